"""The DFlash training objective: anchors, block labels, position weights, the chunked lm-head loss and the simulated
greedy acceptance length, as pure functions of (drafter, batch) tested without a Trainer.

A block anchored at position a (input token x_a, the slot the target's bonus token fills when decoding) trains slot
k = 1..B-1 towards the token at a+k, where that token is supervised and inside the sequence (and the anchor's
conversation). Its cross-entropy CE_k is against (`labels`):

- "hard": the label x_{a+k} itself;
- "soft": the target's own distribution over the token at a+k, p = softmax(target lm_head(s_{a+k-1})), s the target's
  last (post-norm) hidden state, as EAGLE-3's soft targets are; over a reduced draft vocabulary p is renormalised
  over it, and a slot whose full-vocabulary target argmax is outside it is not in the loss (as a hard label outside
  it is not). A target distribution one-hot on the label gives the hard loss.

Per-position weights within a block (detached):

- "dpace" (D-PACE, arXiv 2605.18810; the default of speculators 0.9 and ModelOpt): with q_k = exp(-CE_k) the slot's
  confidence, s_k = (1 - alpha) q_k + alpha over supervised slots (1 elsewhere) and P_k = s_1 ... s_k,
  w_k = m_k * sum_{j >= k} m_j P_j: the derivative of the expected accepted length sum_k prod_{j<=k} q_j with
  respect to log q_k, smoothed by alpha (0.5).
- "decay": w_k = exp(-(k-1) / gamma) (DFlash's, gamma 4).

The loss is sum over supervised slots of w_k * CE_k, divided by the number of supervised slots. The vocabulary
projection runs in chunks of rows under activation checkpointing: at most one `[chunk, V]` logits tensor (with soft
labels, one of the target's too) exists at a time, in forward and again in backward. The metrics (position accuracy,
simulated acceptance) compare the draft's argmax with the label x_{a+k} under either loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3_zoo.drafters.dflash.model import DFlashDrafter

WEIGHTINGS = ("dpace", "decay")
LABELS = ("hard", "soft")


def select_anchors(loss_mask: torch.Tensor, num_anchors: int = 512, generator: torch.Generator | None = None,
                   document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` anchors per sequence, drawn uniformly without replacement among positions a >= 1 whose
    token and next token are supervised (`loss_mask [B, T]`) and, in a packed row, of the same conversation as the
    tokens before and after them; sorted. Returns anchors `[B, A]` (unused entries 0) and their validity `[B, A]`
    bool. Draw again each epoch (pass a generator seeded by epoch)."""
    b, t = loss_mask.shape
    m = loss_mask.bool()
    eligible = torch.zeros_like(m)
    eligible[:, 1:-1] = m[:, 1:-1] & m[:, 2:]
    if document_ids is not None:
        doc = document_ids[:, 1:-1]
        eligible[:, 1:-1] &= (doc == document_ids[:, 2:]) & (doc == document_ids[:, :-2])
    scores = torch.rand((b, t), generator=generator, device="cpu").to(loss_mask.device)
    scores = torch.where(eligible, scores, torch.full_like(scores, 2.0))  # ineligible positions sort last
    a = min(num_anchors, t)
    picked = scores.topk(a, dim=1, largest=False).indices
    valid = eligible.gather(1, picked)
    picked = torch.where(valid, picked, torch.zeros_like(picked))
    order = torch.where(valid, picked, torch.full_like(picked, t)).argsort(dim=1)  # valid anchors first, ascending
    return picked.gather(1, order), valid.gather(1, order)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                 block_size: int, document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `[B, A, block_size-1]` (x_{a+k} for k = 1..block_size-1) and their mask: the anchor is valid, a+k is
    inside the sequence (and the anchor's conversation, `document_ids`) and its token is supervised."""
    t = input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)  # [B, A, B-1]
    inside = pos < t
    pos = pos.clamp(max=t - 1)
    labels = input_ids.gather(1, pos.flatten(1)).view(pos.shape)
    mask = loss_mask.bool().gather(1, pos.flatten(1)).view(pos.shape) & inside & anchor_valid[..., None]
    if document_ids is not None:
        mask &= document_ids.gather(1, pos.flatten(1)).view(pos.shape) == document_ids.gather(1, anchors)[..., None]
    return labels, mask


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE weights `[..., K]` of slots 1..K of each block from their cross-entropy and supervision mask."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace alpha={alpha}; expected a value in (0, 1]")
    with torch.no_grad():
        m = mask.to(torch.float32)
        smooth = torch.where(mask, (1.0 - alpha) * torch.exp(-ce.float()) + alpha, torch.ones_like(m))
        prefix = torch.cumprod(smooth, dim=-1)
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, dims=[-1]), dim=-1), dims=[-1])
        return suffix * m


