"""Attention kernels of the drafter: the Training-Time-Test (TTT) pattern, its naive reference, and cached decoding.

TTT step k, query at position t, sees the step-0 keys at positions <= t (causal) plus the keys that steps 1..k
produced at the same position t (the "diagonal"): exactly the keys a depth-k node sees while drafting a tree.

The CPU and CUDA backends keep no T x T score matrix. `ttt_backend` picks one per device type, once:
- "cpu-flash" (CPU): the causal part runs in PyTorch's fused CPU flash kernel, which also returns its log-sum-exp,
  and the k diagonal scores (one dot product each) are merged in log space. The backward re-uses the flash
  backward with the *merged* output and log-sum-exp, which makes its softmax-gradient term exact for the union of
  causal and diagonal keys (the same identity flash attention uses to combine blocks), and adds the diagonal terms
  by hand.
- "flex" (CUDA): one compiled FlexAttention call over the keys `[k0 | k1 .. kk]` with a block-sparse mask built
  directly from block indices: causal blocks on the step-0 segment, one identity-masked block per diagonal segment.
  FlexAttention's Triton kernels do forward and backward without materialising scores (it has no CPU backward).
- "explicit" (any other device, and where the CPU flash op is missing): the same log-space merge with explicit fp32
  causal scores; exact, portable, O(T^2) memory.

Packed rows (`document_ids`, several conversations in one row): every backend also hides the step-0 keys of other
documents (the diagonal keys are the query's own position, hence its own document). cpu-flash and explicit add the
document mask to the causal part; flex builds its block mask from the documents' block spans on the device.

Precision is explicit: under autocast q/k/v are cast to autocast's dtype before the kernel and the kernel runs with
autocast disabled in forward *and* backward (so both see the same dtypes); without autocast, the inputs' promoted
dtype. The merge and its log-sum-exp are fp32.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

_flash_fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


TTT_BACKENDS = ("cpu-flash", "flex", "explicit")
_FLEX_BLOCK = 128  # FlexAttention's default sparse block size; each step's key segment is padded to a multiple
FLEX_GRAPHS = 32  # the compiled FlexAttention's recompile limit (dynamo's default: 8)


@functools.cache
def ttt_backend(device_type: str) -> str:
    """The TTT attention backend for a device type (`"cpu"`, `"cuda"`, ...); the one place that chooses."""
    if device_type == "cpu":
        return "cpu-flash" if _flash_fwd is not None else "explicit"
    if device_type == "cuda":
        return "flex"
    return "explicit"


def document_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, T, T]` additive mask: 0 where query and key lie in the same document, -inf elsewhere."""
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return torch.zeros(same.shape, dtype=dtype, device=document_ids.device).masked_fill(~same, float("-inf"))


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float, doc_mask: torch.Tensor | None = None):
    t, groups = q.shape[-2], q.shape[1] // k.shape[1]
    s = (q.float() @ _expand_kv(k, groups).float().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s if doc_mask is None else s + doc_mask


def _causal_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flash: bool,
                     doc_mask: torch.Tensor | None = None):
    """Causal attention (within documents, with an additive `doc_mask`) and its log-sum-exp; k/v may have fewer
    (GQA) heads."""
    if flash:  # the CPU flash kernel handles GQA natively and returns the log-sum-exp
        out, lse = _flash_fwd(q, k, v, 0.0, True, attn_mask=_in(doc_mask, q.dtype), scale=scale)
        return out, lse.float()
    # explicit scores (devices without a kernel that exposes the log-sum-exp): exact, O(T^2) memory
    s = _causal_scores(q, k, scale, doc_mask)
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1) @ _expand_kv(v, q.shape[1] // v.shape[1]).float()).to(q.dtype)
    return out, lse


def _in(doc_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if doc_mask is None else doc_mask.to(dtype)


def _causal_backward(d_out, q, k, v, out, lse, scale, flash: bool, doc_mask: torch.Tensor | None = None):
    if flash:
        return _flash_bwd(d_out.contiguous(), q, k, v, out, lse, 0.0, True, attn_mask=_in(doc_mask, q.dtype),
                          scale=scale)
    groups = q.shape[1] // k.shape[1]
    p = torch.exp(_causal_scores(q, k, scale, doc_mask) - lse[..., None])  # probabilities w.r.t. the merged normaliser
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
    groups of g = h // hk query heads per KV head (head i uses KV head i // g, as `repeat_interleave`). All inputs
    share one dtype; forward and backward run with autocast disabled (see `ttt_attention`). `doc_mask`: None, or
    the `[B, 1, T, T]` additive `document_mask` of a packed batch (applied to the causal step-0 part).
    """

    @staticmethod
    def forward(ctx, scale: float, flash: bool, doc_mask, q, k0, v0, kd, vd):
        with torch.autocast(q.device.type, enabled=False):
            return _TTTAttention._forward(ctx, scale, flash, doc_mask, q, k0, v0, kd, vd)

    @staticmethod
    def _forward(ctx, scale, flash, doc_mask, q, k0, v0, kd, vd):
        b, h, t, d = q.shape
        hk = k0.shape[1]
        g = h // hk
        out_c, lse_c = _causal_with_lse(q, k0, v0, scale, flash, doc_mask)
        qg = q.float().reshape(b, hk, g, t, d)
        kdf, vdf = kd.float(), vd.float()
        s = torch.einsum("bkgtd,bktnd->bkgtn", qg, kdf) * scale
        lse_c = lse_c.view(b, hk, g, t)
        lse = torch.logaddexp(lse_c, torch.logsumexp(s, -1))
        a = torch.exp(lse_c - lse)[..., None]
        bw = torch.exp(s - lse[..., None])
        out = a * out_c.float().reshape(b, hk, g, t, d) + torch.einsum("bkgtn,bktnd->bkgtd", bw, vdf)
        out = out.reshape(b, h, t, d).to(q.dtype)
        ctx.scale, ctx.flash, ctx.doc_mask = scale, flash, doc_mask
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse.reshape(b, h, t), bw)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k0, v0, kd, vd, out, lse, bw = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return (None, None, None, *_TTTAttention._backward(d_out.to(q.dtype), q, k0, v0, kd, vd, out, lse, bw,
                                                               ctx.scale, ctx.flash, ctx.doc_mask))

    @staticmethod
    def _backward(d_out, q, k0, v0, kd, vd, out, lse, bw, scale, flash, doc_mask=None):
        b, h, t, d = q.shape
        hk = k0.shape[1]
        g = h // hk
        dq, dk0, dv0 = _causal_backward(d_out, q, k0, v0, out, lse, scale, flash, doc_mask)
        do = d_out.float().reshape(b, hk, g, t, d)
        delta = (do * out.float().reshape(b, hk, g, t, d)).sum(-1)
        kdf, vdf = kd.float(), vd.float()
        dvd = torch.einsum("bkgtn,bkgtd->bktnd", bw, do)
        ds = bw * (torch.einsum("bkgtd,bktnd->bkgtn", do, vdf) - delta[..., None]) * scale
        dq = dq.float() + torch.einsum("bkgtn,bktnd->bkgtd", ds, kdf).reshape(b, h, t, d)
        dkd = torch.einsum("bkgtn,bkgtd->bktnd", ds, q.float().reshape(b, hk, g, t, d))
        return dq.to(q.dtype), dk0, dv0, dkd.to(kd.dtype), dvd.to(vd.dtype)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@functools.lru_cache(maxsize=512)
def _ttt_block_mask(seg_len: int, n_diag: int, device: torch.device):
    """FlexAttention block mask for queries `[0, seg_len)` over keys `[k0 | k1 .. k_n]`, each segment `seg_len` long.

    Built from block indices (never from a dense `[T, (n+1)T]` mask): query block i reads the step-0 blocks
    0..i-1 in full, the step-0 block i causally and block i of every diagonal segment through the mask function.
    Cached: it depends only on its arguments, and building it costs a host-to-device copy (a sync) and ~30 small
    launches per TTT step. 512 entries hold every padded length up to 8192 tokens for 8 steps (~50 MB in all).
    """
    from torch.nn.attention.flex_attention import BlockMask

    nb = seg_len // _FLEX_BLOCK
    n_kv = (n_diag + 1) * nb
    i = torch.arange(nb, device=device, dtype=torch.int32)
    partial = torch.zeros(nb, n_kv, dtype=torch.int32, device=device)
    partial[:, : n_diag + 1] = i[:, None] + nb * torch.arange(n_diag + 1, device=device, dtype=torch.int32)
    partial_num = torch.full((nb,), n_diag + 1, dtype=torch.int32, device=device)
    full = torch.arange(n_kv, device=device, dtype=torch.int32).expand(nb, n_kv).contiguous()  # first i: 0..i-1
    # a tensor, not a Python int, in the mask function's closure: a new length needs no recompile
    seg = torch.tensor(seg_len, dtype=torch.int32, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = kv_idx % seg
        return ((kv_idx < seg) & (pos <= q_idx)) | ((kv_idx >= seg) & (pos == q_idx))

    return BlockMask.from_kv_blocks(partial_num[None, None], partial[None, None], i[None, None], full[None, None],
                                    BLOCK_SIZE=_FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(seg_len, n_kv * _FLEX_BLOCK))


def _document_block_mask(document_ids: torch.Tensor, seg_len: int, n_diag: int):
    """`_ttt_block_mask` for packed rows: the step-0 keys are also limited to the query's document.

    Built on the device from block spans (no wait for the host): document ids never decrease along a row, so the
    documents of a block are those between its first and last token. Step-0 block j < i is full for query block i
    when both blocks hold one and the same document, partial when they share one (the key block's last document is
    the query block's first), and skipped otherwise; the diagonal block and block i of each diagonal segment stay
    partial. Not cached: it depends on the batch.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, t = document_ids.shape
    device = document_ids.device
    # padded keys past t are hidden by causality already and padded queries are cut off: they join the row's last
    # document (ids still never decrease, and a last block of one document stays full)
    doc = torch.cat([document_ids, document_ids[:, -1:].expand(b, seg_len - t)], dim=1).to(torch.int32)
    nb = seg_len // _FLEX_BLOCK
    blocks = doc.view(b, nb, _FLEX_BLOCK)
    first, last = blocks[..., 0], blocks[..., -1]  # [B, nb]: the lowest and highest document of each block
    below = torch.ones(nb, nb, dtype=torch.bool, device=device).tril(-1)  # [i, j]: key block j before query block i
    full = below & (first[:, None, :] == last[:, :, None])  # [B, i, j]
    shared = below & (last[:, None, :] == first[:, :, None])
    eye = torch.eye(nb, dtype=torch.bool, device=device).expand(b, nb, nb)
    partial = torch.cat([(shared & ~full) | eye, *[eye] * n_diag], dim=-1)  # [B, nb, (n_diag + 1) * nb]
    full = torch.cat([full, torch.zeros(b, nb, n_diag * nb, dtype=torch.bool, device=device)], dim=-1)

    def listed(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the flagged block indices first, in ascending order (a stable sort of "not flagged"), and their count
        idx = torch.sort((~flags).to(torch.int8), dim=-1, stable=True).indices
        return flags.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]

    seg = torch.tensor(seg_len, dtype=torch.int32, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = kv_idx % seg
        ttt = ((kv_idx < seg) & (pos <= q_idx)) | ((kv_idx >= seg) & (pos == q_idx))
        return ttt & (doc[b, q_idx] == doc[b, pos])

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=_FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(seg_len, (n_diag + 1) * seg_len))


@functools.cache
def _compiled_flex():
    """FlexAttention compiled once per process for every batch shape the training sampler gives: dynamic shapes from
    the first call (no static graph for the first length), at least 2 blocks per segment (`_flex_ttt`: dynamo
    specialises sizes 0 and 1), and room for the graphs that sizes equal by chance still add (dynamo gives equal
    sizes one symbol, e.g. 4 heads and 4 blocks, and a later batch where they differ needs another graph) and for
    a batch of one sequence: its own recompile limit of `FLEX_GRAPHS`. Past the limit, dynamo would run FlexAttention
    in eager mode, i.e. dense attention."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=True)

    config = getattr(torch.compiler, "config", None)
    if not hasattr(config, "recompile_limit"):  # a torch without the public setting: dynamo's limit
        return compiled

    def flex(*args, **kwargs):
        # read when a call needs a new graph; the process's limit for everything else stays as it is
        with config.patch(recompile_limit=max(config.recompile_limit, FLEX_GRAPHS)):
            return compiled(*args, **kwargs)

    return flex


def _flex_ttt(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
              document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """TTT attention as one FlexAttention call (compiled on CUDA; eager, i.e. dense math, elsewhere)."""
    from torch.nn.attention.flex_attention import flex_attention

    t = q.shape[-2]
    # at least 2 blocks: a block count of 1 would be specialised by the compiler (a graph of its own for every batch
    # of <= 128 tokens, each TTT step count included)
    seg_len = max(-(-t // _FLEX_BLOCK), 2) * _FLEX_BLOCK
    pad = seg_len - t  # zero keys past t are never visible (causal: pos <= q < t; diagonal: pos == q < t)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, pad)) if pad else x

    k_all = torch.cat([padded(k) for k in keys], dim=-2)
    v_all = torch.cat([padded(v) for v in values], dim=-2)
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    mask = _ttt_block_mask(seg_len, len(keys) - 1, q.device) if document_ids is None else \
        _document_block_mask(document_ids, seg_len, len(keys) - 1)
    out = fn(padded(q), k_all, v_all, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys[0].shape[1])
    return out[..., :t, :]


def _compute_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return functools.reduce(torch.promote_types, (x.dtype for x in tensors))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  backend: str | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """TTT attention for step k = len(keys) - 1.

    Args:
        q: `[B, heads, T, d]` queries of step k (RoPE applied).
        keys, values: per step 0..k, `[B, kv_heads, T, d]` (RoPE applied to keys).
        backend: one of `TTT_BACKENDS`; default `ttt_backend(q.device.type)`.
        document_ids: `[B, T]` packed rows: the document of each position, never decreasing along a row; a query
            sees no key of another document. None = one document per row.

    Returns:
        `[B, heads, T, d]` in autocast's dtype under autocast, else the inputs' promoted dtype.
    """
    backend = backend or ttt_backend(q.device.type)
    if backend not in TTT_BACKENDS:
        raise ValueError(f"unknown TTT attention backend {backend!r}; valid: {', '.join(TTT_BACKENDS)}")
    dtype = _compute_dtype([q, *keys, *values])
    q, keys, values = q.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    scale = 1.0 / math.sqrt(q.shape[-1])
    with torch.autocast(q.device.type, enabled=False):
        if backend == "flex":
            return _flex_ttt(q, keys, values, scale, document_ids)
        doc_mask = None if document_ids is None else document_mask(document_ids, dtype)
        if len(keys) == 1:
            return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=doc_mask is None,
                                                  attn_mask=_causal_documents(doc_mask),
                                                  enable_gqa=q.shape[1] != keys[0].shape[1])
        kd = torch.stack(keys[1:], dim=3)  # [B, hk, T, n, d]
        vd = torch.stack(values[1:], dim=3)
        return _TTTAttention.apply(scale, backend == "cpu-flash", doc_mask, q, keys[0], values[0], kd, vd)


def _causal_documents(doc_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The causal part of an additive document mask (SDPA takes a mask or `is_causal`, not both)."""
    if doc_mask is None:
        return None
    t = doc_mask.shape[-1]
    return doc_mask.masked_fill(torch.ones(t, t, dtype=torch.bool, device=doc_mask.device).triu(1), float("-inf"))


def ttt_attention_reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                            document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Naive TTT attention: concatenate all steps' keys and build the full [T, (k+1)T] visibility mask (the step-0
    keys limited to the query's document with `document_ids [B, T]`)."""
    groups = q.shape[1] // keys[0].shape[1]
    t = q.shape[-2]
    k_all = torch.cat([_expand_kv(k, groups) for k in keys], dim=-2)
    v_all = torch.cat([_expand_kv(v, groups) for v in values], dim=-2)
    visible = [torch.ones(t, t, dtype=torch.bool, device=q.device).tril()]
    visible += [torch.eye(t, dtype=torch.bool, device=q.device)] * (len(keys) - 1)
    mask = torch.cat(visible, dim=-1)
    if document_ids is not None:
        same = document_ids[:, None, :, None] == document_ids[:, None, None, :]  # [B, 1, T, T]
        mask = mask & torch.cat([same, *[torch.ones_like(same)] * (len(keys) - 1)], dim=-1)
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
