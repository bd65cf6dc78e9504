"""``neg_log_alpha``: -log max(alpha, eps) (the LK "alpha" loss); its gradient is the TV gradient over alpha, 0 where
alpha is below the floor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_zoo.losses.base import Loss, register_loss

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.losses.chunk import Chunk, ChunkObjective, ReferenceTerms

EPS = 1e-5  # alpha floor (speculators' value): below it the loss is flat, its gradient 0


@register_loss("neg_log_alpha")
class NegLogAlpha(Loss):
    def chunk(self, c: Chunk) -> ChunkObjective:
        import torch

        a = c.acceptance_terms()
        floor = a.alpha.clamp_min(EPS)
        scale = torch.where(a.alpha > EPS, -1.0 / floor, torch.zeros_like(floor))
        return c.result(-floor.log(), a.reported, a.grad.mul_(scale[:, None]))

    def reference(self, r: ReferenceTerms) -> torch.Tensor:
        import torch

        return -torch.log(r.alpha.clamp_min(EPS))
