"""DeepSeek-V3 / R1 targets (HF ``model_type == "deepseek_v3"``): MoE with MLA attention, dense first layers."""

from __future__ import annotations

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter


@register_adapter("deepseek_v3")
class DeepseekV3Adapter(TargetAdapter):
    """DeepSeek-V3/R1: 61 layers (first 3 dense, then MoE), MLA attention, one MTP module stored as layer 61."""

    decoder_layer_class = "DeepseekV3DecoderLayer"  # dense and MoE layers share the class: one FSDP wrap unit
    # The multi-token-prediction module ships as `model.layers.61.*`; the HF model has no slot for it.
    keys_to_ignore_on_load = (r"model\.layers\.61\.",)
    chat_format_names = ("deepseek_v3",)

    # 4 layers (first dense, then MoE with 4 routed + 1 shared expert, top-2 of 2 groups), small MLA dims.
    tiny_config_fields = dict(  # over TINY_SHAPE
        moe_intermediate_size=32,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_mtp_layers=0,
        tie_word_embeddings=False,
    )
