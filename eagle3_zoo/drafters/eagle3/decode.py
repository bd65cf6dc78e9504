"""EAGLE-3's `DraftModel` (`eagle3_zoo.drafters.DraftModel`): the drafter as the speculative decoder drives it.

The EAGLE-3 drafter keeps one KV cache laid out as

    [ step-0 rows of the accepted context (one per target position) | nodes of the tree being drafted ]

Row t of the context reads the target features of position t and the embedding of token t+1 at RoPE position t,
exactly as at TTT step 0 in training (`eagle3_zoo.drafters.eagle3.ttt`). A tree node at depth d hangs below the last
context row, so it sits at RoPE position `ctx_len - 1 + d` and attends to every context row plus its own ancestors:
the pattern TTT step d trains. When a cycle's tokens are accepted the tree entries are dropped and the accepted
tokens are appended as new context rows with their real target features, so the drafter never recomputes the
prefix.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3_zoo.modeling import DraftStepOutput, Eagle3Drafter


class Eagle3DraftModel:
    """`DraftModel` over an `Eagle3Drafter` and the target's (frozen) input embedding.

    Args:
        drafter: The EAGLE-3 drafter (its `d2t` maps draft ids to target ids).
        embed_tokens: The target's input embedding (e.g. ``adapter.embed_tokens(target)``).
    """

    def __init__(self, drafter: Eagle3Drafter, embed_tokens: nn.Embedding):
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        self.cache = drafter.new_cache()
        self.ctx_len = 0  # step-0 context rows at the front of the cache

    def reset(self) -> None:
        self.cache = self.drafter.new_cache()
        self.ctx_len = 0

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target(draft_ids)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids.to(self.embed_tokens.weight.device)).unsqueeze(0)

    def extend(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, next_ids: torch.Tensor) -> DraftStepOutput:
        self.cache.crop(self.ctx_len)  # the previous cycle's tree entries
        m = next_ids.shape[-1]
        device = self.drafter.fc.weight.device
        positions = torch.arange(self.ctx_len, self.ctx_len + m, device=device).unsqueeze(0)
        hidden = self.drafter.fuse(aux_hidden.to(device))
        # causal, all past visible; only the last row is drafted from
        out = self.drafter.step(self._embed(next_ids), hidden, positions, self.cache, last_logits_only=True)
        self.ctx_len += m
        return DraftStepOutput(logits=out.logits, hidden=out.hidden[:, -1:])

    def expand(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor
    ) -> DraftStepOutput:
        q = token_ids.shape[-1]
        n_tree = len(self.cache) - self.ctx_len
        if visible.shape != (q, n_tree + q):
            raise ValueError(f"visible mask has shape {tuple(visible.shape)}, expected ({q}, {n_tree + q}): "
                             f"{n_tree} tree entries are cached and {q} nodes are new")
        device, dtype = self.drafter.fc.weight.device, self.drafter.fc.weight.dtype
        mask = torch.zeros(1, 1, q, self.ctx_len + n_tree + q, dtype=dtype, device=device)
        tree_part = torch.zeros(q, n_tree + q, dtype=dtype, device=device)
        tree_part.masked_fill_(~visible.to(device), torch.finfo(dtype).min)
        mask[0, 0, :, self.ctx_len :] = tree_part
        positions = (self.ctx_len - 1 + depths.to(device)).unsqueeze(0)
        return self.drafter.step(self._embed(token_ids), hidden, positions, self.cache, attn_mask=mask)
