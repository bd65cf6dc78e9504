"""Speculative sampling is lossless: the emitted tokens follow the target's (warped) distribution.

Chi-square goodness of fit with fixed seeds against exact distributions computed from the target, for a drafter
that often disagrees with it (so both the accept and the reject/residual branches run).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from eagle3_zoo.speculative import DraftTree, SamplingParams, SpeculativeGenerator, accept, tree_spec
from tests.test_speculative_support import OracleDraftModel, random_drafter, tiny_target

P_MIN = 1e-3  # fixed seeds: the outcome is deterministic; a wrong rule fails by many orders of magnitude


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = int(counts.sum())
    expected = probs.double() * n
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token with zero probability was emitted"
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5),
                                    SamplingParams(1.3, top_p=0.8), SamplingParams(1.0, top_k=6, top_p=0.9)])
def test_multi_candidate_rule_matches_target_distribution(params):
    vocab, draws = 12, 6000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=g) * 1.5
    # root with three deterministic candidates, chosen against the target: its least likely tokens first
    kids = torch.argsort(logits[0])[:2].tolist() + [int(logits[0].argmax())]
    tree = DraftTree(tokens=torch.tensor([0, *kids]), parents=torch.tensor([-1, 0, 0, 0]),
                     depths=torch.tensor([0, 1, 1, 1]), children=[[1, 2, 3], [], [], []])
    tree_logits = torch.cat([logits[:1], logits[1:].expand(3, -1)])
    counts = torch.zeros(vocab)
    for _ in range(draws):
        result = accept(tree, tree_logits, params, g)
        first = int(tree.tokens[result.path[1]]) if len(result.path) > 1 else result.bonus
        counts[first] += 1
    assert _chi2_pvalue(counts, params.probs(logits[0])) > P_MIN
    # power: the classic bug (on rejection, resample from p instead of the residual) would be detected
    p = params.probs(logits[0])
    buggy, reach = torch.zeros_like(p), 1.0
    for kid in kids:
        buggy[kid] += reach * p[kid]
        reach *= 1 - p[kid]
    buggy += reach * p
    assert _chi2_pvalue(counts, buggy) < 1e-6


def _exact_marginals(target, prompt: torch.Tensor, params: SamplingParams, vocab: int) -> list[torch.Tensor]:
    """Exact marginals of the 1st, 2nd and 3rd sampled token (by enumerating the prefixes)."""
    with torch.no_grad():
        p1 = params.probs(target(prompt[None]).logits[0, -1])
        seqs = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2_given = params.probs(target(seqs).logits[:, -1])  # [x1, x2]
        pairs = torch.tensor(list(itertools.product(range(vocab), repeat=2)))
        seqs = torch.cat([prompt.expand(vocab * vocab, -1), pairs], 1)
        p3_given = params.probs(target(seqs).logits[:, -1]).view(vocab, vocab, vocab)  # [x1, x2, x3]
    joint12 = p1[:, None] * p2_given
    return [p1, joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))]


def _sampled_marginals(mode: str, draws: int, vocab: int = 12):
    target = tiny_target("llama", init_std=0.08, vocab_size=vocab)
    # a random drafter's single chain guess is accepted too rarely to test much: chains draft the greedy path
    drafter = random_drafter(target, seed=5) if mode == "tree" else OracleDraftModel(target, "right")
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.95)
    gen = SpeculativeGenerator(target, drafter, tree_spec(mode, depth=3, top_k=3, total_tokens=8),
                               layer_ids=(1, 2, 3))
    prompt = torch.tensor([3, 7, 1, 11, 5])
    rng = torch.Generator().manual_seed(1234)
    counts = torch.zeros(3, vocab)
    accepted = []
    for _ in range(draws):
        out = gen.generate(prompt, 3, params, eos_token_id=[], generator=rng)
        for pos, token in enumerate(out.tokens):
            counts[pos, token] += 1
        accepted += out.accept_lengths
    return counts, _exact_marginals(target, prompt, params, vocab), accepted


def _check_marginals(counts, exact, accepted) -> None:
    rate = sum(a > 0 for a in accepted) / len(accepted)
    assert 0.05 < rate < 0.9, f"both branches must run (acceptance rate {rate:.2f})"
    assert max(accepted) >= 2  # deeper nodes were accepted too
    for pos in range(3):  # token 1 comes from the prefill, tokens 2 and 3 from verified drafts
        assert _chi2_pvalue(counts[pos], exact[pos]) > P_MIN, f"token {pos + 1}"


def test_speculative_sampling_marginals_match_target():
    _check_marginals(*_sampled_marginals("tree", draws=400))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_speculative_sampling_marginals_match_target_many_draws(mode):
    _check_marginals(*_sampled_marginals(mode, draws=5000))


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=0.0)
    probs = SamplingParams(0.5, top_k=2).probs(torch.tensor([1.0, 3.0, 2.0, 0.0]))
    assert (probs > 0).tolist() == [False, True, True, False]
    torch.testing.assert_close(probs[1] / probs[2], torch.tensor(2.0, dtype=torch.float64).exp())
