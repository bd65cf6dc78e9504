"""The DFlash drafter (eagle3_zoo.drafters.dflash): training/decoding equivalence, the block mask, FlexAttention vs
the dense reference, parameter shapes, the weight names vLLM 0.32 loads, and the loss weights."""

from __future__ import annotations

import ast
import glob
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3_zoo.drafters.dflash.config import DFlashConfig, default_target_layer_ids
from eagle3_zoo.drafters.dflash.loss import (
    acceptance_length,
    block_labels,
    chunked_cross_entropy,
    decay_weights,
    dflash_loss,
    dpace_weights,
    select_anchors,
)
from eagle3_zoo.drafters.dflash.model import DFlashDrafter, dense_block_mask, flex_mask_mod

ROOT = Path(__file__).resolve().parents[1]
B = 4  # block size of the tiny drafter
T = 20


def _config(**kw) -> DFlashConfig:
    args = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=100,
                num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99, num_hidden_layers=2,
                block_size=B, rope_theta=10000.0)
    args.update(kw)
    return DFlashConfig(**args)


def _setup(seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = _config(**kw)
    drafter = DFlashDrafter(cfg).double()
    with torch.no_grad():  # norms away from 1 so a skipped norm shows
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    aux = torch.randn(2, T, cfg.num_features * cfg.target_hidden_size, dtype=torch.double)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, T))
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.double)
    return cfg, drafter, aux, ids, embed


