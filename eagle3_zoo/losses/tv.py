"""``tv``: the acceptance loss 1 - alpha (total variation between p and q); d/dz = -d alpha / dz."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_zoo.losses.base import Loss, register_loss

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.losses.chunk import Chunk, ChunkObjective, ReferenceTerms


@register_loss("tv")
class TotalVariation(Loss):
    def chunk(self, c: Chunk) -> ChunkObjective:
        a = c.acceptance_terms()
        return c.result(1.0 - a.alpha, a.reported, a.grad.neg_())

    def reference(self, r: ReferenceTerms) -> torch.Tensor:
        return 1.0 - r.alpha
