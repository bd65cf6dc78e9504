"""The config of a fresh EAGLE-3 drafter from the recipe's `drafter` section and the target's config
(`Eagle3Kind.config_from`). Imports no torch: `plan` builds it without the kind's model code (`config_from` of
`eagle3_zoo.drafters`)."""

from __future__ import annotations

from typing import Any

from eagle3_zoo.modeling.config import Eagle3Config

# the recipe's drafter-shape fields (null: the target family's published-drafter shape, else the target's)
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def config_from(section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                defaults: dict[str, Any], target_name: str, torch_dtype: str) -> Eagle3Config:
    """An `Eagle3Config` sized like the target: the family's published-drafter shape (`defaults`), then the
    section's non-null shape fields on top; its draft vocabulary size and EAGLE-3.1 flags from the section."""
    overrides = {k: defaults[k] for k in SHAPE_FIELDS if k in defaults}
    overrides.update({k: getattr(section, k) for k in SHAPE_FIELDS if getattr(section, k) is not None})
    return Eagle3Config.from_target_config(
        target_config, draft_vocab_size=section.draft_vocab_size, aux_layer_ids=aux_layer_ids,
        target_name_or_path=target_name, torch_dtype=torch_dtype, fc_norm=section.fc_norm,
        norm_output=section.norm_output, **overrides)