ANCHORS = torch.tensor([[1, 5, 6, 17], [3, 4, 10, 19]])  # adjacent anchors, the first position, blocks past the end


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_block(drafter: DFlashDrafter, aux_prefix, anchor_id, embed):
    """One block written out from vLLM 0.32's DFlash forward, independently of the module's code paths: context K/V
    from hidden_norm(fc(aux)) (no input_layernorm), k_norm and RoPE at context positions 0..P-1, the block at
    P..P+B-1, every key visible, per-head q/k norms, GQA by repeating kv heads."""
    cfg = drafter.config
    p, d, eps = aux_prefix.shape[0], cfg.head_dim, cfg.rms_norm_eps
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def rope(x, pos):  # x [T, heads, d]
        ang = pos.double()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    ctx = _rms(aux_prefix @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)
    ids = torch.tensor([int(anchor_id)] + [cfg.mask_token_id] * (cfg.block_size - 1))
    x = embed[ids]
    ctx_pos, pos = torch.arange(p), torch.arange(p, p + cfg.block_size)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in drafter.layers:
        a = layer.self_attn
        hn = _rms(x, layer.input_layernorm.weight, eps)
        q = rope(_rms((hn @ a.q_proj.weight.T).view(-1, cfg.num_attention_heads, d), a.q_norm.weight, eps), pos)

        def kv(src, src_pos, a=a):
            k = _rms((src @ a.k_proj.weight.T).view(-1, cfg.num_key_value_heads, d), a.k_norm.weight, eps)
            return rope(k, src_pos), (src @ a.v_proj.weight.T).view(-1, cfg.num_key_value_heads, d)

        (kc, vc), (kq, vq) = kv(ctx, ctx_pos), kv(hn, pos)
        k = torch.cat([kc, kq]).repeat_interleave(rep, dim=1)
        v = torch.cat([vc, vq]).repeat_interleave(rep, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(len(ids), -1) @ a.o_proj.weight.T
        hp = _rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + (F.silu(hp @ layer.mlp.gate_proj.weight.T) * (hp @ layer.mlp.up_proj.weight.T)) @ \
            layer.mlp.down_proj.weight.T
    return _rms(x, drafter.norm.weight, eps)


# ---- (a) training forward == each block drafted alone, as decoding drafts it ----

def test_all_anchor_training_forward_equals_each_block_drafted_alone():
    cfg, drafter, aux, ids, embed = _setup()
    with torch.no_grad():
        hidden = drafter.training_forward(aux, ids, ANCHORS, embed).view(2, ANCHORS.shape[1], B, -1)
        for b in range(2):
            for j, a in enumerate(ANCHORS[b].tolist()):
                alone = drafter.draft_block(aux[b:b + 1, :a], ids[b:b + 1, a], embed)[0]
                torch.testing.assert_close(hidden[b, j], alone, rtol=0, atol=1e-12)
                # and both equal the block written out from vLLM's forward (context strictly before the anchor)
                # (RoPE angles are fp32 in the module, fp64 here)
                torch.testing.assert_close(alone, _reference_block(drafter, aux[b, :a], ids[b, a], embed),
                                           rtol=1e-5, atol=1e-5)


# ---- (b) FlexAttention block mask == dense mask reference ----

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_path_equals_the_dense_reference():
    from torch.nn.attention.flex_attention import create_mask

    _, drafter, aux, ids, embed = _setup(1)
    mask = create_mask(flex_mask_mod(ANCHORS, T, B), 2, None, ANCHORS.numel() // 2 * B, T + ANCHORS.numel() // 2 * B,
                       device="cpu")
    assert torch.equal(mask[:, 0], dense_block_mask(ANCHORS, T, B))
    with torch.no_grad():  # FlexAttention has no backward on CPU; the GPU check runs it compiled
        dense = drafter.training_forward(aux, ids, ANCHORS, embed, attention="dense")
        flex = drafter.training_forward(aux, ids, ANCHORS, embed, attention="flex")
    torch.testing.assert_close(flex, dense, rtol=1e-10, atol=1e-10)


# ---- (c) a block sees context strictly before its anchor and its own slots only ----

def test_mask_rule_slot_by_slot():
    mask = dense_block_mask(ANCHORS, T, B)
    q = ANCHORS.shape[1] * B
    assert mask.shape == (2, q, T + q)
    for b in range(2):
        for s in range(q):
            j, anchor = s // B, ANCHORS[b, s // B].item()
            for key in range(T + q):
                expected = key < anchor if key < T else (key - T) // B == j
                assert mask[b, s, key].item() == expected, (b, s, key)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_a_block_reads_no_later_context_and_no_other_block(attention):
    cfg, drafter, aux, ids, embed = _setup(2)
    anchors = torch.tensor([[4, 9, 14], [6, 7, 12]])
    with torch.no_grad():
        base = drafter.training_forward(aux, ids, anchors, embed, attention).view(2, 3, B, -1)
        for b in range(2):
            for j, a in enumerate(anchors[b].tolist()):
                later = aux.clone()
                later[b, a:] += 3.0  # the anchor position's own feature and everything after it
                out = drafter.training_forward(later, ids, anchors, embed, attention).view(2, 3, B, -1)
                torch.testing.assert_close(out[b, j], base[b, j], rtol=0, atol=1e-12)
                before = aux.clone()
                before[b, a - 1] += 3.0  # the last context position is read
                out = drafter.training_forward(before, ids, anchors, embed, attention).view(2, 3, B, -1)
                assert (out[b, j] - base[b, j]).abs().max() > 1e-6
                other = ids.clone()  # another block's anchor token changes nothing here
                for k, a2 in enumerate(anchors[b].tolist()):
                    if k != j and a2 != a:
                        other[b, a2] = (other[b, a2] + 1) % (cfg.vocab_size - 1)
                out = drafter.training_forward(aux, other, anchors, embed, attention).view(2, 3, B, -1)
                torch.testing.assert_close(out[b, j], base[b, j], rtol=0, atol=1e-12)


# ---- (d) parameter_shapes() == the built module; the config ----

@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_parameter_shapes_equal_the_built_module(draft_vocab_size):
    cfg = _config(draft_vocab_size=draft_vocab_size, num_hidden_layers=3, head_dim=32, target_hidden_size=48)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    built = {n: (tuple(p.shape), "norm" if p.dim() == 1 else "linear") for n, p in drafter.named_parameters()}
    assert cfg.parameter_shapes() == built
    buffers = dict(drafter.named_buffers())
    assert set(buffers) == ({"d2t"} if draft_vocab_size else set())  # no rotary buffers
    drafter.to_empty(device="cpu")  # the RoPE frequencies are real numbers after a meta build
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, DFlashDrafter(cfg).rotary_emb.inv_freq, rtol=0, atol=0)
    assert drafter.double().rotary_emb.inv_freq.dtype == torch.float32


def test_from_target_config_defaults_and_layer_id_conventions():
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=256, num_hidden_layers=36, vocab_size=1000, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = DFlashConfig.from_target_config(target, mask_token_id=999)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)  # 0-based decoder-layer outputs, 1 .. N-3
    assert cfg.aux_layer_ids == (2, 10, 18, 26, 34)  # hidden state entering layer id+1 = vLLM's aux id
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.rope_theta, cfg.head_dim) == (5, 16, 1e6, 32)
    assert default_target_layer_ids(30, 5) == (1, 8, 14, 20, 27)  # SmolLM2's depth, rounded half to even
    assert default_target_layer_ids(30, 1) == (15,)
    with pytest.raises(ValueError, match="target_layer_ids"):
        _config(target_layer_ids=(1, 8))  # layer 8 does not exist in an 8-layer target
    with pytest.raises(ValueError, match="mask_token_id"):
        _config(mask_token_id=100)


