"""The engine feed seen from training: its rate and the trainer's wait in the logs and the progress line, and what a
run keeps when the engine fails it."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from typing_extensions import override

logger = logging.getLogger(__name__)


class EngineFeedCallback(L.Callback):
    """Log `train/engine_tok_s` (prompt tokens/s the engine delivered to this rank) and `train/engine_wait` (the
    fraction of the time since the first request that the loaders waited for the engine) every batch: the progress
    bar and the progress log line show them. At the end, one summary line; on an engine failure, `kept` says what the
    run keeps (`fit` adds it to the error).

    Args:
        feed: the run's `eagle3_zoo.data.engine.feed.EngineFeed`; default: the DataModule's `feed`, read in `setup`
            (Lightning calls the callbacks' `setup` after the DataModule's, which builds `fit`'s run).
    """

    def __init__(self, feed: Any = None) -> None:
        self.feed = feed
        self.saved_step: int | None = None
        self.kept = ""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.feed is None:
            self.feed = getattr(trainer.datamodule, "feed", None)
        if self.feed is None:
            raise ValueError("EngineFeedCallback: the run streams no hidden states from an engine (no feed)")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stats, device = self.feed.stats, pl_module.device
        elapsed = max(stats.elapsed(), 1e-9)
        # tensors filled on the device: a float would be copied host-to-device with a wait, every step
        pl_module.log("train/engine_tok_s", torch.full((), stats.tokens / elapsed, device=device),
                      batch_size=1)  # not `prog_bar` (a wait per batch to show it): the bar reads `shown_metrics`
        pl_module.log("train/engine_wait", torch.full((), min(stats.wait_s / elapsed, 1.0), device=device),
                      batch_size=1)
        if isinstance(getattr(pl_module, "shown_metrics", None), dict):  # what a live bar shows, read on the host
            pl_module.shown_metrics.update({"train/engine_tok_s": stats.tokens / elapsed,
                                            "train/engine_wait": min(stats.wait_s / elapsed, 1.0)})

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.saved_step = trainer.global_step

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = self.feed.stats
        logger.info("engine feed (rank %d): %d requests, %d tokens in %.0f s (%.0f tokens/s); the loaders waited "
                    "%.1f s for it (%.0f%%); per server %s; %d request(s) answered by another server after a failure; "
                    "peak disk reserved %.1f MB", trainer.global_rank, s.requests, s.tokens, s.elapsed(),
                    s.tokens_per_s(), s.wait_s, 100 * s.wait_s / max(s.elapsed(), 1e-9), dict(s.per_server),
                    s.failovers, self.feed.peak_reserved / 1e6)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        checkpoint = (f"the last checkpoint (step {self.saved_step}) is kept" if self.saved_step is not None
                      else "no checkpoint was written in this run (a resume starts from the previous one, if any)")
        stores = {id(ds.stream.store): ds.stream.store for ds in (getattr(trainer.datamodule, "train_set", None),
                  getattr(trainer.datamodule, "val_set", None)) if ds is not None and ds.stream.store is not None}
        for st in stores.values():
            st.suspend()  # the samples it queued become a shard now, so they are counted (and kept)
        kept = [f"the feature store {st.directory} keeps {len(st.stored())} of {len(st.samples)} samples"
                for st in stores.values()]
        self.kept = (f"training stopped at step {trainer.global_step}; {checkpoint}"
                     + "".join(f"; {k}" for k in kept)
                     + "; bring the engine back and run the same command again to resume")
