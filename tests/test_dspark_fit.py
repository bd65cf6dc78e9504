"""DSpark as the third drafter kind, trained by `fit` (in process) on the tiny random Llama target: the loss falls, the
folder is the `dspark` layout (what vLLM 0.32's qwen3_dspark loads), passes `eagle3-zoo check` and is decoded by
`eagle3-zoo eval` with the kind's `DSparkProposer`, losslessly; the kind reads the target's last hidden state, its
anchors are deterministic (a rerun with the same seed writes bit-identical weights), and bad `drafter.dspark` keys
(or EAGLE-3 keys that would do nothing) are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_dflash_fit import write_counting_jsonl
from training_fixtures import EAGLE3_ONLY_OVERRIDES, save_tiny_target, tiny_recipe, write_recipe

from eagle3_zoo.drafters import get_kind, kind_names, kind_of, kind_of_config
from eagle3_zoo.drafters.dspark.model import DSparkDrafter

DSPARK = {"kind": "dspark", "draft_vocab_size": 128, "aux_layer_ids": None,
          "dspark": {"num_layers": 1, "block_size": 4, "num_anchors": 32, "target_layer_ids": [0, 1, 2],
                     "markov_rank": 16}}
STEPS = 30


def _recipe(tmp, target, data, **sections):
    base = tiny_recipe(tmp, target, data, drafter=json.loads(json.dumps(DSPARK)),
                       ttt={"steps": 1, "schedule": "constant"}, optim={"lr": 3e-3, "warmup_steps": 1},
                       trainer={"max_steps": STEPS, "val_check_interval": 15, "checkpoint_every_n_steps": 10})
    # the target's own greedy answers (what decoding verifies: the eval's prompts are the data's first turns)
    base["data"]["regenerate"] = {"enabled": True, "max_new_tokens": 48, "batch_size": 12, "max_turns": 1}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return base


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark_fit")
    return tmp, save_tiny_target(tmp / "target"), write_counting_jsonl(tmp / "count.jsonl")


def _fit(tmp, target, data, name, *overrides, **sections):
    from eagle3_zoo.training.fit import fit_main

    path = write_recipe(tmp / f"{name}.yaml", _recipe(tmp, target, data, **sections))
    return fit_main(path, [f"output_dir={tmp / name}", *overrides])


def _column(run, name):
    rows = (run / "logs/version_0/metrics.csv").read_text().splitlines()
    col = rows[0].split(",").index(name)
    return [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]


@pytest.fixture(scope="module")
def trained(files):
    tmp, target, data = files
    torch.set_num_threads(1)
    return _fit(tmp, target, data, "run")


def test_dspark_is_a_builtin_kind_of_its_own_drafters_and_configs():
    """A DSpark drafter and config subclass DFlash's: the registry names the most derived kind for each."""
    from transformers import LlamaConfig

    from eagle3_zoo.drafters.dflash.config import DFlashConfig
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter
    from eagle3_zoo.drafters.dspark.config import DSparkConfig

    assert kind_names()[:3] == ("eagle3", "dflash", "dspark")
    kind = get_kind("dspark")
    assert kind.drafter_class is DSparkDrafter and kind.layouts == ("dspark",) and kind.decoding == "block"
    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                     num_hidden_layers=4, vocab_size=256)
    spark = DSparkConfig.from_target_config(tc, mask_token_id=255, num_hidden_layers=1, target_layer_ids=(0, 1),
                                            block_size=4, markov_rank=8)
    flash = DFlashConfig.from_target_config(tc, mask_token_id=255, num_hidden_layers=1, target_layer_ids=(0, 1),
                                            block_size=4)
    assert kind_of(DSparkDrafter(spark)).name == "dspark" and kind_of_config(spark).name == "dspark"
    assert kind_of(DFlashDrafter(flash)).name == "dflash" and kind_of_config(flash).name == "dflash"
    # the kind reads DFlash's layers and the target's last hidden state (its loss's target distribution)
    needs = kind.features(spark)
    assert needs.aux_layer_ids == (1, 2) and needs.final_hidden is True
    assert get_kind("dflash").features(flash).final_hidden is False


def test_fit_trains_a_dspark_folder_that_checks_and_evaluates_losslessly(files, trained, capsys):
    from eagle3_zoo.checkpoint.check import check_drafter
    from eagle3_zoo.cli import main as cli_main

    tmp, target_dir, _ = files
    losses = _column(tmp / "run", "train/loss")
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses  # measured 0.80 (0.835 -> 0.586)
    tv, tau = _column(tmp / "run", "train/tv"), _column(tmp / "run", "train/tau_est")
    assert sum(tv[-5:]) < 0.6 * sum(tv[:5]), tv  # the TV to the target's distribution: measured 0.207 -> 0.088
    assert tau[0] == 1.0 and sum(tau[-5:]) / 5 > 1.15, tau  # simulated greedy length: measured 1.0 -> ~1.45
    drafter = DSparkDrafter.from_pretrained(trained)
    c = drafter.config
    assert c.target_layer_ids == (0, 1, 2) and c.aux_layer_ids == (1, 2, 3) and c.block_size == 4
    assert c.num_hidden_layers == 1 and c.draft_vocab_size == 128 and c.markov_rank == 16
    assert c.mask_token_id == c.vocab_size - 1 and drafter.confidence_head is not None
    raw = json.loads((trained / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["sample_from_anchor"] is True
    assert set(load_file(trained / "model.safetensors")) == set(c.parameter_shapes()) | {"d2t"}
    prov = json.loads((trained / "provenance.json").read_text())
    assert prov["drafter"]["aux_layer_ids"] == [1, 2, 3] and prov["training"]["global_step"] == STEPS
    header = (tmp / "run/logs/version_0/metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/acc_1", "train/acc_4", "train/tv", "train/bce", "val/loss", "val/tau_est",
            "val/alpha_1"} <= set(header)

    report = check_drafter(trained, str(target_dir))
    assert report.format == "dspark" and not report.errors, report.problems
    assert "CPU_ENGINE" in {p.code for p in report.warnings}  # vLLM's CPU build refuses DSpark: said
    assert cli_main(["check", str(trained), "--target", str(target_dir)]) == 0
    from eagle3_zoo.speculative.engine_eval import dflash_layout

    with pytest.raises(ValueError, match="DSpark.*GPU only"):  # not served by vLLM as a DFlash drafter
        dflash_layout(trained)

    bench = tmp / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"id": f"p{i}", "turns": [p]}) + "\n"
                             for i, p in enumerate(["Count on.", "Count on."])))
    out = tmp / "eval.json"
    capsys.readouterr()
    code = cli_main(["eval", str(trained), "--target", str(target_dir), "--bench", str(bench), "--device", "cpu",
                     "--max-new-tokens", "24", "--out", str(out), "--no-progress", "--strict"])
    assert code == 0
    saved = json.loads(out.read_text())
    s = saved["settings"]
    assert s["mode"] == "block" and s["drafter_kind"] == "dspark" and s["depth"] == 4 and s["block_size"] == 4
    assert saved["lossless"] is True and all(r["matches_baseline"] for r in saved["requests"]["prompts"])
    assert saved["overall"]["tau"] > 1.0
    print(f"DSpark tiny fit: loss {losses[0]:.3f} -> {losses[-1]:.3f}, eval tau {saved['overall']['tau']:.2f}")


