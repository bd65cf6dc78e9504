"""scripts/bench_speculators.py refuses cleanly without speculators, and where speculators is installed its
Eagle3 training step and eagle3-zoo's compute the same loss and gradients on a tiny shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_speculators.py"
spec = importlib.util.spec_from_file_location("bench_speculators", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = ["--seq-lens", "40", "--steps", "3", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate",
        "64", "--draft-vocab", "64", "--vocab", "96"]


def test_without_speculators_it_exits_2_and_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "speculators", None)  # import speculators raises ImportError
    monkeypatch.setitem(sys.modules, "speculators.config", None)
    with pytest.raises(SystemExit) as e:
        bench.import_peer()
    assert e.value.code == 2
    assert "pip install --no-deps speculators==0.9.0" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None, reason="speculators is not installed here")
@pytest.mark.parametrize("frozen", [False, True])
def test_the_two_steps_agree(frozen):
    args = bench.parse_args(TINY + (["--frozen-lm-head"] if frozen else []))
    ours, theirs = bench.build(args, 40, 3, bench.import_peer())
    err = bench.agreement(ours, theirs, 3)
    assert err["loss"] < 1e-5 and err["grad"] < 1e-4
    assert ours[0].lm_head.weight.requires_grad is not frozen
