"""Training callbacks: side effects only (the loss stays a pure function in the module).

`TTTScheduleCallback` sets how many TTT steps the module unrolls on each batch: all K from the start
("constant"), or a linear ramp from 1 to K over the first `ramp_fraction` of training ("ramp"), which lets the
drafter learn step 0 first and keeps the early steps cheap.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from eagle3_zoo.util.progress import _eta, progress_interval_s

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "ramp")
NUM_TOKENS = "num_tokens"  # a batch's tokens, counted on the host before it moves to the device (`batch_tokens`)


def ttt_steps_at(step: int, total_steps: int, steps: int, schedule: str = "constant",
                 ramp_fraction: float = 0.3) -> int:
    """Active TTT steps at optimizer step `step` (0-based) of `total_steps`.

    The ramp moves from 1 to `steps` in equal stages over the first `ramp_fraction * total_steps` steps, then
    stays at `steps`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown TTT schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if steps < 1:
        raise ValueError(f"TTT steps must be >= 1, got {steps}")
    ramp_steps = ramp_fraction * total_steps
    if schedule == "constant" or steps == 1 or ramp_steps <= 0:
        return steps
    return min(steps, 1 + math.floor(step * steps / ramp_steps))


class TTTScheduleCallback(L.Callback):
    """Set `pl_module.active_ttt_steps` before every training batch and log it as `train/ttt_steps`.

    Args:
        steps: the full unroll length K.
        schedule: "constant" (K throughout) or "ramp" (1 -> K over `ramp_fraction` of the run).
        ramp_fraction: fraction of `trainer.estimated_stepping_batches` (i.e. of max_steps) used by the ramp.
    """

    def __init__(self, steps: int, schedule: str = "constant", ramp_fraction: float = 0.3):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown TTT schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        if not 0 <= ramp_fraction <= 1:
            raise ValueError(f"ramp_fraction must be in [0, 1], got {ramp_fraction}")
        self.steps, self.schedule, self.ramp_fraction = steps, schedule, ramp_fraction

    def _total_steps(self, trainer: L.Trainer) -> int:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) else 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # a function of the global step only, so a resumed run continues the ramp where it stopped
        active = ttt_steps_at(trainer.global_step, self._total_steps(trainer), self.steps, self.schedule,
                              self.ramp_fraction)
        pl_module.active_ttt_steps = active
        # a tensor filled on the device: Lightning turns a float into a tensor by a blocking host-to-device copy
        pl_module.log("train/ttt_steps", torch.full((), float(active), device=pl_module.device), on_step=True,
                      on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "schedule": self.schedule, "ramp_fraction": self.ramp_fraction}


class ProgressLogCallback(L.Callback):
    """Training progress in words: what is trained (once), and where no live bar shows the steps (log files, CI),
    a line about every `log_every_s` seconds and at the last step (the end of an epoch-limited run too) with the step,
    rate, ETA and training metrics;
    after each validation a line with its metrics (written above the bar on a terminal).

    Args:
        log_every_s: seconds between step lines (default: `EAGLE3_ZOO_LOG_EVERY_S`, else 30).
        bar: a live bar shows the steps (`eagle3_zoo.util.progress.use_bar()`): no step lines then.
    """

    def __init__(self, log_every_s: float | None = None, bar: bool = False):
        self.log_every_s = progress_interval_s() if log_every_s is None else log_every_s
        self.bar = bar
        self._start = self._last_log = time.monotonic()
        self._first_step, self._last_step, self._tokens = 0, -1, 0

    @staticmethod
    def _line(metrics: dict[str, Any], prefix: str) -> str:
        keys = sorted((k for k in metrics if k.startswith(prefix + "/")), key=_metric_order)
        return " ".join(f"{k.split('/', 1)[1]}={v:.4g}" for k, v in zip(keys, _host_values([metrics[k] for k in keys])))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = self._last_log = time.monotonic()
        self._first_step, self._tokens = trainer.global_step, 0
        if trainer.is_global_zero:  # instead of Lightning's model summary table
            trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            logger.info("training %s trainable parameters from step %d to %s", f"{trainable:,}", trainer.global_step,
                        trainer.max_steps if trainer.max_steps > 0 else f"{trainer.max_epochs} epochs")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, now = trainer.global_step, time.monotonic()
        self._tokens += batch_tokens(batch)
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        # with gradient accumulation several batches end on the same optimizer step: one line per step at most
        due = now - self._last_log >= self.log_every_s or last or step == self._first_step + 1
        if self.bar or not trainer.is_global_zero or step == self._last_step or not due:
            return
        self._last_step, self._last_log = step, now
        logger.info("%s: %s", self._progress(trainer, step, now), self._line(trainer.callback_metrics, "train"))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # an epoch-limited run (or one stopped early) has no "last step" line yet: its final state, once
        if self.bar or not trainer.is_global_zero or trainer.global_step in (self._last_step, self._first_step):
            return
        self._last_step = trainer.global_step
        logger.info("%s: %s", self._progress(trainer, trainer.global_step, time.monotonic()),
                    self._line(trainer.callback_metrics, "train"))

    def _progress(self, trainer: L.Trainer, step: int, now: float) -> str:
        """`step 40/60 (67%), 0.21 steps/s, 245 tokens/s on this rank, ETA 0:01:35, 190 s elapsed`."""
        elapsed = max(now - self._start, 1e-9)
        rate = (step - self._first_step) / elapsed
        parts = [f"step {step}" + (f"/{trainer.max_steps} ({step / trainer.max_steps:.0%})"
                                   if trainer.max_steps > 0 else ""),
                 f"{rate:.2f} steps/s", f"{self._tokens / elapsed:.0f} tokens/s on this rank"]
        if trainer.max_steps > 0 and rate > 0 and step < trainer.max_steps:
            parts.append(f"ETA {_eta((trainer.max_steps - step) / rate)}")
        return ", ".join([*parts, f"{elapsed:.0f} s elapsed"])

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            logger.info("validation at step %d: %s", trainer.global_step, self._line(trainer.callback_metrics, "val"))


