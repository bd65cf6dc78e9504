"""DFlash's soft labels (`drafter.dflash.labels: soft`): each slot's cross-entropy against the target's own
distribution at the predicted position, softmax(target lm_head(s_{a+k-1})), chunked over rows as the hard loss is.
A distribution one-hot on the label gives the hard loss exactly (values, position weights and gradients); a random
one gives the per-block formula; a reduced draft vocabulary renormalises it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3_zoo.drafters.dflash.config import DFlashConfig
from eagle3_zoo.drafters.dflash.loss import block_labels, chunked_soft_cross_entropy, dflash_loss
from eagle3_zoo.drafters.dflash.model import DFlashDrafter

B, T, V, H = 4, 20, 64, 64
ANCHORS = torch.tensor([[1, 5, 6, 17], [3, 4, 10, 19]])  # adjacent anchors, the first position, blocks past the end


def _setup(seed: int, **kw):
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       vocab_size=V, num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=V - 1,
                       num_hidden_layers=2, block_size=B, rope_theta=10000.0, **kw)
    drafter = DFlashDrafter(cfg).double()
    aux = torch.randn(2, T, cfg.num_features * H, dtype=torch.double)
    ids = torch.randint(0, V - 1, (2, T))
    embed = torch.randn(V, H, dtype=torch.double)
    q, _ = torch.linalg.qr(torch.randn(V, H, dtype=torch.double))  # orthonormal rows: the target's lm_head / 5
    lmask = torch.ones(2, T, dtype=torch.bool)
    lmask[:, :3] = False
    lmask[1, 12] = False
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    return cfg, drafter, aux, ids, embed, 5.0 * q, lmask, valid


def _one_hot_states(ids: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """Target last hidden states whose logits (`head` = 5 x orthonormal rows) are 1000 at the next token and 0
    elsewhere: a distribution one-hot on x_{t+1} at every position t (the last position: random)."""
    states = torch.randn(*ids.shape, head.shape[1], dtype=head.dtype)
    states[:, :-1] = 200.0 * (head[ids[:, 1:]] / 5.0)
    return states


def _grads(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("weighting", ["dpace", "decay"])
@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_soft_labels_one_hot_on_the_label_give_the_hard_loss(weighting, draft_vocab_size):
    """The same loss, the same D-PACE/decay weights, supervised count, metrics and gradients; with a reduced draft
    vocabulary, labels outside it leave both losses. The target's states one position later (the distribution of
    x_{a+k+1}) give another loss."""
    cfg, drafter, aux, ids, embed, head, lmask, valid = _setup(11, draft_vocab_size=draft_vocab_size)
    if draft_vocab_size:
        used = torch.tensor([i for i in range(V) if i % 8 < 5])  # 40 ids, sorted
        with torch.no_grad():
            drafter.d2t.copy_(used - torch.arange(40))
    states = _one_hot_states(ids, head)
    hard = dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, weighting=weighting, chunk=5)
    hard.loss.backward()
    hard_grads = _grads(drafter)
    soft = dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, weighting=weighting, chunk=5,
                       labels="soft", target_hidden=states)
    soft.loss.backward()
    soft_grads = _grads(drafter)
    labels, mask = block_labels(ids, lmask, ANCHORS, valid, B)
    if draft_vocab_size:
        assert 0 < hard.num_supervised.item() < int(mask.sum())  # some labels are outside the draft vocabulary
    assert soft.num_supervised.item() == hard.num_supervised.item() > 0
    torch.testing.assert_close(soft.loss, hard.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(soft.position_acc, hard.position_acc)
    torch.testing.assert_close(soft.acceptance_length, hard.acceptance_length)
    assert soft_grads.keys() == hard_grads.keys() and soft_grads
    for name in hard_grads:
        torch.testing.assert_close(soft_grads[name], hard_grads[name], rtol=1e-9, atol=1e-12)
    later = torch.roll(states, -1, dims=1)
    shifted = dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, weighting=weighting, chunk=5,
                          labels="soft", target_hidden=later)
    assert abs(shifted.loss.item() - hard.loss.item()) > 1e-3  # the equality above holds to 1e-12


def test_soft_loss_equals_the_per_block_formula():
    """A random target distribution: sum_k w_k (-sum_v p_k[v] log q_k[v]) / supervised slots, p_k from the target's
    state at a+k-1, with the decay weights, against each block drafted alone."""
    cfg, drafter, aux, ids, embed, head, lmask, valid = _setup(12)
    states = torch.randn(2, T, H, dtype=torch.double)
    out = dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, weighting="decay", chunk=3,
                      labels="soft", target_hidden=states)
    total, n = 0.0, 0
    with torch.no_grad():
        for b in range(2):
            for j, a in enumerate(ANCHORS[b].tolist()):
                if not valid[b, j]:
                    continue
                logq = F.log_softmax(drafter.draft_block(aux[b:b + 1, :a], ids[b:b + 1, a], embed)[0, 1:] @ head.T,
                                     dim=-1)
                for k in range(1, B):
                    if a + k < T and lmask[b, a + k]:
                        p = torch.softmax(states[b, a + k - 1] @ head.T, dim=-1)
                        total += torch.exp(torch.tensor(-(k - 1) / 4.0)).item() * -(p * logq[k - 1]).sum().item()
                        n += 1
    assert out.num_supervised.item() == n
    assert out.loss.item() == pytest.approx(total / n, rel=1e-6)  # logits in fp32


def test_chunked_soft_cross_entropy_matches_full_logits_with_gradients():
    """Chunks equal one full pass (values, argmax, gradients); a reduced vocabulary renormalises the target's
    distribution over it and leaves out rows whose target argmax is outside it."""
    torch.manual_seed(13)
    h = torch.randn(37, 16, dtype=torch.double, requires_grad=True)
    w = torch.randn(30, 16, dtype=torch.double, requires_grad=True)  # the draft head over 30 draft ids
    s = torch.randn(37, 16, dtype=torch.double)
    wt = torch.randn(50, 16, dtype=torch.double)  # the target's lm_head over 50 ids
    d2t = torch.arange(30) + torch.arange(30) // 2  # draft id -> target id (30 of the 50)
    t2d = torch.full((50,), -1)
    t2d[d2t] = torch.arange(30)
    ce, pred, keep = chunked_soft_cross_entropy(h, w, s, wt, d2t, t2d, chunk=8)
    target = s @ wt.T
    p = torch.softmax(target[:, d2t].float(), dim=-1)
    full = -(p * F.log_softmax((h @ w.T).float(), dim=-1)).sum(-1)
    torch.testing.assert_close(ce, full)
    assert torch.equal(pred, (h @ w.T).argmax(-1))
    assert torch.equal(keep, t2d[target.argmax(-1)] >= 0) and 0 < int(keep.sum()) < 37
    gh, gw = torch.autograd.grad((ce * torch.arange(37)).sum(), (h, w))
    rh, rw = torch.autograd.grad((full * torch.arange(37)).sum(), (h, w))
    torch.testing.assert_close((gh, gw), (rh, rw))


def test_soft_labels_without_the_target_state_are_refused():
    cfg, drafter, aux, ids, embed, head, lmask, valid = _setup(14)
    with pytest.raises(ValueError, match="target_hidden"):
        dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, labels="soft")
    with pytest.raises(ValueError, match=r"expected \[2, 20, H\]"):
        dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, labels="soft",
                    target_hidden=torch.zeros(2, T - 1, H, dtype=torch.double))
    with pytest.raises(ValueError, match="labels='medium'"):
        dflash_loss(drafter, aux, ids, lmask, ANCHORS, valid, embed, head, labels="medium")
