"""Checkpoint formats of EAGLE-3 drafters: the canonical keys and shapes, config.json read and checked, the
speculators config written. The layouts themselves (detection, key maps, config translation, writers) are objects in
`eagle3_zoo.checkpoint.layouts`, their names in `eagle3_zoo.values.layout_names`.

Three layouts hold the same weights:

- ``sglang`` (canonical): ``config.json`` with ``architectures: [LlamaForCausalLMEagle3]`` and ``model.safetensors``
  with ``midlayer.*`` keys, as `eagle3_zoo.modeling` writes it. SGLang loads it; vLLM too (it renames
  ``midlayer.`` -> ``layers.0.``). SpecForge checkpoints are this layout, sometimes with a ``model.`` prefix and the
  frozen ``embed_tokens.weight``.
- ``official``: the yuhuili/EAGLE3-* releases: ``pytorch_model.bin``, ``architectures: [LlamaForCausalLM]``, no
  rope setting (Llama's base 10000), maybe ``embed_tokens.weight``.
- ``speculators``: vLLM's format: ``speculators_model_type: eagle3``, a nested ``transformer_layer_config``, aux
  layer ids in the top-level ``eagle_aux_hidden_state_layer_ids`` (HF hidden-state indices = our internal ids),
  ``layers.0.*`` keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from eagle3_zoo.checkpoint.weights import inside_folder
from eagle3_zoo.modeling import Eagle3Config
from eagle3_zoo.values import layout_names

FORMATS = (*layout_names.BUILT_IN, *layout_names.DFLASH_BUILT_IN)  # the built-in layouts, EAGLE-3 then DFlash
EXPORT_FORMATS = layout_names.export_names()  # name or alias -> built-in layout written (`layout_names.export_names()`)
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"

_LAYER_KEYS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
CANONICAL_KEYS = ("fc.weight", *(f"midlayer.{k}" for k in _LAYER_KEYS), "norm.weight", "lm_head.weight", "d2t", "t2d")
FC_NORM_KEY = "fc_norm.{}.weight"  # EAGLE-3.1: one RMSNorm per aux hidden state (vLLM loads it as model.fc_norm.{i})

# wrappers some trainers save under (SpecForge / HF PreTrainedModel); both loaders also accept the bare names
STRIPPED_PREFIXES = ("model.",)
# tensors a checkpoint may carry that are never part of the drafter: the frozen target embedding, speculators'
# frozen verifier copies used only for its training loss
DROPPED_KEYS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
# norm variants vLLM reads from a drafter config; a canonical EAGLE-3 drafter has none of them on
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
EAGLE31_FLAGS = ("fc_norm", "norm_output")  # EAGLE-3.1: eagle3-zoo trains, reads and writes these
# variants that change the forward pass in ways eagle3-zoo does not implement (speculators' training defaults)
NON_CANONICAL_FLAGS = ("norm_before_residual", "norm_before_fc", "attention_bias", "mlp_bias")

LAYER_CONFIG_KEYS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
    "rms_norm_eps", "max_position_embeddings", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
)


# files next to the weights that travel with every export and publish: the resolved recipe, provenance, eval results
EXTRA_FILES = ("recipe.yaml", "provenance.json", "eval_results.json")
EXTRA_GLOBS = ("eval_results_*.json", "*.png")  # more eval runs (other draft shapes), per-depth plots


def extra_candidates(folder: str | Path) -> list[Path]:
    """Recipe, provenance, eval results and plots present in a drafter folder (links not yet checked)."""
    folder = Path(folder)
    found = [folder / n for n in EXTRA_FILES if (folder / n).is_file()]
    for pattern in EXTRA_GLOBS:
        found += sorted(p for p in folder.glob(pattern) if p.is_file())
    return found


class NonCanonicalDrafterError(ValueError):
    """A speculators checkpoint using a training variant that changes the EAGLE-3 forward pass."""


def read_config(folder: str | Path) -> dict[str, Any]:
    """The raw config.json dict of a drafter folder.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: not valid JSON / not an object.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{Path(folder)}: no config.json; not a drafter checkpoint folder")
    inside_folder(folder, path)
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte offset {e.start}); expected a JSON config") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def canonical_keys(cfg: Eagle3Config) -> tuple[str, ...]:
    """The canonical tensor names of a drafter with this config (EAGLE-3.1's `fc_norm` adds one weight per aux
    hidden state)."""
    fc_norm = tuple(FC_NORM_KEY.format(i) for i in range(cfg.num_aux_layers)) if cfg.fc_norm else ()
    return (*CANONICAL_KEYS[:1], *fc_norm, *CANONICAL_KEYS[1:])


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every canonical tensor for a drafter config (what SGLang and vLLM allocate)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = {
        "input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
        "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
    }
    return {
        "fc.weight": (h, cfg.num_aux_layers * cfg.target_hidden_size),
        **{FC_NORM_KEY.format(i): (cfg.target_hidden_size,) for i in range(cfg.num_aux_layers) if cfg.fc_norm},
        **{f"midlayer.{k}": v for k, v in layer.items()},
        "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
    }


