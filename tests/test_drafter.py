"""The drafter's two forward paths, its attention kernel and its checkpoint layout."""

import json

import pytest
import torch
from safetensors import safe_open

from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, from_sglang_layer_ids, to_sglang_layer_ids
from eagle3_zoo.modeling.attention import ttt_attention, ttt_attention_reference
from tests.tiny import tiny_config, tiny_drafter, tiny_drafter31

CANONICAL_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.mark.parametrize("backend", ["cpu-flash", "explicit"])
@pytest.mark.parametrize("n_steps", [1, 2, 3, 7])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_ttt_attention_matches_naive_full_mask(n_steps, kv_heads, backend):
    b, h, t, d = 2, 4, 29, 8
    q = torch.randn(b, h, t, d, requires_grad=True)
    ks = [torch.randn(b, kv_heads, t, d, requires_grad=True) for _ in range(n_steps)]
    vs = [torch.randn(b, kv_heads, t, d, requires_grad=True) for _ in range(n_steps)]
    grad = torch.randn(b, h, t, d)
    leaves = [q, *ks, *vs]
    fast = ttt_attention(q, ks, vs, backend=backend)
    fast_grads = torch.autograd.grad((fast * grad).sum(), leaves)
    ref = ttt_attention_reference(q, ks, vs)
    ref_grads = torch.autograd.grad((ref * grad).sum(), leaves)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(fast_grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{}, dict(fc_norm=True), dict(norm_output=True),
                                     dict(fc_norm=True, norm_output=True)],
                         ids=["eagle3", "fc_norm", "norm_output", "eagle3.1"])
def test_ttt_rollout_equals_cached_inference_rollout(options):
    """Logits of TTT step k at position t == feeding the same tokens step by step through the KV cache (EAGLE-3 and
    each EAGLE-3.1 option: the fed-back state is post-norm with norm_output)."""
    steps, t_len = 7, 20
    drafter, embed = tiny_drafter31(**options)
    drafter.eval()
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (1, t_len + steps))
    aux = torch.randn(1, t_len, 3 * cfg.target_hidden_size) * 4
    embeds = embed(ids[:, 1:])  # step k, position t reads token t+1+k
    with torch.no_grad():
        ttt_logits = [drafter.logits(h) for h in drafter.ttt_rollout(embeds, aux, steps)]
        for t in (0, 1, 6, 13, t_len - 1):
            cache = drafter.new_cache()
            pos = torch.arange(t + 1)[None]
            out = drafter.step(embeds[:, : t + 1], drafter.fuse(aux[:, : t + 1]), pos, cache)
            torch.testing.assert_close(out.logits[:, t], ttt_logits[0][:, t], atol=1e-5, rtol=0)
            hidden = out.hidden[:, t : t + 1]
            for k in range(1, steps):
                out = drafter.step(embeds[:, t + k : t + k + 1], hidden, torch.tensor([[t + k]]), cache)
                torch.testing.assert_close(out.logits[:, 0], ttt_logits[k][:, t], atol=1e-5, rtol=0)
                hidden = out.hidden


def test_step_with_explicit_tree_mask_equals_separate_chains():
    """Two sibling branches verified in one call with a tree mask equal each branch run alone."""
    drafter, embed = tiny_drafter()
    drafter.eval()
    cfg = drafter.config
    prefix = 6
    ids = torch.randint(0, cfg.vocab_size, (1, prefix))
    aux = torch.randn(1, prefix, 3 * cfg.target_hidden_size)
    branch = torch.randint(0, cfg.vocab_size, (1, 2))
    hid = torch.randn(1, 2, cfg.hidden_size)
    with torch.no_grad():
        base = drafter.new_cache()
        drafter.step(embed(ids), drafter.fuse(aux), torch.arange(prefix)[None], base)
        singles = []
        for i in range(2):
            c = drafter.new_cache()
            c.keys, c.values = base.keys.clone(), base.values.clone()
            singles.append(drafter.step(embed(branch[:, i : i + 1]), hid[:, i : i + 1], torch.tensor([[prefix]]), c))
        mask = torch.zeros(1, 1, 2, prefix + 2)
        mask[..., prefix:] = torch.tensor([[0.0, float("-inf")], [float("-inf"), 0.0]])
        both = drafter.step(embed(branch), hid, torch.tensor([[prefix, prefix]]), base, attn_mask=mask)
    for i in range(2):
        torch.testing.assert_close(both.logits[:, i], singles[i].logits[:, 0], atol=1e-5, rtol=0)
    assert len(base) == prefix + 2
    base.keep(torch.tensor([0, 1, 2, 3, 4, 5, 7]))
    assert len(base) == prefix + 1


