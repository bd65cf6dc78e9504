"""LLaMA-3.x and SmolLM2 targets (both report HF ``model_type == "llama"``)."""

from __future__ import annotations

from transformers import LlamaConfig

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("llama")
class LlamaAdapter(TargetAdapter):
    """LLaMA-3.x (Llama-3 header format, ``<|eot_id|>``) and SmolLM2 (ChatML, ``<|im_end|>``)."""

    decoder_layer_class = "LlamaDecoderLayer"
    chat_format_names = ("llama3", "chatml-smollm2")

    def tiny_config(self) -> LlamaConfig:
        """4 layers, hidden 64, GQA 4/2 heads, untied head (Llama-3 8B/70B untie; SmolLM2 ties)."""
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
        )
