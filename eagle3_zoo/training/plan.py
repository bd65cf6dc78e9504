"""`eagle3-zoo plan RECIPE`: what one GPU holds when the recipe trains, and whether it fits the declared GPU memory.

    plan = plan_recipe(load_recipe("recipes/llama3_70b.yaml"))
    print(plan.table())          # target shard, drafter + grads + AdamW, reserve; training step; tau evaluation

Lines held for the whole run add up; lines of a phase (the training step's activations and, under FSDP, the
drafter's gathered parameters, unsharded gradients and reduce-scatter input; the tau evaluation's transient
buffers, which `TauEvalCallback` allocates between training steps, after the step's activations are freed) only
count for the phase that needs more: the peak is the persistent part plus the larger phase.
Parameter counts come from the models themselves, built on the meta device from the target's config (shipped in
the package for every zoo/recipe target, so this runs offline): no arithmetic per family (but the KV cache width of
MLA targets, for the tau evaluation). Activation sizes are an
estimate from the drafter's shapes (what the TTT rollout saves for backward per token and step, per dtype: under
autocast the norms' inputs and the attention's merge stay fp32, and autocast keeps a copy of each matmul weight),
checked in the tests against the tensors a real TTT loss saves, in fp32 and under CPU bf16 autocast. Nothing is
allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_zoo.dtypes import torch_dtype

GIB = 1024**3
RESERVE_FIXED_GIB = 1.0  # CUDA context, NCCL buffers
RESERVE_FRACTION = 0.10  # allocator fragmentation
LOGITS_CHUNK = 1024  # rows per chunk of the frozen lm_head product (Eagle3Module.logits_chunk_size)


@dataclass
class PlanLine:
    what: str
    bytes: float
    note: str = ""
    phase: str = ""  # "" = held throughout; else the phase that holds it (only the largest phase counts)


@dataclass
class MemoryPlan:
    """Per-GPU memory of a recipe's training step (and, for offline recipes, of its feature job)."""

    source: str
    target: str
    strategy: str
    world_size: int
    gpu_memory_gb: float | None
    lines: list[PlanLine] = field(default_factory=list)
    feature_job: list[PlanLine] = field(default_factory=list)

    @property
    def total(self) -> float:
        """The peak: the persistent lines plus the largest phase."""
        return peak(self.lines)[0]

    @property
    def peak_phase(self) -> str | None:
        """The phase that sets the peak (None without phases)."""
        return peak(self.lines)[1]

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory_gb is None else self.total <= self.gpu_memory_gb * 1e9

    @property
    def feature_job_fits(self) -> bool | None:
        if not self.feature_job or self.gpu_memory_gb is None:
            return None
        return peak(self.feature_job)[0] <= self.gpu_memory_gb * 1e9

    def table(self) -> str:
        """The plan as a text table with a verdict line."""
        out = [f"{self.source}: target {self.target}, strategy {self.strategy}, {self.world_size} device(s); "
               "per device (GB = 1e9 bytes):"]
        out += _rows(self.lines)
        out.append(_verdict(self.total, self.gpu_memory_gb, "training"))
        if self.feature_job:
            out += ["", "feature job (`eagle3-zoo prepare`, one target per process, data split by rank); per device:"]
            out += _rows(self.feature_job)
            job = peak(self.feature_job)[0]
            out.append(_verdict(job, self.gpu_memory_gb, "feature job"))
            if self.feature_job_fits is False:
                out.append("  -> the target does not fit one process: extract its features with an inference engine "
                           "(tensor/expert parallel) instead")
        return "\n".join(out)


def peak(lines: list[PlanLine]) -> tuple[float, str | None]:
    """Bytes of the persistent lines plus the largest phase, and that phase (None without phases)."""
    phases: dict[str, float] = {}
    for line in lines:
        if line.phase:
            phases[line.phase] = phases.get(line.phase, 0.0) + line.bytes
    held = sum(line.bytes for line in lines if not line.phase)
    if not phases:
        return held, None
    top = max(phases, key=phases.__getitem__)
    return held + phases[top], top


def _rows(lines: list[PlanLine]) -> list[str]:
    """One row per line, each phase's lines under a header row with the phase's sum, then the peak."""
    total, top = peak(lines)
    phases = {line.phase for line in lines if line.phase}
    width = max(len(line.what) + (2 if line.phase else 0) for line in lines)
    width = max([width, *(len(p) + 1 for p in phases)])

    def row(what: str, size: float, note: str = "") -> str:
        return f"  {what.ljust(width)}  {size / 1e9:9.2f} GB  {note}".rstrip()

    rows, seen = [], set()
    for line in lines:
        if line.phase and line.phase not in seen:
            seen.add(line.phase)
            size = sum(x.bytes for x in lines if x.phase == line.phase)
            note = ("sets the peak" if line.phase == top else "smaller, not counted") if len(phases) > 1 else ""
            rows.append(row(f"{line.phase}:", size, note))
        rows.append(row(f"  {line.what}" if line.phase else line.what, line.bytes, line.note))
    rows.append(row("total", total, f"peak: the lines held throughout + the {top}" if len(phases) > 1 else ""))
    return rows


