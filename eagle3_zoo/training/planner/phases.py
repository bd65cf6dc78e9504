"""The phases of `eagle3-zoo plan` before training: regeneration and hidden states, each on the hardware it runs on.

Regeneration in process (`data.regenerate.backend: hf`) holds, on every trainer GPU, the whole target and one
`generate` batch: the prefill of `batch_size` prompts (at most `data.max_length - 1` tokens each: longer ones are
dropped) and then their KV cache growing by `max_new_tokens`. In the engine (the recipe's `engine:` for hidden
states and for regeneration with backend engine, or the one vLLM server regeneration starts with backend vllm) each
GPU holds the engine's weights at its
tensor / expert parallel size, one forward's activations and the KV cache that `gpu_memory_utilization` leaves: the
phase fits when that budget holds at least one sequence of the engine's context length. A server someone else runs
(backend openai) is outside the plan: one line says so. Nothing is allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle3_zoo.training.planner.report import PhasePlan, PlanLine, reserve_line
from eagle3_zoo.values.dtypes import torch_dtype

if TYPE_CHECKING:
    from eagle3_zoo.recipe.engine import EngineConfig
    from eagle3_zoo.recipe.sections import DataConfig, Recipe, TargetConfig, TrainerConfig

VLLM_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
VLLM_BATCHED_TOKENS = 8192  # tokens of one vLLM forward (its chunked-prefill budget on large GPUs): activations


def forward_bytes(config: Any, tokens: int, itemsize: int, tp: int = 1) -> float:
    """One decoder layer's activations over `tokens` (no grad): residual stream, norms and attention (6 hidden
    widths) and the MLP's gate, up and product (3 intermediate widths), the widths split over `tp` GPUs."""
    return tokens * (6 * config.hidden_size + 3 * config.intermediate_size / tp) * itemsize


