"""`eagle3-zoo plan` covers every phase of a run (regeneration, hidden states, training step, tau evaluation), each
shipped recipe's phases fit the hardware it declares and no shipped FSDP recipe loads the whole target on a rank;
`plan`, `build_run` and the strategy builder take their decisions from the one run plan (world size, what of the
target a rank loads, the FSDP shard group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_zoo.adapters import get_adapter
from eagle3_zoo.cli import main
from eagle3_zoo.recipe import decisions as run_plan
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.training import build, strategies
from eagle3_zoo.training.planner.plan import plan_recipe, target_parameter_counts

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
PHASES = ("regeneration", "hidden states", "training", "tau evaluation")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_phase_of_every_shipped_recipe_is_planned_and_fits(recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shipped target configs are enough
    r = load_recipe(recipe)
    plan = plan_recipe(r, source=str(recipe))
    table = plan.table()
    lines = table.splitlines()
    for phase in PHASES:  # each phase has its own verdict line, or one line saying it is off / runs elsewhere
        assert any(line.startswith(f"{phase}: ") for line in lines), (phase, table)
    assert plan.not_fitting() == [], table
    if r.trainer.accelerator == "gpu":  # declared hardware: every phase planned here has a verdict, and fits
        assert plan.fits, table
        for p in plan.phases:
            assert p.fits is (True if p.lines else None), table
        assert table.splitlines()[-1] == "plan: every phase planned here fits"
    rp = run_plan.run_plan(r)
    if r.trainer.strategy == "fsdp":  # no shipped FSDP recipe loads the whole target on a rank
        assert rp.target_load != "whole", (rp.target_load, rp.target_load_reason)
        assert run_plan.target_skeleton_reason(r) is None or rp.target_load == "heads only"


def test_plan_exits_1_naming_the_phases_that_do_not_fit(capsys):
    # in-process regeneration of the 70B target: the whole target + its KV cache on every trainer GPU, and every
    # rank loads it whole before FSDP shards it
    assert main(["plan", "recipes/llama3_70b.yaml", "data.regenerate.backend=hf"]) == 1
    out = capsys.readouterr().out
    assert "regeneration: does NOT fit: 203.6 GB of 80 GB" in out and "whole target before sharding" in out
    assert out.rstrip().splitlines()[-1] == "plan: does NOT fit: regeneration, training"
    # the FP8 671B engine on the trainer's 80 GB GPUs instead of its 141 GB ones
    assert main(["plan", "recipes/deepseek_v3.yaml", "engine.gpu_memory_gb=null"]) == 1
    out = capsys.readouterr().out
    assert "hidden states: does NOT fit" in out and out.rstrip().endswith("plan: does NOT fit: regeneration, "
                                                                           "hidden states")
    assert main(["plan", "recipes/llama3_8b.yaml", "trainer.gpu_memory_gb=40"]) == 1  # regeneration: 57.1 GB
    assert capsys.readouterr().out.rstrip().endswith("plan: does NOT fit: regeneration")


def test_plan_of_a_phase_that_is_off_or_elsewhere_is_one_line():
    table = plan_recipe(load_recipe("recipes/deepseek_v3.yaml", ["data.regenerate.enabled=false"])).table()
    assert "\nregeneration: off (data.regenerate.enabled: false)\n" in table
    assert "\ntau evaluation: off (trainer.tau_eval.every_n_steps: null)" in table
    table = plan_recipe(load_recipe("recipes/mistral_small.yaml", ["data.regenerate.backend=openai",
                                                                    "data.regenerate.base_url=http://127.0.0.1:8001"]
                                     )).table()
    assert "\nregeneration: on the OpenAI-compatible server at data.regenerate.base_url" in table


def test_regeneration_in_the_engine_is_planned_as_the_engine_with_its_parallelism():
    """backend engine: the regeneration phase is the recipe's engine (its TP / EP, GPUs and utilisation), with the
    context of a regeneration request; the trainer ranks hold no target for it."""
    r = load_recipe("recipes/qwen3_30b_a3b.yaml")
    plan = plan_recipe(r)
    regen, hidden = plan.phase("regeneration"), plan.phase("hidden states")
    table = "\n".join(regen.table())
    assert regen.fits and "regeneration: " in plan.table()
    assert "in the engine (2 server(s) launched here, each tensor parallel 2 x data parallel 1, expert parallel), " \
           "for the regeneration only, stopped after it" in plan.table()
    assert regen.lines[0].what == "weights" and regen.lines[0].bytes == pytest.approx(hidden.lines[0].bytes)
    assert regen.capacity_gb == pytest.approx(hidden.capacity_gb)  # the engine's GPUs, not the trainer's
    assert "4096 tokens" in table and "data.regenerate.concurrency 64 in flight" in table  # 2048 + 2048 new
    assert run_plan.regeneration_site(r.data) == "engine" and run_plan.run_plan(r).target_load != "whole"
    attached = plan_recipe(load_recipe("recipes/llama3_70b.yaml")).table()
    assert "\nregeneration: in the engine (1 attached server(s), each tensor parallel 8 x data parallel 1), " \
           "answering the completions" in attached


def test_devices_as_a_list_count_each_device_in_plan_and_strategy():
    r = load_recipe("recipes/llama3_70b.yaml", ['trainer.devices="0,1"'])
    assert r.trainer.devices == "0,1"
    assert run_plan.run_plan(r).world_size == 2
    plan = plan_recipe(r)
    assert plan.world_size == 2 and "2 device(s)" in plan.table() and "sharded over 2" in plan.table()
    strategy = strategies.build_strategy("fsdp", devices=r.trainer.devices, num_nodes=1, accelerator="gpu")
    assert strategy._data_parallel_size == 2
    assert run_plan.devices_per_node("3", "gpu") == 3 and run_plan.devices_per_node("1,", "gpu") == 1


@pytest.mark.parametrize("devices", ["auto", "-1"])
def test_plan_says_how_it_counted_devices_auto(devices, monkeypatch, capsys, caplog):
    """`trainer.devices` auto / -1 is counted as the GPUs visible here, and the plan says so; with none visible (a
    GPU run planned on a laptop) it says that it counted one device, how to plan for N, and warns."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["plan", "recipes/llama3_70b.yaml", f"trainer.devices={devices}"]) in (0, 1)
    header = capsys.readouterr().out.splitlines()[0]
    assert f"strategy fsdp, 1 device(s) (trainer.devices = {devices}, but no CUDA GPU is visible here: counted as 1 " \
           "device, while the run takes every GPU of its node; pass trainer.devices=N to plan for N GPUs per node)" \
           in header, header
    assert [r for r in caplog.records if r.levelname == "WARNING" and "counted as 1 device" in r.getMessage()]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    caplog.clear()
    plan = plan_recipe(load_recipe("recipes/llama3_70b.yaml", [f"trainer.devices={devices}"]))
    assert plan.world_size == 4 and "sharded over 4" in plan.table()
    assert f"4 device(s) (trainer.devices = {devices}: the 4 CUDA GPU(s) visible here);" in plan.table()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "4 device(s); per device" in plan_recipe(load_recipe("recipes/llama3_70b.yaml",
                                                                ["trainer.devices=4"])).table()  # a count: no note


