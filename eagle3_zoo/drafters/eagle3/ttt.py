"""The EAGLE-3 Training-Time-Test loss: a pure function of (drafter, batch, steps), tested without a Trainer.

At TTT step k, position t reads the drafter's own step k-1 output at t (target features at step 0), the embedding
of the ground-truth token x_{t+1+k}, and is trained towards the target's distribution at t+1+k (which predicts
x_{t+2+k}), masked by the supervision mask of that predicted token. Positions whose full-vocab target argmax is
not in the draft vocabulary are excluded. Each step's loss is normalised by its number of supervised positions.

The per-position objective (EAGLE-3's soft cross-entropy by default, or another registered loss: `eagle3_zoo.losses`)
over the draft vocabulary is fused with the lm_head and computed only on supervised rows, in chunks, with its gradients
formed in the forward pass: no [T, draft_vocab] logits are kept for backward. Each step also reports the mean
expected acceptance alpha of its drafted token, unless asked not to (`with_alpha=False`: a training step whose
metrics no logger records skips its passes over the rows and the target's draft-vocabulary mass).

On a GPU the loss waits for the device once (the supervised-row counts of all steps, read in one transfer, size
every gather); nothing else in it needs a value on the host.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from eagle3_zoo.losses import Loss
from eagle3_zoo.losses.chunk import as_loss, chunk_objective


@dataclass
class TTTLossOutput:
    loss: torch.Tensor  # scalar, sum_k w_k * loss_k (differentiable)
    step_losses: torch.Tensor  # [K] detached
    step_acc: torch.Tensor  # [K] fraction of supervised positions where draft argmax == target argmax
    num_supervised: torch.Tensor  # [K] int64, on the batch's device
    step_alpha: torch.Tensor | None = None  # [K] mean expected acceptance alpha of a drafted token (losses.chunk);
    # None with with_alpha=False


def default_step_weights(steps: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3's weights w_k = decay**k."""
    return [decay**k for k in range(steps)]


