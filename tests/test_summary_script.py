"""scripts/summary.py: the quickstart ends with one table of the measured rows and the paths to look at."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.hub_fixtures import canonical_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "summary.py"
spec = importlib.util.spec_from_file_location("summary_script", SCRIPT)
summary_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary_script)


def test_summary_lists_every_measured_row_and_the_paths(tmp_path):
    run = tmp_path / "run"
    canonical_dir(run, name="drafter")
    bench = {"requests": 4, "tau": 1.44, "speedup": 0.93, "spec_tokens_per_s": 10.2, "baseline_tokens_per_s": 11.0,
             "lossless": True}
    machine = {"processor": "Xeon", "cpu_count": 2, "torch_threads": 1, "device": "cpu",
               "load_average": {"start": [1.5, 1.0, 0.5], "end": [2.25, 1.2, 0.6]}}
    (run / "drafter" / "eval_results.json").write_text(json.dumps({"benchmarks": {"mtbench": bench},
                                                                   "machine": machine}))
    (run / "drafter" / "provenance.json").write_text(json.dumps(
        {"training": {"global_step": 60, "wall_time_s": 74.0, "final_metrics": {"val/acc_0": 0.15}}}))
    text = summary_script.summary(run, card=run / "card" / "README.md")
    assert "trained 60 steps in 74.0 s; validation acc_0 0.150" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("mtbench"))
    assert row.split() == ["mtbench", "4", "1.44", "0.93x", "10.2", "11.0", "yes"]  # plain tokens/s beside
    assert "machine: Xeon (cpu, 2 cores, 1 torch threads); load average (1 min) during each run: evaluation: 1.50 at " \
           "the start, 2.25 at the end" in text
    assert f"drafter: {run / 'drafter'}" in text and "card:    " in text and "tensorboard --logdir" in text
    assert "WARNING" not in text

    (run / "drafter" / "eval_results.json").write_text(json.dumps({"benchmarks": {"mtbench": {**bench,
                                                                                               "lossless": False}}}))
    assert "WARNING: speculative output differed" in summary_script.summary(run)


def test_summary_without_a_drafter_is_a_clear_error(tmp_path, capsys):
    assert summary_script.main([str(tmp_path)]) == 2
    assert "no drafter folder" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        summary_script.summary(tmp_path)