def _metric_order(key: str) -> tuple[int, str, int]:
    name = key.split("/", 1)[1]
    base, _, k = name.rpartition("_")
    return (0 if name == "loss" else 1, base if k.isdigit() else name, int(k) if k.isdigit() else -1)


def _host_values(values: list[Any]) -> list[float]:
    """Floats of device scalars and numbers, read in one transfer (one wait for the device, not one per value)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def batch_tokens(batch: Any) -> int:
    """Input tokens of a right-padded batch (padding excluded): the count taken on the host before the batch moved
    to the device (`DrafterModule.on_before_batch_transfer`), else counted from the batch."""
    if not isinstance(batch, dict):
        return 0
    if isinstance(batch.get(NUM_TOKENS), int):
        return batch[NUM_TOKENS]
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel()) if "input_ids" in batch else 0


class StepProgressBar(TQDMProgressBar):
    """The training bar of a step-limited run counts optimizer steps of `max_steps` across epochs and resumes (the
    stock bar shows `Epoch 2/-2` and batches of the epoch), and shows the loss, `acc_0` and tokens/s, not `v_num`."""

    def __init__(self) -> None:
        super().__init__()
        self._t0, self._tokens = 0.0, 0
        self._held: dict[str, Any] = {}  # metrics other than training's (validation's), kept from their last read

    def _count_steps(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar  # set by on_train_start
        if trainer.max_steps > 0:
            # the rate counts the steps since this bar (re)started, not the ones a resumed run did before
            bar.total, bar.n, bar.initial = trainer.max_steps, trainer.global_step, trainer.global_step
            bar.set_description(f"step (epoch {trainer.current_epoch})")  # refreshes the bar

    @override
    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._t0, self._tokens = time.monotonic(), 0
        self._count_steps(trainer)  # a run resumed mid-epoch gets no on_train_epoch_start for that epoch

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._count_steps(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._tokens += batch_tokens(batch)
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar, step = self.train_progress_bar, trainer.global_step
        # the stock bar's refresh rule (every `refresh_rate` steps and at the last), on optimizer steps
        if self.is_enabled and not bar.disable and (step % self.refresh_rate == 0 or step == bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._held = {k: v for k, v in super().get_metrics(trainer, pl_module).items()
                      if not k.startswith("train/") and k != "v_num"}

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        shown = getattr(pl_module, "shown_metrics", None)
        if trainer.training and shown:
            # the module read them with its step's counts (as of the previous step): reading Lightning's progress
            # bar metrics would wait for the device at every refresh
            items = {**self._held, **shown}
        else:
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
        elapsed = time.monotonic() - self._t0
        if self._tokens and elapsed > 0:
            items["tok/s"] = f"{self._tokens / elapsed:.0f}"
        return items
