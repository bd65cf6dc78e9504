"""Hidden-state requests to the recipe's engine: shared by every loader of a rank (`EngineFeed`).

Each request asks one server for the states of one sample (vLLM batches the requests it has in flight). A request
goes to the server with the fewest requests in flight; a server that still fails after its client's retries (with
backoff) hands the request to the next one, and when every server has failed it, a launched server whose process
died is restarted (`EngineDeployment.restart`) and the request tried again. Only then does it fail, with one
`EngineFeedError` naming the servers and the last failure. Which server answered never changes what comes back:
the same model, the same prompt, and vLLM's states do not depend on what else was batched with a request.

The disk budget is shared by the loaders: a request reserves the bytes its file will take before it is sent and
releases them when its file has been read (and deleted). Requests are named `e3z<run><rank>-<sample>-<nonce>`, so
vLLM's file names (`cmpl-<request id>-0-<suffix>.safetensors`) tell this run's files from any other's: a run that
starts again removes the files its killed predecessor left, and nobody else's.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_zoo.data.ranks import start_on_node
from eagle3_zoo.targets.openai_client import ServerError

logger = logging.getLogger(__name__)


def final_norm_on_cpu(norm: Any) -> Any:
    """A CPU copy of the target's final norm module (the engine's files are read on the host)."""
    return copy.deepcopy(norm).to("cpu")


class EngineFeedError(ServerError):
    """The engine did not deliver hidden states (after retries, failover to the other servers and restarts)."""


@dataclass
class FeedStats:
    """What the engine delivered to this rank, and how long the trainer waited for it."""

    tokens: int = 0  # prompt tokens of the answered requests
    requests: int = 0
    wait_s: float = 0.0  # time the loaders spent blocked on the engine (waiting for and reading its files)
    per_server: Counter = field(default_factory=Counter)  # answered requests by server URL
    failovers: int = 0  # requests a server failed that another then answered
    started: float | None = None  # monotonic time of the first request

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.elapsed(), 1e-9)


def run_tag(output_dir: str | os.PathLike, rank: int) -> str:
    """The request-name prefix of rank `rank` of the run writing `output_dir` (stable across restarts)."""
    digest = hashlib.sha256(str(Path(output_dir).absolute()).encode()).hexdigest()[:10]
    return f"e3z{digest}r{rank}"


class EngineFeed:
    """This rank's requests to an `EngineDeployment` (see the module docstring).

    Args:
        deployment: the recipe's engine (`eagle3_zoo.targets.deployment.EngineDeployment`), not started yet.
        tag: this rank's request-name prefix (`run_tag`).
        budget_bytes: disk the files of requested, unread samples may take (`data.prefetch_disk_gib`).
        concurrency: requests in flight per server at most (`engine.concurrency`).
        hidden_size: the target's hidden size, checked in every file (None: not checked).
    """

    def __init__(self, deployment: Any, tag: str, budget_bytes: int, concurrency: int = 16,
                 hidden_size: int | None = None) -> None:
        self.deployment, self.tag = deployment, tag
        self.layers = len(deployment.aux_layer_ids) + 1  # the aux layers and the last one
        self.hidden_size = hidden_size
        self.budget_bytes, self.concurrency = int(budget_bytes), concurrency
        self.stats = FeedStats()
        self.reserved = 0  # bytes of requested samples whose files are not read yet
        self.peak_reserved = 0
        self._lock = threading.Condition()
        self._inflight: Counter = Counter()
        self._pool: ThreadPoolExecutor | None = None
        self._over_budget_warned = False

    # ------------------------------------------------------------------------------------------ start
    def start(self) -> EngineFeed:
        """Start (launch mode) or check (attach mode) the servers, and remove this run's leftover files."""
        if self._pool is not None:
            return self
        d = self.deployment
        start_on_node(d)  # the node's first rank launches, the node's others attach
        self.remove_leftovers()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(d.servers) * self.concurrency),
                                        thread_name_prefix="eagle3-zoo-engine")
        logger.info("engine feed: %s", d.describe())
        return self

    def remove_leftovers(self) -> int:
        """Delete the files (and locks) of this run's requests that a killed run never read; their number."""
        storage = Path(self.deployment.storage)
        stale = list(storage.glob(f"cmpl-{self.tag}-*")) if storage.is_dir() else []
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if stale:
            logger.info("engine feed: removed %d hidden-state file(s) a previous run of this output_dir left in %s",
                        len(stale), storage)
        return len(stale)

    def close(self) -> None:
        """Stop taking requests, wait for those in flight (their files are deleted by their streams), stop launched
        servers. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.deployment.stop()

    # ---------------------------------------------------------------------------------------- budget
    def reserve(self, nbytes: int, force: bool = False) -> bool:
        """Reserve `nbytes` of the disk budget; False (nothing reserved) when it would exceed it, unless `force`
        (the batch being trained on is always requested)."""
        with self._lock:
            if not force and self.reserved + nbytes > self.budget_bytes and self.reserved > 0:
                return False
            if self.reserved + nbytes > self.budget_bytes and not self._over_budget_warned:
                self._over_budget_warned = True
                logger.warning("engine feed: one batch's hidden states (%.1f MB) exceed data.prefetch_disk_gib "
                               "(%.1f MB); it is requested anyway, without prefetch", nbytes / 1e6,
                               self.budget_bytes / 1e6)
            self.reserved += nbytes
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes

    # -------------------------------------------------------------------------------------- requests
    def submit(self, ids: Sequence[int], index: int) -> Future:
        """Request the states of sample `index` (token ids `ids`); the future's result is the local path of its
        file."""
        if self._pool is None:
            raise RuntimeError("the engine feed is not started (or already closed)")
        if self.stats.started is None:
            self.stats.started = time.monotonic()
        request_id = f"{self.tag}-{index}-{uuid.uuid4().hex[:8]}"
        return self._pool.submit(self._request, [int(i) for i in ids], request_id)

    def _pick(self, tried: set[int]) -> int | None:
        with self._lock:
            free = [i for i in range(len(self.deployment.servers)) if i not in tried]
            if not free:
                return None
            best = min(free, key=lambda i: (self._inflight[i], i))
            self._inflight[best] += 1
            return best

    def _request(self, ids: list[int], request_id: str) -> Path:
        from eagle3_zoo.targets.vllm_features import answered_file, read_hidden_states, request_hidden_states

        servers, tried, last, rounds = self.deployment.servers, {}, "", 0  # tried: index -> its restarts when sent
        while True:
            i = self._pick(set(tried))
            if i is None:  # every server failed this request: bring back those that died, else give up
                revived = [j for j, seen in sorted(tried.items()) if self.deployment.restart(servers[j], seen)]
                rounds += 1
                if not revived or rounds > self.deployment.engine.max_restarts + 1:
                    raise EngineFeedError(self._failure(len(ids), last))
                for j in revived:
                    del tried[j]
                continue
            server = servers[i]
            sent = server.restarts  # a failure counts against the process the request was sent to
            try:
                named = request_hidden_states(server.client, server.model, ids, request_id)
                path = answered_file(named, self.deployment.storage, request_id, server.url)
                # checked in full before the trainer sees it (a bad file fails over like a failed request); kept on
                # disk for the loader, which reads it again and deletes it
                read_hidden_states(path, ids, self.layers, self.hidden_size, server=server.url,
                                   lock_timeout=self.deployment.engine.timeout, keep=True)
            except ServerError as e:
                last = str(e)
                tried[i] = sent
                logger.warning("engine server %s failed a request (%s); %s", server.url, last,
                               "trying another" if len(tried) < len(servers) else "checking the servers")
                continue
            finally:
                with self._lock:
                    self._inflight[i] -= 1
            with self._lock:
                self.stats.tokens += len(ids)
                self.stats.requests += 1
                self.stats.per_server[server.url] += 1
                self.stats.failovers += bool(tried)
            return path

    def read(self, path: Path, ids: list[int]) -> Any:
        """The `[T, layers, H]` states of an answered request's file (`submit`'s result), read once and deleted."""
        from eagle3_zoo.targets.vllm_features import read_hidden_states

        return read_hidden_states(path, ids, self.layers, self.hidden_size, lock_timeout=self.deployment.engine.timeout)

    def _failure(self, tokens: int, last: str) -> str:
        d = self.deployment
        restarts = ""
        if d.mode == "launch":
            done = ", ".join(f"{s.url} {s.restarts}" for s in d.servers)
            restarts = f"; restarts of launched servers that died: {done} (engine.max_restarts = " \
                f"{d.engine.max_restarts} each)"
        return (f"no engine server delivered the hidden states of a {tokens}-token sample: {last} (tried "
                f"{', '.join(s.url for s in d.servers)}, each with {d.engine.retries} retries{restarts})")

    def states_batch(self, sequences: Sequence[Any], final_norm: Any) -> tuple[Any, Any]:
        """Right-padded `(aux [B, T, len(aux) * H], final [B, T, H])` of token-id sequences, all requested at once
        (the offline feature job's `features_fn`); each file is read once and deleted."""
        import torch

        from eagle3_zoo.targets.vllm_features import split_states

        seqs = [[int(i) for i in (s.tolist() if hasattr(s, "tolist") else s)] for s in sequences]
        self.start()
        futures = [self.submit(ids, f"f{n}") for n, ids in enumerate(seqs)]
        start = time.monotonic()
        pairs = [split_states(self.read(f.result(), ids), final_norm) for f, ids in zip(futures, seqs)]
        self.stats.wait_s += time.monotonic() - start
        width = max(len(s) for s in seqs)
        aux = torch.zeros(len(seqs), width, pairs[0][0].shape[1], dtype=pairs[0][0].dtype)
        final = torch.zeros(len(seqs), width, pairs[0][1].shape[1], dtype=pairs[0][1].dtype)
        for i, (a, f) in enumerate(pairs):
            aux[i, : a.shape[0]], final[i, : f.shape[0]] = a, f
        return aux, final
