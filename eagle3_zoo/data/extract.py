"""Offline feature job: run the frozen target over a recipe's examples and store its features in shards.

Each sample stores `input_ids`, `loss_mask`, `aux_hidden [T, 3H]` and `final_hidden [T, H]` (unpadded) through
`FeatureWriter`. Samples are written in a fixed order (longest first, ties by example order) and run through the
target in fixed batches of consecutive samples; so after a crash the rerun recomputes exactly the batches that
were lost with exactly the same composition, and the store (shard files, hashes, manifest) is identical to the
store of an uninterrupted run. The writer itself guarantees no corrupt or duplicated shard (see
`eagle3_zoo.data.features`).

A distributed job passes `rank`/`world_size`: rank r takes every world_size-th batch and writes its own store in
`<features_dir>/rank-XXXXX`; `FeatureReader(features_dir)` reads the per-rank stores together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.data.datamodule import collate_right_padded
from eagle3_zoo.data.features import MANIFEST, FeatureWriter, shard_problem
from eagle3_zoo.modeling.io import exclusive_lock
from eagle3_zoo.progress import Progress

logger = logging.getLogger(__name__)


def features_dir_for(recipe: Any, data_fingerprint: str, target_id: str, aux_layer_ids: tuple[int, ...]) -> Path:
    """`data.features_dir`, or a directory under `data.cache_dir` keyed by everything the features depend on."""
    if recipe.data.features_dir:
        return Path(recipe.data.features_dir)
    key = hashlib.sha256(json.dumps({
        "data": data_fingerprint, "target": target_id, "target_dtype": recipe.target.dtype,
        "lora": recipe.target.lora_path, "aux_layer_ids": list(aux_layer_ids), "dtype": recipe.data.features_dtype,
        "shard_size": recipe.data.features_shard_size}, sort_keys=True).encode()).hexdigest()
    return Path(recipe.data.cache_dir) / "features" / key[:16]


def store_meta(target_id: str, aux_layer_ids: tuple[int, ...], data_fingerprint: str) -> dict[str, Any]:
    return {"target": target_id, "aux_layer_ids": list(aux_layer_ids), "data_fingerprint": data_fingerprint}


def _exclusive(directory: Path) -> contextlib.AbstractContextManager[None]:
    # ranks started together wait for the one that extracts
    return exclusive_lock(directory.parent / f".{directory.name}.extract.lock")


def _is_complete(directory: Path, sample_ids: set[str], verify: str = "size") -> bool:
    """Whether the store holds `sample_ids` in shards that all pass their manifest check (`verify`: size or hash).

    A complete manifest alone is not enough: a shard truncated or replaced since would be read by `fit` and fail
    there; the writer drops and redoes such shards.
    """
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    stored = {sid for shard in manifest.get("shards", []) for sid in shard["samples"]}
    if not (manifest.get("complete") and sample_ids <= stored):
        return False
    return not any(shard_problem(directory / shard["file"], shard, verify) for shard in manifest["shards"])


@torch.no_grad()
def write_features(examples: list[dict[str, Any]], target: Any, adapter: Any, out_dir: str | Path, *,
                   aux_layer_ids: tuple[int, ...], batch_size: int = 8, shard_size: int = 256,
                   dtype: str = "bfloat16", meta: dict[str, Any] | None = None, rank: int = 0,
                   world_size: int = 1, verify: str = "size", features_fn: Any = None) -> Path:
    """Run `target` over `examples` and store their features (resumable; see the module docstring).

    Shards already stored are checked against the manifest first (`verify`: "size", or "hash" which reads them
    all); damaged ones are extracted again and counted in the log. `features_fn(list of input_ids) -> (aux
    [B, T, 3H], final [B, T, H])` right-padded replaces the in-process forward (the `vllm` backend:
    `eagle3_zoo.targets.vllm_features.VLLMFeatureExtractor.batch`).

    Returns:
        The store directory (this rank's subdirectory when `world_size > 1`).
    """
    out_dir = Path(out_dir)
    store = out_dir / f"rank-{rank:05d}" if world_size > 1 else out_dir
    order = sorted(range(len(examples)), key=lambda i: -int(examples[i]["input_ids"].numel()))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)][rank::world_size]
    mine = {str(examples[i]["id"]) for batch in batches for i in batch}
    with _exclusive(store):
        if _is_complete(store, mine, verify):
            logger.info("%s: feature store complete (%d samples, shards verified: %s), nothing to extract", store,
                        len(mine), verify)
            return store
        device = next(target.parameters()).device if features_fn is None else None
        with FeatureWriter(store, shard_size, dtype, meta=meta, verify=verify) as writer:
            todo = [b for b in batches if any(str(examples[i]["id"]) not in writer for i in b)]
            logger.info("%s: extracting features of %d samples in %d batches (%d stored before)", store,
                        sum(len(b) for b in todo), len(todo), len(mine) - sum(len(b) for b in todo))
            progress = Progress(sum(len(b) for b in todo), "feature job", "sample", logger=logger)
            for batch in todo:
                if features_fn is not None:
                    aux_hidden, final_hidden = features_fn([examples[i]["input_ids"] for i in batch])
                else:
                    padded = collate_right_padded([examples[i] for i in batch])
                    aux_hidden, final_hidden, _ = adapter.forward_features(
                        target, padded["input_ids"].to(device), attention_mask=padded["attention_mask"].to(device),
                        layer_ids=aux_layer_ids, use_cache=False)
                for row, i in enumerate(batch):
                    ex, t = examples[i], int(examples[i]["input_ids"].numel())
                    writer.add(str(ex["id"]), input_ids=ex["input_ids"], loss_mask=ex["loss_mask"],
                               aux_hidden=aux_hidden[row, :t], final_hidden=final_hidden[row, :t])
                progress.update(len(batch), tokens=sum(int(examples[i]["input_ids"].numel()) for i in batch))
            progress.close()
        if writer.damaged:
            logger.warning("%s: redid %d damaged shard(s) (%d samples): %s", store, len(writer.damaged),
                           sum(len(s["samples"]) for s in writer.damaged), ", ".join(s["file"] for s in writer.damaged))
    return store


def check_rank(rank: int, world_size: int) -> None:
    """Raise a one-line `ValueError` unless `world_size >= 1` and `0 <= rank < world_size` (a rank out of range
    would extract nothing and report success)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} --world-size {world_size}: expected world size >= 1 and 0 <= rank < "
                         "world size (rank r of N processes of a distributed feature job: --rank r --world-size N)")


