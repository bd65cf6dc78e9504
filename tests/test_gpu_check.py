"""`scripts/gpu_check.sh --cpu-smoke`: the GPU check's code (TTT step vs the naive formulation, in fp32 with autocast
off and on a padded length; the device's attention backend vs the reference; `fit` as shipped under auto, with the
host-device syncs of a step counted, and under fsdp on one process with skeleton loading and a sharded checkpoint;
lossless greedy speculative decoding) on tiny CPU shapes. Rows are printed as they are measured, and a machine
without omegaconf (the lent GPU image, when its wheel is not carried) still gets every other row."""

from __future__ import annotations

import re
import subprocess
import sys

from training_fixtures import REPO, subprocess_env

ROWS = ["TTT train step bf16", "TTT train step bf16", "TTT train step bf16", "TTT attention 'cpu-flash' float32",
        "TTT attention 'cpu-flash' bfloat16", "TTT attention 'cpu-flash' float32",
        "TTT attention 'cpu-flash' bfloat16", "fit bf16-mixed auto", "fit bf16-mixed fsdp",
        "greedy speculative decoding"]


def _run(**env: str) -> tuple[int, list[str], str, bool]:
    """Run the smoke; returns (exit code, table rows, stderr, whether the process still ran when the first row was
    printed)."""
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--cpu-smoke"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(PYTHON=sys.executable, OMP_NUM_THREADS="2", **env))
    lines, running_at_first_row = [], None
    for line in proc.stdout:
        lines.append(line)
        if running_at_first_row is None and line.startswith("| TTT"):
            running_at_first_row = proc.poll() is None
    stderr = proc.stderr.read()
    code = proc.wait(timeout=300)
    table = [line.rstrip() for line in lines if line.startswith("|")]
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["check", "eagle3-zoo", "reference", "agreement",
                                                             "warm-up s", "ok"], "".join(lines)[-3000:] + stderr
    return code, table[2:], stderr, bool(running_at_first_row)


def test_gpu_check_cpu_smoke_prints_each_row_as_measured():
    code, rows, stderr, streamed = _run()
    assert code == 0, "\n".join(rows) + stderr[-3000:]
    assert streamed  # the first row came while the other checks were still running
    assert [r.split("|")[1].strip().split(",")[0] for r in rows] == ROWS, "\n".join(rows)
    assert all(r.endswith("| PASS |") for r in rows), "\n".join(rows)
    assert "vs naive fp32, autocast off: loss " in rows[0] and "(padded)" in rows[2]
    assert re.search(r"syncs in one step: [0-5] \(budget 5\)", rows[7]), rows[7]
    assert "skeleton: " in rows[8] and "sharded checkpoint written" in rows[8]
    assert "lossless: tree same tokens, chain same tokens" in rows[9]


def test_gpu_check_without_omegaconf_reports_and_runs_the_rest(tmp_path):
    """The lent GPU image has no omegaconf: without the carried wheel, the checks that need it fail with the error
    and the rest still run and pass; the exit code says a check failed."""
    shim = tmp_path / "omegaconf"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('No module named omegaconf')\n")
    code, rows, stderr, _ = _run(PYTHONPATH=f"{tmp_path}:{REPO}", GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    assert code == 1 and "no omegaconf" in stderr
    names = [r.split("|")[1].strip() for r in rows]
    assert names[7:] == ["fit auto", "fit fsdp", "speculative decoding"], "\n".join(rows)
    assert all(r.endswith("| PASS |") for r in rows[:7]) and all("ERROR ImportError" in r for r in rows[7:])
