"""The data stage of a recipe: read -> (regenerate) -> split -> tokenise -> supervised-token counts.

`prepare_data` is shared by `fit` and the offline feature job, so both see exactly the same examples in the same
order. The counts that define the draft vocabulary are cached (`eagle3_zoo.data.vocab_cache`) under a key of the
data (file contents under location-independent keys, and every setting that changes the token stream), the
tokenizer and the draft size.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from eagle3_zoo.data.cache_keys import json_sha256, key_version
from eagle3_zoo.data.readers import ReadStats, drop_level, read_sources, split_train_val
from eagle3_zoo.data.tokenize import TokenStats, supervised_token_counts, tokenize_conversations
from eagle3_zoo.data.vocab_cache import (
    fingerprint_sources,
    load_token_counts,
    save_token_counts,
    tokenizer_fingerprint,
    vocab_cache_key,
)
from eagle3_zoo.util.fileio import atomic_write_bytes

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import DataConfig, Recipe

logger = logging.getLogger(__name__)



@dataclass
class PreparedData:
    """Examples of both splits, what was read/kept/skipped, and the train split's supervised-token counts."""

    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    read_stats: ReadStats
    token_stats: TokenStats
    counts: torch.Tensor
    fingerprint: str  # data + tokenizer + every token-stream setting
    regenerate: dict[str, Any] = field(default_factory=dict)
    val_conversations: list[Any] = field(default_factory=list)  # the held-out conversations (regenerated if so)

    def summary(self) -> dict[str, Any]:
        """Data summary for provenance.json."""
        return {
            "conversations_read": self.read_stats.read,
            "conversations_kept_by_reader": self.read_stats.kept,
            "skipped_by_reader": dict(sorted(self.read_stats.skipped.items())),
            "truncated_files": list(self.read_stats.truncated_files),
            "tokenization": self.token_stats.to_dict(),
            "train_examples": len(self.train),
            "val_examples": len(self.val),
            "train_tokens": sum(int(e["input_ids"].numel()) for e in self.train),
            "train_supervised_tokens": int(self.counts.sum()),
            "regeneration": self.regenerate,
            "fingerprint": self.fingerprint,
        }


def _examples_path(cache_dir: str | Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "tokens" / f"{fingerprint}.safetensors"


def save_examples(cache_dir: str | Path, fingerprint: str, train: list[dict[str, Any]], val: list[dict[str, Any]],
                  stats: TokenStats) -> Path:
    """Cache tokenised examples (tokenising ShareGPT-sized data takes tens of seconds; every DDP rank and every
    resumed run would repeat it). One safetensors file: concatenated ids/masks, lengths, split; ids in metadata."""
    examples = train + val
    tensors = {"input_ids": torch.cat([e["input_ids"] for e in examples]).to(torch.int32),
               "loss_mask": torch.cat([e["loss_mask"] for e in examples]).to(torch.uint8),
               "lengths": torch.tensor([e["input_ids"].numel() for e in examples], dtype=torch.int64)}
    meta = {"ids": json.dumps([str(e["id"]) for e in examples]), "num_train": str(len(train)),
            "stats": json.dumps(stats.to_dict()), "fingerprint": fingerprint}
    path = _examples_path(cache_dir, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save(tensors, metadata=meta))
    return path


def load_examples(cache_dir: str | Path, fingerprint: str) -> tuple[list, list, TokenStats] | None:
    """Examples cached by `save_examples` under `fingerprint`, or None (missing or unreadable: recomputed)."""
    path = _examples_path(cache_dir, fingerprint)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            ids, masks, lengths = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "lengths"))
        names, num_train, raw = json.loads(meta["ids"]), int(meta["num_train"]), json.loads(meta["stats"])
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        logger.warning("ignoring unreadable token cache %s (%s)", path, e)
        return None
    examples = [{"id": name, "input_ids": i.long(), "loss_mask": m.long()}
                for name, i, m in zip(names, ids.split(lengths.tolist()), masks.split(lengths.tolist()))]
    stats = TokenStats(**{**raw, "skipped": Counter(raw["skipped"])})
    return examples[:num_train], examples[num_train:], stats


