"""The DSpark objective (eagle3_zoo.drafters.dspark.loss): TV by hand, the full loss against a per-block reference
written from the formula (slot k at a+k predicts a+k+1 against the target's distribution there), chunking with
gradients, the reduced vocabulary, and an empty batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle3_zoo.drafters.dflash.loss import select_anchors
from eagle3_zoo.drafters.dspark.loss import dspark_loss
from tests.test_dspark_model import _config, _random

T = 20
ANCHORS = torch.tensor([[1, 5, 6, 17], [3, 4, 10, 18]])  # adjacent anchors, blocks that run past the end


def test_the_tv_term_and_acceptance_by_hand():
    """One slot, vocabulary 3, the backbone silenced (base logits 0) and the Markov bias giving q = (.25, .25, .5);
    the target's p = (.5, .5, 0): TV = 0.5; CE = -log q[argmax p] = -log .25; alpha = 0.5."""
    cfg = _config(vocab_size=3, mask_token_id=2, markov_rank=3, block_size=2)
    drafter = _random(cfg)
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(3))
        drafter.markov_head.markov_w2.weight.copy_(torch.log(torch.tensor([0.25, 0.25, 0.5]))[:, None].expand(3, 3))
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(0.0)  # sigmoid 0.5
    ids = torch.tensor([[0, 1, 1, 1]])
    lm_head = torch.zeros(3, cfg.hidden_size, dtype=torch.double)
    lm_head[0, 0] = lm_head[1, 0] = 1.0
    lm_head[2, 0] = -100.0
    lm_head[0, 1] = 1e-3  # argmax p = 0
    target_h = torch.zeros(1, 4, cfg.hidden_size, dtype=torch.double)
    target_h[..., 0] = 1.0
    target_h[..., 1] = 1.0
    mask = torch.tensor([[False, False, True, False]])  # only slot 0 of the block at 1 (predicting position 2)
    aux = torch.zeros(1, 4, cfg.num_features * cfg.hidden_size, dtype=torch.double)
    embed = torch.randn(3, cfg.hidden_size, dtype=torch.double)
    out = dspark_loss(drafter, aux, ids, mask, torch.tensor([[1]]), torch.tensor([[True]]), embed, target_h, lm_head)
    assert int(out.num_supervised) == 1
    assert float(out.tv) == pytest.approx(0.5, abs=1e-3)
    assert float(out.ce) == pytest.approx(-math.log(0.25), abs=1e-6)
    assert float(out.accept_rate[0]) == pytest.approx(0.5, abs=1e-3)
    assert float(out.bce) == pytest.approx(math.log(2.0), abs=1e-6)  # BCE(0.5, 0.5)
    assert float(out.loss.detach()) == pytest.approx(0.1 * -math.log(0.25) + 0.9 * 0.5 + math.log(2.0), abs=1e-3)


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, T, cfg.num_features * cfg.target_hidden_size, generator=g, dtype=torch.double)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, T), generator=g)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.double)
    target_h = torch.randn(2, T, cfg.hidden_size, generator=g, dtype=torch.double)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.double) * 0.5
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, 8] = False  # an unsupervised token inside a block
    return aux, ids, embed, target_h, lm_head, mask


def _reference(drafter, aux, ids, mask, anchors, valid, embed, target_h, lm_head, gamma=4.0):
    """The loss from the formula, block by block, full logits, no chunking."""
    cfg = drafter.config
    b = cfg.block_size
    hidden = drafter.training_forward(aux, ids, anchors, embed).view(*anchors.shape, b, -1)
    head = drafter.head_weight(lm_head)
    d2t = drafter.to_target_ids(torch.arange(cfg.draft_vocab_size))
    total, n = 0.0, 0
    for r in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            a = int(anchors[r, j])
            for k in range(b):
                if not valid[r, j] or a + k + 1 >= T or not mask[r, a + k + 1]:
                    continue
                h = hidden[r, j, k]
                e = drafter.markov_head.markov_w1.weight[ids[r, a + k]]
                logits = (h @ head.T + e @ drafter.markov_head.markov_w2.weight.T).float()
                target_logits = (target_h[r, a + k] @ lm_head.T).float()
                greedy = int(target_logits.argmax())
                q = torch.softmax(logits, -1)
                p = torch.softmax(target_logits, -1)[d2t]  # the target's mass on the draft ids
                tv = 1 - torch.minimum(p / p.sum(), q).sum()  # trained against p renormalised
                alpha = torch.minimum(p, q).sum()  # the acceptance: the confidence target
                ce = -torch.log_softmax(logits, -1)[int((d2t == greedy).nonzero()[0])] if greedy in d2t.tolist() \
                    else torch.zeros(())
                c = drafter.confidence_head.proj
                conf = (torch.cat([h, e]) @ c.weight[0] + c.bias[0]).float()
                bce = F.binary_cross_entropy_with_logits(conf, alpha.detach())
                total = total + math.exp(-k / gamma) * (0.1 * ce + 0.9 * tv + 1.0 * bce)
                n += 1
    return total / n, n


@pytest.mark.parametrize("kw", [dict(), dict(draft_vocab_size=40)])
def test_dspark_loss_equals_the_per_block_formula_with_gradients(kw):
    cfg = _config(**kw)
    drafter = _random(cfg)
    if drafter.d2t is not None:  # a draft vocabulary of every other target id
        drafter.d2t.copy_(torch.arange(cfg.draft_vocab_size))
    aux, ids, embed, target_h, lm_head, mask = _batch(cfg)
    valid = torch.ones_like(ANCHORS, dtype=torch.bool)
    valid[1, 2] = False
    out = dspark_loss(drafter, aux, ids, mask, ANCHORS, valid, embed, target_h, lm_head, chunk=5)
    want, n = _reference(drafter, aux, ids, mask, ANCHORS, valid, embed, target_h, lm_head)
    assert int(out.num_supervised) == n
    torch.testing.assert_close(out.loss, want.float(), rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(out.loss, list(drafter.parameters()), allow_unused=True)
    ref = torch.autograd.grad(want, list(drafter.parameters()), allow_unused=True)
    for (name, _), g, r in zip(drafter.named_parameters(), got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7, msg=name)
    assert out.accept_rate.shape == (cfg.block_size,) and out.position_acc.shape == (cfg.block_size,)


def test_chunking_does_not_change_the_loss_or_its_gradients():
    cfg = _config()
    drafter = _random(cfg)
    aux, ids, embed, target_h, lm_head, mask = _batch(cfg, seed=1)
    anchors, valid = select_anchors(mask, 6, torch.Generator().manual_seed(0))
    outs = []
    for chunk in (3, 1000):
        drafter.zero_grad()
        out = dspark_loss(drafter, aux, ids, mask, anchors, valid, embed, target_h, lm_head, chunk=chunk)
        out.loss.backward()
        outs.append((out.loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b)


def test_a_drafter_equal_to_the_target_has_zero_tv_and_full_acceptance():
    """Oracle-steered: a bigram sequence x_{t+1} = nxt[x_t]; the target's logits at t put `scale` on x_{t+1}; the
    drafter's backbone is silenced (norm weight 0: base logits 0) and its Markov head (w1 = I) puts `scale` on
    nxt[prev] with prev = x_{a+k}: its logits equal the target's at every slot, so TV = 0, every greedy slot is right
    and the block's acceptance length is B + 1. Negative control: the same head predicting x_{t+2} (the labels one
    position off) is wrong everywhere."""
    cfg = _config(markov_rank=100)
    drafter = _random(cfg)
    torch.manual_seed(3)
    nxt = torch.randperm(99)
    assert not torch.any(nxt == torch.arange(99))  # no fixed point: x_{t+2} != x_{t+1}
    ids = torch.zeros(2, T, dtype=torch.long)
    ids[:, 0] = torch.tensor([3, 50])
    for t in range(1, T):
        ids[:, t] = nxt[ids[:, t - 1]]
    used = sorted(set(ids.flatten().tolist()))
    assert len(used) <= cfg.hidden_size
    scale = 40.0
    lm_head = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=torch.double)
    for i, v in enumerate(used):
        lm_head[v, i] = 1.0
    target_h = torch.zeros(2, T, cfg.hidden_size, dtype=torch.double)
    for r in range(2):
        for t in range(T - 1):
            target_h[r, t, used.index(int(ids[r, t + 1]))] = scale

    def markov(to):
        w2 = torch.zeros(cfg.vocab_size, cfg.markov_rank, dtype=torch.double)
        w2[to, torch.arange(99)] = scale
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.copy_(torch.eye(cfg.vocab_size, cfg.markov_rank))
            drafter.markov_head.markov_w2.weight.copy_(w2)

    with torch.no_grad():
        drafter.norm.weight.zero_()
    aux, _, embed, _, _, _ = _batch(cfg)
    full = torch.ones(2, T, dtype=torch.bool)
    anchors = torch.tensor([[1, 5, 9, 14], [2, 3, 10, 15]])  # whole blocks inside the sequence
    valid = torch.ones_like(anchors, dtype=torch.bool)
    markov(nxt)
    out = dspark_loss(drafter, aux, ids, full, anchors, valid, embed, target_h, lm_head)
    assert float(out.tv) < 1e-6 and float(out.accept_rate.min()) > 1 - 1e-6
    assert torch.all(out.position_acc == 1.0)
    assert float(out.acceptance_length) == pytest.approx(cfg.block_size + 1)
    assert float(out.expected_length) == pytest.approx(cfg.block_size + 1, abs=1e-4)
    markov(nxt[nxt])
    bad = dspark_loss(drafter, aux, ids, full, anchors, valid, embed, target_h, lm_head)
    assert float(bad.accept_rate.max()) < 1e-6 and torch.all(bad.position_acc == 0.0)
    assert float(bad.acceptance_length) == pytest.approx(1.0)


def test_a_batch_with_nothing_supervised_gives_a_zero_loss_that_backpropagates():
    cfg = _config()
    drafter = _random(cfg)
    aux, ids, embed, target_h, lm_head, _ = _batch(cfg)
    mask = torch.zeros(2, T, dtype=torch.bool)
    out = dspark_loss(drafter, aux, ids, mask, ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), embed,
                      target_h, lm_head)
    assert float(out.loss.detach()) == 0.0 and int(out.num_supervised) == 0
    out.loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())


