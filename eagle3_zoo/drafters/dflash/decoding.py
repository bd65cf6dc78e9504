"""The drafter side of DFlash decoding: a persistent per-layer draft KV cache of the verified context's features.

Every verified position's target features enter the drafter once: `hidden_norm(fc(.))`, then each draft layer's
`k_proj`/`v_proj` (k normed and rotated at the position's RoPE position), appended to that layer's cache, as vLLM
0.32's `precompute_and_store_context_kv` does. A block is then drafted in one forward over its B slots
`[anchor, MASK x (B-1)]` at positions P..P+B-1 (P = cached context length), attending to every cached context entry
and to every slot of the block; the block's own keys/values are not kept (the next cycle appends the verified
positions' context features instead). The result equals `DFlashDrafter.draft_block` on the whole prefix.

Batch size 1 (one request at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_zoo.drafters.dflash.model import DFlashDrafter


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # every key visible: no mask


class DFlashContextCache:
    """Context keys/values of one request, per draft layer: `keys[i]`, `values[i]` `[1, kv_heads, P, head_dim]`.

    Args:
        drafter: The DFlash drafter (its dtype and device hold the cache).
    """

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.reset()

    @property
    def length(self) -> int:
        """Context positions cached (0..length-1); the next block's anchor sits at position `length`."""
        return self.keys[0].shape[-2]

    def reset(self) -> None:
        """Forget the context (start of a request)."""
        d = self.drafter
        w = d.fc.weight
        empty = w.new_zeros(1, d.config.num_key_value_heads, 0, d.config.head_dim)
        self.keys = [empty] * d.config.num_hidden_layers
        self.values = [empty] * d.config.num_hidden_layers

    @torch.no_grad()
    def extend(self, aux_hidden: torch.Tensor) -> None:
        """Append the features of the next `m` verified positions, `aux_hidden [1, m, n*H_target]` (the target's
        concatenated layer outputs at positions length..length+m-1)."""
        d = self.drafter
        expected = d.config.num_features * d.config.target_hidden_size
        if aux_hidden.dim() != 3 or aux_hidden.shape[0] != 1 or aux_hidden.shape[-1] != expected:
            raise ValueError(f"aux_hidden has shape {tuple(aux_hidden.shape)}; expected [1, m, {expected}] "
                             f"({d.config.num_features} target layers x {d.config.target_hidden_size})")
        w = d.fc.weight
        ctx = d.context(aux_hidden.to(device=w.device, dtype=w.dtype))
        start = self.length
        positions = torch.arange(start, start + ctx.shape[1], device=w.device)[None]
        cos, sin = d.rotary_emb(positions, ctx.dtype)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            self.keys[i] = torch.cat([self.keys[i], k], dim=-2)
            self.values[i] = torch.cat([self.values[i], v], dim=-2)

    @torch.no_grad()
    def draft_hidden(self, anchor_id: int, embed_weight: torch.Tensor) -> torch.Tensor:
        """The block anchored at position `length` with token `anchor_id`: normed hidden states `[1, B, H]` of its
        slots (slot k = 1..B-1 predicts the token at position length+k)."""
        d = self.drafter
        w = d.fc.weight
        b = d.config.block_size
        ids = torch.full((1, b), d.config.mask_token_id, dtype=torch.long, device=w.device)
        ids[0, 0] = int(anchor_id)
        x = F.embedding(ids, embed_weight.to(w.device)).to(w.dtype)
        positions = torch.arange(self.length, self.length + b, device=w.device)[None]
        cos, sin = d.rotary_emb(positions, x.dtype)
        for layer, k, v in zip(d.layers, self.keys, self.values):
            x = layer.forward_context_kv(x, cos, sin, k, v, _attend)
        return d.norm(x)

    @torch.no_grad()
    def draft(self, anchor_id: int, embed_weight: torch.Tensor,
              target_lm_head_weight: torch.Tensor | None = None) -> list[int]:
        """The B-1 greedy draft tokens (target ids) after `anchor_id`: argmax of each slot 1..B-1 under the drafter's
        head (its own with a reduced vocabulary, else the target's `target_lm_head_weight`)."""
        d = self.drafter
        hidden = self.draft_hidden(anchor_id, embed_weight)[0, 1:]
        head = d.head_weight(target_lm_head_weight).to(device=hidden.device)
        draft_ids = (hidden.to(head.dtype) @ head.T).argmax(-1)
        return d.to_target_ids(draft_ids).tolist()


class DFlashProposer:
    """`BlockProposer` (`eagle3_zoo.drafters.base`) over a `DFlashDrafter`, the target's input embedding and (full
    draft vocabulary) the target's lm_head weight, with a persistent draft KV cache of the context
    (`DFlashContextCache`)."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor,
                 target_lm_head_weight: torch.Tensor | None = None):
        self.drafter = drafter
        self.embed_weight = embed_weight
        self.head = drafter.head_weight(target_lm_head_weight)  # raises for a full vocabulary without the target's
        self.num_draft = drafter.config.block_size - 1
        self.cache = DFlashContextCache(drafter)

    def reset(self) -> None:
        self.cache.reset()

    def extend(self, aux_hidden: torch.Tensor) -> None:
        self.cache.extend(aux_hidden)

    def propose(self, anchor_id: int) -> list[int]:
        return self.cache.draft(anchor_id, self.embed_weight, self.head)