def refuse_unsupported_variants(raw: dict[str, Any], fmt: str, source: str) -> None:
    """Raise `NonCanonicalDrafterError` for a norm/bias variant that vLLM would run and eagle3-zoo cannot.

    vLLM reads `norm_before_fc` from `eagle_config` too, and every flag from the top level of any layout; a
    speculators config may also carry them in its `transformer_layer_config`.
    """
    places = [raw, raw.get("eagle_config") or {}, raw.get("transformer_layer_config") or {}]
    on = [k for k in NON_CANONICAL_FLAGS if any(isinstance(p, dict) and p.get(k) for p in places)]
    if on:
        flags = ", ".join(f"{k}=true" for k in on)
        raise NonCanonicalDrafterError(f"{source}: {fmt} drafter with {flags}: a forward pass that is neither "
                                       "EAGLE-3 nor EAGLE-3.1 (fc_norm / norm_output); eagle3-zoo cannot represent "
                                       "it (vLLM can still serve it as is)")


def target_architectures(model_type: str | None) -> list[str]:
    """HF causal-LM class of a target `model_type` (transformers' own auto mapping; empty if unknown)."""
    if not model_type:
        return []
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [name] if name else []


def verifier_resolvable(name: str) -> bool:
    """Whether speculators can resolve a verifier name: a Hub id (ORG/NAME) or an existing local folder."""
    return Path(name).is_dir() or bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name))


def speculators_verifier(target_name_or_path: str | None, verifier: str | None, what: str) -> str:
    """The `speculators_config.verifier.name_or_path` of a speculators config.json: `verifier`, else the drafter's
    target (a zoo alias such as "smollm2-135m-instruct" mapped to its Hub id). `what`: "format" or "layout", for the
    message.

    Raises:
        ValueError: no target recorded and no `verifier`, or a name speculators cannot resolve (neither a Hub id nor
            a local folder).
    """
    from eagle3_zoo.values.zoo_registry import target_hub_id

    name = verifier or target_hub_id(target_name_or_path) or target_name_or_path
    if not name:
        raise ValueError(f"the speculators {what} names the target (speculators_config.verifier.name_or_path), but "
                         "this drafter's config has no target_name_or_path; pass --verifier HUB_ID_OR_FOLDER")
    if not verifier_resolvable(name):
        raise ValueError(f"speculators could not resolve the verifier {name!r} (neither a Hub id ORG/NAME nor a local "
                         "folder here); pass --verifier with the target's Hub id or its local folder")
    return name


def speculators_config(
    cfg: Eagle3Config, num_speculative_tokens: int = 3, verifier_architectures: list[str] | None = None,
    verifier: str | None = None,
) -> dict[str, Any]:
    """config.json of the speculators export (the schema vLLM's speculators loader validates).

    `verifier` (default: the drafter's target, a zoo alias such as "smollm2-135m-instruct" mapped to its Hub id) is
    written as `speculators_config.verifier.name_or_path`, which speculators resolves as a Hub id or local folder.

    Raises:
        ValueError: the drafter does not record its target, or the verifier is neither a Hub id nor a local folder.
    """
    name = speculators_verifier(cfg.target_name_or_path, verifier, "format")
    canon = cfg.to_json_dict()
    layer = {k: canon[k] for k in (*LAYER_CONFIG_KEYS, "attention_bias", "tie_word_embeddings", "torch_dtype")}
    layer.update(model_type="llama", num_hidden_layers=1, mlp_bias=False)
    out: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM's speculators loader defaults norm_before_residual to True when absent: always write every flag
        **{flag: bool(getattr(cfg, flag, False)) for flag in NORM_FLAGS},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": name,
                "architectures": verifier_architectures or target_architectures(cfg.target_model_type),
            },
        },
        "torch_dtype": cfg.torch_dtype,
        "eagle3_zoo": {**canon["eagle3_zoo"], "aux_layer_ids_convention":
                       "eagle_aux_hidden_state_layer_ids = HF hidden_states index (vLLM / speculators convention)"},
    }
    if cfg.aux_layer_ids is not None:  # speculators/vLLM count HF hidden-state indices, as we do internally
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return out
