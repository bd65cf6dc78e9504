"""Offline feature job: run the frozen target over a recipe's examples and store its features in shards.

Each sample stores `input_ids`, `loss_mask`, `aux_hidden [T, 3H]` and `final_hidden [T, H]` (unpadded) through
`FeatureWriter`. Samples are written in a fixed order (longest first, ties by example order) and run through the
target in fixed batches of consecutive samples; so after a crash the rerun recomputes exactly the batches that
were lost with exactly the same composition, and the store (shard files, hashes, manifest) is identical to the
store of an uninterrupted run. The writer itself guarantees no corrupt or duplicated shard (see
`eagle3_zoo.data.features`).

The work is cut into parts of whole batches (`features_shard_size // batch_size` batches, at least one), the same
way for any number of processes; part k is its own store `<features_dir>/part-<k>`. Rank r of W extracts parts
r, r + W, ... (`eagle3_zoo.data.ranks`); a restarted rank skips its finished parts and resumes the one it was
filling. Under `fit` the ranks then wait (polling the manifests) until every part is done. The parts are merged
in order into the top-level `manifest.json` (their shards listed as `part-<k>/shard-*.safetensors`), which
`FeatureReader` reads: files, manifest and sample order are identical for any world size and for one process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3_zoo.data.cache_keys import json_sha256, key_version
from eagle3_zoo.data.datamodule import collate_right_padded
from eagle3_zoo.data.features import MANIFEST, FeatureStoreError, FeatureWriter, shard_problem
from eagle3_zoo.data.ranks import RankSplit, split_for, wait_until
from eagle3_zoo.util.fileio import atomic_write_bytes, exclusive_lock
from eagle3_zoo.util.progress import Progress

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import DataConfig, Recipe, TargetConfig

logger = logging.getLogger(__name__)

HYBRID_MARKER = ".hybrid"  # in a store directory that a hybrid run is filling (`eagle3_zoo.data.engine.stream`)


def features_dir_for(data: DataConfig, target: TargetConfig, data_fingerprint: str, target_id: str,
                     aux_layer_ids: tuple[int, ...]) -> Path:
    """`data.features_dir`, or a directory under `data.cache_dir` keyed by everything the features depend on (the
    target section's dtype and LoRA among them)."""
    if data.features_dir:
        return Path(data.features_dir)
    key = json_sha256({"layout": key_version("features"), "data": data_fingerprint, "target": target_id,
                       "target_dtype": target.dtype, "lora": target.lora_path,
                       "aux_layer_ids": list(aux_layer_ids), "dtype": data.features_dtype,
                       "shard_size": data.features_shard_size}, "features")
    return Path(data.cache_dir) / "features" / key[:16]


def store_meta(target_id: str, aux_layer_ids: tuple[int, ...], data_fingerprint: str) -> dict[str, Any]:
    return {"target": target_id, "aux_layer_ids": list(aux_layer_ids), "data_fingerprint": data_fingerprint}


def _exclusive(directory: Path) -> contextlib.AbstractContextManager[None]:
    # another process on the same part waits for the one that extracts it
    return exclusive_lock(directory.parent / f".{directory.name}.extract.lock")


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def _check_layout(out_dir: Path) -> None:
    """Refuse a directory holding an unfinished store of the layout before parts (one store, or `rank-*` stores)."""
    try:
        top = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        top = {"parts": None}
    if "parts" not in top or any(out_dir.glob("rank-[0-9]*/" + MANIFEST)):
        raise FeatureStoreError(f"{out_dir}: holds an incomplete feature store of an older layout (no parts); "
                                "remove it or point data.features_dir at a new directory, and rerun the feature job")
    if (out_dir / HYBRID_MARKER).exists():  # its parts hold what a training pass read, not this job's share
        raise FeatureStoreError(f"{out_dir}: holds the unfinished store of a data.mode=hybrid run; finish it with that "
                                "run (its second epoch completes the store), or point data.features_dir elsewhere")


def merge_parts(out_dir: Path, num_parts: int) -> None:
    """The top-level manifest of `out_dir`: its complete parts' shards in part order (same bytes for any writer)."""
    manifests = [json.loads((out_dir / part_name(k) / MANIFEST).read_text()) for k in range(num_parts)]
    merged = {key: manifests[0][key] for key in ("format", "version", "dtype", "shard_size_samples", "hidden_size",
                                                 "aux_layer_ids", "fields", "meta")}
    shards = [{**shard, "file": f"{part_name(k)}/{shard['file']}"} for k, m in enumerate(manifests)
              for shard in m["shards"]]
    merged.update(complete=True, parts=num_parts, num_samples=sum(m["num_samples"] for m in manifests),
                  num_tokens=sum(m["num_tokens"] for m in manifests),
                  num_bytes=sum(m["num_bytes"] for m in manifests), shards=shards)
    data = json.dumps(merged, indent=1).encode()
    with _exclusive(out_dir):
        path = out_dir / MANIFEST
        if not path.is_file() or path.read_bytes() != data:
            atomic_write_bytes(path, data)


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
                   dtype: str = "bfloat16", meta: dict[str, Any] | None = None, split: RankSplit | None = None,
                   wait: bool = True, verify: str = "size", features_fn: Any = None) -> Path:
    """Run `target` over `examples` and store their features (resumable, split by rank; see the module docstring).

    Parts already stored are checked against their manifests first (`verify`: "size", or "hash" which reads them
    all); damaged shards are extracted again and counted in the log. `features_fn(list of input_ids) -> (aux
    [B, T, 3H], final [B, T, H])` right-padded replaces the in-process forward (the `vllm` backend:
    `eagle3_zoo.targets.vllm_features.VLLMFeatureExtractor.batch`). `split`: this process's share (default: all);
    `wait`: return only when the other ranks' parts are done too. `target` may be a function that loads it, called
    only when a part of this rank's share needs extracting.

    Returns:
        The store directory `out_dir`.
    """
    out_dir, split = Path(out_dir), split or RankSplit()
    if _is_complete(out_dir, {str(e["id"]) for e in examples}, verify):
        logger.info("%s: feature store complete (%d samples, shards verified: %s), nothing to extract", out_dir,
                    len(examples), verify)
        return out_dir
    _check_layout(out_dir)
    order = sorted(range(len(examples)), key=lambda i: -int(examples[i]["input_ids"].numel()))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    per_part = max(1, shard_size // batch_size)
    parts = [batches[i : i + per_part] for i in range(0, len(batches), per_part)]
    ids = [{str(examples[i]["id"]) for batch in part for i in batch} for part in parts]
    device = None
    for k in split.share(range(len(parts))):
        store = out_dir / part_name(k)
        with _exclusive(store):
            if _is_complete(store, ids[k], verify):
                continue
            if features_fn is None and device is None:
                if not isinstance(target, torch.nn.Module):
                    target = target()  # loaded only now that a part needs it
                device = next(target.parameters()).device
            _write_part(examples, parts[k], target, adapter, store, aux_layer_ids, shard_size, dtype, meta, verify,
                        features_fn, device)
    def done() -> tuple[int, int]:
        return sum(_is_complete(out_dir / part_name(k), ids[k]) for k in range(len(parts))), len(parts)

    if wait:
        wait_until(done, f"feature parts ({out_dir})")
    if done()[0] == len(parts):  # (`prepare --rank`, which does not wait: the last rank to finish merges)
        merge_parts(out_dir, len(parts))
        logger.info("%s: feature store complete (%d samples in %d parts)", out_dir, len(examples), len(parts))
    return out_dir


def _write_part(examples: list[dict[str, Any]], batches: list[list[int]], target: Any, adapter: Any, store: Path,
                aux_layer_ids: tuple[int, ...], shard_size: int, dtype: str, meta: dict[str, Any] | None,
                verify: str, features_fn: Any, device: Any) -> None:
    with FeatureWriter(store, shard_size, dtype, meta=meta, verify=verify) as writer:
        todo = [b for b in batches if any(str(examples[i]["id"]) not in writer for i in b)]
        logger.info("%s: extracting features of %d samples in %d batches", store, sum(len(b) for b in todo),
                    len(todo))
        with Progress(sum(len(b) for b in todo), "feature job", "sample", logger=logger) as progress:
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
    if writer.damaged:
        logger.warning("%s: redid %d damaged shard(s) (%d samples): %s", store, len(writer.damaged),
                       sum(len(s["samples"]) for s in writer.damaged), ", ".join(s["file"] for s in writer.damaged))


def check_rank(rank: int, world_size: int) -> None:
    """Raise a one-line `ValueError` unless `world_size >= 1` and `0 <= rank < world_size` (a rank out of range
    would extract nothing and report success)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} --world-size {world_size}: expected world size >= 1 and 0 <= rank < "
                         "world size (rank r of N processes of a distributed feature job: --rank r --world-size N)")


def extract_features(recipe: Recipe, *, target: Any = None, tokenizer: Any = None, adapter: Any = None,
                     data: Any = None, rank: int = 0, world_size: int = 1, verify: str = "size") -> Path:
    """The offline feature job of a recipe: prepare its data like `fit` does and store the target's features.

    Args:
        recipe: a loaded `Recipe`.
        target, tokenizer, adapter: an already loaded target (default: `load_target` from the recipe); one loaded
            heads-only (`load_recipe_target(heads_only=True)`) is loaded whole only if features must be extracted.
        data: already prepared data (`eagle3_zoo.data.prepare.PreparedData`); default: prepared here.
        rank, world_size: this process's share of a feature job started by hand (`prepare --rank --world-size`;
            it does not wait for the other ranks). Default: the share among the ranks of a torch.distributed run
            that see the store (`eagle3_zoo.data.ranks.split_for`), waiting for all of them.
        verify: how stored shards are checked before they count as done: "size" (cheap, what `fit` reads) or
            "hash" (reads every shard; `prepare`). Damaged shards are extracted again.

    Returns:
        The feature-store directory (`data.features_dir` or a keyed directory under `data.cache_dir`).
    """
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.targets.loading import aux_layer_ids_for, hand_started_device, is_heads_only, load_recipe_target

    check_rank(rank, world_size)  # before the target is loaded
    if target is None:
        device = hand_started_device(recipe.trainer, rank) if world_size > 1 else None
        target, tokenizer, adapter = load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, device=device)
    target_id = recipe.target.name_or_path
    if data is None:
        data = prepare_data(recipe, tokenizer, adapter, target=target, target_id=target_id,
                            vocab_size=target.config.vocab_size)
    aux_ids = aux_layer_ids_for(recipe.drafter, recipe.target.name_or_path, target, adapter)
    out_dir = features_dir_for(recipe.data, recipe.target, data.fingerprint, target_id, aux_ids)
    split = RankSplit(rank, world_size) if world_size > 1 else split_for(out_dir)
    model: Any = target
    if is_heads_only(target):  # the whole target is loaded only if this rank has features to extract
        model = functools.partial(_whole_target, recipe, target.get_input_embeddings().weight.device)
    with contextlib.ExitStack() as stack:
        features_fn = None
        if recipe.data.features_backend == "vllm":  # the recipe's engine, started at the first batch that needs it
            features_fn = _engine_features_fn(recipe, target, adapter, aux_ids, split.rank, stack)
        write_features(data.train + data.val, model, adapter, out_dir, aux_layer_ids=aux_ids,
                       batch_size=recipe.trainer.batch_size, shard_size=recipe.data.features_shard_size,
                       dtype=recipe.data.features_dtype, meta=store_meta(target_id, aux_ids, data.fingerprint),
                       split=split, wait=world_size == 1, verify=verify, features_fn=features_fn)
    return out_dir


def _engine_features_fn(recipe: Recipe, target: Any, adapter: Any, aux_ids: tuple[int, ...], rank: int,
                        stack: contextlib.ExitStack) -> Any:
    """`features_fn` of the feature job through the recipe's engine (`engine:`; launched or attached at the first
    batch that needs features, stopped when `stack` closes)."""
    from eagle3_zoo.data.engine.feed import EngineFeed, final_norm_on_cpu, run_tag
    from eagle3_zoo.targets.deployment import EngineDeployment

    deployment = EngineDeployment(recipe, aux_ids, target.config.num_hidden_layers)
    feed = EngineFeed(deployment, run_tag(recipe.output_dir, rank), int(recipe.data.prefetch_disk_gib * 2**30),
                      concurrency=recipe.engine.concurrency, hidden_size=target.config.hidden_size)
    stack.callback(feed.close)
    return functools.partial(feed.states_batch, final_norm=final_norm_on_cpu(adapter.final_norm(target)))


def _whole_target(recipe: Recipe, device: Any) -> Any:
    from eagle3_zoo.targets.loading import load_recipe_target

    return load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, device=device)[0]
