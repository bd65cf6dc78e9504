"""Publish a drafter to the Hugging Face Hub: check, stage a folder, create the repo and upload it in one commit.

    publish("runs/smollm2_135m/drafter", "me/smollm2-135m-eagle3", dry_run=True)   # stages only, no request

The token comes from huggingface_hub's usual sources (`token=`, `HF_TOKEN`, the cached `hf auth login`); it is only
ever passed to `HfApi`, never written to the staged folder, the card or a log. Before anything is uploaded
(`--dry-run` included) the drafter folder's recipe, provenance and results and then every staged file are scanned
for every secret the process knows (`eagle3_zoo.util.redaction`: the Hub token, the engine and regeneration keys, a
server argument's key, URL credentials): one found refuses the publish (`TokenLeakError`) rather than uploading a
redacted copy, so that a folder holding a key is noticed (and the key replaced) before it is shared. A failed
publish removes what it staged (its temporary stage, or the files it put into `--stage-dir`).

With no network, publishing fails within `eagle3_zoo.hub.endpoint.PROBE_TIMEOUT_S` seconds with one line naming the
endpoint (a `HubUnreachableError`) instead of an HTTP client traceback after the client's own retries and timeouts.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import eagle3_zoo
from eagle3_zoo.checkpoint.check import require_valid_drafter
from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.folder import drafter_out_dir, is_drafter_folder
from eagle3_zoo.checkpoint.formats import extra_candidates
from eagle3_zoo.checkpoint.layouts import detect_format, load_drafter_config
from eagle3_zoo.checkpoint.opened import OpenedDrafter
from eagle3_zoo.hub.card import render_card
from eagle3_zoo.hub.endpoint import is_transport_error, require_reachable, resolve_endpoint, unreachable_error
from eagle3_zoo.modeling import CONFIG_NAME
from eagle3_zoo.util.fileio import atomic_write
from eagle3_zoo.util.redaction import find_secret, register, register_document

log = logging.getLogger(__name__)

class TokenLeakError(RuntimeError):
    """A secret (the Hub token, an engine key...) was found in the drafter folder or a staged file; nothing was
    uploaded."""


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


def check_repo_id(repo_id: str) -> None:
    """The repo-id check the Hub client applies on upload, run locally first (so `--dry-run` applies it too).

    Raises:
        ValueError: not ORG/NAME of letters, digits, '-', '_' and '.' (huggingface_hub's `validate_repo_id`).
    """
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
        if "/" not in repo_id:  # the Hub would put it under the token's user; the card's snippets need the full id
            raise ValueError("no ORG/ namespace")
    except ValueError as e:
        raise ValueError(f"--repo-id {repo_id!r} is not a Hub repo id ({e}); expected ORG/NAME of letters, digits, "
                         "'-', '_' and '.', e.g. my-org/smollm2-135m-eagle3") from None


def stage(drafter_dir: str | Path | OpenedDrafter, stage_dir: str | Path, repo_id: str | None = None,
          fmt: str | None = None, published: bool = False, force: bool = False,
          **card_overrides) -> list[str]:
    """Write the folder to upload: weights + config in `fmt`, README.md card, plots, recipe, results, provenance.

    `drafter_dir`: the drafter folder, or that folder opened (`OpenedDrafter`: its weights are not read again).

    `published`: the folder goes to `repo_id` (the card's snippets name it); otherwise they name the staged folder.
    `force`: stage into a folder that is not empty (its files of other names are kept, and listed as staged).

    Raises:
        ValueError: `stage_dir` exists and is not empty (stale files would be uploaded too), without `force`.
    """
    out = Path(stage_dir)
    if not force and out.exists() and any(out.iterdir()):
        raise ValueError(f"stage folder {out} is not empty; pass an empty or new folder")
    source = drafter_dir if isinstance(drafter_dir, OpenedDrafter) else OpenedDrafter.open(drafter_dir)
    source.export(out, fmt, force=force)
    layout = detect_format(out)  # the layout written: `fmt` of the drafter's kind (`speculators` of DFlash, ...)
    card = render_card(out, repo_id=repo_id, fmt=layout, published=published, **card_overrides)
    atomic_write(out / "README.md", card.save)  # a killed stage never leaves a truncated card
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _scan_for_secrets(paths: list[Path], where: Callable[[Path], str], drafter_dir: str | Path) -> None:
    """Refuse when a file holds a secret the process knows (`eagle3_zoo.util.redaction.find_secret`, never the
    value)."""
    for path in paths:
        if path.is_file() and (what := find_secret(path.read_bytes())):
            raise TokenLeakError(f"{where(path)} contains {what}; refusing to publish. Remove it from the files of "
                                 f"{drafter_dir} (recipe.yaml / provenance.json, whose paths and values the model card "
                                 "shows; a key goes in an environment variable named by engine.api_key_env) and "
                                 "publish again")


def is_staged_folder(path: Path) -> bool:
    """Whether `path` is a folder an earlier `publish` staged: a drafter folder with the model card publish renders
    (README.md whose metadata names eagle3-zoo as its library)."""
    try:
        card = (path / "README.md").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    header = card.split("---", 2)[1] if card.startswith("---") and card.count("---") >= 2 else ""
    return is_drafter_folder(path) and "library_name: eagle3-zoo" in header


def stage_destination(stage_dir: str | Path, drafter_dir: str | Path, force: bool = False) -> tuple[Path, bool]:
    """`--stage-dir` as a folder publish may stage into, and whether it holds an earlier stage (to be emptied first:
    its stale files would be uploaded too). New, empty and earlier stages are taken; any other non-empty folder only
    with `force` (its files of other names are kept, and uploaded with the stage), as `export --out` does.

    Raises:
        ValueError: it is (or holds) the drafter folder, holds the current directory, is a file, or is a non-empty
            folder that no publish staged (without `force`).
    """
    out, src = Path(os.path.abspath(stage_dir)), Path(os.path.abspath(drafter_dir))
    if out == src or out in src.parents:
        raise ValueError(f"stage folder {stage_dir} {'is' if out == src else 'holds'} the drafter folder {drafter_dir};"
                         " staging would replace it: name a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        if is_staged_folder(out):
            return out, True
        if is_drafter_folder(out) and not force:
            raise ValueError(f"stage folder {out} is a drafter folder that publish did not stage (no eagle3-zoo model "
                             "card); staging would overwrite its files: name a new or empty folder, or pass --force "
                             "to stage into it anyway (its files of other names are kept and uploaded too)")
    # a folder that is no drafter folder: export's refusal, which names --force (same wording for both commands)
    return drafter_out_dir(out, force=force, force_option="--force"), False


def _remove_stage(out: Path, temporary: bool, existed: bool = True, keep: frozenset[str] = frozenset()) -> None:
    """Undo a stage: the temporary folder, or what was staged into the caller's folder (the names in `keep` were
    there before and stay), and that folder itself if the publish created it."""
    if temporary:
        shutil.rmtree(out.parent, ignore_errors=True)  # the temporary root holding the stage
        return
    for path in out.iterdir() if out.is_dir() else ():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if not existed and out.is_dir():
        out.rmdir()


def publish(
    drafter_dir: str | Path,
    repo_id: str,
    private: bool = False,
    create_pr: bool = False,
    dry_run: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    stage_dir: str | Path | None = None,
    fmt: str | None = None,
    commit_message: str | None = None,
    force: bool = False,
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
        stage_dir: where to stage (default: a new temporary folder, removed after a successful upload): a new or
            empty folder, or one an earlier publish staged (replaced); `stage_destination`.
        fmt: "sglang" (canonical; SGLang and vLLM load it), "speculators" (vLLM's format) or another written layout
            (`eagle3_zoo.values.layout_names.export_choices()`); None: the drafter kind's default ("sglang" for EAGLE-3,
            "dflash" for DFlash; `speculators` of a DFlash drafter is `speculators-dflash`).
        commit_message: default names the target and the eagle3-zoo version.
        force: stage into a non-empty `stage_dir` that no publish staged (its files of other names are kept and
            uploaded too).
        card_overrides: passed to `render_card` (e.g. `license`, `tags`).

    Raises:
        ValueError: `repo_id` is not ORG/NAME (checked before anything else, dry run included), no token is found
            for a real publish, or `stage_dir` is refused (`stage_destination`).
        DrafterCheckError: the static check found errors (nothing staged or sent).
        TokenLeakError: a known secret (the Hub token, an engine key...) appears in the drafter folder or a staged
            file (nothing sent; the staged files are removed).
        HubUnreachableError: the endpoint does not answer (within `endpoint.PROBE_TIMEOUT_S` seconds).
    """
    from huggingface_hub import get_token

    check_repo_id(repo_id)
    if not dry_run and not (token or get_token()):  # before anything is staged: say how to log in
        raise ValueError("no Hugging Face token: log in with `hf auth login` or set HF_TOKEN to a token with write "
                         f"access to {repo_id.split('/')[0]} (`--dry-run` stages the folder without one)")
    if token:
        register(token, "the Hub token")
    source = OpenedDrafter.open(drafter_dir)  # its weights read once for the check and the export
    report = source.require_valid(purpose="publish")  # its warnings are logged by the export
    from eagle3_zoo.checkpoint.check import recipe_file_problem

    if problem := recipe_file_problem(drafter_dir):  # the card shows the recipe: say so before staging anything
        raise ValueError(f"{problem}: the model card shows the recipe; fix or remove recipe.yaml")
    # before staging: the export would write the folder's files redacted, and the folder itself must be fixed
    src = Path(drafter_dir)
    sources = [src / CONFIG_NAME, *extra_candidates(src)]
    for path in sources:  # what the folder itself names a secret: its recipe's key arguments, URL credentials
        if path.suffix in (".yaml", ".json") and path.is_file():
            register_document(path.read_text(encoding="utf-8", errors="replace"), path.suffix)
    _scan_for_secrets(sources, lambda p: f"{p.name} of {src}", drafter_dir)
    temporary = stage_dir is None
    # a temporary stage is a folder in a temporary root, which also holds what staging keeps next to the stage
    if temporary:
        out, earlier = Path(tempfile.mkdtemp(prefix="eagle3-zoo-publish-")) / repo_id.split("/")[-1], False
    else:  # before the cleanup below could touch its files
        out, earlier = stage_destination(stage_dir, drafter_dir, force=force)
    if earlier:  # an earlier stage is replaced whole: none of its files may be uploaded with this one
        log.info("replacing the earlier stage in %s", out)
        _remove_stage(out, temporary=False)
    existed = out.exists()
    kept = frozenset(p.name for p in out.iterdir()) if out.is_dir() else frozenset()  # --force: the folder's own

    try:
        files = stage(source, out, repo_id=repo_id, fmt=fmt, published=not dry_run, force=force,
                      **card_overrides)
        require_valid_drafter(out, purpose="publish")  # what is uploaded, not only its source, must load
        # a dry run stages what would be uploaded: same scan
        _scan_for_secrets(sorted(out.rglob("*")), lambda p: f"staged {p.relative_to(out)}", drafter_dir)
        if dry_run:
            log.debug("dry run: staged %d files in %s for %s; no request was made", len(files), out, repo_id)
            return PublishResult(repo_id, out, True, files, report)
        result = _upload(out, drafter_dir, repo_id, files, report, private=private, create_pr=create_pr,
                         token=token, endpoint=endpoint, commit_message=commit_message)
    except BaseException:
        # a failed publish leaves nothing: no temporary stage, nothing staged in --stage-dir (a truncated file of a
        # full disk, a staged token, a folder that a retry would refuse as not empty)
        _remove_stage(out, temporary, existed, keep=kept)
        raise
    if temporary:
        _remove_stage(out, temporary)
        result.stage_dir = None
    return result


def _upload(out: Path, drafter_dir: str | Path, repo_id: str, files: list[str], report: CheckReport, *,
            private: bool, create_pr: bool, token: str | None, endpoint: str | None,
            commit_message: str | None) -> PublishResult:
    """Create the repo and upload the staged folder in one commit; a lost connection becomes one line."""
    from huggingface_hub import HfApi

    url = require_reachable(endpoint)
    cfg, _ = load_drafter_config(drafter_dir)
    message = commit_message or (f"EAGLE-3 drafter for {cfg.target_name_or_path or 'its target'} "
                                 f"(eagle3-zoo {eagle3_zoo.__version__})")
    api = HfApi(endpoint=resolve_endpoint(endpoint), token=token)
    try:
        repo_url = api.create_repo(repo_id, exist_ok=True, private=private)
        commit = api.upload_folder(repo_id=repo_id, folder_path=out, commit_message=message, create_pr=create_pr)
    except Exception as e:
        if is_transport_error(e):  # the connection dropped after the probe
            raise unreachable_error(url, e) from e
        raise
    log.debug("published %s: %s", repo_id, commit.commit_url)  # the CLI prints it
    return PublishResult(repo_id, out, False, files, report, repo_url=str(repo_url), commit_url=commit.commit_url,
                         pr_url=commit.pr_url)
