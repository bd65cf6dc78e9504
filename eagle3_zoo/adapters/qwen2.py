"""Qwen-2.5 targets (HF ``model_type == "qwen2"``)."""

from __future__ import annotations

from transformers import Qwen2Config

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("qwen2")
class Qwen2Adapter(TargetAdapter):
    """Qwen-2.5 (ChatML with Qwen's default system prompt, ``<|im_end|>``); q/k/v projections carry biases."""

    decoder_layer_class = "Qwen2DecoderLayer"
    chat_format_names = ("chatml-qwen2.5",)

    def tiny_config(self) -> Qwen2Config:
        """4 layers, hidden 64, GQA 4/2 heads, tied embeddings (as Qwen2.5-0.5B..3B)."""
        return Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
        )
