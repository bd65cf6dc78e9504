"""The EAGLE-3 Training-Time-Test loss: a pure function of (drafter, batch, steps), tested without a Trainer.

At TTT step k, position t reads the drafter's own step k-1 output at t (target features at step 0), the embedding
of the ground-truth token x_{t+1+k}, and is trained towards the target's distribution at t+1+k (which predicts
x_{t+2+k}), masked by the supervision mask of that predicted token. Positions whose full-vocab target argmax is
not in the draft vocabulary are excluded. Each step's loss is normalised by its number of supervised positions.

The soft cross-entropy over the draft vocabulary is fused with the lm_head and computed only on supervised rows,
in chunks, with its gradients formed in the forward pass: no [T, draft_vocab] logits are kept for backward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TTTLossOutput:
    loss: torch.Tensor  # scalar, sum_k w_k * loss_k (differentiable)
    step_losses: torch.Tensor  # [K] detached
    step_acc: torch.Tensor  # [K] fraction of supervised positions where draft argmax == target argmax
    num_supervised: torch.Tensor  # [K] int64


def default_step_weights(steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3's weights w_k = decay**k."""
    return [decay**k for k in range(steps)]


def target_distribution(
    target_logits: torch.Tensor, t2d: torch.Tensor, target_valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft targets over the draft vocabulary (fp32, renormalised) and the mask of usable positions.

    Args:
        target_logits: `[B, T, V]` over the target vocab, or `[B, T, Vd]` already restricted to the draft vocab.
        t2d: `[V]` bool draft-vocab membership.
        target_valid: with draft-vocab logits, `[B, T]` bool "full-vocab argmax is in the draft vocab".
    """
    vocab, draft_vocab = t2d.numel(), int(t2d.sum())
    if target_logits.shape[-1] == vocab and vocab != draft_vocab:
        valid = t2d[target_logits.argmax(-1)]
        target_logits = target_logits[..., t2d]
    elif target_logits.shape[-1] == draft_vocab:
        valid = target_valid if target_valid is not None else torch.ones(target_logits.shape[:-1], dtype=torch.bool,
                                                                           device=target_logits.device)
    else:
        raise ValueError(f"target_logits last dim {target_logits.shape[-1]} is neither the target vocab ({vocab}) "
                         f"nor the draft vocab ({draft_vocab})")
    return torch.softmax(target_logits.float(), dim=-1), valid.to(torch.bool)


class _FusedSoftCE(torch.autograd.Function):
    """sum_rows -(p * log_softmax(h @ W.T)).sum(-1) with grads computed chunk-wise in forward.

    Per chunk: one pass for the row max and argmax, a batched row-dot for p . logits, in-place exp / normalise to
    the softmax and in-place `softmax - p` (the logits gradient, since p rows sum to 1): no log-softmax tensor.
    """

    @staticmethod
    def forward(ctx, h, weight, p, rows, target_ids, chunk: int):
        w = weight.float()
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        grad_w = None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        for i in range(0, h.shape[0], chunk):
            hc = h[i : i + chunk].float()
            idx = None if rows is None else rows[i : i + chunk]
            pc = p[i : i + chunk] if idx is None else p.index_select(0, idx)  # gathered per chunk, never [N, Vd]
            tc = pc.argmax(-1) if target_ids is None else (target_ids[i : i + chunk] if idx is None
                                                            else target_ids.index_select(0, idx))
            logits = hc @ w.t()
            row_max, arg = logits.max(-1)
            dot = torch.bmm(pc.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # sum_v p * logits, per row
            probs = logits.sub_(row_max[:, None]).exp_()
            denom = probs.sum(-1)
            loss += (row_max + denom.log() - dot).sum()  # -sum p*log_softmax = logsumexp - p.logits
            correct += (arg == tc).sum()
            g = probs.div_(denom[:, None]).sub_(pc)  # d loss / d logits
            grad_h[i : i + chunk] = g @ w
            if weight.requires_grad:
                grad_w = g.t() @ hc if grad_w is None else grad_w.addmm_(g.t(), hc)
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct=None):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gh = grad_h.mul_(grad_loss).to(h_dtype)  # saved grads are used once: scale in place
        gw = grad_w.mul_(grad_loss).to(w_dtype) if grad_w.numel() else None
        return gh, gw, None, None, None, None


def fused_soft_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    probs: torch.Tensor,
    chunk: int = 1024,
    rows: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy of `hidden [N,H] @ weight.T` against target probabilities.

    `probs` is `[N, Vd]`, or `[M, Vd]` with `rows [N]` selecting the row of each hidden state (gathered chunk by
    chunk, so no `[N, Vd]` copy is made). `target_ids` (same indexing as `probs`) are the argmax ids used for the
    accuracy count; default: computed from `probs`. Returns `(loss_sum, n_correct)`.
    """
    return _FusedSoftCE.apply(hidden, weight, probs, rows, target_ids, chunk)


def ttt_loss(
    drafter: nn.Module,
    embed_tokens: nn.Module,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int = 7,
    step_weights: list[float] | None = None,
    target_valid: torch.Tensor | None = None,
    chunk: int = 1024,
) -> TTTLossOutput:
    """EAGLE-3 TTT loss for one batch (right-padded; pads have loss_mask 0).

    Args:
        drafter: an `Eagle3Drafter`.
        embed_tokens: the target's frozen input embedding.
        input_ids: `[B, T]` target token ids.
        aux_hidden: `[B, T, n_aux*Ht]` target features.
        target_logits: `[B, T, V]` target logits (or `[B, T, Vd]` restricted to the draft vocab + `target_valid`).
        loss_mask: `[B, T]` 1 where token j is supervised.
        steps: number of TTT steps K to unroll.
        step_weights: `w_k` per step (default 0.8**k).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    weights = step_weights if step_weights is not None else default_step_weights(steps)
    if len(weights) < steps:
        raise ValueError(f"{len(weights)} step weights for {steps} TTT steps")
    b, t = input_ids.shape
    probs, valid = target_distribution(target_logits, drafter.t2d, target_valid)
    flat_probs = probs.reshape(b * t, -1)
    flat_target_ids = flat_probs.argmax(-1)  # once for all steps: step k reads row t+1+k
    # token fed at step k, position t is x_{t+1+k}; positions past the end read a pad id and are never supervised
    next_ids = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, steps)], dim=1)
    with torch.no_grad():
        embeds = embed_tokens(next_ids)
    supervised = loss_mask.to(torch.bool)
    total = torch.zeros((), dtype=torch.float32, device=aux_hidden.device)
    losses, accs, counts = [], [], []
    for k, hidden in enumerate(drafter.ttt_rollout(embeds, aux_hidden, steps)):
        n_pos = t - 2 - k  # positions t with a predicted token x_{t+2+k} inside the sequence
        if n_pos <= 0:
            mask = torch.zeros(b, 0, dtype=torch.bool, device=aux_hidden.device)
        else:
            mask = supervised[:, 2 + k :] & valid[:, 1 + k : 1 + k + n_pos]
        rows_b, rows_t = mask.nonzero(as_tuple=True)
        n = rows_b.numel()
        if n:
            h_rows = drafter.norm(hidden[rows_b, rows_t])
            loss_sum, correct = fused_soft_cross_entropy(h_rows, drafter.lm_head.weight, flat_probs, chunk,
                                                         rows=rows_b * t + rows_t + 1 + k, target_ids=flat_target_ids)
            loss_k = loss_sum / n
            acc_k = correct.float() / n
        else:
            # zero that keeps every parameter in the graph (DDP/FSDP expect each one to receive a gradient)
            loss_k = drafter.logits(hidden[:, :1]).sum() * 0.0
            acc_k = torch.zeros((), device=aux_hidden.device)
        total = total + weights[k] * loss_k
        losses.append(loss_k.detach())
        accs.append(acc_k)
        counts.append(n)
    if sum(counts) == 0:
        warnings.warn("batch has no supervised positions (loss_mask all 0 or every target outside the draft vocab): "
                      "its loss is 0", RuntimeWarning, stacklevel=2)
    return TTTLossOutput(
        loss=total,
        step_losses=torch.stack(losses),
        step_acc=torch.stack(accs),
        num_supervised=torch.tensor(counts, dtype=torch.int64),
    )
