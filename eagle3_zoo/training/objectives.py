"""The per-position objectives of a TTT step: each one's value and logits gradient for a chunk of rows (what the
fused lm_head loss in `training.loss` runs), and the naive autograd formulation every one is tested against.

With draft logits z, q = softmax(z) and the target's distribution over the draft vocabulary p (renormalised,
rows summing to 1), the acceptance of a drafted token is alpha(p, q) = sum_v min(p_v, q_v) = 1 - TV(p, q):

- ``soft_ce``: EAGLE-3's soft cross-entropy -sum_v p_v log q_v; d/dz = q - p.
- ``tv``: the acceptance loss 1 - alpha (total variation); d alpha / dz_j = q_j (s_j - S), s_v = [q_v < p_v],
  S = sum_v s_v q_v.
- ``neg_log_alpha``: -log max(alpha, eps) (the LK "alpha" loss); its gradient is the TV gradient over alpha.
- ``lk_hybrid``: lambda * KL(p || q) + (1 - lambda) * (1 - alpha) with lambda = exp(-eta * alpha) per position and
  alpha not differentiated inside lambda (the LK losses, arXiv 2602.23881, as vLLM speculators' `lk_hybrid` reads
  them; SpecForge's `lambda` mode takes lambda from the step's mean alpha instead). KL's gradient is soft_ce's.

The losses use the renormalised p, whose unique optimum q = p is also the cross-entropy's (SpecForge computes its
acceptance terms on the unnormalised target probabilities instead, which leaves the loss flat once q >= m p). The
*reported* alpha is the expected acceptance of sampling the draft against the full target distribution,
sum_v min(m p_v, q_v), where m is the target's probability mass on the draft vocabulary (the draft can never
propose the rest; m = 1 when unknown): the per-token rate tau is made of at temperature 1.

All in fp32; every gradient entry is at most 2 in magnitude (the fused loss casts it to fp16/bf16). Ties
q_v == p_v get no TV gradient (they have measure zero except where both are 0, where q's own derivative vanishes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

OBJECTIVES = ("soft_ce", "tv", "neg_log_alpha", "lk_hybrid")
NLA_EPS = 1e-5  # alpha floor of neg_log_alpha (speculators' value): below it the loss is flat, its gradient 0
DEFAULT_ETA = 3.0  # lk_hybrid's lambda = exp(-eta * alpha) (the value speculators ships as its default)


ALPHA_BLOCK = 128  # rows per block of the reported alpha: its temporaries stay [128, Vd], not [chunk, Vd]


class ChunkObjective(NamedTuple):
    loss: torch.Tensor  # [n] fp32 per-row objective
    alpha: torch.Tensor | None  # [n] fp32 expected acceptance against the full target (no gradient); None unasked
    grad: torch.Tensor  # [n, Vd] fp32 d loss / d logits (the logits buffer, overwritten)
    argmax: torch.Tensor  # [n] int64 the draft's top token


def check_objective(name: str) -> None:
    """Raise a ValueError naming the valid objectives when `name` is not one."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown TTT loss {name!r}; valid: {', '.join(OBJECTIVES)}; to add a loss see "
                         "docs/contributing/adding-a-loss.md")


