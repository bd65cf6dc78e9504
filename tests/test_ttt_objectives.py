"""Every TTT loss option through `ttt_loss` (fused lm_head, chunked, per-step weights) against a naive per-position
definition: the loss, every step's loss and expected acceptance, and every parameter's gradient, in fp32 and under
bf16 / fp16 autocast; on EAGLE-3 and EAGLE-3.1 drafters.

Autocast bounds are relative errors (||x - ref|| / ||ref||) against the fp32 naive reference, about 3x the largest
measured over the four objectives on this CPU (torch 2.13, the EAGLE-3.1 tiny drafter; the test prints them): bf16
loss and step losses 7.5e-4, step alphas 1.1e-3, gradients 5.1e-2 (the worst parameter, neg_log_alpha's
input_layernorm); fp16 6.9e-5 / 7.5e-5 / 5.2e-3. bf16 keeps 8 mantissa bits (unit roundoff 2e-3): a few roundoffs
are expected, a wrong formula is far larger.
"""

from __future__ import annotations

import pytest
import torch

import eagle3_zoo.modeling.drafter as drafter_module
from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.losses import available_losses
from eagle3_zoo.modeling.attention import ttt_attention_reference
from tests.tiny import tiny_drafter31 as drafter31

OBJECTIVES = available_losses()

# relative bounds: (loss and step losses, step alphas, gradients)
TOL = {torch.bfloat16: (2.5e-3, 3.5e-3, 1.5e-1), torch.float16: (2.5e-4, 2.5e-4, 1.6e-2)}
WEIGHTS = [1.0, 0.7, 0.45, 0.3]  # not 0.8**k: the per-step weights must be the ones passed


def _batch(cfg, b=2, t=24, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g) * 3
    target_logits = torch.randn(b, t, cfg.vocab_size, generator=g) * 3
    mask = (torch.rand(b, t, generator=g) > 0.25).long()
    return ids, aux, target_logits, mask


# each registered loss written out for one position, independently of its module: (p, log q, alpha) -> loss
PER_POSITION = {
    "soft_ce": lambda p, logq, alpha: -(p * logq).sum(),
    "tv": lambda p, logq, alpha: 1 - alpha,
    "neg_log_alpha": lambda p, logq, alpha: -torch.log(alpha.clamp_min(1e-5)),
    "lk_hybrid": lambda p, logq, alpha: _lk_hybrid(p, logq, alpha, eta=3.0),  # its default eta
}


def _lk_hybrid(p, logq, alpha, eta):
    lam = torch.exp(-eta * alpha.detach())
    kl = (p * (p.log() - logq)).sum()
    return lam * kl + (1 - lam) * (1 - alpha)


def _per_position(name: str, z: torch.Tensor, full_target: torch.Tensor, t2d: torch.Tensor):
    """The definitions, written out for one position: (loss, expected acceptance against the full target)."""
    logq = torch.log_softmax(z.float(), -1)
    q = logq.exp()
    p_full = torch.softmax(full_target.float(), -1)
    p = torch.softmax(full_target[t2d].float(), -1)  # renormalised over the draft vocabulary
    alpha = torch.minimum(p, q).sum()
    accept = torch.minimum(p_full[t2d], q).sum().detach()  # what sampling the draft would be accepted at
    return PER_POSITION[name](p, logq, alpha), accept


def test_every_registered_loss_is_written_out_here():
    missing = sorted(set(OBJECTIVES) - set(PER_POSITION))
    assert not missing, f"write the naive per-position formula of {missing} in PER_POSITION (adding-a-loss.md)"


