"""Regeneration through an OpenAI-compatible server (`data.regenerate.backend: openai | vllm`).

Same contract as `eagle3_zoo.data.regenerate` (the in-process `hf` backend): the same JSONL file and cache key, the
same record format (`{"id", "source", "index", "messages"}`), the same prompts (the conversation so far rendered
with the target's chat template, sent as token ids to ``/v1/completions`` so the server does not re-render or
re-tokenize it), the same stop tokens and `max_length`/`max_turns` rules. When the server returns the answer's token
ids (vLLM: ``return_token_ids``) they are decoded here with the target's tokenizer exactly as the `hf` backend
decodes its own output; otherwise the server's text is used.

Every answer is checked before it is kept (`reply_of`): a JSON object with a ``choices`` list, token ids that are
integers inside the tokenizer's vocabulary, or else a text string, and not empty unless the server says the model
stopped at once. A refused answer is never cached: with `data.on_error: raise` the run stops naming the URL, the
conversation and what is wrong; with `skip` the conversation is left out, counted (`server_answer_refused`) and
asked again by the next run.

Conversations are independent requests, `concurrency` in flight at once (the server batches them). Each finished
conversation is appended as one line (one `write()` on an `O_APPEND` descriptor, fsynced), so a run killed at any
moment (or a server that dies) leaves only whole conversations, and a rerun answers exactly the rest. When a
request still fails after its retries, the conversations already finished are kept and the error says how many.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from eagle3_zoo.adapters.chat import thinking_enabled
from eagle3_zoo.data.readers import Conversation
from eagle3_zoo.data.regenerate import (
    RegenerateStats,
    _end_ids,
    _load_done,
    _locked,
    _render_prompt,
    _to_answer,
    collect_regenerated,
    decode_reply,
    reply_message,
)
from eagle3_zoo.targets.openai_client import BadAnswerError, OpenAIClient, ServerError

logger = logging.getLogger(__name__)


def regenerate_with_client(
    conversations: Sequence[Conversation],
    client: OpenAIClient,
    tokenizer: Any,
    adapter: Any,
    out_path: str | Path,
    *,
    model: str | None = None,
    max_new_tokens: int = 1024,
    temperature: float = 0.0,
    max_length: int | None = None,
    max_turns: int | None = None,
    concurrency: int = 4,
    seed: int = 0,
    template_kwargs: dict[str, Any] | None = None,
    on_error: str = "raise",
) -> tuple[list[Conversation], RegenerateStats]:
    """Replace every assistant turn by the served target's reply; resumable (see the module docstring).

    Args:
        conversations: normalised conversations.
        client: the server (`OpenAIClient`: base URL, API key variable, timeout, retries).
        tokenizer, adapter: the target's tokenizer and adapter (chat template, end-of-turn token).
        out_path: the JSONL file of regenerated conversations (shared with the `hf` backend).
        model: the served model name (default: the first of ``/v1/models``).
        concurrency: conversations in flight at once.
        on_error: an answer that is refused (see the module docstring): "raise" stops the run, "skip" leaves its
            conversation out (counted as `server_answer_refused`, asked again by the next run).
        Others: as `eagle3_zoo.data.regenerate.regenerate_conversations` (`template_kwargs` included).

    Raises:
        ServerError: the server is down at the start, or a request kept failing (the message counts what was kept).
        BadAnswerError: an answer was refused with `on_error="raise"` (the message counts what was kept).
    """
    out_path = Path(out_path)
    stats = RegenerateStats()
    end_ids = _end_ids(tokenizer, adapter)
    with _locked(out_path):
        done = _load_done(out_path)
        todo = [c for c in conversations if c.uid not in done]
        stats.reused = len(conversations) - len(todo)
        if todo:
            client.check()  # server down at the start: one clear error naming the URL, nothing written
            model = model or client.models()[0]
            logger.info("regenerating %d conversations through %s (%s, %d in flight; %d already in %s)", len(todo),
                        client.base_url, model, concurrency, stats.reused, out_path)
            _run(todo, client, model, tokenizer, adapter, out_path, done, stats, on_error=on_error, end_ids=end_ids,
                 max_new_tokens=max_new_tokens, temperature=temperature, max_length=max_length, max_turns=max_turns,
                 concurrency=concurrency, seed=seed, template_kwargs=template_kwargs)
    return collect_regenerated(conversations, done, stats), stats


def _run(todo: list[Conversation], client: OpenAIClient, model: str, tokenizer: Any, adapter: Any, out_path: Path,
         done: dict[str, Any], stats: RegenerateStats, *, concurrency: int, on_error: str, **kw: Any) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    failure: BaseException | None = None

    def keep(fut: Any, conv: Conversation) -> None:
        nonlocal failure
        if fut.cancelled():
            return
        if isinstance(fut.exception(), BadAnswerError) and on_error == "skip":
            stats.skipped["server_answer_refused"] += 1  # not written: the next run asks again
            logger.warning("skipping conversation %s (data.on_error=skip): %s", conv.uid, fut.exception())
            return
        if fut.exception() is not None:
            failure = failure or fut.exception()
            return
        messages, turns = fut.result()
        record = {"id": conv.uid, "source": conv.source, "index": conv.index, "messages": messages}
        os.write(fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())  # one write: whole lines only
        os.fsync(fd)
        done[conv.uid] = messages
        stats.generated += 1
        stats.turns += turns
        if stats.generated % 10 == 0 or stats.generated == len(todo):
            logger.info("regenerated %d/%d conversations", stats.generated, len(todo))

    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            pending = {pool.submit(_answer, c, client, model, tokenizer, adapter, **kw): c for c in todo}
            while pending and failure is None:
                finished, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in finished:
                    keep(fut, pending.pop(fut))
            for fut in pending:  # after a failure: start nothing new ...
                fut.cancel()
            for fut, conv in pending.items():  # ... and keep the conversations already in flight that finish
                wait([fut])
                keep(fut, conv)
    finally:
        os.close(fd)
    if failure is not None:
        hint = " (or set data.on_error=skip to leave out and count the conversations whose answers are refused)" \
            if isinstance(failure, BadAnswerError) else ""
        error = BadAnswerError if isinstance(failure, BadAnswerError) else ServerError
        raise error(f"regeneration through {client.base_url} stopped: {failure}; {stats.generated} of "
                    f"{len(todo)} conversations done this run are kept in {out_path} ({stats.reused} from "
                    f"before); rerun to answer the rest{hint}") from None


def _answer(conv: Conversation, client: OpenAIClient, model: str, tokenizer: Any, adapter: Any, *,
            end_ids: list[int], max_new_tokens: int, temperature: float, max_length: int | None,
            max_turns: int | None, seed: int,
            template_kwargs: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], int]:
    """One conversation, turn by turn (the same rules as the `hf` backend's `_regenerate_batch`)."""
    new: list[dict[str, str]] = []
    pending = list(conv.messages)
    answered = 0
    while max_turns is None or answered < max_turns:
        while pending and not _to_answer(pending[0]):
            new.append(pending.pop(0))
        if not pending:
            break
        prompt = _render_prompt(tokenizer, adapter, new, template_kwargs, conv.tools)
        thinking = thinking_enabled(adapter.chat_format(tokenizer), template_kwargs)
        if max_length is not None and len(prompt) >= max_length:
            while new and new[-1]["role"] != "assistant":  # the rest would be truncated away in training
                new.pop()
            break
        payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens,
                                   "temperature": temperature, "stop_token_ids": end_ids, "return_token_ids": True,
                                   "skip_special_tokens": not thinking}  # reasoning markers may be special tokens
        if temperature > 0:  # reproducible per conversation and turn, whatever the order of requests
            payload["seed"] = (seed + zlib.crc32(f"{conv.uid}/{answered}".encode())) % 2**31
        try:
            reply = reply_of(client.completion(payload), tokenizer, adapter, end_ids, template_kwargs)
        except BadAnswerError as e:
            raise BadAnswerError(f"conversation {conv.uid}, answer {answered + 1}: {e}") from None
        pending.pop(0)  # the original assistant turn
        new.append(reply)
        answered += 1
    return new, answered