def _verdict(total: float, gpu_memory_gb: float | None, what: str) -> str:
    if gpu_memory_gb is None:
        return f"{what}: no trainer.gpu_memory_gb declared, so no verdict ({total / 1e9:.1f} GB needed)"
    word = "fits" if total <= gpu_memory_gb * 1e9 else "does NOT fit"
    return f"{what}: {word}: {total / 1e9:.1f} GB of {gpu_memory_gb:g} GB per GPU (trainer.gpu_memory_gb)"


def _meta_model(config: Any) -> torch.nn.Module:
    """The target built on the meta device (no memory), without its checkpoint quantisation (dequantised on load)."""
    from transformers import AutoModelForCausalLM

    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def target_parameter_counts(config: Any, adapter: Any) -> dict[str, int]:
    """`total`, `embed`, `lm_head` and `largest_layer` parameter counts of the target (meta-device build)."""
    model = _meta_model(config)
    embed, head = adapter.embed_tokens(model).weight, adapter.lm_head(model).weight
    layers = list(adapter.decoder_layers(model))
    unique = {id(p): p.numel() for p in model.parameters()}
    return {"total": sum(unique.values()), "embed": embed.numel(),
            "lm_head": 0 if head is embed else head.numel(),
            "largest_layer": max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)}


def _meta_drafter(config: Any) -> torch.nn.Module:
    from eagle3_zoo.modeling import Eagle3Drafter

    with torch.device("meta"):
        return Eagle3Drafter(config)


def drafter_parameter_count(config: Any) -> int:
    """Trainable parameters of a drafter with this `Eagle3Config` (meta-device build)."""
    return sum(p.numel() for p in _meta_drafter(config).parameters() if p.requires_grad)


