"""The textbook formulation of the TTT loss, the baseline that benchmarks and the GPU check compare `ttt_loss`
against: the same function (positions t + k, the same masks, the same draft-vocabulary targets), computed the
straightforward way (after the official SafeAILab/EAGLE trainer), with none of `ttt_loss`'s memory savings."""

from __future__ import annotations

from typing import Any

import torch

from eagle3_zoo.drafters.eagle3.ttt import target_distribution


def reference_ttt_loss(drafter: Any, embed: Any, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
                       target_logits: torch.Tensor, target_valid: torch.Tensor | None, loss_mask: torch.Tensor,
                       steps: int, weights: list[float]) -> torch.Tensor:
    """The textbook formulation of the same loss as `ttt_loss` (after the official trainer's): per step a full fp32
    `[T, T]` causal score matrix plus one column per earlier step's key at the same position, the lm_head and a
    log-softmax over every position, and a masked soft cross-entropy."""
    layer = drafter.midlayer
    attn = layer.self_attn
    b, t = input_ids.shape
    groups, scale = attn.num_heads // attn.num_kv_heads, attn.head_dim**-0.5
    probs, valid = target_distribution(target_logits, drafter.t2d, target_valid)
    next_ids = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, steps)], 1)
    with torch.no_grad():
        embeds = embed(next_ids)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
    hidden = drafter.fuse(aux_hidden)
    keys, values, total = [], [], 0.0
    for k in range(steps):
        x = layer.attn_input(embeds[:, k : k + t].to(hidden.dtype), hidden)
        cos, sin = drafter._rope(x, positions + k)
        q, key, value = attn.project(x, cos, sin)
        keys.append(key.repeat_interleave(groups, 1).float())
        values.append(value.repeat_interleave(groups, 1).float())
        qf = q.float()
        scores = (qf @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        diagonal = [(qf * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]
        p = torch.softmax(torch.cat([scores, *diagonal], -1), -1)
        out = p[..., :t] @ values[0]
        for j in range(1, k + 1):
            out = out + p[..., t + j - 1 : t + j] * values[j]
        hidden = layer.finish(hidden, out.to(q.dtype))
        logp = torch.log_softmax(drafter.logits(hidden).float(), -1)
        n_pos = t - 2 - k
        mask = loss_mask[:, 2 + k :].bool() & valid[:, 1 + k : 1 + k + n_pos]
        ce = -(probs[:, 1 + k : 1 + k + n_pos] * logp[:, :n_pos]).sum(-1)
        total = total + weights[k] * (ce * mask).sum() / mask.sum()
    return total
