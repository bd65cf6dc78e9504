"""DFlash as the second drafter kind, trained by `fit` (in process) on the tiny random Llama target: the loss falls,
the folder loads with `DFlashDrafter.from_pretrained` and decodes losslessly with `DFlashGenerator`, a rerun with the
same seed writes bit-identical weights, a resume continues (another DFlash setting is refused), offline features train
the same drafter, `consolidate` writes the same folder, and bad `drafter.dflash` keys (or EAGLE-3 keys that would do
nothing) are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import EAGLE3_ONLY_OVERRIDES, save_tiny_target, tiny_recipe, write_recipe

from eagle3_zoo.drafters import get_kind, kind_names
from eagle3_zoo.drafters.dflash.model import DFlashDrafter

DFLASH = {"kind": "dflash", "draft_vocab_size": 128, "aux_layer_ids": None,
          "dflash": {"num_layers": 1, "block_size": 4, "num_anchors": 32, "target_layer_ids": [0, 1, 2]}}


def _recipe(tmp, target, data, **sections):
    base = tiny_recipe(tmp, target, data, drafter=dict(DFLASH), ttt={"steps": 1, "schedule": "constant"},
                       optim={"lr": 3e-3, "warmup_steps": 1},
                       trainer={"max_steps": 30, "val_check_interval": 15, "checkpoint_every_n_steps": 10})
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return base


def write_counting_jsonl(path, n: int = 24):
    """Conversations whose replies count on from a random digit: text a drafter can learn in a few dozen steps (the
    fixed-sentence chats of `write_chat_jsonl` pair sentences at random, which no drafter can predict)."""
    rng = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(n):
            start = int(torch.randint(10, (1,), generator=rng))
            reply = " ".join(str((start + k) % 10) for k in range(40))
            f.write(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": "Count on."},
                                                                  {"from": "gpt", "value": reply}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash_fit")
    return tmp, save_tiny_target(tmp / "target"), write_counting_jsonl(tmp / "count.jsonl")


def _fit(tmp, target, data, name, *overrides, **sections):
    from eagle3_zoo.training.fit import fit_main

    path = write_recipe(tmp / f"{name}.yaml", _recipe(tmp, target, data, **sections))
    return fit_main(path, [f"output_dir={tmp / name}", *overrides])


def _losses(run):
    rows = (run / "logs/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    col = header.index("train/loss")
    return [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]


@pytest.fixture(scope="module")
def trained(files):
    tmp, target, data = files
    torch.set_num_threads(1)
    return _fit(tmp, target, data, "run")


def test_dflash_is_a_builtin_kind():
    assert "dflash" in kind_names()
    kind = get_kind("dflash")
    assert kind.drafter_class is DFlashDrafter and kind.layouts == ("dflash", "speculators-dflash")


def test_only_a_kind_that_unrolls_gets_the_ttt_schedule(files):
    """The Trainer of a DFlash run has no TTT schedule (nothing logs or shows `ttt_steps`); an EAGLE-3 run's has."""
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.callbacks import TTTScheduleCallback
    from eagle3_zoo.training.fit import build_trainer

    tmp, target, data = files
    dflash = load_recipe(write_recipe(tmp / "unrolls_dflash.yaml", _recipe(tmp, target, data)))
    eagle3 = load_recipe(write_recipe(tmp / "unrolls_eagle3.yaml", tiny_recipe(tmp, target, data)))
    schedules = [[c for c in build_trainer(r, logger=False).callbacks if isinstance(c, TTTScheduleCallback)]
                 for r in (dflash, eagle3)]
    assert [len(s) for s in schedules] == [0, 1]
    assert get_kind("dflash").unrolls is False and get_kind("eagle3").unrolls is True


def test_fit_trains_a_dflash_drafter_that_decodes_losslessly(files, trained):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
    from eagle3_zoo.speculative.generate import plain_generate

    tmp, target_dir, _ = files
    losses = _losses(tmp / "run")
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    drafter = DFlashDrafter.from_pretrained(trained)
    c = drafter.config
    assert c.target_layer_ids == (0, 1, 2) and c.aux_layer_ids == (1, 2, 3) and c.block_size == 4
    assert c.num_hidden_layers == 1 and c.draft_vocab_size == 128 and c.mask_token_id == c.vocab_size - 1
    assert drafter.d2t is not None and get_kind("dflash").check_folder(trained) == []
    tok_ids = set(drafter.to_target_ids(torch.arange(128)).tolist())  # the draft vocabulary holds the digits and " "
    assert {22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 227} <= tok_ids
    prov = json.loads((trained / "provenance.json").read_text())
    assert prov["drafter"]["aux_layer_ids"] == [1, 2, 3] and prov["training"]["global_step"] == 30
    metrics = (tmp / "run/logs/version_0/metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/tau_est", "train/acc_1", "train/acc_3", "val/loss", "val/tau_est"} <= set(metrics)
    assert "train/ttt_steps" not in metrics  # nothing is unrolled: no TTT schedule (`DrafterKind.unrolls`)

    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    gen = DFlashGenerator(target, drafter)
    for text in ("Hello, how are you today?", "The quick brown fox"):
        ids = torch.tensor(tok(text)["input_ids"])
        spec = gen.generate(ids, 24, eos_token_id=[])
        base = plain_generate(target, ids, 24, eos_token_id=[])
        assert spec.tokens == base.tokens
        assert spec.accept_lengths and all(0 <= a <= c.block_size - 1 for a in spec.accept_lengths)