def chunk_objective(logits: torch.Tensor, p: torch.Tensor, name: str = "soft_ce", mass: torch.Tensor | None = None,
                    eta: float = DEFAULT_ETA, report: bool = True) -> ChunkObjective:
    """Per-row objective, acceptance and logits gradient of one chunk; `logits` (fp32) is overwritten in place.

    One softmax pass (row max, exp, normalise in place), a batched row dot for p . z, and for the acceptance
    losses one comparison mask: no log-softmax tensor is formed.

    Args:
        logits: `[n, Vd]` fp32 draft logits (consumed: it holds the gradient on return).
        p: `[n, Vd]` fp32 target distribution over the draft vocabulary (rows sum to 1).
        name: one of `OBJECTIVES`.
        mass: `[n]` target probability mass on the draft vocabulary, for the reported alpha (None = 1).
        eta: lk_hybrid's lambda = exp(-eta * alpha).
        report: compute the reported alpha (a metric: for soft_ce two more passes over `[n, Vd]`, which a training
            step that logs nothing skips); False returns alpha None.
    """
    check_objective(name)
    row_max, argmax = logits.max(-1)
    dot = torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # sum_v p_v z_v
    q = logits.sub_(row_max[:, None]).exp_()
    denom = q.sum(-1)
    q.div_(denom[:, None])
    ce = row_max + denom.log() - dot  # logsumexp(z) - p . z = -sum_v p_v log q_v
    if name == "soft_ce":
        return ChunkObjective(ce, _acceptance(q, p, mass) if report else None, q.sub_(p), argmax)
    alpha = torch.minimum(q, p).sum(-1)
    reported = alpha if mass is None else _acceptance(q, p, mass) if report else None
    g_alpha = q * (q < p)  # s * q
    g_alpha.addcmul_(q, g_alpha.sum(-1, keepdim=True), value=-1.0)  # q * (s - S) = d alpha / dz
    if name == "tv":
        return ChunkObjective(1.0 - alpha, reported, g_alpha.neg_(), argmax)
    if name == "neg_log_alpha":
        floor = alpha.clamp_min(NLA_EPS)
        scale = torch.where(alpha > NLA_EPS, -1.0 / floor, torch.zeros_like(floor))
        return ChunkObjective(-floor.log(), reported, g_alpha.mul_(scale[:, None]), argmax)
    lam = torch.exp(-eta * alpha)  # lk_hybrid
    kl = ce + torch.xlogy(p, p).sum(-1)  # cross-entropy - entropy(p)
    grad = q.sub_(p).mul_(lam[:, None]).add_(g_alpha.mul_((lam - 1.0)[:, None]))
    return ChunkObjective(lam * kl + (1.0 - lam) * (1.0 - alpha), reported, grad, argmax)


def _acceptance(q: torch.Tensor, p: torch.Tensor, mass: torch.Tensor | None) -> torch.Tensor:
    """`[n]` sum_v min(q_v, m p_v) in blocks of `ALPHA_BLOCK` rows (one `[n, Vd]` temporary per operand was the
    fused loss's peak memory)."""
    out = torch.empty(q.shape[0], dtype=q.dtype, device=q.device)
    for i in range(0, q.shape[0], ALPHA_BLOCK):
        rows = slice(i, i + ALPHA_BLOCK)
        out[rows] = torch.minimum(q[rows], p[rows] if mass is None else p[rows] * mass[rows, None]).sum(-1)
    return out


def reference_objective(logits: torch.Tensor, p: torch.Tensor, name: str = "soft_ce", mass: torch.Tensor | None = None,
                        eta: float = DEFAULT_ETA) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive formulation: autograd through log_softmax / minimum over full `[n, Vd]` tensors.

    Returns:
        (`[n]` per-row objective, differentiable w.r.t. `logits`; `[n]` reported alpha, detached).
    """
    check_objective(name)
    logq = torch.log_softmax(logits.float(), -1)
    q = logq.exp()
    p = p.float()
    alpha = torch.minimum(q, p).sum(-1)
    reported = alpha if mass is None else torch.minimum(q, p * mass.float()[:, None]).sum(-1)
    ce = -(p * logq).sum(-1)
    if name == "soft_ce":
        loss = ce
    elif name == "tv":
        loss = 1.0 - alpha
    elif name == "neg_log_alpha":
        loss = -torch.log(alpha.clamp_min(NLA_EPS))
    else:
        lam = torch.exp(-eta * alpha.detach())
        kl = (torch.xlogy(p, p) - p * logq).sum(-1)
        loss = lam * kl + (1.0 - lam) * (1.0 - alpha)
    return loss, reported.detach()