def decay_weights(num_slots: int, gamma: float = 4.0, device: torch.device | None = None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..num_slots."""
    if not gamma > 0:
        raise ValueError(f"decay gamma={gamma}; expected a value > 0")
    return torch.exp(-torch.arange(num_slots, dtype=torch.float32, device=device) / gamma)


def acceptance_length(correct: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Simulated greedy acceptance per block: the leading run of correct supervised slots plus the target's bonus
    token (vLLM's count). correct/mask `[..., K]` -> (sum of lengths over blocks with a supervised slot, number of
    such blocks)."""
    run = (correct & mask).to(torch.float32).cumprod(dim=-1).sum(dim=-1) + 1.0
    blocks = mask.any(dim=-1)
    return (run * blocks).sum(), blocks.sum()


def _chunk_ce(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (h @ weight.t()).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE of `hidden [N, H] @ weight.T` against `labels [N]` and each row's argmax, `chunk` rows at a time
    with the logits recomputed in backward instead of stored."""
    ces, preds = [], []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], weight, labels[i:i + chunk])
        ce, pred = checkpoint(_chunk_ce, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_ce(*args)
        ces.append(ce)
        preds.append(pred)
    if not ces:
        return hidden.new_zeros(0, dtype=torch.float32), labels.new_zeros(0)
    return torch.cat(ces), torch.cat(preds)


def _chunk_soft_ce(h: torch.Tensor, weight: torch.Tensor, target_h: torch.Tensor, target_weight: torch.Tensor,
                   draft_to_target: torch.Tensor | None,
                   t2d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = (h @ weight.t()).float()
    with torch.no_grad():
        target_logits = (target_h.to(target_weight.dtype) @ target_weight.t()).float()  # features may be bf16
        in_vocab = torch.ones(target_logits.shape[0], dtype=torch.bool, device=target_logits.device)
        if draft_to_target is not None:  # renormalised over the draft vocabulary
            in_vocab = t2d[target_logits.argmax(-1)] >= 0
            target_logits = target_logits[:, draft_to_target]
        p = torch.softmax(target_logits, dim=-1)
    return -(p * F.log_softmax(logits, dim=-1)).sum(-1), logits.argmax(-1), in_vocab


def chunked_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_hidden: torch.Tensor,
                               target_weight: torch.Tensor, draft_to_target: torch.Tensor | None = None,
                               t2d: torch.Tensor | None = None,
                               chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row soft CE of `hidden [N, H] @ weight.T` against softmax(`target_hidden [N, H_t] @ target_weight.T`),
    each row's argmax and whether the row is in the loss, `chunk` rows at a time with both logits recomputed in
    backward instead of stored. A reduced draft vocabulary: `draft_to_target [V_draft]` (its target ids; the target's
    distribution is renormalised over them) and `t2d [V]` (-1 = absent; a row whose full-vocabulary target argmax is
    absent is not in the loss)."""
    outs = []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], weight, target_hidden[i:i + chunk], target_weight, draft_to_target, t2d)
        outs.append(checkpoint(_chunk_soft_ce, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _chunk_soft_ce(*args))
    if not outs:
        return (hidden.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.long, device=hidden.device),
                torch.zeros(0, dtype=torch.bool, device=hidden.device))
    ce, pred, in_vocab = (torch.cat(parts) for parts in zip(*outs))
    return ce, pred, in_vocab


@dataclass
class DFlashLossOutput:
    loss: torch.Tensor  # scalar, sum_k w_k CE_k / supervised slots (differentiable)
    position_acc: torch.Tensor  # [B-1] fraction of supervised slots k whose argmax is the label (detached)
    acceptance_length: torch.Tensor  # scalar, mean simulated greedy accepted length per block (bonus included)
    num_supervised: torch.Tensor  # scalar int64, supervised slots in the loss


