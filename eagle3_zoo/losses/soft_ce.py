"""``soft_ce``: EAGLE-3's soft cross-entropy -sum_v p_v log q_v (the default); d/dz = q - p."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_zoo.losses.base import Loss, register_loss

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.losses.chunk import Chunk, ChunkObjective, ReferenceTerms


@register_loss("soft_ce")
class SoftCrossEntropy(Loss):
    def chunk(self, c: Chunk) -> ChunkObjective:
        return c.result(c.ce, c.acceptance() if c.report else None, c.q.sub_(c.p))

    def reference(self, r: ReferenceTerms) -> torch.Tensor:
        return r.ce
