"""Batches for training: length-bucketed, deterministic, resumable mid-epoch, right-padded.

Online mode serves tokens only (`input_ids`, `loss_mask`; the target runs in the training step); offline mode
serves tokens plus the stored target features (`aux_hidden`, `final_hidden`) from a `FeatureReader`.

Batching: the sampler builds *global* batches of `batch_size * world_size` examples (shuffled with
`seed + epoch`, then sorted by length inside windows of `bucket_batches` global batches, so each batch holds
similar lengths and little padding), and rank r takes slice r of each global batch. The data seen by one
optimizer step is therefore the same for 1 process x batch 2b and 2 processes x batch b.

Resuming: Lightning saves the state of a loader that implements `state_dict`/`load_state_dict`. The state is the
epoch and the number of batches the training loop has *consumed*, read from the Trainer's own counters (the loader
itself runs one batch ahead because Lightning prefetches); the restored loader skips exactly those batches, so a
run resumed from a mid-epoch checkpoint sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

PAD_FIELDS_FLOAT = ("aux_hidden", "final_hidden")


class ExampleDataset(Dataset):
    """Token examples `{"input_ids": [T], "loss_mask": [T]}` (online mode)."""

    def __init__(self, examples: Sequence[dict[str, torch.Tensor]]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ex = self.examples[index]
        return {"input_ids": ex["input_ids"], "loss_mask": ex["loss_mask"]}

    @property
    def lengths(self) -> list[int]:
        return [int(ex["input_ids"].shape[0]) for ex in self.examples]


class FeatureDataset(Dataset):
    """A subset of a feature store, by sample id (offline mode)."""

    def __init__(self, reader: Any, sample_ids: Sequence[str]):
        self.reader = reader
        self.indices = [reader.index_of(sid) for sid in sample_ids]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.reader[self.indices[index]]

    @property
    def lengths(self) -> list[int]:
        return [int(self.reader.token_counts[i]) for i in self.indices]


def collate_right_padded(samples: Sequence[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: `attention_mask` and `loss_mask` are 0 on pads, features 0.

    Packed samples (`eagle3_zoo.data.packing`) also carry `position_ids` (0 on pads) and `document_ids`; a row's pads
    form one more document after its last, so document ids never decrease along a row."""
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    b, t = len(samples), max(lengths)
    batch = {
        "input_ids": torch.full((b, t), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.long),
    }
    for name in PAD_FIELDS_FLOAT:
        if name in samples[0]:
            ref = samples[0][name]
            batch[name] = torch.zeros(b, t, *ref.shape[1:], dtype=ref.dtype)
    packed = "document_ids" in samples[0]
    if packed:
        batch["position_ids"] = torch.zeros(b, t, dtype=torch.long)
        batch["document_ids"] = torch.zeros(b, t, dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        if packed:
            batch["position_ids"][i, :n] = s["position_ids"]
            batch["document_ids"][i, :n] = s["document_ids"]
            batch["document_ids"][i, n:] = int(s["document_ids"][-1]) + 1
        batch["input_ids"][i, :n] = s["input_ids"]
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = s["loss_mask"].long()
        for name in PAD_FIELDS_FLOAT:
            if name in batch:
                batch[name][i, :n] = s[name]
    return batch


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Deterministic length-bucketed batches, sharded over ranks (see the module docstring).

    Args:
        lengths: token length of each example.
        batch_size: per-rank batch size.
        num_replicas: data-parallel world size.
        rank: this rank.
        shuffle: shuffle examples and batch order per epoch (`seed + epoch`); off = one fixed order (validation).
        seed: shuffling seed.
        drop_last: drop the last incomplete global batch (training); otherwise it is filled by wrapping around to
            the first examples so every rank gets a batch (only needed with several ranks).
        bucket_batches: global batches per length-sorting window (larger = less padding, less randomness).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, bucket_batches: int = 50):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside world size {num_replicas}")
        self.lengths = list(lengths)
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.bucket_batches = shuffle, seed, drop_last, bucket_batches
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip) from a checkpoint

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, consumed: int) -> None:
        """Skip the first `consumed` batches the next time `epoch` is iterated (mid-epoch checkpoint)."""
        self._resume = (int(epoch), int(consumed))

    def planned(self) -> list[list[int]]:
        """The batches the next iteration yields: this rank's share of this epoch's global batches, after the skip
        of a resumed epoch (a loader that fetches ahead, `eagle3_zoo.data.engine.stream`, requests them up front)."""
        skip = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        b = self.batch_size
        return [batch[self.rank * b : (self.rank + 1) * b] if self.num_replicas > 1 else batch
                for batch in self.global_batches()[skip:]]

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches (`batch_size * num_replicas` example indices each)."""
        n, size = len(self.lengths), self.batch_size * self.num_replicas
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=gen).tolist() if self.shuffle else list(range(n))
        window = size * self.bucket_batches
        batches = []
        for start in range(0, n, window):
            chunk = sorted(order[start : start + window], key=lambda i: -self.lengths[i])  # stable: ties keep order
            batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        if batches and len(batches[-1]) < size:
            last = batches.pop()  # the only short one: the tail of the last window
            if not self.drop_last:
                pad = (order * math.ceil(size / max(n, 1)))[: size - len(last)] if self.num_replicas > 1 else []
                batches.append(last + pad)
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=gen).tolist()
            batches = [batches[i] for i in perm]
        return batches

    def __iter__(self):
        batches = self.planned()
        self._resume = None
        yield from batches

    def __len__(self) -> int:
        n, size = len(self.lengths), self.batch_size * self.num_replicas
        return n // size if self.drop_last else math.ceil(n / size)


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `LengthBucketBatchSampler` whose position Lightning checkpoints (see module docstring).

    Args:
        position: returns (epoch, batches consumed in that epoch) from the Trainer; None = count locally
            (epoch = number of `iter()` calls, consumed = batches yielded).
    """

    def __init__(self, dataset: Dataset, batch_sampler: LengthBucketBatchSampler,
                 position: Callable[[], tuple[int, int]] | None = None, **kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._position = position
        self._local_epoch, self._yielded = -1, 0

    def __iter__(self):
        if self._position is not None:
            epoch = self._position()[0]
        else:
            self._local_epoch += 1
            epoch = self._local_epoch
        self.batch_sampler.set_epoch(epoch)
        resume = self.batch_sampler._resume
        # a restored position keeps counting from where it was, so a second checkpoint in this epoch is right too
        self._yielded = resume[1] if resume is not None and resume[0] == epoch else 0
        self._begin_pass(self.batch_sampler.planned())
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def _begin_pass(self, batches: list[list[int]]) -> None:
        """Called before a pass over `batches` (this rank's, in order) starts; a loader that fetches ahead hooks in."""

    def state_dict(self) -> dict[str, int]:
        epoch, consumed = self._position() if self._position is not None else (self._local_epoch, self._yielded)
        return {"epoch": int(epoch), "consumed": int(consumed), "seed": self.batch_sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.batch_sampler.seed) != self.batch_sampler.seed:
            raise ValueError(f"checkpoint data order used seed {state['seed']}, this run {self.batch_sampler.seed}: "
                             "resume with the same data.seed")
        self.batch_sampler.resume(state["epoch"], state["consumed"])
        if self._position is None:
            self._local_epoch = state["epoch"] - 1


def _rows(dataset: Dataset) -> str:
    examples = getattr(dataset, "num_examples", None)
    return "examples" if examples is None else f"rows ({examples} examples packed)"


class FeatureDataModule(L.LightningDataModule):
    """Train/val loaders over token examples (online) or feature-store samples (offline).

    Args:
        train: the training dataset (`ExampleDataset` or `FeatureDataset`, anything with `lengths`).
        val: the validation dataset, or None.
        batch_size: per-device batch size.
        seed: data-order seed.
        num_workers: DataLoader worker processes.
        pad_id: id written into padded `input_ids` positions (never attended, never supervised).
        pack_length: pack several examples per row, up to this many tokens (`data.packing`: `data.max_length`);
            None = one example per row.
    """

    def __init__(self, train: Dataset, val: Dataset | None = None, *, batch_size: int = 1, seed: int = 0,
                 num_workers: int = 0, pad_id: int = 0, pack_length: int | None = None):
        super().__init__()
        self.batch_size, self.seed, self.num_workers, self.pad_id = batch_size, seed, num_workers, pad_id
        self.use_datasets(train, val, pack_length)

    def use_datasets(self, train: Dataset | None, val: Dataset | None, pack_length: int | None = None) -> None:
        """Load from `train` and `val` (packed into rows of up to `pack_length` tokens when it is given)."""
        if pack_length is not None and train is not None:
            from eagle3_zoo.data.packing import PackedDataset

            train = PackedDataset(train, pack_length)
            val = PackedDataset(val, pack_length) if val is not None and len(val) else val
        self.train_set, self.val_set = train, val

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _loop_position(self) -> tuple[int, int]:
        loop = self.trainer.fit_loop
        return loop.epoch_progress.current.processed, loop.epoch_loop.batch_progress.current.ready

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        world, rank = self._world()
        sampler = LengthBucketBatchSampler(dataset.lengths, self.batch_size, num_replicas=world, rank=rank,
                                           shuffle=shuffle, seed=self.seed, drop_last=shuffle)
        if shuffle and len(sampler) == 0:
            raise ValueError(f"{len(dataset)} training {_rows(dataset)} cannot fill one batch of {self.batch_size} x "
                             f"{world} device(s): add data or lower trainer.batch_size")
        kwargs = dict(num_workers=self.num_workers, collate_fn=functools.partial(collate_right_padded,
                      pad_id=self.pad_id), persistent_workers=self.num_workers > 0)
        return self._make_loader(dataset, sampler, shuffle, **kwargs)

    def _make_loader(self, dataset: Dataset, sampler: LengthBucketBatchSampler, shuffle: bool,
                     **kwargs: Any) -> DataLoader:
        if not shuffle:  # validation: a fixed order, nothing to resume
            return DataLoader(dataset, batch_sampler=sampler, **kwargs)
        position = self._loop_position if self.trainer is not None else None
        return ResumableDataLoader(dataset, sampler, position=position, **kwargs)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None or len(self.val_set) == 0:
            return []
        return self._loader(self.val_set, shuffle=False)
