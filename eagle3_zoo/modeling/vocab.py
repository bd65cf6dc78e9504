"""Draft vocabulary: the `draft_vocab_size` most frequent supervised target tokens, as (d2t, t2d) buffers."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn token counts over supervised positions into the EAGLE-3 vocabulary mapping.

    Keeps the `draft_vocab_size` most frequent target ids (ties broken by the lower id, so the result is
    deterministic), sorted ascending by id. When the data has fewer distinct tokens than `draft_vocab_size`,
    the remaining slots are filled with the lowest unused ids (zero-count ids sort by id).

    Args:
        counts: `[vocab_size]` non-negative counts of target token ids.
        draft_vocab_size: number of draft tokens, `1 <= draft_vocab_size <= vocab_size`.

    Returns:
        `d2t` int64 `[draft_vocab_size]` offsets (`target_id = draft_id + d2t[draft_id]`) and `t2d` bool
        `[vocab_size]` marking the target ids in the draft vocabulary.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D over the target vocabulary, got shape {tuple(counts.shape)}")
    vocab_size = counts.numel()
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int):
        raise ValueError(f"draft_vocab_size must be an int, got {draft_vocab_size!r}")
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be between 1 and the target vocab size "
                         f"{vocab_size}")
    if (counts < 0).any():
        raise ValueError("counts must be non-negative")
    distinct = int((counts > 0).sum())
    if distinct < draft_vocab_size:  # small data (a smoke slice): nothing wrong, only lm_head rows that go unused
        log.info("draft vocabulary: the data has %d distinct supervised tokens for %d slots; the other %d slots hold "
                 "the lowest unused ids (never supervised; drafter.draft_vocab_size=%d would spend no lm_head rows on "
                 "them)", distinct, draft_vocab_size, draft_vocab_size - distinct, max(distinct, 1))
    # stable sort on -count: equal counts keep ascending id order
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def identity_vocab(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mapping for a drafter whose draft vocabulary is the whole target vocabulary."""
    return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)


def draft_ids_of(t2d: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary in draft order (ascending), from `t2d`."""
    return t2d.nonzero().squeeze(-1)