def target_distribution(
    target_logits: torch.Tensor, t2d: torch.Tensor, target_valid: torch.Tensor | None = None,
    draft_vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft targets over the draft vocabulary (fp32, renormalised) and the mask of usable positions.

    Args:
        target_logits: `[B, T, V]` over the target vocab, or `[B, T, Vd]` already restricted to the draft vocab.
        t2d: `[V]` bool draft-vocab membership.
        target_valid: with draft-vocab logits, `[B, T]` bool "full-vocab argmax is in the draft vocab".
        draft_vocab_size: the number of ids `t2d` marks (default: counted, which waits for the device).
    """
    vocab = t2d.numel()
    draft_vocab = int(t2d.sum()) if draft_vocab_size is None else draft_vocab_size
    if target_logits.shape[-1] == vocab and vocab != draft_vocab:
        valid = t2d[target_logits.argmax(-1)]
        target_logits = target_logits.index_select(-1, torch.nonzero_static(t2d, size=draft_vocab).squeeze(-1))
    elif target_logits.shape[-1] == draft_vocab:
        valid = target_valid if target_valid is not None else torch.ones(target_logits.shape[:-1], dtype=torch.bool,
                                                                           device=target_logits.device)
    else:
        raise ValueError(f"target_logits last dim {target_logits.shape[-1]} is neither the target vocab ({vocab}) "
                         f"nor the draft vocab ({draft_vocab})")
    return torch.softmax(target_logits.float(), dim=-1), valid.to(torch.bool)


class FusedSoftCEOutput(NamedTuple):
    loss: torch.Tensor  # scalar fp32, sum_r row_weight_r * CE_r (differentiable)
    row_loss: torch.Tensor  # [N] fp32 soft cross-entropy of each row (not differentiable)
    row_correct: torch.Tensor  # [N] bool, draft argmax == target argmax (not differentiable)


class FusedLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar fp32, sum_r row_weight_r * objective_r (differentiable)
    row_loss: torch.Tensor  # [N] fp32 objective of each row (not differentiable)
    row_correct: torch.Tensor  # [N] bool, draft argmax == target argmax (not differentiable)
    row_alpha: torch.Tensor | None  # [N] fp32 expected acceptance of each row's draft distribution (not
    # differentiable); None with with_alpha=False


class _FusedLMHeadLoss(torch.autograd.Function):
    """sum_r w_r * objective(softmax(h_r @ W.T), p_r) with grads computed chunk-wise in forward.

    Per chunk the objective's value, the acceptance alpha and the logits gradient come from
    `losses.chunk.chunk_objective` (one softmax pass in place, a batched row-dot for p . logits, no log-softmax tensor).

    Precision is explicit, never inherited from the caller's autocast state: the two matmuls per chunk run in
    `mm_dtype` (autocast's dtype under autocast, else fp32), everything else (max, exp, sums, loss) in fp32, and
    `grad_w` is ONE fp32 buffer for all rows. `ttt_loss` passes the rows of every TTT step in one call with
    `w_r = w_k / n_k`, so a drafter has one fp32 `[Vd, H]` gradient buffer per batch, not one per step. In a
    low-precision `mm_dtype` the row weights stay outside the cast: the logits gradient (|g| <= 2 for every
    objective) is cast unweighted, `grad_h` rows are weighted in fp32 after the product, and `grad_w` weights the
    hidden rows relative to the chunk's largest weight, applying that one in fp32 (weighted first, w_r * g ~ 1e-9
    underflows fp16, whose smallest subnormal is 6e-8: 16-mixed gradients were off by 6-27% at N=2048, Vd=32000).
    Backward only scales the saved gradients by the incoming scalar, so forward and backward cannot disagree.
    """

    @staticmethod
    def forward(ctx, h, weight, p, rows, target_ids, row_weights, mass, chunk: int, mm_dtype: torch.dtype,
                objective: Loss, with_alpha: bool):
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(mm_dtype)
            n = h.shape[0]
            grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad \
                else None
            row_loss = torch.empty(n, dtype=torch.float32, device=h.device)
            row_alpha = torch.empty(n if with_alpha else 0, dtype=torch.float32, device=h.device)
            row_correct = torch.empty(n, dtype=torch.bool, device=h.device)
            for i in range(0, n, chunk):
                rows_i = slice(i, i + chunk)
                idx = None if rows is None else rows[rows_i]
                pc = _gathered(p, idx, rows_i).float()  # gathered per chunk, never [N, Vd]
                tc = pc.argmax(-1) if target_ids is None else _gathered(target_ids, idx, rows_i)
                mc = None if mass is None or not with_alpha else _gathered(mass, idx, rows_i).float()
                hc = h[rows_i].to(mm_dtype)
                out = chunk_objective((hc @ w.t()).float(), pc, objective, mc, report=with_alpha)
                row_loss[rows_i] = out.loss
                if with_alpha:
                    row_alpha[rows_i] = out.alpha
                row_correct[rows_i] = out.argmax == tc
                rw = None if row_weights is None else row_weights[rows_i]
                _add_chunk_grads(out.grad, hc, h[rows_i], w, rw, mm_dtype, grad_h[rows_i], grad_w)
            loss = (row_loss * row_weights).sum() if row_weights is not None else row_loss.sum()
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.mark_non_differentiable(row_loss, row_correct, row_alpha)
        return loss, row_loss, row_correct, row_alpha

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, *_grad_row_outputs):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        with torch.autocast(grad_h.device.type, enabled=False):
            grad_loss = grad_loss.float()
            gh = grad_h.mul_(grad_loss).to(h_dtype)  # saved grads are used once: scale in place
            gw = grad_w.mul_(grad_loss).to(w_dtype) if grad_w.numel() else None
        return gh, gw, *([None] * 9)


def _gathered(x: torch.Tensor, idx: torch.Tensor | None, rows: slice) -> torch.Tensor:
    return x[rows] if idx is None else x.index_select(0, idx)


def _add_chunk_grads(g: torch.Tensor, hc: torch.Tensor, h: torch.Tensor, w: torch.Tensor, rw: torch.Tensor | None,
                     mm_dtype: torch.dtype, grad_h: torch.Tensor, grad_w: torch.Tensor | None) -> None:
    """One chunk's `grad_h = rw * g @ W` (written into the view `grad_h`) and `grad_w += (rw * g).T @ h`, with the
    row weights kept out of a low-precision cast (`_FusedLMHeadLoss`)."""
    if mm_dtype == torch.float32:
        if rw is not None:
            g.mul_(rw[:, None])
        grad_h.copy_(g @ w)
        if grad_w is not None:
            grad_w.addmm_(g.t(), hc)
        return
    g = g.to(mm_dtype)  # unweighted
    grad_h.copy_(g @ w if rw is None else (g @ w).float().mul_(rw[:, None]))
    if grad_w is None:
        return
    if rw is None:  # low-precision product (fp32 accumulation inside the GEMM), summed in fp32
        grad_w.add_(g.t() @ hc)
    else:
        top = rw.max().clamp_min(torch.finfo(torch.float32).tiny)  # a chunk of zero-weight rows adds nothing
        hw = (h.float() * (rw / top)[:, None]).to(mm_dtype)
        grad_w.add_((g.t() @ hw).float().mul_(top))


def fused_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    probs: torch.Tensor,
    chunk: int = 1024,
    rows: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    objective: Loss | str = "soft_ce",
    mass: torch.Tensor | None = None,
    with_alpha: bool = True,
) -> FusedLossOutput:
    """Weighted sum of a per-row objective (a `Loss`, or a registered loss's name) of `hidden [N,H] @ weight.T`
    against target probabilities, and each row's expected acceptance alpha.

    `probs` is `[N, Vd]`, or `[M, Vd]` with `rows [N]` selecting the row of each hidden state (gathered chunk by
    chunk, so no `[N, Vd]` copy is made). `target_ids` and `mass` (the target's probability mass on the draft
    vocabulary, for alpha; default 1) use the same indexing as `probs`; `target_ids` are the argmax ids of the
    accuracy (default: computed from `probs`). `row_weights [N]` (default 1) weight each row's loss. Under
    autocast the matmuls run in autocast's dtype and the rest in fp32; otherwise everything runs in fp32.
    `with_alpha=False` skips the alpha (`row_alpha` None) and reads no `mass`.
    """
    objective = as_loss(objective)
    device_type = hidden.device.type
    mm_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32
    if row_weights is not None:
        row_weights = row_weights.float()
    loss, row_loss, row_correct, row_alpha = _FusedLMHeadLoss.apply(
        hidden, weight, probs, rows, target_ids, row_weights, mass, chunk, mm_dtype, objective, with_alpha)
    return FusedLossOutput(loss, row_loss, row_correct, row_alpha if with_alpha else None)


def fused_soft_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    probs: torch.Tensor,
    chunk: int = 1024,
    rows: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> FusedSoftCEOutput:
    """`fused_lm_head_loss` with EAGLE-3's soft cross-entropy (loss, per-row loss, per-row accuracy)."""
    return FusedSoftCEOutput(*fused_lm_head_loss(hidden, weight, probs, chunk, rows, target_ids, row_weights,
                                                 with_alpha=False)[:3])


def draft_vocab_mass(target_logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """`[...]` fp32 probability the full target distribution puts on the draft vocabulary (`draft_ids`), per row."""
    logits = target_logits.float()
    return torch.exp(torch.logsumexp(logits.index_select(-1, draft_ids), -1) - torch.logsumexp(logits, -1))


def ttt_loss(
    drafter: nn.Module,
    embed_tokens: nn.Module,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int = 7,
    step_weights: list[float] | torch.Tensor | None = None,
    target_valid: torch.Tensor | None = None,
    chunk: int = 1024,
    objective: Loss | str = "soft_ce",
    target_mass: torch.Tensor | None = None,
    counts: list[int] | None = None,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    with_alpha: bool = True,
) -> TTTLossOutput:
    """EAGLE-3 TTT loss for one batch (right-padded; pads have loss_mask 0), or of packed rows (`document_ids`).

    Args:
        drafter: an `Eagle3Drafter`.
        embed_tokens: the target's frozen input embedding.
        input_ids: `[B, T]` target token ids.
        aux_hidden: `[B, T, n_aux*Ht]` target features.
        target_logits: `[B, T, V]` target logits (or `[B, T, Vd]` restricted to the draft vocab + `target_valid`).
        loss_mask: `[B, T]` 1 where token j is supervised.
        steps: number of TTT steps K to unroll.
        step_weights: `w_k` per step (default 0.8**k): floats, or a `[>= steps]` tensor on the batch's device.
        objective: the per-position loss, a `Loss` with its parameters (`eagle3_zoo.losses.make_loss`) or a
            registered loss's name with its default parameters (default EAGLE-3's soft cross-entropy).
        target_mass: `[B, T]` the target's probability mass on the draft vocabulary, for the reported acceptance
            (default: from full-vocab `target_logits`, else 1).
        counts: the supervised positions of each step (`num_supervised`) already read on the host by the caller
            (`DrafterModule` reads them with other values in one transfer); default: read here.
        position_ids: `[B, T]` RoPE positions (packed rows: restarting at 0 per document; default 0..T-1).
        document_ids: `[B, T]` packed rows: the document of each position, never decreasing along a row. Attention
            stays inside a document and no position is trained on a token of the next one (`step_masks`), so the
            loss equals that of the documents in separate rows.
        with_alpha: compute `step_alpha` (a metric only: the loss and its gradients do not depend on it); False
            skips it and the draft-vocabulary mass (`step_alpha` None).
    """
    objective = as_loss(objective)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    weights = step_weights if step_weights is not None else default_step_weights(steps)
    if len(weights) < steps:
        raise ValueError(f"{len(weights)} step weights for {steps} TTT steps")
    b, t = input_ids.shape
    device = aux_hidden.device
    if with_alpha and target_mass is None and target_logits.shape[-1] == drafter.t2d.numel() != drafter.d2t.numel():
        draft_ids = torch.nonzero_static(drafter.t2d, size=drafter.d2t.numel()).squeeze(-1).to(target_logits.device)
        # `chunk` rows at a time: its temporaries stay [chunk, V], not [B*T, V]
        target_mass = torch.cat([draft_vocab_mass(rows, draft_ids) for rows in
                                 target_logits.reshape(b * t, -1).split(chunk)]).reshape(b, t)
    probs, valid = target_distribution(target_logits, drafter.t2d, target_valid, drafter.d2t.numel())
    flat_probs = probs.reshape(b * t, -1)
    flat_target_ids = flat_probs.argmax(-1)  # once for all steps: step k reads row t+1+k
    # token fed at step k, position t is x_{t+1+k}; positions past the end read a pad id and are never supervised
    next_ids = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, steps)], dim=1)
    with torch.no_grad():
        embeds = embed_tokens(next_ids)
    masks = step_masks(loss_mask, valid, steps, document_ids)
    n_k = masks.sum((1, 2))
    # the loss's one wait for the device (unless the caller read them): the counts size every gather below
    counts = n_k.tolist() if counts is None else list(counts)
    total = torch.zeros((), dtype=torch.float32, device=device)
    # rows of every step go through ONE fused lm_head + loss call after the rollout (one fp32 grad_w buffer)
    h_rows, prob_rows, row_weights = [], [], []
    for k, hidden in enumerate(drafter.ttt_rollout(embeds, aux_hidden, steps, position_ids, document_ids)):
        n = counts[k]
        if n:
            rows_b, rows_t = torch.nonzero_static(masks[k], size=n).unbind(1)  # no sync: the size is known
            h_rows.append(drafter.norm(hidden[rows_b, rows_t]))
            prob_rows.append(rows_b * t + rows_t + 1 + k)
            row_weights.append(_row_weights(weights[k], n, device))
        else:
            # zero that keeps every parameter in the graph (DDP/FSDP expect each one to receive a gradient)
            total = total + drafter.logits(hidden[:, :1]).sum().float() * 0.0
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    accs = torch.zeros(steps, dtype=torch.float32, device=device)
    alphas = torch.zeros(steps, dtype=torch.float32, device=device)
    if h_rows:
        out = fused_lm_head_loss(torch.cat(h_rows), drafter.lm_head.weight, flat_probs, chunk,
                                 rows=torch.cat(prob_rows), target_ids=flat_target_ids,
                                 row_weights=torch.cat(row_weights), objective=objective,
                                 mass=None if target_mass is None else target_mass.reshape(b * t),
                                 with_alpha=with_alpha)
        total = total + out.loss
        step_of_row = torch.repeat_interleave(torch.arange(steps, device=device), n_k, output_size=sum(counts))
        denom = n_k.clamp(min=1).float()
        losses = losses.index_add_(0, step_of_row, out.row_loss) / denom
        accs = accs.index_add_(0, step_of_row, out.row_correct.float()) / denom
        if with_alpha:
            alphas = alphas.index_add_(0, step_of_row, out.row_alpha) / denom
    if sum(counts) == 0:
        warnings.warn("batch has no supervised positions (loss_mask all 0 or every target outside the draft vocab): "
                      "its loss is 0", RuntimeWarning, stacklevel=2)
    return TTTLossOutput(loss=total, step_losses=losses, step_acc=accs, num_supervised=n_k,
                         step_alpha=alphas if with_alpha else None)


