"""The whole data stage of a recipe as one step (`eagle3-zoo prepare`): `prepare_recipe`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle3_zoo.data.feature_job import check_rank, extract_features
from eagle3_zoo.data.ranks import RankSplit

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import Recipe


def prepare_recipe(recipe: Recipe, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """The whole data stage of a recipe as `fit` runs it, without training: read, regenerate, split, tokenise,
    count the draft vocabulary and, for an offline recipe, the feature job. Everything lands in the caches `fit`
    reads, so a later `fit` with the same data settings goes straight to training (a one-off preparation step).

    An existing feature store is verified shard by shard (sha256 against the manifest): `prepare` is the step that
    makes the store sound, so a truncated or corrupt shard is extracted again here rather than found by `fit`.

    Returns:
        The data summary of provenance.json, plus `features_dir` for an offline recipe.
    """
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.targets.loading import hand_started_device, load_recipe_target

    check_rank(rank, world_size)  # before the target is loaded
    target, tokenizer, adapter = load_recipe_target(recipe.target, recipe.drafter, recipe.trainer,
                                                    device=hand_started_device(recipe.trainer, rank))
    split = RankSplit(rank, world_size) if world_size > 1 else None  # processes started by hand share the cache
    data = prepare_data(recipe, tokenizer, adapter, target=target, target_id=recipe.target.name_or_path,
                        vocab_size=target.config.vocab_size, split=split)
    summary = data.summary()
    if recipe.data.mode == "offline":
        store = extract_features(recipe, target=target, tokenizer=tokenizer, adapter=adapter, data=data, rank=rank,
                                 world_size=world_size, verify="hash")
        summary["features_dir"] = str(store)
    return summary
