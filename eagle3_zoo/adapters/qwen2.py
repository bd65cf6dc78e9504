"""Qwen-2.5 targets (HF ``model_type == "qwen2"``)."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("qwen2")
class Qwen2Adapter(TargetAdapter):
    """Qwen-2.5 (ChatML with Qwen's default system prompt, ``<|im_end|>``); q/k/v projections carry biases."""

    decoder_layer_class = "Qwen2DecoderLayer"
    chat_format_names = ("chatml-qwen2.5",)

    # 4 layers, hidden 64, GQA 4/2 heads, tied embeddings (as Qwen2.5-0.5B..3B).
    tiny_config_fields = dict(  # over TINY_SHAPE
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )
