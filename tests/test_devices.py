"""Which GPU each process uses, checked on a CPU with `torch.cuda` faked: `fit`'s setup hook makes the rank's GPU
the current device before the data stage (regeneration and the feature job run there, in `trainer.fit`), and a data job
started by hand (`prepare --rank r --world-size N`) puts rank r on its own GPU, not every rank on GPU 0."""

from __future__ import annotations

import types

import pytest
import torch
from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.recipe.decisions import run_plan
from eagle3_zoo.recipe.sections import load_recipe


@pytest.fixture
def two_gpus(monkeypatch):
    """`torch.cuda` says two GPUs; `set_device` calls are recorded (nothing runs on them)."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return calls


def _recipe(tmp_path, **trainer):
    (tmp_path / "target").mkdir()  # validated to exist, never read: the tests stop before the target is loaded
    data = write_chat_jsonl(tmp_path / "d.jsonl", n=2)
    return load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path / "target", data,
                                                                       trainer=trainer)))


class _Loaded(Exception):
    """Stops a job where the target would be loaded (`prepare_recipe`) or the data stage starts
    (`RunDataModule.prepare_run`)."""


@pytest.mark.parametrize("local_rank", [1, 0])
def test_setup_makes_the_ranks_gpu_current_before_the_data_stage(tmp_path, two_gpus, monkeypatch, local_rank):
    """Rank 1 of 2 started by Lightning (its local rank 1), or a one-process run (0): cuda:<local rank> is current
    when `RunDataModule.setup` starts the data stage (`prepare_run`, which loads the target there)."""
    from eagle3_zoo.training import build

    seen = []

    def prepare_run(self, device=None):
        seen.append((device, list(two_gpus)))
        raise _Loaded

    monkeypatch.setattr(build.RunDataModule, "prepare_run", prepare_run)
    recipe = _recipe(tmp_path, accelerator="gpu", devices=2, strategy="ddp")
    datamodule = build.run_datamodule(recipe, run_plan(recipe), "r.yaml")
    datamodule.trainer = types.SimpleNamespace(local_rank=local_rank)
    with pytest.raises(_Loaded):
        datamodule.setup("fit")
    assert seen == [(torch.device("cuda", local_rank), [torch.device("cuda", local_rank)])]


@pytest.mark.parametrize("rank, local_rank, expected", [(1, None, 1), (3, None, 1), (0, None, 0), (1, "0", 0)])
def test_prepare_by_hand_puts_each_rank_on_its_own_gpu(tmp_path, two_gpus, monkeypatch, rank, local_rank, expected):
    """`prepare --rank r --world-size 4` on a 2-GPU machine: GPU r mod 2 (a launcher's LOCAL_RANK wins); the same
    for the feature job's entry point (`python -m eagle3_zoo prepare --rank r`)."""
    import eagle3_zoo.targets.loading as loading
    from eagle3_zoo.data import feature_job, stage

    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    placed = []

    def load(target, drafter, trainer, source="recipe", device=None, **kw):
        placed.append(device)
        raise _Loaded

    monkeypatch.setattr(loading, "load_recipe_target", load)
    recipe = _recipe(tmp_path)  # trainer.accelerator auto
    for job in (stage.prepare_recipe, feature_job.extract_features):
        with pytest.raises(_Loaded):
            job(recipe, rank=rank, world_size=4)
    assert placed == [torch.device("cuda", expected)] * 2 and two_gpus == [torch.device("cuda", expected)] * 2