def reply_of(choice: dict[str, Any], tokenizer: Any, adapter: Any, end_ids: list[int],
             template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The assistant message of one completion choice, checked first (see the module docstring).

    Raises:
        BadAnswerError: what is wrong with the choice (its type, ids outside the vocabulary, an empty answer).
    """
    ids, text, finish = choice.get("token_ids"), choice.get("text"), choice.get("finish_reason")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadAnswerError(f"'token_ids' is not a list of integers ({str(ids)[:60]})")
        vocab = len(tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise BadAnswerError(f"{len(bad)} of {len(ids)} token ids lie outside the tokenizer's vocabulary "
                                 f"0..{vocab - 1} (e.g. {bad[0]}): is the server serving this target?")
        empty = not ids
    elif isinstance(text, str):
        empty = not text
    else:
        raise BadAnswerError("the choice has neither 'token_ids' nor a 'text' string" if text is None else
                             f"'text' is a JSON {type(text).__name__}, not a string")
    if empty and finish != "stop":  # a model that ends its turn at once says so; an empty "length" answer is broken
        raise BadAnswerError(f"an empty answer (no token) with finish_reason {finish!r}")
    if ids is None:
        return reply_message(tokenizer, adapter, text, template_kwargs)
    cut = next((j for j, tok in enumerate(ids) if tok in end_ids), len(ids))
    return decode_reply(tokenizer, adapter, ids[:cut], template_kwargs)


def regenerate_for_recipe(recipe: Any, conversations: Sequence[Conversation], tokenizer: Any, adapter: Any,
                          out_path: Path) -> tuple[list[Conversation], RegenerateStats]:
    """`data.regenerate.backend` openai (the server at `base_url`) or vllm (a server started here for the target)."""
    import contextlib

    d, r = recipe.data, recipe.data.regenerate
    kw = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_length=d.max_length,
              max_turns=r.max_turns, concurrency=r.concurrency, seed=d.seed,
              template_kwargs=dict(d.chat_template_kwargs), on_error=d.on_error)
    client_kw = dict(api_key_env=r.api_key_env, timeout=r.timeout, retries=r.retries)
    if r.backend == "openai":
        if not r.base_url:
            raise ValueError("data.regenerate.backend = 'openai' needs data.regenerate.base_url (the server root, "
                             "e.g. http://127.0.0.1:8000)")
        return regenerate_with_client(conversations, OpenAIClient(r.base_url, **client_kw), tokenizer, adapter,
                                      out_path, **kw)
    if r.backend != "vllm":
        raise ValueError(f"data.regenerate.backend = {r.backend!r}: expected hf, openai or vllm")
    from eagle3_zoo.targets.server import VLLMServer

    done = _load_done(out_path) if out_path.exists() else {}
    with contextlib.ExitStack() as stack:
        url = "http://127.0.0.1:1"  # never contacted when everything is answered already
        if any(c.uid not in done for c in conversations):
            server = stack.enter_context(VLLMServer(recipe.target.name_or_path, dtype=recipe.target.dtype,
                                                    log_path=out_path.with_suffix(".vllm.log")))
            url = server.base_url
        return regenerate_with_client(conversations, OpenAIClient(url, **client_kw), tokenizer, adapter, out_path,
                                      **kw)
