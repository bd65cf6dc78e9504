"""Pull a drafter from the Hub (or the zoo): download, detect its format, check it against the target, convert;
and `load_any_drafter`, a drafter from a local folder, a Hub repo or a zoo name.

    result = pull("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", target="meta-llama/Llama-3.1-8B-Instruct",
                  convert_to="sglang", out_dir="drafters/llama31")
    print(result.report)          # problems found, each with its fix
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.convert import import_drafter
from eagle3_zoo.checkpoint.layouts import detect_layout
from eagle3_zoo.checkpoint.opened import OpenedDrafter
from eagle3_zoo.hub.endpoint import HubUnreachableError, hub_url, require_reachable, resolve_endpoint, unreachable_error
from eagle3_zoo.hub.zoo import find_zoo, resolve_repo_id, zoo_hint
from eagle3_zoo.values import layout_names

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
        convert_to: a written layout, "sglang" (alias "canonical") or "speculators": write a converted copy.
        out_dir: download into this folder (default: the Hugging Face cache); the converted copy goes to
            `<out_dir>/<format>` (default: `./<repo name>-<format>`).
        endpoint: Hub URL (default: `HF_ENDPOINT` or huggingface.co).
        token: Hub token for private/gated repos (default: huggingface_hub's usual sources).
        cache_dir: Hugging Face cache folder when `out_dir` is not given.

    Returns:
        A `PullResult`; `result.report.ok` is False when the check found errors (the files are still there, and
        nothing is converted).

    Raises:
        ValueError: unknown `convert_to`, a zoo entry that is not published, or a name that is neither a zoo name
            nor a repo on the endpoint (with the closest zoo names).
        HubUnreachableError: the endpoint does not answer and no downloaded copy exists.
    """
    written = layout_names.export_names()
    if convert_to is not None and convert_to not in written:
        raise ValueError(f"unknown convert_to={convert_to!r}; valid: {', '.join(written)}")
    repo_id = resolve_repo_id(repo_id_or_zoo_name)
    path = _download(repo_id_or_zoo_name, repo_id, revision=revision, endpoint=endpoint, token=token,
                     local_dir=str(out_dir) if out_dir is not None else None,
                     cache_dir=str(cache_dir) if cache_dir is not None else None)
    layout = detect_layout(path)
    fmt = layout.name
    folder = OpenedDrafter.open(path)  # the weights read once for the check and the conversion
    report = folder.check(target)
    entry = find_zoo(repo_id_or_zoo_name)
    if entry is not None and entry.kind != layout.kind:
        report.add("ZOO_KIND_MISMATCH", f"{path}: the zoo lists {entry.name} as a {entry.kind} drafter ({entry.format} "
                   f"layout), but the download is a {layout.kind} drafter folder ({fmt} layout)",
                   "check the repository (it may have been replaced), or fix the zoo entry's kind and format")
    log.info("pulled %s (%s format) into %s: %d error(s), %d warning(s)", repo_id, fmt, path, len(report.errors),
             len(report.warnings))
    converted = None
    if convert_to is not None and not report.ok:
        log.warning("%s: not converted to %s: the check found errors (see the report)", path, convert_to)
    elif convert_to is not None:
        written_as = layout_names.export_names(layout.kind).get(convert_to, written[convert_to])  # of this kind
        name = f"{repo_id.split('/')[-1]}-{written_as}"
        dest = Path(out_dir) / written_as if out_dir is not None else Path.cwd() / name
        # a zoo entry names the target, which the speculators layout records (z-lab's DFlash configs do not)
        verifier = entry.target if entry is not None and layout.kind == "dflash" else None
        converted = folder.export(dest, convert_to, verifier=verifier)
    return PullResult(repo_id, path, fmt, report, converted)


def _download(name: str, repo_id: str, *, revision: str | None, endpoint: str | None, **kwargs) -> Path:
    """`snapshot_download` of a drafter's files; failures become one line saying what `name` is not.

    The endpoint is probed first (a few seconds at most): unreachable, a copy downloaded before is used if there is
    one, else the error names the endpoint instead of surfacing after the client's retries.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    url = hub_url(endpoint)
    entry = find_zoo(name)
    what = f"zoo entry {entry.name!r} ({repo_id})" if entry else f"{name!r}"
    download = dict(revision=revision, endpoint=resolve_endpoint(endpoint), allow_patterns=DRAFTER_PATTERNS, **kwargs)
    try:
        if not constants.HF_HUB_OFFLINE:
            try:
                require_reachable(endpoint)
            except HubUnreachableError as unreachable:
                try:
                    path = snapshot_download(repo_id, local_files_only=True, **download)
                except LocalEntryNotFoundError:
                    raise unreachable from None
                log.warning("%s; using the copy downloaded before: %s", unreachable, path)
                return Path(path)
        return Path(snapshot_download(repo_id, **download))
    except RevisionNotFoundError:
        raise ValueError(f"{what}: no revision {revision!r} on {url}") from None
    except RepositoryNotFoundError:  # also private or gated repos without access
        found = f"no repo {repo_id} on {url} (if it is private or gated: `hf auth login` or set HF_TOKEN)"
        if entry:
            raise ValueError(f"{what}: {found}") from None
        raise ValueError(f"{what} is neither a known zoo name ({zoo_hint(name, list_all=False)}) nor a repo id on "
                         f"the Hub: {found}") from None
    except (HubUnreachableError, LocalEntryNotFoundError) as e:
        cause = e if isinstance(e, HubUnreachableError) else unreachable_error(url, e.__cause__ or e)
        if entry:
            raise HubUnreachableError(f"cannot download {what}: {cause}") from None
        raise HubUnreachableError(f"{what} is neither a known zoo name ({zoo_hint(name, list_all=False)}) nor a "
                                  f"reachable repo id: {cause}") from None


def load_any_drafter(
    path_or_repo: str | Path, revision: str | None = None, endpoint: str | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A drafter of any registered kind (`import_drafter`) from a local folder (any layout), a Hub repo id or a zoo
    name; for `drafter.init_from`.

    Hub repos are downloaded with `pull` (snapshot_download) and imported; nothing is executed from them.
    """
    if Path(path_or_repo).is_dir():
        return import_drafter(path_or_repo, dtype=dtype)
    if str(path_or_repo).startswith(("/", ".", "~")):
        raise FileNotFoundError(f"{path_or_repo}: no such drafter folder")
    return import_drafter(pull(str(path_or_repo), revision=revision, endpoint=endpoint).path, dtype=dtype)

