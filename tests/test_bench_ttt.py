"""scripts/bench_ttt.py times eagle3-zoo against the reference only after both computed the same loss and
gradients; a disagreement stops it."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from eagle3_zoo.training.reference import reference_ttt_loss

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_ttt.py"
spec = importlib.util.spec_from_file_location("bench_ttt", SCRIPT)
bench_ttt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_ttt)

ARGS = argparse.Namespace(hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=96, draft_vocab=64, batch=1,
                          seq_len=24, coverage=0.98, supervised_fraction=0.66, steps=3)


def _setup():
    drafter, embed, *batch = bench_ttt.build(ARGS)
    return drafter, embed, batch, [0.8**k for k in range(ARGS.steps)]


def test_the_two_formulations_agree_on_weights_away_from_zero():
    drafter, embed, batch, weights = _setup()
    assert float(drafter.fc.weight.abs().mean()) > 0.02  # not the near-zero default init
    err = bench_ttt.agreement(drafter, embed, batch, ARGS.steps, weights)
    assert err["loss"] < 1e-5 and err["grad"] < 1e-4


def test_a_disagreement_stops_the_benchmark(monkeypatch):
    drafter, embed, batch, weights = _setup()

    def shifted(drafter, embed, ids, aux, logits, valid, mask, steps, weights):  # a different function: K-1 steps
        return reference_ttt_loss(drafter, embed, ids, aux, logits, valid, mask, steps - 1, weights)

    monkeypatch.setattr(bench_ttt, "reference_ttt_loss", shifted)
    with pytest.raises(SystemExit, match="disagree"):
        bench_ttt.agreement(drafter, embed, batch, ARGS.steps, weights)
