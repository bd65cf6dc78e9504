"""CPU threads: how many torch uses, chosen before it starts its thread pool.

torch's CPU kernels run on an OpenMP pool (libgomp here), one thread per core by default. Every parallel region
ends in a barrier, and libgomp's waiting threads spin before they sleep. On a machine whose cores are busy with
other work, one of our threads is often descheduled while the others spin at the barrier for it, and the small
operations of decoding (hundreds of regions per token) pay that wait each time: with two threads on two cores and
one other busy process, every stage ran several times slower than with one thread (`scripts/bench_threads.py`).

So the default (`auto`) is one thread per core this process may run on (`os.sched_getaffinity`) minus the cores
other processes keep busy right now (the runnable count of `/proc/stat`, sampled a few times), at least one; and
waiting threads yield instead of spinning (`OMP_WAIT_POLICY=PASSIVE`) unless the environment already says how they
wait, so load that arrives later costs less too. `--threads N` or `EAGLE3_ZOO_THREADS=N` fixes the count;
`OMP_NUM_THREADS` set by the user is kept.

The OpenMP settings are read once, when torch loads libgomp: `configure_threads` sets them in the environment when
torch is not imported yet (the command line calls it first), and `torch.set_num_threads` otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "EAGLE3_ZOO_THREADS"
AUTO = "auto"
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # a user setting of any of them is kept
_SAMPLES, _SAMPLE_GAP_S = 5, 0.02


@dataclass(frozen=True)
class ThreadChoice:
    """What `configure_threads` decided and why (logged once per process)."""

    threads: int
    reason: str
    usable_cpus: int
    busy_elsewhere: int
    wait_policy: str

    def describe(self) -> str:
        busy = f", {self.busy_elsewhere} busy with other work" if self.reason.startswith("auto") else ""
        return (f"CPU threads: {self.threads} ({self.reason}; {self.usable_cpus} usable core(s){busy}; OpenMP "
                f"wait policy {self.wait_policy}; set --threads N or {ENV}=N to choose)")


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask: taskset, cgroups cpusets, SLURM), not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _runnable(stat: str) -> int | None:
    for line in stat.splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return None


def busy_elsewhere(samples: int = _SAMPLES, gap_s: float = _SAMPLE_GAP_S) -> int:
    """Threads of other processes that are running or ready to run now (median of a few samples; 0 off Linux).

    The kernel's runnable count includes this process's own running thread, which is subtracted. The 1-minute load
    average is not used: it still counts the previous stage of a pipeline that has just exited.
    """
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                n = _runnable(f.read())
        except OSError:
            return 0
        if n is None:
            return 0
        counts.append(n - 1)
        if i + 1 < samples:
            time.sleep(gap_s)
    return max(0, sorted(counts)[len(counts) // 2])


def parse_threads(value: str | int | None, source: str) -> int | None:
    """A thread count from an option or the environment: a positive integer, or None for `auto` / unset.

    Raises:
        ValueError: anything else, naming `source`.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", AUTO)):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ValueError(f"{source}={value!r}: expected a positive number of CPU threads or '{AUTO}'")
    return n


def choose_threads(requested: str | int | None = None) -> ThreadChoice:
    """The thread count for this process: `requested` (e.g. `--threads`), else `EAGLE3_ZOO_THREADS`, else a user's
    `OMP_NUM_THREADS`, else one per usable core not busy elsewhere (at least one)."""
    cpus = usable_cpus()
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE" if not any(v in os.environ for v in _WAIT_VARS) else "?")
    fixed = parse_threads(requested, "--threads")
    if fixed is not None:
        return ThreadChoice(fixed, "--threads", cpus, 0, policy)
    fixed = parse_threads(os.environ.get(ENV), ENV)
    if fixed is not None:
        return ThreadChoice(fixed, ENV, cpus, 0, policy)
    user_omp = os.environ.get("OMP_NUM_THREADS")
    if user_omp and user_omp.strip().isdigit() and int(user_omp) > 0:
        return ThreadChoice(int(user_omp), "OMP_NUM_THREADS", cpus, 0, policy)
    busy = busy_elsewhere() if cpus > 1 else 0
    return ThreadChoice(max(1, cpus - busy), "auto: usable cores minus busy ones", cpus, busy, policy)


def configure_threads(requested: str | int | None = None) -> ThreadChoice:
    """Choose the thread count (`choose_threads`) and apply it to torch, MKL and OpenMP.

    Before `import torch` the choice goes into the environment, where libgomp and MKL read it when they load (and
    subprocesses such as DDP ranks inherit it); after, `torch.set_num_threads` applies the count (the wait policy
    can then no longer change).
    """
    choice = choose_threads(requested)
    if "torch" not in sys.modules:
        if not any(v in os.environ for v in _WAIT_VARS):
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(choice.threads)
    else:
        import torch

        torch.set_num_threads(choice.threads)
    log.debug("%s", choice.describe())
    return choice
