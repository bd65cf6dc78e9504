"""The tensor pass every loss shares: one softmax over a chunk of rows of draft logits (what the fused lm_head loss
in `drafters.eagle3.ttt` runs per chunk) and the acceptance terms, handed to the loss's own `chunk`; and the naive
autograd formulation every loss is tested against (`reference_objective`).

With draft logits z, q = softmax(z) and the target's distribution over the draft vocabulary p (renormalised, rows
summing to 1), the acceptance of a drafted token is alpha(p, q) = sum_v min(p_v, q_v) = 1 - TV(p, q), and
d alpha / dz_j = q_j (s_j - S) with s_v = [q_v < p_v], S = sum_v s_v q_v.

The losses use the renormalised p, whose unique optimum q = p is also the cross-entropy's (SpecForge computes its
acceptance terms on the unnormalised target probabilities instead, which leaves the loss flat once q >= m p). The
*reported* alpha is the expected acceptance of sampling the draft against the full target distribution,
sum_v min(m p_v, q_v), where m is the target's probability mass on the draft vocabulary (the draft can never
propose the rest; m = 1 when unknown): the per-token rate tau is made of at temperature 1.

All in fp32; every gradient entry is at most 2 in magnitude (the fused loss casts it to fp16/bf16). Ties
q_v == p_v get no TV gradient (they have measure zero except where both are 0, where q's own derivative vanishes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from eagle3_zoo.losses.base import Loss, make_loss

ALPHA_BLOCK = 128  # rows per block of the reported alpha: its temporaries stay [128, Vd], not [chunk, Vd]


class ChunkObjective(NamedTuple):
    loss: torch.Tensor  # [n] fp32 per-row objective
    alpha: torch.Tensor | None  # [n] fp32 expected acceptance against the full target (no gradient); None unasked
    grad: torch.Tensor  # [n, Vd] fp32 d loss / d logits (the logits buffer, overwritten)
    argmax: torch.Tensor  # [n] int64 the draft's top token


class AcceptanceTerms(NamedTuple):
    alpha: torch.Tensor  # [n] sum_v min(p_v, q_v) against the renormalised p (what the acceptance losses train)
    reported: torch.Tensor | None  # [n] the reported alpha (`Chunk.report`; with no mass: `alpha` itself)
    grad: torch.Tensor  # [n, Vd] d alpha / dz (a new buffer: `Chunk.q` is left as it is)


@dataclass
class Chunk:
    """A chunk of rows after the shared softmax pass: what a loss's `chunk` computes its value and gradient from."""

    q: torch.Tensor  # [n, Vd] fp32 softmax(z), in the logits buffer (a loss may write its gradient into it)
    p: torch.Tensor  # [n, Vd] fp32 target distribution over the draft vocabulary
    ce: torch.Tensor  # [n] the soft cross-entropy -sum_v p_v log q_v (= logsumexp(z) - p . z)
    argmax: torch.Tensor  # [n] the draft's top token
    mass: torch.Tensor | None  # [n] target probability mass on the draft vocabulary (None = 1)
    report: bool  # whether the reported alpha is asked for (a metric; a step that logs nothing skips it)

    def acceptance(self) -> torch.Tensor:
        """`[n]` the reported alpha sum_v min(q_v, m p_v), in blocks of `ALPHA_BLOCK` rows (one `[n, Vd]`
        temporary per operand was the fused loss's peak memory)."""
        q, p, mass = self.q, self.p, self.mass
        out = torch.empty(q.shape[0], dtype=q.dtype, device=q.device)
        for i in range(0, q.shape[0], ALPHA_BLOCK):
            rows = slice(i, i + ALPHA_BLOCK)
            out[rows] = torch.minimum(q[rows], p[rows] if mass is None else p[rows] * mass[rows, None]).sum(-1)
        return out

    def acceptance_terms(self) -> AcceptanceTerms:
        """alpha, the reported alpha and d alpha / dz, for the losses built on the acceptance (read `q` first)."""
        q, p = self.q, self.p
        alpha = torch.minimum(q, p).sum(-1)
        reported = alpha if self.mass is None else self.acceptance() if self.report else None
        g_alpha = q * (q < p)  # s * q
        g_alpha.addcmul_(q, g_alpha.sum(-1, keepdim=True), value=-1.0)  # q * (s - S) = d alpha / dz
        return AcceptanceTerms(alpha, reported, g_alpha)

    def result(self, loss: torch.Tensor, alpha: torch.Tensor | None, grad: torch.Tensor) -> ChunkObjective:
        return ChunkObjective(loss, alpha, grad, self.argmax)


class ReferenceTerms(NamedTuple):
    """Full-tensor terms of the naive formulation; `logq` (and what derives from it) carries autograd."""

    logq: torch.Tensor  # [n, Vd] log_softmax(z)
    q: torch.Tensor  # [n, Vd] softmax(z)
    p: torch.Tensor  # [n, Vd] fp32 target distribution
    alpha: torch.Tensor  # [n] sum_v min(p_v, q_v)
    ce: torch.Tensor  # [n] -sum_v p_v log q_v


def as_loss(loss: Loss | str) -> Loss:
    """A `Loss`; a name is the registered loss with its default parameters."""
    return make_loss(loss) if isinstance(loss, str) else loss


def chunk_objective(logits: torch.Tensor, p: torch.Tensor, loss: Loss | str = "soft_ce",
                    mass: torch.Tensor | None = None, report: bool = True) -> ChunkObjective:
    """Per-row objective, acceptance and logits gradient of one chunk; `logits` (fp32) is overwritten in place.

    One softmax pass (row max, exp, normalise in place) and a batched row dot for p . z, shared by every loss; the
    loss forms the rest (`Loss.chunk`): no log-softmax tensor is formed.

    Args:
        logits: `[n, Vd]` fp32 draft logits (consumed: it holds the gradient on return).
        p: `[n, Vd]` fp32 target distribution over the draft vocabulary (rows sum to 1).
        loss: a `Loss` (`eagle3_zoo.losses`), or a registered name with its default parameters.
        mass: `[n]` target probability mass on the draft vocabulary, for the reported alpha (None = 1).
        report: compute the reported alpha (a metric: for soft_ce two more passes over `[n, Vd]`, which a training
            step that logs nothing skips); False may return alpha None.
    """
    loss = as_loss(loss)
    row_max, argmax = logits.max(-1)
    dot = torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # sum_v p_v z_v
    q = logits.sub_(row_max[:, None]).exp_()
    denom = q.sum(-1)
    q.div_(denom[:, None])
    ce = row_max + denom.log() - dot  # logsumexp(z) - p . z = -sum_v p_v log q_v
    return loss.chunk(Chunk(q, p, ce, argmax, mass, report))


def reference_objective(logits: torch.Tensor, p: torch.Tensor, loss: Loss | str = "soft_ce",
                        mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive formulation: autograd through log_softmax / minimum over full `[n, Vd]` tensors.

    Returns:
        (`[n]` per-row objective, differentiable w.r.t. `logits`; `[n]` reported alpha, detached).
    """
    loss = as_loss(loss)
    logq = torch.log_softmax(logits.float(), -1)
    q = logq.exp()
    p = p.float()
    alpha = torch.minimum(q, p).sum(-1)
    reported = alpha if mass is None else torch.minimum(q, p * mass.float()[:, None]).sum(-1)
    ce = -(p * logq).sum(-1)
    return loss.reference(ReferenceTerms(logq, q, p, alpha, ce)), reported.detach()