def fsdp_padded_numel(config: Any, shard: int) -> int:
    """Elements of a drafter's parameters as FSDP2 lays them out unsharded over `shard` ranks: each parameter's
    dim 0 padded to a multiple of `shard` (the all-gather output and the reduce-scatter input have this size)."""
    return sum(-(-p.shape[0] // shard) * shard * (p.numel() // p.shape[0]) for p in _meta_drafter(config).parameters())


def stored_dtype(precision: str) -> torch.dtype:
    """The dtype of the drafter's stored parameters under a `trainer.precision` (Lightning converts the module
    under the `*-true` precisions; the mixed precisions keep fp32 weights)."""
    return {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision,
                                                                                                torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the drafter's matmuls under a `trainer.precision` (autocast's under `*-mixed`)."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, stored_dtype(precision))


def fsdp_drafter_lines(config: Any, precision: str, shard: int) -> list[PlanLine]:
    """The drafter's FSDP2 buffers in a training step (`strategies.shard_fsdp2`).

    The drafter objective is one FSDP unit, and the root of its own tree, so FSDP2 does not reshard it after
    forward: the whole drafter is gathered once per step, in the `MixedPrecisionPolicy`'s param dtype (bf16 under
    bf16-mixed, else the stored dtype), and kept through backward. Backward leaves every gradient whole (param
    dtype) until the post-backward hook frees the gathered parameters and copies (casting) the gradients into one
    reduce-scatter input in the reduce dtype (fp32 under bf16-mixed). The gathered and the reduce-scatter buffers
    have FSDP2's padded size (`fsdp_padded_numel`). The lines add up with the step's activations: an upper bound,
    since the reduce-scatter input is allocated after backward freed the activations and the gathered parameters.
    Checked against the buffers FSDP2 allocates in tests/test_plan.py.
    """
    from eagle3_zoo.training.strategies import drafter_mixed_precision

    policy = drafter_mixed_precision(precision)
    pdt = policy.param_dtype if policy is not None and policy.param_dtype is not None else stored_dtype(precision)
    rdt = policy.reduce_dtype if policy is not None and policy.reduce_dtype is not None else pdt
    n, padded = drafter_parameter_count(config), fsdp_padded_numel(config, shard)
    (pb, pname), (rb, rname) = ((d.itemsize, str(d).removeprefix("torch.")) for d in (pdt, rdt))
    train = "training step"
    return [PlanLine("drafter all-gather", padded * pb,
                     f"{padded / 1e6:.0f}M x {pb} B ({pname}): one FSDP unit, gathered whole once per step, kept "
                     "through backward", train),
            PlanLine("drafter unsharded grads", n * pb,
                     f"{n / 1e6:.0f}M x {pb} B ({pname}), whole until the post-backward reduce-scatter", train),
            PlanLine("drafter reduce-scatter input", padded * rb,
                     f"{padded / 1e6:.0f}M x {rb} B ({rname}), the grads copied in after backward (upper bound: "
                     "counted with the activations)", train)]


def ttt_saved_bytes(config: Any, tokens: int, steps: int, compute: torch.dtype = torch.float32,
                    supervised: float | None = None) -> dict[str, float]:
    """Bytes the TTT rollout and loss keep for backward (an estimate from the drafter's shapes, per dtype).

    `compute` is the matmuls' dtype (autocast's under `*-mixed`, the weights' under `*-true`). Per token and TTT
    step k, in `compute`: the norm outputs, the one cast attention input (2H) and MLP input, i.e. 6H; q and the
    attention output (2 q-widths); the MLP gate, activation, up and product (4I); the keys and values the attention
    reads, k0 and v0 at step 0, the stacked diagonal keys/values (2k kv-widths) and, below fp32, k0 cast again. In
    fp32 whatever the compute dtype: the two norm inputs that need a gradient (2H) and their scales, RoPE's cos/sin
    and the log-sum-exp and diagonal weights (heads x (k + 1)). Per supervised row and step: the gathered hidden and
    the final norm's output (fp32 input below fp32), the fused loss's hidden gradient (fp32) and the row indices.
    Step 0 adds the fc input; under autocast with fp32 weights, autocast's copy of each matmul weight but fc's and
    the lm_head's (`autocast_weights`). Checked against the tensors a real TTT loss saves (fp32 and bf16 autocast) in
    tests/test_plan.py.

    Returns:
        `{"activations", "loss_rows", "fc_input", "autocast_weights"}` in bytes.
    """
    h, inter, d, heads = config.hidden_size, config.intermediate_size, config.head_dim, config.num_attention_heads
    q, kv = heads * d, config.num_key_value_heads * d
    sup = tokens if supervised is None else supervised
    c = compute.itemsize
    low = c < 4
    # sum over k of the keys/values: 2 kv at step 0, then 2k kv (+ kv for the recast k0 below fp32)
    keys = kv * (2 + sum(2 * k + low for k in range(1, steps)))
    per_token = steps * (6 * h + 2 * q + 4 * inter) * c + keys * c
    per_token += (steps * (2 * h + 2 + 2 * d) + heads * steps * (steps + 1) // 2) * (4 if low else c)
    rows = sup * steps * ((h * (c + 4) + 4 if low else 2 * h * c + 4) + 4 * h + 16)
    n_aux = len(config.aux_layer_ids or (0, 0, 0))
    weights = 0
    if low:
        drafter = _meta_drafter(config)
        # not fc's: the features need no gradient, so its backward needs only its input
        weights = sum(m.weight.numel() for m in drafter.modules()
                      if isinstance(m, torch.nn.Linear) and m not in (drafter.lm_head, drafter.fc)) * c
    return {"activations": per_token * tokens, "loss_rows": rows, "fc_input": n_aux * config.target_hidden_size
            * tokens * c, "autocast_weights": weights}


def kv_elements_per_token(config: Any) -> int:
    """Elements a transformers `DynamicCache` keeps per token over all layers of a target with this config (keys
    and values; MLA models (transformers 5.x DeepSeek-V3) cache the compressed latent and the shared RoPE key).
    Checked against a real cache in tests/test_plan.py."""
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) is not None:  # MLA
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        d = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_layer = 2 * (getattr(config, "num_key_value_heads", None) or heads) * d
    return config.num_hidden_layers * per_layer


def tau_eval_lines(recipe: Any, target_config: Any, dcfg: Any, n_drafter: int, gathers: bool) -> list[PlanLine]:
    """The transient buffers of one tau evaluation (`TauEvalCallback.measure`, between training steps).

    Under FSDP every rank gathers the drafter into a plain copy in the parameters' stored dtype
    (`strategies.unsharded_drafter`; fp32 under bf16-mixed); under ddp/auto the drafter decodes in place. Then one
    prompt at a time (freed before the next): the target's and the drafter's KV caches over the prompt,
    `max_new_tokens` and the draft tree, the prompt's target pass (one layer's activations, the aux features and
    final hidden it returns) and the drafter's pass over the prompt (at most what a TTT step saves, a causal mask),
    and the fp32 logits rows of the verified path and the drafted frontier. Prompts are bounded by
    `data.max_length` (MT-bench first turns are far shorter)."""
    from eagle3_zoo.speculative.callback import TauEvalCallback

    cfg = recipe.trainer.tau_eval
    tree = TauEvalCallback(["plan"], every_n_steps=cfg.every_n_steps, max_new_tokens=cfg.max_new_tokens).tree
    tbytes = torch_dtype(recipe.target.dtype).itemsize
    wbytes = stored_dtype(recipe.trainer.precision).itemsize
    p, n = recipe.data.max_length, cfg.max_new_tokens
    h, inter = target_config.hidden_size, target_config.intermediate_size
    target_kv = kv_elements_per_token(target_config) * (p + n + tree.total_tokens + 1) * tbytes
    draft_kv = 2 * dcfg.num_key_value_heads * dcfg.head_dim * (p + n + tree.depth * tree.top_k) * wbytes
    prompt = (p * (6 * h + 3 * inter) + p * (len(dcfg.aux_layer_ids) * dcfg.target_hidden_size + h)) * tbytes
    saved = ttt_saved_bytes(dcfg, p, 1, stored_dtype(recipe.trainer.precision))
    draft_pass = saved["activations"] + saved["loss_rows"] + saved["fc_input"] + p * p * (wbytes + 1)
    logits = (tree.depth + 2) * target_config.vocab_size * 4 + tree.top_k * dcfg.draft_vocab_size * 4
    phase = "tau evaluation"
    lines = []
    if gathers:
        lines.append(PlanLine("gathered drafter copy", n_drafter * wbytes,
                              f"{n_drafter / 1e6:.0f}M params x {wbytes} B, whole on every GPU (unsharded_drafter)",
                              phase))
    lines.append(PlanLine("decode buffers", target_kv + draft_kv + prompt + draft_pass + logits,
                          f"KV caches (target {target_kv / 1e9:.2f} GB) for a {p}-token prompt + {n} new tokens + "
                          f"a {tree.total_tokens}-node tree, prompt passes, logits rows", phase))
    return lines


def plan_recipe(recipe: Any, target_config: Any = None, source: str = "recipe") -> MemoryPlan:
    """The per-GPU memory plan of a recipe.

    Args:
        recipe: a loaded `Recipe`.
        target_config: the target's config (default: the shipped config of `target.name_or_path`, else its
            `config.json` through transformers, which may download it).
        source: the recipe's name in messages.
    """
    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.adapters.shipped import shipped_target_config
    from eagle3_zoo.training.build import drafter_config
    from eagle3_zoo.training.strategies import drafter_mixed_precision

    t, tr = recipe.target, recipe.trainer
    if target_config is None:
        target_config = shipped_target_config(t.name_or_path)
    if target_config is None:
        from eagle3_zoo.hub.check_target import resolve_target_config

        target_config = resolve_target_config(t.name_or_path)
    adapter = get_adapter(target_config.model_type)
    world = (tr.devices if isinstance(tr.devices, int) and tr.devices > 0 else 1) * tr.num_nodes
    fsdp = tr.strategy == "fsdp"
    per_node = world // tr.num_nodes
    # FSDP shards within a node and replicates across nodes (HSDP, `strategies.fsdp_mesh`) when there are several
    shard = (per_node if tr.num_nodes > 1 and per_node > 1 else world) if fsdp else 1
    tbytes = torch_dtype(t.dtype).itemsize
    compute = compute_dtype(tr.precision)
    compute_name = str(compute).removeprefix("torch.")
    counts = target_parameter_counts(target_config, adapter)
    aux = tuple(recipe.drafter.aux_layer_ids or adapter.aux_layer_ids(target_config.num_hidden_layers))
    dcfg = drafter_config(recipe, target_config, aux)
    n_drafter = drafter_parameter_count(dcfg)
    tokens = tr.batch_size * recipe.data.max_length
    steps = recipe.ttt.steps
    plan = MemoryPlan(source, getattr(target_config, "_name_or_path", "") or t.name_or_path, tr.strategy, world,
                      tr.gpu_memory_gb)
    quant = (getattr(target_config, "quantization_config", None) or {}).get("quant_method")
    dequant = f"; its {quant} checkpoint dequantised to {t.dtype}" if quant else ""
    from eagle3_zoo.recipe_engine import features_from_engine, target_in_training_step, target_sharded_in_trainer

    tau = bool(tr.tau_eval.every_n_steps)
    in_step = target_in_training_step(recipe)
    keep_target = in_step or tau
    shard_target = target_sharded_in_trainer(recipe)  # offline: FSDP shards the drafter only
    train = "training step"
    source_of_features = "the engine (streamed)" if features_from_engine(recipe) and recipe.data.mode != "offline" \
        else "the store"
    if keep_target:
        why = "online features" if in_step else "tau evaluation during training"
        where = (f"sharded over {shard}" + (f", replicated over {tr.num_nodes} nodes" if shard < world else "")
                 if shard_target else "a full copy per GPU")
        plan.lines.append(PlanLine("target weights", counts["total"] * tbytes / (shard if shard_target else 1),
                                   f"{counts['total'] / 1e9:.2f}B params in {t.dtype}, {where} ({why}){dequant}"))
        if shard_target:
            plan.lines.append(PlanLine("target all-gather", 2 * counts["largest_layer"] * tbytes,
                                       "two decoder layers unsharded at a time (prefetch)"))
    else:
        plan.lines.append(PlanLine("target embed + lm_head", (counts["embed"] + counts["lm_head"]) * tbytes,
                                   f"features come from {source_of_features}"))
    state = 4 * stored_dtype(tr.precision).itemsize  # weights + grads + AdamW (m, v), all in the stored dtype
    plan.lines.append(PlanLine("drafter weights+grads+AdamW", n_drafter * state / shard,
                               f"{n_drafter / 1e6:.0f}M params x {state} B{f' / {shard}' if fsdp else ''}"))
    if in_step:
        h, inter = target_config.hidden_size, target_config.intermediate_size
        plan.lines.append(PlanLine("target forward", tokens * (6 * h + 3 * inter) * tbytes
                                   + LOGITS_CHUNK * target_config.vocab_size * 4,
                                   "one layer's activations (no grad) + a chunk of fp32 logits", train))
    else:
        plan.lines.append(PlanLine("target logits chunk", LOGITS_CHUNK * target_config.vocab_size * 4,
                                   "fp32 lm_head logits of the stored final hidden, a chunk at a time", train))
    saved = ttt_saved_bytes(dcfg, tokens, steps, compute)
    act = saved["activations"]
    note = f"{steps} TTT steps x {tokens} tokens (batch {tr.batch_size} x {recipe.data.max_length}), {compute_name}"
    if tr.activation_checkpointing:  # the MLP's 4 [T, I] tensors are recomputed in backward, one step at a time
        act -= (steps - 1) * 4 * dcfg.intermediate_size * tokens * compute.itemsize
        note += "; MLP activations recomputed (activation checkpointing)"
    plan.lines.append(PlanLine("TTT activations", act + saved["loss_rows"] + saved["fc_input"], note, train))
    # autocast keeps a compute-dtype copy of each fp32 matmul weight for backward (FSDP's bf16 policy has none)
    copies = saved["autocast_weights"] if tr.precision.endswith("-mixed") and not (
        fsdp and drafter_mixed_precision(tr.precision) is not None) else 0
    if copies:
        plan.lines.append(PlanLine("autocast weight copies", copies,
                                   f"{compute_name} copies of the drafter's fp32 matmul weights (kept for backward)",
                                   train))
    vd = dcfg.draft_vocab_size
    plan.lines.append(PlanLine("loss buffers", tokens * vd * 4 + vd * dcfg.hidden_size * 4,
                               f"target probabilities over {vd} draft tokens + one lm_head gradient buffer (fp32)",
                               train))
    if fsdp:
        plan.lines += fsdp_drafter_lines(dcfg, tr.precision, shard)
    if tau:
        plan.lines += tau_eval_lines(recipe, target_config, dcfg, n_drafter, gathers=fsdp)
    subtotal = plan.total
    plan.lines.append(PlanLine("reserve", RESERVE_FIXED_GIB * GIB + RESERVE_FRACTION * subtotal,
                               f"{RESERVE_FIXED_GIB:g} GiB CUDA context + {RESERVE_FRACTION:.0%} fragmentation"))
    if recipe.data.mode == "offline" and not features_from_engine(recipe):  # else the engine runs the feature job
        job = [PlanLine("target weights", counts["total"] * tbytes,
                        f"{counts['total'] / 1e9:.2f}B params in {t.dtype}, whole in each process{dequant}"),
               PlanLine("target forward", tokens * (6 * target_config.hidden_size + 3 * target_config.intermediate_size)
                        * tbytes, "one layer's activations (no grad)")]
        job.append(PlanLine("reserve", RESERVE_FIXED_GIB * GIB + RESERVE_FRACTION * sum(x.bytes for x in job), ""))
        plan.feature_job = job
    return plan
