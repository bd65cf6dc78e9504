"""`eagle3-zoo plan RECIPE`: what one GPU holds in every phase of the recipe's run, and whether each fits.

    plan = plan_recipe(load_recipe("recipes/llama3_70b.yaml"))
    print(plan.table())          # the run plan; regeneration; hidden states; training step and tau evaluation
    plan.not_fitting()           # the phases that do not fit (`eagle3-zoo plan` exits 1 naming them)

What runs where and what of the target each trainer rank loads are the run plan's decisions
(`eagle3_zoo.recipe.decisions`, which the data stage of `fit` and the strategy builder read too); the phases before
training are planned in `plan_phases`, this module plans the training phase. In the training phase, lines held for
the whole run add up; lines of a phase (the training step's activations and, under FSDP, the
drafter's gathered parameters, unsharded gradients and reduce-scatter input; the tau evaluation's transient
buffers, which `TauEvalCallback` allocates between training steps, after the step's activations are freed) only
count for the phase that needs more: the peak is the persistent part plus the larger phase.
Parameter counts come from the models themselves, built on the meta device from the target's config (shipped in
the package for every zoo/recipe target, so this runs offline): no arithmetic per family (but the KV cache width of
MLA targets, for the tau evaluation). The training step's buffers are the drafter kind's
estimate from its shapes (`DrafterKind.step_lines`, asked through `eagle3_zoo.drafters.step_lines` with the run plan's
decisions: EAGLE-3's is what the TTT rollout saves for backward per token and step, per dtype, `ttt_saved_bytes`;
DFlash's what one forward over all its blocks saves, `dflash_saved_bytes`), checked in the tests against the tensors
a real loss saves, in fp32 and under CPU bf16 autocast. Nothing is allocated.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3_zoo.drafters import StepSizing, step_lines
from eagle3_zoo.drafters.dflash.sizing import dflash_saved_bytes  # noqa: F401  (re-exported: the DFlash step's sizing)
from eagle3_zoo.drafters.eagle3.sizing import ttt_saved_bytes
from eagle3_zoo.recipe.decisions import compute_dtype, stored_dtype  # noqa: F401
from eagle3_zoo.training.planner.report import (  # noqa: F401  (re-exported: the plan's API)
    RESERVE_FIXED_GIB,
    RESERVE_FRACTION,
    MemoryPlan,
    PhasePlan,
    PlanLine,
    peak,
    reserve_line,
)
from eagle3_zoo.values.dtypes import torch_dtype

if TYPE_CHECKING:
    from eagle3_zoo.recipe.decisions import RunPlan
    from eagle3_zoo.recipe.sections import Recipe

logger = logging.getLogger(__name__)

LOGITS_CHUNK = 1024  # rows per chunk of the frozen lm_head product (DrafterModule.logits_chunk_size)


def _meta_model(config: Any) -> torch.nn.Module:
    """The target built on the meta device (no memory), without its checkpoint quantisation (dequantised on load)."""
    from transformers import AutoModelForCausalLM

    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


COUNTS_FILE = ("resources", "target_parameter_counts.json")  # the shipped targets' counts, keyed by `counts_key`


def _transformers_version() -> str:
    """The installed transformers version, from its metadata (importing transformers costs ~1 s under load)."""
    from importlib.metadata import version

    return version("transformers")


def _resolved_fields(config: Any) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}


def counts_key(config: Any) -> str:
    """What a target's parameter counts depend on: its whole config (not its name) and the transformers version
    that builds the model, as a digest."""
    text = json.dumps({"config": _resolved_fields(config), "transformers": _transformers_version()}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def shipped_key(data: dict[str, Any]) -> str:
    """A shipped target's config file (`shipped_target_dict`) and the transformers version, as a digest."""
    text = json.dumps({"shipped": data, "transformers": _transformers_version()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def shipped_resolved_config(name: str) -> Any | None:
    """The shipped target's config as the installed transformers resolves it, from the package's table: a
    `ResolvedConfig`, with no transformers import. None when `name` is not shipped or the table was made from another
    file or transformers version (the caller then resolves it with transformers: `shipped_target_config`)."""
    from eagle3_zoo.adapters.shipped import ResolvedConfig, shipped_target_dict

    data = shipped_target_dict(name)
    if data is None:
        return None
    key = shipped_key(data)
    entry = next((e for e in _shipped_counts().values() if e.get("_shipped") == key), None)
    return None if entry is None else ResolvedConfig(entry["_config"], data["_name_or_path"])


@functools.lru_cache(maxsize=1)
def _shipped_counts() -> dict[str, dict[str, int]]:
    path = resources.files("eagle3_zoo").joinpath(*COUNTS_FILE)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def target_parameter_counts(config: Any, adapter: Any, shipped: bool = True) -> dict[str, int]:
    """`total`, `embed`, `lm_head` and `largest_layer` parameter counts of the target (meta-device build), and of
    its decoder layers' `layer_matrices` (parameters of 2 or more dims: what FP8 checkpoints quantise) and routed
    `experts` (what expert parallelism splits).

    With `shipped`, a config whose `counts_key` is in the package's table (the shipped targets, counted with the
    transformers version the table was made with) is answered from it without building the model (~2.5 s of
    imports and construction); tests/test_plan.py rebuilds every entry the installed transformers can check."""
    if shipped and (known := _shipped_counts().get(counts_key(config))) is not None:
        return {k: v for k, v in known.items() if not k.startswith("_")}  # "_target", "_transformers": labels
    model = _meta_model(config)
    embed, head = adapter.embed_tokens(model).weight, adapter.lm_head(model).weight
    layers = list(adapter.decoder_layers(model))
    unique = {id(p): p.numel() for p in model.parameters()}
    named = [(n, p) for m in layers for n, p in m.named_parameters()]
    return {"total": sum(unique.values()), "embed": embed.numel(),
            "lm_head": 0 if head is embed else head.numel(),
            "largest_layer": max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
            "layer_matrices": sum(p.numel() for _, p in named if p.dim() >= 2),
            "experts": sum(p.numel() for n, p in named if ".experts." in f".{n}")}


def shipped_counts_table() -> dict[str, dict[str, int]]:
    """The table `target_parameter_counts` reads, built: every shipped target config counted on the meta device
    (with the installed transformers)."""
    import transformers

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.adapters.shipped import shipped_target_config, shipped_target_dict, shipped_target_ids

    table = {}
    for hub_id in shipped_target_ids():
        config = shipped_target_config(hub_id)
        counts = target_parameter_counts(config, get_adapter(config.model_type), shipped=False)
        resolved = json.loads(json.dumps(_resolved_fields(config), default=str))
        table[counts_key(config)] = {"_target": hub_id, "_transformers": transformers.__version__,
                                     "_shipped": shipped_key(shipped_target_dict(hub_id)), "_config": resolved,
                                     **counts}
    return table


def write_shipped_counts() -> Path:
    """Rebuild the package's table of the shipped targets' parameter counts (after adding or changing a shipped
    target config, or with another transformers version):
    `python -c "from eagle3_zoo.training.planner.plan import write_shipped_counts; write_shipped_counts()"`."""
    from eagle3_zoo.util.fileio import atomic_write_text

    path = Path(str(resources.files("eagle3_zoo").joinpath(*COUNTS_FILE)))
    atomic_write_text(path, json.dumps(shipped_counts_table(), indent=1, sort_keys=True) + "\n")
    _shipped_counts.cache_clear()
    return path


def drafter_parameter_count(config: Any) -> int:
    """Parameters of a drafter with this config (all trainable), from its `parameter_shapes` (no model built)."""
    return sum(math.prod(shape) for shape, _ in config.parameter_shapes().values())


def fsdp_padded_numel(config: Any, shard: int) -> int:
    """Elements of a drafter's parameters as FSDP2 lays them out unsharded over `shard` ranks: each parameter's
    dim 0 padded to a multiple of `shard` (the all-gather output and the reduce-scatter input have this size)."""
    return sum(-(-shape[0] // shard) * shard * math.prod(shape[1:]) for shape, _ in config.parameter_shapes().values())


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
    from eagle3_zoo.recipe.decisions import fsdp_drafter_dtypes

    pdt, rdt = fsdp_drafter_dtypes(precision) or (stored_dtype(precision),) * 2
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


def tau_eval_lines(recipe: Recipe, target_config: Any, dcfg: Any, n_drafter: int, gathers: bool) -> list[PlanLine]:
    """The transient buffers of one tau evaluation (`TauEvalCallback.measure`, between training steps).

    Under FSDP every rank gathers the drafter into a plain copy in the parameters' stored dtype
    (`sharded.unsharded_drafter`; fp32 under bf16-mixed); under ddp/auto the drafter decodes in place. Then one
    prompt at a time (freed before the next): the target's and the drafter's KV caches over the prompt,
    `max_new_tokens` and the draft tree, the prompt's target pass (one layer's activations, the aux features and
    final hidden it returns) and the drafter's pass over the prompt (at most what a TTT step saves, a causal mask),
    and the fp32 logits rows of the verified path and the drafted frontier. Prompts are bounded by
    `data.max_length` (MT-bench first turns are far shorter)."""
    from eagle3_zoo.values.draft_shapes import TreeSpec

    cfg = recipe.trainer.tau_eval
    # the tree `TauEvalCallback` drafts (its defaults), without importing Lightning for it
    tree = TreeSpec()
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


def plan_recipe(recipe: Recipe, target_config: Any = None, source: str = "recipe") -> MemoryPlan:
    """The per-GPU memory plan of every phase of a recipe's run, from its run plan (`run_plan`).

    Args:
        recipe: a loaded `Recipe`.
        target_config: the target's config (default: the shipped config of `target.name_or_path`, else its
            `config.json` through transformers, which may download it).
        source: the recipe's name in messages.
    """
    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.adapters.shipped import shipped_target_config
    from eagle3_zoo.recipe.decisions import counted_devices, drafter_config, run_plan, trainer_device
    from eagle3_zoo.targets.loading import feature_layer_ids
    from eagle3_zoo.training.planner.phases import hidden_states_phase, regeneration_phase

    t, tr = recipe.target, recipe.trainer
    if target_config is None:  # a shipped target: resolved from the table (no transformers), else by transformers
        target_config = shipped_resolved_config(t.name_or_path) or shipped_target_config(t.name_or_path)
    if target_config is None:
        from eagle3_zoo.checkpoint.check_target import resolve_target_config

        target_config = resolve_target_config(t.name_or_path)
    adapter = get_adapter(target_config.model_type)
    rp = run_plan(recipe)
    counts = target_parameter_counts(target_config, adapter)
    name = recipe.target.name_or_path
    dcfg = drafter_config(recipe.drafter, name, recipe.trainer.precision, target_config,
                          feature_layer_ids(recipe.drafter, name, target_config, adapter))
    quant = (getattr(target_config, "quantization_config", None) or {}).get("quant_method")
    dequant = f"; its {quant} checkpoint dequantised to {t.dtype}" if quant else ""
    counted, assumed = counted_devices(tr.devices, tr.accelerator)
    if assumed:
        logger.warning("%s: %s", source, counted)
    plan = MemoryPlan(source, getattr(target_config, "_name_or_path", "") or t.name_or_path, tr.strategy,
                      rp.world_size, tr.gpu_memory_gb, decisions=_decisions(rp), devices_counted=counted,
                      tau_off="" if rp.tau else "off (trainer.tau_eval.every_n_steps: null)",
                      unit=trainer_device(tr.accelerator))
    kv = kv_elements_per_token(target_config)
    plan.phases = [regeneration_phase(recipe, target_config, counts, kv, dequant),
                   hidden_states_phase(recipe, target_config, counts, kv, dequant)]
    plan.lines = _training_lines(recipe, rp, target_config, dcfg, counts, dequant)
    return plan


def _decisions(rp: RunPlan) -> str:
    """The run plan in one line: what of the target a trainer rank loads, the shard layout, the dtypes."""
    dt = {k: str(v).removeprefix("torch.") for k, v in
          (("t", rp.target_dtype), ("s", rp.drafter_dtype), ("c", rp.compute_dtype))}
    layout = f"FSDP shard group {rp.shard} x {rp.replicas} replica(s)" if rp.strategy == "fsdp" else \
        f"{rp.world_size} data-parallel replica(s)"
    return (f"run plan: the target on each trainer rank: {rp.target_load} ({rp.target_load_reason}), "
            f"{dt['t']}; {layout}; drafter {dt['s']} weights, {dt['c']} matmuls; regeneration: {rp.regeneration}; "
            f"hidden states: {rp.hidden_states}")


def _training_lines(recipe: Recipe, rp: RunPlan, target_config: Any, dcfg: Any, counts: dict[str, int],
                    dequant: str) -> list[PlanLine]:
    """Per trainer GPU during training: the target (as `rp.target_load` says), the drafter and its optimizer, the
    training step's buffers and the tau evaluation's transient."""
    from eagle3_zoo.recipe.decisions import fsdp_drafter_dtypes, trainer_device

    t, tr = recipe.target, recipe.trainer
    tbytes = rp.target_dtype.itemsize
    fsdp, shard, world = tr.strategy == "fsdp", rp.shard, rp.world_size
    n_drafter = drafter_parameter_count(dcfg)
    lines = []
    if rp.target_kept:
        why = "online features" if rp.target_in_step else "tau evaluation during training"
        where = (f"sharded over {shard}" + (f", replicated over {tr.num_nodes} nodes" if shard < world else "")
                 if rp.target_sharded else "a full copy per GPU")
        lines.append(PlanLine("target weights", counts["total"] * tbytes / (shard if rp.target_sharded else 1),
                              f"{counts['total'] / 1e9:.2f}B params in {t.dtype}, {where} ({why}){dequant}"))
        if rp.target_sharded:
            lines.append(PlanLine("target all-gather", 2 * counts["largest_layer"] * tbytes,
                                  "two decoder layers unsharded at a time (prefetch)"))
            if rp.target_load == "whole":  # loaded whole on every rank, then sharded: the load is a phase of its own
                lines.append(PlanLine("whole target before sharding", counts["total"] * tbytes * (1 - 1 / shard),
                                      f"the rest of the target, on every rank until FSDP shards it "
                                      f"({rp.target_load_reason})", "target load"))
    elif rp.target_load == "whole":  # loaded for the data stage (or a LoRA merge), and the run keeps it
        lines.append(PlanLine("target weights", counts["total"] * tbytes,
                              f"{counts['total'] / 1e9:.2f}B params in {t.dtype}, loaded whole "
                              f"({rp.target_load_reason}) and kept; training reads its embedding and lm_head"
                              f"{dequant}"))
    else:
        lines.append(PlanLine("target embed + lm_head", (counts["embed"] + counts["lm_head"]) * tbytes,
                              f"features come from {'the engine (streamed)' if rp.streams else 'the store'}"))
    state = 4 * rp.drafter_dtype.itemsize  # weights + grads + AdamW (m, v), all in the stored dtype
    lines.append(PlanLine("drafter weights+grads+AdamW", n_drafter * state / shard,
                          f"{n_drafter / 1e6:.0f}M params x {state} B{f' / {shard}' if fsdp else ''}"))
    # the step's own buffers, as the kind sizes them (EAGLE-3: the TTT rollout; DFlash: all blocks in one forward)
    sizing = StepSizing(
        compute_dtype=rp.compute_dtype, drafter_dtype=rp.drafter_dtype, target_dtype=rp.target_dtype,
        # the target's dtype when the step runs it, else the feature store's (offline) or the engine's stream
        feature_dtype=rp.target_dtype if rp.target_in_step else torch_dtype(recipe.data.features_dtype),
        target_in_step=rp.target_in_step, on_gpu=trainer_device(tr.accelerator) == "GPU",
        # autocast keeps a compute-dtype copy of each fp32 matmul weight for backward (FSDP's bf16 policy has none)
        autocast_copies=tr.precision.endswith("-mixed") and not (fsdp and fsdp_drafter_dtypes(tr.precision)
                                                                 is not None),
        logits_chunk=LOGITS_CHUNK, batch_size=tr.batch_size, max_length=recipe.data.max_length,
        mixed=tr.precision.endswith("-mixed"), activation_checkpointing=tr.activation_checkpointing,
        ttt_steps=recipe.ttt.steps)
    lines += [PlanLine(line.what, line.bytes, line.note, "training step")
              for line in step_lines(recipe.drafter.kind, recipe.drafter, dcfg, target_config, sizing)]
    return _step_and_tau(lines, recipe, rp, target_config, dcfg, n_drafter)


def _step_and_tau(lines: list[PlanLine], recipe: Recipe, rp: RunPlan, target_config: Any, dcfg: Any,
                  n_drafter: int) -> list[PlanLine]:
    """`lines` + FSDP's drafter buffers, the tau evaluation's transient and the reserve."""
    fsdp = recipe.trainer.strategy == "fsdp"
    if fsdp:
        lines += fsdp_drafter_lines(dcfg, recipe.trainer.precision, rp.shard)
    if rp.tau:
        lines += tau_eval_lines(recipe, target_config, dcfg, n_drafter, gathers=fsdp)
    return [*lines, reserve_line(lines)]
