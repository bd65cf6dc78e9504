"""`drafter.init_from` for a DFlash run: a DFlash folder (z-lab or speculators layout) is the run's starting drafter,
with its weights and draft vocabulary, checked as EAGLE-3's is: a drafter of another kind, one that does not fit the
target, and one whose block size, layer count or feature layers differ from the recipe's are refused, naming what
differs."""

from __future__ import annotations

import pytest
import torch
from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.adapters import get_adapter
from eagle3_zoo.drafters import get_kind
from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.modeling import build_draft_vocab
from eagle3_zoo.recipe.decisions import drafter_config
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.targets.loading import feature_layer_ids
from eagle3_zoo.training.build import drafter_start

DFLASH = {"kind": "dflash", "draft_vocab_size": 128, "aux_layer_ids": None,
          "dflash": {"num_layers": 1, "block_size": 4, "num_anchors": 32, "target_layer_ids": [0, 1, 2]}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny target, a DFlash recipe for it, and a DFlash drafter of that recipe written in both layouts."""
    from transformers import AutoConfig

    from eagle3_zoo.checkpoint.layouts import get_layout

    tmp = tmp_path_factory.mktemp("dflash_init")
    target = save_tiny_target(tmp / "target")
    data = write_chat_jsonl(tmp / "chat.jsonl", n=4)
    path = write_recipe(tmp / "r.yaml", tiny_recipe(tmp, target, data, drafter=dict(DFLASH)))
    target_config = AutoConfig.from_pretrained(target)
    recipe = load_recipe(path)
    aux = feature_layer_ids(recipe.drafter, recipe.target.name_or_path, target_config, get_adapter("llama"))
    config = drafter_config(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, target_config, aux)
    d2t, t2d = build_draft_vocab(torch.arange(512) % 37, config.draft_vocab_size)
    torch.manual_seed(1)
    drafter = get_kind("dflash").build(config, d2t=d2t.long(), t2d=t2d.bool())
    zlab = drafter.save_pretrained(tmp / "zlab")
    spec = tmp / "spec"
    spec.mkdir()
    get_layout("speculators-dflash").write(drafter, spec, verifier="Qwen/Qwen3-8B")
    return {"tmp": tmp, "path": path, "target_config": target_config, "drafter": drafter, "zlab": zlab,
            "spec": spec, "d2t": d2t, "t2d": t2d}


def _start(run, *overrides):
    recipe = load_recipe(run["path"], list(overrides))
    aux = feature_layer_ids(recipe.drafter, recipe.target.name_or_path, run["target_config"], get_adapter("llama"))
    return drafter_start(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, run["target_config"],
                         torch.arange(512) % 5, aux)


@pytest.mark.parametrize("layout", ["zlab", "spec"])
def test_a_dflash_run_starts_from_a_dflash_folder(run, layout):
    start = _start(run, f"drafter.init_from={run[layout]}")
    assert start.kind is get_kind("dflash") and start.fc_input_scale is None
    built = start.build()
    assert isinstance(built, DFlashDrafter) and built.config.block_size == 4
    ours = run["drafter"].state_dict()
    assert built.state_dict().keys() == ours.keys()
    assert all(torch.equal(built.state_dict()[k], v.float() if v.is_floating_point() else v) for k, v in ours.items())
    # the drafter's draft vocabulary, not the one the run's data would give (`% 5` counts)
    assert torch.equal(start.d2t, run["d2t"].long()) and torch.equal(start.t2d, run["t2d"].bool())
    assert start.num_parameters() == sum(p.numel() for p in built.parameters())


def test_a_dflash_folder_that_does_not_fit_the_run_is_refused(run):
    folder = run["zlab"]
    with pytest.raises(ValueError) as e:
        _start(run, f"drafter.init_from={folder}", "drafter.dflash.block_size=8", "drafter.dflash.num_layers=2",
               "drafter.dflash.target_layer_ids=[0,1,3]")
    message = str(e.value)
    assert message.startswith(f"drafter.init_from = {str(folder)!r} does not fit the target: ")
    assert "target_layer_ids [0, 1, 2] != the run's [0, 1, 3] (set drafter.dflash.target_layer_ids" in message
    assert "num_layers = 1 but drafter.dflash.num_layers = 2" in message
    assert "block_size = 4 but drafter.dflash.block_size = 8" in message
    with pytest.raises(ValueError, match=r"mask_token_id is 511 but drafter.dflash.mask_token_id = 7"):
        _start(run, f"drafter.init_from={folder}", "drafter.dflash.mask_token_id=7")


def test_a_drafter_of_another_kind_is_refused(run, tmp_path):
    with pytest.raises(ValueError, match=r"is a DFlashDrafter \(drafter kind 'dflash'\), not a drafter of "
                                         r"drafter.kind = 'eagle3'"):
        _start(run, f"drafter.init_from={run['zlab']}", "drafter.kind=eagle3", "drafter.aux_layer_ids=[1,2,3]",
               "drafter.dflash.target_layer_ids=null")
    from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter

    eagle3 = Eagle3Drafter(Eagle3Config.from_target_config(run["target_config"], draft_vocab_size=128,
                                                           aux_layer_ids=(1, 2, 3)))
    eagle3.set_vocab(run["d2t"], run["t2d"])
    folder = eagle3.save_pretrained(tmp_path / "eagle3")
    with pytest.raises(ValueError, match=r"is a Eagle3Drafter \(drafter kind 'eagle3'\), not a drafter of "
                                         r"drafter.kind = 'dflash'"):
        _start(run, f"drafter.init_from={folder}")


def test_a_dflash_folder_for_another_target_is_refused(run, tmp_path):
    from eagle3_zoo.drafters.dflash.config import DFlashConfig

    c = run["drafter"].config
    other = DFlashConfig(**{**{k: getattr(c, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size", "vocab_size", "target_layer_ids",
                                                          "mask_token_id", "num_hidden_layers", "block_size",
                                                          "head_dim")},
                            "num_target_layers": c.num_target_layers + 2})
    folder = DFlashDrafter(other).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"does not fit the target: num_target_layers=6 but the target has 4"):
        _start(run, f"drafter.init_from={folder}")
