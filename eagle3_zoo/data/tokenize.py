"""Conversations -> training examples through the target adapter, with every skip counted by reason.

An example is `{"id", "input_ids" [T] long, "loss_mask" [T] long}`. The drafter at position t predicts token
t+2, so a usable example needs at least 3 tokens and a supervised token at position >= 2; others are skipped
("too_short", "no_supervised_tokens") and counted, never dropped silently. Conversations longer than
`max_length` are truncated (counted) or dropped ("too_long"), per `data.overflow`. Conversations the chat template
cannot map are a "template_error" skip, or a `DataError` naming the file and record index with `on_error=raise`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_zoo.data.readers import DataError

logger = logging.getLogger(__name__)

OVERFLOW = ("truncate", "drop")
MIN_TOKENS = 3  # x_0, x_1 (features + embedding) and the predicted x_2


@dataclass
class TokenStats:
    """What tokenisation kept and skipped."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    tokens: int = 0
    supervised_tokens: int = 0

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self, max_length: int | None = None) -> str:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items())) or "none"
        limit = f" at data.max_length={max_length}" if max_length else ""
        return (f"tokenised {self.conversations} conversations: kept {self.kept} ({self.tokens} tokens, "
                f"{self.supervised_tokens} supervised), truncated {self.truncated}{limit}, dropped "
                f"{self.num_skipped} ({reasons})")

    def to_dict(self) -> dict[str, Any]:
        return {"conversations": self.conversations, "kept": self.kept, "truncated": self.truncated,
                "skipped": dict(sorted(self.skipped.items())), "tokens": self.tokens,
                "supervised_tokens": self.supervised_tokens}


def _where(conv: Any) -> str:
    return f"{getattr(conv, 'source', '?')}: record {getattr(conv, 'index', '?')}"


def tokenize_conversations(
    conversations: Iterable[Any],
    tokenizer: Any,
    adapter: Any,
    *,
    max_length: int,
    overflow: str = "truncate",
    on_error: str = "raise",
    system_prompt: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    stats: TokenStats | None = None,
    log: bool = True,
) -> tuple[list[dict[str, Any]], TokenStats]:
    """Build `{"id", "input_ids", "loss_mask"}` examples with `adapter.build_example`.

    Args:
        conversations: `Conversation`s (from `eagle3_zoo.data.readers`); their messages are validated as
            `eagle3_zoo.chat.conversation.Message`s and rendered with the template and `template_kwargs` that
            `eagle3_zoo.chat.formats.render_prompt` renders evaluation prompts with; their ``tools`` reach the
            template.
        tokenizer: the target tokenizer.
        adapter: the target adapter.
        max_length: maximum tokens per example.
        overflow: "truncate" (right-truncate) or "drop" longer conversations.
        on_error: "raise" a `DataError` for a conversation the chat template cannot map, or "skip" it (counted).
        system_prompt: passed to `build_example`.
        template_kwargs: chat-template variables (recipe `data.chat_template_kwargs`), passed to `build_example`.
        stats: accumulated in place when given.
        log: log the stats' summary (off when the caller logs several calls' stats as one line).

    Returns:
        The examples and the stats.
    """
    if overflow not in OVERFLOW:
        raise ValueError(f"unknown overflow policy {overflow!r} (recipe data.overflow); valid: {', '.join(OVERFLOW)}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"unknown on_error {on_error!r} (recipe data.on_error); valid: raise, skip")
    stats = stats if stats is not None else TokenStats()
    examples = []
    for conv in conversations:
        stats.conversations += 1
        try:
            # one token past the limit tells "fits" from "was cut" without tokenising everything twice
            ex = adapter.build_example(tokenizer, conv.messages, max_length + 1, system_prompt=system_prompt,
                                       template_kwargs=template_kwargs, tools=getattr(conv, "tools", None))
        except ValueError as e:  # TemplateMappingError is a ValueError, as are malformed messages
            if on_error == "raise":
                raise DataError(f"{_where(conv)}: cannot build a training example: {e}; set data.on_error=skip to "
                                "skip such conversations (they are counted and logged)") from e
            stats.skipped["template_error"] += 1
            continue
        input_ids, loss_mask = ex["input_ids"], ex["loss_mask"]
        if input_ids.numel() > max_length:
            if overflow == "drop":
                stats.skipped["too_long"] += 1
                continue
            stats.truncated += 1
            input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if input_ids.numel() < MIN_TOKENS:
            stats.skipped["too_short"] += 1
            continue
        if not bool(loss_mask[2:].any()):
            stats.skipped["no_supervised_tokens"] += 1
            continue
        stats.kept += 1
        stats.tokens += int(input_ids.numel())
        stats.supervised_tokens += int(loss_mask.sum())
        examples.append({"id": getattr(conv, "uid", str(stats.conversations - 1)),
                         "input_ids": input_ids.long(), "loss_mask": loss_mask.long()})
    if log:
        logger.log(logging.WARNING if stats.num_skipped else logging.INFO, "%s", stats.summary())
    return examples, stats


def supervised_token_counts(examples: Sequence[dict[str, Any]], vocab_size: int) -> torch.Tensor:
    """Counts of target token ids at supervised positions (the draft-vocabulary statistic), int64 `[vocab_size]`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ex in examples:
        ids = ex["input_ids"][ex["loss_mask"].bool()]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"example {ex.get('id')}: token id {int(ids.max())} >= target vocab size {vocab_size} "
                             "(tokenizer and model disagree)")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def draft_vocab_coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of supervised tokens whose id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d.to(counts.device)].sum()) / total if total else 0.0
