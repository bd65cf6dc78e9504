"""TTT loss semantics, the fused soft cross-entropy, and the draft-vocabulary mapping."""

import logging

import pytest
import torch

from eagle3_zoo.drafters.eagle3.ttt import fused_soft_cross_entropy, ttt_loss
from eagle3_zoo.modeling import build_draft_vocab, identity_vocab
from tests.tiny import tiny_drafter


def _batch(drafter, b=2, t=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g)
    target_logits = torch.randn(b, t, cfg.vocab_size, generator=g) * 3
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    return ids, aux, target_logits, mask


def _naive_ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps, weights):
    """Straight per-position loops over the TTT loss's definition: at step k, position t reads its step k-1 output
    and the embedding of x_{t+1+k} and is trained towards the target's distribution at t+1+k."""
    b, t = ids.shape
    t2d = drafter.t2d
    next_ids = torch.cat([ids[:, 1:], ids.new_zeros(b, steps)], 1)
    total = 0.0
    per_step = []
    for k, h in enumerate(drafter.ttt_rollout(embed(next_ids), aux, steps)):
        logp = torch.log_softmax(drafter.logits(h).float(), -1)
        terms = []
        for bi in range(b):
            for ti in range(t):
                j = ti + 2 + k  # predicted token
                if j >= t or not mask[bi, j] or not t2d[target_logits[bi, j - 1].argmax()]:
                    continue
                p = torch.softmax(target_logits[bi, j - 1][t2d].float(), -1)
                terms.append(-(p * logp[bi, ti]).sum())
        loss_k = torch.stack(terms).mean() if terms else torch.zeros(())
        per_step.append(loss_k)
        total = total + weights[k] * loss_k
    return total, torch.stack(per_step)


def test_ttt_loss_matches_naive_definition_and_gradients():
    drafter, embed = tiny_drafter()
    ids, aux, target_logits, mask = _batch(drafter)
    steps, weights = 4, [0.8**k for k in range(4)]
    out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps)
    grads = torch.autograd.grad(out.loss, list(drafter.parameters()))
    ref_total, ref_steps = _naive_ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps, weights)
    ref_grads = torch.autograd.grad(ref_total, list(drafter.parameters()))
    torch.testing.assert_close(out.loss, ref_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_losses, ref_steps.detach(), atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)
    # the last positions have no target: step k supervises at most T-2-k positions per row
    assert all(int(n) <= 2 * (16 - 2 - k) for k, n in enumerate(out.num_supervised))


def test_draft_vocab_logits_with_valid_mask_equal_full_vocab_logits():
    drafter, embed = tiny_drafter()
    ids, aux, target_logits, mask = _batch(drafter)
    full = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=3)
    valid = drafter.t2d[target_logits.argmax(-1)]
    sliced = ttt_loss(drafter, embed, ids, aux, target_logits[..., drafter.t2d], mask, steps=3, target_valid=valid)
    torch.testing.assert_close(full.loss, sliced.loss)


def test_fused_soft_cross_entropy_matches_eager():
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    p = torch.softmax(torch.randn(37, 50), -1)
    loss, row_loss, row_correct = fused_soft_cross_entropy(h, w, p, chunk=8)
    (loss * 0.7).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = h @ w.t()
    ref = -(p * torch.log_softmax(logits, -1)).sum()
    (ref * 0.7).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(row_loss, -(p * torch.log_softmax(logits, -1)).sum(-1).detach())
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gw, w.grad)
    assert torch.equal(row_correct, logits.argmax(-1) == p.argmax(-1))


def test_overfits_one_batch_to_near_zero_loss():
    drafter, embed = tiny_drafter()
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    aux = torch.randn(1, 12, 3 * cfg.target_hidden_size)
    # sharp one-hot-like targets inside the draft vocab: the achievable minimum of the soft CE is ~0
    tgt_ids = drafter.draft_to_target(torch.randint(0, cfg.draft_vocab_size, (1, 12)))
    target_logits = torch.full((1, 12, cfg.vocab_size), -30.0).scatter(-1, tgt_ids[..., None], 30.0)
    mask = torch.ones(1, 12, dtype=torch.long)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = None
    for _ in range(300):
        out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else float(out.loss.detach())
    assert first > 5.0
    assert float(out.loss.detach()) < 0.05
    assert torch.all(out.step_acc == 1.0)


def test_no_supervised_positions_gives_zero_loss_and_warning():
    drafter, embed = tiny_drafter()
    ids, aux, target_logits, _ = _batch(drafter)
    with pytest.warns(RuntimeWarning, match="no supervised positions"):
        out = ttt_loss(drafter, embed, ids, aux, target_logits, torch.zeros_like(ids), steps=3)
    assert float(out.loss) == 0.0 and not torch.isnan(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.all(p.grad == 0) for p in drafter.parameters())


def test_ttt_loss_rejects_bad_arguments():
    drafter, embed = tiny_drafter()
    ids, aux, target_logits, mask = _batch(drafter)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=0)
    with pytest.raises(ValueError, match="neither the target vocab"):
        ttt_loss(drafter, embed, ids, aux, target_logits[..., :10], mask, steps=1)


# ---- draft vocabulary ----

def test_vocab_keeps_most_frequent_sorted_by_id_with_deterministic_ties():
    counts = torch.tensor([5, 0, 9, 5, 1, 5, 0, 2])
    d2t, t2d = build_draft_vocab(counts, 3)
    used = torch.arange(3) + d2t
    assert used.tolist() == [0, 2, 3]  # 9, then the 5s by lowest id (0, 3; not 5)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().squeeze(-1).tolist() == [0, 2, 3]


def test_vocab_fills_with_lowest_unused_ids_when_data_is_small(caplog):
    counts = torch.zeros(10, dtype=torch.long)
    counts[7] = 3
    counts[4] = 1
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.modeling.vocab"):
        d2t, t2d = build_draft_vocab(counts, 5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 7]
    assert int(t2d.sum()) == 5
    # information, not a warning (the smoke run's 128 conversations have fewer distinct tokens than its 8192 slots)
    assert [(r.levelname, r.getMessage()[:76]) for r in caplog.records] == [
        ("INFO", "draft vocabulary: the data has 2 distinct supervised tokens for 5 slots; the")]


def test_vocab_full_size_is_identity():
    counts = torch.randint(0, 100, (20,))
    d2t, t2d = build_draft_vocab(counts, 20)
    assert torch.equal(d2t, torch.zeros(20, dtype=torch.int64)) and bool(t2d.all())
    assert torch.equal(d2t, identity_vocab(20)[0])


@pytest.mark.parametrize("size", [0, -1, 11, 2.5, True])
def test_vocab_invalid_sizes(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10, dtype=torch.long), size)


def test_vocab_rejects_bad_counts():
    with pytest.raises(ValueError, match="1-D"):
        build_draft_vocab(torch.ones(2, 5), 3)
    with pytest.raises(ValueError, match="non-negative"):
        build_draft_vocab(torch.tensor([1, -1, 2]), 2)
