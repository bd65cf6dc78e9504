"""The in-process (`hf`) target backend: load a recipe's frozen target and choose its aux layers.

Moved here from `training/build.py` so that `data/` (the feature job) does not import `training/`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def load_recipe_target(recipe: Any, source: str = "recipe", skeleton: bool = False) -> tuple[Any, Any, Any]:
    """Load the recipe's frozen target and check the recipe against its config.

    With `skeleton`, the decoder layers stay on the meta device for FSDP to fill shard by shard
    (`load_target_skeleton`); a target that cannot be read that way is loaded whole (with a warning).

    Returns:
        `(model, tokenizer, adapter)` on the CPU (the Trainer moves it).

    Raises:
        ValueError: `target.family` names another family than the target's `model_type`.
        RecipeError: draft vocab larger than the target vocab, aux layer ids out of range, wrong drafter width.
    """
    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.adapters.loading import ShardedLoadUnsupported, load_target_skeleton
    from eagle3_zoo.recipe import validate_against_target

    t = recipe.target
    loaded = None
    if skeleton:
        try:
            loaded = load_target_skeleton(t.name_or_path, dtype=t.dtype, trust_remote_code=t.trust_remote_code)
        except ShardedLoadUnsupported as e:
            logger.warning("%s; every rank loads the whole target before FSDP shards it", e)
    model, tokenizer, adapter = loaded or load_target(t.name_or_path, dtype=t.dtype, lora_path=t.lora_path,
                                                      trust_remote_code=t.trust_remote_code)
    if t.family not in ("auto", adapter.model_type):
        raise ValueError(f"{source}: target.family = {t.family!r} but {t.name_or_path} is a {adapter.model_type!r} "
                         f"model (config.json model_type); set target.family to {adapter.model_type!r} or 'auto'")
    cfg = model.config
    validate_against_target(recipe, cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size, source=source)
    return model, tokenizer, adapter


def aux_layer_ids_for(recipe: Any, target: Any, adapter: Any) -> tuple[int, ...]:
    """`drafter.aux_layer_ids`, or the adapter's default for the target's depth."""
    if recipe.drafter.aux_layer_ids is not None:
        return tuple(int(i) for i in recipe.drafter.aux_layer_ids)
    return tuple(adapter.aux_layer_ids(target.config.num_hidden_layers))
