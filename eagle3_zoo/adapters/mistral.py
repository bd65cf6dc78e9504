"""Mistral targets (HF ``model_type == "mistral"``): Mistral-Small-24B-Instruct-2501 (Mistral Small 3)."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("mistral")
class MistralAdapter(TargetAdapter):
    """Mistral Small 3.x text models: Llama-like layers, ``[INST]``/``[SYSTEM_PROMPT]`` chat formats (Tekken): the
    2501 template (no tools) and the 3.2 (2506) one (``[TOOL_CALLS]``/``[TOOL_RESULTS]``, tool definitions).

    Mistral Small 3 has no sliding window (``sliding_window: null``); older Mistral-7B v0.1 slides every layer
    (``sliding_window: 4096``), which `attention_windows` reads from the config (all layers one window).
    Aux layers: the shared rule (2, N//2, N-3) (vLLM and SGLang serve Mistral with their Llama code and its
    default); Mistral-Small-24B (40 layers): (2, 20, 37). SpecForge's ``configs/mistral-small-24B-eagle3.json``
    sizes the drafter like the target.
    """

    decoder_layer_class = "MistralDecoderLayer"
    # 2501 (the recipe's target, and the tiny tokenizer's) first: its signature is absent from the 3.2 template,
    # while 3.2's ([SYSTEM_PROMPT]) is in both, so the order makes each tokenizer resolve to its own format
    chat_format_names = ("mistral-small-2501", "mistral-small")
    sliding_window_layers = True  # only in checkpoints whose config sets sliding_window

    # 4 layers, hidden 64, GQA 4/2 heads of 16, no sliding window (as Mistral Small 3).
    tiny_config_fields = dict(  # over TINY_SHAPE
        head_dim=16,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 100000000.0},
        tie_word_embeddings=False,
    )
