"""Attention kernels of the drafter: the Training-Time-Test (TTT) pattern, its naive reference, and cached decoding.

TTT step k, query at position t, sees the step-0 keys at positions <= t (causal) plus the keys that steps 1..k
produced at the same position t (the "diagonal"): exactly the keys a depth-k node sees while drafting a tree.

The fast path never builds a T x T score matrix for the diagonal: the causal part runs in PyTorch's fused CPU/GPU
flash kernel, which also returns its log-sum-exp, and the k diagonal scores (one dot product each) are merged in
log space. The backward re-uses the flash backward with the *merged* output and log-sum-exp, which makes its
softmax-gradient term exact for the union of causal and diagonal keys (the same identity flash attention uses
to combine blocks), and adds the diagonal terms by hand.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_flash_fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _causal_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    if _flash_fwd is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, lse = _flash_fwd(q, k, v, 0.0, True, scale=scale)
        return out, lse.float()
    # portable path (e.g. CUDA without the CPU op): explicit scores, still exact
    t = q.shape[-2]
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1) @ v.float()).to(q.dtype)
    return out, lse


def _causal_backward(d_out, q, k, v, out, lse, scale):
    if _flash_bwd is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return _flash_bwd(d_out.contiguous(), q, k, v, out, lse, 0.0, True, scale=scale)
    t = q.shape[-2]
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])  # probabilities w.r.t. the merged normaliser
    dp = d_out.float() @ v.float().transpose(-1, -2)
    delta = (d_out.float() * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ k.float()) * scale
    dk = (ds.transpose(-1, -2) @ q.float()) * scale
    dv = p.transpose(-1, -2) @ d_out.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TTTAttention(torch.autograd.Function):
    """softmax over {causal step-0 keys} U {diagonal keys of steps 1..k}; inputs [B, heads, T, d] (GQA expanded)."""

    @staticmethod
    def forward(ctx, scale: float, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, *diag: torch.Tensor):
        n = len(diag) // 2
        ks, vs = diag[:n], diag[n:]
        out_c, lse_c = _causal_with_lse(q, k0, v0, scale)
        s = torch.stack([(q.float() * kj.float()).sum(-1) * scale for kj in ks], -1)  # [B,h,T,n]
        lse = torch.logaddexp(lse_c, torch.logsumexp(s, -1))
        a = torch.exp(lse_c - lse)[..., None]
        b = torch.exp(s - lse[..., None])
        out = a * out_c.float()
        for j in range(n):
            out = out + b[..., j, None] * vs[j].float()
        out = out.to(q.dtype)
        ctx.scale = scale
        ctx.n = n
        ctx.save_for_backward(q, k0, v0, out, lse, b, *ks, *vs)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k0, v0, out, lse, b, *kv = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        ks, vs = kv[:n], kv[n:]
        dq, dk0, dv0 = _causal_backward(d_out, q, k0, v0, out, lse, scale)
        dq = dq.float()
        d_out_f = d_out.float()
        delta = (d_out_f * out.float()).sum(-1)  # [B,h,T]
        dks, dvs = [], []
        for j in range(n):
            bj = b[..., j]
            dvs.append((bj[..., None] * d_out_f).to(vs[j].dtype))
            ds = bj * ((d_out_f * vs[j].float()).sum(-1) - delta) * scale
            dq = dq + ds[..., None] * ks[j].float()
            dks.append((ds[..., None] * q.float()).to(ks[j].dtype))
        return (None, dq.to(q.dtype), dk0, dv0, *dks, *dvs)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """TTT attention for step k = len(keys) - 1.

    Args:
        q: `[B, heads, T, d]` queries of step k (RoPE applied).
        keys, values: per step 0..k, `[B, kv_heads, T, d]` (RoPE applied to keys).

    Returns:
        `[B, heads, T, d]`.
    """
    groups = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=groups > 1)
    ks = [_expand_kv(k, groups) for k in keys]
    vs = [_expand_kv(v, groups) for v in values]
    return _TTTAttention.apply(scale, q, ks[0], vs[0], *ks[1:], *vs[1:])


def ttt_attention_reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Naive TTT attention: concatenate all steps' keys and build the full [T, (k+1)T] visibility mask."""
    groups = q.shape[1] // keys[0].shape[1]
    t = q.shape[-2]
    k_all = torch.cat([_expand_kv(k, groups) for k in keys], dim=-2)
    v_all = torch.cat([_expand_kv(v, groups) for v in values], dim=-2)
    visible = [torch.ones(t, t, dtype=torch.bool, device=q.device).tril()]
    visible += [torch.eye(t, dtype=torch.bool, device=q.device)] * (len(keys) - 1)
    mask = torch.cat(visible, dim=-1)
    scores = (q @ k_all.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v_all


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of `q` new queries over all cached keys (`past + q`).

    `attn_mask` is additive `[B, 1, q, past+q]` (0 = visible); None means every past key is visible and the new
    tokens attend causally among themselves.
    """
    groups = q.shape[1] // k.shape[1]
    nq, nk = q.shape[-2], k.shape[-2]
    if attn_mask is None and nq > 1:
        past = nk - nq
        visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=past)
        attn_mask = torch.zeros(nq, nk, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=groups > 1)
