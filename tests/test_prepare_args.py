"""`eagle3-zoo prepare` / `python -m eagle3_zoo prepare` arguments: overrides before or after the options, and a
rank outside the world refused in one line before anything is loaded."""

from __future__ import annotations

import runpy
import sys

import pytest
import yaml

from eagle3_zoo import cli
from eagle3_zoo.data import feature_job, stage


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """A valid recipe (embedded target and data: nothing is read while validating it); loading its target fails."""
    def no_target(*args, **kwargs):
        raise AssertionError("the target must not be loaded for bad arguments")

    monkeypatch.setattr("eagle3_zoo.training.build.load_recipe_target", no_target)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"data": {"sources": [{"path": "sharegpt-embedded"}],
                                             "cache_dir": str(tmp_path / "cache"), "mode": "offline"},
                                    "trainer": {"max_steps": 1}, "output_dir": str(tmp_path / "run")}))
    return str(path)


@pytest.mark.parametrize("argv", [
    ["R", "--rank", "1", "--world-size", "2", "trainer.seed=3", "data.seed=4"],
    ["R", "trainer.seed=3", "--rank", "1", "data.seed=4", "--world-size", "2"],
    ["--rank", "1", "--world-size", "2", "R", "trainer.seed=3", "data.seed=4"],
])
def test_prepare_takes_overrides_before_or_after_the_options(recipe, monkeypatch, capsys, argv):
    seen = {}

    def fake_prepare(r, *, rank, world_size):
        seen.update(seeds=(r.trainer.seed, r.data.seed), rank=rank, world_size=world_size)
        return {"ok": True}

    monkeypatch.setattr(stage, "prepare_recipe", fake_prepare)
    assert cli.main(["prepare", *[recipe if a == "R" else a for a in argv]]) == 0
    assert seen == {"seeds": (3, 4), "rank": 1, "world_size": 2}


@pytest.mark.parametrize("rank,world_size", [(5, 2), (2, 2), (-1, 2), (0, 0)])
def test_prepare_refuses_a_rank_outside_the_world(recipe, capsys, rank, world_size):
    assert cli.main(["prepare", recipe, "--rank", str(rank), "--world-size", str(world_size)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --rank {rank} --world-size {world_size}: expected world size >= 1 and 0 <= rank < world "
                   "size (rank r of N processes of a distributed feature job: --rank r --world-size N)\n")


def _python_m(monkeypatch, *argv):
    """`python -m eagle3_zoo prepare ARGV...` in this process; its exit code."""
    monkeypatch.setattr(sys, "argv", ["eagle3_zoo", "prepare", *argv])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("eagle3_zoo", run_name="__main__")
    return exited.value.code


def test_prepare_module_takes_intermixed_overrides_and_checks_the_rank(recipe, monkeypatch, capsys, tmp_path):
    assert _python_m(monkeypatch, recipe, "--rank", "3", "--world-size", "2", "trainer.seed=3") == 2
    assert capsys.readouterr().err.startswith("error: --rank 3 --world-size 2: expected world size >= 1")
    seen = {}
    monkeypatch.setattr(stage, "prepare_recipe", lambda r, *, rank, world_size: seen.update(
        seed=r.trainer.seed, rank=rank, world_size=world_size) or {"features_dir": str(tmp_path / "features")})
    assert _python_m(monkeypatch, recipe, "--rank", "1", "--world-size", "2", "trainer.seed=3") == 0
    assert seen == {"seed": 3, "rank": 1, "world_size": 2}


def test_library_entry_points_check_the_rank(recipe):
    from eagle3_zoo.recipe.sections import load_recipe

    with pytest.raises(ValueError, match=r"--rank 2 --world-size 2: expected"):
        stage.prepare_recipe(load_recipe(recipe), rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"--rank 0 --world-size 0: expected"):
        feature_job.extract_features(load_recipe(recipe), rank=0, world_size=0)