def test_strategies_read_the_run_plan_functions():
    assert strategies.world_size is run_plan.world_size
    assert strategies.target_skeleton_reason is run_plan.target_skeleton_reason
    assert strategies.fsdp_shard_size is run_plan.fsdp_shard_size


def test_fsdp_mesh_is_the_shard_group_plan_reports(monkeypatch):
    """Across nodes the strategy's mesh is (replicate, shard) with the shard group the run plan (and `plan`) says."""
    import torch.distributed.device_mesh as dm

    r = load_recipe("recipes/llama3_70b.yaml", ["trainer.num_nodes=2"])
    rp = run_plan.run_plan(r)
    assert (rp.world_size, rp.shard, rp.replicas) == (16, 8, 2)

    class Mesh:
        device_type = "cpu"

        def size(self):
            return rp.world_size

        def __getitem__(self, name):
            return ("flat", name)

    made = {}
    monkeypatch.setattr(dm, "init_device_mesh", lambda dev, shape, mesh_dim_names: made.setdefault("shape", shape))
    strategies.fsdp_mesh(Mesh(), r.trainer.num_nodes)
    assert made["shape"] == (rp.replicas, rp.shard)
    assert "FSDP shard group 8 x 2 replica(s)" in plan_recipe(r).table()
    assert strategies.fsdp_mesh(Mesh(), 1) == ("flat", "data_parallel")


class _Loaded(Exception):
    pass


@pytest.fixture
def loads(monkeypatch) -> dict:
    """What `build_run` asks `load_recipe_target` for (heads_only, skeleton); the load itself stops the run."""
    seen = {}

    def fake_load(target, drafter, trainer, source, device=None, heads_only=False, skeleton=False):
        seen.update(heads_only=heads_only, skeleton=skeleton)
        raise _Loaded

    monkeypatch.setattr(build, "load_recipe_target", fake_load)
    return seen


