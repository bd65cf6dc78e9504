"""Regenerate assistant turns with the target itself (EAGLE-3 trains on the target's own answers).

Each assistant turn is replaced, in order, by the target's reply to the conversation so far (user turns kept,
earlier assistant turns already regenerated); with `max_turns`, the conversation ends after that many answers (the
cost of regeneration grows with every turn). Conversations are processed `batch_size` at a time, batched by the
length of their first prompt (less padding, rows finishing together); prompts are left-padded so one `generate`
call serves the whole batch. Greedy when `temperature == 0`, sampling otherwise.

Resumable: every finished conversation is appended to a JSONL file (`{"id", "source", "index", "messages"}`) with
one `write()` per line on an `O_APPEND` descriptor, fsynced per batch. A rerun reads the ids already there and
only generates the rest; a torn last line (killed mid-write) is cut off first. An exclusive lock on the file keeps
concurrent processes (ranks of a launcher that starts them all at once) from generating the same data twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.data.readers import Conversation

logger = logging.getLogger(__name__)


@dataclass
class RegenerateStats:
    reused: int = 0
    generated: int = 0
    turns: int = 0
    skipped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"reused": self.reused, "generated": self.generated, "turns": self.turns,
                "skipped": dict(self.skipped)}


def _load_done(path: Path) -> dict[str, list[dict[str, str]]]:
    """Finished records by id; cuts a torn trailing line (no newline or invalid JSON) off the file."""
    done: dict[str, list[dict[str, str]]] = {}
    if not path.exists():
        return done
    data = path.read_bytes()
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        done[str(record["id"])] = record["messages"]
        good += len(line)
    if good != len(data):
        logger.warning("%s: cutting %d bytes of a torn last record left by an interrupted run", path, len(data) - good)
        with open(path, "rb+") as f:
            f.truncate(good)
    return done


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process regenerates this file
        yield


def _end_ids(tokenizer: Any, adapter: Any) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    with contextlib.suppress(ValueError):
        eot = tokenizer.convert_tokens_to_ids(adapter.chat_format(tokenizer).end_of_turn)
        if isinstance(eot, int) and eot != tokenizer.unk_token_id:
            ids.add(eot)
    return sorted(ids)


def _render_prompt(tokenizer: Any, adapter: Any, messages: list[dict[str, str]]) -> list[int]:
    template = getattr(tokenizer, "chat_template", None) or adapter.chat_format(tokenizer).template
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate_replies(model: Any, prompts: Sequence[list[int]], *, max_new_tokens: int, temperature: float,
                     pad_id: int, end_ids: list[int]) -> list[list[int]]:
    """One batched `generate` over left-padded prompts; returns each reply's ids up to (excluding) the end token."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p) :] = 1
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=end_ids, **sampling)
    replies = []
    for row in out[:, width:].tolist():
        cut = next((j for j, tok in enumerate(row) if tok in end_ids), len(row))
        replies.append(row[:cut])
    return replies


def regenerate_conversations(
    conversations: Sequence[Conversation],
    model: Any,
    tokenizer: Any,
    adapter: Any,
    out_path: str | Path,
    *,
    max_new_tokens: int = 1024,
    temperature: float = 0.0,
    batch_size: int = 8,
    max_length: int | None = None,
    max_turns: int | None = None,
    seed: int = 0,
) -> tuple[list[Conversation], RegenerateStats]:
    """Replace every assistant turn by the target's own reply; resumable (see the module docstring).

    Args:
        conversations: normalised conversations (user/assistant/system messages).
        model: the target (`generate`-capable causal LM).
        tokenizer, adapter: the target's tokenizer and adapter (chat template, end-of-turn token).
        out_path: the JSONL file of regenerated conversations (appended to; reused on rerun).
        max_new_tokens: cap per reply.
        temperature: 0 = greedy, else sampling at this temperature.
        batch_size: conversations per `generate` call.
        max_length: a turn whose prompt already has this many tokens is dropped with the rest of the conversation
            (training would truncate it anyway).
        max_turns: answer at most this many assistant turns per conversation and drop what follows; None = all.
        seed: sampling seed (per batch, so a rerun samples the remaining batches reproducibly).

    Returns:
        The regenerated conversations in input order (same ids/sources/indices), and stats.
    """
    out_path = Path(out_path)
    stats = RegenerateStats()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    end_ids = _end_ids(tokenizer, adapter)
    with _locked(out_path):
        done = _load_done(out_path)
        todo = [c for c in conversations if c.uid not in done]
        # similar prompt lengths share a batch; a stable sort keeps the order (and so resumption) deterministic
        todo.sort(key=lambda c: len(next((m["content"] for m in c.messages if m["role"] != "assistant"), "")))
        stats.reused = len(conversations) - len(todo)
        if todo:
            logger.info("regenerating %d conversations with the target (%d already in %s)", len(todo), stats.reused,
                        out_path)
        fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for start in range(0, len(todo), batch_size):
                batch = todo[start : start + batch_size]
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed + start)
                    results = _regenerate_batch(batch, model, tokenizer, adapter, max_new_tokens, temperature,
                                                max_length, max_turns, pad_id, end_ids, stats)
                for conv, messages in zip(batch, results):
                    record = {"id": conv.uid, "source": conv.source, "index": conv.index, "messages": messages}
                    os.write(fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())
                    done[conv.uid] = messages
                os.fsync(fd)
                stats.generated += len(batch)
                logger.info("regenerated %d/%d conversations", stats.generated, len(todo))
        finally:
            os.close(fd)
    out = []
    for conv in conversations:
        messages = done[conv.uid]
        if not any(m["role"] == "assistant" for m in messages):
            stats.skipped["prompt_too_long"] += 1
            continue
        out.append(replace(conv, messages=messages))  # keeps source_key: the uid stays location-free
    return out, stats


def _regenerate_batch(batch: Sequence[Conversation], model: Any, tokenizer: Any, adapter: Any, max_new_tokens: int,
                      temperature: float, max_length: int | None, max_turns: int | None, pad_id: int,
                      end_ids: list[int], stats: RegenerateStats) -> list[list[dict[str, str]]]:
    """Turn by turn over the batch: round j answers the j-th assistant turn of every conversation that has one."""
    new: list[list[dict[str, str]]] = [[] for _ in batch]
    pending = [list(c.messages) for c in batch]  # messages not yet copied/answered
    open_ = set(range(len(batch)))
    answered = 0
    while open_ and (max_turns is None or answered < max_turns):
        prompts, who = [], []
        for i in sorted(open_):
            while pending[i] and pending[i][0]["role"] != "assistant":
                new[i].append(pending[i].pop(0))
            if not pending[i]:
                open_.discard(i)
                continue
            prompt = _render_prompt(tokenizer, adapter, new[i])
            if max_length is not None and len(prompt) >= max_length:
                pending[i] = []  # the rest of the conversation would be truncated away in training
                while new[i] and new[i][-1]["role"] != "assistant":
                    new[i].pop()
                open_.discard(i)
                continue
            prompts.append(prompt)
            who.append(i)
        if not prompts:
            break
        replies = generate_replies(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                   pad_id=pad_id, end_ids=end_ids)
        for i, reply in zip(who, replies):
            pending[i].pop(0)  # the original assistant turn
            new[i].append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True).strip()})
            stats.turns += 1
        answered += 1
    return new
