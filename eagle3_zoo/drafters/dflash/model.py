"""The DFlash drafter: `Ld` Qwen3-style decoder layers that draft a block of B tokens in one forward pass.

    ctx      = hidden_norm(fc(cat(f_1 .. f_n)))           # n target decoder-layer outputs per context position
    x        = embed([anchor, MASK x (B-1)])              # the target's frozen embedding, positions a .. a+B-1
    per layer:
      q      = rope(q_norm(q_proj(input_layernorm(x))))
      k, v   = cat(rope(k_norm(k_proj(ctx))), rope(k_norm(k_proj(input_layernorm(x))))), cat(v_proj(ctx), v_proj(..))
      x      = x + o_proj(attn(q, k, v))                  # "KV injection": the context enters only as keys/values
      x      = x + mlp(post_attention_layernorm(x))       # SwiGLU
    logits   = lm_head(norm(x))                           # slot k (1..B-1) predicts x_{a+k}; slot 0 predicts nothing

Visibility, as vLLM 0.32's DFlash proposer runs it: the context of a block anchored at position a is the features of
positions 0..a-1 only. The anchor is the target's bonus token x_a, whose own features the target has not computed
yet when the block is drafted (vLLM puts the query block at `last verified position + 1 ..`), so the anchor
position's context feature is NOT visible. Inside a block every slot sees every slot (bidirectional). In training,
many blocks share one forward: block j sees context positions < a_j and its own B slots, never another block.

The context keys/values are computed from `hidden_norm(fc(.))` directly (no `input_layernorm`), once per layer for
all context positions; vLLM precomputes them the same way (`precompute_and_store_context_kv`).

Weight names are those vLLM 0.32's `qwen3_dflash.py` loads (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`, and
`lm_head` + `d2t` only with a reduced draft vocabulary); the embedding and a full-vocabulary lm_head are the
target's, passed in, and never part of the state dict. RoPE frequencies are not saved either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3_zoo.drafters.dflash.config import DFlashConfig
from eagle3_zoo.util.fileio import atomic_write, atomic_write_text
from eagle3_zoo.values.dtypes import torch_dtype

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalised in fp32, cast back, then scaled."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate half). The inverse frequencies are a plain fp32 tensor, not a buffer: never saved,
    never cast by `.to(dtype)`; `_apply` moves them with the module."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        d = config.head_dim
        self.attention_scaling = 1.0
        with torch.device("cpu"):  # real values also when the drafter is built on the meta device
            self.inv_freq = self._inv_freq(config, d)

    def _inv_freq(self, config: DFlashConfig, d: int) -> torch.Tensor:
        if config.rope_scaling:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            params = {**config.rope_scaling, "rope_theta": config.rope_theta}
            hf = Qwen3Config(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                             head_dim=d, max_position_embeddings=config.max_position_embeddings,
                             rope_parameters=params)
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, torch.device("cpu"))
        else:
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        return inv_freq.to(torch.float32)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self.inv_freq.to(fn(torch.zeros(1)).device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[B, T]` -> cos, sin `[B, 1, T, d]` in `dtype`."""
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([angles, angles], dim=-1)[:, None]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, H]` (context features or normed block states) -> k (normed, RoPE), v `[B, kv_heads, T, d]`."""
        k = _rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, attend) -> torch.Tensor:
        q = _rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
        # under autocast the fp32 q/k norm weights promote q and k to fp32 while v is in autocast's dtype: hand the
        # kernel one dtype (v's), not a mixed fp32/bf16 triple
        out = attend(q.to(v.dtype), k.to(v.dtype), v)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, cos, sin, ctx, ctx_cos, ctx_sin, attend) -> torch.Tensor:
        ctx_k, ctx_v = self.self_attn.key_value(ctx, ctx_cos, ctx_sin)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_context_kv(self, x, cos, sin, ctx_k, ctx_v, attend) -> torch.Tensor:
        """`forward` with this layer's context keys/values already projected (`self_attn.key_value` of the context
        features at their positions): what decoding runs against its persistent draft KV cache."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- the training mask: block j = slots [j*B, (j+1)*B) of the query; keys = [context T | query blocks Q] ----

def block_positions(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The anchors' RoPE positions `[B, A]` -> the position of every slot `[B, A*block_size]` (p_j + k)."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return (anchor_positions[..., None] + offsets).flatten(-2)


def dense_block_mask(anchors: torch.Tensor, context_len: int, block_size: int,
                     document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """bool `[B, Q, T+Q]` (True = visible), Q = A*block_size: a slot of block j sees context positions < a_j (of the
    anchor's document in a packed row, `document_ids [B, T]`) and the slots of block j. The dense reference of
    `flex_block_mask`."""
    b, a = anchors.shape
    q = a * block_size
    block_of = torch.arange(q, device=anchors.device) // block_size  # [Q]
    slot_anchor = anchors[:, block_of]  # [B, Q]
    ctx = torch.arange(context_len, device=anchors.device)[None, None, :] < slot_anchor[..., None]  # [B, Q, T]
    if document_ids is not None:
        ctx = ctx & (document_ids[:, None, :] == document_ids.gather(1, slot_anchor)[..., None])
    same = (block_of[:, None] == block_of[None, :]).expand(b, q, q)
    return torch.cat([ctx, same], dim=-1)


def flex_mask_mod(anchors: torch.Tensor, context_len: int, block_size: int, document_ids: torch.Tensor | None = None):
    """The FlexAttention `mask_mod` of `dense_block_mask`."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[b, block]
        in_context = (kv_idx < context_len) & (kv_idx < anchor)
        if document_ids is not None:  # (kv_idx % T: a valid index also for the block keys, which this term drops)
            in_context = in_context & (document_ids[b, kv_idx % context_len] == document_ids[b, anchor])
        same_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return in_context | same_block

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int,
                    document_ids: torch.Tensor | None = None):
    """A FlexAttention `BlockMask` for `dense_block_mask` (compiled construction on CUDA: no dense grid)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, a = anchors.shape
    q = a * block_size
    return create_block_mask(flex_mask_mod(anchors, context_len, block_size, document_ids), b, None, q, context_len + q,
                             device=anchors.device, _compile=anchors.is_cuda)


_compiled_flex = None


def _flex_attention(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.is_cuda:  # eager FlexAttention materialises the scores; compiled it is a fused kernel
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


class DFlashDrafter(nn.Module):
    """The DFlash drafter. `embed_weight` (the target's input embedding, `[V, H]`) is passed to every forward and
    never stored; so is the target's lm_head weight for a full-vocabulary drafter (`head_weight`)."""

    config_class = DFlashConfig  # what `from_pretrained` reads config.json with (a subclass may declare its own)
    sample_from_anchor = False  # slot 0 (the anchor) predicts nothing; slots 1..B-1 predict positions a+1..a+B-1

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_features * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        if config.reduced_vocab:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # target = id + d2t
        else:
            self.lm_head = None
            self.d2t = None

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """`[B, T, n*H_target]` concatenated target layer outputs -> context features `[B, T, H]`."""
        return self.hidden_norm(self.fc(aux_hidden))

    def _run(self, ctx: torch.Tensor, ctx_pos: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
             embed_weight: torch.Tensor, attend) -> torch.Tensor:
        x = F.embedding(ids, embed_weight).to(self.fc.weight.dtype)  # the residual stream in the drafter's dtype
        cos, sin = self.rotary_emb(pos, x.dtype)
        ctx_cos, ctx_sin = self.rotary_emb(ctx_pos, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx, ctx_cos, ctx_sin, attend)
        return self.norm(x)

    def block_ids(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """`[B, A*block_size]` query ids: each block is [x_{a_j}, MASK x (B-1)]."""
        bsz = self.config.block_size
        ids = torch.full((*anchors.shape, bsz), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = input_ids.gather(1, anchors)
        return ids.flatten(-2)

    def training_forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                         embed_weight: torch.Tensor, attention: str = "dense", position_ids: torch.Tensor | None = None,
                         document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """All blocks of a batch in one forward: aux_hidden `[B, T, n*H_target]`, input_ids `[B, T]`, anchors
        `[B, A]` (indices in 0..T-1) -> normed hidden states `[B, A*block_size, H]`, block-major.

        `attention`: "dense" (a `[B, Q, T+Q]` boolean mask through scaled_dot_product_attention: the reference, for
        CPU and small shapes) or "flex" (FlexAttention with a block mask; compiled on CUDA). Packed rows pass
        `position_ids` (restarting in each conversation) and `document_ids [B, T]`: a block then sees the context of
        its anchor's conversation only, at that conversation's positions."""
        t, bsz = aux_hidden.shape[1], self.config.block_size
        if attention == "dense":
            mask = dense_block_mask(anchors, t, bsz, document_ids)[:, None]

            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        elif attention == "flex":
            block_mask = flex_block_mask(anchors, t, bsz, document_ids)

            def attend(q, k, v):
                return _flex_attention(q, k, v, block_mask)
        else:
            raise ValueError(f"attention={attention!r}; expected 'dense' or 'flex'")
        ctx_pos = torch.arange(t, device=aux_hidden.device).expand(aux_hidden.shape[0], t) if position_ids is None \
            else position_ids
        return self._run(self.context(aux_hidden), ctx_pos, self.block_ids(input_ids, anchors),
                         block_positions(ctx_pos.gather(1, anchors), bsz), embed_weight, attend)

    def draft_block(self, aux_prefix: torch.Tensor, anchor_ids: torch.Tensor,
                    embed_weight: torch.Tensor) -> torch.Tensor:
        """One block the way decoding drafts it: the features of the verified positions 0..P-1 (`aux_prefix`
        `[B, P, n*H_target]`) and the anchor (bonus) token `anchor_ids [B]` at position P -> normed hidden states
        `[B, block_size, H]` of the slots at positions P..P+block_size-1. Every key is visible: no mask."""
        b, p = aux_prefix.shape[:2]
        anchors = torch.full((b, 1), p, dtype=torch.long, device=aux_prefix.device)
        ids = torch.full((b, self.config.block_size), self.config.mask_token_id, dtype=torch.long,
                         device=aux_prefix.device)
        ids[:, 0] = anchor_ids
        ctx_pos = torch.arange(p, device=aux_prefix.device).expand(b, p)
        return self._run(self.context(aux_prefix), ctx_pos, ids, block_positions(anchors, self.config.block_size),
                         embed_weight, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    def head_weight(self, target_lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """The lm_head weight the drafter scores with: its own (reduced vocabulary) or the target's."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if target_lm_head_weight is None:
            raise ValueError("a full-vocabulary DFlash drafter scores with the target's lm_head: pass "
                             "target_lm_head_weight")
        return target_lm_head_weight

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (`id + d2t[id]`; unchanged for a full-vocabulary drafter)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def save_pretrained(self, save_dir: str | Path) -> Path:
        """Write the z-lab folder vLLM 0.32 loads: `config.json` (`DFlashConfig.to_json_dict`) and
        `model.safetensors` (the state dict in `config.torch_dtype`; `d2t` int64)."""
        save_dir = Path(save_dir)
        dtype = torch_dtype(self.config.torch_dtype)
        tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
                   for name, t in self.state_dict().items()}
        atomic_write(save_dir / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write_text(save_dir / CONFIG_NAME, json.dumps(self.config.to_json_dict(), indent=2) + "\n")
        return save_dir

    @classmethod
    def from_pretrained(cls, load_dir: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> DFlashDrafter:
        """Read a folder `save_pretrained` wrote (or a z-lab DFlash folder with the same tensors)."""
        load_dir = Path(load_dir)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (load_dir / name).is_file():
                raise FileNotFoundError(f"{load_dir}: no {name}; a DFlash drafter folder has {CONFIG_NAME} and "
                                        f"{WEIGHTS_NAME}")
        path = load_dir / CONFIG_NAME
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
        config = cls.config_class.from_json_dict(raw, source=str(path))
        state = load_file(str(load_dir / WEIGHTS_NAME), device=str(device))
        model = cls(config)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"{load_dir / WEIGHTS_NAME}: missing keys {missing}, unexpected keys {unexpected} for "
                             f"a DFlash drafter of {config.num_hidden_layers} layers, draft vocabulary "
                             f"{config.draft_vocab_size} of {config.vocab_size}")
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype or torch_dtype(config.torch_dtype))
