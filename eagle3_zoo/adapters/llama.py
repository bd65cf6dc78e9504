"""LLaMA-3.x and SmolLM2 targets (both report HF ``model_type == "llama"``)."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("llama")
class LlamaAdapter(TargetAdapter):
    """LLaMA-3.x (Llama-3 header format, ``<|eot_id|>``) and SmolLM2 (ChatML, ``<|im_end|>``)."""

    decoder_layer_class = "LlamaDecoderLayer"
    chat_format_names = ("llama3", "chatml-smollm2")

    # 4 layers, hidden 64, GQA 4/2 heads, untied head (Llama-3 8B/70B untie; SmolLM2 ties).
    tiny_config_fields = dict(  # over TINY_SHAPE
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    )