def test_a_dspark_run_is_deterministic(files, trained):
    """Anchors are drawn from the run's seed and the step (as DFlash's): a rerun writes bit-identical weights, another
    seed other weights."""
    tmp, target, data = files
    torch.set_num_threads(1)
    again = _fit(tmp, target, data, "rerun")
    first, second = load_file(trained / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    other = _fit(tmp, target, data, "seed7", "trainer.seed=7", "trainer.max_steps=2")
    assert not torch.equal(load_file(other / "model.safetensors")["markov_head.markov_w2.weight"],
                           first["markov_head.markov_w2.weight"])


def test_offline_features_and_consolidate_write_the_same_dspark_drafter(files, trained):
    """The feature store holds the layers the kind reads (1, 2, 3) and the target's last hidden state: fp32 features
    read back from disk train the drafter the online run trained; `consolidate` of the run's checkpoint writes the
    folder `fit` wrote."""
    from pathlib import Path

    from eagle3_zoo.training.rundir.outputs import consolidate_checkpoint

    tmp, target, data = files
    torch.set_num_threads(1)
    out = _fit(tmp, target, data, "offline", "data.mode=offline")
    store = json.loads((out / "provenance.json").read_text())["data"]["features"]["features_dir"]
    assert json.loads((Path(store) / "manifest.json").read_text())["aux_layer_ids"] == [1, 2, 3]
    online, offline = load_file(trained / "model.safetensors"), load_file(out / "model.safetensors")
    for k in online:
        torch.testing.assert_close(offline[k], online[k], atol=1e-5, rtol=0)
    again = consolidate_checkpoint(tmp / "run/checkpoints/last.ckpt", tmp / "consolidated")
    assert json.loads((again / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert all(torch.equal(online[k], v) for k, v in load_file(again / "model.safetensors").items())


def test_the_dspark_objective_is_the_recipes(files):
    """The kind's objective takes the recipe's loss weights and decay (a zero TV weight leaves CE + BCE)."""
    from eagle3_zoo.drafters.dflash.loss import select_anchors
    from eagle3_zoo.drafters.dspark.loss import dspark_loss
    from eagle3_zoo.recipe.sections import load_recipe

    tmp, target, data = files
    recipe = load_recipe(write_recipe(tmp / "w.yaml", _recipe(tmp, target, data)),
                         ["drafter.dspark.tv_weight=0", "drafter.dspark.decay_gamma=2", "drafter.dspark.ce_weight=0.5"])
    from eagle3_zoo.drafters.dspark.config import DSparkConfig

    cfg = DSparkConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                       vocab_size=50, num_target_layers=4, target_layer_ids=(0, 1), mask_token_id=49,
                       num_hidden_layers=1, block_size=3, markov_rank=4)
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg)
    objective = get_kind("dspark").objective(drafter, None, recipe.drafter)
    aux, ids = torch.randn(1, 12, 64), torch.randint(0, 49, (1, 12))
    mask, embed, last, head = torch.ones(1, 12, dtype=torch.bool), torch.randn(50, 32), torch.randn(1, 12, 32), \
        torch.randn(50, 32)
    out = objective(aux, ids, mask, embed, last, head, torch.Generator().manual_seed(1), 1024)
    anchors, valid = select_anchors(mask, 512, torch.Generator().manual_seed(1))
    want = dspark_loss(drafter, aux, ids, mask, anchors, valid, embed, last, head, ce_weight=0.5, tv_weight=0.0,
                       confidence_weight=1.0, gamma=2.0)
    torch.testing.assert_close(out.loss, want.loss)
    assert float(out.loss.detach()) == pytest.approx(0.5 * float(want.ce) + float(want.bce), rel=1e-5)


@pytest.mark.parametrize("override, key", [
    ("drafter.dspark.block_size=1", "drafter.dspark.block_size"),
    ("drafter.dspark.markov_rank=0", "drafter.dspark.markov_rank"),
    ("drafter.dspark.ce_weight=-1", "drafter.dspark.ce_weight"),
    ("drafter.dspark.tv_weight=-0.5", "drafter.dspark.tv_weight"),
    ("drafter.dspark.bce_weight=-1", "drafter.dspark.bce_weight"),
    ("drafter.dspark.decay_gamma=0", "drafter.dspark.decay_gamma"),
    ("drafter.dspark.num_anchors=0", "drafter.dspark.num_anchors"),
    ("drafter.dspark.target_layer_ids=[2,1]", "drafter.dspark.target_layer_ids"),
    ("drafter.dspark.mask_token_id=-1", "drafter.dspark.mask_token_id"),
    ("drafter.dspark.weighting=dpace", "drafter.dspark.weighting"),  # DFlash's, not DSpark's
    ("drafter.dspark.num_layerz=2", "drafter.dspark.num_layerz"),
    *EAGLE3_ONLY_OVERRIDES,
])
def test_bad_dspark_keys_are_refused_naming_the_key(files, override, key):
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe

    tmp, target, data = files
    path = write_recipe(tmp / "bad.yaml", _recipe(tmp, target, data, ttt={"steps": 3}))
    with pytest.raises(RecipeError) as e:
        load_recipe(path, [override])
    assert key in str(e.value)
    if key.startswith(("drafter.", "ttt.", "loss.", "optim.", "trainer.")) and "dspark." not in key:
        assert "with drafter.kind = dspark" in str(e.value)


def test_dspark_target_layer_ids_out_of_range_is_refused(files):
    from eagle3_zoo.recipe.sections import RecipeError, load_recipe
    from eagle3_zoo.targets.loading import load_recipe_target

    tmp, target, data = files
    path = write_recipe(tmp / "range.yaml", _recipe(tmp, target, data))
    recipe = load_recipe(path, ["drafter.dspark.target_layer_ids=[0,3]"])
    with pytest.raises(RecipeError, match=r"drafter.dspark.target_layer_ids.*valid 0\.\.2"):
        load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, str(path))


def test_a_resume_with_another_dspark_setting_is_refused():
    from eagle3_zoo.training.rundir.resume import ADDED_KEYS, identity_differences

    old = {"drafter.fc_norm": "False", "drafter.kind": repr("dspark")}
    assert ADDED_KEYS["drafter.dspark.markov_rank"] == "256" and ADDED_KEYS["drafter.dspark.bce_weight"] == "1.0"
    assert identity_differences(old, {**old, "drafter.dspark.markov_rank": "256"}) == []
    assert identity_differences(old, {**old, "drafter.dspark.markov_rank": "64"})


def test_plan_sizes_a_dspark_drafter_and_reads_its_layers(files):
    from transformers import AutoConfig

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.recipe.decisions import drafter_config
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.targets.loading import feature_layer_ids

    tmp, target, data = files
    recipe = load_recipe(write_recipe(tmp / "plan.yaml", _recipe(tmp, target, data)))
    cfg = AutoConfig.from_pretrained(target)
    assert feature_layer_ids(recipe.drafter, recipe.target.name_or_path, cfg, get_adapter("llama")) == (1, 2, 3)
    dcfg = drafter_config(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, cfg, None)
    assert type(dcfg).__name__ == "DSparkConfig" and dcfg.markov_rank == 16
    assert get_kind("dspark").num_parameters(dcfg) == sum(p.numel() for p in DSparkDrafter(dcfg).parameters())


def test_plan_sizes_the_dspark_recipes_step(monkeypatch):
    """The shipped DSpark recipe's step: DFlash's block activations plus DSpark's target distribution and heads,
    which grow with the Markov rank and vanish from the DFlash recipe's plan."""
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.planner.plan import plan_recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def lines(path, *overrides):
        return {line.what: line for line in plan_recipe(load_recipe(path, list(overrides))).lines}

    spark = lines("recipes/smollm2_135m_dspark.yaml", "trainer.accelerator=cpu")
    flash = lines("recipes/smollm2_135m_dflash.yaml", "trainer.accelerator=cpu")
    extra = "DSpark target distribution and heads"
    assert "DSpark block activations" in spark and extra in spark and extra not in flash
    assert spark["DSpark block activations"].bytes == flash["DFlash block activations"].bytes  # the same backbone
    assert spark[extra].phase == "training step" and "r=256" in spark[extra].note
    smaller = lines("recipes/smollm2_135m_dspark.yaml", "trainer.accelerator=cpu", "drafter.dspark.markov_rank=16")
    assert smaller[extra].bytes < spark[extra].bytes


def test_dspark_init_layers_from_the_target_copy_its_last_layers_and_name_the_dspark_key():
    """`drafter.dspark.init_layers: target` starts the draft layers from the target's last decoder layers (DFlash's
    copy, through the kind's `build`); a target too shallow is refused naming the DSpark key."""
    from eagle3_zoo.drafters import TargetLayers
    from eagle3_zoo.drafters.dspark.config import DSparkConfig

    cfg = DSparkConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                       vocab_size=50, num_target_layers=4, target_layer_ids=(0, 1), mask_token_id=49,
                       num_hidden_layers=1, block_size=3, markov_rank=4)
    kind = get_kind("dspark")
    source = {n: torch.full_like(p, 0.5) for n, p in DSparkDrafter(cfg).layers[0].named_parameters()}
    d2t, t2d = torch.zeros(50, dtype=torch.long), torch.ones(50, dtype=torch.bool)
    drafter = kind.build(cfg, d2t=d2t, t2d=t2d, target_layers=TargetLayers(layers=({}, source)))
    assert type(drafter) is DSparkDrafter
    assert all(torch.equal(p, source[n]) for n, p in drafter.layers[0].named_parameters())
    with pytest.raises(ValueError, match="drafter.dspark.init_layers = target"):
        kind.build(cfg, d2t=d2t, t2d=t2d, target_layers=TargetLayers(layers=()))