@pytest.mark.parametrize("overrides, load", [
    ([], "fsdp shard"),  # tau evaluation on the sharded target, regeneration on a server
    (["data.regenerate.backend=hf"], "whole"),  # in-process regeneration: the whole target first
    (["trainer.tau_eval.every_n_steps=null"], "heads only"),  # streamed features, no tau: the heads
    (["trainer.strategy=ddp"], "whole"),  # tau evaluation without FSDP: a full copy per rank
])
def test_build_run_loads_the_target_as_the_run_plan_says(overrides, load, loads):
    r = load_recipe("recipes/llama3_70b.yaml", overrides)
    assert run_plan.run_plan(r).target_load == load
    with pytest.raises(_Loaded):
        build.build_run(r)
    assert loads == {"heads_only": load == "heads only", "skeleton": load == "fsdp shard"}


def test_plan_and_build_run_read_the_one_target_load(monkeypatch, loads):
    """Change the decision in `run_plan.target_load` alone: `plan` prints it and `build_run` loads it."""
    monkeypatch.setattr(run_plan, "target_load", lambda recipe: ("heads only", "patched decision"))
    r = load_recipe("recipes/llama3_8b.yaml", ["trainer.tau_eval.every_n_steps=null"])
    assert "heads only (patched decision)" in plan_recipe(r).table()
    with pytest.raises(_Loaded):
        build.build_run(r)
    assert loads == {"heads_only": True, "skeleton": False}


def test_expert_and_matrix_counts_equal_the_built_moe_model():
    """The engine's weights per GPU split the routed experts (expert parallel) and store FP8 matrices: their
    counts come from the model itself."""
    adapter = get_adapter("qwen3_moe")
    config = adapter.tiny_config()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    counts = target_parameter_counts(config, adapter)
    layers = list(adapter.decoder_layers(model))
    experts = sum(p.numel() for m in layers for n, p in m.named_parameters() if n.startswith("mlp.experts."))
    assert experts > 0 and counts["experts"] == experts
    assert counts["layer_matrices"] == sum(p.numel() for m in layers for p in m.parameters() if p.dim() >= 2)


def test_engine_weights_split_by_tensor_and_expert_parallelism():
    def weights(*overrides):
        plan = plan_recipe(load_recipe("recipes/qwen3_30b_a3b.yaml", list(overrides)))
        return plan.phase("hidden states").lines[0].bytes

    tp2, tp4 = weights(), weights("engine.tensor_parallel_size=4", "engine.replicas=1")
    assert tp4 == pytest.approx(tp2 / 2)
    dp_ep, dp = weights("engine.data_parallel_size=2"), weights("engine.data_parallel_size=2",
                                                                "engine.expert_parallel=false")
    assert dp == pytest.approx(tp2) and dp_ep < tp2 * 0.6  # the experts (most of 30B-A3B) over 4 GPUs
    fp8 = plan_recipe(load_recipe("recipes/deepseek_v3.yaml")).phase("hidden states").lines[0]
    assert 80e9 < fp8.bytes < 90e9 and "FP8" in fp8.note  # ~690 GB of FP8 checkpoint over 8 GPUs


def _phase_numbers(plan) -> dict[str, str]:
    """Each phase's peak as recipes/README.md's table writes it ("57.1 of 80"; "server", "step", "off")."""
    def cell(total: float, capacity: float | None) -> str:
        return f"{total / 1e9:.1f}" + ("" if capacity is None else f" of {capacity:g}")

    out = {}
    for p in plan.phases:
        out[p.name] = cell(p.total, p.capacity_gb) if p.lines else p.where.split()[0]
    out["training"] = cell(plan.total, plan.gpu_memory_gb)
    held = sum(x.bytes for x in plan.lines if not x.phase)
    tau = held + sum(x.bytes for x in plan.lines if x.phase == "tau evaluation")
    out["tau evaluation"] = "off" if plan.tau_off else cell(tau, plan.gpu_memory_gb)
    return out


