"""`scripts/gpu_check.sh --cpu-smoke`: the GPU check's code (TTT step vs the naive formulation, in fp32 with autocast
off and on a padded length; the device's attention backend vs the reference; lossless greedy speculative decoding
with a drafter that accepts; `fit` as shipped under auto, with the host-device syncs of a whole step counted, and
under fsdp on one process with skeleton loading and a sharded checkpoint) on tiny CPU shapes. Rows are printed and
written to the JSON-lines file as they are measured, the planned H200 time comes first, and a machine without
omegaconf and without a package index (the lent GPU image, when its wheel is not carried) still gets every other
row."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
from training_fixtures import REPO, subprocess_env

ROWS = ["TTT train step bf16", "TTT train step bf16", "TTT train step bf16", "TTT attention 'cpu-flash' float32",
        "TTT attention 'cpu-flash' bfloat16", "TTT attention 'cpu-flash' float32",
        "TTT attention 'cpu-flash' bfloat16", "speculative decoding", "fit bf16-mixed auto", "fit bf16-mixed fsdp"]


def _run(jsonl, **env: str) -> tuple[int, list[str], str, bool, list[str]]:
    """Run the smoke; returns (exit code, table rows, stderr, whether the process still ran when the first row was
    printed, stdout lines)."""
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--cpu-smoke", "--jsonl", str(jsonl)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(PYTHON=sys.executable, OMP_NUM_THREADS="2", **env))
    lines, running_at_first_row = [], None
    for line in proc.stdout:
        lines.append(line)
        if running_at_first_row is None and line.startswith("| TTT"):
            # the row is in the JSON-lines file by the time it is printed
            running_at_first_row = proc.poll() is None and len(jsonl.read_text().splitlines()) >= 2
    stderr = proc.stderr.read()
    code = proc.wait(timeout=300)
    table = [line.rstrip() for line in lines if line.startswith("|")]
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["check", "eagle3-zoo", "reference", "agreement",
                                                             "warm-up s", "ok"], "".join(lines)[-3000:] + stderr
    return code, table[2:], stderr, bool(running_at_first_row), lines


def test_gpu_check_cpu_smoke_prints_and_records_each_row_as_measured(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    code, rows, stderr, streamed, lines = _run(jsonl)
    assert code == 0, "\n".join(rows) + stderr[-3000:]
    assert streamed  # the first row came (printed and recorded) while the other checks were still running
    # the plan comes first: every check of the GPU run with its estimate, inside 8 minutes with the start
    planned = re.fullmatch(r"planned on one H200: start (\d+) s \+ checks (\d+) s = (\d+) s \(limit 480 s\); "
                           r"per check: (.*)\n", lines[0])
    assert planned and int(planned[3]) <= 480 and len(re.findall(r" \d+ s(?:,|$)", planned[4])) == len(ROWS), lines[0]
    assert [r.split("|")[1].strip().split(",")[0] for r in rows] == ROWS, "\n".join(rows)
    assert all(r.endswith("| PASS |") for r in rows), "\n".join(rows)
    assert "vs naive fp32, autocast off: loss " in rows[0] and "(padded)" in rows[2]
    # decoding accepted (tau > 1.5 in each mode) and pruned the target's cache, losslessly
    assert "lossless: tree same tokens, chain same tokens; tree accepted [" in rows[7], rows[7]
    assert all(float(tau) > 1.5 for tau in re.findall(r"tau (\d+\.\d+)", rows[7])), rows[7]
    assert re.search(r"syncs in a whole fit step: \d+ \(budget \d+\)", rows[8]), rows[8]
    assert "skeleton: " in rows[9] and "sharded checkpoint written" in rows[9]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    head, done, measured = records[0], records[-1], records[1:-1]
    assert head["shapes"] == "cpu-smoke" and head["planned_s_h200"] == int(planned[3])
    assert done == {**done, "done": True, "ok": True, "errors": []}
    assert [r["check"] for r in measured] == [r.split("|")[1].strip() for r in rows]
    assert all(r["ok"] and r["estimate_s_h200"] > 0 for r in measured)
    assert measured[7]["same_tokens"] == {"tree": True, "chain": True}
    assert all(v["pruned"] > 0 for v in measured[7]["cache_prunings"].values())
    assert measured[8]["syncs"] == len(measured[8]["sync_events"])


def test_gpu_check_without_omegaconf_or_index_reports_and_runs_the_rest(tmp_path):
    """The lent GPU image has no omegaconf and no package index: without the carried wheel, fetching it fails, the
    checks that need it fail with the error and the rest still run and pass; the exit code says a check failed."""
    shim = tmp_path / "omegaconf"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('No module named omegaconf')\n")
    offline = tmp_path / "no-links"
    offline.mkdir()
    code, rows, stderr, _, _ = _run(tmp_path / "rows.jsonl", PYTHONPATH=f"{tmp_path}:{REPO}",
                                    GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"), PIP_NO_INDEX="1",
                                    PIP_FIND_LINKS=str(offline))
    assert code == 1 and "could not fetch omegaconf" in stderr, stderr[-2000:]
    names = [r.split("|")[1].strip() for r in rows]
    # only the `fit` checks load a recipe: the kernels and decoding (and the loss registry's value rules) run without it
    assert names[8:] == ["fit auto", "fit fsdp"], "\n".join(rows)
    assert all(r.endswith("| PASS |") for r in rows[:8]) and all("ERROR ImportError" in r for r in rows[8:])
    records = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert records[-1]["errors"] == ["fit auto", "fit fsdp"]


def test_plan_refuses_a_gpu_run_past_eight_minutes(monkeypatch):
    """The plan sums the start and every check's estimate: a check without one, or a total over 480 s, is refused
    before anything runs (it would spend the device time of a run that cannot finish)."""
    spec = importlib.util.spec_from_file_location("gpu_check_plan", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclass looks its module up there
    spec.loader.exec_module(gpu_check)
    keys = list(gpu_check.ESTIMATE_S)
    assert gpu_check.plan(keys).startswith("planned on one H200: start ")
    with pytest.raises(KeyError, match="no H200 estimate for \\['new check'\\]"):
        gpu_check.plan([*keys, "new check"])
    monkeypatch.setitem(gpu_check.ESTIMATE_S, "fit fsdp", gpu_check.LIMIT_S)
    with pytest.raises(ValueError, match="over the 480 s limit"):
        gpu_check.plan(keys)


def test_cuda_sync_count_skips_the_debug_modes_own_notice(monkeypatch):
    """On CUDA the fit step's syncs are the warnings of `set_sync_debug_mode("warn")`; its one-time notice about being
    a prototype also says "synchronizing" and was counted as a sync on the first H200 run (2 against a budget of 1)."""
    import warnings

    spec = importlib.util.spec_from_file_location("gpu_check_syncs", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)
    spec.loader.exec_module(gpu_check)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn_explicit("Synchronization debug mode is a prototype feature and does not yet detect all "
                               "synchronizing operations", UserWarning, "torch/cuda/__init__.py", 1270)
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "eagle3_zoo/module.py", 389)
    assert gpu_check.cuda_sync_events(seen) == ["sync at module.py:389"]


def test_dflash_gpu_check_cpu_smoke(tmp_path):
    """`scripts/gpu_check_dflash.py --cpu-smoke`: FlexAttention's block mask equals the dense reference (forward; a
    CPU has no flex backward) and the training step runs with both, every row recorded."""
    cmd = [sys.executable, "scripts/gpu_check_dflash.py", "--cpu-smoke", "--jsonl", str(tmp_path / "d.jsonl")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(row["ok"] for row in rows)
    assert rows[0]["loss_rel_err"] < 1e-4
