"""What a finished run leaves behind: the canonical drafter folder with its resolved recipe and provenance.

    output_dir/drafter/config.json          # canonical SGLang/official layout (Eagle3Drafter.save_pretrained)
    output_dir/drafter/model.safetensors
    output_dir/drafter/recipe.yaml          # the resolved recipe (overrides applied)
    output_dir/drafter/provenance.json      # git SHA, package versions, target, data summary, training summary

The folder is staged in a temp directory and renamed into place, so a crash never leaves a half-written drafter
(and a rerun removes what a killed one staged). Files in an existing folder that the project does not write (e.g.
the `eval_results*.json` of README's commands) are carried over into the new folder: a rerun replaces only what it
owns. The staged folder passes the checks of `eagle3-zoo check` before it replaces anything: no command writes a
drafter that `check`, `export` or `eval` would refuse.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.fileio import pickle_refusal, recover_replaced_directory, replace_directory, staged_directory
from eagle3_zoo.modeling import Eagle3Drafter

PACKAGES = ("eagle3-zoo", "torch", "lightning", "transformers", "torchmetrics", "safetensors", "omegaconf", "peft")


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


def build_provenance(*, recipe_dict: dict[str, Any], target: dict[str, Any], data: dict[str, Any],
                     training: dict[str, Any], drafter: Eagle3Drafter,
                     git: dict[str, Any] | None = None) -> dict[str, Any]:
    """provenance.json. `git`: the checkout state when the run *started* (default: now); a long run must pass it,
    since commits made while it trains are not the code it ran."""
    cfg = drafter.config
    return {
        "created_unix": int(time.time()),
        "git": git if git is not None else git_info(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "target": target,
        "drafter": {"aux_layer_ids": list(cfg.aux_layer_ids or ()), "draft_vocab_size": cfg.draft_vocab_size,
                    "hidden_size": cfg.hidden_size, "num_parameters": sum(p.numel() for p in drafter.parameters())},
        "data": data,
        "training": training,
        "recipe": recipe_dict,
    }


def _finish_tree(directory: Path) -> None:
    """fsync every file and give the folder ordinary permissions (temp files and dirs are created private)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        f.chmod(0o666 & ~umask)
    directory.chmod(0o777 & ~umask)


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
    """provenance.json's text: strict JSON (non-finite numbers as null, anything else unknown as its string)."""
    plain = json.loads(json.dumps(provenance, default=str))  # non-JSON types (paths, dtypes) -> str first
    return json.dumps(json_safe(plain), indent=2, allow_nan=False) + "\n"


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


def drafter_out_dir(out_dir: str | Path) -> Path:
    """`out_dir` as an absolute path that may be replaced by a drafter folder.

    Raises:
        ValueError: it names no folder (`.`, `/`), holds the current directory, or is an existing folder that is not
            a drafter folder (no config.json): replacing it would delete what it holds.
    """
    path = Path(os.path.abspath(out_dir))
    if not path.name or Path.cwd() == path or path in Path.cwd().parents:
        raise ValueError(f"drafter folder '{out_dir}' is {path}, which holds the current directory; the folder is "
                         "replaced when it is written: name a new folder, e.g. ./drafter")
    if path.is_dir() and any(path.iterdir()) and not (path / "config.json").exists():
        raise ValueError(f"{path} exists and is not a drafter folder (no config.json); it would be replaced: name a "
                         "new folder, or the drafter folder to rewrite")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; a drafter is written as a folder: name a new folder")
    return path


def _save_recipe(recipe: Any, path: Path) -> None:
    """recipe.yaml: a typed recipe resolved (the run's own), a plain dict (read from a checkpoint) as data: any
    `${...}` in it stays literal text, never resolved (it could name an environment variable holding a token)."""
    from eagle3_zoo.fileio import atomic_write_text
    from eagle3_zoo.recipe import save_resolved_recipe

    if isinstance(recipe, dict):
        from omegaconf import OmegaConf

        atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(recipe), resolve=False))
    else:
        save_resolved_recipe(recipe, path)


