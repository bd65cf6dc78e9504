"""End to end through the real CLI entry on a tiny random Llama target: online fit, exact outputs, resume with a
larger max_steps (the step count continues), offline fit (same drafter as online), and a user error."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import run_fit_cli, save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.modeling import Eagle3Drafter
from eagle3_zoo.training.rundir.lock import RUN_LOCK


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=24)
    recipe = write_recipe(tmp / "tiny.yaml", tiny_recipe(tmp, target, data))
    return tmp, recipe


@pytest.fixture(scope="module")
def online_step4(setup):
    """The drafter of a plain 4-step online fit (the reference of the offline and preconditioning tests), trained
    here when `test_online_fit_outputs_and_resume` has not already saved it (e.g. a test run on its own)."""
    tmp, recipe = setup
    path = tmp / "online_step4.safetensors"
    if not path.exists():
        run = tmp / "run_reference"
        r = run_fit_cli(recipe, f"output_dir={run}")
        assert r.returncode == 0, r.stderr[-4000:]
        shutil.copy(run / "drafter" / "model.safetensors", path)
    return path


def _files(root):
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _csv_steps(path):
    rows = path.read_text().splitlines()
    header = rows[0].split(",")
    col, loss = header.index("step"), header.index("train/loss")
    return [int(r.split(",")[col]) for r in rows[1:] if r.split(",")[loss]]


def test_online_fit_outputs_and_resume(setup):
    tmp, recipe = setup
    run = tmp / "run"
    r = run_fit_cli(recipe)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().endswith(str(run / "drafter"))
    assert _files(run) == {"drafter/config.json", "drafter/model.safetensors", "drafter/recipe.yaml",
                           "drafter/provenance.json", "checkpoints/last.ckpt", "logs/version_0/metrics.csv",
                           "logs/version_0/hparams.yaml", RUN_LOCK}  # the run lock stays (flock: unheld now)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((run / "drafter").stat().st_mode) == 0o777 & ~umask  # not the temp dir's private mode
    assert stat.S_IMODE((run / "drafter" / "model.safetensors").stat().st_mode) == 0o666 & ~umask
    shutil.copy(run / "drafter" / "model.safetensors", tmp / "online_step4.safetensors")
    drafter = Eagle3Drafter.from_pretrained(run / "drafter")
    assert drafter.config.aux_layer_ids == (1, 2, 3) and drafter.config.draft_vocab_size == 128
    prov = json.loads((run / "drafter" / "provenance.json").read_text())
    assert prov["training"]["global_step"] == 4 and prov["target"]["model_type"] == "llama"
    data = prov["data"]
    assert data["conversations_read"] == 24 and data["train_examples"] + data["val_examples"] == 24
    assert data["train_supervised_tokens"] > 0 and data["draft_vocab_coverage"] == 1.0  # < 128 distinct tokens
    assert prov["packages"]["lightning"] and "sha" in (prov["git"] or {"sha": None})
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4
    assert all(k.startswith("objective.drafter.") for k in ckpt["state_dict"])  # the target is not saved
    assert _csv_steps(run / "logs/version_0/metrics.csv") == [0, 1, 2, 3]

    r = run_fit_cli(recipe, "trainer.max_steps=6")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resuming from" in r.stderr
    assert _csv_steps(run / "logs/version_1/metrics.csv") == [4, 5]  # continues, not from 0
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert json.loads((run / "drafter" / "provenance.json").read_text())["training"]["global_step"] == 6


def test_offline_fit_matches_online(setup, online_step4):
    tmp, recipe = setup
    run = tmp / "run_offline"
    r = run_fit_cli(recipe, "data.mode=offline", f"output_dir={run}")
    assert r.returncode == 0, r.stderr[-4000:]
    assert {"drafter/model.safetensors", "checkpoints/last.ckpt", "drafter/provenance.json"} <= _files(run)
    prov = json.loads((run / "drafter" / "provenance.json").read_text())
    store = Path(prov["data"]["features"]["features_dir"])
    assert json.loads((store / "manifest.json").read_text())["complete"]
    online = load_file(online_step4)
    offline = load_file(run / "drafter" / "model.safetensors")
    for k in online:  # fp32 features: the same computation as online, read back from disk
        torch.testing.assert_close(offline[k], online[k], atol=1e-5, rtol=0)


def test_prepare_caches_the_data_stage_for_fit(setup, capsys):
    """`eagle3-zoo prepare` runs regeneration and the feature job once; `fit` then reuses both."""
    from eagle3_zoo.cli import main

    tmp, recipe = setup
    overrides = ["data.mode=offline", "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=4",
                 f"data.cache_dir={tmp / 'prep_cache'}", f"output_dir={tmp / 'run_prepared'}"]
    assert main(["prepare", str(recipe), *overrides]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["regeneration"]["generated"] == 24 and summary["train_examples"] + summary["val_examples"] == 24
    store = Path(summary["features_dir"])
    assert json.loads((store / "manifest.json").read_text())["complete"]
    assert not (tmp / "run_prepared").exists()  # no training
    r = run_fit_cli(recipe, *overrides, "trainer.max_steps=1")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "regenerating" not in r.stderr and "feature store complete" in r.stderr
    prov = json.loads((tmp / "run_prepared" / "drafter" / "provenance.json").read_text())
    assert prov["data"]["regeneration"]["reused"] == 24 and prov["data"]["features"]["features_dir"] == str(store)


def test_preconditioned_fc_online_equals_offline_and_is_folded(setup, online_step4):
    tmp, recipe = setup
    written = {}
    for mode in ("online", "offline"):
        run = tmp / f"run_precond_{mode}"
        r = run_fit_cli(recipe, f"data.mode={mode}", "optim.precondition_fc=true", f"output_dir={run}")
        assert r.returncode == 0, r.stderr[-4000:]
        written[mode] = load_file(run / "drafter" / "model.safetensors")
        assert set(written[mode]) == set(load_file(online_step4))  # same format, no extra key
    for k in written["online"]:  # the scale measured by a target forward == the one from the stored features
        torch.testing.assert_close(written["offline"][k], written["online"][k], atol=1e-5, rtol=0)
    plain = load_file(online_step4)
    assert not torch.allclose(written["online"]["fc.weight"], plain["fc.weight"], atol=1e-4)


def test_cli_reports_user_errors_without_traceback(setup, capsys):
    from eagle3_zoo.cli import main

    tmp, recipe = setup
    assert main(["fit", str(recipe), "trainer.max_stpes=3", "drafter.draft_vocab_size=0"]) == 2
    err = capsys.readouterr().err
    assert "trainer.max_stpes" in err and "did you mean 'trainer.max_steps'" in err
    assert "drafter.draft_vocab_size" in err and "Traceback" not in err


def test_prepare_redoes_a_damaged_feature_shard(setup, caplog, capsys):
    """A truncated (or same-size corrupt) shard of a complete store is not "nothing to extract": `prepare` checks
    every shard against the manifest, extracts the damaged ones again, says so, and the store is as before."""
    from eagle3_zoo.cli import main
    from eagle3_zoo.data.features import FeatureReader

    tmp, recipe = setup
    overrides = ["data.mode=offline", f"data.cache_dir={tmp / 'redo_cache'}", f"output_dir={tmp / 'run_redo'}"]
    caplog.set_level("INFO")
    assert main(["prepare", str(recipe), *overrides]) == 0
    store = Path(json.loads(capsys.readouterr().out)["features_dir"])
    manifest = json.loads((store / "manifest.json").read_text())
    assert len(manifest["shards"]) == 6
    shard = store / manifest["shards"][2]["file"]
    original = shard.read_bytes()

    shard.write_bytes(original[:-100])  # an interrupted copy of the store
    caplog.clear()
    assert main(["prepare", str(recipe), *overrides]) == 0
    assert "nothing to extract" not in caplog.text
    assert f"{shard}: size {len(original) - 100} bytes, manifest says {len(original)}" in caplog.text
    assert manifest["shards"][2]["file"] == "part-00002/shard-00000.safetensors"  # one shard per part here
    assert "part-00002: redid 1 damaged shard(s) (4 samples): shard-00000.safetensors" in caplog.text
    assert shard.read_bytes() == original and json.loads((store / "manifest.json").read_text()) == manifest

    corrupt = bytearray(original)
    corrupt[-5] ^= 0xFF  # same size: only a hash sees it
    shard.write_bytes(bytes(corrupt))
    caplog.clear()
    assert main(["prepare", str(recipe), *overrides]) == 0
    assert "(corrupt shard)" in caplog.text and "redid 1 damaged shard(s)" in caplog.text
    assert shard.read_bytes() == original and json.loads((store / "manifest.json").read_text()) == manifest
    caplog.clear()
    assert main(["prepare", str(recipe), *overrides]) == 0
    assert "nothing to extract" in caplog.text  # sound again
    assert len(FeatureReader(store, verify="hash")) == 24
