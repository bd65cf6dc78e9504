"""`drafter.dflash.init_layers`: with `target` a fresh DFlash drafter's layers start as copies of the target's last
decoder layers (where names and shapes match; the q/k norms a Llama target lacks keep their initialisation) and its
final norm as the target's, through the run's own construction (`RunDataModule.prepare_run` -> `DrafterStart`);
with the default (`random`) the drafter is the one a run built before the option existed."""

from __future__ import annotations

import pytest
import torch
from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.recipe.sections import load_recipe

DFLASH = {"kind": "dflash", "draft_vocab_size": 128, "aux_layer_ids": None,
          "dflash": {"num_layers": 2, "block_size": 4, "num_anchors": 8, "target_layer_ids": [0, 1, 2]}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash_init")
    return tmp, save_tiny_target(tmp / "target"), write_chat_jsonl(tmp / "chat.jsonl", n=6)


def _start(files, init_layers=None):
    from eagle3_zoo.recipe.decisions import run_plan
    from eagle3_zoo.training.build import RunDataModule

    tmp, target, data = files
    drafter = {**DFLASH, "dflash": dict(DFLASH["dflash"])}
    if init_layers is not None:
        drafter["dflash"]["init_layers"] = init_layers
    name = f"init_{init_layers}"
    path = write_recipe(tmp / f"{name}.yaml", tiny_recipe(tmp, target, data, drafter=drafter,
                                                         ttt={"steps": 1, "schedule": "constant"},
                                                         output_dir=str(tmp / name)))
    recipe = load_recipe(path)
    module = RunDataModule(recipe, run_plan(recipe))
    module.prepare_run("cpu")
    torch.manual_seed(0)
    return module, module.drafter_start.build()


def test_init_layers_target_copies_the_target_s_last_layers_and_norm(files):
    module, drafter = _start(files, "target")
    target, adapter = module.target, module.adapter
    layers = adapter.decoder_layers(target)
    assert len(layers) == 4 and len(drafter.layers) == 2
    for layer, source in zip(drafter.layers, layers[2:]):
        ref = dict(source.named_parameters())
        own = dict(layer.named_parameters())
        shared = [n for n in own if n in ref]
        assert len(shared) == 9  # q/k/v/o, gate/up/down, the two layer norms
        for n in shared:
            assert torch.equal(own[n], ref[n]), n
            assert own[n].data_ptr() != ref[n].data_ptr()  # a copy: training the drafter leaves the target as is
        for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):  # a Llama layer has none: initialised
            assert n not in ref and torch.equal(own[n], torch.ones_like(own[n]))
    assert torch.equal(drafter.norm.weight, adapter.final_norm(target).weight)
    assert module.plan.target_load == "whole"


def test_init_layers_default_is_the_random_start_it_always_was(files):
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter

    module, drafter = _start(files)
    assert module.recipe.drafter.dflash.init_layers == "random" and module.drafter_start.target_layers is None
    torch.manual_seed(0)
    fresh = DFlashDrafter(module.drafter_start.config)
    assert fresh.state_dict().keys() == drafter.state_dict().keys()
    for k, v in fresh.state_dict().items():
        if k != "d2t":
            assert torch.equal(v, drafter.state_dict()[k]), k
    ref = dict(module.adapter.decoder_layers(module.target)[-1].named_parameters())
    assert not torch.equal(drafter.layers[-1].mlp.down_proj.weight, ref["mlp.down_proj.weight"])


def test_init_layers_is_a_resume_identity_key_with_its_default():
    from eagle3_zoo.training.rundir.resume import ADDED_KEYS

    assert ADDED_KEYS["drafter.dflash.init_layers"] == repr("random")
