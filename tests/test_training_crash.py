"""Crash safety: SIGKILL `fit` and the feature job mid-run, rerun, and compare with uninterrupted runs.

Slow: `pytest -m slow tests/test_training_crash.py`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import (
    REPO,
    run_fit_cli,
    save_tiny_target,
    subprocess_env,
    tiny_recipe,
    write_chat_jsonl,
    write_recipe,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash")
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=200)
    recipe = tiny_recipe(tmp, target, data, trainer={"max_steps": 30, "checkpoint_every_n_steps": 5,
                                                     "val_check_interval": 10, "log_every_n_steps": 5},
                         ttt={"steps": 3, "schedule": "ramp", "ramp_fraction": 0.5})
    return tmp, write_recipe(tmp / "crash.yaml", recipe)


def _kill_when(cmd: list[str], ready, timeout: float = 300) -> int:
    """Start `cmd`, SIGKILL it as soon as `ready()` is true; returns the exit code (-9 if it was killed)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=subprocess_env(), cwd=REPO)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_fit_resumes_to_the_same_drafter(setup):
    tmp, recipe = setup
    ref, crashed = tmp / "ref", tmp / "crashed"
    r = run_fit_cli(recipe, f"output_dir={ref}")
    assert r.returncode == 0, r.stderr[-4000:]

    ckpt = crashed / "checkpoints" / "last.ckpt"
    code = _kill_when([sys.executable, "-m", "eagle3_zoo.cli", "fit", str(recipe), f"output_dir={crashed}"],
                      ckpt.exists)
    assert code == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (crashed / "drafter").exists()
    killed_at = torch.load(ckpt, weights_only=False)["global_step"]
    assert 0 < killed_at < 30

    r = run_fit_cli(recipe, f"output_dir={crashed}")
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resuming from {ckpt}" in r.stderr
    a = load_file(ref / "drafter" / "model.safetensors")
    b = load_file(crashed / "drafter" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0)
    prov = json.loads((crashed / "drafter" / "provenance.json").read_text())
    assert prov["training"]["global_step"] == 30


def _store_files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*.safetensors")}


def test_killed_feature_job_resumes_to_the_same_store(setup):
    from eagle3_zoo.data.features import FeatureReader

    tmp, recipe = setup
    ref, crashed = tmp / "features_ref", tmp / "features_crashed"
    extract = [sys.executable, "-m", "eagle3_zoo", "prepare", str(recipe), "data.mode=offline",
               "data.features_shard_size=2"]  # = `eagle3-zoo prepare`: the feature job runs for an offline recipe
    r = subprocess.run([*extract, f"data.features_dir={ref}"], capture_output=True, text=True, env=subprocess_env(),
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]

    def some_shards_written() -> bool:  # one shard per part here (features_shard_size = batch_size = 2)
        return len(list(crashed.glob("part-*/manifest.json"))) >= 5

    code = _kill_when([*extract, f"data.features_dir={crashed}"], some_shards_written)
    assert code == -signal.SIGKILL, "the job finished before it could be killed"
    assert not (crashed / "manifest.json").exists()  # the parts are merged once all are done

    r = subprocess.run([*extract, f"data.features_dir={crashed}"], capture_output=True, text=True,
                       env=subprocess_env(), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads((crashed / "manifest.json").read_text()) == json.loads((ref / "manifest.json").read_text())
    assert _store_files(crashed) == _store_files(ref)
    assert not [p.name for p in crashed.rglob("*") if ".tmp" in p.name]
    reader = FeatureReader(crashed, verify="hash")
    assert len(reader.sample_ids) == len(set(reader.sample_ids)) == 200
