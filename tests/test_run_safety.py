"""No silent wrong results from `fit` reruns: a changed recipe never resumes an old checkpoint, a diverged run stops
without writing anything non-finite, a rerun keeps the user's files in the drafter folder, and corrupt/foreign
checkpoints or stale temporaries are handled with one clear line (through the real CLI on a tiny target)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import run_fit_cli, save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.checkpoint import check_drafter
from eagle3_zoo.training.rundir.lock import RUN_LOCK
from eagle3_zoo.training.rundir.resume import RESUMABLE_KEYS, identity_differences, run_identity
from eagle3_zoo.util.provenance import provenance_json
from tests.hub_fixtures import canonical_dir, edit_weights


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("safety")
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=24)
    other = write_chat_jsonl(tmp / "other.jsonl", n=24, seed=1)
    recipe = write_recipe(tmp / "tiny.yaml", tiny_recipe(tmp, target, data, trainer={"max_steps": 2}))
    return tmp, recipe, other


def _one_line_error(r, code: int = 2) -> str:
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def test_rerun_with_changed_recipe_refuses_and_keeps_the_drafter(env):
    tmp, recipe, other = env
    run = tmp / "run_changed"
    assert run_fit_cli(recipe, f"output_dir={run}").returncode == 0
    weights = (run / "drafter" / "model.safetensors").read_bytes()
    provenance = (run / "drafter" / "provenance.json").read_text()

    r = run_fit_cli(recipe, f"output_dir={run}", f"data.sources=[{{path: {other}}}]", "optim.lr=0.05")
    line = _one_line_error(r)
    assert "belongs to a run with other settings" in line
    assert "optim.lr: 0.001 -> 0.05" in line and "prepared data" in line and "data.sources" in line
    assert "set another output_dir" in line and "trainer.max_steps" in line  # how to start fresh / what may change
    assert (run / "drafter" / "model.safetensors").read_bytes() == weights  # nothing rewritten
    assert (run / "drafter" / "provenance.json").read_text() == provenance

    line = _one_line_error(run_fit_cli(recipe, f"output_dir={run}", "drafter.draft_vocab_size=64"))
    assert "drafter.draft_vocab_size: 128 -> 64" in line and "draft vocabulary" in line


def test_rerun_keeps_user_files_in_the_drafter_folder(env):
    tmp, recipe, _ = env
    run = tmp / "run_user_files"
    assert run_fit_cli(recipe, f"output_dir={run}").returncode == 0
    drafter = run / "drafter"
    (drafter / "eval_results.json").write_text('{"mine": 1}\n')
    (drafter / "notes").mkdir()
    (drafter / "notes" / "a.txt").write_text("keep me")
    r = run_fit_cli(recipe, f"output_dir={run}", "trainer.max_steps=3")  # a resumable change: training continues
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr
    assert json.loads((drafter / "provenance.json").read_text())["training"]["global_step"] == 3
    assert (drafter / "eval_results.json").read_text() == '{"mine": 1}\n'
    assert (drafter / "notes" / "a.txt").read_text() == "keep me"
    # no staging or old folder left behind: only the run lock, which stays (flock: released when its holder ends)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [RUN_LOCK]


def test_a_rerun_that_trains_nothing_keeps_the_runs_record_and_consolidate_carries_it(env):
    """The provenance of a finished run (its wall time, epochs, hardware, final metrics) survives a rerun of `fit`,
    which resumes at max_steps and trains nothing; `consolidate` writes the same record from the checkpoint."""
    from eagle3_zoo.cli import main

    tmp, recipe, _ = env
    run = tmp / "run_record"
    assert run_fit_cli(recipe, f"output_dir={run}").returncode == 0
    first = json.loads((run / "drafter" / "provenance.json").read_text())["training"]
    assert first["global_step"] == 2 and first["wall_time_s"] > 0 and first["hardware"]
    assert {"train/loss", "train/acc_0"} <= set(first["final_metrics"]) and first["epochs"] >= 0
    r = run_fit_cli(recipe, f"output_dir={run}")
    assert r.returncode == 0 and "resuming from" in r.stderr, r.stderr[-3000:]
    again = json.loads((run / "drafter" / "provenance.json").read_text())["training"]
    assert again == first  # not this process's 2 seconds, another epoch count or empty metrics
    assert first["starts"] == 1  # the rerun trained nothing: it is no start of training
    assert main(["consolidate", str(run / "checkpoints" / "last.ckpt"), str(tmp / "consolidated")]) == 0
    merged = json.loads((tmp / "consolidated" / "provenance.json").read_text())["training"]
    assert {k: merged[k] for k in first} == first


def test_diverged_run_stops_keeps_last_finite_checkpoint_and_writes_no_drafter(env):
    tmp, recipe, _ = env
    run = tmp / "run_nan"
    r = run_fit_cli(recipe, f"output_dir={run}", "optim.lr=1e30", "optim.grad_clip=null",
                    "trainer.checkpoint_every_n_steps=1")
    line = _one_line_error(r, code=1)
    assert "NonFiniteError" in line and "not finite" in line and "--debug" in line
    assert not (run / "drafter").exists()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] >= 1
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())

    debug = run_fit_cli(recipe, f"output_dir={tmp / 'run_nan_debug'}", "optim.lr=1e30", "optim.grad_clip=null",
                        "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # --debug shows where it happened


@pytest.mark.parametrize("content", ["garbage", "foreign"])
def test_corrupt_or_foreign_checkpoint_is_one_line(env, content):
    tmp, recipe, _ = env
    run = tmp / f"run_{content}"
    (run / "checkpoints").mkdir(parents=True)
    last = run / "checkpoints" / "last.ckpt"
    if content == "garbage":
        last.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    else:
        torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 9}, last)
    line = _one_line_error(run_fit_cli(recipe, f"output_dir={run}"))
    expected = "is not a readable checkpoint of this run" if content == "garbage" else "not written by an eagle3-zoo"
    assert str(last) in line and expected in line and "set another output_dir" in line
    assert "weights_only" not in line  # torch's advice to unpickle anything is not passed on


def test_stale_checkpoint_temporaries_are_removed(env):
    tmp, recipe, _ = env
    run = tmp / "run_stale"
    stale = run / "checkpoints" / ".last.ckpt.k1ll3d.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a checkpoint")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    r = run_fit_cli(recipe, f"output_dir={run}", "trainer.max_steps=1")  # `eagle3-zoo fit`
    assert r.returncode == 0, r.stderr[-3000:]
    assert not stale.exists() and "removed 1 stale temporary" in r.stderr
    assert sorted(p.name for p in stale.parent.iterdir()) == ["last.ckpt"]
    # one clean log: no record printed twice (Lightning's own console handler and ours both used to print its lines)
    messages = [re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ \w+ [\w.]+: |^(INFO|WARNING): ", "", ln).strip()
                for ln in r.stderr.splitlines() if ln.strip() and not re.search(r"[━┃│┏┡└]|it/s", ln)]
    assert any("max_steps=1" in m for m in messages)  # Lightning's lines are there
    assert len(messages) == len(set(messages)), [m for m in messages if messages.count(m) > 1]


def test_run_identity_ignores_only_resumable_keys():
    base = {"optim": {"lr": 0.001}, "trainer": {"max_steps": 4, "precision": "32-true"}, "output_dir": "a"}
    ident = dict(data_fingerprint="f", d2t=torch.arange(3), target={"model_type": "llama"}, world_size=1)
    a = run_identity(base, **ident)
    assert identity_differences(a, run_identity({**base, "trainer": {"max_steps": 9, "precision": "32-true"},
                                                  "output_dir": "b"}, **ident)) == []
    assert identity_differences(a, run_identity({**base, "trainer": {"max_steps": 4, "precision": "bf16-mixed"}},
                                                **ident)) == ["trainer.precision: '32-true' -> 'bf16-mixed'"]
    assert identity_differences(a, run_identity(base, **{**ident, "d2t": torch.tensor([0, 1, 5])}))
    assert identity_differences(a, run_identity(base, **{**ident, "data_fingerprint": "g"}))
    assert "trainer.max_steps" in RESUMABLE_KEYS and "optim.lr" not in RESUMABLE_KEYS


def test_run_identity_allows_another_world_size_with_the_same_global_batch():
    """2 processes x batch 1 resume as 1 process x batch 2 (the same global batches, resharded state); a change of
    the global batch (2 x 1 -> 1 x 1) is refused."""
    ident = dict(data_fingerprint="f", d2t=torch.arange(3), target={"model_type": "llama"})
    two = run_identity({"trainer": {"devices": 2, "num_nodes": 1, "batch_size": 1}}, **ident, world_size=2)
    one = run_identity({"trainer": {"devices": 1, "num_nodes": 1, "batch_size": 2}}, **ident, world_size=1)
    assert identity_differences(two, one) == []
    nodes = run_identity({"trainer": {"devices": 1, "num_nodes": 2, "batch_size": 1}}, **ident, world_size=2)
    assert identity_differences(two, nodes) == []
    smaller = run_identity({"trainer": {"devices": 1, "num_nodes": 1, "batch_size": 1}}, **ident, world_size=1)
    assert identity_differences(two, smaller) == [
        "global batch (trainer.batch_size x devices x num_nodes): 2 -> 1"]


def test_provenance_is_strict_json():
    text = provenance_json({"final_metrics": {"val/loss": float("nan"), "acc": 0.5, "big": float("inf")},
                            "path": __import__("pathlib").Path("/x")})

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    parsed = json.loads(text, parse_constant=refuse)
    assert parsed == {"final_metrics": {"val/loss": None, "acc": 0.5, "big": None}, "path": "/x"}


def test_check_flags_non_finite_weights(tmp_path):
    src, _ = canonical_dir(tmp_path)
    assert check_drafter(src).ok

    def poison(state):
        state["midlayer.mlp.down_proj.weight"][0, 0] = float("nan")
        state["norm.weight"][1] = float("inf")

    edit_weights(src, poison)
    report = check_drafter(src)
    found = [p for p in report.problems if p.code == "NONFINITE_WEIGHTS"]
    assert len(found) == 1 and not report.ok, report
    assert "midlayer.mlp.down_proj.weight" in found[0].message and "norm.weight" in found[0].message
    assert "2 weight tensor(s)" in found[0].message
    fine = load_file(src / "model.safetensors")
    assert not torch.isfinite(fine["norm.weight"]).all()  # the file really holds the poisoned values


def test_identity_saved_before_world_size_became_resumable_compares_by_global_batch():
    base = {"optim": {"lr": 0.001}, "trainer": {"batch_size": 2, "precision": "32-true"}}
    ident = dict(data_fingerprint="f", d2t=torch.arange(3), target={"model_type": "llama"})
    current = run_identity(base, world_size=2, **ident)  # global batch 4
    old = {k: v for k, v in current.items() if not k.startswith("global batch")}
    old |= {"trainer.batch_size": "4", "trainer.devices": "1", "trainer.num_nodes": "1"}  # the old format
    assert identity_differences(old, current) == []  # 4 x 1 x 1 == 2 x 2: resumable, and no "<unset>" noise
    old["trainer.batch_size"] = "2"
    assert identity_differences(old, current) == [
        "global batch (trainer.batch_size x devices x num_nodes): 2 -> 4"]
    old["trainer.devices"] = "'auto'"  # cannot be resolved from the old identity: refused, said plainly
    assert identity_differences(old, current) == [
        "global batch (trainer.batch_size x devices x num_nodes): <unset> -> 4"]


@pytest.mark.parametrize("name, params", [("soft_ce", {}), ("lk_hybrid", {"eta": 3.0}), ("lk_hybrid", {"eta": 2.0})])
def test_identity_saved_before_loss_params_compares_its_lk_eta_as_lk_hybrids_eta(name, params):
    ident = dict(data_fingerprint="f", d2t=torch.arange(3), target={"model_type": "llama"}, world_size=1)
    current = run_identity({"loss": {"name": name, "params": params, "lk_eta": None}}, **ident)
    old = run_identity({"loss": {"name": name, "lk_eta": 3.0}}, **ident)  # what every earlier run saved
    assert identity_differences(old, current) == ([] if params.get("eta", 3.0) == 3.0 else
                                                  ["loss.params.eta: 3.0 -> 2.0"])
    moved = run_identity({"loss": {"name": "tv", "params": {}, "lk_eta": None}}, **ident)
    assert identity_differences(old, moved) == [f"loss.name: '{name}' -> 'tv'"] + (
        ["loss.params.eta: 3.0 -> <unset>"] if name == "lk_hybrid" else [])
