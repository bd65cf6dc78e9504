"""DSpark drafter configuration (torch-free) and the `config.json` layout vLLM 0.32's `qwen3_dspark.py` loads.

A DSpark drafter is a DFlash drafter (`DFlashConfig`: the same backbone, feature layers, mask token and block) with
two heads on top, and one change of slot semantics:

- `sample_from_anchor`: every one of the `block_size` slots predicts the NEXT token (slot k at position a+k predicts
  x_{a+k+1}; the anchor slot predicts x_{a+1}), so a block drafts `block_size` tokens (vLLM 0.32 sets
  `num_speculative_tokens = block_size` for DSpark), where a DFlash block drafts `block_size - 1`.
- the Markov head (`markov_rank` r, "vanilla"): `markov_w1 [vocab_size, r]` embeds the previous token (target ids),
  `markov_w2 [draft_vocab_size, r]` turns it into a bias added to the slot's draft-vocabulary logits.
- the confidence head (`enable_confidence_head`): `proj` (with bias, fp32 in vLLM) maps the slot's hidden state
  (concatenated with the previous token's Markov embedding when `confidence_head_with_markov`) to the logit of its
  acceptance probability.

The `config.json` is the z-lab DFlash one (`dflash_config: {mask_token_id, target_layer_ids}`, vLLM aux id =
target_layer_id + 1) with `architectures: ["Qwen3DSparkModel"]` (vLLM's architecture name, also the key of its
method detection) and the top-level keys vLLM reads: `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, `sample_from_anchor` (top level: vLLM's DFlash proposer refuses it inside
`dflash_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3_zoo.drafters.dflash.config import DFlashConfig

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM 0.32 registry: ("qwen3_dspark", "Qwen3DSparkForCausalLM")
MARKOV_HEAD_TYPES = ("vanilla",)


@dataclass
class DSparkConfig(DFlashConfig):
    """A `DFlashConfig` plus DSpark's Markov and confidence heads (see the module docstring)."""

    markov_rank: int = 256  # r of markov_w1 [V, r] / markov_w2 [V_draft, r]
    markov_head_type: str = "vanilla"  # the low-rank transition bias; vLLM 0.32 serves only this one
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # proj reads cat(hidden, markov_w1[prev]); vLLM's default when absent
    # is False, so the key is always written

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 1:
            problems.append(f"markov_rank={self.markov_rank!r}; expected an integer >= 1 (vLLM 0.32 always builds "
                            "the Markov head)")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            problems.append(f"markov_head_type={self.markov_head_type!r}; valid: {', '.join(MARKOV_HEAD_TYPES)}")
        for name in ("enable_confidence_head", "confidence_head_with_markov"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r}; expected true or false")
        if problems:
            raise ValueError("invalid DSparkConfig: " + "; ".join(problems))

    @property
    def num_draft(self) -> int:
        """Tokens one block drafts: every slot, the anchor's included (`sample_from_anchor`)."""
        return self.block_size

    @property
    def confidence_input_size(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    def parameter_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """`DFlashConfig.parameter_shapes` plus the heads: name -> (shape, kind); kinds "linear" and "norm" as there,
        "embedding" (`markov_w1`, read by index) and "fp32" (the confidence head, kept in fp32 by vLLM)."""
        shapes = super().parameter_shapes()
        shapes["markov_head.markov_w1.weight"] = ((self.vocab_size, self.markov_rank), "embedding")
        shapes["markov_head.markov_w2.weight"] = ((self.draft_vocab_size, self.markov_rank), "linear")
        if self.enable_confidence_head:
            shapes["confidence_head.proj.weight"] = ((1, self.confidence_input_size), "fp32")
            shapes["confidence_head.proj.bias"] = ((1,), "fp32")
        return shapes

    def to_json_dict(self) -> dict[str, Any]:
        """The DFlash z-lab `config.json` as vLLM 0.32's Qwen3 DSpark loader reads it (see the module docstring)."""
        d = super().to_json_dict()
        d["architectures"] = [ARCHITECTURE]
        d.update(markov_rank=self.markov_rank, markov_head_type=self.markov_head_type,
                 enable_confidence_head=self.enable_confidence_head,
                 confidence_head_with_markov=self.confidence_head_with_markov, sample_from_anchor=True)
        return d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], source: str = "config.json") -> DSparkConfig:
        """Read a `config.json` `to_json_dict` wrote (or a Qwen3 DSpark one with the same keys)."""
        d = dict(d)
        problems = []
        if d.pop("sample_from_anchor", True) is not True:
            problems.append("sample_from_anchor is not true; only anchor-as-first-prediction blocks (vLLM 0.32's "
                            "default for DSpark) are supported")
        if d.pop("dspark_bonus_anchor", False) is not False:
            problems.append("dspark_bonus_anchor is not false; unsupported")
        if "markov_rank" not in d:
            problems.append("no markov_rank (vLLM 0.32's Qwen3 DSpark loader needs it)")
        if problems:
            raise ValueError(f"{source}: " + "; ".join(problems))
        return super().from_json_dict(d, source)
