"""Drafter folders in every format the hub layer reads, built from `tiny_drafter()` (no downloads).

The target these drafters fit: hidden 32, vocab 96, 8 layers (`tiny_target_config()`), so target checks start clean.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle3_zoo.modeling import Eagle3Drafter
from tests.tiny import tiny_drafter

TARGET = "tiny-org/tiny-llama"
# a drafter that fits tiny_target_config(): target hidden = drafter hidden, default aux layers of an 8-layer target
FIT = dict(target_hidden_size=32, aux_layer_ids=(2, 4, 5), target_name_or_path=TARGET, target_model_type="llama")


def tiny_target_config(**overrides) -> LlamaConfig:
    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kw.update(overrides)
    return LlamaConfig(**kw)


def canonical_dir(root: Path, name: str = "canonical", seed: int = 0, **overrides) -> tuple[Path, Eagle3Drafter]:
    drafter, _ = tiny_drafter(seed=seed, **{**FIT, **overrides})
    return drafter.save_pretrained(root / name), drafter


def official_dir(root: Path, drafter: Eagle3Drafter, name: str = "official", dtype=torch.float32,
                 embedding: bool = True) -> Path:
    """The yuhuili/EAGLE3-* layout: pytorch_model.bin (+ a copy of the embedding unless `embedding` is false),
    LlamaForCausalLM, no rope."""
    out = root / name
    out.mkdir(parents=True)
    cfg = drafter.config
    state = {k: (v.to(dtype) if v.is_floating_point() else v).clone() for k, v in drafter.state_dict().items()}
    if embedding:
        state["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size).to(dtype)
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.28.1", "use_cache": True, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
    }, indent=2))
    return out


def specforge_dir(root: Path, canonical: Path, name: str = "specforge") -> Path:
    """SpecForge-style safetensors: every key under `model.` plus the frozen embedding copy."""
    out = root / name
    out.mkdir(parents=True)
    state = load_file(str(canonical / "model.safetensors"))
    state = {f"model.{k}": v for k, v in state.items()}
    cfg = json.loads((canonical / "config.json").read_text())
    state["model.embed_tokens.weight"] = torch.randn(cfg["vocab_size"], cfg["hidden_size"])
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def edit_weights(folder: Path, fn) -> None:
    """Rewrite model.safetensors with `fn(state)` applied (tests break checkpoints on purpose)."""
    state = load_file(str(folder / "model.safetensors"))
    fn(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def step_logits(drafter: Eagle3Drafter, seed: int = 1) -> torch.Tensor:
    """Draft logits of a fixed 2-step rollout through the KV-cache path (identical weights -> identical logits)."""
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    aux = torch.randn(1, 5, cfg.num_aux_layers * cfg.target_hidden_size, generator=g)
    embeds = torch.randn(1, 5, cfg.hidden_size, generator=g)
    cache = drafter.new_cache()
    with torch.no_grad():
        out = drafter.step(embeds, drafter.fuse(aux), torch.arange(5)[None], cache)
        nxt = drafter.step(embeds[:, -1:], out.hidden[:, -1:], torch.tensor([[5]]), cache)
    return torch.cat([out.logits, nxt.logits], dim=1)