def kv_elements(config: Any, kv_per_token: int, tokens: int) -> int:
    """Elements a transformers `DynamicCache` keeps for one sequence of `tokens` tokens (`kv_per_token`: over all
    layers, `plan.kv_elements_per_token`): a sliding-window layer (`layer_types` "sliding_attention": Gemma-3,
    gpt-oss) keeps its last `sliding_window - 1` tokens only, every other layer all of them. Checked against a real
    cache in tests/test_plan_phases.py."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
    kept = sum(min(tokens, window - 1) if kind == "sliding_attention" and window else tokens for kind in kinds)
    return kv_per_token // layers * kept


def regeneration_in_process(data: DataConfig, target: TargetConfig, config: Any, counts: dict[str, int],
                            kv_per_token: int, dequant: str) -> list[PlanLine]:
    """Per trainer GPU: the whole target and one `generate` batch (prefill, then decode to `max_new_tokens`)."""
    r, t = data.regenerate, target
    tb = torch_dtype(t.dtype).itemsize
    b, p, n = r.batch_size, data.max_length - 1, r.max_new_tokens
    kv = kv_per_token * tb
    window = f", sliding-window layers their last {config.sliding_window - 1}" if kv_elements(
        config, kv_per_token, p + n) < kv_per_token * (p + n) else ""
    logits = b * config.vocab_size * 4  # the last position's fp32 logits of each row
    lines = [PlanLine("target weights", counts["total"] * tb,
                      f"{counts['total'] / 1e9:.2f}B params in {t.dtype}, whole on every trainer rank{dequant}"),
             PlanLine("KV cache", b * kv_elements(config, kv_per_token, p) * tb, f"batch {b} x {p}-token prompts",
                      "prefill"),
             PlanLine("prefill forward", forward_bytes(config, b * p, tb) + logits,
                      "one layer's activations over the batch (no grad) + last-position fp32 logits", "prefill"),
             PlanLine("KV cache", b * kv_elements(config, kv_per_token, p + n) * tb,
                      f"batch {b} x ({p} prompt + {n} new) tokens ({kv / 1e3:.0f} KB per token{window})", "decode"),
             PlanLine("decode step", logits + forward_bytes(config, b, tb), "one token per row", "decode")]
    return [*lines, reserve_line(lines)]


def engine_weight_bytes(config: Any, counts: dict[str, int], dtype: str, tp: int, ep_group: int) -> tuple[float, str]:
    """Weight bytes per engine GPU and how they are stored: the checkpoint's FP8 decoder matrices with their fp32
    block scales (one per `weight_block_size` block) or MXFP4 experts as vLLM serves them, the rest in `dtype`;
    everything split over the `tp` GPUs but the routed experts, split over `ep_group` (tp x dp under expert
    parallelism). Layers past `num_hidden_layers` (DeepSeek-V3's multi-token-prediction layer) are not counted: vLLM
    loads them only to draft with them."""
    db = torch_dtype(dtype).itemsize
    quant_config = getattr(config, "quantization_config", None) or {}
    quant = quant_config.get("quant_method")
    experts, matrices, total = counts["experts"], counts["layer_matrices"], counts["total"]
    if quant == "fp8":
        block = quant_config.get("weight_block_size") or []
        scale_b = 4.0 / (block[0] * block[1]) if len(block) == 2 else 0.0  # fp32 scale per block, per weight
        fp8_b = 1.0 + scale_b
        expert_b, other_b = experts * fp8_b, (matrices - experts) * fp8_b + (total - matrices) * db
        scales = f" + fp32 scales per {block[0]}x{block[1]} block" if scale_b else ""
        how = f"the checkpoint's FP8 decoder matrices (1 B{scales}), the rest in {dtype}"
    elif quant == "mxfp4":
        expert_b, other_b = experts * (0.5 + 1 / 32), (total - experts) * db
        how = f"MXFP4 experts (4.25 bits), the rest in {dtype}"
    else:
        expert_b, other_b = experts * db, (total - experts) * db
        how = f"{dtype}"
    return other_b / tp + expert_b / ep_group, how


def engine_lines(config: Any, counts: dict[str, int], kv_per_token: int, *, dtype: str, tp: int, dp: int,
                 expert_parallel: bool, max_len: int, utilization: float, concurrency: tuple[int, str] | None,
                 capacity_gb: float | None) -> tuple[list[PlanLine], list[str]]:
    """One engine GPU: its weights, one forward's activations and one `max_len` sequence's KV cache; and the KV
    budget `utilization` leaves (`capacity_gb` x utilization - weights - activations) in sequences."""
    db = torch_dtype(dtype).itemsize
    ep_group = tp * dp if expert_parallel and counts["experts"] else tp
    weights, how = engine_weight_bytes(config, counts, dtype, tp, ep_group)
    mla = getattr(config, "kv_lora_rank", None) is not None
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    split = 1 if mla else min(tp, kv_heads)  # vLLM replicates MLA's latent, and KV heads beyond the head count
    kv = kv_per_token * db / split
    tokens = max(VLLM_BATCHED_TOKENS, max_len)
    experts = f", experts over {ep_group}" if ep_group != tp else ""
    lines = [PlanLine("weights", weights, f"{counts['total'] / 1e9:.2f}B params: {how}; / {tp} (tensor "
                      f"parallel){experts}"),
             PlanLine("forward activations", forward_bytes(config, tokens, db, tp),
                      f"one layer over {tokens} batched tokens (an estimate; vLLM measures its own at start)"),
             PlanLine("KV cache, one sequence", kv * max_len, f"{max_len} tokens x {kv / 1e3:.1f} KB per token "
                      "per GPU")]
    after = []
    if capacity_gb is not None:
        budget = capacity_gb * 1e9 - lines[0].bytes - lines[1].bytes
        seqs = max(budget, 0) / (kv * max_len)
        after.append(f"  KV budget: {budget / 1e9:.1f} GB per GPU = {seqs:.0f} sequences of {max_len} tokens"
                     + (f" ({concurrency[1]} {concurrency[0]} in flight)" if concurrency else ""))
    return lines, after


def engine_capacity(engine: EngineConfig, trainer: TrainerConfig,
                    utilization: float | None) -> tuple[float | None, str]:
    """GB per engine GPU that vLLM may use: `gpu_memory_utilization` x `engine.gpu_memory_gb` (null: the trainer's
    GPUs), and the keys it comes from."""
    e = engine
    gpu, key = (e.gpu_memory_gb, "engine.gpu_memory_gb") if e.gpu_memory_gb is not None else (
        trainer.gpu_memory_gb, "trainer.gpu_memory_gb")
    util = utilization or VLLM_UTILIZATION
    return (None if gpu is None else gpu * util), f"{util:g} (engine.gpu_memory_utilization) x {key}"


def regeneration_phase(recipe: Recipe, config: Any, counts: dict[str, int], kv_per_token: int,
                       dequant: str) -> PhasePlan:
    """Regeneration where `run_plan.regeneration_site` puts it: off, in process on every trainer GPU, one vLLM
    server started here (backend vllm: the whole target on one GPU), the recipe's engine (backend engine) or a server
    outside the run (not planned)."""
    from eagle3_zoo.recipe.decisions import regeneration_site, trainer_device
    from eagle3_zoo.recipe.sections import regeneration_max_model_len

    site, r, d, tr = regeneration_site(recipe.data), recipe.data.regenerate, recipe.data, recipe.trainer
    name = "regeneration"
    if site == "off":
        return PhasePlan(name, "off (data.regenerate.enabled: false)")
    if site == "server":
        return PhasePlan(name, f"on the OpenAI-compatible server at data.regenerate.base_url ({r.base_url}), "
                         "started outside this run: its memory is not planned here, and no trainer rank loads the "
                         "target for it")
    if site == "in process":
        return PhasePlan(name, f"in process (backend hf), every trainer rank generating batches of {r.batch_size} "
                         "with the whole target", regeneration_in_process(d, recipe.target, config, counts,
                                                                         kv_per_token, dequant), tr.gpu_memory_gb,
                         unit=trainer_device(tr.accelerator))
    if site == "engine":
        how = "for the regeneration only, stopped after it" if recipe.engine.mode == "launch" else \
            "answering the completions"
        return engine_phase(recipe, config, counts, kv_per_token, name, regeneration_max_model_len(recipe.engine, d),
                            (r.concurrency, "data.regenerate.concurrency"), how)
    capacity = None if tr.gpu_memory_gb is None else tr.gpu_memory_gb * VLLM_UTILIZATION
    lines, after = engine_lines(config, counts, kv_per_token, dtype=recipe.target.dtype, tp=1, dp=1,
                                expert_parallel=False, max_len=d.max_length + r.max_new_tokens,
                                utilization=VLLM_UTILIZATION, capacity_gb=capacity,
                                concurrency=(r.concurrency, "data.regenerate.concurrency"))
    return PhasePlan(name, "one vLLM server started here for the target (backend vllm: one GPU, no tensor "
                     "parallelism)", lines, capacity, f"{VLLM_UTILIZATION:g} (vLLM's default) x trainer.gpu_memory_gb",
                     after)


def hidden_states_phase(recipe: Recipe, config: Any, counts: dict[str, int], kv_per_token: int,
                        dequant: str) -> PhasePlan:
    """The target's hidden states where `run_plan.hidden_states_site` puts them: in the training step (its lines are
    the training phase's), the offline feature job in process, or the recipe's engine."""
    from eagle3_zoo.recipe.decisions import hidden_states_site, trainer_device
    from eagle3_zoo.recipe.sections import engine_max_model_len

    site, t, tr = hidden_states_site(recipe.data), recipe.target, recipe.trainer
    name = "hidden states"
    if site == "training step":
        return PhasePlan(name, "in the training step, by the target on the trainer's GPUs (planned with training)")
    if site == "feature job":
        tb = torch_dtype(t.dtype).itemsize
        tokens = tr.batch_size * recipe.data.max_length
        job = [PlanLine("target weights", counts["total"] * tb,
                        f"{counts['total'] / 1e9:.2f}B params in {t.dtype}, whole in each process{dequant}"),
               PlanLine("target forward", forward_bytes(config, tokens, tb), "one layer's activations (no grad)")]
        job.append(PlanLine("reserve", reserve_line(job).bytes, ""))
        phase = PhasePlan(name, "feature job (`eagle3-zoo prepare`, one target per process, data split by rank)", job,
                          tr.gpu_memory_gb, unit=trainer_device(tr.accelerator))
        if phase.fits is False:
            phase.after.append("  -> the target does not fit one process: extract its features with an inference "
                               "engine (tensor/expert parallel) instead")
        return phase
    how = {"online": "streamed to the trainers", "hybrid": "streamed, stored on the first pass",
           "offline": "stored before training"}[recipe.data.mode]
    return engine_phase(recipe, config, counts, kv_per_token, name, engine_max_model_len(recipe.engine, recipe.data),
                        (recipe.engine.concurrency, "engine.concurrency"), how)


def engine_phase(recipe: Recipe, config: Any, counts: dict[str, int], kv_per_token: int, name: str, max_len: int,
                 concurrency: tuple[int, str], how: str) -> PhasePlan:
    """A phase in the recipe's engine: one engine GPU at the section's parallelism, sequences of `max_len`."""
    e = recipe.engine
    capacity, key = engine_capacity(e, recipe.trainer, e.gpu_memory_utilization)
    lines, after = engine_lines(config, counts, kv_per_token, dtype=e.dtype or recipe.target.dtype,
                                tp=e.tensor_parallel_size, dp=e.data_parallel_size, expert_parallel=e.expert_parallel,
                                max_len=max_len, utilization=e.gpu_memory_utilization or VLLM_UTILIZATION,
                                concurrency=concurrency, capacity_gb=capacity)
    servers = f"{e.replicas} server(s) launched here" if e.mode == "launch" else f"{len(e.urls)} attached server(s)"
    nodes = f" over {e.num_nodes} nodes" if e.num_nodes > 1 else ""
    return PhasePlan(name, f"in the engine ({servers}, each tensor parallel {e.tensor_parallel_size} x data parallel "
                     f"{e.data_parallel_size}{', expert parallel' if e.expert_parallel else ''}{nodes}), {how}", lines,
                     capacity, key, after)
