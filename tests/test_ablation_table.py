"""scripts/ablation_table.py: the paired comparison that says whether an evaluation separates two drafters."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ablation_table.py"
spec = importlib.util.spec_from_file_location("ablation_table", SCRIPT)
ablation_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablation_table)


def _result(rows: list[tuple[str, int, int]]) -> dict:
    return {"requests": {"mtbench": [{"id": i, "new_tokens": n, "cycles": c} for i, n, c in rows]}}


def test_paired_difference_resolves_a_consistent_gain_and_not_noise():
    ref = _result([(f"{q}/turn1", 64, c) for q, c in enumerate([40, 30, 35, 45, 32, 38, 41, 29])])
    # every request needs 4 cycles fewer: tau rises on each, so the interval excludes 0
    better = _result([(f"{q}/turn1", 64, c - 4) for q, c in enumerate([40, 30, 35, 45, 32, 38, 41, 29])])
    d, lo, hi = ablation_table.paired_tau_difference(ref, better)
    assert d == 64 * 8 / (290 - 32) - 64 * 8 / 290 and 0 < lo <= d <= hi
    # as many requests better as worse by the same amount: the interval straddles 0
    mixed = _result([(f"{q}/turn1", 64, c + (4 if q % 2 else -4)) for q, c in enumerate([40, 30, 35, 45, 32, 38,
                                                                                         41, 29])])
    d, lo, hi = ablation_table.paired_tau_difference(ref, mixed)
    assert lo < 0 < hi
    assert ablation_table.paired_tau_difference(ref, ref) == (0.0, 0.0, 0.0)
    # only shared requests are paired; none shared -> no comparison
    assert ablation_table.paired_tau_difference(ref, _result([("99/turn1", 64, 10)])) is None
    assert ablation_table.paired_tau_difference(ref, None) is None


def test_lossless_cell_counts_checked_requests_and_says_when_none_were():
    ok = {"overall": {"lossless_checked": 32, "lossless_mismatches": []}}
    bad = {"overall": {"lossless_checked": 32, "lossless_mismatches": [{"id": "81/turn1", "first_difference": 7}]}}
    unchecked = {"overall": {"lossless_checked": 0, "lossless_mismatches": []}}
    assert ablation_table.lossless_cell({"tree": ok, "chain": ok}) == "64/64"
    assert ablation_table.lossless_cell({"tree": ok, "chain": bad}) == "63/64"
    assert ablation_table.lossless_cell({"tree": unchecked, "chain": None}) == "not checked"
    assert ablation_table.lossless_cell({"tree": None, "chain": None}) == "-"