def write_drafter_folder(drafter: Eagle3Drafter, out_dir: str | Path, recipe: Any,
                         provenance: dict[str, Any]) -> Path:
    """Stage `drafter` + recipe.yaml + provenance.json in a temp dir with the files of an existing `out_dir` that the
    project does not own, check it, then rename it to `out_dir` (replacing it).

    `recipe`: a typed recipe (written resolved) or a plain dict read from a checkpoint (written as it is).

    Raises:
        ValueError: `out_dir` may not be replaced (`drafter_out_dir`).
        InvalidDrafterError: the staged folder fails `eagle3-zoo check` (NaN weights, a bad vocab map): nothing is
            replaced.
        DiskFullError: the disk (or the file-size limit) is full; nothing is replaced.
    """
    out_dir = drafter_out_dir(out_dir)
    with staged_directory(out_dir) as tmp:
        recover_replaced_directory(out_dir)  # a replacement cut short: its user files are carried over below
        drafter.save_pretrained(tmp)
        _save_recipe(recipe, tmp / "recipe.yaml")
        (tmp / "provenance.json").write_text(provenance_json(provenance))
        _finish_tree(tmp)
        from eagle3_zoo.hub.check import require_valid_stage

        require_valid_stage(tmp, out_dir)
        if out_dir.exists():
            _carry_over(out_dir, tmp)
        replace_directory(tmp, out_dir)
    return out_dir


def drafter_from_state(config: Any, state: dict[str, torch.Tensor],
                       fc_input_scale: torch.Tensor | None = None) -> Eagle3Drafter:
    """The drafter to write (fp32, CPU) from a full state dict of its weights; a training-time fc preconditioning
    scale is folded into fc.weight."""
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(state)
    drafter = drafter.to(torch.float32)
    if fc_input_scale is not None:
        drafter.set_fc_input_scale(fc_input_scale.detach().cpu().float())
        drafter.fold_fc_input_scale()
    return drafter


def full_drafter(module: Any) -> Eagle3Drafter | None:
    """A plain (unsharded, CPU, fp32) copy of the trained drafter. Under FSDP the full weights are gathered onto
    rank 0 only, shard by shard (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`); every rank must
    call it, and the others get None."""
    from torch.distributed.tensor import DTensor

    src = module.drafter
    if any(isinstance(p, DTensor) for p in src.parameters()):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(src, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
    else:
        state = src.state_dict()
    # a one-rank mesh hands back its (complete) DTensors as they are
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}
    return drafter_from_state(src.config, state, src.fc_input_scale if src._fc_scaled else None)


DRAFTER_INFO_KEY = "eagle3_zoo_drafter"
"""Checkpoint entry with what `consolidate_checkpoint` needs besides the weights: the drafter config, its fc
preconditioning scale (not a checkpointed buffer), the resolved recipe, and the provenance known at the start."""
_STATE_PREFIX = "state_dict.objective.drafter."  # DCP keys of the drafter in a Lightning checkpoint of `fit`


