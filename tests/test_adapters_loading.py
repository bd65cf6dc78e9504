"""load_target on tiny saved checkpoints: frozen eval model, merged PEFT LoRA, DeepSeek MTP keys, clear errors."""

import json
import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from eagle3_zoo.adapters import UnknownAdapterError, get_adapter, load_target


def _save_tiny(tmp_path, family, name="target"):
    adapter = get_adapter(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(adapter.tiny_config())
    path = tmp_path / name
    model.save_pretrained(path)
    adapter.tiny_tokenizer().save_pretrained(path)
    return path, model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 81, 400]])


@pytest.mark.parametrize("family", ["llama", "qwen2", "deepseek_v3"])
def test_load_target_returns_frozen_eval_model_tokenizer_and_adapter(tmp_path, family):
    path, reference = _save_tiny(tmp_path, family)
    model, tokenizer, adapter = load_target(path, dtype="float32")
    assert adapter.model_type == family and type(adapter) is type(get_adapter(family))
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    assert tokenizer.chat_template == adapter.chat_formats[0].template
    assert model.dtype == torch.float32
    torch.testing.assert_close(_logits(model, IDS), _logits(reference.eval(), IDS), atol=0, rtol=0)
    half, _, _ = load_target(path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert load_target(path, dtype="auto")[0].dtype == torch.float32  # as saved
    with pytest.raises(ValueError, match="not a torch dtype"):
        load_target(path, dtype="Tensor")


def test_lora_adapter_is_merged_exactly_as_peft_does(tmp_path):
    path, _ = _save_tiny(tmp_path, "llama")
    lora_dir = tmp_path / "lora"
    base = AutoModelForCausalLM.from_pretrained(path)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    get_peft_model(base, config).save_pretrained(lora_dir)

    merged, _, _ = load_target(path, lora_path=lora_dir)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), lora_dir).merge_and_unload()
    plain, _, _ = load_target(path)

    assert type(merged).__name__ == "LlamaForCausalLM"  # unwrapped: no PEFT layers left
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert all(not p.requires_grad for p in merged.parameters()) and not merged.training
    got, want = _logits(merged, IDS), _logits(reference.eval(), IDS)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got - _logits(plain, IDS)).abs().max() > 1e-3  # the LoRA really changes the target


def test_deepseek_mtp_layer_keys_are_ignored_on_load(tmp_path, caplog):
    path, reference = _save_tiny(tmp_path, "deepseek_v3")
    adapter = get_adapter("deepseek_v3")
    assert adapter.ignored_on_load("model.layers.61.eh_proj.weight")
    assert not adapter.ignored_on_load("model.layers.6.mlp.gate.weight")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.61.eh_proj.weight"] = torch.zeros(8, 16)  # DeepSeek-V3's MTP module lives at layer 61
    weights["model.layers.61.shared_head.norm.weight"] = torch.ones(8)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="eagle3_zoo"):
        model, _, _ = load_target(path)
    assert "unused weights" not in caplog.text
    torch.testing.assert_close(_logits(model, IDS), _logits(reference.eval(), IDS), atol=0, rtol=0)


def test_unexpected_keys_of_no_declared_pattern_are_reported(tmp_path, caplog):
    path, _ = _save_tiny(tmp_path, "llama")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.61.eh_proj.weight"] = torch.zeros(8, 16)  # not an MTP layer for Llama
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="eagle3_zoo"):
        load_target(path)
    assert "unused weights" in caplog.text and "model.layers.61.eh_proj.weight" in caplog.text


def test_missing_weights_raise_instead_of_staying_random(tmp_path):
    path, _ = _save_tiny(tmp_path, "qwen2")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_target(path)


def test_unknown_family_fails_before_reading_weights(tmp_path):
    path = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64).save_pretrained(path)  # config only, no weights
    assert json.loads((path / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(UnknownAdapterError, match="unknown target model_type 'gpt2'"):
        load_target(path)