def test_config_json_is_the_zlab_layout_and_round_trips():
    cfg = _config(draft_vocab_size=40)
    d = cfg.to_json_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 3, 5]}
    assert (d["block_size"], d["num_target_layers"], d["num_hidden_layers"]) == (B, 8, 2)
    assert d["layer_types"] == ["full_attention", "full_attention"]  # non-causal in vLLM
    assert "eagle_aux_hidden_state_layer_ids" not in d  # vLLM would read it first, as HF indices
    assert DFlashConfig.from_json_dict(d) == cfg
    bad = {**d, "dflash_config": {"target_layer_ids": [1, 3, 5]}}
    with pytest.raises(ValueError, match="config.json: dflash_config"):
        DFlashConfig.from_json_dict(bad)


# ---- (e) the state dict is what vLLM 0.32's qwen3_dflash.py loads ----

# vLLM 0.32 DFlashQwen3Model.hf_to_vllm_mapper.orig_to_new_stacked (checked against the source below when present)
VLLM_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
                ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def _vllm_parameters(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """The parameters of vLLM 0.32's DFlashQwen3ForCausalLM (tp 1) a DFlash file fills, with their shapes (the
    embedding and `mask_embedding` are dropped by its loader when the file has none)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"model.fc.weight": (h, cfg.num_features * cfg.target_hidden_size), "model.hidden_norm.weight": (h,),
           "model.norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * d, h),
                    p + "self_attn.o_proj.weight": (h, nh * d),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_up_proj.weight": (2 * i, h), p + "mlp.down_proj.weight": (h, i)})
    if cfg.reduced_vocab:  # otherwise vLLM shares the target's lm_head and has no draft_id_to_target_id
        out["lm_head.weight"] = (cfg.draft_vocab_size, h)
        out["draft_id_to_target_id"] = (cfg.draft_vocab_size,)
    return out


def _load_like_vllm(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """DFlashQwen3ForCausalLM.load_weights' renaming (d2t -> draft_id_to_target_id, `model.` before everything but
    lm_head) and the stacked q/k/v and gate/up loads, concatenated along dim 0 in vLLM's order."""
    assert not any("mask_hidden" in n for n in state)  # vLLM's loader asserts it away
    parts: dict[str, list[tuple[object, tuple[int, ...]]]] = {}
    for name, t in state.items():
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        shard = None
        for old, (new, shard_id) in VLLM_STACKED.items():
            if old in name:
                name, shard = name.replace(old, new), shard_id
        parts.setdefault(name, []).append((shard, tuple(t.shape)))
    order = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
    out = {}
    for name, ps in parts.items():
        ps.sort(key=lambda s: order[s[0]])
        assert [s for s, _ in ps] in ([None], ["q", "k", "v"], [0, 1]), (name, ps)
        shapes = [shape for _, shape in ps]
        assert all(s[1:] == shapes[0][1:] for s in shapes), (name, shapes)
        out[name] = (sum(s[0] for s in shapes), *shapes[0][1:])
    return out


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_state_dict_is_what_vllm_loads(draft_vocab_size):
    cfg = _config(draft_vocab_size=draft_vocab_size, head_dim=32)
    drafter = DFlashDrafter(cfg)
    state = drafter.state_dict()
    assert _load_like_vllm(state) == _vllm_parameters(cfg)
    if draft_vocab_size:
        assert state["d2t"].dtype == torch.int64
    assert not any("rotary" in n or "embed" in n for n in state)


def _vllm_source() -> Path | None:
    candidates = []
    python = os.environ.get("EAGLE3_ZOO_VLLM_PYTHON")
    if python:
        candidates.append(Path(python).absolute().parents[1])  # the venv, not the interpreter it links to
    candidates.append(ROOT / ".venv-vllm")
    for venv in candidates:
        for site in glob.glob(str(venv / "lib" / "python3*" / "site-packages")):
            path = Path(site) / "vllm" / "model_executor" / "models" / "qwen3_dflash.py"
            if path.is_file():
                return path
    return None


