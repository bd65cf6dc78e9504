"""load_target on tiny saved checkpoints: frozen eval model, merged PEFT LoRA, DeepSeek MTP keys, clear errors."""

import json
import logging
import socket
import time

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from eagle3_zoo.adapters import UnknownAdapterError, available_adapters, get_adapter, load_target


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


@pytest.mark.parametrize("family", available_adapters())
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


def test_fp8_checkpoint_is_refused_before_reading_weights(tmp_path):
    """DeepSeek-V3's FP8 block-quantised layout: a clear refusal saying what works, no weight read."""
    config = get_adapter("deepseek_v3").tiny_config()
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    path = tmp_path / "ds3-fp8"
    config.save_pretrained(path)  # config only: the refusal must come before any weight is looked for
    with pytest.raises(ValueError, match=r"FP8 block-quantised.*inference engine.*bf16 copy"):
        load_target(path)


# --------------------------------------------------------------- names that are no target: one line, and fast
def _no_hub_download(*args, **kwargs):
    raise AssertionError("a target that cannot be resolved must not reach transformers' download (it retries ~25 s)")


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache (the repo ids below are not in it)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def test_target_that_is_a_file_or_a_folder_without_config(tmp_path, monkeypatch):
    path, _ = _save_tiny(tmp_path, "llama")
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", _no_hub_download)
    with pytest.raises(FileNotFoundError, match=r"target '.*model.safetensors' is a file, not a model folder; pass a "
                       r"local folder with config.json, a Hub repo id such as .*, or 'smollm2-135m-instruct' / "
                       r"'embedded' for the embedded"):
        load_target(path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"target '.*' is a folder without config.json; pass a local folder"):
        load_target(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"target '/no/such/model' is neither a local folder nor a Hub repo id"):
        load_target("/no/such/model")


def test_unknown_hub_id_offline_fails_at_once_without_asking_the_hub(empty_hub_cache, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", _no_hub_download)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"target 'no-such-org/no-such-model' is neither a local folder nor in "
                       r"the Hugging Face cache, and HF_HUB_OFFLINE is set .*; pass a local folder with config.json"):
        load_target("no-such-org/no-such-model")
    assert time.monotonic() - start < 2


def test_unreachable_hub_fails_within_seconds(empty_hub_cache, monkeypatch):
    import huggingface_hub

    with socket.socket() as s:  # a port nothing listens on: connections are refused at once, as with no network
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=rf"target 'no-such-org/no-such-model' is neither a local folder nor "
                       rf"reachable on the Hub \({endpoint}: ConnectError: .*this machine may be offline\) and it is "
                       r"not in the Hugging Face cache; pass a local folder"):
        load_target("no-such-org/no-such-model")
    assert time.monotonic() - start < 5


def test_hub_that_never_answers_fails_within_the_probe_timeout(empty_hub_cache, monkeypatch):
    """A DNS lookup that hangs is not bounded by the HTTP client's timeout: the probe is."""
    import huggingface_hub

    from eagle3_zoo.adapters import loading

    monkeypatch.setattr(loading, "HUB_PROBE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: time.sleep(30))
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"neither a local folder nor reachable on the Hub \(.*: TimeoutError: "
                       r"no answer within 0.5 s; this machine may be offline\)"):
        load_target("no-such-org/no-such-model")
    assert time.monotonic() - start < 3


def test_repo_the_hub_does_not_have(empty_hub_cache, monkeypatch):
    import huggingface_hub

    from tests.hub_server import LoopbackHub

    with LoopbackHub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        with pytest.raises(FileNotFoundError, match=r"target 'no-such-org/no-such-model' is neither a local folder "
                           r"nor a repo on the Hub \(http://127.0.0.1:\d+; a private repo needs a token"):
            load_target("no-such-org/no-such-model")
    assert [r["path"] for r in hub.requests] == ["/api/models/no-such-org/no-such-model"]  # one request, no retry


def test_cached_hub_target_loads_offline_and_with_the_hub_unreachable(tmp_path, empty_hub_cache, monkeypatch):
    import huggingface_hub

    snapshot = empty_hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    path, reference = _save_tiny(snapshot.parent, "llama", name=snapshot.name)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:1")  # refused
    model, _, _ = load_target("tiny-org/tiny-llama")
    torch.testing.assert_close(_logits(model, IDS), _logits(reference.eval(), IDS), atol=0, rtol=0)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", _no_hub_download)
    assert load_target("tiny-org/tiny-llama")[0].config.num_hidden_layers == reference.config.num_hidden_layers
