"""``lk_hybrid``: lambda * KL(p || q) + (1 - lambda) * (1 - alpha) with lambda = exp(-eta * alpha) per position and
alpha not differentiated inside lambda (the LK losses, arXiv 2602.23881, as vLLM speculators' `lk_hybrid` reads
them; SpecForge's `lambda` mode takes lambda from the step's mean alpha instead). KL's gradient is soft_ce's,
q - p; the TV part's is -(d alpha / dz)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3_zoo.losses.base import Loss, register_loss
from eagle3_zoo.util.schema import GT0, ruled

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.losses.chunk import Chunk, ChunkObjective, ReferenceTerms


@dataclass
class LKHybridParams:
    eta: float = ruled(3.0, GT0)  # lambda = exp(-eta * alpha): larger moves from KL to TV at a lower acceptance
    # (speculators' default)


@register_loss("lk_hybrid")
class LKHybrid(Loss):
    Params = LKHybridParams

    def chunk(self, c: Chunk) -> ChunkObjective:
        import torch

        a = c.acceptance_terms()
        lam = torch.exp(-self.params.eta * a.alpha)
        kl = c.ce + torch.xlogy(c.p, c.p).sum(-1)  # cross-entropy - entropy(p)
        grad = c.q.sub_(c.p).mul_(lam[:, None]).add_(a.grad.mul_((lam - 1.0)[:, None]))
        return c.result(lam * kl + (1.0 - lam) * (1.0 - a.alpha), a.reported, grad)

    def reference(self, r: ReferenceTerms) -> torch.Tensor:
        import torch

        lam = torch.exp(-self.params.eta * r.alpha.detach())
        kl = (torch.xlogy(r.p, r.p) - r.p * r.logq).sum(-1)
        return lam * kl + (1.0 - lam) * (1.0 - r.alpha)
