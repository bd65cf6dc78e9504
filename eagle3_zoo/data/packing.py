"""Sequence packing (`data.packing`): several conversations per row, up to `data.max_length` tokens.

Packs are made once, by best-fit decreasing over the examples' lengths (each example goes into the fullest pack it
still fits in), so they depend only on the lengths: the same on every rank and on resume. The length-bucketed
sampler then shuffles and batches the packs as it batches examples (`eagle3_zoo.data.datamodule`).

A packed sample concatenates its conversations' token-aligned tensors (ids, loss mask, stored features) and adds
`position_ids` (restarting at 0 in each conversation: the RoPE positions each one has alone) and `document_ids`
(0, 1, ... per conversation). The training step keeps every conversation to itself with them: TTT attention never
crosses a document, no position is trained on a token of the next one, and the target (online) sees the positions
restart (`eagle3_zoo.training.module`). The loss of a packed batch equals the loss of its conversations unpacked.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into packs of at most `capacity` tokens (best-fit decreasing).

    Longest first (ties by index), each into the pack with the least room that still holds it, else a new pack.
    An example longer than `capacity` (the data stage never makes one) gets a pack of its own: nothing is dropped.
    """
    if capacity < 1:
        raise ValueError(f"pack capacity must be >= 1 token, got {capacity}")
    packs: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, pack index), sorted
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = int(lengths[i])
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, p = room.pop(at)
            packs[p].append(i)
            if free - n > 0:
                bisect.insort(room, (free - n, p))
        else:
            packs.append([i])
            if capacity - n > 0:
                bisect.insort(room, (capacity - n, len(packs) - 1))
    return packs


def concat_documents(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed sample: every token-aligned tensor concatenated, plus `position_ids` and `document_ids`."""
    out = {name: torch.cat([s[name] for s in samples]) for name in samples[0]}
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    out["position_ids"] = torch.cat([torch.arange(n) for n in lengths])
    out["document_ids"] = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths))
    return out


class PackedDataset(Dataset):
    """`dataset`'s examples packed into rows of at most `capacity` tokens (`pack_lengths`).

    Args:
        dataset: any dataset with `lengths` whose items are dicts of token-aligned tensors (`ExampleDataset`,
            `FeatureDataset`).
        capacity: tokens per row (`data.max_length`).
    """

    def __init__(self, dataset: Any, capacity: int):
        self.dataset, self.capacity = dataset, capacity
        example_lengths = dataset.lengths
        self.packs = pack_lengths(example_lengths, capacity)
        self._lengths = [sum(example_lengths[i] for i in pack) for pack in self.packs]

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return concat_documents([self.dataset[i] for i in self.packs[index]])

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    @property
    def num_examples(self) -> int:
        return len(self.dataset)


def padding_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Fraction of the padded `[B, T_max]` tokens of `batches` (lists of indices into `lengths`) that are padding."""
    real = sum(lengths[i] for batch in batches for i in batch)
    total = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches if batch)
    return 1.0 - real / total if total else 0.0
