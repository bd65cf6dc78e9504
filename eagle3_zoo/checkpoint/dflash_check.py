"""The checks of `eagle3-zoo check` for a DFlash drafter folder (either DFlash layout) or a DSpark one (its `dspark`
layout: the same checks, against vLLM 0.32's `qwen3_dspark.py`, with its Markov and confidence heads), and against
its target.

The config is read into a `DFlashConfig` (which refuses block_size < 2, a mask token outside the vocabulary, target
layer ids outside 0..num_target_layers-1, heads that are no multiple of the KV heads); on top of it: the class and
fields vLLM 0.32 reads, the head size vLLM's CPU attention supports, and the weights: names and shapes exactly those
vLLM 0.32's `qwen3_dflash.py` `load_weights` takes (`DFlashConfig.parameter_shapes`; `lm_head` and an int64 `d2t`
only with a reduced draft vocabulary), no `mask_hidden`, no rotary buffers, no embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.dflash_layouts import SPECULATORS_DFLASH_ARCHITECTURE
from eagle3_zoo.checkpoint.layout_base import Layout
from eagle3_zoo.checkpoint.weights import TensorInfo
from eagle3_zoo.drafters.dflash.config import ARCHITECTURE, DFlashConfig
from eagle3_zoo.drafters.dspark.config import ARCHITECTURE as DSPARK_ARCHITECTURE

# vLLM 0.32 `v1/attention/backends/cpu_attn.py` `CPUAttentionBackend.get_supported_head_sizes()`
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# tensors other DFlash implementations save that vLLM 0.32's loader does not take, and why they are not needed
_FOREIGN = {
    "mask_hidden": "a learned mask embedding (vLLM 0.32's loader refuses it with an assertion: it embeds "
                   "mask_token_id)",
    "rotary_emb": "RoPE frequencies (recomputed from rope_theta)",
    "embed_tokens": "an embedding of the drafter's own, which vLLM would load in place of the target's (the "
                    "DFlashDrafter here embeds with the target's)",
}


def dflash_config_problems(raw: dict[str, Any], layout: Layout, source: str,
                           report: CheckReport) -> DFlashConfig | None:
    """Read `raw` (config.json `source` of a DFlash `layout`) and append its problems; None when it cannot be read."""
    try:
        cfg = layout.read_config(raw, source)
    except ValueError as e:
        report.add("CONFIG_INVALID", str(e), "fix config.json (compare with `eagle3-zoo export DIR --format dflash` "
                   "output)")
        return None
    if layout.kind == "dspark":
        _dspark_problems(raw, cfg, source, report)
    elif layout.speculators_model_type is None:
        _zlab_problems(raw, cfg, source, report)
    else:
        _speculators_problems(raw, cfg, source, report)
    heads = raw.get("num_attention_heads", (raw.get("transformer_layer_config") or {}).get("num_attention_heads"))
    stored_head_dim = raw.get("head_dim", (raw.get("transformer_layer_config") or {}).get("head_dim"))
    if stored_head_dim is None and cfg.hidden_size % cfg.num_attention_heads:
        report.add("HEAD_DIM", f"{source}: no head_dim and hidden_size={cfg.hidden_size} is not a multiple of "
                   f"num_attention_heads={heads}: the engines' head size would truncate",
                   "write head_dim (q_proj rows = num_attention_heads * head_dim)")
    if cfg.head_dim not in CPU_ATTENTION_HEAD_SIZES:
        report.add("CPU_HEAD_DIM", f"{source}: head_dim={cfg.head_dim}: vLLM 0.32's CPU attention supports head "
                   f"sizes {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} only (GPU backends may differ)",
                   "serve it on a GPU, or train the drafter with a supported head_dim", "warning")
    return cfg


def _zlab_problems(raw: dict[str, Any], cfg: DFlashConfig, source: str, report: CheckReport) -> None:
    if raw.get("architectures") != [ARCHITECTURE]:
        report.add("ARCHITECTURE", f"{source}: architectures={raw.get('architectures')!r}; vLLM and SGLang build "
                   f"their DFlash drafter for ['{ARCHITECTURE}'] only", f"set architectures to ['{ARCHITECTURE}']")
    if raw.get("model_type") != "qwen3":
        report.add("MODEL_TYPE", f"{source}: model_type={raw.get('model_type')!r}; the z-lab layout is a Qwen3 config "
                   "(vLLM's DFlash drafter is Qwen3 layers)", "set model_type to 'qwen3'")
    for key in ("block_size", "num_target_layers"):
        if key not in raw:
            report.add("DFLASH_FIELD_MISSING", f"{source}: no {key}; vLLM and SGLang read it from config.json",
                       f"write {key} (`eagle3-zoo export DIR --format dflash`)")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and list(top) != list(cfg.aux_layer_ids):
        report.add("AUX_IDS_CONFLICT", f"{source}: eagle_aux_hidden_state_layer_ids={list(top)} but dflash_config."
                   f"target_layer_ids={list(cfg.target_layer_ids)}: vLLM reads the top-level field first, as "
                   f"hidden-state indices (= target_layer_id + 1 = {list(cfg.aux_layer_ids)})",
                   "remove eagle_aux_hidden_state_layer_ids (dflash_config.target_layer_ids is the z-lab field)")


def _dspark_problems(raw: dict[str, Any], cfg: DFlashConfig, source: str, report: CheckReport) -> None:
    """The z-lab checks with DSpark's architecture and the keys vLLM 0.32's Qwen3 DSpark loader reads at the top
    level, and the engine that can serve it."""
    if raw.get("architectures") != [DSPARK_ARCHITECTURE]:
        report.add("ARCHITECTURE", f"{source}: architectures={raw.get('architectures')!r}; vLLM 0.32 builds its "
                   f"DSpark drafter (qwen3_dspark) for ['{DSPARK_ARCHITECTURE}']",
                   f"set architectures to ['{DSPARK_ARCHITECTURE}']")
    if raw.get("model_type") != "qwen3":
        report.add("MODEL_TYPE", f"{source}: model_type={raw.get('model_type')!r}; a DSpark config is a Qwen3 config "
                   "(vLLM's DSpark drafter is Qwen3 layers)", "set model_type to 'qwen3'")
    for key in ("block_size", "num_target_layers", "sample_from_anchor", "enable_confidence_head",
                "confidence_head_with_markov"):
        if key not in raw:
            report.add("DSPARK_FIELD_MISSING", f"{source}: no {key}; vLLM 0.32's Qwen3 DSpark loader reads it from "
                       "config.json (its defaults differ from what this drafter was trained as)",
                       f"write {key} (`DSparkDrafter.save_pretrained` does)")
    report.add("CPU_ENGINE", f"{source}: vLLM 0.32's CPU build refuses DSpark (Model Runner V1 does not support dspark "
               "speculative decoding; V2 requires Triton, i.e. a GPU): `eval --engine vllm` cannot serve it here",
               "serve it with vLLM on a GPU; measure it here with `eagle3-zoo eval DRAFTER_DIR` (our lossless decoder)",
               "warning")


def _speculators_problems(raw: dict[str, Any], cfg: DFlashConfig, source: str, report: CheckReport) -> None:
    if raw.get("architectures") != [SPECULATORS_DFLASH_ARCHITECTURE]:
        report.add("ARCHITECTURE", f"{source}: architectures={raw.get('architectures')!r}, expected "
                   f"['{SPECULATORS_DFLASH_ARCHITECTURE}'] for a speculators DFlash checkpoint",
                   f"set architectures to ['{SPECULATORS_DFLASH_ARCHITECTURE}']", "warning")
    spec = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), dict) else {}
    methods = spec.get("proposal_methods")
    tokens = methods[0].get("speculative_tokens") if isinstance(methods, list) and methods \
        and isinstance(methods[0], dict) else None
    if tokens is None or not (spec.get("verifier") or {}).get("name_or_path"):
        report.add("SPECULATORS_CONFIG", f"{source}: vLLM's speculators loader requires speculators_config."
                   "proposal_methods[0].speculative_tokens and speculators_config.verifier.name_or_path",
                   "export with `eagle3-zoo export DIR --format speculators`")
    elif not (isinstance(tokens, int) and 1 <= tokens <= cfg.block_size - 1):
        report.add("SPECULATIVE_TOKENS", f"{source}: speculators_config.proposal_methods[0].speculative_tokens="
                   f"{tokens!r}; a block of block_size={cfg.block_size} drafts 1..{cfg.block_size - 1} tokens",
                   f"write a value in 1..{cfg.block_size - 1}")
    if "sliding_window_non_causal" not in raw:
        report.add("NON_CAUSAL_MISSING", f"{source}: no sliding_window_non_causal; vLLM 0.32 defaults it to true "
                   "(bidirectional blocks), other readers may not", "write sliding_window_non_causal: true",
                   "warning")


def dflash_weight_problems(folder: Path, cfg: DFlashConfig, infos: dict[str, TensorInfo], kind: str,
                           report: CheckReport, layout: Layout | None = None) -> None:
    """The weight file's tensors (`infos`, weight-file kind `kind`) against what vLLM 0.32 loads for `cfg` (with the
    loader of `layout`: `qwen3_dflash`, or `qwen3_dspark` for a DSpark folder; None: a DFlash layout)."""
    where = folder / "model.safetensors"
    loader = getattr(layout, "loader", "qwen3_dflash")
    dspark = loader == "qwen3_dspark"
    if kind != "safetensors":
        report.add("WEIGHTS_FORMAT", f"{folder}: {kind} weights; {'DSpark' if dspark else 'DFlash'} folders hold "
                   "model.safetensors", "re-save as safetensors (`eagle3-zoo export DIR --format "
                   f"{'dspark' if dspark else 'dflash'}`)")
        return
    expected = {k: shape for k, (shape, _) in cfg.parameter_shapes().items()}
    if cfg.reduced_vocab:
        expected["d2t"] = (cfg.draft_vocab_size,)
    missing = sorted(set(expected) - set(infos))
    if missing:
        more = " ..." if len(missing) > 8 else ""
        report.add("WEIGHTS_MISSING_KEYS", f"{where}: missing {', '.join(missing[:8])}{more}"
                   f" ({len(missing)} of {len(expected)} tensors vLLM 0.32's {loader} loads for this config)",
                   f"re-export the drafter (`{'DSpark' if dspark else 'DFlash'}Drafter.save_pretrained`), or fix "
                   "num_hidden_layers / draft_vocab_size"
                   + (" / markov_rank / enable_confidence_head" if dspark else "") + " in config.json")
    for name in sorted(set(infos) - set(expected)):
        if name == "t2d" and cfg.reduced_vocab:
            report.add("WEIGHT_IGNORED", f"{where}: t2d is skipped by vLLM 0.32's {loader} loader (d2t alone maps "
                       "draft ids to target ids)", "drop t2d, or leave it: nothing reads it", "warning")
            continue
        if dspark and "mask_embedding" in name:
            report.add("WEIGHT_IGNORED", f"{where}: {name} is skipped by vLLM 0.32's {loader} loader (DSpark embeds "
                       "mask_token_id with the target's embedding)", f"drop {name}, or leave it: nothing reads it",
                       "warning")
            continue
        why = next((w for part, w in _FOREIGN.items() if part in name), None)
        if name in ("lm_head.weight", "d2t"):
            why = f"the full-vocabulary drafter (draft_vocab_size = vocab_size = {cfg.vocab_size}) uses the target's " \
                  "lm_head; vLLM loads lm_head and d2t only with a reduced draft vocabulary"
        report.add("WEIGHT_UNEXPECTED", f"{where}: {name} is not a tensor vLLM 0.32's {loader} loads"
                   f"{f': {why}' if why else ''}", f"drop {name} from the weights (valid names: fc, hidden_norm, "
                   "layers.{i}.*, norm, "
                   + ("markov_head.markov_w1, markov_head.markov_w2, confidence_head.proj (with the confidence "
                      "head), " if dspark else "") + "and lm_head + d2t with a reduced draft vocabulary)")
    for name, shape in expected.items():
        if name in infos and tuple(infos[name].shape) != shape:
            report.add("WEIGHT_SHAPE", f"{where}: {name} has shape {tuple(infos[name].shape)}, expected {shape} for "
                       f"this config (hidden_size={cfg.hidden_size}, heads={cfg.num_attention_heads}x{cfg.head_dim}, "
                       f"kv heads={cfg.num_key_value_heads}, features={cfg.num_features}x{cfg.target_hidden_size})",
                       "the config does not describe these weights: fix config.json or re-export the drafter")
    if "d2t" in infos and "d2t" in expected and infos["d2t"].dtype != "I64":
        report.add("D2T_DTYPE", f"{where}: d2t has dtype {infos['d2t'].dtype}, expected I64 (int64): vLLM copies it "
                   "into a LongTensor", "re-export the drafter (`DFlashDrafter.save_pretrained` writes int64)")


def dflash_d2t_problems(cfg: DFlashConfig, load: Callable[[str], Any], report: CheckReport) -> None:
    """Every draft id of `d2t` maps inside the target vocabulary (`load(name)`: the tensor of that name)."""
    import torch

    d2t = load("d2t").to(torch.int64)
    targets = torch.arange(cfg.draft_vocab_size) + d2t
    bad = ((targets < 0) | (targets >= cfg.vocab_size)).nonzero().flatten()
    if len(bad):
        report.add("D2T_OUT_OF_RANGE", f"{len(bad)} draft ids map outside the target vocabulary 0..{cfg.vocab_size - 1}"
                   f" (d2t[{int(bad[0])}]={int(d2t[bad[0]])})", "rebuild d2t for this target's vocabulary")


def dflash_target_problems(cfg: DFlashConfig, target: Any, report: CheckReport) -> None:
    """Append the problems of DFlash drafter `cfg` against the target config `target` (object or dict)."""
    def get(key: str) -> Any:
        return target.get(key) if isinstance(target, dict) else getattr(target, key, None)

    hidden, vocab, layers = get("hidden_size"), get("vocab_size"), get("num_hidden_layers")
    if hidden is not None and cfg.target_hidden_size != hidden:
        report.add("TARGET_HIDDEN_SIZE", f"target_hidden_size={cfg.target_hidden_size} but the target's hidden_size="
                   f"{hidden}: fc takes {cfg.num_features} x target_hidden_size features", "use the drafter trained "
                   "for this target")
    if hidden is not None and cfg.hidden_size != hidden:
        report.add("TARGET_WIDTH", f"hidden_size={cfg.hidden_size} but the target's hidden_size={hidden}: the drafter "
                   "embeds with the target's embedding and drafts through its lm_head, at the target's width",
                   "use the drafter trained for this target")
    if vocab is not None and cfg.vocab_size != vocab:
        report.add("TARGET_VOCAB", f"vocab_size={cfg.vocab_size} but the target's vocab_size={vocab}: token ids "
                   "(mask_token_id, d2t) index another vocabulary", "use the drafter trained for this target")
    if layers is not None:
        if cfg.num_target_layers != layers:
            report.add("TARGET_LAYERS", f"num_target_layers={cfg.num_target_layers} but the target has {layers} "
                       "decoder layers", "use the drafter trained for this target")
        out = [i for i in cfg.target_layer_ids if i >= layers]
        if out:
            report.add("TARGET_LAYER_IDS", f"target_layer_ids {out} are outside the target's decoder layers "
                       f"0..{layers - 1} (0-based layer outputs)", "use the drafter trained for this target")
