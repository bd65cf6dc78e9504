"""The EAGLE-3 drafter: config, model (TTT + KV-cache paths), attention kernels and draft-vocabulary mapping.

The config imports no torch (reading and checking a drafter's config.json answers at once); the model and vocabulary
names are imported from their modules on first use.
"""

from eagle3_zoo.modeling.config import (
    Eagle3Config,
    default_aux_layer_ids,
    from_sglang_layer_ids,
    to_sglang_layer_ids,
)
from eagle3_zoo.util.lazy import lazy_exports

_LAZY = {**dict.fromkeys(("CONFIG_NAME", "WEIGHTS_NAME", "DraftCache", "DraftStepOutput", "Eagle3Drafter"), "drafter"),
         **dict.fromkeys(("build_draft_vocab", "draft_ids_of", "identity_vocab"), "vocab")}
# `eagle3_zoo.modeling.Eagle3Drafter` and the other names of `_LAZY`: imported on first use (PEP 562)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "DraftCache",
    "DraftStepOutput",
    "Eagle3Config",
    "Eagle3Drafter",
    "build_draft_vocab",
    "default_aux_layer_ids",
    "draft_ids_of",
    "from_sglang_layer_ids",
    "identity_vocab",
    "to_sglang_layer_ids",
]