def extract_features(recipe: Any, *, target: Any = None, tokenizer: Any = None, adapter: Any = None,
                     data: Any = None, rank: int = 0, world_size: int = 1, verify: str = "size") -> Path:
    """The offline feature job of a recipe: prepare its data like `fit` does and store the target's features.

    Args:
        recipe: a loaded `Recipe`.
        target, tokenizer, adapter: an already loaded target (default: `load_target` from the recipe).
        data: already prepared data (`eagle3_zoo.data.prepare.PreparedData`); default: prepared here.
        rank, world_size: this process's share of a distributed feature job.
        verify: how stored shards are checked before they count as done: "size" (cheap, what `fit` reads) or
            "hash" (reads every shard; `prepare`). Damaged shards are extracted again.

    Returns:
        The feature-store directory (`data.features_dir` or a keyed directory under `data.cache_dir`).
    """
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.targets.loading import aux_layer_ids_for, load_recipe_target

    check_rank(rank, world_size)  # before the target is loaded
    if target is None:
        target, tokenizer, adapter = load_recipe_target(recipe)
    target_id = recipe.target.name_or_path
    if data is None:
        data = prepare_data(recipe, tokenizer, adapter, target=target, target_id=target_id,
                            vocab_size=target.config.vocab_size)
    aux_ids = aux_layer_ids_for(recipe, target, adapter)
    out_dir = features_dir_for(recipe, data.fingerprint, target_id, aux_ids)
    with contextlib.ExitStack() as stack:
        features_fn = None
        if recipe.data.features_backend == "vllm":  # a server started at the first batch that needs features
            from eagle3_zoo.targets.vllm_features import VLLMFeatureExtractor

            features_fn = stack.enter_context(VLLMFeatureExtractor(
                target_id, aux_ids, dtype=recipe.target.dtype, log_path=out_dir.parent / f"{out_dir.name}.vllm.log"
            )).batch
        write_features(data.train + data.val, target, adapter, out_dir, aux_layer_ids=aux_ids,
                       batch_size=recipe.trainer.batch_size, shard_size=recipe.data.features_shard_size,
                       dtype=recipe.data.features_dtype, meta=store_meta(target_id, aux_ids, data.fingerprint),
                       rank=rank, world_size=world_size, verify=verify, features_fn=features_fn)
    return out_dir


def prepare_recipe(recipe: Any, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """The whole data stage of a recipe as `fit` runs it, without training: read, regenerate, split, tokenise,
    count the draft vocabulary and, for an offline recipe, the feature job. Everything lands in the caches `fit`
    reads, so a later `fit` with the same data settings goes straight to training (a one-off preparation step).

    An existing feature store is verified shard by shard (sha256 against the manifest): `prepare` is the step that
    makes the store sound, so a truncated or corrupt shard is extracted again here rather than found by `fit`.

    Returns:
        The data summary of provenance.json, plus `features_dir` for an offline recipe.
    """
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.targets.loading import load_recipe_target

    check_rank(rank, world_size)  # before the target is loaded
    target, tokenizer, adapter = load_recipe_target(recipe)
    data = prepare_data(recipe, tokenizer, adapter, target=target, target_id=recipe.target.name_or_path,
                        vocab_size=target.config.vocab_size)
    summary = data.summary()
    if recipe.data.mode == "offline":
        store = extract_features(recipe, target=target, tokenizer=tokenizer, adapter=adapter, data=data, rank=rank,
                                 world_size=world_size, verify="hash")
        summary["features_dir"] = str(store)
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m eagle3_zoo.data.extract RECIPE [key=value ...]`; prints the feature-store directory."""
    import argparse
    import logging as _logging
    import sys

    from eagle3_zoo.recipe import load_recipe

    parser = argparse.ArgumentParser(prog="python -m eagle3_zoo.data.extract",
                                     description="Offline feature job of a recipe (resumable).")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value overrides, before or after the options")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_intermixed_args(argv)  # overrides may follow --rank/--world-size
    _logging.basicConfig(level=_logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        out = extract_features(load_recipe(args.recipe, args.overrides), rank=args.rank, world_size=args.world_size)
    except (ValueError, FileNotFoundError, ImportError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
