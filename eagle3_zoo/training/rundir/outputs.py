"""What a finished run leaves behind: the trained drafter (gathered from its FSDP shards), its provenance.json and
the drafter record a checkpoint carries, written as the canonical drafter folder (`eagle3_zoo.checkpoint.folder`);
and `consolidate_checkpoint`, the same folder from a checkpoint of `fit`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.checkpoint.folder import drafter_out_dir, write_drafter_folder
from eagle3_zoo.checkpoint.layouts import layouts
from eagle3_zoo.drafters import DEFAULT_KIND, get_kind
from eagle3_zoo.training.rundir.checkpoint_io import DRAFTER_INFO_KEY, info_json, read_checkpoint_header, sharded_state
from eagle3_zoo.util.provenance import git_info, package_versions, provenance_json


def drafter_summary(config: Any, num_parameters: int) -> dict[str, Any]:
    """provenance.json's `drafter` entry, for a drafter of `config` with `num_parameters` parameters."""
    return {"aux_layer_ids": list(config.aux_layer_ids or ()), "draft_vocab_size": config.draft_vocab_size,
            "hidden_size": config.hidden_size, "num_parameters": num_parameters}


def build_provenance(*, recipe_dict: dict[str, Any], target: dict[str, Any], data: dict[str, Any],
                     training: dict[str, Any], drafter: dict[str, Any],
                     git: dict[str, Any] | None = None) -> dict[str, Any]:
    """provenance.json. `drafter`: its `drafter_summary`. `git`: the checkout state when the run *started* (default:
    now); a long run must pass it, since commits made while it trains are not the code it ran."""
    return {
        "created_unix": int(time.time()),
        "git": git if git is not None else git_info(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "target": target,
        "drafter": drafter,
        "data": data,
        "training": training,
        "recipe": recipe_dict,
    }


def full_drafter(module: Any) -> Any:
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
    return module.kind.to_write(src, state)


_STATE_PREFIX = "state_dict.objective.drafter."  # DCP keys of the drafter in a Lightning checkpoint of `fit`


def drafter_info(config: Any, fc_input_scale: torch.Tensor | None, recipe_dict: dict[str, Any],
                 provenance: dict[str, Any]) -> dict[str, Any]:
    """The `DRAFTER_INFO_KEY` entry for a drafter of `config` trained with `fc_input_scale` (None: not
    preconditioned; see there)."""
    return {"config": json.dumps(config.to_json_dict()), "recipe": json.dumps(recipe_dict, default=str),
            "provenance": provenance_json(provenance),
            "fc_input_scale": None if fc_input_scale is None else fc_input_scale.detach().cpu().float()}


def recorded_kind(raw: dict[str, Any], source: str) -> Any:
    """The `DrafterKind` of a drafter config.json `raw` that `fit` recorded (its kind's own config.json): the kind of
    the first registered layout that claims it (`Layout.claims`), else the default kind (EAGLE-3's canonical config
    is claimed by no layout: its folders are told by their weight files)."""
    return get_kind(next((layout.kind for layout in layouts() if layout.claims(raw, source)), DEFAULT_KIND))


def consolidate_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the canonical drafter folder (`write_drafter_folder`: the same files a finished run writes) from a
    checkpoint of `fit`: a sharded (DCP) `last.ckpt` directory of an FSDP run, or a single-file checkpoint.

    Runs in one process: DCP reads every rank's shards into full tensors (`no_dist=True`).

    Raises:
        FileNotFoundError: `checkpoint` does not exist.
        ValueError: not a checkpoint written by `fit` (no drafter entry), or unreadable.
    """
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
    raw = info_json(info, "config", checkpoint)
    source = f"{checkpoint} drafter config"
    kind = recorded_kind(raw, source)
    config = kind.config_class.from_json_dict(raw, source=source)
    state = sharded_state(checkpoint, _STATE_PREFIX) if checkpoint.is_dir() else {
        f"state_dict.{k}": v for k, v in (meta.get("state_dict") or {}).items()}
    state = {k.removeprefix(_STATE_PREFIX): v for k, v in state.items() if k.startswith(_STATE_PREFIX)}
    try:
        drafter = kind.from_checkpoint(config, state, info)  # EAGLE-3 folds its recorded fc preconditioning scale
    except (RuntimeError, TypeError) as e:  # missing / unexpected keys, shapes that do not fit the config
        raise ValueError(f"{checkpoint}: its drafter weights do not fit its drafter config "
                         f"({str(e).strip().splitlines()[0]}...)") from None
    from eagle3_zoo.training.rundir.record import RECORD_KEY

    provenance = info_json(info, "provenance", checkpoint)
    record = meta.get(RECORD_KEY) if isinstance(meta.get(RECORD_KEY), dict) else {}  # wall time, epochs, metrics...
    provenance.setdefault("training", {}).update(record, global_step=meta.get("global_step"),
                                                 consolidated_from=str(checkpoint.resolve()))
    return write_drafter_folder(drafter, out, info_json(info, "recipe", checkpoint), provenance, kind=kind)
