"""The EAGLE-3 drafter: config, model (TTT + KV-cache paths), attention kernels and draft-vocabulary mapping."""

from eagle3_zoo.modeling.config import (
    Eagle3Config,
    default_aux_layer_ids,
    from_sglang_layer_ids,
    to_sglang_layer_ids,
)
from eagle3_zoo.modeling.drafter import CONFIG_NAME, WEIGHTS_NAME, DraftCache, DraftStepOutput, Eagle3Drafter
from eagle3_zoo.modeling.vocab import build_draft_vocab, draft_ids_of, identity_vocab

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
