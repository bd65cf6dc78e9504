"""The per-position TTT objectives: the chunk math the fused lm_head loss runs, against the naive autograd form."""

import pytest
import torch

from eagle3_zoo.losses import available_losses, make_loss
from eagle3_zoo.losses.chunk import chunk_objective, reference_objective

OBJECTIVES = available_losses()  # the registered losses: each module of eagle3_zoo/losses/


def _rows(n=23, v=57, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    p = torch.softmax(torch.randn(n, v, generator=g) * 2, -1)
    mass = torch.rand(n, generator=g) * 0.5 + 0.5
    return logits, p, mass


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize("with_mass", [False, True])
def test_chunk_objective_equals_naive_loss_alpha_and_logits_gradient(name, with_mass):
    logits, p, mass = _rows()
    mass = mass if with_mass else None
    z = logits.clone().requires_grad_()
    ref_loss, ref_alpha = reference_objective(z, p, name, mass)
    weights = torch.rand(len(p))
    (ref_grad,) = torch.autograd.grad((ref_loss * weights).sum(), z)
    out = chunk_objective(logits.clone(), p, name, mass)
    torch.testing.assert_close(out.loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.alpha, ref_alpha, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.grad * weights[:, None], ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(out.argmax, logits.argmax(-1))


def test_alpha_is_the_overlap_of_the_two_distributions():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.4, 0.1]]))
    out = chunk_objective(logits.clone(), p, "tv")
    torch.testing.assert_close(out.alpha, torch.tensor([0.2 + 0.3 + 0.2]))
    torch.testing.assert_close(out.loss, torch.tensor([0.3]))
    # with half the target's mass outside the draft vocabulary the draft is accepted at most half the time; the
    # loss still trains towards the renormalised distribution
    half = chunk_objective(logits.clone(), p, "tv", mass=torch.tensor([0.5]))
    torch.testing.assert_close(half.alpha, torch.tensor([0.2 + 0.15 + 0.1]))
    torch.testing.assert_close(half.loss, torch.tensor([0.3]))


def test_the_four_objectives_differ_and_share_their_optimum():
    logits, p, _ = _rows(n=4, v=9, seed=3)
    values = {name: chunk_objective(logits.clone(), p, name).loss for name in OBJECTIVES}
    assert len({round(float(v.sum()), 4) for v in values.values()}) == len(OBJECTIVES)
    at_target = p.log()  # q = p: alpha = 1 and every acceptance loss is 0 (TV has a kink there, no gradient claim)
    for name in ("tv", "neg_log_alpha", "lk_hybrid"):
        out = chunk_objective(at_target.clone(), p, name)
        torch.testing.assert_close(out.alpha, torch.ones(4), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.loss, torch.zeros(4), atol=1e-5, rtol=0)
    ce = chunk_objective(at_target.clone(), p, "soft_ce")  # the cross-entropy's gradient q - p does vanish
    torch.testing.assert_close(ce.grad, torch.zeros_like(ce.grad), atol=1e-6, rtol=0)


def test_lk_hybrid_moves_from_kl_to_tv_as_acceptance_grows():
    logits, p, _ = _rows(n=6, v=11, seed=5)
    hybrid = chunk_objective(logits.clone(), p, make_loss("lk_hybrid", {"eta": 3.0}))
    kl = chunk_objective(logits.clone(), p, "soft_ce").loss + torch.xlogy(p, p).sum(-1)
    tv = 1 - hybrid.alpha
    lam = torch.exp(-3.0 * hybrid.alpha)
    torch.testing.assert_close(hybrid.loss, lam * kl + (1 - lam) * tv)
    near_kl = chunk_objective(logits.clone(), p, make_loss("lk_hybrid", {"eta": 1e-6}))
    torch.testing.assert_close(near_kl.loss, kl, atol=1e-4, rtol=1e-4)


def test_neg_log_alpha_is_flat_below_its_floor():
    p = torch.tensor([[1.0, 0.0, 0.0]])
    logits = torch.tensor([[-30.0, 0.0, 0.0]])  # the draft puts ~1e-13 on the target's token
    out = chunk_objective(logits.clone(), p, "neg_log_alpha")
    assert float(out.alpha) < 1e-5
    assert torch.all(out.grad == 0)
    torch.testing.assert_close(out.loss, -torch.log(torch.tensor([1e-5])))


def test_unknown_objective_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown TTT loss 'kl'; valid: lk_hybrid, neg_log_alpha, soft_ce, tv; "
                                         "to add a loss see docs/contributing/adding-a-loss.md"):
        chunk_objective(torch.zeros(1, 2), torch.ones(1, 2) / 2, "kl")
