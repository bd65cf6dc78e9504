"""Qwen3 dense targets (HF ``model_type == "qwen3"``): Qwen3-0.6B ... 32B."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("qwen3")
class Qwen3Adapter(TargetAdapter):
    """Qwen3: ChatML with ``<think>`` reasoning and ``<tool_call>`` turns; q/k RMS norms, no q/k/v biases.

    Aux layers: the shared rule (2, N//2, N-3), which vLLM (``SupportsEagle3`` default) and SGLang
    (``set_eagle3_layers_to_capture``, stored as ids - 1) use for Qwen3; Qwen3-8B (36 layers): (2, 18, 33).
    Published drafters (SpecForge configs, RedHatAI speculators) are sized like the target, 32000 draft tokens.
    """

    decoder_layer_class = "Qwen3DecoderLayer"
    chat_format_names = ("qwen3",)

    # 4 layers, hidden 64, GQA 4/2 heads of 16, tied embeddings (as Qwen3-0.6B..4B).
    tiny_config_fields = dict(  # over TINY_SHAPE
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )
