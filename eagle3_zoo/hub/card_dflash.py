"""The model card of a DFlash drafter folder (either DFlash layout): the packaged `model_card_dflash.md.j2` rendered
from the folder's config and the files training and evaluation leave next to the weights.

The card names the kind (DFlash) and tags it (`dflash`, `speculative-decoding`), gives the serving command with
`"method": "dflash"` (vLLM 0.32 serves a DFlash folder without it as a plain draft model that accepts no token), and
shows acceptance and speed only from `eval_results*.json` measured on these very weights (`card.shared_variables`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from eagle3_zoo.checkpoint.layouts import load_drafter_config
from eagle3_zoo.values import layout_names

TEMPLATE = "model_card_dflash.md.j2"
BASE_TAGS = ("dflash", "speculative-decoding", "draft-model", "eagle3-zoo")


def template_text() -> str:
    """The packaged DFlash card template."""
    return resources.files("eagle3_zoo").joinpath("resources", TEMPLATE).read_text(encoding="utf-8")


def dflash_card_variables(folder: Path, fmt: str, shared: dict[str, Any]) -> dict[str, Any]:
    """The template variables of a DFlash folder's card: `shared` (`card.shared_variables`: names, evaluation rows
    measured on these weights, training and provenance) and the DFlash drafter's own."""
    from eagle3_zoo.values.zoo_registry import target_hub_id

    cfg, _ = load_drafter_config(folder)
    target = cfg.target_name_or_path or shared.get("recipe_target")
    hub_target = target_hub_id(target)
    vocab_note = (f"its own lm_head over a draft vocabulary of {cfg.draft_vocab_size} of the target's "
                  f"{cfg.vocab_size} tokens (d2t map); the target's embedding is used and not saved"
                  if cfg.reduced_vocab else None)
    variables = {
        **shared,
        "target": target, "target_serve": hub_target or target, "target_family": cfg.target_model_type,
        "target_url": f"https://huggingface.co/{hub_target}" if hub_target else "",
        "hidden_size": cfg.hidden_size, "torch_dtype": cfg.torch_dtype, "num_layers": cfg.num_hidden_layers,
        "heads": f"{cfg.num_attention_heads} heads x {cfg.head_dim} ({cfg.num_key_value_heads} key/value)",
        "vocab_note": vocab_note, "block_size": cfg.block_size, "drafted": cfg.block_size - 1,
        "mask_token_id": cfg.mask_token_id,
        "feature_layers": f"the outputs of target decoder layers {list(cfg.target_layer_ids)} of "
                          f"{cfg.num_target_layers} (vLLM aux ids {list(cfg.aux_layer_ids)})",
        "format_description": layout_names.card_info(fmt).description,
        "show_sglang": "sglang" in layout_names.card_info(fmt).engines,
    }
    return {k: v for k, v in variables.items() if v is not None}


def render_dflash_card(drafter_dir: str | Path, fmt: str, shared: dict[str, Any], license: str = "apache-2.0",
                       tags: tuple[str, ...] = (), **overrides: Any) -> ModelCard:
    """The card of a DFlash drafter folder in layout `fmt` (`card.render_card` of the DFlash kind, which passes
    `shared`; `license`, `tags` and `overrides` as there)."""
    from eagle3_zoo.values.zoo_registry import target_hub_id

    variables = {**dflash_card_variables(Path(drafter_dir), fmt, shared), **overrides}
    layout = layout_names.card_info(fmt)
    family = variables.get("target_family")
    data = ModelCardData(
        base_model=target_hub_id(variables.get("target")), library_name="eagle3-zoo", license=license,
        tags=list(dict.fromkeys([*BASE_TAGS, *([family] if family else []), *layout.engines, *layout.card_tags,
                                 *tags])),
    )
    return ModelCard.from_template(data, template_str=template_text(), **variables)