def naive_ttt(name, drafter, embed, ids, aux, target_logits, mask, steps, weights):
    b, t = ids.shape
    t2d = drafter.t2d
    next_ids = torch.cat([ids[:, 1:], ids.new_zeros(b, steps)], 1)
    total, losses, alphas = 0.0, [], []
    for k, h in enumerate(drafter.ttt_rollout(embed(next_ids), aux, steps)):
        logits = drafter.logits(h)
        terms, accepts = [], []
        for bi in range(b):
            for ti in range(t):
                j = ti + 2 + k  # the token step k predicts at position ti
                if j >= t or not mask[bi, j] or not t2d[target_logits[bi, j - 1].argmax()]:
                    continue
                loss, accept = _per_position(name, logits[bi, ti], target_logits[bi, j - 1], t2d)
                terms.append(loss)
                accepts.append(accept)
        loss_k = torch.stack(terms).mean()
        losses.append(loss_k)
        alphas.append(torch.stack(accepts).mean())
        total = total + weights[k] * loss_k
    return total, torch.stack(losses).detach(), torch.stack(alphas)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float(), ref.detach().float()
    return float((a - ref).norm() / ref.norm().clamp(min=1e-12))


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize("options", [{}, dict(fc_norm=True, norm_output=True)], ids=["eagle3", "eagle3.1"])
def test_fp32_loss_alphas_and_gradients_equal_the_naive_definition(name, options, monkeypatch):
    drafter, embed = drafter31(**options)
    ids, aux, target_logits, mask = _batch(drafter.config)
    steps, params = 4, list(drafter.parameters())
    out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, step_weights=WEIGHTS, chunk=16,
                   objective=name)
    assert int(out.num_supervised.sum()) > 3 * 16  # several chunks of the fused loss
    grads = torch.autograd.grad(out.loss, params)
    monkeypatch.setattr(drafter_module, "ttt_attention", ttt_attention_reference)
    ref, ref_steps, ref_alphas = naive_ttt(name, drafter, embed, ids, aux, target_logits, mask, steps, WEIGHTS)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_losses, ref_steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_alpha, ref_alphas, atol=1e-6, rtol=1e-5)
    for (pname, _), g, r in zip(drafter.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4, msg=lambda m, pname=pname: f"{pname}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", OBJECTIVES)
def test_autocast_loss_alphas_and_gradients_are_within_tolerance_of_fp32_naive(name, dtype, monkeypatch):
    drafter, embed = drafter31(fc_norm=True, norm_output=True)
    ids, aux, target_logits, mask = _batch(drafter.config)
    steps, params = 4, list(drafter.parameters())
    with torch.autocast("cpu", dtype=dtype):
        out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, step_weights=WEIGHTS, chunk=16,
                       objective=name)
    grads = torch.autograd.grad(out.loss, params)  # outside autocast, as Lightning calls backward
    fp32 = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, step_weights=WEIGHTS, chunk=16,
                    objective=name)
    assert float(out.loss.detach()) != float(fp32.loss.detach())  # autocast did take effect
    monkeypatch.setattr(drafter_module, "ttt_attention", ttt_attention_reference)
    ref, ref_steps, ref_alphas = naive_ttt(name, drafter, embed, ids, aux, target_logits, mask, steps, WEIGHTS)
    ref_grads = torch.autograd.grad(ref, params)
    loss_tol, alpha_tol, grad_tol = TOL[dtype]
    errors = {"loss": _rel(out.loss, ref), "steps": _rel(out.step_losses, ref_steps),
              "alphas": _rel(out.step_alpha, ref_alphas),
              "grads": max(_rel(g, r) for g, r in zip(grads, ref_grads))}
    print(f"{name} {dtype}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert out.loss.dtype == torch.float32 and errors["loss"] < loss_tol and errors["steps"] < loss_tol
    assert errors["alphas"] < alpha_tol
    for (pname, _), g, r in zip(drafter.named_parameters(), grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), pname
        assert _rel(g, r) < grad_tol, f"{pname}: relative gradient error {_rel(g, r):.2e} >= {grad_tol}"


def test_the_objective_changes_the_gradient_and_an_unknown_one_is_refused():
    drafter, embed = drafter31()
    ids, aux, target_logits, mask = _batch(drafter.config)
    grads = {}
    for name in OBJECTIVES:
        out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=2, objective=name)
        grads[name] = torch.autograd.grad(out.loss, [drafter.lm_head.weight])[0]
        assert out.step_alpha.shape == (2,) and ((out.step_alpha > 0) & (out.step_alpha < 1)).all()
    for a in OBJECTIVES:
        for b in OBJECTIVES:
            assert a == b or not torch.allclose(grads[a], grads[b])
    with pytest.raises(ValueError, match="unknown TTT loss 'kl'"):
        ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=2, objective="kl")
