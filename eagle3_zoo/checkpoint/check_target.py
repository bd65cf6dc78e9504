"""Checks of a drafter against its target's config: sizes, aux layers (range and convention), RoPE, context length.

Aux layer conventions: internally and in vLLM/speculators an id is a HF `output_hidden_states`
index (the residual stream entering decoder layer i, valid 0..N-1); SGLang's `eagle_config` field stores `id - 1`.
An id list equal to the default in the *other* convention is the classic off-by-one, so it is flagged; where each
layout stores the ids, and in which convention, is its own (`Layout.stored_aux_ids`, `aux_convention_problems`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.layouts import Layout
from eagle3_zoo.modeling import Eagle3Config, default_aux_layer_ids


def resolve_target_config(target: Any) -> Any:
    """A target config from a `PretrainedConfig`, a dict, a local folder, a Hub id or the embedded target's name.

    Zoo and recipe targets (and the embedded target) use the config shipped in the package: no network. Other Hub
    ids go through `AutoConfig.from_pretrained(target, trust_remote_code=False)` (config.json only) after the same
    fast check `load_target` makes (one Hub request, no retries; the cache when offline). Multimodal configs resolve
    to their text config.

    Raises:
        TargetNotFoundError: neither a local folder, a shipped config, nor a repo the Hub or the cache has.
    """
    if isinstance(target, (str, Path)):
        from transformers import AutoConfig

        from eagle3_zoo.adapters.loading import resolve_target
        from eagle3_zoo.adapters.shipped import shipped_target_config

        shipped = None if Path(target).expanduser().is_dir() else shipped_target_config(str(target))
        if shipped is not None:
            return shipped
        where, local_only = resolve_target(target)
        target = AutoConfig.from_pretrained(where, trust_remote_code=False, local_files_only=local_only)
    if not isinstance(target, dict) and hasattr(target, "get_text_config"):
        target = target.get_text_config()
    return target


def _get(target: Any, key: str, default: Any = None) -> Any:
    return target.get(key, default) if isinstance(target, dict) else getattr(target, key, default)


def _target_rope(target: Any) -> tuple[float, str]:
    params = _get(target, "rope_parameters") or {}
    scaling = _get(target, "rope_scaling") or {}
    theta = params.get("rope_theta", _get(target, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def target_problems(raw: dict[str, Any], layout: Layout, cfg: Eagle3Config, target: Any, report: CheckReport) -> None:
    """Append the problems of drafter `cfg` (raw config `raw` of `layout`) against `target` to `report`."""
    hidden, vocab, layers = (_get(target, k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if hidden is not None and cfg.target_hidden_size != hidden:
        report.add("HIDDEN_SIZE_MISMATCH", f"the drafter's fc reads {cfg.num_aux_layers} x target_hidden_size="
                   f"{cfg.target_hidden_size} features but the target's hidden size is {hidden}",
                   "use a drafter trained for this target (or the target it was trained for)")
    if hidden is not None and cfg.hidden_size != hidden:
        report.add("EMBED_SIZE_MISMATCH", f"drafter hidden_size={cfg.hidden_size} but it consumes the target's "
                   f"embeddings of width {hidden}", "use a drafter trained for this target")
    if vocab is not None and cfg.vocab_size != vocab:
        report.add("VOCAB_MISMATCH", f"drafter vocab_size={cfg.vocab_size} (d2t/t2d live in it) but the target's "
                   f"vocab is {vocab}: proposed ids are not this target's tokens",
                   "use a drafter trained with this target's tokenizer")
    if layers is not None:
        _aux_problems(raw, layout, cfg, int(layers), report)
    _rope_problems(raw, cfg, target, report)
    target_max = _get(target, "max_position_embeddings")
    if target_max and cfg.max_position_embeddings < target_max:
        report.add("MAX_POSITION", f"drafter max_position_embeddings={cfg.max_position_embeddings} < the target's "
                   f"{target_max}: vLLM caps speculative decoding at the drafter's length",
                   f"raise max_position_embeddings to {target_max} in config.json (RoPE needs no new weights)",
                   "warning")
    model_type = _get(target, "model_type")
    if cfg.target_model_type and model_type and cfg.target_model_type != model_type:
        report.add("TARGET_FAMILY_MISMATCH", f"trained for a '{cfg.target_model_type}' target, checked against a "
                   f"'{model_type}' one", "double-check the target", "warning")


def _aux_problems(raw: dict[str, Any], layout: Layout, cfg: Eagle3Config, n: int, report: CheckReport) -> None:
    ids = cfg.aux_layer_ids
    if ids is None:
        return  # loaders use their default (2, N//2, N-3): the eagle3-zoo default too
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        stored = layout.stored_aux_ids(raw)
        report.add("AUX_LAYER_OUT_OF_RANGE", f"aux layers {list(ids)} (HF hidden-state indices; stored as {stored}) "
                   f"include {bad}, outside 0..{n - 1} for a {n}-layer target: the engine never captures them",
                   "use a drafter trained for this target, or fix the ids (SGLang field = HF index - 1)")
        return
    if len(ids) != 3:
        report.add("AUX_LAYER_COUNT", f"{len(ids)} aux layers: SGLang's and vLLM's fc expect exactly 3",
                   "serve it with eagle3-zoo only, or train with 3 aux layers", "warning")
    default = tuple(default_aux_layer_ids(n)) if n >= 4 else None
    if default is not None:
        layout.aux_convention_problems(raw, ids, default, report)


def _rope_problems(raw: dict[str, Any], cfg: Eagle3Config, target: Any, report: CheckReport) -> None:
    theta, kind = _target_rope(target)
    if abs(cfg.rope_theta - theta) > 1e-6 * max(theta, 1.0):
        unset = "rope_theta" not in raw and "rope_parameters" not in raw and "transformer_layer_config" not in raw
        origin = "config.json has no rope setting, so loaders use Llama's default 10000" if unset else \
            f"rope_theta={cfg.rope_theta:g}"
        report.add("ROPE_THETA_MISMATCH", f"drafter RoPE base differs from the target's {theta:g} ({origin}); fine "
                   "only if the drafter was trained with this base", "set rope_theta to the base the drafter was "
                   "trained with (eagle3-zoo drafters use the target's)", "warning")
    mine = (cfg.rope_scaling or {}).get("rope_type", "default")
    if mine != kind:
        report.add("ROPE_SCALING_MISMATCH", f"drafter RoPE type '{mine}' vs the target's '{kind}'",
                   "copy the target's rope scaling into the drafter config if it was trained with it", "warning")
