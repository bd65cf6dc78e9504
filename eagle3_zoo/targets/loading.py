"""The in-process (`hf`) target backend: load a recipe's frozen target and choose its aux layers.

Moved here from `training/build.py` so that `data/` (the feature job) does not import `training/`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import DrafterConfig, TargetConfig, TrainerConfig

logger = logging.getLogger(__name__)


def target_device(trainer: TrainerConfig, local_rank: int | None = None) -> torch.device:
    """Where this rank's target lives for everything it does (regeneration, feature job, training forward, tau
    eval): `cuda:<local rank>` when the recipe trains on GPUs (`trainer.accelerator` gpu or auto) and CUDA is
    available, else the CPU. `local_rank` defaults to the launcher's `LOCAL_RANK` (0 without one)."""
    if trainer.accelerator in ("gpu", "auto") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank)
    return torch.device("cpu")


def use_device(device: torch.device) -> torch.device:
    """Make `device` this process's current CUDA device (a no-op for the CPU) and return it: anything that allocates
    on "cuda" without an index (NCCL, kernel workspaces, libraries) then lands on this rank's GPU, not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def hand_started_device(trainer: TrainerConfig, rank: int) -> torch.device:
    """The device of rank `rank` of a data job started by hand (`prepare --rank r --world-size N`), made current:
    the launcher's `LOCAL_RANK` where one set it, else GPU `r mod (GPUs here)`, so the N processes on one machine
    take one GPU each (all of them on GPU 0 would run one after another, or out of memory)."""
    local = os.environ.get("LOCAL_RANK")
    if local is None and torch.cuda.is_available():
        local = rank % max(torch.cuda.device_count(), 1)
    return use_device(target_device(trainer, None if local is None else int(local)))


def load_recipe_target(target: TargetConfig, drafter: DrafterConfig, trainer: TrainerConfig, source: str = "recipe",
                       device: str | torch.device | None = None, heads_only: bool = False,
                       skeleton: bool = False) -> tuple[Any, Any, Any]:
    """Load the recipe's frozen target and check the recipe's drafter against its config.

    Args:
        target, drafter, trainer: the recipe's `target`, `drafter` and `trainer` sections.
        device: where the target is placed (default `target_device(trainer)`).
        heads_only: read only the embedding, final norm and lm_head (`load_target_heads`; the rest stays on the
            meta device), for training on stored features.
        skeleton: the decoder layers stay on the meta device for FSDP to fill shard by shard
            (`load_target_skeleton`); a target that cannot be read that way is loaded whole (with a warning).

    Returns:
        `(model, tokenizer, adapter)` on `device`.

    Raises:
        ValueError: `target.family` names another family than the target's `model_type`.
        RecipeError: draft vocab larger than the target vocab, aux layer ids out of range, wrong drafter width.
    """
    from eagle3_zoo.adapters import load_target, load_target_heads
    from eagle3_zoo.adapters.loading import ShardedLoadUnsupported, load_target_skeleton
    from eagle3_zoo.recipe.sections import validate_against_target

    t = target
    device = target_device(trainer) if device is None else device
    loaded = None
    if skeleton:
        try:
            loaded = load_target_skeleton(t.name_or_path, dtype=t.dtype, trust_remote_code=t.trust_remote_code)
        except ShardedLoadUnsupported as e:
            logger.warning("%s; every rank loads the whole target before FSDP shards it", e)
    if loaded is not None:
        model, tokenizer, adapter = loaded
    elif heads_only:
        model, tokenizer, adapter = load_target_heads(t.name_or_path, dtype=t.dtype,
                                                      trust_remote_code=t.trust_remote_code, device=device)
    else:
        model, tokenizer, adapter = load_target(t.name_or_path, dtype=t.dtype, lora_path=t.lora_path,
                                                trust_remote_code=t.trust_remote_code, device=device)
    if t.family not in ("auto", adapter.model_type):
        raise ValueError(f"{source}: target.family = {t.family!r} but {t.name_or_path} is a {adapter.model_type!r} "
                         f"model (config.json model_type); set target.family to {adapter.model_type!r} or 'auto'")
    cfg = model.config
    validate_against_target(drafter, cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size, source=source)
    return model, tokenizer, adapter


def aux_layer_ids_for(drafter: DrafterConfig, target_name: str, target: Any, adapter: Any) -> tuple[int, ...]:
    """The hidden states the data stage produces for the recipe's drafter (`feature_layer_ids`)."""
    return feature_layer_ids(drafter, target_name, target.config, adapter)


def feature_layer_ids(drafter: DrafterConfig, target_name: str, target_config: Any, adapter: Any) -> tuple[int, ...]:
    """The target hidden states (HF `output_hidden_states` ids) the data stage produces for the recipe's drafter
    (`drafter`: the recipe's `drafter` section; `target_name`: its `target.name_or_path`): `drafter.aux_layer_ids`,
    else what the recipe's kind of drafter reads (`DrafterKind.features` of the config `config_from` derives;
    EAGLE-3: the adapter's default three for the target's depth)."""
    if drafter.aux_layer_ids is not None:
        return tuple(int(i) for i in drafter.aux_layer_ids)
    if drafter.kind == "eagle3":  # the adapter declares EAGLE-3's layers (no drafter config needed)
        return tuple(adapter.aux_layer_ids(target_config.num_hidden_layers))
    from eagle3_zoo.drafters import get_kind

    kind = get_kind(drafter.kind)
    config = kind.config_from(drafter, target_config, aux_layer_ids=None, defaults=adapter.drafter_defaults,
                              target_name=target_name, torch_dtype="float32")
    return tuple(kind.features(config).aux_layer_ids)


def is_heads_only(model: Any) -> bool:
    """Whether `model` was loaded heads-only (`load_recipe_target(heads_only=True)`): its layers are on the meta
    device and it cannot run a forward."""
    return any(p.is_meta for p in model.parameters())
