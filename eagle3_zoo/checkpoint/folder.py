"""The canonical drafter folder a run (or `eagle3-zoo consolidate`) leaves behind, written safely.

    output_dir/drafter/config.json          # the kind's own layout (EAGLE-3: canonical SGLang/official)
    output_dir/drafter/model.safetensors
    output_dir/drafter/recipe.yaml          # the recipe (overrides applied; `${oc.env:...}` as text, secrets redacted)
    output_dir/drafter/provenance.json      # git SHA, package versions, target, data summary, training summary

The folder is staged in a temp directory and renamed into place, so a crash never leaves a half-written drafter (and a
rerun removes what a killed one staged). Files in an existing folder that the project does not write (e.g. the
`eval_results*.json` of the commands in docs/performance.md) are carried over into the new folder: a rerun replaces only
what it owns. The staged folder passes the checks of `eagle3-zoo check` before it replaces anything: no command writes a
drafter that `check`, `export` or `eval` would refuse.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.check import require_valid_stage
from eagle3_zoo.modeling.config import ARCHITECTURE
from eagle3_zoo.util.fileio import atomic_write_text, recover_replaced_directory, replace_directory, staged_directory
from eagle3_zoo.util.provenance import provenance_json
from eagle3_zoo.util.redaction import redact_data

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import Recipe


def _finish_tree(directory: Path) -> None:
    """fsync every file and give the folder ordinary permissions (temp files and dirs are created private)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        f.chmod(0o666 & ~umask)
    directory.chmod(0o777 & ~umask)


def _carry_over(old_dir: Path, staged: Path) -> None:
    """Hard-link (or copy) into `staged` every entry of `old_dir` that the new folder does not write itself."""
    for entry in old_dir.iterdir():
        dest = staged / entry.name
        if dest.exists() or entry.name.startswith("."):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, dest)


def _link_or_copy(src: Any, dest: Any) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dest)
        return
    try:
        os.link(src, dest)  # no copy of a large file; the old folder keeps its own link until it is removed
    except OSError:
        shutil.copy2(src, dest)


def is_drafter_folder(path: Path) -> bool:
    """Whether `path` holds a drafter's config.json (an EAGLE-3 drafter in a layout eagle3-zoo reads: canonical,
    official or speculators), not a target's or anything else's."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (raw.get("speculators_model_type") == "eagle3" or "draft_vocab_size" in raw
                                      or ARCHITECTURE in (raw.get("architectures") or []))


def drafter_out_dir(out_dir: str | Path, force: bool = False, force_option: str | None = None) -> Path:
    """`out_dir` as an absolute path that may be replaced by a drafter folder.

    `force`: an existing folder that is not a drafter folder may be written too (files of other names are kept);
    `force_option`: the caller's option that does so, named in the refusal.

    Raises:
        ValueError: it names no folder (`.`, `/`), holds the current directory, or is an existing folder that is not
            a drafter folder (no drafter's config.json): replacing it would delete or mix up what it holds.
    """
    path = Path(os.path.abspath(out_dir))
    if not path.name or Path.cwd() == path or path in Path.cwd().parents:
        raise ValueError(f"drafter folder '{out_dir}' is {path}, which holds the current directory; the folder is "
                         "replaced when it is written: name a new folder, e.g. ./drafter")
    if not force and path.is_dir() and any(path.iterdir()) and not is_drafter_folder(path):
        what = "its config.json is not a drafter's" if (path / "config.json").exists() else "no config.json"
        forced = f", or pass {force_option} to write the drafter into it anyway (its files of other names are kept)" \
            if force_option else ""
        raise ValueError(f"{path} exists and is not a drafter folder ({what}); it would be replaced: name a new "
                         f"folder, or the drafter folder to rewrite{forced}")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; a drafter is written as a folder: name a new folder")
    return path


def _save_recipe(recipe: Recipe | dict[str, Any], path: Path) -> None:
    """recipe.yaml: a typed recipe as artefacts hold it (`recipe.recipe_to_dict`), a plain dict (read from a
    checkpoint) as data: any `${...}` in it stays literal text, never resolved (it could name an environment
    variable holding a token); secrets redacted in both."""
    from eagle3_zoo.recipe.sections import save_resolved_recipe

    if isinstance(recipe, dict):
        from omegaconf import OmegaConf

        atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(redact_data(recipe)), resolve=False))
    else:
        save_resolved_recipe(recipe, path)


def write_drafter_folder(drafter: Any, out_dir: str | Path, recipe: Recipe | dict[str, Any],
                         provenance: dict[str, Any], kind: Any = None) -> Path:
    """Stage `drafter` + recipe.yaml + provenance.json in a temp dir with the files of an existing `out_dir` that the
    project does not own, check it, then rename it to `out_dir` (replacing it).

    `recipe`: a typed recipe (written resolved) or a plain dict read from a checkpoint (written as it is). `kind`: the
    drafter's `DrafterKind` (default EAGLE-3's path); a kind with no registered layout writes the folder with its
    `save` and checks it with its `check_folder`.

    Raises:
        ValueError: `out_dir` may not be replaced (`drafter_out_dir`).
        InvalidDrafterError: the staged folder fails `eagle3-zoo check` (NaN weights, a bad vocab map): nothing is
            replaced.
        DiskFullError: the disk (or the file-size limit) is full; nothing is replaced.
    """
    out_dir = drafter_out_dir(out_dir)
    with staged_directory(out_dir) as tmp:
        recover_replaced_directory(out_dir)  # a replacement cut short: its user files are carried over below
        own = kind is not None and not kind.layouts  # written and checked by its kind
        kind.save(drafter, tmp) if own else drafter.save_pretrained(tmp)
        _save_recipe(recipe, tmp / "recipe.yaml")
        (tmp / "provenance.json").write_text(provenance_json(provenance))
        if own:
            problems = kind.check_folder(tmp)
            if problems:
                raise ValueError(f"{out_dir}: refusing to write an invalid {kind.name} drafter: {'; '.join(problems)}")
        else:
            require_valid_stage(tmp, out_dir)
        replace_with_stage(tmp, out_dir)
    return out_dir


def replace_with_stage(staged: Path, out_dir: Path) -> None:
    """Make the checked folder `staged` the folder `out_dir` in one rename (`replace_directory`): its files fsynced
    and given ordinary permissions, and the entries of an existing `out_dir` that it does not hold carried over, so
    that `out_dir` holds either its old files or all the new ones, never a mix, whenever the writer is killed."""
    _finish_tree(staged)
    if out_dir.exists():
        _carry_over(out_dir, staged)
    replace_directory(staged, out_dir)
