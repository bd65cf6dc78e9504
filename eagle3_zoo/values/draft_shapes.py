"""Draft shapes: `TreeSpec`, its text form (`chain:K`, `tree:D/K/N`) and the serving engines' flags for it.

Torch-free, and below every folder that uses it: the `eval` argument parser validates `--shapes` and the model card
maps a shape to flags without importing torch (or `speculative/`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SHAPE_SYNTAX = ("chain:K (K draft tokens, top-1 each) or tree:D/K/N (depth D, top-k K, N draft nodes), optionally "
                "followed by @P (draft only nodes whose cumulative draft probability is >= P, 0 <= P < 1)")
# the default draft shape (the EAGLE-3 paper's tree: depth 8, top-k 10, 60 draft nodes): `eval`, the tau callback,
# `tree_spec` and the model card read it from here
DEFAULT_DEPTH = 8
DEFAULT_TOP_K = 10
DEFAULT_TOTAL_TOKENS = 60
_CHAIN = re.compile(r"chain:(\d+)(?:@([0-9.eE+-]+))?")
_TREE = re.compile(r"tree:(\d+)/(\d+)/(\d+)(?:@([0-9.eE+-]+))?")


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree.

    Attributes:
        depth: Maximum number of draft tokens on a path (chain: the chain length K).
        top_k: Children proposed per expanded node, and frontier nodes kept per depth.
        total_tokens: Draft nodes kept after reranking (the root, i.e. the last emitted token, not counted).
        min_prob: Draft only nodes whose cumulative draft probability (the product of the drafter's probabilities
            along the node's path, EAGLE-2's score: its estimate of the chance the node is accepted) is at least
            this; 0 = off. A node costs verification time whether or not it is accepted, so where verifying more
            tokens is not free (a CPU) the tree shrinks where the drafter is unsure, down to no draft at all (the
            cycle is then one plain decoding step). Lossless either way: the verifier checks whatever is drafted.
    """

    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K
    total_tokens: int = DEFAULT_TOTAL_TOKENS
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"tree {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1) (0 = off), got {self.min_prob}")

    @classmethod
    def chain(cls, length: int, min_prob: float = 0.0) -> TreeSpec:
        """A chain of `length` draft tokens (cut where the cumulative draft probability drops below `min_prob`)."""
        return cls(depth=length, top_k=1, total_tokens=length, min_prob=min_prob)

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """`chain:K` or `tree:D/K/N` (see `SHAPE_SYNTAX`); raises ValueError naming the valid forms."""
        text = text.strip()
        spec = None
        try:
            if m := _CHAIN.fullmatch(text):
                spec = cls.chain(int(m[1]), float(m[2] or 0))
            elif m := _TREE.fullmatch(text):
                spec = cls(int(m[1]), int(m[2]), int(m[3]), float(m[4] or 0))
        except ValueError:  # a number out of range, or a probability that is no number
            spec = None
        if spec is None:
            raise ValueError(f"bad draft shape {text!r}: expected {SHAPE_SYNTAX}, numbers >= 1, "
                             f"e.g. chain:1 or tree:8/10/60")
        return spec

    @property
    def is_chain(self) -> bool:
        """One draft token per depth (top-1): the tree is a chain of `min(depth, total_tokens)` tokens."""
        return self.top_k == 1

    @property
    def label(self) -> str:
        """The text form `parse` reads back (a top-1 tree is written as the chain it is)."""
        cut = f"@{self.min_prob:g}" if self.min_prob else ""
        if self.is_chain:
            return f"chain:{min(self.depth, self.total_tokens)}{cut}"
        return f"tree:{self.depth}/{self.top_k}/{self.total_tokens}{cut}"

    @property
    def verified_tokens(self) -> int:
        """Tokens one verification forward reads at most: the draft nodes plus the root (with `min_prob`, fewer
        where the drafter is unsure)."""
        return (min(self.depth, self.total_tokens) if self.is_chain else self.total_tokens) + 1

    def serving_flags(self) -> dict[str, int]:
        """The same shape in SGLang's EAGLE flags (`--speculative-num-steps / -eagle-topk / -num-draft-tokens`,
        whose draft-token count includes the root, so a chain of K is K + 1) and vLLM's `num_speculative_tokens`
        (a chain length; vLLM's EAGLE-3 drafts chains). Neither engine cuts drafts by `min_prob`: the flags give
        the shape without the cut."""
        depth = min(self.depth, self.total_tokens)
        return {"sglang_num_steps": depth, "sglang_topk": self.top_k,
                "sglang_num_draft_tokens": self.verified_tokens, "vllm_num_speculative_tokens": depth}


MAX_DRAFT_TOKENS = 4096  # the bound on a draft's depth and nodes where the target's context length is unknown


def shape_problem(spec: TreeSpec, context: int | None, max_new_tokens: int) -> str | None:
    """Why `spec` cannot decode requests of up to `max_new_tokens` tokens on a target whose context is `context`
    tokens (None: unknown), else None: checked before decoding, since a draft deeper than the room left runs for
    ever (one drafter step per depth, every cycle) and a tree with more nodes than the context holds allocates its
    attention mask over all of them.

    Within the context, a draft must leave room for the answer: the last cycle's nodes sit up to `depth` positions
    past the `max_new_tokens`-th new token, and one verification forward appends all `verified_tokens`.
    """
    room = context - max_new_tokens if context else MAX_DRAFT_TOKENS
    where = (f"the target's context of {context} tokens minus --max-new-tokens {max_new_tokens}" if context else
             f"{MAX_DRAFT_TOKENS} (the target does not say its context length)")
    if room < 2:
        return (f"--max-new-tokens {max_new_tokens} leaves no room for a draft in the target's context of {context} "
                "tokens; lower --max-new-tokens")
    for what, value in (("depth", min(spec.depth, spec.total_tokens)), ("verified tokens", spec.verified_tokens)):
        if value > room:
            return (f"draft shape {spec.label}: {what} {value} exceeds {where} = {room}; use a shape of at most "
                    f"{room - 1} draft tokens (e.g. chain:{min(room - 1, 8)} or tree:{min(room - 1, 8)}/10/"
                    f"{min(room - 1, 60)}) or lower --max-new-tokens")
    return None


def spec_from_settings(settings: dict[str, Any]) -> TreeSpec | None:
    """The `TreeSpec` of an eagle3-zoo evaluation's settings (`mode, depth, top_k, total_tokens`), else None."""
    try:
        depth, min_prob = int(settings["depth"]), float(settings.get("min_prob") or 0)
        if settings.get("mode") == "chain":
            return TreeSpec.chain(depth, min_prob)
        return TreeSpec(depth, int(settings["top_k"]), int(settings["total_tokens"]), min_prob)
    except (KeyError, TypeError, ValueError):
        return None


def parse_shapes(text: str) -> list[TreeSpec]:
    """Comma-separated shapes (`chain:1,tree:1/2/2,tree:8/10/60`); duplicates and empty lists are errors."""
    specs = [TreeSpec.parse(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise ValueError(f"no draft shape in {text!r}: expected a comma-separated list of {SHAPE_SYNTAX}")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate draft shape in {text!r} (as shapes: {', '.join(labels)})")
    return specs