def drafter_info(drafter: Eagle3Drafter, recipe_dict: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """The `DRAFTER_INFO_KEY` entry for `drafter` (see there)."""
    return {"config": json.dumps(drafter.config.to_json_dict()), "recipe": json.dumps(recipe_dict, default=str),
            "provenance": provenance_json(provenance),
            "fc_input_scale": drafter.fc_input_scale.detach().cpu().float() if drafter._fc_scaled else None}


class UnreadableCheckpointError(ValueError):
    """A checkpoint whose header torch cannot load (truncated, foreign pickle, not a torch file); `error_type` and
    `first_line` say what torch said. The message names the file that failed (a sharded checkpoint's meta.pt)."""

    def __init__(self, file: Path, cause: BaseException):
        import pickle

        self.error_type = type(cause).__name__
        self.first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else self.error_type
        if isinstance(cause, pickle.UnpicklingError) and "weights_only" in str(cause):
            self.first_line = pickle_refusal(cause)  # never pass on torch's advice to load it unsafely
        super().__init__(f"{file} is not a readable checkpoint ({self.error_type}: {self.first_line})")


def read_checkpoint_header(checkpoint: Path, key: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The header of a Lightning checkpoint of `fit` (a file, or a sharded checkpoint's directory, whose `meta.pt`
    holds everything but the weights and optimizer states) and its entry `key` (None where it has no such dict).

    A file is memory-mapped: only the pickled header is read, not the tensors (a 70B drafter's optimizer state is
    large); its `state_dict` entry stays lazy until used.

    Raises:
        UnreadableCheckpointError: torch cannot load it (`weights_only`: a foreign pickle is refused, never run).
    """
    sharded = checkpoint.is_dir()
    file = checkpoint / "meta.pt" if sharded else checkpoint
    try:
        header = torch.load(file, map_location="cpu", weights_only=True, mmap=not sharded)
    except Exception as e:  # truncated zip, foreign pickle (weights_only refuses it), not a torch file at all
        raise UnreadableCheckpointError(file, e) from None
    header = header if isinstance(header, dict) else {}
    entry = header.get(key)
    return header, entry if isinstance(entry, dict) else None


def consolidate_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the canonical drafter folder (`write_drafter_folder`: the same files a finished run writes) from a
    checkpoint of `fit`: a sharded (DCP) `last.ckpt` directory of an FSDP run, or a single-file checkpoint.

    Runs in one process: DCP reads every rank's shards into full tensors (`no_dist=True`).

    Raises:
        FileNotFoundError: `checkpoint` does not exist.
        ValueError: not a checkpoint written by `fit` (no drafter entry), or unreadable.
    """
    from eagle3_zoo.modeling import Eagle3Config
    from eagle3_zoo.training.checkpoint_io import info_json, sharded_state

    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist (pass a run's checkpoints/last.ckpt)")
    out = Path(os.path.abspath(out_dir))
    if out == checkpoint.resolve() or out in checkpoint.resolve().parents:
        raise ValueError(f"drafter folder {out} holds the checkpoint {checkpoint}; it would be replaced: name a new "
                         "folder, e.g. the run's drafter/")
    out = drafter_out_dir(out)
    meta, info = read_checkpoint_header(checkpoint, DRAFTER_INFO_KEY)
    if info is None:
        raise ValueError(f"{checkpoint} was not written by an eagle3-zoo fit that records its drafter "
                         f"({DRAFTER_INFO_KEY} is missing)")
    config = Eagle3Config.from_json_dict(info_json(info, "config", checkpoint), source=f"{checkpoint} drafter config")
    state = sharded_state(checkpoint, _STATE_PREFIX) if checkpoint.is_dir() else {
        f"state_dict.{k}": v for k, v in (meta.get("state_dict") or {}).items()}
    state = {k.removeprefix(_STATE_PREFIX): v for k, v in state.items() if k.startswith(_STATE_PREFIX)}
    try:
        drafter = drafter_from_state(config, state, info.get("fc_input_scale"))
    except (RuntimeError, TypeError) as e:  # missing / unexpected keys, shapes that do not fit the config
        raise ValueError(f"{checkpoint}: its drafter weights do not fit its drafter config "
                         f"({str(e).strip().splitlines()[0]}...)") from None
    from eagle3_zoo.training.record import RECORD_KEY

    provenance = info_json(info, "provenance", checkpoint)
    record = meta.get(RECORD_KEY) if isinstance(meta.get(RECORD_KEY), dict) else {}  # wall time, epochs, metrics...
    provenance.setdefault("training", {}).update(record, global_step=meta.get("global_step"),
                                                 consolidated_from=str(checkpoint.resolve()))
    return write_drafter_folder(drafter, out, info_json(info, "recipe", checkpoint), provenance)