def step_masks(loss_mask: torch.Tensor, valid: torch.Tensor, steps: int,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`[steps, B, T]` bool: step k trains position t (< T - 2 - k) on the target at t + 1 + k, where the token it
    predicts, x_{t+2+k}, is supervised and that target's full-vocab argmax is in the draft vocab; in packed rows
    (`document_ids`) also only where x_{t+2+k} lies in t's document (the tokens it read, x_{t+1..t+1+k}, then do)."""
    b, t = loss_mask.shape
    supervised = loss_mask.to(torch.bool)
    masks = torch.zeros(steps, b, t, dtype=torch.bool, device=loss_mask.device)
    for k in range(min(steps, t - 2)):
        n_pos = t - 2 - k  # positions with a predicted token x_{t+2+k} inside the sequence
        masks[k, :, :n_pos] = supervised[:, 2 + k :] & valid[:, 1 + k : 1 + k + n_pos]
        if document_ids is not None:
            masks[k, :, :n_pos] &= document_ids[:, :n_pos] == document_ids[:, 2 + k :]
    return masks


def _row_weights(weight: float | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """`[n]` fp32 rows of weight / n; a tensor weight (per-rank weights, `rank_step_weights`) stays on its device."""
    if isinstance(weight, torch.Tensor):
        return (weight.to(device, torch.float32) / n).expand(n)
    return torch.full((n,), weight / n, dtype=torch.float32, device=device)