def test_same_seed_rerun_is_bit_identical_and_resume_continues(files, trained):
    tmp, target, data = files
    torch.set_num_threads(1)
    again = _fit(tmp, target, data, "rerun")
    first, second = load_file(trained / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = _fit(tmp, target, data, "seed7", "trainer.seed=7", "trainer.max_steps=2")
    assert not torch.equal(load_file(other / "model.safetensors")["fc.weight"], first["fc.weight"])

    # resume: 20 steps, then to 30 from its last.ckpt
    _fit(tmp, target, data, "resumed", "trainer.max_steps=20")
    resumed = _fit(tmp, target, data, "resumed", "trainer.max_steps=30")
    assert json.loads((resumed / "provenance.json").read_text())["training"]["global_step"] == 30
    ckpt = torch.load(tmp / "resumed/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 30
    # a resume with another DFlash setting is refused, naming the key
    from eagle3_zoo.training.rundir.resume import ResumeError

    with pytest.raises(ResumeError, match="drafter.dflash.num_anchors"):
        _fit(tmp, target, data, "resumed", "trainer.max_steps=40", "drafter.dflash.num_anchors=4")


def test_offline_features_train_the_same_dflash_drafter(files, trained):
    """The feature job stores exactly the layers the kind reads (1, 2, 3 = target_layer_ids + 1); fp32 features read
    back from disk train the drafter the online run trained."""
    tmp, target, data = files
    torch.set_num_threads(1)
    out = _fit(tmp, target, data, "offline", "data.mode=offline")
    store = json.loads((out / "provenance.json").read_text())["data"]["features"]["features_dir"]
    manifest = json.loads((Path(store) / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 2, 3]
    online, offline = load_file(trained / "model.safetensors"), load_file(out / "model.safetensors")
    for k in online:
        torch.testing.assert_close(offline[k], online[k], atol=1e-5, rtol=0)


def test_check_folder_reports_a_broken_dflash_folder(files, trained, tmp_path):
    import shutil

    kind = get_kind("dflash")
    broken = shutil.copytree(trained, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    assert any("not a loadable DFlash drafter folder" in p for p in kind.check_folder(broken))
    nan = shutil.copytree(trained, tmp_path / "nan")
    state = load_file(nan / "model.safetensors")
    state["fc.weight"][0, 0] = float("nan")
    from safetensors.torch import save_file

    save_file(state, nan / "model.safetensors")
    assert any("non-finite" in p for p in kind.check_folder(nan))


def test_consolidate_writes_the_same_dflash_folder(files, trained):
    from eagle3_zoo.training.rundir.outputs import consolidate_checkpoint

    tmp, _, _ = files
    out = consolidate_checkpoint(tmp / "run/checkpoints/last.ckpt", tmp / "consolidated")
    a, b = load_file(trained / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("override, key", [
    ("drafter.dflash.block_size=1", "drafter.dflash.block_size"),
    ("drafter.dflash.weighting=linear", "drafter.dflash.weighting"),
    ("drafter.dflash.labels=medium", "drafter.dflash.labels"),
    ("drafter.dflash.dpace_alpha=0", "drafter.dflash.dpace_alpha"),
    ("drafter.dflash.target_layer_ids=[2,1]", "drafter.dflash.target_layer_ids"),
    ("drafter.dflash.num_anchors=0", "drafter.dflash.num_anchors"),
    ("drafter.dflash.mask_token_id=-1", "drafter.dflash.mask_token_id"),
    ("drafter.dflash.num_layerz=2", "drafter.dflash.num_layerz"),
    *EAGLE3_ONLY_OVERRIDES,
])
def test_bad_dflash_keys_are_refused_naming_the_key(files, override, key):
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe

    tmp, target, data = files
    path = write_recipe(tmp / "bad.yaml", _recipe(tmp, target, data, ttt={"steps": 3}))
    with pytest.raises(RecipeError) as e:
        load_recipe(path, [override])
    assert key in str(e.value)


def test_soft_labels_are_refused_for_another_kind(files):
    """`drafter.dflash.labels: soft` with an EAGLE-3 drafter would do nothing: refused, naming the key and the kind."""
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe

    tmp, target, data = files
    path = write_recipe(tmp / "soft_eagle3.yaml", _recipe(tmp, target, data))
    with pytest.raises(RecipeError, match=r"drafter.dflash.labels.*dflash only.*eagle3"):
        load_recipe(path, ["drafter.kind=eagle3", "drafter.dflash.labels=soft", "ttt.steps=3"])
    assert load_recipe(path, ["drafter.dflash.labels=soft"]).drafter.dflash.labels == "soft"


def test_fit_with_soft_labels_reads_the_targets_last_hidden_state(files, trained):
    """`drafter.dflash.labels: soft` trains on the tiny target online (the step asks the target for its last hidden
    state: `training_features`) and offline (the store's), to the same drafter; the loss falls; the weights differ
    from the hard-label run's; the folder decodes losslessly."""
    from transformers import LlamaForCausalLM

    from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
    from eagle3_zoo.speculative.generate import plain_generate

    tmp, target_dir, data = files
    torch.set_num_threads(1)
    kind = get_kind("dflash")
    from eagle3_zoo.recipe.sections import load_recipe

    recipe = load_recipe(write_recipe(tmp / "soft_plan.yaml", _recipe(tmp, target_dir, data)),
                         ["drafter.dflash.labels=soft"])
    cfg = DFlashDrafter.from_pretrained(trained).config
    assert kind.training_features(cfg, recipe.drafter).final_hidden is True
    assert kind.training_features(cfg, None).final_hidden is False and kind.features(cfg).final_hidden is False
    online = _fit(tmp, target_dir, data, "soft", "drafter.dflash.labels=soft")
    offline = _fit(tmp, target_dir, data, "soft_offline", "drafter.dflash.labels=soft", "data.mode=offline")
    losses = _losses(tmp / "soft")
    # the random target's distributions are flat: the soft CE falls towards their entropy, not towards 0
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]), losses
    a, b, hard = (load_file(f / "model.safetensors") for f in (online, offline, trained))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0)
    assert not torch.equal(a["fc.weight"], hard["fc.weight"])
    drafter = DFlashDrafter.from_pretrained(online)
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.tensor([1, 5, 9, 14, 3, 7])
    assert DFlashGenerator(target, drafter).generate(ids, 16, eos_token_id=[]).tokens == \
        plain_generate(target, ids, 16, eos_token_id=[]).tokens


def test_target_layer_ids_out_of_range_is_refused(files):
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe
    from eagle3_zoo.targets.loading import load_recipe_target

    tmp, target, data = files
    path = write_recipe(tmp / "range.yaml", _recipe(tmp, target, data))
    recipe = load_recipe(path, ["drafter.dflash.target_layer_ids=[0,3]"])
    with pytest.raises(RecipeError, match=r"drafter.dflash.target_layer_ids.*valid 0\.\.2"):
        load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, str(path))


def test_plan_sizes_a_dflash_drafter(files):
    from eagle3_zoo.recipe.decisions import drafter_config
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.targets.loading import feature_layer_ids

    tmp, target, data = files
    from transformers import AutoConfig

    from eagle3_zoo.adapters import get_adapter

    recipe = load_recipe(write_recipe(tmp / "plan.yaml", _recipe(tmp, target, data)))
    cfg = AutoConfig.from_pretrained(target)
    assert feature_layer_ids(recipe.drafter, recipe.target.name_or_path, cfg, get_adapter("llama")) == (1, 2, 3)
    dcfg = drafter_config(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, cfg, None)
    assert get_kind("dflash").num_parameters(dcfg) == sum(
        p.numel() for p in DFlashDrafter(dcfg).parameters())


def test_a_dflash_run_continues_a_trained_dflash_folder(files, trained):
    """`drafter.init_from` = the trained folder: the run starts from its weights (its first loss is the trained run's
    late loss, not a fresh drafter's) and writes a DFlash folder of the same shape."""
    tmp, target, data = files
    torch.set_num_threads(1)
    warm = _fit(tmp, target, data, "warm", "trainer.max_steps=2", f"drafter.init_from={trained}")
    fresh, warmed = _losses(tmp / "run"), _losses(tmp / "warm")
    assert warmed[0] < 0.8 * fresh[0] and warmed[0] < 1.2 * sum(fresh[-5:]) / 5, (warmed, fresh)
    assert DFlashDrafter.from_pretrained(warm).config.to_json_dict().keys() == \
        DFlashDrafter.from_pretrained(trained).config.to_json_dict().keys()
