"""`eagle3-zoo plan`: every shipped recipe is planned offline (shipped target configs) and fits its declared GPU
memory; parameter counts equal the built models'; the TTT activation estimate matches what a real TTT loss saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_zoo.cli import main
from eagle3_zoo.recipe import load_recipe
from eagle3_zoo.training.loss import ttt_loss
from eagle3_zoo.training.plan import drafter_parameter_count, plan_recipe, target_parameter_counts, ttt_saved_elements
from tests.tiny import tiny_drafter

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_is_planned_offline_and_fits(recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shipped configs are enough
    r = load_recipe(recipe)
    plan = plan_recipe(r, source=str(recipe))
    names = [line.what for line in plan.lines]
    assert "drafter weights+grads+AdamW" in names and "TTT activations" in names and names[-1] == "reserve"
    assert all(line.bytes > 0 for line in plan.lines)
    if r.trainer.accelerator == "gpu":  # GPU recipes declare their GPU memory and must fit it
        assert r.trainer.gpu_memory_gb and plan.fits, plan.table()
    if r.data.mode == "offline":
        assert plan.feature_job and plan.feature_job[0].what == "target weights"


def test_plan_cli_llama3_70b(capsys):
    assert main(["plan", "recipes/llama3_70b.yaml"]) == 0
    out = capsys.readouterr().out
    assert "16 device(s)" in out and "sharded over 8, replicated over 2 nodes" in out and "training: fits:" in out
    assert main(["plan", "recipes/llama3_8b.yaml", "trainer.gpu_memory_gb=16"]) == 1  # a full 8B copy per GPU
    assert "training: does NOT fit" in capsys.readouterr().out


def test_deepseek_feature_job_needs_an_engine():
    plan = plan_recipe(load_recipe("recipes/deepseek_v3.yaml"))
    assert plan.fits and plan.feature_job_fits is False
    assert 1.2e12 < plan.feature_job[0].bytes < 1.5e12  # 671B parameters in bf16
    assert "inference engine" in plan.table() and "fp8 checkpoint dequantised" in plan.table()


def test_parameter_counts_equal_the_built_models():
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    adapter = get_adapter("llama")
    config = adapter.tiny_config()
    model = LlamaForCausalLM(config)
    counts = target_parameter_counts(config, adapter)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embed"] == model.model.embed_tokens.weight.numel()
    assert counts["largest_layer"] == sum(p.numel() for p in model.model.layers[0].parameters())
    drafter, _ = tiny_drafter()
    assert drafter_parameter_count(drafter.config) == sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def _saved_bytes(drafter, embed, t: int, steps: int) -> tuple[int, int]:
    """Bytes the TTT loss keeps for backward (activations, and lm_head gradient buffers), parameters excluded."""
    cfg = drafter.config
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, t))
    aux = torch.randn(1, t, 3 * cfg.target_hidden_size)
    logits = torch.randn(1, t, cfg.vocab_size)
    params = {p.untyped_storage().data_ptr() for p in [*drafter.parameters(), *embed.parameters()]}
    seen: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ttt_loss(drafter, embed, ids, aux, logits, torch.ones(1, t), steps=steps, target_valid=None)
    head = cfg.draft_vocab_size * cfg.hidden_size * 4
    heads = sum(n for n in seen.values() if n == head)
    return sum(seen.values()) - heads, heads


@pytest.mark.parametrize("t", [64, 128])
def test_ttt_activation_estimate_matches_saved_tensors(t):
    # widths that differ from each other, so that no saved tensor is mistaken for another
    drafter, embed = tiny_drafter(draft_vocab_size=80, hidden_size=40, head_dim=12, intermediate_size=104)
    steps = 3
    measured, head_buffers = _saved_bytes(drafter, embed, t, steps)
    est = ttt_saved_elements(drafter.config, tokens=t, steps=steps)
    estimate = 4 * (est["activations"] + est["loss_rows_fp32"] + est["fc_input"])  # fp32
    assert 0.9 < measured / estimate < 1.1, (measured, estimate)
    assert head_buffers == drafter.config.draft_vocab_size * drafter.config.hidden_size * 4  # one buffer, all steps
