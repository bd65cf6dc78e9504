"""Target features for EAGLE-3: aux hidden states by forward pre-hooks, and chunked frozen-lm_head logits.

The pre-hook reads the residual stream *entering* a decoder layer, i.e. HF `output_hidden_states[i]` (the internal
aux-layer convention), without materialising all N hidden states (`output_hidden_states=True` on a 70B target keeps
80 full-size tensors alive). Hooks are registered per call and always removed, so the model carries no state.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class TargetLayout(Protocol):
    """What capture needs to know of a target: where its decoder layers and lm_head are, and its default aux layers
    (a `TargetAdapter` is one; typed structurally so that this module, which `adapters.base` uses, imports nothing
    back from it)."""

    def aux_layer_ids(self, num_layers: int) -> tuple[int, int, int]: ...

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList: ...

    def lm_head(self, model: nn.Module) -> nn.Linear: ...


class AuxHiddenCapture:
    """Residual-stream tensors captured entering the selected decoder layers during the last forward.

    Attributes:
        layer_ids: The captured layer indices (internal convention), in (low, mid, high) order.
    """

    def __init__(self, layer_ids: Sequence[int]):
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self._states: dict[int, torch.Tensor] = {}

    @property
    def hidden_states(self) -> tuple[torch.Tensor, ...]:
        """One ``[B, T, H]`` tensor per entry of `layer_ids`.

        Raises:
            RuntimeError: if no forward ran through all selected layers inside the capture.
        """
        missing = [i for i in self.layer_ids if i not in self._states]
        if missing:
            raise RuntimeError(f"no hidden state was captured for layers {missing}: run the forward inside the block")
        return tuple(self._states[i] for i in self.layer_ids)

    @property
    def aux_hidden(self) -> torch.Tensor:
        """``[B, T, len(layer_ids) * H]``: the captured states concatenated on the last dim (low, mid, high)."""
        return torch.cat(self.hidden_states, dim=-1)


@contextmanager
def capture_aux_hidden(
    model: nn.Module, adapter: TargetLayout, layer_ids: Sequence[int] | None = None
) -> Iterator[AuxHiddenCapture]:
    """Capture the residual stream entering `layer_ids` during forwards run inside the block.

    Works with any call of the target (full sequence, KV-cache increments, 4D float masks with explicit
    `position_ids` for tree verification); each forward overwrites the previous capture.

    Args:
        model: The target (``*ForCausalLM`` or its base model).
        adapter: The target's adapter (locates the decoder layers).
        layer_ids: Internal aux-layer ids (HF ``output_hidden_states`` indices, 0..N-1); default
            ``adapter.aux_layer_ids(N)``.

    Yields:
        An `AuxHiddenCapture`; read ``.aux_hidden`` after the forward (also after the block).

    Raises:
        ValueError: if a layer id is outside 0..N-1.
    """
    layers = adapter.decoder_layers(model)
    ids = tuple(adapter.aux_layer_ids(len(layers)) if layer_ids is None else layer_ids)
    bad = [i for i in ids if not 0 <= int(i) < len(layers)]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range: the target has {len(layers)} decoder layers (0..N-1)")
    capture = AuxHiddenCapture(ids)
    handles = []
    try:
        for layer_id in dict.fromkeys(capture.layer_ids):  # one hook per distinct layer, order kept
            hook = _make_pre_hook(capture._states, layer_id)
            handles.append(layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True))
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def _make_pre_hook(store: dict[int, torch.Tensor], layer_id: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        # transformers 5.x passes hidden_states positionally; gradient checkpointing or other callers may use the
        # keyword, so accept both.
        store[layer_id] = args[0] if args else kwargs["hidden_states"]

    return hook


def cache_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return `kwargs` with the KV cache under the name `module.forward` takes.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (old name warns, removal announced for 5.40); callers
    may use either name and we pass what the installed model expects.
    """
    params = inspect.signature(module.forward).parameters
    new, old = "cache", "past_key_values"
    if old in kwargs and new in params and old not in params:
        kwargs = {**kwargs, new: kwargs[old]}
        del kwargs[old]
    elif new in kwargs and old in params and new not in params:
        kwargs = {**kwargs, old: kwargs[new]}
        del kwargs[new]
    return kwargs


def output_cache(outputs: Any) -> Any:
    """The KV cache of a model output under either name (``cache`` in transformers 5.24, ``past_key_values``)."""
    for name in ("cache", "past_key_values"):
        if name in outputs.keys():  # ModelOutput lists only the fields that are set
            return outputs[name]
    return None


@torch.no_grad()
def target_logits(
    model: nn.Module,
    adapter: TargetLayout,
    final_hidden: torch.Tensor,
    vocab_ids: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Frozen target lm_head applied to `final_hidden` in sequence chunks, optionally to a subset of vocab rows.

    Args:
        model: The target model.
        adapter: Its adapter (locates the lm_head).
        final_hidden: ``[..., T, H]`` post-norm final hidden states.
        vocab_ids: ``None`` (full vocabulary), a 1-D LongTensor of target ids, or a bool mask over the target vocab
            (e.g. the drafter's ``t2d``); rows are returned in ascending id order for a mask.
        chunk_size: Sequence positions per matmul (bounds the temporary memory of one chunk).

    Returns:
        ``[..., T, V]`` or ``[..., T, len(vocab_ids)]`` logits, equal to the full logits sliced.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    head = adapter.lm_head(model)
    if vocab_ids is None:
        chunks = [head(h) for h in final_hidden.split(chunk_size, dim=-2)]
        return torch.cat(chunks, dim=-2)
    ids = _vocab_index(vocab_ids, head.weight.shape[0]).to(head.weight.device)
    weight = head.weight.index_select(0, ids)
    bias = head.bias.index_select(0, ids) if getattr(head, "bias", None) is not None else None
    chunks = [F.linear(h, weight, bias) for h in final_hidden.split(chunk_size, dim=-2)]
    return torch.cat(chunks, dim=-2)


def _vocab_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if vocab_ids.dtype == torch.bool:
        if vocab_ids.shape != (vocab_size,):
            raise ValueError(f"vocab mask has shape {tuple(vocab_ids.shape)}, expected ({vocab_size},)")
        return vocab_ids.nonzero().squeeze(-1)
    ids = vocab_ids.long().reshape(-1)
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"vocab ids must lie in 0..{vocab_size - 1}")
    return ids
