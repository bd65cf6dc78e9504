"""`scripts/gpu_check.sh --cpu-smoke`: the GPU check's code (TTT step vs the naive formulation with loss and
gradients compared, the device's attention backend vs the reference, bf16-mixed fit steps) on tiny CPU shapes."""

from __future__ import annotations

import subprocess
import sys

from training_fixtures import REPO, subprocess_env


def test_gpu_check_cpu_smoke_prints_one_passing_table():
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-smoke"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env=subprocess_env(PYTHON=sys.executable, OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = [line for line in r.stdout.splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["check", "eagle3-zoo", "naive / reference", "agreement",
                                                             "ok"]  # one table
    rows = table[2:]
    assert len(rows) == 5 and all(row.rstrip().endswith("| PASS |") for row in rows), "\n".join(table)
    assert [row.split("|")[1].strip().split(",")[0] for row in rows] == [
        "TTT train step bf16", "TTT train step bf16", "TTT attention 'cpu-flash' float32",
        "TTT attention 'cpu-flash' bfloat16", "fit bf16-mixed"]
    assert "loss " in rows[0] and "grads " in rows[0] and "tok/s" in rows[0]  # both formulations ran and compared
