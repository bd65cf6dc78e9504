"""Gemma 3 text targets (HF ``model_type == "gemma3_text"``): gemma-3-1b-it, or the text model of 4B-27B.

The multimodal Gemma 3 checkpoints (4B and up, ``model_type == "gemma3"`` with a ``text_config``) are refused by
`adapter_for` with what to do (a text-only checkpoint); no adapter is registered for the wrapper.
"""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("gemma3_text")
class Gemma3TextAdapter(TargetAdapter):
    """Gemma 3: 5 sliding-window layers (window 512 or 1024) per full-attention layer, sandwich norms.

    Embeddings: ``Gemma3TextScaledWordEmbedding`` multiplies by sqrt(hidden) inside its forward, so the drafter,
    which calls the target's embedding module (`embed_tokens`), sees exactly the target's embeddings. vLLM's and
    SGLang's EAGLE-3 drafters (``LlamaForCausalLMEagle3``) embed with the shared weight *without* Gemma's
    normaliser; the drafter's first op is an RMSNorm of the embedding, so the two agree to within the norm's eps
    (tested in tests/test_adapters_families.py).
    Aux layers: the shared rule (2, N//2, N-3); gemma-3-1b-it (26 layers): (2, 13, 23). SpecForge's
    ``configs/gemma3-1b-eagle3.json`` sizes the drafter like the target (head_dim 256, 4 heads / 1 KV head).
    """

    decoder_layer_class = "Gemma3DecoderLayer"
    chat_format_names = ("gemma3",)
    sliding_window_layers = True

    # 4 layers (3 sliding with window 8, then 1 full), hidden 64, GQA 4/2 heads of 16.
    # Untied head (Gemma 3 ties it): with tied random weights the scaled embedding dominates the residual and
    # greedy text repeats one token; tied heads are covered by the qwen2 / qwen3 tiny configs.
    tiny_config_fields = dict(  # over TINY_SHAPE
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
    )