def test_target_hidden_of_the_wrong_shape_is_refused():
    cfg = _config()
    drafter = _random(cfg)
    aux, ids, embed, target_h, lm_head, mask = _batch(cfg)
    with pytest.raises(ValueError, match="target_hidden"):
        dspark_loss(drafter, aux, ids, mask, ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), embed,
                    target_h[:, 1:], lm_head)


def test_bf16_autocast_with_bf16_target_states_is_close_to_fp32():
    """The training setting: an fp32 drafter under bf16 autocast, the target's last hidden states stored in bf16."""
    cfg = _config()
    drafter = _random(cfg).float()
    aux, ids, embed, target_h, lm_head, mask = (x.float() if x.is_floating_point() else x for x in _batch(cfg))
    valid = torch.ones_like(ANCHORS, dtype=torch.bool)
    ref = dspark_loss(drafter, aux, ids, mask, ANCHORS, valid, embed, target_h, lm_head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = dspark_loss(drafter, aux, ids, mask, ANCHORS, valid, embed, target_h.bfloat16(), lm_head)
    low.loss.backward()
    assert low.loss.dtype == torch.float32 and all(p.grad is not None for p in drafter.parameters())
    torch.testing.assert_close(low.loss.detach(), ref.loss.detach(), rtol=0.05, atol=0.05)
    stored = dspark_loss(drafter, aux, ids, mask, ANCHORS, valid, embed, target_h.bfloat16(), lm_head)  # no autocast
    torch.testing.assert_close(stored.loss.detach(), ref.loss.detach(), rtol=0.02, atol=0.02)
