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


def _use_flash(q: torch.Tensor) -> bool:
    return _flash_fwd is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16,
                                                                              torch.float16)


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    t, groups = q.shape[-2], q.shape[1] // k.shape[1]
    s = (q.float() @ _expand_kv(k, groups).float().transpose(-1, -2)) * scale
    return s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))


def _causal_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention and its log-sum-exp; k/v may have fewer (GQA) heads."""
    if _use_flash(q):  # the CPU flash kernel handles GQA natively and returns the log-sum-exp
        out, lse = _flash_fwd(q, k, v, 0.0, True, scale=scale)
        return out, lse.float()
    # portable path (e.g. CUDA, where SDPA does not expose the log-sum-exp): explicit scores, still exact
    s = _causal_scores(q, k, scale)
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1) @ _expand_kv(v, q.shape[1] // v.shape[1]).float()).to(q.dtype)
    return out, lse


def _causal_backward(d_out, q, k, v, out, lse, scale):
    if _use_flash(q):
        return _flash_bwd(d_out.contiguous(), q, k, v, out, lse, 0.0, True, scale=scale)
    groups = q.shape[1] // k.shape[1]
    p = torch.exp(_causal_scores(q, k, scale) - lse[..., None])  # probabilities w.r.t. the merged normaliser
    dp = d_out.float() @ _expand_kv(v, groups).float().transpose(-1, -2)
    delta = (d_out.float() * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ _expand_kv(k, groups).float()) * scale
    dk = (ds.transpose(-1, -2) @ q.float()) * scale
    dv = p.transpose(-1, -2) @ d_out.float()
    b, h, t, d = dk.shape
    if groups > 1:  # sum the expanded heads' gradients back onto their shared KV head
        dk = dk.view(b, h // groups, groups, t, d).sum(2)
        dv = dv.view(b, h // groups, groups, t, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TTTAttention(torch.autograd.Function):
    """softmax over {causal step-0 keys} U {diagonal keys of steps 1..k}.

    q `[B, h, T, d]`; k0/v0 `[B, hk, T, d]`; kd/vd `[B, hk, T, n, d]` (the n diagonal steps stacked), with GQA
    groups of g = h // hk query heads per KV head (head i uses KV head i // g, as `repeat_interleave`).
    """

    @staticmethod
    def forward(ctx, scale: float, q, k0, v0, kd, vd):
        b, h, t, d = q.shape
        hk = k0.shape[1]
        g = h // hk
        out_c, lse_c = _causal_with_lse(q, k0, v0, scale)
        qg = q.float().reshape(b, hk, g, t, d)
        kdf, vdf = kd.float(), vd.float()
        s = torch.einsum("bkgtd,bktnd->bkgtn", qg, kdf) * scale
        lse_c = lse_c.view(b, hk, g, t)
        lse = torch.logaddexp(lse_c, torch.logsumexp(s, -1))
        a = torch.exp(lse_c - lse)[..., None]
        bw = torch.exp(s - lse[..., None])
        out = a * out_c.float().reshape(b, hk, g, t, d) + torch.einsum("bkgtn,bktnd->bkgtd", bw, vdf)
        out = out.reshape(b, h, t, d).to(q.dtype)
        ctx.scale = scale
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse.reshape(b, h, t), bw)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k0, v0, kd, vd, out, lse, bw = ctx.saved_tensors
        scale = ctx.scale
        b, h, t, d = q.shape
        hk = k0.shape[1]
        g = h // hk
        dq, dk0, dv0 = _causal_backward(d_out, q, k0, v0, out, lse, scale)
        do = d_out.float().reshape(b, hk, g, t, d)
        delta = (do * out.float().reshape(b, hk, g, t, d)).sum(-1)
        kdf, vdf = kd.float(), vd.float()
        dvd = torch.einsum("bkgtn,bkgtd->bktnd", bw, do)
        ds = bw * (torch.einsum("bkgtd,bktnd->bkgtn", do, vdf) - delta[..., None]) * scale
        dq = dq.float() + torch.einsum("bkgtn,bktnd->bkgtd", ds, kdf).reshape(b, h, t, d)
        dkd = torch.einsum("bkgtn,bkgtd->bktnd", ds, q.float().reshape(b, hk, g, t, d))
        return None, dq.to(q.dtype), dk0, dv0, dkd.to(kd.dtype), dvd.to(vd.dtype)


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
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=groups > 1)
    kd = torch.stack(keys[1:], dim=3)  # [B, hk, T, n, d]
    vd = torch.stack(values[1:], dim=3)
    return _TTTAttention.apply(1.0 / math.sqrt(q.shape[-1]), q, keys[0], values[0], kd, vd)


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
