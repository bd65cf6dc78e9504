"""Lossless greedy speculative decoding with a DSpark drafter, batch size 1: `DFlashGenerator`'s cycle (draft a
block, verify the chain in one target forward, keep the accepted prefix and the bonus, append the verified positions'
features to the persistent draft context cache) with DSpark's proposer.

The proposer drafts a block as vLLM 0.32's DSpark proposer does with greedy drafting: ONE backbone forward over
`[anchor, MASK x (B-1)]` at positions P..P+B-1 against the cached context (`DFlashContextCache`), then the Markov
stage left to right: slot k's logits are its base logits plus `markov_w2(markov_w1[prev])`, prev = the anchor for
slot 0 and the token drafted at slot k-1 after that; the draft is the argmax, mapped to a target id. A block drafts
B tokens (slot k predicts position P+k+1). With a confidence head each drafted token's confidence
(sigmoid of `confidence_head`) is recorded (`DSparkProposer.confidence`, one list per cycle); it does not change what
is drafted or verified.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from eagle3_zoo.adapters import TargetAdapter, adapter_for
from eagle3_zoo.drafters.dspark.decoding import DSparkProposer
from eagle3_zoo.drafters.dspark.model import DSparkDrafter
from eagle3_zoo.speculative.dflash_decode import DFlashGenerator, _check_fits

__all__ = ["DSparkGenerator", "DSparkProposer"]


class DSparkGenerator(DFlashGenerator):
    """Greedy speculative decoding of a Hugging Face causal LM with a DSpark drafter (`DFlashGenerator` with a
    `DSparkProposer`; `generate` and `measure` are the DFlash ones).

    Args:
        target: The target ``*ForCausalLM`` (frozen, eval mode, sdpa or eager attention).
        drafter: The `DSparkDrafter`.
        adapter: The target's adapter; default ``adapter_for(target)``.
        layer_ids: Feature layers (internal convention); default the config's ``aux_layer_ids`` (a negative control
            may pass others).
    """

    def __init__(self, target: nn.Module, drafter: DSparkDrafter, adapter: TargetAdapter | None = None,
                 layer_ids: Sequence[int] | None = None):
        if not isinstance(drafter, DSparkDrafter):
            raise TypeError(f"DSparkGenerator needs a DSparkDrafter, got {type(drafter).__name__}")
        adapter = adapter or adapter_for(target)
        _check_fits(drafter, target, adapter)
        head = None if drafter.config.reduced_vocab else adapter.lm_head(target).weight
        proposer = DSparkProposer(drafter, adapter.embed_tokens(target).weight, head)
        super().__init__(target, proposer, adapter, layer_ids or drafter.config.aux_layer_ids)
