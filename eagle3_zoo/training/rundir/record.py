"""The training record of a run (wall time, steps, epochs, hardware, final metrics), kept across restarts.

A run may take several starts of `fit` (a crash, a kill, a longer `trainer.max_steps`), and a rerun of a finished run
trains nothing at all. The record therefore travels in every checkpoint (`RECORD_KEY`): a start adds its own training
time to what the checkpoint says the earlier starts spent, and a start that trains no step leaves the record as it
was, so the drafter folder's `provenance.json` (and the model card) describe the whole run, not the last process.
`eagle3-zoo consolidate` reads the same record from the checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from typing_extensions import override

RECORD_KEY = "eagle3_zoo_training"


class TrainingRecordCallback(L.Callback):
    """Keeps the run's training record (see the module docstring) in every checkpoint.

    Args:
        started: `time.time()` when this start of `fit` began (its data and target loading count as run time).
        hardware: what this start trained on ("Intel(R) Xeon(R), 2 cores, 2 threads").
        static: fields known at the start (strategy, precision, world size).
    """

    def __init__(self, started: float, hardware: str | None = None, static: dict[str, Any] | None = None):
        self.started, self.hardware, self.static = started, hardware, dict(static or {})
        self.before: dict[str, Any] = {}  # the record of the earlier starts (from the resumed checkpoint)
        self.final: dict[str, Any] | None = None  # the record at the end of training (what the last checkpoint holds)
        self._first_step: int | None = None  # global step when this start began training

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        record = checkpoint.get(RECORD_KEY)
        self.before = dict(record) if isinstance(record, dict) else {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first_step = trainer.global_step

    def trained_steps(self, trainer: L.Trainer) -> int:
        """Optimizer steps this start of `fit` took (0 for a rerun of a finished run)."""
        return trainer.global_step - (trainer.global_step if self._first_step is None else self._first_step)

    def record(self, trainer: L.Trainer) -> dict[str, Any]:
        """The run's record now: the earlier starts' with this one's added; unchanged if this start trained nothing."""
        if self.before and not self.trained_steps(trainer):
            return dict(self.before)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        return {
            **self.static,
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "wall_time_s": round(float(self.before.get("wall_time_s") or 0.0) + time.time() - self.started, 1),
            "starts": int(self.before.get("starts") or 0) + 1,
            "hardware": self.hardware or self.before.get("hardware"),
            # metrics of the last logged step and validation; a start that logged none keeps the earlier ones
            "final_metrics": {**(self.before.get("final_metrics") or {}), **metrics},
        }

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # runs before the checkpoint callbacks' (Lightning calls those last): the final `last.ckpt` holds this record
        self.final = self.record(trainer)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[RECORD_KEY] = self.final if self.final is not None else self.record(trainer)
