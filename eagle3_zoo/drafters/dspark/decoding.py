"""The drafter side of DSpark decoding (batch size 1): `DSparkProposer`, the `BlockProposer` that drafts a block as
vLLM 0.32's DSpark proposer does with greedy drafting (see `eagle3_zoo.speculative.dspark_decode`)."""

from __future__ import annotations

import torch

from eagle3_zoo.drafters.dflash.decoding import DFlashContextCache
from eagle3_zoo.drafters.dspark.model import DSparkDrafter


class DSparkProposer:
    """`BlockProposer` over a `DSparkDrafter`, the target's input embedding and (full draft vocabulary) the target's
    lm_head weight."""

    def __init__(self, drafter: DSparkDrafter, embed_weight: torch.Tensor,
                 target_lm_head_weight: torch.Tensor | None = None):
        self.drafter = drafter
        self.embed_weight = embed_weight
        self.head = drafter.head_weight(target_lm_head_weight)
        self.num_draft = drafter.config.num_draft
        self.cache = DFlashContextCache(drafter)
        self.confidence: list[list[float]] = []

    def reset(self) -> None:
        self.cache.reset()
        self.confidence = []

    def extend(self, aux_hidden: torch.Tensor) -> None:
        self.cache.extend(aux_hidden)

    @torch.no_grad()
    def propose(self, anchor_id: int) -> list[int]:
        d = self.drafter
        hidden = self.cache.draft_hidden(anchor_id, self.embed_weight)[0]  # [B, H], one parallel forward
        base = (hidden @ self.head.to(device=hidden.device, dtype=hidden.dtype).T).float()
        prev = torch.tensor([int(anchor_id)], device=hidden.device)
        drafts, embeds = [], []
        for k in range(d.config.num_draft):  # the sequential Markov stage
            e = d.markov_head.embed(prev)
            embeds.append(e)
            draft_id = (base[k] + d.markov_head.bias(e)[0].float()).argmax(-1, keepdim=True)
            prev = d.to_target_ids(draft_id)
            drafts.append(int(prev))
        if d.confidence_head is not None:
            self.confidence.append(torch.sigmoid(d.confidence_logits(hidden, torch.cat(embeds))).tolist())
        return drafts
