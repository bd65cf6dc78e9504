"""Qwen3 mixture-of-experts targets (HF ``model_type == "qwen3_moe"``): Qwen3-30B-A3B, Qwen3-235B-A22B."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("qwen3_moe")
class Qwen3MoeAdapter(TargetAdapter):
    """Qwen3-MoE: every layer sparse (128 experts, top-8), Qwen3's attention and chat format.

    Aux layers: the shared rule (2, N//2, N-3), as vLLM and SGLang default for Qwen3-MoE; Qwen3-30B-A3B (48
    layers): (2, 24, 45). The drafter's MLP follows the config's dense ``intermediate_size`` (6144 for 30B-A3B),
    as SpecForge's ``configs/qwen3-30B-eagle3.json`` does.
    """

    decoder_layer_class = "Qwen3MoeDecoderLayer"
    chat_format_names = ("qwen3",)

    # 4 layers, hidden 64, GQA 4/2 heads of 16, 4 experts of width 64 (top-2, renormalised as
    # Qwen3-30B-A3B) in every layer.
    tiny_config_fields = dict(  # over TINY_SHAPE
        moe_intermediate_size=64,
        norm_topk_prob=True,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )
