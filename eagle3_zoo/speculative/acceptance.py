"""Token selection: the sampling settings, plain next-token choice, and lossless acceptance over a draft tree.

Greedy (temperature 0): walk down the tree while the target's argmax is one of the current node's children; the
argmax at the first miss is the bonus token. This reproduces `generate(do_sample=False)` token for token.

Sampling (temperature > 0): the target's distribution p at a node is processed exactly as plain sampling does
(transformers' temperature, top-k and top-p warpers, in `generate`'s order). The children of the node are
deterministic draft candidates (top-k of the drafter, chosen before the target's randomness), so the multi-candidate
rule of SpecInfer / EAGLE-2 with a point-mass proposal applies: try the children in draft order, accept child c with
probability p(c); on rejection set p(c) = 0 and renormalise; if every child is rejected, sample the bonus token from
what is left. For any x, P(emit x) = p(x): each rejection step removes exactly the mass it tested, so the output
distribution equals p whatever the drafter proposes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle3_zoo.speculative.target import NodeLogits
from eagle3_zoo.speculative.tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings shared by speculative and plain decoding.

    Attributes:
        temperature: 0 = greedy; > 0 = sampling.
        top_k: Keep the k most likely tokens when sampling (0 = off). Note: `generate` defaults to 50; here off.
        top_p: Nucleus mass when sampling (1.0 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def warpers(self) -> LogitsProcessorList:
        """The warpers `generate(do_sample=True, temperature=..., top_k=..., top_p=...)` builds, in its order."""
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            procs.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=self.top_p))
        return procs

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed next-token distribution(s) for `logits` `[..., V]` (float64 for exact-ish residual updates)."""
        flat = logits.float().reshape(-1, logits.shape[-1])
        # the warpers ignore input_ids (no repetition penalties are supported)
        warped = self.warpers(torch.empty(flat.shape[0], 0, dtype=torch.long, device=flat.device), flat)
        return torch.softmax(warped.double(), dim=-1).reshape(logits.shape)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Plain decoding's choice from `logits` `[V]`: argmax, or a sample from the processed distribution."""
    if params.greedy:
        return int(logits.argmax(-1))
    return int(torch.multinomial(params.probs(logits), 1, generator=generator))


@dataclass
class Acceptance:
    """Outcome of verifying one tree.

    Attributes:
        path: Accepted node indices, root (0) first; `len(path) - 1` draft tokens were accepted.
        bonus: The target's own token after the path (correction on a miss, extra token on a full match).
        attempted_next: Whether the last accepted node had draft children (a further depth was tried and failed).
    """

    path: list[int]
    bonus: int
    attempted_next: bool


def accept(
    tree: DraftTree, logits: torch.Tensor | NodeLogits, params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Walk the tree with the target's logits (`logits[i]`: `[V]`, the distribution after node i's path)."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        if params.greedy:
            choice = int(logits[node].argmax(-1))
            hit = next((c for c in kids if tokens[c] == choice), None)
        else:
            hit, choice = _sample_node(logits[node], [tokens[c] for c in kids], kids, params, generator)
        if hit is None:
            return Acceptance(path=path, bonus=choice, attempted_next=bool(kids))
        path.append(hit)
        node = hit


def _sample_node(
    logits: torch.Tensor, kid_tokens: list[int], kids: list[int], params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int | None, int]:
    p = params.probs(logits)
    for token, kid in zip(kid_tokens, kids):
        u = torch.rand((), generator=generator, dtype=p.dtype, device=p.device)
        if bool(u < p[token]):
            return kid, token
        p = p.clone()
        p[token] = 0.0  # a point-mass proposal: the residual max(p - q, 0) is p without the tested token
        p = p / p.sum()
    return None, int(torch.multinomial(p, 1, generator=generator))
