"""Lossless speculative generation (chain or EAGLE-2 tree) and the plain KV-cache baseline, batch size 1.

One request:
  1. prefill: the target reads the prompt (capturing aux features) and picks the first token like plain decoding;
     the drafter reads the prompt rows.
  2. cycle: draft a tree below the last emitted token, verify it in one target forward, accept a path plus the
     target's bonus token, prune the target cache to the path, append the path's features to the drafter's cache.
  3. stop exactly where `generate` would: at the first EOS/stop token (kept) or at `max_new_tokens`, even inside
     an accepted draft.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from eagle3_zoo.adapters import TargetAdapter, adapter_for
from eagle3_zoo.adapters.capture import cache_kwargs
from eagle3_zoo.drafters import kind_of
from eagle3_zoo.speculative.acceptance import SamplingParams, accept, next_token
from eagle3_zoo.speculative.draft import DraftModel
from eagle3_zoo.speculative.target import TargetRunner
from eagle3_zoo.speculative.tree import build_tree
from eagle3_zoo.values.draft_shapes import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS, TreeSpec

MODES = ("tree", "chain")


def tree_spec(mode: str, depth: int = DEFAULT_DEPTH, top_k: int = DEFAULT_TOP_K,
              total_tokens: int = DEFAULT_TOTAL_TOKENS, min_prob: float = 0.0) -> TreeSpec:
    """The draft shape of a mode: `tree` (EAGLE-2 dynamic tree) or `chain` (`depth` tokens, top-1 each), cut where
    the cumulative draft probability drops below `min_prob` (0 = never)."""
    if mode == "tree":
        return TreeSpec(depth=depth, top_k=top_k, total_tokens=total_tokens, min_prob=min_prob)
    if mode == "chain":
        return TreeSpec.chain(depth, min_prob)
    raise ValueError(f"unknown speculative mode {mode!r}; valid: {', '.join(MODES)}")


@dataclass
class GenerationOutput:
    """One request's result.

    Attributes:
        tokens: New tokens (prompt excluded), including a final EOS/stop token if one ended the request.
        seconds: Wall time of the request (prefill included).
        stop_reason: ``"eos"`` or ``"length"``.
        accept_lengths: Per verification cycle, draft tokens the verifier accepted (before any stop truncation).
        attempted_next: Per cycle, whether the tree had a child below the last accepted node (a deeper try failed).
    """

    tokens: list[int]
    seconds: float = 0.0
    stop_reason: str = "length"
    accept_lengths: list[int] = field(default_factory=list)
    attempted_next: list[bool] = field(default_factory=list)

    @property
    def cycles(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float | None:
        """Mean tokens per verification cycle (accepted drafts + the bonus token); None without cycles."""
        return (sum(self.accept_lengths) + self.cycles) / self.cycles if self.cycles else None


def eos_ids(model: nn.Module, eos_token_id: int | Iterable[int] | None) -> set[int]:
    """The stop ids `generate` uses: the argument, else the model's `generation_config.eos_token_id`."""
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


def _emit(out: list[int], new: Sequence[int], max_new_tokens: int, stop: set[int]) -> str | None:
    for token in new:
        out.append(int(token))
        if token in stop:
            return "eos"
        if len(out) >= max_new_tokens:
            return "length"
    return None