def _self_attributes(tree: ast.Module, cls: str) -> set[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_vllm_mirror_matches_vllm_032_source():
    """The mirror above against the loader it mirrors, read with `ast` (vLLM is not imported). Skipped without an
    engine venv (scripts/setup_engine.sh, or EAGLE3_ZOO_VLLM_PYTHON)."""
    path = _vllm_source()
    if path is None:
        pytest.skip("no vLLM source (.venv-vllm or EAGLE3_ZOO_VLLM_PYTHON)")
    version = (path.parents[2] / "_version.py").read_text()
    assert "(0, 32, " in version, f"{path}: the mirror was read from vLLM 0.32"
    source = path.read_text()
    tree = ast.parse(source)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DFlashQwen3Model")
    mapper = next(n.value for n in model.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "hf_to_vllm_mapper")
    stacked = next(k.value for k in mapper.keywords if k.arg == "orig_to_new_stacked")
    assert ast.literal_eval(stacked) == VLLM_STACKED
    assert {"qkv_proj", "o_proj", "q_norm", "k_norm"} <= _self_attributes(tree, "DFlashQwen3Attention")
    assert {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} <= \
        _self_attributes(tree, "DFlashQwen3DecoderLayer")
    assert {"layers", "fc", "hidden_norm", "norm", "embed_tokens", "mask_embedding"} <= \
        _self_attributes(tree, "DFlashQwen3Model")
    assert {"lm_head", "draft_id_to_target_id"} <= _self_attributes(tree, "DFlashQwen3ForCausalLM")
    assert 'name.replace("d2t", "draft_id_to_target_id")' in source and 'name = "model." + name' in source
    assert "from .qwen2 import Qwen2MLP as Qwen3MLP" in source
    qwen2 = ast.parse((path.parent / "qwen2.py").read_text())
    assert {"gate_up_proj", "down_proj"} <= _self_attributes(qwen2, "Qwen2MLP")
    assert "[i + 1 for i in (dflash_config.get(\"target_layer_ids\")" in \
        (path.parents[2] / "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py").read_text()  # aux id = id + 1


# ---- (f) the objective: weights, labels, anchors, acceptance, chunked CE ----

def test_dpace_weights_by_hand():
    q = torch.tensor([[0.8, 0.6, 0.4], [0.8, 0.6, 0.4]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    w = dpace_weights(-q.log(), mask, alpha=0.5)
    # smoothed 0.9, 0.8, 0.7 -> prefixes 0.9, 0.72, 0.504 -> suffix sums
    torch.testing.assert_close(w[0], torch.tensor([2.124, 1.224, 0.504]))
    # the unsupervised slot: smoothed 1 and weight 0; prefixes 0.9, 0.9, 0.63
    torch.testing.assert_close(w[1], torch.tensor([1.53, 0.0, 0.63]))
    assert not dpace_weights(-q.log().requires_grad_(), mask).requires_grad  # detached


def test_decay_weights_and_acceptance_length_by_hand():
    torch.testing.assert_close(decay_weights(3, gamma=4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    correct = torch.tensor([[True, True, False], [True, True, True], [False, True, True], [True, True, True]])
    mask = torch.tensor([[True, True, True], [True, False, True], [True, True, True], [False, False, False]])
    total, blocks = acceptance_length(correct, mask)
    assert (total.item(), blocks.item()) == (3 + 2 + 1, 3)  # runs 2, 1, 0 plus the bonus token; block 4 unsupervised


def test_block_labels_and_anchor_selection():
    ids = torch.arange(10)[None]
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    labels, mask = block_labels(ids, lm, torch.tensor([[2, 7]]), torch.tensor([[True, True]]), 4)
    assert labels.tolist() == [[[3, 4, 5], [8, 9, 9]]]
    assert mask.tolist() == [[[True, True, False], [True, True, False]]]  # x5 unsupervised; x10 past the end
    anchors, valid = select_anchors(lm, 8, torch.Generator().manual_seed(0))
    assert anchors[valid].tolist() == [2, 3, 6, 7, 8]  # token and next token supervised, a >= 1
    assert not valid[0, 5:].any()
    few, fvalid = select_anchors(lm, 2, torch.Generator().manual_seed(1))
    assert fvalid.all() and set(few[0].tolist()) <= {2, 3, 6, 7, 8} and few[0, 0] < few[0, 1]


def test_chunked_cross_entropy_matches_full_logits_with_gradients():
    torch.manual_seed(3)
    h = torch.randn(37, 16, dtype=torch.double, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.double, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    ce, pred = chunked_cross_entropy(h, w, labels, chunk=8)
    full = F.cross_entropy((h @ w.T).float(), labels, reduction="none")
    torch.testing.assert_close(ce, full)
    assert torch.equal(pred, (h @ w.T).argmax(-1))
    gh, gw = torch.autograd.grad((ce * torch.arange(37)).sum(), (h, w))
    rh, rw = torch.autograd.grad((full * torch.arange(37)).sum(), (h, w))
    torch.testing.assert_close((gh, gw), (rh, rw))


@pytest.mark.parametrize("weighting", ["dpace", "decay"])
def test_dflash_loss_equals_the_per_block_formula(weighting):
    cfg, drafter, aux, ids, embed = _setup(4)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.double)
    lmask = torch.ones(2, T, dtype=torch.bool)
    lmask[:, :3] = False
    lmask[1, 12] = False
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    out = dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, lm_head, weighting=weighting, chunk=5)
    out.loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    total, n, accepted, blocks = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for b in range(2):
            for j, a in enumerate(ANCHORS[b].tolist()):
                if not valid[b, j]:
                    continue
                logits = drafter.draft_block(aux[b:b + 1, :a], ids[b:b + 1, a], embed)[0, 1:] @ lm_head.T
                ks = [k for k in range(1, B) if a + k < T and lmask[b, a + k]]
                if not ks:
                    continue
                ce = {k: F.cross_entropy(logits[k - 1], ids[b, a + k]).item() for k in ks}
                if weighting == "decay":
                    w = {k: math.exp(-(k - 1) / 4.0) for k in ks}
                else:
                    s, prefix = 1.0, {}
                    for k in range(1, B):
                        s *= 0.5 * math.exp(-ce[k]) + 0.5 if k in ks else 1.0
                        prefix[k] = s
                    w = {k: sum(prefix[m] for m in ks if m >= k) for k in ks}
                total += sum(w[k] * ce[k] for k in ks)
                n += len(ks)
                run = 0
                for k in range(1, B):
                    if k in ks and logits[k - 1].argmax().item() == ids[b, a + k].item():
                        run += 1
                    else:
                        break
                accepted += run + 1
                blocks += 1
    assert out.num_supervised.item() == n
    assert out.loss.item() == pytest.approx(total / n, rel=1e-6)
    assert out.acceptance_length.item() == pytest.approx(accepted / blocks)


def test_reduced_vocabulary_loss_maps_labels_through_d2t():
    cfg, drafter, aux, ids, embed = _setup(5, draft_vocab_size=60)
    used = [i for i in range(100) if i % 5 < 3]  # 60 ids, sorted
    with torch.no_grad():
        drafter.d2t.copy_(torch.tensor(used) - torch.arange(60))
    lmask = torch.ones(2, T, dtype=torch.bool)
    valid = torch.ones_like(ANCHORS, dtype=torch.bool)
    out = dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed)
    labels, mask = block_labels(ids, lmask, ANCHORS, valid, B)
    in_vocab = torch.isin(labels, torch.tensor(used))
    assert out.num_supervised.item() == int((mask & in_vocab).sum())  # out-of-vocabulary labels leave the loss
    assert 0 < out.num_supervised.item() < int(mask.sum())
    out.loss.backward()
    assert drafter.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_a_packed_row_equals_its_conversations_alone(attention):
    """Two conversations in one row (`position_ids` restarting, `document_ids`): every block, label, anchor and the
    loss equal those of the conversations unpacked."""
    cfg, drafter, aux, ids, embed = _setup(6)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.double)
    n1, n2 = 9, 11  # the first row's first 9 tokens, the second row's first 11
    p_aux = torch.cat([aux[0, :n1], aux[1, :n2]])[None]
    p_ids = torch.cat([ids[0, :n1], ids[1, :n2]])[None]
    pos = torch.cat([torch.arange(n1), torch.arange(n2)])[None]
    doc = torch.cat([torch.zeros(n1, dtype=torch.long), torch.ones(n2, dtype=torch.long)])[None]
    anchors = torch.tensor([[2, 6, 7, n1 + 1, n1 + 5, n1 + 9]])
    with torch.no_grad():
        packed = drafter.training_forward(p_aux, p_ids, anchors, embed, attention, pos, doc).view(6, B, -1)
        first = drafter.training_forward(aux[:1, :n1], ids[:1, :n1], anchors[:, :3], embed, attention)
        second = drafter.training_forward(aux[1:, :n2], ids[1:, :n2], anchors[:, 3:] - n1, embed, attention)
    torch.testing.assert_close(packed[:3], first.view(3, B, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[3:], second.view(3, B, -1), rtol=0, atol=1e-12)
    lmask = torch.ones(1, n1 + n2, dtype=torch.bool)
    labels, mask = block_labels(p_ids, lmask, anchors, torch.ones_like(anchors, dtype=torch.bool), B, doc)
    assert mask[0, 2].tolist() == [True, False, False]  # anchor 7: x9 is the second conversation's first token
    assert mask[0, 1].tolist() == [True, True, False]
    got, valid = select_anchors(lmask, 30, torch.Generator().manual_seed(0), doc)
    assert got[valid].tolist() == [*range(1, n1 - 1), *range(n1 + 1, n1 + n2 - 1)]  # no anchor straddles the seam
    if attention == "dense":  # the loss too (flex has no backward on CPU; its forward is what differs)
        v = torch.ones(1, 3, dtype=torch.bool)
        packed_loss = dflash_loss(drafter, p_aux, p_ids, lmask, anchors, torch.ones(1, 6, dtype=torch.bool), embed,
                                  lm_head, position_ids=pos, document_ids=doc)
        a = dflash_loss(drafter, aux[:1, :n1], ids[:1, :n1], lmask[:, :n1], anchors[:, :3], v, embed, lm_head)
        b = dflash_loss(drafter, aux[1:, :n2], ids[1:, :n2], lmask[:, :n2], anchors[:, 3:] - n1, v, embed, lm_head)
        n = a.num_supervised + b.num_supervised
        assert packed_loss.num_supervised == n
        torch.testing.assert_close(packed_loss.loss, (a.loss * a.num_supervised + b.loss * b.num_supervised) / n)


def test_a_batch_with_nothing_supervised_gives_a_zero_loss_that_backpropagates():
    _, drafter, aux, ids, embed = _setup(7)
    out = dflash_loss(drafter, aux, ids, torch.zeros(2, T, dtype=torch.bool), ANCHORS,
                      torch.zeros_like(ANCHORS, dtype=torch.bool), embed, torch.randn(100, 64, dtype=torch.double))
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.num_supervised.item() == 0
    assert drafter.fc.weight.grad is not None and out.acceptance_length.item() == 0.0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_bf16_autocast_runs_both_attention_paths():
    torch.manual_seed(8)
    cfg = _config()
    drafter = DFlashDrafter(cfg)
    aux, ids = torch.randn(2, T, 3 * 64), torch.randint(0, 99, (2, T))
    embed = torch.randn(100, 64)
    with torch.no_grad():
        ref = drafter.training_forward(aux, ids, ANCHORS, embed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dense = drafter.training_forward(aux, ids, ANCHORS, embed, "dense")
            flex = drafter.training_forward(aux, ids, ANCHORS, embed, "flex")
    torch.testing.assert_close(flex.float(), dense.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(dense.float(), ref, rtol=0.05, atol=0.1)


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_the_saved_folder_is_what_vllm_loads_and_reads_back(tmp_path, draft_vocab_size):
    import json

    from safetensors import safe_open

    from eagle3_zoo.drafters.dflash.model import CONFIG_NAME, WEIGHTS_NAME

    cfg, drafter, aux, ids, embed = _setup(9, draft_vocab_size=draft_vocab_size, torch_dtype="bfloat16")
    if draft_vocab_size:
        with torch.no_grad():
            drafter.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))
    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert _load_like_vllm({k: torch.empty(s) for k, s in shapes.items()}) == _vllm_parameters(cfg)
    assert {d for k, d in dtypes.items() if k != "d2t"} == {"BF16"}
    assert dtypes.get("d2t", "I64") == "I64"
    assert DFlashConfig.from_json_dict(json.loads((tmp_path / CONFIG_NAME).read_text())) == cfg
    back = DFlashDrafter.from_pretrained(tmp_path, dtype=torch.double)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), back.state_dict().items(), strict=True):
        expected = a.to(torch.bfloat16).double() if a.is_floating_point() else a
        assert torch.equal(b, expected), name
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DFlashDrafter.from_pretrained(tmp_path)
