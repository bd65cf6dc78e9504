"""scripts/kinds_side_by_side.py: per-request pairs of both judges, the pooled interval, the paired difference by
request id, and the table it writes from the arms' outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kinds_side_by_side.py"
spec = importlib.util.spec_from_file_location("kinds_side_by_side", SCRIPT)
kinds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kinds)
at = kinds._at

BASE = [40, 30, 35, 45, 32, 38, 41, 29]


def _ours(cycles: list[int], order=None, seconds: float = 4.0, base_seconds: float = 2.0) -> dict:
    rows = [{"id": f"{i}/turn1", "new_tokens": 64, "cycles": c, "seconds": seconds, "baseline_seconds": base_seconds}
            for i, c in enumerate(cycles)]
    if order is not None:
        rows = [rows[i] for i in order]
    return {"requests": {"mtbench": rows},
            "overall": {"lossless_checked": len(cycles), "lossless_mismatches": [], "acceptance_per_depth":
                        [0.5, 0.25, 0.125, 0.1]}}


def _vllm(accepted: list[int], drafts: int = 32, mismatches: int = 0) -> dict:
    rows = [{"id": f"mtbench:{i}/turn1", "new_tokens": 64, "seconds": 3.0, "baseline_seconds": 2.0,
             "spec": {"drafts": drafts, "accepted_tokens": a}} for i, a in enumerate(accepted)]
    return {"requests": rows, "overall": {"lossless_checked": True, "acceptance_per_depth": [0.4, 0.3, None],
                                          "lossless_mismatches": [f"mtbench:{i}/turn1" for i in range(mismatches)]}}


def test_pooled_interval_is_the_pooled_ratio_with_a_bracketing_bootstrap():
    tau, _ = kinds.request_pairs(_ours(BASE), "ours")
    mid, lo, hi = at.pooled_ratio_interval(tau)
    assert mid == 64 * 8 / sum(BASE) and lo < mid < hi
    # a request's tau is (drafts + accepted) / drafts in vLLM, pooled over requests
    vtau, vspeed = kinds.request_pairs(_vllm([8, 16, 24, 0]), "vllm")
    assert vtau["mtbench:1/turn1"] == (48, 32) and at.pooled_ratio_interval(vtau)[0] == 1 + 48 / 128
    assert at.pooled_ratio_interval(vspeed) == (2 / 3, 2 / 3, 2 / 3)  # plain seconds / speculative seconds
    assert at.pooled_ratio_interval({}) is None
    # a request's own tau (tokens of its cycles, the prefill's first token not counted) is what is pooled when given
    with_tau = _ours(BASE)
    for r in with_tau["requests"]["mtbench"]:
        r["tau"] = 63 / r["cycles"]
    assert at.pooled_ratio_interval(kinds.request_pairs(with_tau, "ours")[0])[0] == 63 * 8 / sum(BASE)


def test_paired_difference_pairs_by_request_id_not_by_position():
    ref, _ = kinds.request_pairs(_ours(BASE), "ours")
    # the same per-request cycles listed in another order: no difference at all
    shuffled, _ = kinds.request_pairs(_ours(BASE, order=[3, 1, 7, 0, 5, 2, 6, 4]), "ours")
    assert at.paired_ratio_difference(ref, shuffled) == (0.0, 0.0, 0.0)
    # 4 cycles fewer on every request: the paired interval excludes 0 although the per-arm intervals overlap
    better, _ = kinds.request_pairs(_ours([c - 4 for c in BASE]), "ours")
    d, lo, hi = at.paired_ratio_difference(ref, better)
    assert d == 64 * 8 / (sum(BASE) - 32) - 64 * 8 / sum(BASE) and 0 < lo <= d <= hi
    assert at.pooled_ratio_interval(better)[1] < at.pooled_ratio_interval(ref)[2]
    # only shared ids are paired
    assert at.paired_ratio_difference(ref, {"mtbench/99/turn1": (64, 10)}) is None


def test_table_rows_reference_and_lossless_counts(tmp_path):
    shapes = {"shapes": [{"shape": s, **_ours(BASE)} for s in kinds.EAGLE3_SHAPES]}
    for arm, ours, vllm, block in (("eagle3", shapes, _vllm([8] * 8), None),
                                   ("dflash", _ours([c - 4 for c in BASE], seconds=1.0), _vllm([16] * 8, 16, 1), 16)):
        (tmp_path / arm / "drafter").mkdir(parents=True)
        (tmp_path / arm / "eval_ours.json").write_text(json.dumps(ours))
        (tmp_path / arm / "eval_vllm.json").write_text(json.dumps(vllm))
        metrics = {f"val/acc_{k}": 0.5 for k in range(16)}
        (tmp_path / arm / "drafter" / "provenance.json").write_text(json.dumps(
            {"training": {"global_step": 77, "wall_time_s": 500.0, "final_metrics": metrics}}))
        (tmp_path / arm / "drafter" / "config.json").write_text(json.dumps({"block_size": block} if block else {}))
        (tmp_path / f"{arm}.fit_seconds").write_text("555\n")
    (tmp_path / "eagle3" / "logs" / "version_0").mkdir(parents=True)
    (tmp_path / "eagle3" / "logs" / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/loss\n0,9,1.0,\n0,19,,2.0\n0,29,1.0,\n0,39,,1.5\n0,41,1.0,\n")
    train = kinds.training_table(tmp_path).splitlines()
    assert len(train) == 4 and "| 77 | 555 | 500.0 |" in train[2]
    assert train[2].endswith("| 40 |") and train[3].endswith("| - |")  # the last validation: step 39 + 1
    assert train[2].count("0.50") == 7 and train[3].count("0.50") == 15  # acc_0..6 / acc_1..15
    rows = [r.split(" | ") for r in kinds.judged_table(tmp_path).splitlines()[2:]]
    assert len(rows) == len(kinds.ROWS)
    ours_ref, tree, dflash, vllm_ref, vllm_dflash = rows
    assert ours_ref[5] == "-" and tree[5].startswith("+0.00 [+0.00, +0.00]")
    assert dflash[2] == "block 16 (15 drafted)" and float(dflash[5].split("[")[1].split(",")[0]) > 0
    assert dflash[6] == "2.00 [2.00, 2.00]" and dflash[7].startswith("+1.50 [+1.50, +1.50]")  # 2/1 vs 2/4
    assert vllm_ref[4].startswith("1.25 [1.25, 1.25]") and vllm_dflash[4].startswith("2.00 [2.00, 2.00]")
    assert vllm_dflash[5].startswith("+0.75 [+0.75, +0.75]")
    assert ours_ref[-1].strip(" |") == "8/8" and vllm_dflash[-1].strip(" |") == "7/8"
    assert dflash[8] == "0.50 / 0.25 / 0.12" and vllm_ref[8] == "0.40 / 0.30 / -"
