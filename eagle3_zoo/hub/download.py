"""Pull a drafter from the Hub (or the zoo): download, detect its format, check it against the target, convert.

    result = pull("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", target="meta-llama/Llama-3.1-8B-Instruct",
                  convert_to="sglang", out_dir="drafters/llama31")
    print(result.report)          # problems found, each with its fix
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_zoo.hub.check import CheckReport, check_drafter
from eagle3_zoo.hub.convert import export_drafter
from eagle3_zoo.hub.formats import EXPORT_FORMATS, detect_format
from eagle3_zoo.hub.upload import resolve_endpoint
from eagle3_zoo.hub.zoo import resolve_repo_id

log = logging.getLogger(__name__)

# only what a drafter folder can hold; a repo's other files (e.g. a stray full model) are not downloaded
DRAFTER_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.yaml", "*.md", "*.png"]


@dataclass
class PullResult:
    """Where the drafter landed, its format, the check report and the converted copy (if asked for)."""

    repo_id: str
    path: Path
    format: str
    report: CheckReport
    converted_path: Path | None = None


def pull(
    repo_id_or_zoo_name: str,
    revision: str | None = None,
    target: Any = None,
    convert_to: str | None = None,
    out_dir: str | Path | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: str | Path | None = None,
) -> PullResult:
    """Download a drafter with `snapshot_download`, detect its format, check it and optionally convert it.

    Args:
        repo_id_or_zoo_name: a Hub repo id or a zoo name (`eagle3-zoo zoo list`).
        revision: branch, tag or commit.
        target: target to check against: a Hub id / local folder (its config.json is read with
            `AutoConfig.from_pretrained(..., trust_remote_code=False)`), a config object or a dict. None = static check.
        convert_to: "sglang" (alias "canonical") or "speculators": write a converted copy.
        out_dir: download into this folder (default: the Hugging Face cache); the converted copy goes to
            `<out_dir>/<format>` (default: `./<repo name>-<format>`).
        endpoint: Hub URL (default: `HF_ENDPOINT` or huggingface.co).
        token: Hub token for private/gated repos (default: huggingface_hub's usual sources).
        cache_dir: Hugging Face cache folder when `out_dir` is not given.

    Returns:
        A `PullResult`; `result.report.ok` is False when the check found errors (the files are still there).

    Raises:
        ValueError: unknown `convert_to`, or a zoo entry that is not published.
    """
    if convert_to is not None and convert_to not in EXPORT_FORMATS:
        raise ValueError(f"unknown convert_to={convert_to!r}; valid: {', '.join(EXPORT_FORMATS)}")
    repo_id = resolve_repo_id(repo_id_or_zoo_name)
    from huggingface_hub import snapshot_download

    path = Path(snapshot_download(
        repo_id, revision=revision, endpoint=resolve_endpoint(endpoint), token=token,
        local_dir=str(out_dir) if out_dir is not None else None,
        cache_dir=str(cache_dir) if cache_dir is not None else None, allow_patterns=DRAFTER_PATTERNS,
    ))
    fmt = detect_format(path)
    report = check_drafter(path, target_config=target)
    log.info("pulled %s (%s format) into %s: %d error(s), %d warning(s)", repo_id, fmt, path, len(report.errors),
             len(report.warnings))
    converted = None
    if convert_to is not None:
        name = f"{repo_id.split('/')[-1]}-{EXPORT_FORMATS[convert_to]}"
        dest = Path(out_dir) / EXPORT_FORMATS[convert_to] if out_dir is not None else Path.cwd() / name
        converted = export_drafter(path, convert_to, dest)
    return PullResult(repo_id, path, fmt, report, converted)