def dflash_loss(drafter: DFlashDrafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                anchors: torch.Tensor, anchor_valid: torch.Tensor, embed_weight: torch.Tensor,
                target_lm_head_weight: torch.Tensor | None = None, weighting: str = "dpace", alpha: float = 0.5,
                gamma: float = 4.0, chunk: int = 1024, attention: str = "dense",
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                labels: str = "hard", target_hidden: torch.Tensor | None = None) -> DFlashLossOutput:
    """The DFlash objective of one batch (all blocks in one forward; packed rows: `position_ids`, `document_ids`).
    A label outside a reduced draft vocabulary is not in the loss (no draft id can name it) but counts as a
    rejected slot in the acceptance metrics. `labels="soft"` (module docstring) needs `target_hidden [B, T, H_t]`,
    the target's last post-norm hidden state, and `target_lm_head_weight`, the target's lm_head (with a reduced
    draft vocabulary too)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}; expected one of {', '.join(WEIGHTINGS)}")
    if labels not in LABELS:
        raise ValueError(f"labels={labels!r}; expected one of {', '.join(LABELS)}")
    if labels == "soft" and (target_hidden is None or target_lm_head_weight is None):
        raise ValueError("labels='soft' trains against the target's distribution: pass target_hidden (the target's "
                         "last hidden state) and target_lm_head_weight")
    if target_hidden is not None and target_hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"target_hidden has shape {tuple(target_hidden.shape)}; expected [{input_ids.shape[0]}, "
                         f"{input_ids.shape[1]}, H] (the target's last hidden state at every position)")
    bsz = drafter.config.block_size
    hidden = drafter.training_forward(aux_hidden, input_ids, anchors, embed_weight, attention, position_ids,
                                      document_ids)
    hidden = hidden.view(*anchors.shape, bsz, -1)[..., 1:, :]  # slot 0 (the anchor) predicts nothing
    weight = drafter.head_weight(target_lm_head_weight)
    soft = labels == "soft"
    labels, mask = block_labels(input_ids, loss_mask, anchors, anchor_valid, bsz, document_ids)
    draft_labels, in_vocab = labels, torch.ones_like(mask)
    t2d = draft_to_target = None
    if drafter.d2t is not None:  # target ids -> draft ids (-1 = not in the draft vocabulary)
        t2d = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=labels.device)
        draft_ids = torch.arange(drafter.config.draft_vocab_size, device=labels.device)
        draft_to_target = drafter.to_target_ids(draft_ids)
        t2d[draft_to_target] = draft_ids
        draft_labels = t2d[labels]
        in_vocab = draft_labels >= 0
    rows = mask.nonzero(as_tuple=True)
    if soft:  # slot k (index k-1) predicts a+k from the target's state at a+k-1
        pos = (anchors[rows[0], rows[1]] + rows[2]).clamp(max=input_ids.shape[1] - 1)
        ce, pred, row_in_loss = chunked_soft_cross_entropy(
            hidden[rows], weight, target_hidden[rows[0], pos].detach(), target_lm_head_weight.detach(),
            draft_to_target, t2d, chunk)
        in_vocab = torch.zeros_like(mask)
        in_vocab[rows] = row_in_loss
    else:
        ce, pred = chunked_cross_entropy(hidden[rows], weight, draft_labels[rows].clamp(min=0), chunk)
        row_in_loss = in_vocab[rows]
    loss_mask_slots = mask & in_vocab
    ce_slots = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    ce_slots[rows] = ce.detach()
    if weighting == "dpace":
        w = dpace_weights(ce_slots, loss_mask_slots, alpha)[rows]
    else:
        w = decay_weights(bsz - 1, gamma, mask.device).expand(mask.shape)[rows]
    n = row_in_loss.sum()
    loss = (ce * w * row_in_loss).sum() / n.clamp(min=1)
    if ce.numel() == 0:  # nothing supervised: a zero that still reaches every parameter (DDP, optimizers)
        loss = hidden.sum() * 0.0
    correct = torch.zeros_like(mask)
    correct[rows] = (drafter.to_target_ids(pred) == labels[rows]) & row_in_loss
    total = mask.sum(dim=tuple(range(mask.dim() - 1)))
    position_acc = (correct.sum(dim=tuple(range(mask.dim() - 1))) / total.clamp(min=1)).float()
    length_sum, blocks = acceptance_length(correct, mask)
    return DFlashLossOutput(loss, position_acc, length_sum / blocks.clamp(min=1), n)
