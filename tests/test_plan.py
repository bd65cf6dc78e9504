"""`eagle3-zoo plan`: every shipped recipe is planned offline (shipped target configs) and fits its declared GPU
memory; parameter counts equal the built models'; the TTT activation estimate matches what a real TTT loss saves;
the tau evaluation's transient (a gathered drafter under FSDP, decode buffers) is a phase of its own, and the peak
is the persistent part plus the larger of it and the training step; KV cache widths equal real caches'; under FSDP
the training step counts the drafter's gathered parameters, unsharded gradients and reduce-scatter input, whose
sizes and dtypes equal the buffers FSDP2 allocates for a real sharded drafter."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from eagle3_zoo.adapters import available_adapters, get_adapter
from eagle3_zoo.cli import main
from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.training.planner.plan import (
    dflash_saved_bytes,
    drafter_parameter_count,
    fsdp_drafter_lines,
    kv_elements_per_token,
    plan_recipe,
    target_parameter_counts,
    ttt_saved_bytes,
)
from tests.tiny import tiny_drafter

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_is_planned_offline_and_fits(recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shipped configs are enough
    r = load_recipe(recipe)
    plan = plan_recipe(r, source=str(recipe))
    names = [line.what for line in plan.lines]
    block = r.drafter.kind in ("dflash", "dspark")  # sized from the DFlash step (DSpark: plus its heads)
    step = f"{'DSpark' if r.drafter.kind == 'dspark' else 'DFlash'} block activations" if block else "TTT activations"
    assert "drafter weights+grads+AdamW" in names and step in names and names[-1] == "reserve"
    if block:  # none of EAGLE-3's lines
        assert "loss chunk" in names and "TTT activations" not in names and "loss buffers" not in names
    assert all(line.bytes > 0 for line in plan.lines)
    if r.trainer.accelerator == "gpu":  # GPU recipes declare their GPU memory and must fit it
        assert r.trainer.gpu_memory_gb and plan.fits, plan.table()
    if r.data.mode == "offline":
        assert plan.feature_job and plan.feature_job[0].what == "target weights"


def test_plan_cli_llama3_70b(capsys):
    assert main(["plan", "recipes/llama3_70b.yaml", "engine.mode=launch", "engine.urls=[]",
                 "data.features_backend=hf", "trainer.num_nodes=2"]) == 0  # the target in the training step
    out = capsys.readouterr().out
    assert "16 device(s)" in out and "sharded over 8, replicated over 2 nodes" in out and "training: fits:" in out
    assert main(["plan", "recipes/llama3_70b.yaml"]) == 0  # as shipped: hidden states from the engine node
    out = capsys.readouterr().out
    assert "8 device(s)" in out and "sharded over 8 (tau evaluation during training)" in out
    assert "target forward" not in out and "training: fits:" in out
    assert main(["plan", "recipes/llama3_8b.yaml", "trainer.gpu_memory_gb=16"]) == 1  # a full 8B copy per GPU
    assert "training: does NOT fit" in capsys.readouterr().out


def test_deepseek_feature_job_needs_an_engine():
    shipped = plan_recipe(load_recipe("recipes/deepseek_v3.yaml"))  # streamed from the engine: heads only here
    assert shipped.fits and not shipped.feature_job and "from the engine" in shipped.table()
    assert shipped.lines[0].what == "target embed + lm_head" and shipped.lines[0].bytes < 4e9
    plan = plan_recipe(load_recipe("recipes/deepseek_v3.yaml", ["data.mode=offline", "data.features_backend=hf"]))
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


@contextlib.contextmanager
def _saving(amp: torch.dtype | None, excluded):
    """Under CPU autocast in `amp` (None: fp32): a dict, filled on exit of the block, of the bytes of each storage
    autograd saves for backward (each storage once), the storages of `excluded` tensors (parameters) left out."""
    params = {p.untyped_storage().data_ptr() for p in excluded}
    seen: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = x.untyped_storage().nbytes()
        return x

    with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield seen


def _saved_bytes(drafter, embed, t: int, steps: int, amp: torch.dtype | None) -> tuple[int, int, int]:
    """Bytes the TTT loss keeps for backward, each storage once (activations, autocast's weight copies), under CPU
    autocast in `amp` (None: fp32), parameters excluded; the lm_head gradient buffers apart; the supervised rows."""
    cfg = drafter.config
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, t))
    aux = torch.randn(1, t, 3 * cfg.target_hidden_size)
    logits = torch.randn(1, t, cfg.vocab_size)
    with _saving(amp, [*drafter.parameters(), *embed.parameters()]) as seen:
        out = ttt_loss(drafter, embed, ids, aux, logits, torch.ones(1, t), steps=steps, target_valid=None)
    head = cfg.draft_vocab_size * cfg.hidden_size * 4
    heads = sum(n for n in seen.values() if n == head)
    return sum(seen.values()) - heads, heads, int(out.num_supervised.sum())


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("t, steps", [(64, 3), (128, 4)])
def test_ttt_activation_estimate_matches_saved_tensors(t, steps, amp):
    """fp32, and bf16 autocast over fp32 weights (DDP/auto under bf16-mixed), where the norms' inputs and the
    attention's merge stay fp32 and the attention input is cast once for q/k/v (three casts saved three copies)."""
    # widths that differ from each other, so that no saved tensor is mistaken for another
    drafter, embed = tiny_drafter(draft_vocab_size=80, hidden_size=40, head_dim=12, intermediate_size=104)
    measured, head_buffers, rows = _saved_bytes(drafter, embed, t, steps, amp)
    est = ttt_saved_bytes(drafter.config, tokens=t, steps=steps, compute=amp or torch.float32,
                          supervised=rows / steps)
    estimate = sum(est.values())
    assert 0.98 < measured / estimate < 1.02, (measured, estimate, est)
    assert head_buffers == drafter.config.draft_vocab_size * drafter.config.hidden_size * 4  # one buffer, all steps


def _dflash_saved_bytes(amp: torch.dtype | None, batch: int, t: int, anchors: int,
                        soft: bool = False) -> tuple[int, int, object]:
    """Bytes a tiny DFlash drafter's `dflash_loss` (dense mask; `soft`: soft labels) keeps for backward, each storage
    once, under CPU autocast in `amp` (None: fp32), parameters and the frozen embedding/lm_head excluded; the
    supervised rows."""
    from eagle3_zoo.drafters.dflash.config import DFlashConfig
    from eagle3_zoo.drafters.dflash.loss import dflash_loss, select_anchors
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter

    # widths that differ from each other, so that no saved tensor is mistaken for another
    cfg = DFlashConfig(hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=104,
                       vocab_size=300, num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=299,
                       num_hidden_layers=2, block_size=4, rope_theta=10000.0, target_hidden_size=56)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    aux = torch.randn(batch, t, cfg.num_features * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size - 1, (batch, t))
    loss_mask = torch.ones(batch, t)
    loss_mask[:, : t // 4] = 0  # a prompt: fewer supervised rows than slots
    embed, head = torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    picked, valid = select_anchors(loss_mask, anchors, torch.Generator().manual_seed(0))
    final = {"labels": "soft", "target_hidden": torch.randn(batch, t, cfg.hidden_size)} if soft else {}
    with _saving(amp, [*drafter.parameters(), embed, head]) as seen:
        out = dflash_loss(drafter, aux, ids, loss_mask, picked, valid, embed, head, chunk=16, attention="dense",
                          **final)
    return sum(seen.values()), int(out.num_supervised), cfg


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("batch, t, anchors", [(2, 64, 8), (1, 48, 6)])
def test_dflash_activation_estimate_matches_saved_tensors(batch, t, anchors, amp):
    """fp32, and bf16 autocast over fp32 weights (DDP/auto under bf16-mixed), where the residual stream and the
    norms' statistics stay fp32 and every projection's input is cast on its own. The estimate counts every saved
    tensor, so it is held to 0.01%: its smallest terms (the row indices, 0.1% here) are above that. A torch that
    saves other tensors (a new SDPA path) shows here first."""
    measured, rows, cfg = _dflash_saved_bytes(amp, batch, t, anchors)
    est = dflash_saved_bytes(cfg, batch, t, anchors, amp or torch.float32, "dense", supervised=rows)
    estimate = sum(est.values())
    assert measured == pytest.approx(estimate, rel=1e-4), (measured, estimate, est)
    assert (est["autocast_weights"] > 0) == (amp is not None)
    flex = dflash_saved_bytes(cfg, batch, t, anchors, amp or torch.float32, "flex", supervised=rows)
    assert flex["mask"] == 0 and est["mask"] > 0 and flex["blocks"] == est["blocks"]


def test_dflash_soft_labels_keep_the_rows_target_states_and_plan_them():
    """Soft labels keep the supervised rows' target states (fp32 here) for backward instead of their labels, which
    the plan's loss chunk counts (with the target's logits chunk), as it adds the last hidden state to the
    features (`training_features`: final_hidden) and runs the target's forward to its final norm."""
    from eagle3_zoo.values.dtypes import torch_dtype

    hard, rows, cfg = _dflash_saved_bytes(None, 2, 64, 8)
    soft, soft_rows, _ = _dflash_saved_bytes(None, 2, 64, 8, soft=True)
    assert soft_rows == rows and soft - hard == rows * (cfg.hidden_size * 4 - 8)  # states instead of int64 labels
    base = _by_name(plan_recipe(load_recipe("recipes/qwen3_8b_dflash.yaml")))
    plan = _by_name(plan_recipe(load_recipe("recipes/qwen3_8b_dflash.yaml", ["drafter.dflash.labels=soft"])))
    r = load_recipe("recipes/qwen3_8b_dflash.yaml")
    tokens = r.trainer.batch_size * r.data.max_length
    fbytes = torch_dtype(r.target.dtype if "target forward" in base else r.data.features_dtype).itemsize
    assert plan["target features"].bytes - base["target features"].bytes == tokens * 4096 * fbytes
    assert "last hidden state" in plan["target features"].note and "soft labels" in plan["loss chunk"].note
    assert plan["loss chunk"].bytes > base["loss chunk"].bytes
    assert "last hidden state" not in base["target features"].note


def test_dflash_plan_lines_follow_the_run():
    """A DFlash recipe is planned from the DFlash step (no TTT, no target probabilities); the dense mask is planned
    on a CPU run, FlexAttention on a GPU run; the query slots follow num_anchors, capped by the sequence length."""
    gpu = _by_name(plan_recipe(load_recipe("recipes/qwen3_8b_dflash.yaml")))
    assert "TTT activations" not in gpu and "loss buffers" not in gpu
    assert "FlexAttention" in gpu["DFlash block activations"].note and gpu["loss chunk"].phase == "training step"
    fewer = _by_name(plan_recipe(load_recipe("recipes/qwen3_8b_dflash.yaml", ["drafter.dflash.num_anchors=256"])))
    assert fewer["DFlash block activations"].bytes < 0.6 * gpu["DFlash block activations"].bytes
    cpu = _by_name(plan_recipe(load_recipe("recipes/smollm2_135m_dflash.yaml", ["trainer.accelerator=cpu"])))
    assert "dense" in cpu["DFlash block activations"].note


def _tiny_plan(*overrides: str):
    """The plan of the llama3_8b recipe with `overrides`, on the tiny Llama config (fast, offline)."""
    r = load_recipe("recipes/llama3_8b.yaml", ["drafter.draft_vocab_size=256", *overrides])
    return plan_recipe(r, target_config=get_adapter("llama").tiny_config())


def _by_name(plan) -> dict:
    return {line.what: line for line in plan.lines}


def test_tau_eval_transient_only_with_tau_eval_and_the_copy_only_under_fsdp():
    off = _by_name(_tiny_plan("trainer.tau_eval.every_n_steps=null"))
    assert "decode buffers" not in off and "gathered drafter copy" not in off
    ddp = _by_name(_tiny_plan("trainer.strategy=ddp"))  # the drafter decodes in place: no copy
    assert ddp["decode buffers"].phase == "tau evaluation" and "gathered drafter copy" not in ddp
    fsdp = _tiny_plan("trainer.strategy=fsdp")  # every rank gathers the sharded drafter (fp32 under bf16-mixed)
    copy = _by_name(fsdp)["gathered drafter copy"]
    n_drafter = _by_name(fsdp)["drafter weights+grads+AdamW"].bytes * fsdp.world_size / 16  # 16 B / param, sharded
    assert copy.phase == "tau evaluation" and copy.bytes == pytest.approx(n_drafter * 4)
    assert _by_name(_tiny_plan("trainer.strategy=fsdp", "trainer.precision=bf16-true"))[
        "gathered drafter copy"].bytes == pytest.approx(copy.bytes / 2)  # stored in bf16 there
    # offline, FSDP shards only the drafter: the target tau evaluation decodes on is whole on every GPU
    offline = _by_name(_tiny_plan("trainer.strategy=fsdp", "data.mode=offline"))
    assert "a full copy per GPU" in offline["target weights"].note and "target all-gather" not in offline
    assert offline["target weights"].bytes == ddp["target weights"].bytes and "gathered drafter copy" in offline


def _held_and_phases(plan) -> tuple[float, dict[str, float]]:
    phases: dict[str, float] = {}
    for line in plan.lines:
        if line.phase:
            phases[line.phase] = phases.get(line.phase, 0.0) + line.bytes
    return sum(line.bytes for line in plan.lines if not line.phase), phases


@pytest.mark.parametrize("case", ["tau", "training"])
def test_the_peak_is_the_larger_phase(case):
    if case == "tau":  # a short training sequence, a long decode: the tau evaluation sets the peak
        plan = _tiny_plan("trainer.strategy=fsdp", "data.max_length=16", "trainer.batch_size=1", "ttt.steps=1",
                          "trainer.tau_eval.max_new_tokens=100000")
    else:  # a long training batch, a short decode: the training step does
        plan = _tiny_plan("trainer.strategy=fsdp", "trainer.batch_size=8", "trainer.tau_eval.max_new_tokens=1")
    held, phases = _held_and_phases(plan)
    top = "tau evaluation" if case == "tau" else "training step"
    other = "training step" if case == "tau" else "tau evaluation"
    assert phases[top] > 2 * phases[other] > 0
    assert plan.peak_phase == top and plan.total == pytest.approx(held + phases[top])  # not held + both phases
    assert f"{top}:" in plan.table() and "sets the peak" in next(
        row for row in plan.table().splitlines() if row.strip().startswith(f"{top}:"))


def test_target_kv_estimate_matches_a_real_decode():
    from transformers import LlamaForCausalLM

    from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter
    from eagle3_zoo.speculative.generate import SpeculativeGenerator, tree_spec

    config = get_adapter("llama").tiny_config()
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(config, draft_vocab_size=config.vocab_size,
                                                            aux_layer_ids=(0, 1, 2)))
    tree = tree_spec("tree", depth=3, top_k=2, total_tokens=5)
    gen = SpeculativeGenerator(target, drafter, tree)
    prompt, new = 20, 12
    gen.generate(torch.arange(1, prompt + 1), new, eos_token_id=-1)
    layers = [layer for layer in gen.runner.cache.layers if layer.is_initialized]
    held = sum(layer.keys.numel() + layer.values.numel() for layer in layers)
    length = layers[0].keys.shape[-2]
    assert prompt + new <= length <= prompt + new + tree.total_tokens + 1  # the bound the plan uses
    assert held == kv_elements_per_token(config) * length


@pytest.mark.parametrize("family", available_adapters())
def test_kv_elements_per_token_match_a_real_cache(family):
    from transformers import AutoModelForCausalLM, DynamicCache

    from eagle3_zoo.adapters.capture import cache_kwargs

    config = get_adapter(family).tiny_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache()  # full-length layers, as the tau evaluation's target runner keeps them
    with torch.no_grad():
        model(input_ids=torch.arange(1, 11).view(1, -1), **cache_kwargs(model, {"cache": cache, "use_cache": True}))
    held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized)
    assert held == kv_elements_per_token(config) * 10  # MLA (deepseek_v3): the compressed latent + RoPE key


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_fsdp_drafter_lines_match_the_buffers_fsdp2_allocates(precision, monkeypatch):
    """`shard_fsdp2` on a tiny drafter over 3 ranks (a fake process group in this process: collectives are no-ops,
    shapes and dtypes are real; 3 pads dims that 3 does not divide): the drafter is one FSDP unit, still gathered
    after forward, and the gathered, gradient and reduce-scatter buffers are the plan's lines."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from eagle3_zoo.drafters.eagle3.objective import DrafterObjective
    from eagle3_zoo.training.strategies import shard_fsdp2

    drafter, embed = tiny_drafter(draft_vocab_size=80, hidden_size=40, head_dim=12, intermediate_size=104)
    cfg, world = drafter.config, 3
    expected = {line.what: line.bytes for line in fsdp_drafter_lines(cfg, precision, world)}
    seen = {}
    reduce = _fsdp_param_group.foreach_reduce

    def spy(params, grads, *args, **kwargs):  # the post-backward reduce of the unit's whole gradients
        seen["grads"] = sum(g.numel() * g.element_size() for g in grads)
        out = reduce(params, grads, *args, **kwargs)
        seen["reduce-scatter input"] = out[0].numel() * out[0].element_size()
        return out

    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", spy)
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        objective = DrafterObjective(drafter)
        shard_fsdp2(None, None, objective, init_device_mesh("cpu", (world,)), precision=precision)
        assert [m for m in objective.modules() if isinstance(m, FSDPModule)] == [objective]  # one unit
        group = objective._get_fsdp_state()._fsdp_param_group
        t = 16
        ids = torch.randint(0, cfg.vocab_size, (1, t))
        out = objective(embed, ids, torch.randn(1, t, 3 * cfg.target_hidden_size),
                        torch.randn(1, t, cfg.draft_vocab_size), torch.ones(1, t), torch.ones(1, t, dtype=torch.bool),
                        2, [1.0, 0.8])
        assert group.is_unsharded  # not resharded after forward: gathered once, kept through backward
        gathered = sum(o.numel() * o.element_size() for p in group.fsdp_params for o in p.all_gather_outputs)
        out[0].backward()
        assert not group.is_unsharded
    finally:
        dist.destroy_process_group()
    assert gathered == expected["drafter all-gather"]
    assert seen["grads"] == expected["drafter unsharded grads"]
    assert seen["reduce-scatter input"] == expected["drafter reduce-scatter input"]
    assert gathered > drafter_parameter_count(cfg) * (2 if precision == "bf16-mixed" else 4)  # padded over 3


def test_fsdp_plan_counts_the_drafter_buffers_in_the_training_step():
    fsdp = _tiny_plan("trainer.strategy=fsdp", "trainer.devices=8")  # bf16-mixed: gathered in bf16, reduced in fp32
    lines = _by_name(fsdp)
    n = lines["drafter weights+grads+AdamW"].bytes * 8 / 16  # 16 B / param, sharded over 8
    gather, grads, rs = (lines[w] for w in ("drafter all-gather", "drafter unsharded grads",
                                            "drafter reduce-scatter input"))
    assert {gather.phase, grads.phase, rs.phase} == {"training step"}
    assert grads.bytes == 2 * n and 2 * n <= gather.bytes < 2 * n * 1.05 and rs.bytes == 2 * gather.bytes
    fp32 = _by_name(_tiny_plan("trainer.strategy=fsdp", "trainer.devices=8", "trainer.precision=32-true"))
    assert fp32["drafter all-gather"].bytes == 2 * gather.bytes  # no policy: gathered in the stored fp32
    assert fp32["drafter reduce-scatter input"].bytes == rs.bytes
    assert "drafter all-gather" not in _by_name(_tiny_plan("trainer.strategy=ddp"))  # DDP keeps whole parameters


def test_the_shipped_parameter_counts_are_what_the_meta_build_counts():
    """The package's table of the shipped targets' parameter counts (which lets `plan` answer without building the
    target) equals a meta-device build of every shipped target config, with the transformers version it was made
    with; with another version its keys do not match and `plan` builds (nothing to check here then)."""
    import json
    from importlib import resources

    import transformers

    from eagle3_zoo.training.planner.plan import COUNTS_FILE, shipped_counts_table

    shipped = json.loads(resources.files("eagle3_zoo").joinpath(*COUNTS_FILE).read_text())
    versions = {entry["_transformers"] for entry in shipped.values()}
    if versions != {transformers.__version__}:
        pytest.skip(f"the table was counted with transformers {versions}, this is {transformers.__version__}")
    assert shipped == shipped_counts_table(), ("the shipped counts are stale: rebuild them with "
                                               "eagle3_zoo.training.planner.plan.write_shipped_counts()")


def test_plan_of_a_shipped_recipe_builds_no_target_and_a_changed_config_does(monkeypatch):
    """A shipped target is counted from the table (no model built, so no modeling import); the same target with one
    field changed is not in the table and is built."""
    import transformers

    from eagle3_zoo.adapters.shipped import shipped_target_config
    from eagle3_zoo.training.planner import plan as plan_module

    if transformers.__version__ not in {e["_transformers"] for e in plan_module._shipped_counts().values()}:
        pytest.skip("the shipped counts were made with another transformers version")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    built = []
    meta_model = plan_module._meta_model
    monkeypatch.setattr(plan_module, "_meta_model", lambda config: built.append(config) or meta_model(config))
    recipe = load_recipe(RECIPES[0].parent / "llama3_8b.yaml")
    plan_recipe(recipe, source="llama3_8b")
    assert built == []
    config = shipped_target_config(recipe.target.name_or_path)
    config.num_hidden_layers = 2
    counts = plan_module.target_parameter_counts(config, get_adapter(config.model_type))
    assert len(built) == 1 and counts["total"] < 8_000_000_000


def _shipped_table_is_current() -> bool:
    from eagle3_zoo.training.planner import plan as plan_module

    return plan_module._transformers_version() in {e["_transformers"] for e in plan_module._shipped_counts().values()}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_drafter_shapes_without_a_build_equal_the_built_drafter(recipe):
    """`plan` sizes the drafter from `Eagle3Config.parameter_shapes()` (no torch module, no transformers import):
    name, order and shape of every parameter equal the meta-device build, for each shipped recipe's drafter, also
    with the EAGLE-3.1 options (fails when the drafter gains, loses or reshapes a parameter)."""
    from eagle3_zoo.adapters.shipped import shipped_target_config
    from eagle3_zoo.drafters import get_kind
    from eagle3_zoo.recipe.decisions import drafter_config
    from eagle3_zoo.targets.loading import feature_layer_ids

    r = load_recipe(recipe)
    target_config = shipped_target_config(r.target.name_or_path)
    adapter = get_adapter(target_config.model_type)
    base = drafter_config(r.drafter, r.target.name_or_path, r.trainer.precision, target_config,
                          feature_layer_ids(r.drafter, r.target.name_or_path, target_config, adapter))
    kind = get_kind(r.drafter.kind)
    eagle31 = [base.__class__(**{**base.__dict__, "fc_norm": True, "norm_output": True})] if kind.name == "eagle3" \
        else []
    for cfg in (base, *eagle31):
        with torch.device("meta"):
            built = kind.drafter_class(cfg)
        assert [(n, tuple(p.shape)) for n, p in built.named_parameters()] == \
            [(n, shape) for n, (shape, _) in cfg.parameter_shapes().items()]
        linear = {f"{n}.weight" for n, m in built.named_modules() if isinstance(m, torch.nn.Linear)}
        assert linear == {n for n, (_, kind) in cfg.parameter_shapes().items()  # DSpark's confidence head: fp32
                          if kind == "linear" or (kind == "fp32" and n.endswith(".weight"))}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_plan_from_the_resolved_table_equals_plan_through_transformers(recipe, monkeypatch):
    """A shipped target's config comes from the package's table (as transformers resolved it when the table was
    made) instead of transformers: the plan is the same, line for line, as with the config transformers builds
    now, under fsdp and ddp and with tau evaluation on."""
    from eagle3_zoo.adapters.shipped import ResolvedConfig, shipped_target_config
    from eagle3_zoo.training.planner.plan import shipped_resolved_config

    if not _shipped_table_is_current():
        pytest.skip("the shipped table was made with another transformers version")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tau = [] if load_recipe(recipe).drafter.kind in ("dflash", "dspark") else ["trainer.tau_eval.every_n_steps=100"]
    for overrides in ([], ["trainer.strategy=fsdp", *tau], ["trainer.strategy=ddp"]):
        r = load_recipe(recipe, overrides)
        resolved = shipped_resolved_config(r.target.name_or_path)
        assert isinstance(resolved, ResolvedConfig)
        fast = plan_recipe(r, source="r")
        slow = plan_recipe(r, target_config=shipped_target_config(r.target.name_or_path), source="r")
        assert fast.table() == slow.table() and fast.lines == slow.lines, overrides


def test_plan_of_a_shipped_recipe_imports_no_transformers():
    """`eagle3-zoo plan` of a shipped recipe reads the resolved config from the package's table: transformers (about
    2 s of imports on 2 busy cores) and the drafter's modeling code stay unimported (fails without the table's
    resolved configs or without `parameter_shapes`)."""
    import subprocess
    import sys

    if not _shipped_table_is_current():
        pytest.skip("the shipped table was made with another transformers version")
    code = ("import sys; from eagle3_zoo.cli import main; rc = main(['plan', 'recipes/llama3_70b.yaml']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m == 'eagle3_zoo.modeling"
            ".drafter'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=RECIPES[0].parents[1],
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]


def test_a_kind_sizes_its_own_training_step():
    """`plan` asks the recipe's kind for its training step's buffers (`DrafterKind.step_lines`, with the run plan's
    decisions in `StepSizing`): a kind registered beside the built-in ones gets its own lines in the training step and
    none of another kind's (fails when `plan` sizes a step by the kind's name)."""
    from eagle3_zoo.drafters import StepLine, get_kind, register_kind, unregister_kind

    class Sized(type(get_kind("eagle3"))):
        name = "sized_toy"

        def step_lines(self, section, config, target_config, sizing):
            return [StepLine("toy step", 3.0 * 2**30, f"batch {sizing.batch_size}, {sizing.compute_dtype}, "
                             f"chunk {sizing.logits_chunk}, target in step: {sizing.target_in_step}")]

    register_kind(Sized())
    try:
        plan = plan_recipe(load_recipe("recipes/smollm2_135m.yaml", ["drafter.kind=sized_toy"]))
    finally:
        unregister_kind("sized_toy")
    step = [line for line in plan.lines if line.phase == "training step"]
    assert [(line.what, line.bytes) for line in step] == [("toy step", 3.0 * 2**30)]
    assert step[0].note.startswith("batch ") and "chunk 1024" in step[0].note
    eagle3 = [line.what for line in plan_recipe(load_recipe("recipes/smollm2_135m.yaml")).lines
              if line.phase == "training step"]
    assert "TTT activations" in eagle3 and "toy step" not in eagle3
