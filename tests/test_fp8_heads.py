"""Heads-only loading of an FP8 block-quantised checkpoint in DeepSeek-V3's layout (written here: the embedding, final
norm and lm_head in bf16, every decoder matrix float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block):
the three bf16 tensors are read exactly and nothing else is read, whole loads are still refused, and a quantised head
is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from eagle3_zoo.adapters import get_adapter, load_target, load_target_heads

HEADS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's format: weight / scale in float8_e4m3fn, scale_inv = per-block amax / 448 (float32)."""
    rows, cols = weight.shape[-2:]
    scale = torch.full((*weight.shape[:-2], -(-rows // 128), -(-cols // 128)), 1.0)
    scale *= weight.float().abs().amax().clamp(min=1e-12) / 448.0
    return (weight.float() / scale.flatten()[0]).to(torch.float8_e4m3fn), scale


def _fp8_checkpoint(path, quantise_head: bool = False):
    adapter = get_adapter("deepseek_v3")
    config = adapter.tiny_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    decoder, heads = {}, {}
    for name, tensor in model.state_dict().items():
        if name in HEADS and not (quantise_head and name == "lm_head.weight"):
            heads[name] = tensor.contiguous()
        elif tensor.dim() >= 2 and (name.startswith("model.layers.") or name == "lm_head.weight"):
            (decoder if name != "lm_head.weight" else heads)[name], scale = _block_fp8(tensor)
            (decoder if name != "lm_head.weight" else heads)[f"{name}_scale_inv"] = scale
        else:
            decoder[name] = tensor.contiguous()  # norms, router biases: bf16 as in the official checkpoint
    config.quantization_config = FP8
    config.save_pretrained(path)
    adapter.tiny_tokenizer().save_pretrained(path)
    files = {"model-00001-of-00002.safetensors": decoder, "model-00002-of-00002.safetensors": heads}
    for file, tensors in files.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, tensors in files.items() for k in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return {k: v for k, v in model.state_dict().items() if k in HEADS}


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds3-fp8")
    return path, _fp8_checkpoint(path)


def test_heads_only_reads_the_bf16_heads_and_no_fp8_tensor(fp8_target, monkeypatch):
    path, original = fp8_target
    decoder_dtypes = set()
    with safe_open(str(path / "model-00001-of-00002.safetensors"), "pt") as f:
        decoder_dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if not k.endswith("_scale_inv")}
    assert "F8_E4M3" in decoder_dtypes  # the layout under test: FP8 decoder matrices

    read = []
    real_open = safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, key):
            return self.handle.get_slice(key)

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

    monkeypatch.setattr("eagle3_zoo.adapters.loading.safe_open", Recording)
    model, _, adapter = load_target_heads(path, dtype="bfloat16")
    assert sorted(read) == sorted(HEADS)  # nothing quantised is read, so nothing is dequantised
    for key, module in zip(HEADS, (adapter.embed_tokens(model), adapter.final_norm(model), adapter.lm_head(model))):
        assert module.weight.dtype == torch.bfloat16 and torch.equal(module.weight, original[key])
    layers = list(adapter.decoder_layers(model).parameters())
    assert layers and all(p.is_meta for p in layers)


def test_whole_loads_of_an_fp8_checkpoint_are_still_refused(fp8_target):
    path, _ = fp8_target
    with pytest.raises(ValueError, match=r"FP8 block-quantised.*engine.*data.features_backend: vllm"):
        load_target(path)


def test_a_quantised_head_is_refused_by_name(tmp_path):
    _fp8_checkpoint(tmp_path, quantise_head=True)
    with pytest.raises(ValueError, match=r"lm_head.weight is stored quantised \(F8_E4M3, block scales "
                                         r"lm_head.weight_scale_inv\).*does not dequantise"):
        load_target_heads(tmp_path, dtype="bfloat16")
