"""Two CPU processes (gloo) with ddp and fsdp (FSDP2 via ModelParallelStrategy) train the same drafter as one
process with the whole batch: the loss weighting makes the rank-averaged gradient equal the global-batch gradient.
Their checkpoints resume (the step count continues).

Slow ones: `pytest -m slow tests/test_distributed.py`.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import run_fit_cli, save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

TOL = 2e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, batch 2, 4 steps."""
    tmp = tmp_path_factory.mktemp("dist")
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=24)
    recipe = write_recipe(tmp / "tiny.yaml", tiny_recipe(tmp, target, data, trainer={"batch_size": 2}))
    r = run_fit_cli(recipe, f"output_dir={tmp / 'single'}")
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp, recipe


def _losses(run, version=0):
    rows = (run / f"logs/version_{version}/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    step, loss = header.index("step"), header.index("train/loss")
    return {int(r.split(",")[step]): float(r.split(",")[loss]) for r in rows[1:] if r.split(",")[loss]}


def _run_parallel(tmp, recipe, strategy, *extra):
    run = tmp / strategy
    r = run_fit_cli(recipe, f"trainer.strategy={strategy}", "trainer.devices=2", "trainer.batch_size=1",
                    f"output_dir={run}", *extra, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return run


def _assert_same_training(tmp, run):
    ref = _losses(tmp / "single")
    got = _losses(run)
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), step
    a = load_file(tmp / "single" / "drafter" / "model.safetensors")
    b = load_file(run / "drafter" / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=TOL, rtol=0)


def test_fsdp_two_processes_match_one(single):
    tmp, recipe = single
    run = _run_parallel(tmp, recipe, "fsdp")
    _assert_same_training(tmp, run)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4 and all(k.startswith("objective.drafter.") for k in ckpt["state_dict"])


@pytest.mark.slow
def test_fsdp_checkpoint_resumes(single):
    tmp, recipe = single
    run = tmp / "fsdp"
    if not (run / "checkpoints" / "last.ckpt").exists():
        run = _run_parallel(tmp, recipe, "fsdp")
    _run_parallel(tmp, recipe, "fsdp", "trainer.max_steps=6")
    assert sorted(_losses(run, version=1)) == [4, 5]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


@pytest.mark.slow
def test_ddp_two_processes_match_one_and_resume(single):
    tmp, recipe = single
    run = _run_parallel(tmp, recipe, "ddp")
    _assert_same_training(tmp, run)
    _run_parallel(tmp, recipe, "ddp", "trainer.max_steps=6")
    assert sorted(_losses(run, version=1)) == [4, 5]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
