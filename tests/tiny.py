"""Tiny drafter/target builders shared by tests (no downloads)."""

from __future__ import annotations

import torch
from torch import nn

from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab


def tiny_config(**overrides) -> Eagle3Config:
    kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
              vocab_size=96, draft_vocab_size=64, target_hidden_size=24, rope_theta=10000.0, rms_norm_eps=1e-6,
              max_position_embeddings=256, aux_layer_ids=(2, 3, 5))
    kw.update(overrides)
    return Eagle3Config(**kw)


def tiny_drafter(seed: int = 0, **overrides) -> tuple[Eagle3Drafter, nn.Embedding]:
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides)
    drafter = Eagle3Drafter(cfg)
    drafter.reset_parameters(std=0.2)  # larger than the init default so that attention patterns matter in tests
    for norm in (drafter.midlayer.input_layernorm, drafter.midlayer.hidden_norm,
                 drafter.midlayer.post_attention_layernorm, drafter.norm):
        norm.weight.data.uniform_(0.5, 1.5)
    counts = torch.randint(0, 50, (cfg.vocab_size,))
    drafter.set_vocab(*build_draft_vocab(counts, cfg.draft_vocab_size))
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.requires_grad_(False)
    return drafter, embed


def tiny_drafter31(seed: int = 0, **overrides) -> tuple[Eagle3Drafter, nn.Embedding]:
    """`tiny_drafter` with EAGLE-3.1 options (`fc_norm=True`, `norm_output=True` in `overrides`); its fc_norm weights
    drawn away from 1 so that they matter."""
    drafter, embed = tiny_drafter(seed=seed, **overrides)
    if drafter.fc_norm is not None:
        for norm in drafter.fc_norm:
            norm.weight.data.uniform_(0.3, 3.0)
    return drafter, embed
