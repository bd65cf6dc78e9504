"""gpt-oss targets (HF ``model_type == "gpt_oss"``): gpt-oss-20b and gpt-oss-120b."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("gpt_oss")
class GptOssAdapter(TargetAdapter):
    """gpt-oss: MoE (32 / 128 experts, top-4), sliding-window (128) and full attention alternating, learned
    attention sinks, Harmony chat format (reasoning in the ``analysis`` channel), MXFP4 expert weights.

    The MXFP4 experts are dequantised on load (`load_target`); transformers has no sdpa kernel with sinks, so the
    target runs eager attention, which takes the verification masks.
    Aux layers: the shared rule (2, N//2, N-3), as vLLM and SGLang default; gpt-oss-20b (24 layers): (2, 12, 21).
    (SpecForge's ``configs/gpt-oss-20B-eagle3.json`` names SGLang ids [1, 11, 21], i.e. internal (2, 12, 22);
    set ``drafter.aux_layer_ids`` to train that variant.) Its drafter MLP is 17280 wide (6 x hidden), not the
    target's per-expert 2880: `drafter_defaults`.
    """

    decoder_layer_class = "GptOssDecoderLayer"
    chat_format_names = ("harmony",)
    sliding_window_layers = True
    attention_sinks = True
    quantized_formats = ("mxfp4",)
    drafter_defaults = {"intermediate_size": 17280, "draft_vocab_size": 32000}

    # 4 layers (sliding window 8 / full alternating), hidden 64, GQA 4/2 heads of 16, 4 experts (top-2).
    tiny_config_fields = dict(  # over TINY_SHAPE
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8},
        tie_word_embeddings=False,
    )