def test_the_recipes_readme_quotes_what_plan_prints(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = (RECIPES[0].parent / "README.md").read_text()
    rows = [line for line in text.split("### Memory per phase")[1].split("\n## ")[0].splitlines()
            if line.startswith("| ") and not line.startswith("| Recipe")]
    assert len(rows) == len(RECIPES)
    words = {"on": "server", "in": "step", "off": "off"}
    for row in rows:
        name, _, regen, hidden, training, tau = (c.strip() for c in row.strip("|").split("|"))
        plan = plan_recipe(load_recipe(RECIPES[0].parent / f"{name.split()[0]}.yaml"))
        got = _phase_numbers(plan)
        for phase, doc in (("regeneration", regen), ("hidden states", hidden), ("training", training),
                           ("tau evaluation", tau)):
            want = words.get(got[phase], got[phase])
            assert doc.split(" (")[0] == want, (name, phase, doc, got[phase])


def test_regeneration_on_a_vllm_server_started_here_holds_the_whole_target_on_one_gpu():
    """backend vllm starts one server with no tensor parallelism: an 8B target fits one 80 GB GPU, a 70B one not."""
    small = plan_recipe(load_recipe("recipes/llama3_8b.yaml", ["data.regenerate.backend=vllm"])).phase("regeneration")
    assert small.fits and small.lines[0].what == "weights" and small.capacity_gb == pytest.approx(72)
    assert small.lines[0].bytes == pytest.approx(8.03e9 * 2, rel=0.01)
    assert "data.regenerate.concurrency 4 in flight" in "\n".join(small.table())
    big = plan_recipe(load_recipe("recipes/llama3_70b.yaml", ["data.regenerate.backend=vllm"]))
    assert big.phase("regeneration").fits is False and big.not_fitting() == ["regeneration"]
    assert run_plan.run_plan(load_recipe("recipes/llama3_70b.yaml", ["data.regenerate.backend=vllm"])).target_load \
        == "fsdp shard"  # the server holds the target, not the trainer ranks


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_regeneration_kv_estimate_matches_the_cache_of_a_real_generate_batch(family):
    """The decode KV line of in-process regeneration against the cache `generate_replies` (the hf backend's one
    `generate` per batch) really holds: `batch_size` rows of the longest prompt the recipe lets through
    (`data.max_length - 1`) + `max_new_tokens` (the last token made is never fed back: one position less), on
    sliding-window layers (Gemma-3, gpt-oss) only the window's last tokens."""
    from transformers import AutoModelForCausalLM

    from eagle3_zoo.data.regenerate import generate_replies
    from eagle3_zoo.training.planner.phases import kv_elements, regeneration_in_process
    from eagle3_zoo.training.planner.plan import kv_elements_per_token

    adapter = get_adapter(family)
    config = adapter.tiny_config()
    if family != "llama":
        config.sliding_window = 6  # gemma3: 3 of its 4 layers keep 5 tokens; gpt_oss: 2 of 4
        assert config.layer_types.count("sliding_attention") == {"gemma3_text": 3, "gpt_oss": 2}[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    batch, max_length, new = 3, 17, 9
    caches = []
    model.register_forward_pre_hook(lambda m, a, kw: caches.append(kw.get("cache", kw.get("past_key_values"))),
                                    with_kwargs=True)  # the cache object generate feeds the model
    prompts = [list(range(1, max_length)), list(range(2, max_length - 3)), list(range(5, max_length - 1))]
    with torch.no_grad():
        generate_replies(model, prompts, max_new_tokens=new, temperature=0.0, pad_id=0,
                         end_ids=[config.vocab_size + 1])  # never made: every row runs to max_new_tokens
    held = sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
               for layer in caches[-1].layers if layer.is_initialized)
    recipe = load_recipe("recipes/llama3_8b.yaml", [f"data.max_length={max_length}", "target.dtype=float32",
                                                    f"data.regenerate.batch_size={batch}",
                                                    f"data.regenerate.max_new_tokens={new}"])
    per_token = kv_elements_per_token(config)
    lines = regeneration_in_process(recipe.data, recipe.target, config, target_parameter_counts(config, adapter),
                                    per_token, "")
    decode_kv = next(x for x in lines if x.what == "KV cache" and x.phase == "decode").bytes
    assert held == batch * kv_elements(config, per_token, max_length - 1 + new - 1) * 4
    assert decode_kv == batch * kv_elements(config, per_token, max_length - 1 + new) * 4
    if family == "llama":
        assert held == decode_kv * (max_length - 1 + new - 1) / (max_length - 1 + new)
    else:
        assert held < 0.65 * batch * per_token * (max_length - 1 + new - 1) * 4  # full length: 1.6-2.4x
    assert lines[0].bytes == sum(p.numel() * 4 for p in model.parameters())  # the whole target, fp32


def test_fp8_engine_weights_count_one_fp32_scale_per_block():
    """An FP8 checkpoint's decoder matrices: 1 B per weight + one fp32 scale per `weight_block_size` block."""
    from types import SimpleNamespace

    from eagle3_zoo.training.planner.phases import engine_weight_bytes

    counts = {"experts": 6 * 2**20, "layer_matrices": 8 * 2**20, "total": 9 * 2**20}
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    blocked, how = engine_weight_bytes(SimpleNamespace(quantization_config=fp8), counts, "bfloat16", 2, 4)
    plain, _ = engine_weight_bytes(SimpleNamespace(quantization_config={"quant_method": "fp8"}), counts,
                                   "bfloat16", 2, 4)
    # no block size: 2M FP8 weights + 1M bf16 over tp 2, 6M FP8 experts over 4 GPUs
    assert plain == 2 * 2**20 / 2 + 2**20 * 2 / 2 + 6 * 2**20 / 4
    assert blocked - plain == pytest.approx((2 * 2**20 / 2 + 6 * 2**20 / 4) * 4 / 128**2)
    assert "fp32 scales per 128x128 block" in how