def data_fingerprint(data: DataConfig, tokenizer: Any, target_id: str, answers: str | None = None) -> str:
    """Key of the token stream a recipe produces: sources (content stamps) + settings + tokenizer, and with
    regeneration the digest of the regenerated conversations (`answers_digest`): the answers are what the token
    stream depends on, so moving their file or changing a setting that leaves them unchanged (`batch_size`) keeps
    the caches, and an answer edited or generated again with other results does not reuse a stale one."""
    d = data
    if d.regenerate.enabled and answers is None:
        raise ValueError("data.regenerate.enabled: the token-stream key needs the regenerated answers' digest")
    extra = {"max_length": d.max_length, "overflow": d.overflow, "max_samples": d.max_samples,
             "on_error": d.on_error, "val_fraction": d.val_fraction, "seed": d.seed,
             "chat_template_kwargs": dict(d.chat_template_kwargs),
             "regenerate": {"answers": answers, "target": target_id} if d.regenerate.enabled else None}
    return json_sha256({"version": key_version("token_stream"), "sources": fingerprint_sources(d.sources, extra),
                        "tokenizer": tokenizer_fingerprint(tokenizer)}, "token_stream")


def answers_digest(conversations: list[Any]) -> str:
    """sha256 of the conversations' content (uid, pinned split, messages, tool definitions when any), in order."""
    return json_sha256([[c.uid, c.split, c.messages, *([c.tools] if getattr(c, "tools", None) else [])]
                        for c in conversations], "answers")


def regeneration_key(data: DataConfig, tokenizer: Any, target_id: str) -> str:
    """Key of the regenerated-answers file: what an answer depends on (the source files and their format, the
    prompt-length limit, the generation settings and chat-template kwargs, the target and its tokenizer), not which
    records a recipe selects (`max_samples`, `split`, `val_fraction`, `on_error`) nor `batch_size`. The file is a
    per-conversation cache (`eagle3_zoo.data.regenerate`), so growing `max_samples` generates only the
    conversations not answered yet."""
    d, r = data, data.regenerate
    settings = {"max_length": d.max_length, "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
                "max_turns": r.max_turns, "seed": d.seed if r.temperature > 0 else None, "target": target_id,
                "chat_template_kwargs": dict(d.chat_template_kwargs)}
    return json_sha256({"version": key_version("regeneration"),
                        "sources": fingerprint_sources(d.sources, settings, selection=False),
                        "tokenizer": tokenizer_fingerprint(tokenizer)}, "regeneration")


def regenerated_path(data: DataConfig, tokenizer: Any, target_id: str) -> Path:
    """`data.regenerate.output`, or `<cache_dir>/regenerated/<regeneration_key>.jsonl`."""
    out = data.regenerate.output
    if out:
        return Path(out)
    return Path(data.cache_dir) / "regenerated" / f"{regeneration_key(data, tokenizer, target_id)[:16]}.jsonl"


MIN_VALIDATION_EXAMPLES = 16  # fewer, and val/loss and val/acc_k say more about which conversations than the drafter


