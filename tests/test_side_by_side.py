"""scripts/side_by_side.py: per-arm bootstrap intervals, the paired comparison and the table it writes."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "side_by_side.py"
spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
side_by_side = importlib.util.module_from_spec(spec)
spec.loader.exec_module(side_by_side)


def _shapes(cycles: dict[str, list[int]], new_tokens: int = 64, mismatches: int = 0) -> dict:
    """An `eval --shapes` result: per shape one request per entry of its cycle list."""
    return {"shapes": [{"shape": shape, "requests": {"mtbench": [{"id": f"{i}/turn1", "new_tokens": new_tokens,
                                                                  "cycles": c} for i, c in enumerate(cs)]},
                        "overall": {"lossless_checked": len(cs),
                                    "lossless_mismatches": [{"request": "0/turn1"}] * mismatches}}
                       for shape, cs in cycles.items()]}


def test_tau_interval_pools_tokens_over_cycles_and_brackets_it():
    res = side_by_side.shape_result(_shapes({"chain:7": [40, 30, 35, 45, 32, 38, 41, 29]}), "chain:7")
    tau, lo, hi = side_by_side.tau_interval(res)
    assert tau == 64 * 8 / 290 and lo < tau < hi
    same = side_by_side.tau_interval(side_by_side.shape_result(_shapes({"chain:7": [32] * 8}), "chain:7"))
    assert same == (2.0, 2.0, 2.0)  # no spread between requests: no interval
    assert side_by_side.tau_interval(None) is None


def test_table_has_every_arm_the_paired_difference_and_the_lossless_count(tmp_path):
    base = [40, 30, 35, 45, 32, 38, 41, 29]
    for arm, delta in (("eagle3_ce", 0), ("eagle31_ce", -4), ("eagle3_acc", 0), ("eagle31_acc", -4)):
        run = tmp_path / arm / "drafter"
        run.mkdir(parents=True)
        metrics = {f"val/alpha_{k}": 0.5 - 0.01 * k for k in range(7)} | {f"val/acc_{k}": 0.4 for k in range(7)}
        (run / "provenance.json").write_text(json.dumps({"training": {"final_metrics": metrics}}))
        for bench in side_by_side.BENCHES:
            cycles = {shape: [c + delta for c in base] for shape in side_by_side.SHAPES}
            (tmp_path / arm / f"eval_{bench}.json").write_text(json.dumps(_shapes(cycles)))
        (tmp_path / f"{arm}.fit_seconds").write_text("1200\n")
    text = side_by_side.table(argparse.Namespace(out=tmp_path, acceptance_loss="lk_hybrid"))
    rows = text.splitlines()
    assert len(rows) == 2 + 4 and "EAGLE-3.1 + lk_hybrid" in text
    assert "0.500 / 0.490 / 0.480" in rows[2]
    better = rows[3].split(" | ")
    # 4 cycles fewer on every request: a difference the paired interval resolves (it excludes 0)
    diff = next(c for c in better if c.startswith("+"))
    lo = float(diff.split("[")[1].split(",")[0])
    assert lo > 0 and better[-1].strip(" |") == "32/32"
    assert rows[4].split(" | ")[5].startswith("+0.00 [+0.00, +0.00]")  # same cycles as the reference
