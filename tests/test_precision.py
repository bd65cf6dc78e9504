"""Mixed precision and the TTT attention backends: the TTT loss and every attention backend under autocast against
the fp32 naive reference (forward and all gradients), the single fp32 lm_head gradient buffer, the FlexAttention
block mask, and a tiny `fit` with `trainer.precision=bf16-mixed`.

Tolerances are relative errors (||x - ref|| / ||ref||), about 3x the largest error measured on this CPU (torch 2.13):
TTT loss bf16 1.7e-4 (per step 4e-4), gradients 2.1e-2 (worst parameter); fp16 5e-6 / 1.4e-5 / 2.5e-3; one attention
call, output / gradients: fp32 2e-7 / 4e-7, bf16 3.7e-3 / 6.1e-3, fp16 4.7e-4 / 7.2e-4. bf16 keeps 8 mantissa bits
(unit roundoff 2e-3), fp16 11 (2.4e-4): a few roundoffs are expected, a wrong formula is far larger.
"""

from __future__ import annotations

import csv
import math

import pytest
import torch
from training_fixtures import run_fit_cli, save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

import eagle3_zoo.modeling.drafter as drafter_module
from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.modeling.attention import (
    _FLEX_BLOCK,
    TTT_BACKENDS,
    _ttt_block_mask,
    ttt_attention,
    ttt_attention_reference,
    ttt_backend,
)
from tests.test_loss_vocab import _naive_ttt_loss
from tests.tiny import tiny_drafter

# relative error bounds: (loss, gradient norm) for the TTT loss; (output, gradient norm) for one attention call
LOSS_TOL = {torch.bfloat16: (1.5e-3, 6e-2), torch.float16: (1e-4, 8e-3)}
ATTN_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12))


def _batch(drafter, b=2, t=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g)
    target_logits = torch.randn(b, t, cfg.vocab_size, generator=g) * 3
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    return ids, aux, target_logits, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_ttt_loss_and_grads_match_fp32_naive_reference(dtype, monkeypatch):
    drafter, embed = tiny_drafter()
    ids, aux, target_logits, mask = _batch(drafter)
    steps, chunk = 3, 16
    params = list(drafter.parameters())
    with torch.autocast("cpu", dtype=dtype):
        out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, chunk=chunk)
    assert int(out.num_supervised.sum()) > 4 * chunk  # the fused loss runs over several chunks
    grads = torch.autograd.grad(out.loss, params)  # outside autocast, as Lightning calls backward
    fp32 = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, chunk=chunk)
    # the reference: per-position loops and the naive [T, (k+1)T] masked attention, all fp32
    monkeypatch.setattr(drafter_module, "ttt_attention", ttt_attention_reference)
    ref_total, ref_steps = _naive_ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps,
                                           [0.8**k for k in range(steps)])
    ref_grads = torch.autograd.grad(ref_total, params)
    loss_tol, grad_tol = LOSS_TOL[dtype]
    assert out.loss.dtype == torch.float32
    assert float(out.loss.detach()) != float(fp32.loss.detach())  # autocast did take effect
    assert abs(float(out.loss) / float(ref_total) - 1) < loss_tol
    torch.testing.assert_close(out.step_losses, ref_steps.detach(), rtol=loss_tol, atol=0)
    assert torch.equal(out.num_supervised, fp32.num_supervised)
    for (name, _), g, r in zip(drafter.named_parameters(), grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        assert _rel(g, r) < grad_tol, f"{name}: relative gradient error {_rel(g, r):.2e} >= {grad_tol}"


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_one_fp32_lm_head_gradient_buffer_for_all_ttt_steps(autocast):
    drafter, embed = tiny_drafter()
    ids, aux, target_logits, mask = _batch(drafter)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=4, chunk=16)
    assert (out.num_supervised > 0).all()
    nodes, seen, todo = [], set(), [out.loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "FusedLMHeadLoss" in type(node).__name__:
            nodes.append(node)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    assert len(nodes) == 1, f"{len(nodes)} fused soft-CE calls for 4 TTT steps (one [Vd, H] buffer each)"
    grad_w = nodes[0].saved_tensors[1]
    assert grad_w.dtype == torch.float32 and grad_w.shape == drafter.lm_head.weight.shape


def test_ttt_backend_is_chosen_once_per_device():
    assert ttt_backend("cpu") == "cpu-flash" and ttt_backend("cuda") == "flex" and ttt_backend("mps") == "explicit"
    q, ks, vs = _attn_inputs(2, 2, torch.float32)
    assert torch.equal(ttt_attention(q, ks, vs), ttt_attention(q, ks, vs, backend=ttt_backend("cpu")))
    with pytest.raises(ValueError, match="unknown TTT attention backend 'sdpa'; valid: cpu-flash, flex, explicit"):
        ttt_attention(q, ks, vs, backend="sdpa")


def _attn_inputs(n_steps, kv_heads, dtype, device="cpu", t=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 4, 16

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    return rand(b, h, t, d), [rand(b, kv_heads, t, d) for _ in range(n_steps)], \
        [rand(b, kv_heads, t, d) for _ in range(n_steps)]


def _check_backend(backend, n_steps, kv_heads, amp_dtype, device="cpu", grads=True):
    """`backend` (under autocast to `amp_dtype`, or fp32 when None) against the fp32 reference."""
    q, ks, vs = _attn_inputs(n_steps, kv_heads, torch.float32, device)
    leaves = [q, *ks, *vs]
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device)
    ref = ttt_attention_reference(q, ks, vs)
    ref_grads = torch.autograd.grad((ref * d_out).sum(), leaves)
    with torch.autocast(device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        if grads:
            out = ttt_attention(q, ks, vs, backend=backend)
        else:
            with torch.no_grad():
                out = ttt_attention(q, ks, vs, backend=backend)
    tol = ATTN_TOL[amp_dtype or torch.float32]
    assert out.dtype == (amp_dtype or torch.float32)
    assert _rel(out, ref) < tol, f"output relative error {_rel(out, ref):.2e}"
    if grads:
        got = torch.autograd.grad((out.float() * d_out).sum(), leaves)  # backward outside autocast
        for i, (a, r) in enumerate(zip(got, ref_grads)):
            assert a.dtype == torch.float32, i
            assert _rel(a, r) < tol, f"gradient {i}: relative error {_rel(a, r):.2e}"


AMP = [None, torch.bfloat16, torch.float16]
AMP_IDS = ["fp32", "bf16-autocast", "fp16-autocast"]


@pytest.mark.parametrize("amp_dtype", AMP, ids=AMP_IDS)
@pytest.mark.parametrize("backend", ["cpu-flash", "explicit"])
@pytest.mark.parametrize("n_steps,kv_heads", [(1, 2), (2, 4), (4, 1), (7, 2)])
def test_cpu_backends_match_reference(backend, n_steps, kv_heads, amp_dtype):
    _check_backend(backend, n_steps, kv_heads, amp_dtype)


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("n_steps,kv_heads", [(1, 2), (3, 1), (7, 4)])
def test_flex_formulation_forward_on_cpu_matches_reference(n_steps, kv_heads, amp_dtype):
    """FlexAttention runs forward on CPU (eager: dense math over the same mask function the CUDA kernel uses)."""
    _check_backend("flex", n_steps, kv_heads, amp_dtype, grads=False)


@pytest.mark.parametrize("n_steps,kv_heads", [(2, 2), (7, 1)])
def test_flex_formulation_gradients_on_cpu_match_reference(n_steps, kv_heads, monkeypatch):
    """Gradients through the flex formulation (padding, key concatenation, GQA) with torch's eager dense FlexAttention
    backward, which runs on CPU once its CPU device check is lifted; the compiled CUDA kernel is checked on a GPU."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    _check_backend("flex", n_steps, kv_heads, None)


@pytest.mark.parametrize("t,n_diag", [(1, 1), (127, 3), (128, 6), (300, 2)])
def test_flex_block_mask_gives_exactly_the_ttt_pattern(t, n_diag):
    """The block-sparse semantics the CUDA kernel executes (full blocks: all visible; partial blocks: the mask
    function; unlisted blocks: skipped) equal the TTT pattern on every (query, key) pair. The eager CPU path applies
    the mask function everywhere and would not notice wrong block indices: this test does."""
    seg = math.ceil(t / _FLEX_BLOCK) * _FLEX_BLOCK
    bm = _ttt_block_mask(seg, n_diag, torch.device("cpu"))
    n_q, n_kv = seg // _FLEX_BLOCK, (n_diag + 1) * seg // _FLEX_BLOCK

    def dense(num, idx):
        out = torch.zeros(n_q, n_kv, dtype=torch.bool)
        for i in range(n_q):
            out[i, idx[0, 0, i, : int(num[0, 0, i])].long()] = True
        return out

    full, partial = dense(bm.full_kv_num_blocks, bm.full_kv_indices), dense(bm.kv_num_blocks, bm.kv_indices)
    assert not (full & partial).any()
    q_idx = torch.arange(seg)[:, None]
    kv_idx = torch.arange((n_diag + 1) * seg)[None, :]

    def expand(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.repeat_interleave(_FLEX_BLOCK, 0).repeat_interleave(_FLEX_BLOCK, 1)

    kernel = expand(full) | (expand(partial) & bm.mask_mod(0, 0, q_idx, kv_idx))
    step, pos = kv_idx // seg, kv_idx % seg
    truth = ((step == 0) & (pos <= q_idx)) | ((step > 0) & (pos == q_idx))
    assert torch.equal(kernel, truth)
    assert int(partial.sum()) == n_q * (n_diag + 1)  # block-sparse: one partial block per segment and query block


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the compiled FlexAttention kernels run on GPUs only "
                           "(scripts/gpu_check.sh checks them on one)")
@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("n_steps,kv_heads", [(1, 2), (3, 1), (7, 4)])
def test_cuda_backend_matches_reference(n_steps, kv_heads, amp_dtype):
    _check_backend(ttt_backend("cuda"), n_steps, kv_heads, amp_dtype, device="cuda")


def test_fit_bf16_mixed_on_a_tiny_target(tmp_path):
    """`fit` with trainer.precision=bf16-mixed (16-mixed is not run here: on CPU Lightning replaces it by bf16-mixed;
    fp16 autocast is covered by the loss and attention tests above)."""
    target = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=16)
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_recipe(tmp_path, target, data, trainer={"max_steps": 3}))
    r = run_fit_cli(recipe, "trainer.precision=bf16-mixed")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Using bfloat16 Automatic Mixed Precision (AMP)" in r.stderr
    rows = list(csv.DictReader(open(tmp_path / "run/logs/version_0/metrics.csv")))
    losses = [float(row["train/loss"]) for row in rows if row["train/loss"]]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)
    assert (tmp_path / "run/drafter/model.safetensors").is_file()


def test_all_backends_are_tested():
    assert set(TTT_BACKENDS) == {"cpu-flash", "flex", "explicit"}  # a new backend needs its reference test above