def _request_args(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams | None,
                  eos_token_id: int | Iterable[int] | None) -> tuple[torch.Tensor, SamplingParams, set[int]]:
    """The prompt as `[n]`, the sampling params (greedy by default) and the stop ids of one request: the same for
    speculative and plain decoding."""
    ids = input_ids.reshape(-1) if input_ids.dim() == 1 or input_ids.shape[0] == 1 else None
    if ids is None:
        raise ValueError(f"batch size 1 only: input_ids has shape {tuple(input_ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return ids, sampling or SamplingParams(), eos_ids(model, eos_token_id)


class SpeculativeGenerator:
    """Speculative decoding of a Hugging Face causal LM with a drafter of a registered kind (or any `DraftModel`).

    Args:
        target: The target ``*ForCausalLM`` (frozen, eval mode, sdpa or eager attention).
        drafter: A trained drafter of a registered kind (`eagle3_zoo.drafters`: wrapped, with the target's
            embedding, in its kind's `DraftModel`) or a `DraftModel`.
        tree: Draft shape (`tree_spec(mode, ...)`); default EAGLE-2 depth 8, top-k 10, 60 nodes.
        adapter: The target's adapter; default ``adapter_for(target)``.
        layer_ids: Aux layers; default the ones the drafter's kind reads (`DrafterKind.features`; else the adapter
            default).
    """

    def __init__(
        self,
        target: nn.Module,
        drafter: nn.Module | DraftModel,
        tree: TreeSpec | None = None,
        adapter: TargetAdapter | None = None,
        layer_ids: Sequence[int] | None = None,
    ):
        adapter = adapter or adapter_for(target)
        if not isinstance(drafter, DraftModel):
            kind = kind_of(drafter)
            problems = kind.target_mismatches(drafter, target.config)
            if problems:
                raise ValueError("drafter does not fit the target: " + "; ".join(problems))
            layer_ids = layer_ids or kind.features(drafter.config).aux_layer_ids
            drafter = kind.draft_model(drafter, adapter.embed_tokens(target))
        self.target = target
        self.draft = drafter
        self.tree = tree or TreeSpec()
        self.runner = TargetRunner(target, adapter, layer_ids)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` after `input_ids` (`[n]` or `[1, n]`).

        Args:
            input_ids: The prompt.
            max_new_tokens: Upper bound on new tokens.
            sampling: Greedy by default.
            eos_token_id: Stop id(s); default the target's ``generation_config.eos_token_id``.
            generator: RNG for sampling, on the target's device.
        """
        ids, sampling, stop = _request_args(self.target, input_ids, max_new_tokens, sampling, eos_token_id)
        start = time.perf_counter()
        self.draft.reset()
        logits, aux = self.runner.prefill(ids)
        first = next_token(logits, sampling, generator)
        out = GenerationOutput(tokens=[])
        reason = _emit(out.tokens, [first], max_new_tokens, stop)
        ids = ids.to(self.runner.device)
        draft_out = None if reason else self.draft.extend(aux, ids, torch.cat([ids[1:], ids.new_tensor([first])]))
        root = first
        while reason is None:
            tree = build_tree(self.draft, root, draft_out, self.tree)
            logits, aux = self.runner.verify(tree)
            result = accept(tree, logits, sampling, generator)
            out.accept_lengths.append(len(result.path) - 1)
            out.attempted_next.append(result.attempted_next)
            path_tokens = tree.tokens[result.path].to(self.runner.device)
            reason = _emit(out.tokens, [*path_tokens[1:].tolist(), result.bonus], max_new_tokens, stop)
            if reason is None:
                self.runner.keep_path(result.path)
                next_ids = torch.cat([path_tokens[1:], path_tokens.new_tensor([result.bonus])])
                draft_out = self.draft.extend(aux[:, result.path], path_tokens, next_ids)
                root = result.bonus
        out.stop_reason = reason
        out.seconds = _elapsed(start, self.runner.device)
        return out


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def plain_generate(
    target: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationOutput:
    """The baseline: plain target decoding with a `DynamicCache`, one token per forward, same stop rules."""
    ids, sampling, stop = _request_args(target, input_ids, max_new_tokens, sampling, eos_token_id)
    device = next(target.parameters()).device
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    kwargs = cache_kwargs(target, {"cache": cache, "use_cache": True, "logits_to_keep": 1})
    step_ids = ids.to(device).view(1, -1)
    out = GenerationOutput(tokens=[])
    reason = None
    while reason is None:
        logits = target(input_ids=step_ids, **kwargs).logits[0, -1].float()
        token = next_token(logits, sampling, generator)
        reason = _emit(out.tokens, [token], max_new_tokens, stop)
        step_ids = step_ids.new_tensor([[token]])
    out.stop_reason = reason
    out.seconds = _elapsed(start, device)
    return out
