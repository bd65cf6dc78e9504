"""How the data jobs (regeneration, the feature job) split their work across the processes of a run.

Rank r of W takes a disjoint share (`RankSplit.share`: items r, r + W, ...), writes its own part files atomically,
then waits, polling the files (no collective with a deadline), until every share is on disk; the parts are then
combined in a fixed order that does not depend on W, so the result is the same for any number of processes.

Rule for caches: the work is split across the ranks that *see the same directory*. Under torch.distributed
(`fit` with ddp/fsdp) `split_for(directory)` finds them: every rank drops a probe file there and reads which
probes it sees. With one cache shared by all nodes, the W ranks split the work; with node-local caches, each node
splits it across its own ranks and does all of it, so no rank waits for a file another node writes. The
collectives of this stage (the probe, `data_barrier`) run in a gloo group with a deadline of `DATA_TIMEOUT`, so a
node that finds its cache filled does not time out while another works for hours. Processes started by hand
(`eagle3-zoo prepare --rank r --world-size N`) are given their share and must point at one shared cache.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")

DATA_TIMEOUT = timedelta(days=7)
"""Deadline of the data stage's collectives: regeneration of a large dataset takes hours, not minutes."""
POLL_S = 2.0
_group: Any = None


@dataclass(frozen=True)
class RankSplit:
    """This process's share of a data job: `rank` of `world_size` processes that share the output directory."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of world size {self.world_size}: expected world size >= 1 and "
                             "0 <= rank < world size")

    def share(self, items: Sequence[T]) -> list[T]:
        """Items rank, rank + world_size, ... of `items`."""
        return list(items[self.rank :: self.world_size])


def _coordination_group() -> Any:
    global _group
    if _group is None:  # collective: every rank reaches it at the same point (`start_coordination`)
        _group = dist.new_group(backend="gloo", timeout=DATA_TIMEOUT)
    return _group


def start_coordination() -> None:
    """Create the data stage's gloo group right after the process group starts, before any other group is created
    (groups must be created in the same order on every rank)."""
    if distributed():
        _coordination_group()


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def data_barrier() -> None:
    """Wait for every rank of the run (no-op without torch.distributed), with the data stage's long deadline."""
    if distributed():
        dist.barrier(group=_coordination_group())


def gather_lists(items: list[T]) -> list[T]:
    """Every rank's `items`, concatenated in rank order (`items` itself without torch.distributed). Collective."""
    if not distributed():
        return list(items)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items), group=_coordination_group())
    return [item for part in out for item in part]


def split_for(directory: str | Path) -> RankSplit:
    """This rank's share among the ranks that see `directory` (see the module docstring); `RankSplit()` in a single
    process. Collective under torch.distributed: every rank calls it at the same point."""
    if not distributed():
        return RankSplit()
    group = _coordination_group()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    token = [uuid.uuid4().hex]
    dist.broadcast_object_list(token, src=0, group=group)
    rank, world = dist.get_rank(), dist.get_world_size()
    probe = directory / f".probe-{token[0]}-{rank}"
    probe.touch()
    dist.barrier(group=group)
    names = set(os.listdir(directory))
    seen = [r for r in range(world) if f".probe-{token[0]}-{r}" in names]
    dist.barrier(group=group)
    probe.unlink()
    if len(seen) < world:
        logger.info("%s is seen by ranks %s of %d (a node-local cache): they split its work among themselves",
                    directory, seen, world)
    return RankSplit(seen.index(rank), len(seen))


def wait_until(done: Callable[[], tuple[int, int]], what: str, poll_s: float = POLL_S,
               log_every_s: float | None = None) -> None:
    """Poll `done() -> (finished, total)` until finished == total, logging progress every `log_every_s` seconds
    (default `EAGLE3_ZOO_LOG_EVERY_S`, else 30; the other ranks write their parts meanwhile; a rank that died is
    noticed by its launcher, which stops the others)."""
    from eagle3_zoo.util.progress import progress_interval_s

    log_every_s = progress_interval_s() if log_every_s is None else log_every_s
    last = time.monotonic()
    while True:
        finished, total = done()
        if finished >= total:
            return
        if time.monotonic() - last >= log_every_s:
            logger.info("waiting for the other ranks' %s: %d of %d done", what, finished, total)
            last = time.monotonic()
        time.sleep(poll_s)


def start_on_node(deployment: Any, launch: bool = True) -> Any:
    """Start an engine deployment (`eagle3_zoo.targets.deployment.EngineDeployment`) under torch.distributed too: in
    launch mode the node's first rank launches the servers (unless `launch` is False) and the node's other ranks
    attach to them. Collective under torch.distributed. Returns the deployment."""
    if deployment.mode == "launch" and distributed():
        first = int(os.environ.get("LOCAL_RANK", "0")) == 0
        deployment.start(launch=first and launch)
        host = os.uname().nodename
        shared = gather_lists([(host, [s.url for s in deployment.servers])])
        if not first:
            deployment.attach_launched([url for h, urls in shared if h == host for url in urls])
    else:
        deployment.start(launch=launch)
    return deployment
