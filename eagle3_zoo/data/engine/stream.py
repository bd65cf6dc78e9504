"""Training batches whose hidden states are streamed from the engine (`data.mode: online | hybrid`, backend vllm).

Order first: the batches of a pass are the length-bucketed sampler's (`LengthBucketBatchSampler`: seeded, resumable
mid-epoch, sharded by rank), fixed before any request is sent. When a pass begins, its loader hands the whole list
to its `FeatureStream`, which requests the states of the batches ahead of the one being trained on: at most
`data.prefetch_batches` batches ahead, and no more than `data.prefetch_disk_gib` of files waiting on disk (shared by
the loaders of a rank; the batch being trained on is always requested). A batch is handed to the training step in
plan order whichever server answered first; each file is read once and deleted. A resumed run plans the batches
after the checkpoint, so it sees the same batches with the same states as an uninterrupted run. Hybrid runs also
write what they read to a feature store and read it once complete (`eagle3_zoo.data.hybrid_store`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from eagle3_zoo.data.datamodule import FeatureDataModule, ResumableDataLoader
from eagle3_zoo.data.engine.feed import final_norm_on_cpu
from eagle3_zoo.data.hybrid_store import HybridStore

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import Recipe

logger = logging.getLogger(__name__)


class FeatureStream:
    """The planned batches of one loader, their states requested ahead from an `EngineFeed`.

    Args:
        feed: this rank's `eagle3_zoo.data.engine.feed.EngineFeed`.
        examples: token examples (`id`, `input_ids`, `loss_mask`), indexed by the sampler's indices.
        layers: states per token in a file (the aux layers and the last one).
        hidden_size: the target's hidden size.
        itemsize: bytes per value in the engine's files (its dtype).
        final_norm: the target's final norm (applied to the last state, which vLLM returns before it).
        prefetch_batches: batches requested ahead of the one being trained on.
        store: the `HybridStore` the states are also written to, or None (online: nothing is kept).
    """

    def __init__(self, feed: Any, examples: list[dict[str, Any]], *, layers: int, hidden_size: int, itemsize: int,
                 final_norm: Any, prefetch_batches: int, store: HybridStore | None = None, name: str = "t") -> None:
        self.feed, self.examples, self.layers, self.name = feed, examples, layers, name
        self.row_bytes = layers * hidden_size * itemsize
        self.final_norm, self.prefetch, self.store = final_norm, prefetch_batches, store
        self._batches: list[list[int]] = []
        self._pending: dict[int, list[Any]] = {}  # batch position -> futures of its samples
        self.stop_requested: Any = lambda: False  # the trainer's SIGTERM flag, set by the DataModule
        self._pos = self._next = 0

    def sample_bytes(self, index: int) -> int:
        """Disk bytes of one sample's file (its states; the file's header and ids are small)."""
        return self._bytes(self.examples[index])

    def _bytes(self, example: dict[str, Any]) -> int:
        return int(example["input_ids"].numel()) * self.row_bytes

    def _submit(self, example: dict[str, Any], name: str) -> Any:
        return self.feed.submit(example["input_ids"].tolist(), f"{self.name}{name}")

    def plan(self, batches: list[list[int]]) -> None:
        """Begin a pass over `batches` (the previous pass's requests are dropped) and request the first ones."""
        self.cancel()
        self._batches, self._pos, self._next = [list(b) for b in batches], 0, 0
        self._pump()

    def _pump(self) -> None:
        while self._next < len(self._batches) and self._next <= self._pos + self.prefetch:
            batch = self._batches[self._next]
            cost = sum(self.sample_bytes(i) for i in batch)
            if not self.feed.reserve(cost, force=self._next == self._pos):
                return  # over the disk budget: wait until a batch has been read
            self._pending[self._next] = [self._submit(self.examples[i], str(i)) for i in batch]
            self._next += 1

    def take(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples of the next planned batch (which must be `indices`), with their states; blocks until the
        engine has delivered them, reads each file once and deletes it.

        Raises:
            EngineFeedError: the engine did not deliver them (the rest of the pass is dropped).
        """
        if self._pos >= len(self._batches) or list(indices) != self._batches[self._pos]:
            raise RuntimeError(f"the loader asked for batch {list(indices)}, the stream planned "
                               f"{self._batches[self._pos] if self._pos < len(self._batches) else 'none'}")
        self._pump()
        start = time.monotonic()
        futures = self._pending.pop(self._pos)
        try:
            samples = [self._read(self.examples[i], self._result(f)) for i, f in zip(indices, futures)]
        except BaseException:
            self._discard(futures)
            self.cancel()
            raise
        finally:
            self.feed.release(sum(self.sample_bytes(i) for i in indices))
            self.feed.stats.wait_s += time.monotonic() - start
        self._pos += 1
        self._pump()
        return samples

    def _result(self, future: Any) -> Path:
        """A request's file, waited for in slices: a SIGTERM (`stop_requested`) ends the wait as Lightning ends a step
        (its `SIGTERMException`) instead of after the engine's deadlines."""
        while True:
            try:
                return future.result(timeout=0.25)
            except TimeoutError:
                if self.stop_requested():
                    from lightning.pytorch.utilities.exceptions import SIGTERMException

                    logger.warning("engine feed: SIGTERM received while waiting for the engine; stopping")
                    raise SIGTERMException from None

    def _read(self, ex: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
        from eagle3_zoo.targets.vllm_features import split_states

        aux, final = split_states(self.feed.read(path, ex["input_ids"].tolist()), self.final_norm)
        sample = {"input_ids": ex["input_ids"], "loss_mask": ex["loss_mask"], "aux_hidden": aux,
                  "final_hidden": final}
        return self.store.add(str(ex["id"]), sample) if self.store is not None else sample

    def fetch(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One example's sample now, outside any plan (`optim.precondition_fc`'s statistics, a hybrid store's
        missing samples)."""
        self.feed.reserve(self._bytes(example), force=True)
        try:
            return self._read(example, self._result(self._submit(example, "x")))
        finally:
            self.feed.release(self._bytes(example))

    def cancel(self) -> None:
        """Drop the requests of the current pass: unsent ones are cancelled, the files of the others deleted."""
        for pos, futures in self._pending.items():
            self.feed.release(sum(self.sample_bytes(i) for i in self._batches[pos]))
            self._discard(futures)
        self._pending.clear()

    @staticmethod
    def _discard(futures: list[Any]) -> None:
        def remove(future: Any) -> None:  # a result is a file the feed checked: this request's, in the directory
            if not future.cancelled() and future.exception() is None:
                for p in (future.result(), Path(f"{future.result()}.lock")):
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        logger.warning("engine feed: could not delete %s (%s)", p, e)

        for future in futures:
            if not future.cancel():
                future.add_done_callback(remove)


class StreamedFeatureDataset(Dataset):
    """Token examples whose states come from a `FeatureStream` (or, once a hybrid store is complete, from it)."""

    def __init__(self, examples: list[dict[str, Any]], stream: FeatureStream) -> None:
        self.examples, self.stream = examples, stream

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def lengths(self) -> list[int]:
        return [int(ex["input_ids"].shape[0]) for ex in self.examples]

    def _reader(self) -> Any:
        store = self.stream.store
        return store.reader if store is not None else None

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        reader = self._reader()
        if reader is not None:
            return [reader[reader.index_of(str(self.examples[i]["id"]))] for i in indices]
        return self.stream.take(indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        reader = self._reader()
        if reader is not None:
            return reader[reader.index_of(str(self.examples[index]["id"]))]
        return self.stream.fetch(self.examples[index])

    def begin_pass(self, batches: list[list[int]], epoch: int, training: bool) -> None:
        """A loader's pass over `batches` begins: plan it. Hybrid: a complete store is read; a training pass after the
        first completes the store first (collective: every rank's training loader begins its pass together)."""
        store = self.stream.store
        if store is not None and store.reader is None:
            if store.complete():
                store.open()
            elif training and epoch > 0:
                store.finish(self.stream.fetch)
        if self._reader() is None:
            self.stream.plan(batches)


class StreamingLoader(ResumableDataLoader):
    """A `ResumableDataLoader` that tells its dataset the batches of each pass before it fetches the first one."""

    def __init__(self, *args: Any, training: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.training = training

    def _begin_pass(self, batches: list[list[int]]) -> None:
        self.dataset.begin_pass(batches, self.batch_sampler.epoch, self.training)


class StreamingDataModule(FeatureDataModule):
    """`FeatureDataModule` over `StreamedFeatureDataset`s: the engine feed starts in `setup` and stops in `teardown`
    (or `on_exception`), when Lightning runs them on every rank. `feed` may come later, with the datasets (the run's
    DataModule learns them in its `setup`, `eagle3_zoo.training.build`); until then the hooks have nothing to do."""

    def __init__(self, train: StreamedFeatureDataset | None, val: StreamedFeatureDataset | None, feed: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(train, val, **kwargs)
        self.feed = feed

    def _streams(self) -> list[FeatureStream]:
        return [d.stream for d in (self.train_set, self.val_set) if d is not None]

    def setup(self, stage: str) -> None:
        if self.feed is None:
            return
        for stream in self._streams():
            stream.stop_requested = lambda: self.trainer is not None and self.trainer.received_sigterm
        self.feed.start()

    def teardown(self, stage: str) -> None:
        self._stop()

    def on_exception(self, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.feed is None:
            return
        for stream in self._streams():
            stream.cancel()
            if stream.store is not None:
                stream.store.suspend()
        self.feed.close()

    def _make_loader(self, dataset: Any, sampler: Any, shuffle: bool, **kwargs: Any) -> Any:
        position = self._loop_position if shuffle and self.trainer is not None else None
        return StreamingLoader(dataset, sampler, position=position, training=shuffle, **kwargs)


def streamed_datasets(recipe: Recipe, data: Any, target: Any, adapter: Any,
                      aux_ids: tuple[int, ...]) -> tuple[StreamedFeatureDataset, StreamedFeatureDataset | None, Any,
                                                         dict[str, Any]]:
    """The datasets of a run whose states are streamed from the recipe's engine, the engine feed they read, and the
    run's feature summary (what a `StreamingDataModule` loads from).

    Args:
        recipe, data: the recipe and its prepared data (`eagle3_zoo.data.prepare.PreparedData`).
        target, adapter: the target (heads only is enough: its config and final norm are read) and its adapter.
        aux_ids: the aux layers the drafter reads.
    """
    from eagle3_zoo.data.engine.feed import EngineFeed, run_tag
    from eagle3_zoo.data.feature_job import features_dir_for, store_meta
    from eagle3_zoo.targets.deployment import EngineDeployment
    from eagle3_zoo.values.dtypes import torch_dtype

    d, cfg = recipe.data, target.config
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    deployment = EngineDeployment(recipe, aux_ids, cfg.num_hidden_layers)
    feed = EngineFeed(deployment, run_tag(recipe.output_dir, rank), int(d.prefetch_disk_gib * 2**30),
                      concurrency=recipe.engine.concurrency, hidden_size=cfg.hidden_size)
    store = None
    info: dict[str, Any] = {"source": "engine", "hidden_states_dir": str(deployment.storage),
                            "engine": recipe.engine.mode}
    if d.mode == "hybrid":
        target_id = recipe.target.name_or_path
        directory = features_dir_for(d, recipe.target, data.fingerprint, target_id, aux_ids)
        store = HybridStore(directory, data.train + data.val, shard_size=d.features_shard_size,
                            dtype=d.features_dtype, meta=store_meta(target_id, aux_ids, data.fingerprint))
        info.update(features_dir=str(directory), dtype=d.features_dtype)
    kw = dict(layers=len(aux_ids) + 1, hidden_size=cfg.hidden_size,
              itemsize=torch_dtype(recipe.engine.dtype or recipe.target.dtype).itemsize,
              final_norm=final_norm_on_cpu(adapter.final_norm(target)), prefetch_batches=d.prefetch_batches,
              store=store)
    train = StreamedFeatureDataset(data.train, FeatureStream(feed, data.train, name="t", **kw))
    val = StreamedFeatureDataset(data.val, FeatureStream(feed, data.val, name="v", **kw)) if data.val else None
    return train, val, feed, info