def _warn_small_validation(n_val: int, conversations: int, val_fraction: float, demo: bool = False) -> None:
    """A warning, with how to get a bigger one, when the validation split is too small to mean anything; in a demo
    run (`demo: true`, the quickstart's smoke slice) the same as information: a small slice is its point."""
    if not n_val or n_val >= MIN_VALIDATION_EXAMPLES:
        return
    if demo:
        logger.info("validation set: %d examples (data.val_fraction=%g of %d conversations; a demo run: val/loss and "
                    "val/acc_k on so few are noise)", n_val, val_fraction, conversations)
        return
    fraction = min(0.5, -(-MIN_VALIDATION_EXAMPLES * 100 // max(conversations, 1)) / 100)
    logger.warning("validation set: only %d examples (data.val_fraction=%g of %d conversations): val/loss and "
                   "val/acc_k measured on so few are noise. For a validation set of %d or more, set "
                   "data.val_fraction=%g, or raise data.max_samples, or add a data source with split: val",
                   n_val, val_fraction, conversations, MIN_VALIDATION_EXAMPLES, fraction)


def prepare_data(recipe: Recipe, tokenizer: Any, adapter: Any, target: Any = None, target_id: str = "",
                 vocab_size: int | None = None, split: Any = None) -> PreparedData:
    """Run the data stage of `recipe` (see the module docstring).

    Args:
        recipe: a loaded `Recipe`.
        tokenizer, adapter: the target's.
        target: the target model (needed only when `data.regenerate.enabled`).
        target_id: the target's name or path (part of the regeneration key).
        vocab_size: the target vocabulary size (default `len(tokenizer)`).
        split: this process's share of the regeneration (`eagle3_zoo.data.ranks.RankSplit`); default: found among
            the ranks of a torch.distributed run that share the cache (`split_for`), else all of it.

    Raises:
        DataError: bad records with `data.on_error=raise`, or no usable example left.
    """
    d = recipe.data
    conversations, read_stats = read_sources(d.sources, on_error=d.on_error, max_samples=d.max_samples)
    regen: dict[str, Any] = {}
    if d.regenerate.enabled:
        from eagle3_zoo.data.ranks import split_for
        from eagle3_zoo.data.regenerate import regenerate_conversations

        path = regenerated_path(d, tokenizer, target_id)
        if split is None:
            split = split_for(path.parent)  # collective under torch.distributed: before any early return
        if d.regenerate.backend != "hf":  # an OpenAI-compatible server: same file, same key, same rank split
            from eagle3_zoo.data.engine.regenerate_server import regenerate_for_recipe

            conversations, rstats = regenerate_for_recipe(recipe, conversations, tokenizer, adapter, path, split=split)
        elif target is None:
            raise ValueError("data.regenerate.enabled needs the target model")
        else:
            conversations, rstats = regenerate_conversations(
                conversations, target, tokenizer, adapter, path, max_new_tokens=d.regenerate.max_new_tokens,
                temperature=d.regenerate.temperature, batch_size=d.regenerate.batch_size, max_length=d.max_length,
                max_turns=d.regenerate.max_turns, seed=d.seed, template_kwargs=d.chat_template_kwargs,
                split=split)
        regen = {"path": str(path), **rstats.to_dict()}
        dropped = rstats.skipped.get("prompt_too_long", 0)
        if dropped:  # long prompts in a slice of real chats: information, unless they are a large share
            logger.log(drop_level(dropped, dropped + rstats.conversations),
                       "regeneration: dropped %d of %d conversations whose first prompt already has data.max_length=%d "
                       "tokens or more (no room left for an answer); raise data.max_length to keep them", dropped,
                       dropped + rstats.conversations, d.max_length)
    answers = answers_digest(conversations) if d.regenerate.enabled else None
    fingerprint = data_fingerprint(d, tokenizer, target_id, answers)
    train_c, val_c = split_train_val(conversations, d.val_fraction, d.seed)
    cached = load_examples(d.cache_dir, fingerprint)
    if cached is not None:
        train, val, token_stats = cached
        where = f"from the cache, key {fingerprint[:12]}..."
    else:
        token_stats, where = TokenStats(), "tokenised now"
        kw = dict(max_length=d.max_length, overflow=d.overflow, on_error=d.on_error, stats=token_stats,
                  template_kwargs=dict(d.chat_template_kwargs), log=False)
        train, _ = tokenize_conversations(train_c, tokenizer, adapter, **kw)
        val, _ = tokenize_conversations(val_c, tokenizer, adapter, **kw)
        if train:
            save_examples(d.cache_dir, fingerprint, train, val, token_stats)
    logger.log(drop_level(token_stats.num_skipped, token_stats.conversations), "%s; %d train + %d validation examples "
               "(%s)", token_stats.summary(d.max_length), len(train), len(val), where)
    _warn_small_validation(len(val), len(train_c) + len(val_c), d.val_fraction, demo=recipe.demo)
    if not train:
        from eagle3_zoo.data.readers import DataError

        raise DataError(f"no usable training example: {read_stats.summary()}; {token_stats.summary()}")
    vocab_size = vocab_size or len(tokenizer)
    key = vocab_cache_key(fingerprint, tokenizer_fingerprint(tokenizer), recipe.drafter.draft_vocab_size)
    counts = load_token_counts(d.cache_dir, key)
    if counts is None or counts.numel() != vocab_size:
        counts = supervised_token_counts(train, vocab_size)
        save_token_counts(d.cache_dir, key, counts, meta={"examples": len(train)})
    else:
        logger.info("draft-vocab token counts from the cache (key %s...)", key[:12])
    return PreparedData(train=train, val=val, read_stats=read_stats, token_stats=token_stats, counts=counts,
                        fingerprint=fingerprint, regenerate=regen, val_conversations=val_c)
