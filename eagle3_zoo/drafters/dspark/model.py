"""The DSpark drafter: the DFlash backbone (`DFlashDrafter`, unchanged) with every slot a prediction, a low-rank
Markov head and a confidence head.

    h_k       = DFlash backbone slot k of the block [anchor x_a, MASK x (B-1)] at position a+k   (k = 0..B-1)
    e_k       = markov_w1[prev_k]                      # prev_0 = the anchor, prev_k = the token at position a+k
    logits_k  = lm_head(h_k) + markov_w2(e_k)          # draft vocabulary; predicts the token at position a+k+1
    conf_k    = sigmoid(proj(cat(h_k, e_k)))           # (proj(h_k) without confidence_head_with_markov)

When decoding, prev_k is the token drafted at slot k-1 (sampled left to right, as vLLM 0.32's DSpark proposer does:
the Markov stage is sequential, the backbone one parallel forward); in training it is the sequence's own token at
a+k (teacher forcing). Weight names as vLLM 0.32's `qwen3_dspark.py` loads them: the DFlash ones,
`markov_head.markov_w1.weight [vocab_size, r]`, `markov_head.markov_w2.weight [draft_vocab_size, r]`,
`confidence_head.proj.{weight [1, H(+r)], bias [1]}`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.drafters.dspark.config import DSparkConfig


class DSparkMarkovHead(nn.Module):
    """Vanilla low-rank transition bias: previous token (target id) -> r-dim embedding -> draft-vocabulary bias."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.draft_vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(markov_embed)


class DSparkConfidenceHead(nn.Module):
    """Logit of a slot's acceptance probability, computed in fp32 (as vLLM 0.32 does)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        self.proj = nn.Linear(config.confidence_input_size, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The DSpark drafter. Like `DFlashDrafter`, the target's embedding (and, with the full vocabulary, its lm_head)
    is passed in and never stored; `training_forward` and `draft_block` are the backbone's, whose every slot is a
    prediction here."""

    config_class = DSparkConfig
    sample_from_anchor = True

    def __init__(self, config: DSparkConfig):
        if not isinstance(config, DSparkConfig):
            raise TypeError(f"DSparkDrafter needs a DSparkConfig, got {type(config).__name__}")
        super().__init__(config)
        self.markov_head = DSparkMarkovHead(config)
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None

    def logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor,
               target_lm_head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot hidden states `[..., H]` and the previous tokens `[...]` (target ids) -> (draft-vocabulary logits
        `[..., V_draft]` with the Markov bias, in fp32; the Markov embeddings `[..., r]`)."""
        head = self.head_weight(target_lm_head_weight)
        e = self.markov_head.embed(prev_ids)
        return (hidden @ head.to(hidden.dtype).T).float() + self.markov_head.bias(e).float(), e

    def confidence_logits(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """Acceptance logits `[...]` (sigmoid = the confidence vLLM reports); raises without a confidence head."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head = false)")
        return self.confidence_head(hidden, markov_embed)