def test_step_last_logits_only_equals_the_last_row():
    """Extending the context with `last_logits_only` (the lm_head on one row) changes nothing but the skipped rows."""
    drafter, embed = tiny_drafter()
    drafter.eval()
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    aux = torch.randn(1, 9, 3 * cfg.target_hidden_size)
    with torch.no_grad():
        full_cache, last_cache = drafter.new_cache(), drafter.new_cache()
        full = drafter.step(embed(ids), drafter.fuse(aux), torch.arange(9)[None], full_cache)
        last = drafter.step(embed(ids), drafter.fuse(aux), torch.arange(9)[None], last_cache, last_logits_only=True)
    assert last.logits.shape == (1, 1, cfg.draft_vocab_size)
    torch.testing.assert_close(last.logits, full.logits[:, -1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(last.hidden, full.hidden, atol=0, rtol=0)
    torch.testing.assert_close(last_cache.keys, full_cache.keys, atol=0, rtol=0)


def test_save_load_round_trip(tmp_path):
    drafter, embed = tiny_drafter()
    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool
    assert keys == CANONICAL_KEYS
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 64 and cfg["vocab_size"] == 96 and cfg["target_hidden_size"] == 24
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # internal (2, 3, 5) minus one
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]  # vLLM's top-level field: HF hidden-state indices
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_parameters"]["rope_theta"] == 10000.0
    for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
              "torch_dtype", "hidden_size"):
        assert k in cfg
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.config.aux_layer_ids == (2, 3, 5)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    ids = torch.randint(0, 96, (2, 10))
    aux = torch.randn(2, 8, 72)
    with torch.no_grad():
        a = [drafter.logits(h) for h in drafter.ttt_rollout(embed(ids[:, 1:]), aux, 2)]
        b = [loaded.logits(h) for h in loaded.ttt_rollout(embed(ids[:, 1:]), aux, 2)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bf16_checkpoint_keeps_vocab_dtypes(tmp_path):
    drafter, _ = tiny_drafter(torch_dtype="bfloat16")
    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.int64


def test_layer_id_conventions_pinned():
    # SmolLM2 (30 layers): internal = HF hidden_states indices (2, 15, 27); SGLang stores outputs of layers 1, 14, 26
    assert to_sglang_layer_ids((2, 15, 27)) == [1, 14, 26]
    assert from_sglang_layer_ids([1, 14, 26]) == (2, 15, 27)
    with pytest.raises(ValueError, match="embeddings"):
        to_sglang_layer_ids((0, 15, 27))


def test_from_target_config_and_bad_configs():
    from transformers import LlamaConfig

    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                     num_hidden_layers=30, vocab_size=500, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    cfg = Eagle3Config.from_target_config(tc, draft_vocab_size=100)
    assert cfg.aux_layer_ids == (2, 15, 27) and cfg.rope_theta == 1e5 and cfg.head_dim == 16
    with pytest.raises(ValueError, match="draft_vocab_size=600"):
        tiny_config(draft_vocab_size=600, vocab_size=500)
    with pytest.raises(ValueError, match="multiple of"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Eagle3Drafter.from_pretrained(tmp_path)
    drafter, _ = tiny_drafter()
    drafter.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*line 1"):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_inconsistent_aux_id_fields_are_refused(tmp_path):
    drafter, _ = tiny_drafter()
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]  # SGLang's numbers written into vLLM's field
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="differ by exactly one"):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_target_mismatches_name_each_size():
    from types import SimpleNamespace

    cfg = tiny_config()  # hidden 32, target_hidden 24, vocab 96
    assert cfg.target_mismatches(SimpleNamespace(vocab_size=96, hidden_size=24)) == [
        "hidden_size 32 != target hidden 24 (the target embedding feeds the drafter)"]
    fits = tiny_config(target_hidden_size=32)
    assert fits.target_mismatches(SimpleNamespace(vocab_size=96, hidden_size=32)) == []
    assert len(fits.target_mismatches(SimpleNamespace(vocab_size=100, hidden_size=64))) == 3


def test_head_initialised_from_the_target_reads_hidden_states_like_the_target():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    drafter, _ = tiny_drafter()
    cfg = drafter.config
    torch.manual_seed(1)
    target_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    target_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    target_norm.weight.data.uniform_(0.5, 1.5)
    drafter.init_head_from_target(target_head.weight, target_norm.weight)
    h = torch.randn(3, cfg.hidden_size)
    rows = drafter.draft_to_target(torch.arange(cfg.draft_vocab_size))
    with torch.no_grad():
        assert torch.allclose(drafter.logits(h), target_head(target_norm(h))[:, rows], atol=1e-6)
    with pytest.raises(ValueError, match=r"lm_head weight has shape \(96, 16\), expected \(96, 32\)"):
        drafter.init_head_from_target(torch.zeros(96, 16))


def test_fc_input_scale_folds_into_fc_weight_without_changing_outputs():
    drafter, embed = tiny_drafter()
    aux = torch.randn(2, 5, drafter.fc.in_features) * torch.linspace(0.1, 300.0, drafter.fc.in_features)
    scale = torch.rand(drafter.fc.in_features) + 0.01
    drafter.set_fc_input_scale(scale)
    with torch.no_grad():
        scaled = drafter.fuse(aux)
        torch.testing.assert_close(scaled, aux @ (drafter.fc.weight * scale).T, rtol=1e-5, atol=1e-4)
        drafter.fold_fc_input_scale()
        torch.testing.assert_close(drafter.fuse(aux), scaled, rtol=1e-5, atol=1e-4)
    assert torch.equal(drafter.fc_input_scale, torch.ones_like(scale))
    assert "fc_input_scale" not in drafter.state_dict()  # never part of a checkpoint
    with pytest.raises(ValueError, match="finite and > 0"):
        drafter.set_fc_input_scale(torch.zeros_like(scale))
