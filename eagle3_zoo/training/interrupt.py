"""Ctrl-C during `fit`: the run stops as an interruption (exit 130), saying what it kept.

Lightning catches a KeyboardInterrupt inside `trainer.fit`, tears the run down, ignores SIGINT from then on and calls
`sys.exit(1)`: the CLI would exit 1, as a failure, with only Lightning's "Detected KeyboardInterrupt". `InterruptWatch`
sees the interrupt in Lightning's `on_exception` hook; `reported` turns the `SystemExit` that follows into
`FitInterrupted` (a KeyboardInterrupt, exit 130) whose message names the checkpoint a rerun resumes from, and gives
SIGINT its handler back. A SIGTERM, which Lightning turns into its `SIGTERMException` at the end of a step (or the
engine feed while it waits), becomes `FitTerminated` (exit 143) with the same account of what was kept.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import lightning as L
from typing_extensions import override

from eagle3_zoo.training.rundir.checkpoint_io import UnreadableCheckpointError, read_checkpoint_header


class FitInterrupted(KeyboardInterrupt):
    """`fit` was interrupted (Ctrl-C); the message says what the run kept."""


class FitTerminated(SystemExit):
    """`fit` stopped on SIGTERM (a scheduler's preemption, `kill`): Lightning ends the step and raises its
    `SIGTERMException` (a `SystemExit` without a code, which would read as success); the message says what the run
    kept, and the exit code is 143 (128 + SIGTERM)."""

    def __init__(self, message: str) -> None:
        super().__init__(143)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InterruptWatch(L.Callback):
    """Records a KeyboardInterrupt that Lightning caught in `trainer.fit` (see the module docstring)."""

    seen = False

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.seen = self.seen or isinstance(exception, KeyboardInterrupt)

    @contextlib.contextmanager
    def reported(self, trainer: L.Trainer, last: Path, every_n_steps: int | None) -> Iterator[None]:
        """Around `trainer.fit`: Lightning's exit after an interrupt becomes `FitInterrupted` naming what `last` (the
        run's `last.ckpt`, saved every `every_n_steps`) holds; any other `SystemExit` passes as it is.

        Raises:
            FitInterrupted: the run was interrupted.
        """
        handler = signal.getsignal(signal.SIGINT)
        try:
            yield
        except SystemExit as e:
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            if isinstance(e, SIGTERMException):
                raise FitTerminated(kept(trainer.global_step, last, every_n_steps)) from None
            if not self.seen:
                raise
            raise FitInterrupted(kept(trainer.global_step, last, every_n_steps)) from None
        finally:
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, handler)  # Lightning left Ctrl-C ignored


def kept(step: int, last: Path, every_n_steps: int | None = None) -> str:
    """What an interrupted run at global step `step` kept: the checkpoint `last` and how to resume it, or nothing."""
    if last.exists():
        try:
            saved = read_checkpoint_header(last, "global_step")[0].get("global_step")
        except UnreadableCheckpointError:
            saved = None
        at = f" (step {saved})" if isinstance(saved, int) else ""
        return (f"fit stopped at step {step}; the last checkpoint {last}{at} is kept: `eagle3-zoo fit` with the same "
                "recipe resumes from it")
    when = f" (trainer.checkpoint_every_n_steps = {every_n_steps})" if every_n_steps else ""
    return (f"fit stopped at step {step}, before its first checkpoint{when}: no training is kept; `eagle3-zoo fit` "
            "with the same recipe starts it again")
