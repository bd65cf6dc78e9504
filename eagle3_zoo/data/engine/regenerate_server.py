"""Regeneration through OpenAI-compatible servers (`data.regenerate.backend: openai | vllm | engine`).

`ServerResponder` answers the rounds of the one regeneration loop (`eagle3_zoo.data.regenerate.regenerate_with`),
so this backend has the in-process `hf` backend's contract: the same JSONL file and cache key, the same record format
(`{"id", "source", "index", "messages"}`), the same prompts (the conversation so far rendered with the target's chat
template, sent as token ids to ``/v1/completions`` so the server does not re-render or re-tokenize it), the same stop
tokens and `max_length`/`max_turns` rules, the same resume and part files, and the same split across ranks (each
rank sends its share). When the server returns the answer's token ids (vLLM: ``return_token_ids``) they are decoded
with the target's tokenizer exactly as the `hf` backend decodes its own output; otherwise the server's text is used.

Every answer is checked before it is kept (`check_choice`): a JSON object with a ``choices`` list, token ids that are
integers inside the tokenizer's vocabulary, or else a text string, and not empty unless the server says the model
stopped at once. A refused answer is never cached: with `data.on_error: raise` the run stops naming the URL, the
conversation and what is wrong; with `skip` the conversation is left out, counted (`server_answer_refused`) and
asked again by the next run.

The requests of a round are independent, `concurrency` in flight at once per server (the server batches them); a
batch is `concurrency` conversations per server unless `batch_size` says otherwise. Several servers (the recipe's
engine deployment, `engine`: its `engine.urls`, or its replicas launched here for the regeneration) share the
conversations: the j-th conversation a batch asks about goes to server j mod n, and its later turns to the same one
(its prompt prefix is cached there). Each answer depends only on the conversation (greedy, or sampling seeded per
conversation and turn), so the file is the one a single server writes. After a request fails (after its retries) nothing
new is sent and the requests in flight are awaited: the conversations already finished are kept, and the error says
how many.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.chat.formats import thinking_enabled
from eagle3_zoo.data.ranks import RankSplit
from eagle3_zoo.data.readers import Conversation
from eagle3_zoo.data.regenerate import Answer, RegenerateStats, Request, answered_ids, end_ids, regenerate_with
from eagle3_zoo.targets.openai_client import BadAnswerError, OpenAIClient, ServerError

if TYPE_CHECKING:
    from eagle3_zoo.recipe.sections import Recipe

logger = logging.getLogger(__name__)


class ServerResponder:
    """OpenAI-compatible servers' ``/v1/completions`` (a `regenerate.Responder`): token-id prompts, the target's
    stop tokens, greedy at temperature 0, else sampling seeded per conversation and turn (whatever the order of the
    requests); several servers share the conversations (module docstring).

    Args:
        client: the server, or several that serve the same target.
        model: the served model name (default: each server's first of ``/v1/models``).
        concurrency: requests in flight per server.
        discard: called with the path a hidden-states server names in an answer's
            ``kv_transfer_params.hidden_states_path`` (a file written for nobody), to delete it.
    """

    refusal = "server_answer_refused"

    def __init__(self, client: OpenAIClient | Sequence[OpenAIClient], tokenizer: Any, adapter: Any, *,
                 model: str | None = None, max_new_tokens: int = 1024, temperature: float = 0.0,
                 concurrency: int = 4, seed: int = 0, template_kwargs: dict[str, Any] | None = None,
                 discard: Callable[[str], None] | None = None) -> None:
        self.clients = [client] if isinstance(client, OpenAIClient) else list(client)
        if not self.clients:
            raise ValueError("ServerResponder needs at least one server")
        self.model, self.models = model, [model] * len(self.clients)
        self.concurrency, self.discard = max(1, concurrency), discard
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.vocab_size = len(tokenizer)
        self.end_ids = end_ids(tokenizer, adapter)
        self.thinking = thinking_enabled(adapter.chat_format(tokenizer), template_kwargs)
        self._server_of: dict[str, int] = {}  # conversation -> server, per batch

    @property
    def in_flight(self) -> int:
        """Requests in flight at once over all the servers."""
        return self.concurrency * len(self.clients)

    @property
    def where(self) -> str:
        return ", ".join(c.base_url for c in self.clients)

    def describe(self) -> str:
        if len(self.clients) == 1:
            return f"through {self.where} ({self.models[0]}, {self.concurrency} in flight)"
        return f"through {len(self.clients)} servers ({self.where}; {self.concurrency} in flight each)"

    def open(self) -> None:
        for i, client in enumerate(self.clients):
            client.check()  # server down at the start: one clear error naming the URL, nothing written
            self.models[i] = self.model or client.models()[0]

    def batch(self, start: int) -> contextlib.AbstractContextManager[Any]:
        self._server_of.clear()
        return contextlib.nullcontext()

    def payload(self, request: Request, model: str | None = None) -> dict[str, Any]:
        model = model or self.models[0]
        payload: dict[str, Any] = {"model": model, "prompt": request.prompt, "max_tokens": self.max_new_tokens,
                                   "temperature": self.temperature, "stop_token_ids": self.end_ids,
                                   "return_token_ids": True,
                                   "skip_special_tokens": not self.thinking}  # reasoning markers may be special
        if self.temperature > 0:  # reproducible per conversation and turn, whatever the order of requests
            payload["seed"] = (self.seed + zlib.crc32(f"{request.uid}/{request.turn}".encode())) % 2**31
        return payload

    def _complete(self, request: Request, server: int) -> Answer:
        client = self.clients[server]
        answer = client.post("/v1/completions", self.payload(request, self.models[server]))
        params = answer.get("kv_transfer_params")
        written = params.get("hidden_states_path") if isinstance(params, dict) else None
        if written and self.discard is not None:
            self.discard(str(written))
        return check_choice(client.first_choice(answer), self.vocab_size)

    def answer(self, requests: Sequence[Request]) -> list[Answer | BaseException | None]:
        results: list[Answer | BaseException | None] = [None] * len(requests)
        n = len(self.clients)
        servers = [self._server_of.setdefault(r.uid, len(self._server_of) % n) for r in requests]
        with ThreadPoolExecutor(max_workers=self.in_flight) as pool:
            futures = {pool.submit(self._complete, r, s): i for i, (r, s) in enumerate(zip(requests, servers))}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in finished:
                    results[futures[fut]] = fut.exception() or fut.result()
                if any(isinstance(results[futures[f]], BaseException) and not self.is_refusal(results[futures[f]])
                       for f in finished):
                    for fut in pending:  # after a failure: start nothing new ...
                        fut.cancel()
                    for fut in pending:  # ... and keep the requests already in flight that finish
                        if not fut.cancelled():
                            wait([fut])
                            results[futures[fut]] = fut.exception() or fut.result()
                    break
        return results

    def is_refusal(self, error: BaseException) -> bool:
        return isinstance(error, BadAnswerError)

    def stopped(self, error: BaseException, kept: str) -> BaseException:
        hint = " (or set data.on_error=skip to leave out and count the conversations whose answers are refused)" \
            if isinstance(error, BadAnswerError) else ""
        kind = BadAnswerError if isinstance(error, BadAnswerError) else ServerError
        return kind(f"regeneration through {self.where} stopped: {error}; {kept}; rerun to answer the "
                    f"rest{hint}")


def check_choice(choice: dict[str, Any], vocab_size: int) -> Answer:
    """The `Answer` of one completion choice, checked first (see the module docstring).

    Raises:
        BadAnswerError: what is wrong with the choice (its type, ids outside the vocabulary, an empty answer).
    """
    ids, text, finish = choice.get("token_ids"), choice.get("text"), choice.get("finish_reason")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadAnswerError(f"'token_ids' is not a list of integers ({str(ids)[:60]})")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise BadAnswerError(f"{len(bad)} of {len(ids)} token ids lie outside the tokenizer's vocabulary "
                                 f"0..{vocab_size - 1} (e.g. {bad[0]}): is the server serving this target?")
        empty = not ids
    elif isinstance(text, str):
        empty = not text
    else:
        raise BadAnswerError("the choice has neither 'token_ids' nor a 'text' string" if text is None else
                             f"'text' is a JSON {type(text).__name__}, not a string")
    if empty and finish != "stop":  # a model that ends its turn at once says so; an empty "length" answer is broken
        raise BadAnswerError(f"an empty answer (no token) with finish_reason {finish!r}")
    return Answer(ids=ids, text=None if ids is not None else text, finish_reason=finish)


def regenerate_with_client(
    conversations: Sequence[Conversation],
    client: OpenAIClient | Sequence[OpenAIClient],
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
    batch_size: int | None = None,
    seed: int = 0,
    template_kwargs: dict[str, Any] | None = None,
    on_error: str = "raise",
    split: RankSplit | None = None,
    discard: Callable[[str], None] | None = None,
) -> tuple[list[Conversation], RegenerateStats]:
    """Replace every assistant turn by the served target's reply; resumable, split across ranks (module docstring).

    Args:
        conversations: normalised conversations.
        client: the server (`OpenAIClient`: base URL, API key variable, timeout, retries), or several serving the
            same target (they share the conversations; the file is the one a single server writes).
        tokenizer, adapter: the target's tokenizer and adapter (chat template, end-of-turn token).
        out_path: the JSONL file of regenerated conversations (shared with the `hf` backend).
        model: the served model name (default: the first of ``/v1/models``).
        concurrency: requests in flight at once per server.
        batch_size: conversations answered round by round together (default: `concurrency` x the servers).
        on_error: an answer that is refused (see the module docstring): "raise" stops the run, "skip" leaves its
            conversation out (counted as `server_answer_refused`, asked again by the next run).
        split: this process's share (`eagle3_zoo.data.ranks.RankSplit`); default: all of it.
        discard: deletes the hidden-states file a server's answer names (see `ServerResponder`).
        Others: as `eagle3_zoo.data.regenerate.regenerate_conversations` (`template_kwargs` included).

    Raises:
        ServerError: the server is down at the start, or a request kept failing (the message counts what was kept).
        BadAnswerError: an answer was refused with `on_error="raise"` (the message counts what was kept).
    """
    responder = ServerResponder(client, tokenizer, adapter, model=model, max_new_tokens=max_new_tokens,
                                temperature=temperature, concurrency=concurrency, seed=seed,
                                template_kwargs=template_kwargs, discard=discard)
    return regenerate_with(responder, conversations, tokenizer, adapter, out_path,
                           batch_size=batch_size or responder.in_flight, max_length=max_length,
                           max_turns=max_turns, template_kwargs=template_kwargs, split=split, on_error=on_error)


def regenerate_for_recipe(recipe: Recipe, conversations: Sequence[Conversation], tokenizer: Any, adapter: Any,
                          out_path: Path, split: RankSplit | None = None) -> tuple[list[Conversation], RegenerateStats]:
    """`data.regenerate.backend` openai (the server at `base_url`), vllm (a server started here for the target) or
    engine (the recipe's engine deployment, `regenerate_in_engine`); `split`: this process's share (default: all of
    it)."""
    d, r = recipe.data, recipe.data.regenerate
    kw = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, max_length=d.max_length,
              max_turns=r.max_turns, concurrency=r.concurrency, seed=d.seed,
              template_kwargs=dict(d.chat_template_kwargs), on_error=d.on_error, split=split)
    client_kw = dict(api_key_env=r.api_key_env, timeout=r.timeout, retries=r.retries)
    if r.backend == "openai":
        if not r.base_url:
            raise ValueError("data.regenerate.backend = 'openai' needs data.regenerate.base_url (the server root, "
                             "e.g. http://127.0.0.1:8000)")
        return regenerate_with_client(conversations, OpenAIClient(r.base_url, **client_kw), tokenizer, adapter,
                                      out_path, **kw)
    if r.backend == "engine":  # the engine's servers, with the engine's key
        client_kw["api_key_env"] = recipe.engine.api_key_env or r.api_key_env
        return regenerate_in_engine(recipe, conversations, tokenizer, adapter, out_path, client_kw, **kw)
    if r.backend != "vllm":
        raise ValueError(f"data.regenerate.backend = {r.backend!r}: expected hf, openai, vllm or engine")
    from eagle3_zoo.targets.server import VLLMServer

    done = answered_ids(out_path)
    with contextlib.ExitStack() as stack:
        url = "http://127.0.0.1:1"  # never contacted when everything is answered already
        if any(c.uid not in done for c in conversations):
            server = stack.enter_context(VLLMServer(recipe.target.name_or_path, dtype=recipe.target.dtype,
                                                    log_path=out_path.with_suffix(".vllm.log")))
            url = server.base_url
        return regenerate_with_client(conversations, OpenAIClient(url, **client_kw), tokenizer, adapter, out_path,
                                      **kw)


def regenerate_in_engine(recipe: Recipe, conversations: Sequence[Conversation], tokenizer: Any, adapter: Any,
                         out_path: Path, client_kw: dict[str, Any], **kw: Any) -> tuple[list[Conversation],
                                                                                        RegenerateStats]:
    """`data.regenerate.backend: engine`: the recipe's engine deployment answers (`targets.deployment`).

    Attach mode sends the requests to the servers at `engine.urls` as they run (hidden-states servers answer
    completions as plain ones do; the hidden-states file each answer names is deleted at once, if this machine sees
    `engine.hidden_states_dir`). Launch mode starts the deployment's servers (replicas, parallelism, devices,
    quantisation, extra arguments) without the hidden-states method, for the regeneration only, and stops them
    afterwards; under torch.distributed the node's first rank launches them and the node's other ranks share them.
    A launched server that dies is started again (at most `engine.max_restarts` times, as for hidden states) and the
    regeneration resumes from what its part files keep; a server that answers with errors, an attached one or a
    refused answer stops it as before. Nothing is started when the file holds every conversation already. `kw`: as
    `regenerate_with_client`.
    """
    from eagle3_zoo.data.ranks import distributed, start_on_node
    from eagle3_zoo.targets.deployment import EngineDeployment
    from eagle3_zoo.targets.vllm_features import answered_file, discard_hidden_states

    deployment = EngineDeployment(recipe, regeneration=True)
    done = answered_ids(out_path)
    need = any(c.uid not in done for c in conversations)
    try:
        if need or (deployment.mode == "launch" and distributed()):  # collective in that case: every rank joins
            start_on_node(deployment, launch=need)
            logger.info("regeneration in the engine: %s", deployment.describe())
        urls = [s.url for s in deployment.servers] or ["http://127.0.0.1:1"]  # never contacted: nothing to answer
        storage = deployment.storage

        def discard(path: str) -> None:  # the server's path, as this machine sees it, if it names a connector file
            try:
                file = answered_file(path, storage)
            except BadAnswerError as e:
                logger.warning("regeneration in the engine: %s", e)
                return
            discard_hidden_states(file, deployment.engine.timeout)

        clients, rounds = [OpenAIClient(url, **client_kw) for url in urls], 0
        while True:
            try:
                return regenerate_with_client(conversations, clients, tokenizer, adapter, out_path, discard=discard,
                                              **kw)
            except BadAnswerError:
                raise
            except ServerError as e:
                rounds += 1
                revived = [] if rounds > deployment.engine.max_restarts else \
                    [s.url for s in deployment.servers if deployment.restart(s, s.restarts)]
                if not revived:
                    raise
                logger.warning("regeneration in the engine: %s back after: %s; resuming", ", ".join(revived), e)
    finally:
        deployment.stop()  # the servers launched here; attached ones keep running
