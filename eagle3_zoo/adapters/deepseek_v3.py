"""DeepSeek-V3 / R1 targets (HF ``model_type == "deepseek_v3"``): MoE with MLA attention, dense first layers."""

from __future__ import annotations

from transformers import DeepseekV3Config

from eagle3_zoo.adapters.base import TargetAdapter, register_adapter
from eagle3_zoo.adapters.chat import ChatFormat
from eagle3_zoo.adapters.testing import TinyTokenizerSpec

# deepseek-ai/DeepSeek-V3 tokenizer_config.json `chat_template`. System messages are joined and placed right after
# BOS; turns are <｜User｜>... and <｜Assistant｜>...<｜end▁of▁sentence｜> with no separators.
DEEPSEEK_V3_CHAT_TEMPLATE = r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"""  # noqa: E501

DEEPSEEK_V3_CHAT = ChatFormat(
    name="deepseek_v3", template=DEEPSEEK_V3_CHAT_TEMPLATE, end_of_turn="<｜end▁of▁sentence｜>"
)


@register_adapter("deepseek_v3")
class DeepseekV3Adapter(TargetAdapter):
    """DeepSeek-V3/R1: 61 layers (first 3 dense, then MoE), MLA attention, one MTP module stored as layer 61."""

    decoder_layer_class = "DeepseekV3DecoderLayer"  # dense and MoE layers share the class: one FSDP wrap unit
    # The multi-token-prediction module ships as `model.layers.61.*`; the HF model has no slot for it.
    keys_to_ignore_on_load = (r"model\.layers\.61\.",)
    chat_formats = (DEEPSEEK_V3_CHAT,)
    tiny_tokenizer_spec = TinyTokenizerSpec(
        special_tokens=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
        ),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
    )

    def tiny_config(self) -> DeepseekV3Config:
        """4 layers (first dense, then MoE with 4 routed + 1 shared expert, top-2 of 2 groups), small MLA dims."""
        return DeepseekV3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
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
            max_position_embeddings=256,
            num_mtp_layers=0,
            tie_word_embeddings=False,
        )
