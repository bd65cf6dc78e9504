"""The target side of speculative decoding: prefill, one-forward tree verification, and KV-cache pruning.

A whole draft tree is verified in ONE target forward: the nodes are flattened (parents first), each attends to the
whole accepted prefix plus its own ancestors through a 4D float mask `[1, 1, q, past + q]` (0 visible, dtype-min
hidden), and sits at RoPE position `past + depth`. With sdpa/eager attention in transformers 5.x a 4D mask is used
as given, so node i's logits equal a plain forward of its path. The same forward captures the aux hidden states
(the adapter's hooks), which feed the drafter's next cycle, so no extra target pass is needed. Afterwards the
target's `DynamicCache` keeps the prefix plus the accepted path only.

Sliding-window layers (Gemma 3, gpt-oss, Mistral with ``sliding_window``) keep full-length caches here (a sliding
cache drops entries a rejected branch may have pushed out, and the accepted path's slots move), and each layer kind
gets its own mask: a node at position p sees a key at position k only if ``p - window < k`` as well (transformers'
rule), so every node's logits equal a plain forward of its path through the sliding layers too. Attention sinks
(gpt-oss) are per-head logits that need no cache entry, so they need nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eagle3_zoo.adapters import TargetAdapter, adapter_for
from eagle3_zoo.speculative.tree import DraftTree

# attention kernels that take an arbitrary additive 4D mask
_MASKABLE_ATTENTION = ("sdpa", "eager")


class NodeLogits:
    """Target logits of tree nodes, computed on first access: acceptance only visits the accepted path and its last
    node, so the lm_head (up to a fifth of a small model's FLOPs per token) runs on a few rows, not all q.

    With `first_child` (node -> its best-scored child, -1 for a leaf), the first access of a node also computes the
    row of its first child (where acceptance walks next when the drafter's top guess holds) in the same matmul:
    where decoding is bound by reading weights (a CPU: one lm_head row reads the whole [V, H] matrix), two rows cost
    about one. More rows per matmul cost more than they save on a CPU (`prefetch`; chain 7 measured: 8 rows at once
    took 13.1 ms per cycle against 5.8 ms row by row), so the default is one."""

    def __init__(self, final_hidden: torch.Tensor, lm_head: nn.Module, first_child: list[int] | None = None,
                 prefetch: int = 1):
        self.final_hidden = final_hidden  # [q, H] post-norm
        self.lm_head = lm_head
        self.first_child = first_child
        self.prefetch = prefetch
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.final_hidden.shape[0]

    def __getitem__(self, node: int) -> torch.Tensor:
        """`[V]` float32 logits of the token after node `node`'s path."""
        if node not in self._rows:
            nodes = [node]
            child = self.first_child[node] if self.first_child is not None else -1
            while child >= 0 and child not in self._rows and len(nodes) <= self.prefetch:
                nodes.append(child)
                child = self.first_child[child]
            rows = self.lm_head(self.final_hidden[nodes]).float()
            self._rows.update(zip(nodes, rows))
        return self._rows[node]


class TargetRunner:
    """Drives a Hugging Face causal LM for one request at a time (batch size 1).

    Args:
        model: The target ``*ForCausalLM`` (frozen, eval mode).
        adapter: Its adapter; default ``adapter_for(model)``.
        layer_ids: Aux layers the drafter was trained on (internal convention); default the adapter's.
    """

    def __init__(self, model: nn.Module, adapter: TargetAdapter | None = None, layer_ids: Sequence[int] | None = None):
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in _MASKABLE_ATTENTION:
            raise ValueError(f"target attention implementation '{impl}' cannot take a tree mask; load the target with "
                             f"attn_implementation in {_MASKABLE_ATTENTION}")
        self.model = model
        self.adapter = adapter or adapter_for(model)
        windows = self.adapter.attention_windows(model.config)
        self._windows = {kind: window for kind, window in zip(getattr(model.config, "layer_types", None) or
                                                                   ["full_attention"] * len(windows), windows)}
        self._sliding = any(w is not None for w in windows)
        self.layer_ids = None if layer_ids is None else tuple(layer_ids)
        self.lm_head = self.adapter.lm_head(model)
        self.cache: DynamicCache | None = None
        self.length = 0  # tokens held in the cache

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def _forward(self, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        aux, final, _ = self.adapter.forward_features(
            self.model, input_ids, layer_ids=self.layer_ids, cache=self.cache, use_cache=True, **kwargs
        )
        return aux, final

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a request: run the prompt `[n]` through a fresh cache.

        Returns:
            The logits `[V]` (float32) at the last prompt position and the aux hidden `[1, n, F]` of the prompt.
        """
        # full-length layers for sliding-window targets too (the masks apply their windows)
        self.cache = DynamicCache() if self._sliding else DynamicCache(config=self.model.config)
        ids = input_ids.to(self.device).view(1, -1)
        n = ids.shape[1]
        kwargs = {}
        if self._sliding:
            pos = torch.arange(n, device=self.device)
            kwargs["attention_mask"] = self._masks(pos, pos, pos[None, :] <= pos[:, None])
        aux, final = self._forward(ids, **kwargs)
        for i, layer in enumerate(self.cache.layers):
            if type(layer) is not DynamicLayer:  # a cache that drops or moves entries a tree would need
                raise ValueError(f"target cache layer {i} is a {type(layer).__name__}; tree verification supports "
                                 f"DynamicLayer caches only")
        self.length = n
        return self.lm_head(final[:, -1]).float()[0], aux

    @torch.no_grad()
    def verify(self, tree: DraftTree) -> tuple[NodeLogits, torch.Tensor]:
        """Run all tree nodes (root included) in one forward appended to the cache.

        Returns:
            The nodes' logits (``logits[i]``: `[V]` float32, the target's distribution of the token after node i's
            path, computed on access) and the aux hidden `[1, n+1, F]` of the nodes.
        """
        past, q = self.length, len(tree)
        visible = torch.ones(q, past + q, dtype=torch.bool, device=self.device)
        visible[:, past:] = tree.ancestor_mask().to(self.device)
        positions = past + tree.depths.to(self.device)
        key_positions = torch.cat([torch.arange(past, device=self.device), positions])
        aux, final = self._forward(tree.tokens.to(self.device).unsqueeze(0),
                                   attention_mask=self._masks(positions, key_positions, visible),
                                   position_ids=positions.unsqueeze(0))
        first_child = [kids[0] if kids else -1 for kids in tree.children]
        return NodeLogits(final[0], self.lm_head, first_child), aux

    def _masks(self, positions: torch.Tensor, key_positions: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive 4D masks `[1, 1, q, k]` (0 visible, dtype-min hidden) from `visible` `[q, k]`, each layer kind's
        window applied by position: one tensor when every layer has the same window, else one per
        ``config.layer_types`` kind (the mapping transformers' hybrid models take in place of their own masks)."""
        dtype = self.lm_head.weight.dtype

        def mask(window: int | None) -> torch.Tensor:
            seen = visible
            if window is not None:
                seen = seen & (key_positions[None, :] > positions[:, None] - window)
            out = torch.zeros(1, 1, *seen.shape, dtype=dtype, device=self.device)
            return out.masked_fill_(~seen, torch.finfo(dtype).min)

        if len(set(self._windows.values())) == 1:
            return mask(next(iter(self._windows.values())))
        return {kind: mask(window) for kind, window in self._windows.items()}

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After `verify`, keep the prefix plus the tree nodes `nodes` (root first, in path order) in the cache."""
        past, nodes = self.length, list(nodes)
        keep = past + len(nodes)
        in_place = nodes == list(range(len(nodes)))  # a chain's path (nodes 0..a) already sits in slots past..keep-1
        idx = None if in_place else torch.tensor(nodes, dtype=torch.long, device=self.device) + past
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            # the accepted entries move to slots past..keep-1; the slice is a view, later updates concatenate anyway
            if idx is not None:
                keys, values = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)
            layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            if idx is not None:
                layer.keys[..., past:, :] = keys
                layer.values[..., past:, :] = values
        self.length = keep
