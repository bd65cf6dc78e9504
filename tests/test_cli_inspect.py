"""Inspect before you run: `fit --print-config` for every shipped recipe, a GPU recipe on a machine without GPUs
stops at once with one line, and files written atomically get ordinary permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from eagle3_zoo.cli import main

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_print_config_resolves_every_shipped_recipe(recipe, capsys):
    assert main(["fit", str(recipe), "trainer.seed=1234", "--print-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    written = yaml.safe_load(recipe.read_text())
    assert resolved["trainer"]["seed"] == 1234  # the override is applied
    assert resolved["target"]["name_or_path"] == written.get("target", {}).get("name_or_path",
                                                                               resolved["target"]["name_or_path"])
    assert set(resolved) == {"target", "drafter", "data", "ttt", "loss", "optim", "trainer", "engine", "output_dir",
                             "demo"}  # defaults
    assert "tau_eval" in resolved["trainer"] and "regenerate" in resolved["data"]


def test_prepare_print_config_loads_nothing(monkeypatch, capsys):
    import eagle3_zoo.data.stage as stage

    monkeypatch.setattr(stage, "prepare_recipe", lambda *a, **k: pytest.fail("prepare must not run"))
    assert main(["prepare", str(RECIPES[0]), "--print-config", "data.max_samples=7"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["max_samples"] == 7


def test_print_config_reports_a_bad_override(capsys):
    assert main(["fit", str(RECIPES[0]), "--print-config", "trainer.max_stpes=3"]) == 2
    assert "did you mean 'trainer.max_steps'" in capsys.readouterr().err


def test_gpu_recipe_without_gpus_stops_before_loading_anything(monkeypatch, capsys):
    import torch

    import eagle3_zoo.adapters as adapters

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(adapters, "load_target", lambda *a, **k: pytest.fail("the target must not be loaded"))
    assert main(["fit", "recipes/qwen25_7b.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "trainer.accelerator = 'gpu'" in err and "no CUDA GPU" in err and "trainer.accelerator=cpu" in err


def test_atomic_writes_get_ordinary_permissions(tmp_path):
    from eagle3_zoo.util.fileio import atomic_write_text

    umask = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "out.json", "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o640  # 0o666 & ~umask, not mkstemp's 0o600
