"""Family capabilities as declared by the adapters: sliding windows and sinks against the tiny configs, the
published-drafter shape defaults, Gemma 3's scaled embedding in the drafter, multimodal wrappers refused, MXFP4
checkpoints dequantised on load, and the export/check round trip of a drafter for every registered family."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Gemma3Config
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

from eagle3_zoo.adapters import UnknownAdapterError, adapter_for, available_adapters, get_adapter, load_target
from eagle3_zoo.checkpoint import check_drafter, convert_to_canonical, export_drafter
from eagle3_zoo.drafters.eagle3.decode import Eagle3DraftModel
from eagle3_zoo.modeling import Eagle3Config
from eagle3_zoo.recipe.sections import Recipe
from eagle3_zoo.training.build import drafter_config
from tests.test_speculative_support import random_drafter, tiny_target

FAMILIES = available_adapters()


@pytest.mark.parametrize("family", FAMILIES)
def test_capability_declarations_match_the_tiny_model(family):
    adapter = get_adapter(family)
    config = adapter.tiny_config()
    assert config.model_type == family and 2 <= config.num_hidden_layers <= 4 and config.vocab_size == 512
    assert adapter.chat_format_names, "every family names its chat format(s)"
    windows = adapter.attention_windows(config)
    assert len(windows) == config.num_hidden_layers
    if not adapter.sliding_window_layers:
        assert windows == (None,) * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config)
    has_sinks = any(name.endswith(".sinks") for name, _ in model.named_parameters())
    assert has_sinks == adapter.attention_sinks
    assert set(adapter.quantized_formats) <= set(AUTO_QUANTIZATION_CONFIG_MAPPING)
    assert set(adapter.drafter_defaults) <= {f.name for f in dataclasses.fields(Eagle3Config)}


def test_reasoning_and_tool_turns_come_from_the_chat_formats():
    assert [(f, get_adapter(f).reasoning, get_adapter(f).tool_turns) for f in ("qwen3", "gpt_oss", "gemma3_text",
                                                                                "mistral")] == [
        ("qwen3", True, True), ("gpt_oss", True, True), ("gemma3_text", False, False), ("mistral", False, True)]


def test_sliding_windows_are_read_from_the_config():
    gemma, gpt_oss, mistral = get_adapter("gemma3_text"), get_adapter("gpt_oss"), get_adapter("mistral")
    assert gemma.attention_windows(gemma.tiny_config()) == (8, 8, 8, None)
    assert gpt_oss.attention_windows(gpt_oss.tiny_config()) == (8, None, 8, None)  # alternating, as gpt-oss
    config = mistral.tiny_config()
    assert mistral.attention_windows(config) == (None,) * 4  # Mistral Small 3: sliding_window null
    config.sliding_window = 16  # Mistral-7B v0.1 style: every layer slides
    assert mistral.attention_windows(config) == (16,) * 4
    config = get_adapter("qwen2").tiny_config()
    config.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        get_adapter("qwen2").attention_windows(config)


def test_drafter_defaults_apply_unless_the_recipe_sets_the_field():
    from eagle3_zoo.adapters.shipped import shipped_target_config

    target = shipped_target_config("openai/gpt-oss-20b")
    recipe = Recipe()
    cfg = drafter_config(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, target, (2, 12, 21))
    assert cfg.intermediate_size == 17280 and cfg.hidden_size == target.hidden_size  # SpecForge's gpt-oss drafter
    recipe.drafter.intermediate_size = 5760
    assert drafter_config(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, target,
                          (2, 12, 21)).intermediate_size == 5760
    qwen, recipe = get_adapter("qwen3").tiny_config(), Recipe()
    recipe.drafter.draft_vocab_size = 256
    assert drafter_config(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, qwen,
                          (1, 2, 3)).intermediate_size == qwen.intermediate_size  # no defaults


def test_gemma3_drafter_embeds_tokens_exactly_as_the_target():
    target = tiny_target("gemma3_text")
    ids = torch.tensor([3, 70, 511, 0])
    embed = get_adapter("gemma3_text").embed_tokens(target)
    scale = target.config.hidden_size**0.5
    reference = target.model.embed_tokens.weight[ids] * scale
    drafter = random_drafter(target)
    draft = Eagle3DraftModel(drafter, embed)
    torch.testing.assert_close(draft._embed(ids)[0], reference, rtol=0, atol=0)  # the normaliser is applied
    with torch.no_grad():  # = what the target's own forward feeds its first layer
        first = []
        hook = target.model.layers[0].register_forward_pre_hook(lambda m, a: first.append(a[0]))
        target(ids[None])
        hook.remove()
    torch.testing.assert_close(first[0][0], reference, rtol=0, atol=0)
    # vLLM / SGLang feed their EAGLE-3 drafter the unscaled embedding; the drafter's first op is an RMSNorm of it,
    # so both give the same attention input up to the norm's eps
    layer = drafter.midlayer
    hidden = torch.randn(4, drafter.config.hidden_size)
    scaled, unscaled = layer.attn_input(reference, hidden), layer.attn_input(reference / scale, hidden)
    torch.testing.assert_close(scaled, unscaled, rtol=1e-4, atol=1e-4)


def test_multimodal_wrapper_is_refused_naming_the_text_model():
    config = Gemma3Config()  # gemma-3-4b..27b: model_type gemma3 around a gemma3_text model
    with pytest.raises(UnknownAdapterError, match="multimodal wrapper around a 'gemma3_text' text model.*text-only"):
        adapter_for(config)
    with pytest.raises(UnknownAdapterError, match="text-only"):
        adapter_for({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}})


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(rows: int, cols: int, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 weights as gpt-oss checkpoints store them (OCP MX spec: E2M1 codes two per byte, low nibble
    first, one E8M0 scale per 32 values along the input dim) and their value, decoded independently of
    transformers: blocks `[E, rows, cols/32, 16]`, scales `[E, rows, cols/32]`, dense `[E, cols, rows]` (HF's)."""
    codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    scales = torch.randint(124, 130, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    blocks = packed.reshape(experts, rows, cols // 32, 16)
    dense = _FP4[codes] * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    return blocks, scales, dense.transpose(1, 2).contiguous()


def test_gpt_oss_mxfp4_checkpoint_is_dequantised_on_load(tmp_path, monkeypatch):
    import eagle3_zoo.adapters.loading as loading

    # transformers dequantises MXFP4 by itself only where it has no kernels (this CPU); load_target asks for it
    # everywhere, so a GPU with triton kernels gets the same plain forward: record what it asks
    asked = []
    real = loading.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: asked.append(k.get("quantization_config")) or real(*a, **k))
    adapter = get_adapter("gpt_oss")
    config = adapter.tiny_config()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales, dense = _mxfp4(rows, cols, e, gen)
            del state[prefix + name]
            state[prefix + name + "_blocks"], state[prefix + name + "_scales"] = blocks, scales
            reference.get_parameter(prefix + name).data.copy_(dense)
    path = tmp_path / "gpt-oss-mxfp4"
    path.mkdir()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    raw = config.to_dict()
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(raw))
    get_adapter("llama").tiny_tokenizer().save_pretrained(path)  # any tokenizer: the test is about the weights

    model, _, loaded_adapter = load_target(path, dtype="float32")
    assert loaded_adapter.model_type == "gpt_oss"
    assert asked[0].quant_method == "mxfp4" and asked[0].dequantize is True
    for layer in range(config.num_hidden_layers):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            got = model.get_parameter(key)
            assert got.dtype == torch.float32 and got.shape == reference.get_parameter(key).shape
            torch.testing.assert_close(got, reference.get_parameter(key), rtol=0, atol=0)
    ids = torch.tensor([[1, 5, 9, 200, 33, 7, 81, 400, 17, 12, 90]])  # longer than the window of 8
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_export_and_check_round_trip(tmp_path, family):
    target = tiny_target(family)
    drafter = random_drafter(target, draft_vocab_size=256)
    drafter.config.target_name_or_path = f"tiny-org/{family}"
    src = drafter.save_pretrained(tmp_path / "canonical")
    assert check_drafter(src, target.config).problems == []
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    assert check_drafter(spec, target.config).problems == []
    back = type(drafter).from_pretrained(convert_to_canonical(spec, tmp_path / "back"))
    assert back.config.target_model_type == family and back.config.aux_layer_ids == drafter.config.aux_layer_ids
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
