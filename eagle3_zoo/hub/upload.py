"""Publish a drafter to the Hugging Face Hub: check, stage a folder, create the repo and upload it in one commit.

    publish("runs/smollm2_135m/drafter", "me/smollm2-135m-eagle3", dry_run=True)   # stages only, no request

The token comes from huggingface_hub's usual sources (`token=`, `HF_TOKEN`, the cached `hf auth login`); it is only
ever passed to `HfApi`, never written to the staged folder, the card or a log, and the staged files are scanned for
it before anything is uploaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import eagle3_zoo
from eagle3_zoo.hub.card import render_card
from eagle3_zoo.hub.check import CheckReport, check_drafter
from eagle3_zoo.hub.convert import export_drafter
from eagle3_zoo.hub.formats import EXPORT_FORMATS, load_drafter_config

log = logging.getLogger(__name__)


class TokenLeakError(RuntimeError):
    """The Hub token was found in a staged file; nothing was uploaded."""


@dataclass
class PublishResult:
    """What `publish` did. `stage_dir` is None when a temporary stage was removed after the upload."""

    repo_id: str
    stage_dir: Path | None
    dry_run: bool
    files: list[str]
    report: CheckReport
    repo_url: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None


def resolve_endpoint(endpoint: str | None) -> str | None:
    """`endpoint`, else `HF_ENDPOINT` read now (huggingface_hub reads it once, at import time)."""
    return endpoint or os.environ.get("HF_ENDPOINT") or None


def stage(drafter_dir: str | Path, stage_dir: str | Path, repo_id: str | None = None, fmt: str = "sglang",
          **card_overrides) -> list[str]:
    """Write the folder to upload: weights + config in `fmt`, README.md card, plots, recipe, results, provenance.

    Raises:
        ValueError: `stage_dir` exists and is not empty (stale files would be uploaded too).
    """
    out = Path(stage_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"stage folder {out} is not empty; pass an empty or new folder")
    export_drafter(drafter_dir, fmt, out)
    render_card(out, repo_id=repo_id, fmt=EXPORT_FORMATS[fmt], **card_overrides).save(out / "README.md")
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _scan_for_token(folder: Path, token: str | None) -> None:
    if not token:
        return
    needle = token.encode()
    for path in folder.rglob("*"):
        if path.is_file() and needle in path.read_bytes():
            raise TokenLeakError(f"{path}: contains the Hub token; refusing to upload. Remove it from the drafter "
                                 "folder's files (recipe.yaml / provenance.json?) and publish again")


def publish(
    drafter_dir: str | Path,
    repo_id: str,
    private: bool = False,
    create_pr: bool = False,
    dry_run: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    stage_dir: str | Path | None = None,
    fmt: str = "sglang",
    commit_message: str | None = None,
    **card_overrides,
) -> PublishResult:
    """Check a drafter, stage it and push it to the Hub in one commit.

    Args:
        drafter_dir: the drafter folder (any format; usually what training wrote).
        repo_id: "org/name" on the Hub.
        private: create the repo private (ignored if it exists).
        create_pr: open a pull request instead of committing to main.
        dry_run: stage only; no network request at all.
        token: Hub token (default: `HF_TOKEN` / cached login, resolved by huggingface_hub).
        endpoint: Hub URL (default: `HF_ENDPOINT` or huggingface.co).
        stage_dir: where to stage (default: a new temporary folder, removed after a successful upload).
        fmt: "sglang" (canonical; SGLang and vLLM load it) or "speculators" (vLLM's format).
        commit_message: default names the target and the eagle3-zoo version.
        card_overrides: passed to `render_card` (e.g. `license`, `tags`).

    Raises:
        DrafterCheckError: the static check found errors (nothing staged or sent).
        TokenLeakError: the token appears in a staged file (nothing sent).
    """
    report = check_drafter(drafter_dir)
    report.raise_for_errors()
    for problem in report.warnings:
        log.warning("%s", problem)
    temporary = stage_dir is None
    out = Path(tempfile.mkdtemp(prefix="eagle3-zoo-publish-")) if temporary else Path(stage_dir)
    files = stage(drafter_dir, out, repo_id=repo_id, fmt=fmt, **card_overrides)
    check_drafter(out).raise_for_errors()  # what is uploaded, not only its source, must load
    if dry_run:
        log.info("dry run: staged %d files in %s for %s; no request was made", len(files), out, repo_id)
        return PublishResult(repo_id, out, True, files, report)
    from huggingface_hub import HfApi, get_token

    _scan_for_token(out, token or get_token())
    cfg, _ = load_drafter_config(drafter_dir)
    message = commit_message or (f"EAGLE-3 drafter for {cfg.target_name_or_path or 'its target'} "
                                 f"(eagle3-zoo {eagle3_zoo.__version__})")
    api = HfApi(endpoint=resolve_endpoint(endpoint), token=token)
    repo_url = api.create_repo(repo_id, exist_ok=True, private=private)
    commit = api.upload_folder(repo_id=repo_id, folder_path=out, commit_message=message, create_pr=create_pr)
    log.info("published %s: %s", repo_id, commit.commit_url)
    if temporary:
        shutil.rmtree(out, ignore_errors=True)
    return PublishResult(repo_id, None if temporary else out, False, files, report, repo_url=str(repo_url),
                         commit_url=commit.commit_url, pr_url=commit.pr_url)
