"""The training progress bar of a step-limited run counts optimizer steps of max_steps across epochs and shows the
loss, acc_0 and tokens/s (not Lightning's `Epoch 2/-2 ... v_num`)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from eagle3_zoo.training.callbacks import StepProgressBar


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch, batch_idx):
        loss = (self.w * batch["input_ids"].float().mean()).sum()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc_0", torch.tensor(0.5), prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _batches(n):
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2])
    return [{"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": mask} for _ in range(n)]


def test_step_progress_bar_counts_steps_across_epochs(tmp_path, capsys):
    bar = StepProgressBar()
    trainer = L.Trainer(max_steps=5, max_epochs=None, logger=False, enable_checkpointing=False, callbacks=[bar],
                        default_root_dir=tmp_path, enable_model_summary=False, accelerator="cpu")
    trainer.fit(_Tiny(), DataLoader(_batches(3), batch_size=None))  # 3 batches per epoch: epochs 0 and 1
    out = capsys.readouterr().out.replace("\r", "\n")
    final = [ln for ln in out.splitlines() if "5/5" in ln]
    assert final and "step (epoch 1)" in final[-1], out[-2000:]
    assert "train/loss" in final[-1] and "train/acc_0" in final[-1] and "tok/s=" in final[-1]
    assert "v_num" not in out and "/-2" not in out
    assert bar._tokens == 5 * 8  # padding excluded: 5 + 3 tokens per batch


def _logged_steps(tmp_path, caplog, **kwargs) -> list[str]:
    import logging

    from eagle3_zoo.training.callbacks import ProgressLogCallback

    trainer = L.Trainer(max_steps=5, max_epochs=None, logger=False, enable_checkpointing=False,
                        callbacks=[ProgressLogCallback(**kwargs)], default_root_dir=tmp_path,
                        enable_model_summary=False, enable_progress_bar=False, accelerator="cpu")
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.training.callbacks"):
        trainer.fit(_Tiny(), DataLoader(_batches(3), batch_size=None))
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


def test_training_log_lines_come_every_log_every_s_seconds_not_every_n_steps(tmp_path, caplog):
    lines = _logged_steps(tmp_path, caplog, log_every_s=3600.0)  # the first step (a sign of life) and the last
    assert [ln.split(":")[0].split(",")[0] for ln in lines] == ["step 1/5 (20%)", "step 5/5 (100%)"]
    assert "ETA" in lines[0] and "steps/s" in lines[0] and "train/loss" not in lines[0] and "loss=" in lines[0]
    caplog.clear()
    assert len(_logged_steps(tmp_path, caplog, log_every_s=0.0)) == 5
    caplog.clear()
    assert _logged_steps(tmp_path, caplog, log_every_s=0.0, bar=True) == []  # the bar shows the steps


def test_the_log_interval_comes_from_the_environment_and_an_epoch_limited_run_logs_its_end(tmp_path, caplog,
                                                                                          monkeypatch):
    import logging

    import pytest

    from eagle3_zoo.training.callbacks import ProgressLogCallback

    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "0")
    assert len(_logged_steps(tmp_path, caplog)) == 5  # a line per step
    caplog.clear()
    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "3600")
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[ProgressLogCallback()], enable_model_summary=False, enable_progress_bar=False,
                        accelerator="cpu")
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.training.callbacks"):
        trainer.fit(_Tiny(), DataLoader(_batches(3), batch_size=None))
    steps = [r.getMessage().split(",")[0] for r in caplog.records if r.getMessage().startswith("step ")]
    assert steps == ["step 1", "step 6"]  # the first step and the end (no max_steps: no "last step" line before)
    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "soon")
    with pytest.raises(ValueError, match="EAGLE3_ZOO_LOG_EVERY_S='soon': expected a number of seconds >= 0"):
        ProgressLogCallback()
