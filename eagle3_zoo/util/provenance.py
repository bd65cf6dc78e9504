"""Provenance: what a run or a measurement ran on and which code it was. The git state of the checkout, the versions
of the packages (`PACKAGES`, for a drafter's provenance.json; `versions`, of `RESULTS_PACKAGES` among them, for an
evaluation's results), the machine (processor or GPU, threads, load average) and provenance.json's strict-JSON text.
Used by training (provenance.json, the run's machine record), evaluation (the results JSON) and the drafter-folder
writer."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.util.redaction import redact_data

PACKAGES = ("eagle3-zoo", "torch", "lightning", "transformers", "torchmetrics", "safetensors", "omegaconf", "peft")
RESULTS_PACKAGES = ("eagle3-zoo", "torch", "transformers")  # of `PACKAGES`, those an evaluation's results name


def git_info(path: str | Path | None = None) -> dict[str, Any] | None:
    """`{"sha", "dirty"}` of the git checkout holding `path` (default: this package), or None outside git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": sha, "dirty": bool(status.strip())}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def json_safe(value: Any) -> Any:
    """`value` with every NaN/Inf float replaced by None (JSON has no such numbers; `json.dumps` would write bare
    `NaN`, which strict readers reject)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def provenance_json(provenance: dict[str, Any]) -> str:
    """provenance.json's text: strict JSON (non-finite numbers as null, anything else unknown as its string), the
    run's secrets redacted (`eagle3_zoo.util.redaction`)."""
    plain = json.loads(json.dumps(provenance, default=str))  # non-JSON types (paths, dtypes) -> str first
    return json.dumps(json_safe(redact_data(plain)), indent=2, allow_nan=False) + "\n"


def load_average() -> list[float] | None:
    """The machine's load average over 1, 5 and 15 minutes (None where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info(device: torch.device | str = "cpu", load_at_start: list[float] | None = None) -> dict[str, Any]:
    """What a measurement ran on: processor (or GPU), cores, torch threads, and the load average at the start of
    the run (`load_at_start`) and now, so that speeds can be read next to how busy the machine was."""
    device = torch.device(device)
    info = {"platform": platform.platform(), "processor": _cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if load_at_start is not None:
        info["load_average"] = {"start": load_at_start, "end": load_average()}
    return info


def _cpu_name() -> str:
    try:  # Linux names the CPU model here; platform.processor() is often empty or just the architecture
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, Any]:
    """The versions of `RESULTS_PACKAGES` (by module name, e.g. ``eagle3_zoo``: the ``__version__`` of the code that
    runs), Python's, and the git commit of the code (``{"sha", "dirty"}``; None outside a git checkout), so a figure
    can name the commit it ran on."""
    modules = [importlib.import_module(name.replace("-", "_")) for name in RESULTS_PACKAGES]
    return {**{module.__name__: module.__version__ for module in modules}, "python": sys.version.split()[0],
            "git": git_info()}
