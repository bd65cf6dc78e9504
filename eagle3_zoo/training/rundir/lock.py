"""One `fit` per output_dir at a time: the run lock, who holds it, and what killed runs left behind.

    with hold_run_directory(Path(recipe.output_dir)):   # refuses at once if another run holds it
        ...                                              # train, checkpoint, write the drafter folder

The process that starts a run takes an exclusive lock on `output_dir/.eagle3-zoo-run.lock` (`exclusive_lock`:
flock, released by the operating system when the process dies, so a killed run never blocks the next) for the
whole run and writes who it is next to it (`.eagle3-zoo-run.json`: pid, host, start time, command, its secrets
redacted by `eagle3_zoo.util.redaction`). A second run
on the same directory refuses in one line naming that holder, before it loads anything: two runs would share the
checkpoint, the logs and the drafter folder, and one result would be lost.

Holding the lock means no other process works in the directory, so what interrupted runs left there is removed at
once, whatever its age: temporaries of checkpoint saves, a sharded checkpoint's staging folder, stages of the
drafter folder. The processes a run starts for its other ranks (Lightning's launcher, torchrun, SLURM) run under
the starting process's lock and take none themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3_zoo.util.fileio import atomic_write_text, exclusive_lock, remove_dead_stages
from eagle3_zoo.util.redaction import redact

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"  # an output_dir holds its checkpoints/ and the drafter/ folder a finished run writes
DRAFTER_DIR = "drafter"
RUN_LOCK = ".eagle3-zoo-run.lock"
RUN_HOLDER = ".eagle3-zoo-run.json"
# set in the processes a launcher starts for a run's ranks; "0" (or unset) in the one that starts the run
_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK", "SLURM_PROCID")


class RunDirectoryInUseError(ValueError):
    """Another run holds the output directory; the message names it (pid, host, start time)."""


def starts_the_run() -> bool:
    """Whether this process starts the run (not one started for another rank of it): it holds the run lock."""
    return all(os.environ.get(name, "0") == "0" for name in _RANK_VARIABLES)


def _holder(output_dir: Path) -> str:
    try:
        info = json.loads((output_dir / RUN_HOLDER).read_text())
        return redact(f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                      f"{' '.join(info.get('command') or [])}".rstrip(": "))
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


@contextlib.contextmanager
def hold_run_directory(output_dir: str | Path) -> Iterator[None]:
    """Hold `output_dir` for a run (see the module docstring); a no-op in the processes of the other ranks.

    Raises:
        RunDirectoryInUseError: another run holds it.
    """
    output_dir = Path(output_dir)
    if not starts_the_run():
        yield
        return
    created = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        if created:  # runs last: a run refused before it wrote anything leaves no folder behind
            held.callback(_remove_if_only_the_lock, output_dir)
        try:
            held.enter_context(exclusive_lock(output_dir / RUN_LOCK, blocking=False))
        except BlockingIOError:
            raise RunDirectoryInUseError(
                f"{output_dir} is in use by another run ({_holder(output_dir)}); two runs on one output_dir would "
                "share its checkpoint, logs and drafter folder: wait for that run to finish, or set another "
                "output_dir") from None
        remove_leftovers(output_dir)  # before the holder file: once it is there, the folder is clean
        command = [os.path.basename(sys.argv[0]), *map(redact, sys.argv[1:])]  # keys given on the command line
        atomic_write_text(output_dir / RUN_HOLDER, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": command}) + "\n")
        held.callback((output_dir / RUN_HOLDER).unlink, missing_ok=True)
        yield


def _remove_if_only_the_lock(output_dir: Path) -> None:
    with contextlib.suppress(OSError):
        if set(os.listdir(output_dir)) <= {RUN_LOCK}:
            (output_dir / RUN_LOCK).unlink(missing_ok=True)
            output_dir.rmdir()


def remove_leftovers(output_dir: Path) -> None:
    """What interrupted runs left in `output_dir` (call it holding the run lock: nothing else works there)."""
    from eagle3_zoo.training.rundir.resume import remove_stale_temporaries

    checkpoints = output_dir / CHECKPOINT_DIR
    remove_stale_temporaries(checkpoints, older_than_s=0.0)
    for staged in checkpoints.glob(".*.staged") if checkpoints.is_dir() else ():  # a sharded save cut short
        shutil.rmtree(staged, ignore_errors=True)
        logger.info("removed %s left by an interrupted sharded checkpoint save", staged)
    remove_dead_stages(output_dir / DRAFTER_DIR)
