"""Ctrl-C during `fit` (a KeyboardInterrupt raised in a training step, as SIGINT raises it): exit 130 with one line
saying what the run kept, Ctrl-C handled again afterwards, and the kept checkpoint resumed by the same recipe."""

from __future__ import annotations

import json
import signal

import pytest
from training_fixtures import tiny_run_files

from eagle3_zoo.cli import main
from eagle3_zoo.training.module import DrafterModule


def _interrupt_at(monkeypatch, step: int) -> None:
    """Raise KeyboardInterrupt in the training step at global step `step` (what Ctrl-C raises in the main thread)."""
    real = DrafterModule.training_step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == step:
            raise KeyboardInterrupt
        return real(self, batch, batch_idx)

    monkeypatch.setattr(DrafterModule, "training_step", training_step)


def _interrupted_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(("interrupted", "error:"))]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _csv_steps(path):
    rows = path.read_text().splitlines()
    header = rows[0].split(",")
    col, loss = header.index("step"), header.index("train/loss")
    return [int(r.split(",")[col]) for r in rows[1:] if r.split(",")[loss]]


@pytest.fixture
def recipe(tmp_path):
    return tiny_run_files(tmp_path, n=16)  # 4 steps, last.ckpt every 2, output_dir tmp_path/run


def test_an_interrupted_fit_exits_130_naming_the_checkpoint_that_resumes(recipe, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    _interrupt_at(monkeypatch, 3)
    assert main(["fit", str(recipe)]) == 130
    line = _interrupted_line(capsys.readouterr().err)
    last = run / "checkpoints" / "last.ckpt"
    assert line == (f"interrupted: fit stopped at step 3; the last checkpoint {last} (step 2) is kept: `eagle3-zoo "
                    "fit` with the same recipe resumes from it"), line
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Lightning had left Ctrl-C ignored
    assert not (run / "drafter").exists()

    monkeypatch.undo()
    assert main(["fit", str(recipe)]) == 0
    assert json.loads((run / "drafter" / "provenance.json").read_text())["training"]["global_step"] == 4
    assert _csv_steps(run / "logs" / "version_1" / "metrics.csv") == [2, 3]  # resumed at step 2, not from 0


def test_a_fit_interrupted_before_its_first_checkpoint_says_nothing_is_kept(recipe, tmp_path, capsys, monkeypatch):
    _interrupt_at(monkeypatch, 1)
    assert main(["fit", str(recipe)]) == 130
    line = _interrupted_line(capsys.readouterr().err)
    assert line == ("interrupted: fit stopped at step 1, before its first checkpoint (trainer.checkpoint_every_n_steps "
                    "= 2): no training is kept; `eagle3-zoo fit` with the same recipe starts it again"), line
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_other_exits_inside_fit_are_not_taken_for_an_interrupt(recipe, monkeypatch):
    from eagle3_zoo.training.fit import fit_main

    def training_step(self, batch, batch_idx):
        raise SystemExit(3)

    monkeypatch.setattr(DrafterModule, "training_step", training_step)
    with pytest.raises(SystemExit) as exit_:
        fit_main(recipe)
    assert exit_.value.code == 3


def test_a_sigterm_stops_fit_with_exit_143_naming_what_it_kept(recipe, tmp_path, capsys, monkeypatch):
    """A scheduler's SIGTERM: Lightning ends the step and raises its SIGTERMException, a SystemExit without a code
    that the CLI took for success (exit 0) before."""
    import os

    real = DrafterModule.training_step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 3 and not self.trainer.received_sigterm:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler notes it; the step ends, then the run stops
        return real(self, batch, batch_idx)

    monkeypatch.setattr(DrafterModule, "training_step", training_step)
    assert main(["fit", str(recipe), "trainer.max_steps=8"]) == 143
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(("terminated", "error:"))]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert lines == [f"terminated (SIGTERM): fit stopped at step 4; the last checkpoint {last} (step 4) is kept: "
                     "`eagle3-zoo fit` with the same recipe resumes from it"], err[-3000:]
    assert not (tmp_path / "run" / "drafter").exists()  # stopped at step 4 of 8: no drafter folder written
