"""Draft shapes: `TreeSpec`, its text form (`chain:K`, `tree:D/K/N`) and the serving engines' flags for it.

Torch-free, so the `eval` argument parser can validate `--shapes` and the model card can map a shape to flags
without importing torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SHAPE_SYNTAX = "chain:K (K draft tokens, top-1 each) or tree:D/K/N (depth D, top-k K, N draft nodes)"
_CHAIN = re.compile(r"chain:(\d+)")
_TREE = re.compile(r"tree:(\d+)/(\d+)/(\d+)")


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree.

    Attributes:
        depth: Maximum number of draft tokens on a path (chain: the chain length K).
        top_k: Children proposed per expanded node, and frontier nodes kept per depth.
        total_tokens: Draft nodes kept after reranking (the root, i.e. the last emitted token, not counted).
    """

    depth: int = 8
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"tree {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def chain(cls, length: int) -> TreeSpec:
        """A chain of `length` draft tokens."""
        return cls(depth=length, top_k=1, total_tokens=length)

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """`chain:K` or `tree:D/K/N` (see `SHAPE_SYNTAX`); raises ValueError naming the valid forms."""
        text = text.strip()
        if m := _CHAIN.fullmatch(text):
            spec = cls.chain(int(m[1])) if int(m[1]) >= 1 else None
        elif m := _TREE.fullmatch(text):
            depth, top_k, total = map(int, m.groups())
            spec = cls(depth, top_k, total) if min(depth, top_k, total) >= 1 else None
        else:
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
        if self.is_chain:
            return f"chain:{min(self.depth, self.total_tokens)}"
        return f"tree:{self.depth}/{self.top_k}/{self.total_tokens}"

    @property
    def verified_tokens(self) -> int:
        """Tokens one verification forward reads at most: the draft nodes plus the root."""
        return (min(self.depth, self.total_tokens) if self.is_chain else self.total_tokens) + 1

    def serving_flags(self) -> dict[str, int]:
        """The same shape in SGLang's EAGLE flags (`--speculative-num-steps / -eagle-topk / -num-draft-tokens`,
        whose draft-token count includes the root, so a chain of K is K + 1) and vLLM's `num_speculative_tokens`
        (a chain length; vLLM's EAGLE-3 drafts chains)."""
        depth = min(self.depth, self.total_tokens)
        return {"sglang_num_steps": depth, "sglang_topk": self.top_k,
                "sglang_num_draft_tokens": self.verified_tokens, "vllm_num_speculative_tokens": depth}


def spec_from_settings(settings: dict[str, Any]) -> TreeSpec | None:
    """The `TreeSpec` of an eagle3-zoo evaluation's settings (`mode, depth, top_k, total_tokens`), else None."""
    try:
        depth = int(settings["depth"])
        if settings.get("mode") == "chain":
            return TreeSpec.chain(depth)
        return TreeSpec(depth, int(settings["top_k"]), int(settings["total_tokens"]))
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
