"""The DSpark training objective against the target's distribution, as a pure function of (drafter, batch).

Blocks and anchors are DFlash's (`select_anchors`). In a block anchored at a, slot k = 0..B-1 (at position a+k)
predicts the token at a+k+1; it is supervised where a+k+1 is inside the sequence (and the anchor's conversation),
its token supervised and the anchor valid. Its target distribution is p_k = softmax(lm_head(s_{a+k})), s the
target's last (post-norm) hidden state, with the frozen target lm_head; the draft distribution q_k is the softmax of
the drafter's Markov-corrected logits (previous token x_{a+k}, teacher forced). Per supervised slot:

    CE_k   = -log q_k[argmax p_k]                  (hard label: the target's greedy token)
    TV_k   = 1 - sum_v min(p_k[v], q_k[v])         (the `tv` loss of `eagle3_zoo.losses`)
    BCE_k  = BCE(sigmoid(conf_k), alpha_k)         (alpha_k the acceptance of sampling q_k against p_k; detached;
                                                    only with a confidence head)
    loss   = sum_k w_k (ce_weight CE_k + tv_weight TV_k + confidence_weight BCE_k) / supervised slots

with the position decay w_k = exp(-k / gamma) (slot 0, the anchor's prediction, weighs 1) and the paper's weights
0.1 / 0.9 / 1.0. With the full vocabulary alpha_k = 1 - TV_k. With a reduced draft vocabulary (draft ids mapped to
target ids through `d2t`) the package's convention for every per-position loss holds (`eagle3_zoo.losses.chunk`):
TV is trained against p renormalised over the draft vocabulary, while alpha_k = sum_v min(q_v, m p_v) (m the
target's mass on the draft vocabulary) is the true acceptance, reported and used as the confidence target; a slot
whose greedy target token is outside the draft vocabulary has no CE term.
Both vocabulary projections run in chunks of rows under activation checkpointing: at most one `[chunk, V]` logits
tensor of each side exists at a time, in forward and again in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3_zoo.drafters.dflash.loss import acceptance_length, block_labels, decay_weights
from eagle3_zoo.drafters.dspark.model import DSparkDrafter
from eagle3_zoo.losses.chunk import reference_objective

CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0  # the paper's loss weights


def _chunk_terms(h, head, markov_embed, markov_w2, target_h, target_head, draft_to_target, t2d):
    logits = (h @ head.T).float() + (markov_embed @ markov_w2.T).float()
    with torch.no_grad():
        target_logits = (target_h.to(target_head.dtype) @ target_head.T).float()  # features stored in bf16
        greedy = target_logits.argmax(-1)
        p, mass = torch.softmax(target_logits, dim=-1), None
        if draft_to_target is not None:  # renormalised over the draft vocabulary; the mass kept for the report
            p = p[:, draft_to_target]
            mass = p.sum(-1)
            p = p / mass.clamp(min=1e-30)[:, None]
    tv, alpha = reference_objective(logits, p, "tv", mass)
    label = greedy if t2d is None else t2d[greedy]
    ce = F.cross_entropy(logits, label.clamp(min=0), reduction="none")
    return ce, tv, alpha, logits.argmax(-1), greedy, label >= 0


def chunked_terms(hidden, head, markov_embed, markov_w2, target_hidden, target_head, draft_to_target=None, t2d=None,
                  chunk: int = 1024):
    """Per-row (CE, TV, acceptance, draft argmax, target argmax, label in draft vocabulary) of rows `[N, H]`,
    `chunk` rows at a time with the logits recomputed in backward instead of stored. `draft_to_target [V_draft]` /
    `t2d [V]` (-1 = absent) map the vocabularies of a reduced-vocabulary drafter."""
    outs = []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], head, markov_embed[i:i + chunk], markov_w2, target_hidden[i:i + chunk],
                target_head, draft_to_target, t2d)
        outs.append(checkpoint(_chunk_terms, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _chunk_terms(*args))
    if not outs:
        z = hidden.new_zeros(0, dtype=torch.float32)
        e = torch.zeros(0, dtype=torch.long, device=hidden.device)
        return z, z, z, e, e, e.bool()
    return tuple(torch.cat(parts) for parts in zip(*outs))


@dataclass
class DSparkLossOutput:
    loss: torch.Tensor  # scalar (differentiable)
    ce: torch.Tensor  # scalar, the decayed mean of each term (detached)
    tv: torch.Tensor
    bce: torch.Tensor
    accept_rate: torch.Tensor  # [B] mean acceptance alpha per slot (detached)
    position_acc: torch.Tensor  # [B] greedy agreement with the target's argmax per slot (Markov teacher forced)
    acceptance_length: torch.Tensor  # scalar, simulated greedy accepted length per block (+1 for the bonus)
    expected_length: torch.Tensor  # scalar, sum_k prod_{j<=k} alpha_j + 1 per block
    confidence_error: torch.Tensor  # scalar, mean |sigmoid(conf) - alpha| (nan without a confidence head)
    num_supervised: torch.Tensor  # scalar int64


def dspark_loss(drafter: DSparkDrafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                anchors: torch.Tensor, anchor_valid: torch.Tensor, embed_weight: torch.Tensor,
                target_hidden: torch.Tensor, target_lm_head_weight: torch.Tensor,
                ce_weight: float = CE_WEIGHT, tv_weight: float = TV_WEIGHT,
                confidence_weight: float = CONFIDENCE_WEIGHT, gamma: float = 4.0, chunk: int = 1024,
                attention: str = "dense", position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> DSparkLossOutput:
    """The DSpark objective of one batch (module docstring). `target_hidden [B, T, H_target]` is the target's last
    post-norm hidden state (its logits are `target_hidden @ target_lm_head_weight.T`)."""
    if target_hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"target_hidden has shape {tuple(target_hidden.shape)}; expected [{input_ids.shape[0]}, "
                         f"{input_ids.shape[1]}, H] (the target's last hidden state at every position)")
    bsz, t = drafter.config.block_size, input_ids.shape[1]
    hidden = drafter.training_forward(aux_hidden, input_ids, anchors, embed_weight, attention, position_ids,
                                      document_ids).view(*anchors.shape, bsz, -1)
    # slot k predicts x_{a+k+1}: DFlash's labels of a block one longer, whose slot k+1 is this block's slot k
    _, mask = block_labels(input_ids, loss_mask, anchors, anchor_valid, bsz + 1, document_ids)
    pos = (anchors[..., None] + torch.arange(bsz, device=anchors.device)).clamp(max=t - 1)  # slot positions a+k
    prev = input_ids.gather(1, pos.flatten(1)).view(pos.shape)
    rows = mask.nonzero(as_tuple=True)
    markov_embed = drafter.markov_head.embed(prev[rows])
    target_rows = target_hidden[rows[0], pos[rows]].detach()
    head = drafter.head_weight(target_lm_head_weight)
    d2t_ids = t2d = None
    if drafter.d2t is not None:
        d2t_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=mask.device))
        t2d = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=mask.device)
        t2d[d2t_ids] = torch.arange(drafter.config.draft_vocab_size, device=mask.device)
    h = hidden[rows]
    ce, tv, alpha, pred, greedy, in_vocab = chunked_terms(h, head, markov_embed, drafter.markov_head.markov_w2.weight,
                                                   target_rows, target_lm_head_weight.detach(), d2t_ids, t2d, chunk)
    w = decay_weights(bsz, gamma, mask.device).expand(mask.shape)[rows]
    n = mask.sum()
    denom = n.clamp(min=1)
    ce_term = (w * ce * in_vocab).sum() / denom
    tv_term = (w * tv).sum() / denom
    loss = ce_weight * ce_term + tv_weight * tv_term
    bce_term = torch.zeros((), device=mask.device)
    conf_err = torch.full((), float("nan"), device=mask.device)
    if drafter.confidence_head is not None:
        conf = drafter.confidence_logits(h, markov_embed)
        bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
        bce_term = (w * bce).sum() / denom
        loss = loss + confidence_weight * bce_term
        if n > 0:
            conf_err = (conf.detach().sigmoid() - alpha).abs().mean()
    if n == 0:  # nothing supervised: a zero that still reaches every parameter (DDP, optimizers)
        loss = hidden.sum() * 0.0 + sum(p.sum() for p in drafter.markov_head.parameters()) * 0.0
        if drafter.confidence_head is not None:
            loss = loss + sum(p.sum() for p in drafter.confidence_head.parameters()) * 0.0
    with torch.no_grad():
        accept = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        accept[rows] = alpha
        correct = torch.zeros_like(mask)
        correct[rows] = drafter.to_target_ids(pred) == greedy
        dims = tuple(range(mask.dim() - 1))
        total = mask.sum(dim=dims).clamp(min=1)
        length_sum, blocks = acceptance_length(correct, mask)
        prefix = torch.where(mask, accept, torch.zeros_like(accept)).cumprod(dim=-1)
        expected = ((prefix.sum(-1) + 1.0) * mask.any(-1)).sum() / blocks.clamp(min=1)
    return DSparkLossOutput(loss, ce_term.detach(), tv_term.detach(), bce_term.detach(),
                            accept.sum(dim=dims) / total, correct.sum(dim=dims).float() / total,
                            length_sum / blocks.clamp(min=1), expected, conf_err, n)
