"""Lossless greedy decoding with a DFlash drafter (eagle3_zoo.speculative.dflash_decode) and its persistent draft KV
cache (eagle3_zoo.drafters.dflash.decoding): output equal to the target's own greedy decoding with a random drafter
and with a planned oracle (full, partial and zero acceptance), the cached context K/V and drafted block equal to
recomputing them from the whole prefix, tau and per-position acceptance by hand, and the pruned target cache equal
to a fresh prefill."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3_zoo.adapters import adapter_for
from eagle3_zoo.adapters.capture import cache_kwargs
from eagle3_zoo.drafters.dflash.config import DFlashConfig
from eagle3_zoo.drafters.dflash.decoding import DFlashContextCache
from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.speculative.dflash_decode import DFlashGenerator, measure
from eagle3_zoo.speculative.generate import plain_generate
from tests.test_speculative_support import assert_same_float32, reference, tiny_target

FAMILIES = ("llama", "qwen3")
LAYER_IDS = (0, 1, 2)  # decoder-layer outputs of the 4-layer tiny targets -> captured entering layers 1, 2, 3


def dflash_drafter(target, seed: int = 1, block_size: int = 4, draft_vocab_size: int | None = None) -> DFlashDrafter:
    """A random DFlash drafter sized from the target (2 layers), norms away from 1 so a skipped norm shows."""
    tc = target.config
    cfg = DFlashConfig.from_target_config(tc, mask_token_id=tc.vocab_size - 1, num_hidden_layers=2,
                                          target_layer_ids=LAYER_IDS, block_size=block_size,
                                          draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
        if drafter.d2t is not None:  # a draft vocabulary of every other target id
            drafter.d2t.copy_(torch.arange(drafter.config.draft_vocab_size))
    return drafter.eval().requires_grad_(False).to(next(target.parameters()).dtype)


class PlannedOracle:
    """A `BlockProposer` that knows the target's greedy continuation `sequence` (prompt + greedy tokens) and, at cycle
    c, drafts its first `plan[c % len(plan)]` tokens right and the rest wrong. It checks the generator's bookkeeping:
    the anchor must be the token right after the context it has been given (positions 0..P-1)."""

    def __init__(self, sequence: list[int], num_draft: int, plan: list[int], vocab: int):
        self.sequence, self.num_draft, self.plan, self.vocab = sequence, num_draft, plan, vocab
        self.reset()

    def reset(self) -> None:
        self.context = 0
        self.cycle = 0
        self.extends: list[int] = []

    def extend(self, aux_hidden: torch.Tensor) -> None:
        assert aux_hidden.dim() == 3 and aux_hidden.shape[0] == 1
        self.context += aux_hidden.shape[1]
        self.extends.append(aux_hidden.shape[1])

    def propose(self, anchor_id: int) -> list[int]:
        p = self.context
        assert self.sequence[p] == anchor_id, f"the anchor at position {p} is not the verified sequence's token"
        right = self.sequence[p + 1: p + 1 + self.num_draft]
        assert len(right) == self.num_draft, "the test's reference continuation is too short"
        good = self.plan[self.cycle % len(self.plan)]
        self.cycle += 1
        return right[:good] + [(t + 1) % self.vocab for t in right[good:]]


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_target(request.param)


PROMPTS = [torch.arange(5, 17), torch.tensor([3]), torch.tensor([100, 7, 42, 250, 9, 9, 9, 301])]


@pytest.mark.parametrize("block_size", [2, 5])
def test_random_drafter_output_equals_target_greedy(target, block_size):
    gen = DFlashGenerator(target, dflash_drafter(target, block_size=block_size))
    for prompt, max_new in zip(PROMPTS, (1, 17, 30)):
        out = gen.generate(prompt, max_new, eos_token_id=[])
        assert out.tokens == reference(target, prompt, max_new, eos_token_id=None)
        assert out.stop_reason == "length" and len(out.tokens) == max_new
        assert all(0 <= a <= block_size - 1 for a in out.accept_lengths)
        assert len(out.tokens) <= 1 + sum(a + 1 for a in out.accept_lengths)


def test_reduced_vocabulary_drafter_output_equals_target_greedy(target):
    gen = DFlashGenerator(target, dflash_drafter(target, block_size=4, draft_vocab_size=64))
    prompt = PROMPTS[2]
    assert gen.generate(prompt, 20, eos_token_id=[]).tokens == reference(target, prompt, 20, eos_token_id=None)


def _oracle_run(target, prompt, max_new, plan, num_draft=4, eos_token_id=()):
    sequence = prompt.tolist() + reference(target, prompt, max_new + num_draft + 2, eos_token_id=None)
    oracle = PlannedOracle(sequence, num_draft, plan, target.config.vocab_size)
    gen = DFlashGenerator(target, oracle, layer_ids=(1, 2, 3))
    return gen, oracle, gen.generate(prompt, max_new, eos_token_id=list(eos_token_id))


@pytest.mark.parametrize("plan", [[4], [0], [4, 0, 2, 1, 3], [1, 4, 4, 0]])
def test_oracle_output_equals_target_greedy_with_planned_acceptance(target, plan):
    """Full-block ([4]), zero ([0]) and mixed acceptance: the output is the target's greedy text, every cycle accepts
    exactly the planned prefix, and the drafter's context grows by exactly the verified positions."""
    prompt = PROMPTS[0]
    for max_new in (1, 9, 26):
        gen, oracle, out = _oracle_run(target, prompt, max_new, plan)
        assert out.tokens == reference(target, prompt, max_new, eos_token_id=None)
        cycles = len(out.accept_lengths)
        assert out.accept_lengths == [plan[c % len(plan)] for c in range(cycles)]
        assert out.attempted_next == [a < 4 for a in out.accept_lengths]
        # prompt features once, then the anchor and the accepted drafts of every cycle but the last
        assert oracle.extends == ([len(prompt)] + [a + 1 for a in out.accept_lengths[:-1]] if cycles else [])
        assert gen.runner.length == len(prompt) + sum(a + 1 for a in out.accept_lengths)


def test_eos_inside_an_accepted_block_stops_there(target):
    prompt = PROMPTS[0]
    free = reference(target, prompt, 30, eos_token_id=None)
    eos = next(t for i, t in enumerate(free) if i >= 6 and t not in free[:i])  # first occurrence, mid-stream
    expected = reference(target, prompt, 30, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) < 30
    _, _, out = _oracle_run(target, prompt, 30, [4], eos_token_id=[eos])
    assert out.tokens == expected and out.stop_reason == "eos"
    assert out.tokens == plain_generate(target, prompt, 30, eos_token_id=eos).tokens


def test_tau_and_acceptance_per_position_by_hand(target):
    """B-1 = 3 drafts, plan 3, 0, 1, 3; 12 tokens = 1 (prefill) + 4 + 1 + 2 + 4, so exactly four cycles.
    tau = (3+0+1+3 + 4) / 4 = 2.75. Position 1 is tried in all 4 cycles and accepted in 3 (0.75); position 2 is tried
    after an accepted position 1 in cycles 1, 3, 4 and accepted in 1 and 4 (2/3); position 3 is tried in cycles 1 and
    4, accepted in both (1.0)."""
    prompt = PROMPTS[0]
    sequence = prompt.tolist() + reference(target, prompt, 20, eos_token_id=None)
    gen = DFlashGenerator(target, PlannedOracle(sequence, 3, [3, 0, 1, 3], target.config.vocab_size),
                          layer_ids=(1, 2, 3))
    summary = measure(gen, [prompt], 12, eos_token_id=[], warmup=0)
    assert summary["cycles"] == 4 and summary["new_tokens"] == 12
    assert summary["tau"] == pytest.approx(2.75)
    assert summary["depth_attempts"] == [4, 3, 2] and summary["depth_accepts"] == [3, 2, 2]
    assert summary["acceptance_per_depth"] == pytest.approx([0.75, 2 / 3, 1.0])
    assert summary["lossless"] is True and summary["lossless_checked"] == 1
    assert summary["spec_tokens_per_s"] > 0 and summary["baseline_tokens_per_s"] > 0


def test_pruned_target_cache_equals_a_fresh_prefill(target, monkeypatch):
    """After every cycle's pruning, the target's cache continued by the next token gives the logits a fresh forward of
    the whole accepted sequence gives there (rejected tails of 4, 2, 0 and 3 entries were dropped)."""
    snapshots = []
    prompt = PROMPTS[0]
    sequence = prompt.tolist() + reference(target, prompt, 40, eos_token_id=None)
    gen = DFlashGenerator(target, PlannedOracle(sequence, 4, [0, 2, 4, 1], target.config.vocab_size),
                          layer_ids=(1, 2, 3))
    keep_path = gen.runner.keep_path

    def spy(nodes):
        keep_path(nodes)
        snapshots.append((gen.runner.length, copy.deepcopy(gen.runner.cache)))

    monkeypatch.setattr(gen.runner, "keep_path", spy)
    out = gen.generate(prompt, 24, eos_token_id=[])
    assert len(snapshots) == len(out.accept_lengths) >= 4
    full = torch.tensor([sequence])
    fresh = target(full).logits[0]
    for length, cache in snapshots:
        for layer in cache.layers:
            assert layer.keys.shape[-2] == length
        probe = full[:, length: length + 1]
        kwargs = cache_kwargs(target, {"cache": cache, "position_ids": torch.tensor([[length]])})
        logits = target(probe, **kwargs).logits[0, -1]
        assert_same_float32(logits, fresh[length])


def _fresh_features(target, tokens: list[int], aux_layer_ids) -> torch.Tensor:
    aux, _, _ = adapter_for(target).forward_features(target, torch.tensor([tokens]), layer_ids=aux_layer_ids)
    return aux


def test_cached_context_and_blocks_equal_recomputation_from_the_whole_prefix(target):
    """In a real decode, every block the cached drafter drafted equals `draft_block` on the features of the whole
    verified prefix computed by one fresh target forward, and the cache's K/V equal those of that prefix."""
    drafter = dflash_drafter(target, block_size=4)
    gen = DFlashGenerator(target, drafter)
    cache: DFlashContextCache = gen.draft.cache
    blocks = []
    draft_hidden = cache.draft_hidden

    def record(anchor_id, embed_weight):
        hidden = draft_hidden(anchor_id, embed_weight)
        blocks.append((cache.length, anchor_id, hidden))
        return hidden

    cache.draft_hidden = record
    prompt = PROMPTS[2]
    out = gen.generate(prompt, 25, eos_token_id=[])
    sequence = prompt.tolist() + out.tokens
    aux = _fresh_features(target, sequence, drafter.config.aux_layer_ids)
    embed = target.get_input_embeddings().weight
    assert len(blocks) == len(out.accept_lengths) >= 10
    for p, anchor, hidden in blocks:
        assert anchor == sequence[p]
        assert_same_float32(hidden, drafter.draft_block(aux[:, :p], torch.tensor([anchor]), embed))
    p = cache.length
    ctx = drafter.context(aux[:, :p])
    cos, sin = drafter.rotary_emb(torch.arange(p)[None], ctx.dtype)
    for layer, k, v in zip(drafter.layers, cache.keys, cache.values):
        k_ref, v_ref = layer.self_attn.key_value(ctx, cos, sin)
        assert_same_float32(k, k_ref)
        assert_same_float32(v, v_ref)


def test_context_cache_extended_piecewise_equals_draft_block():
    """The cache alone, float64: features appended in pieces of 3, 1 and 5 positions give the K/V of one projection of
    all 9 and the block `draft_block` drafts on the 9-position prefix; a reduced-vocabulary head maps through d2t."""
    cfg = DFlashConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       vocab_size=100, num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99,
                       num_hidden_layers=2, block_size=5, rope_theta=10000.0, draft_vocab_size=40)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).double()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        drafter.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))  # draft id i -> target id 2i
    aux = torch.randn(1, 9, 3 * 64, dtype=torch.double)
    embed = torch.randn(100, 64, dtype=torch.double)
    cache = DFlashContextCache(drafter)
    for a, b in ((0, 3), (3, 4), (4, 9)):
        cache.extend(aux[:, a:b])
    assert cache.length == 9
    ctx = drafter.context(aux)
    cos, sin = drafter.rotary_emb(torch.arange(9)[None], ctx.dtype)
    for layer, k, v in zip(drafter.layers, cache.keys, cache.values):
        k_ref, v_ref = layer.self_attn.key_value(ctx, cos, sin)
        torch.testing.assert_close(k, k_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=1e-12)
    ref = drafter.draft_block(aux, torch.tensor([17]), embed)
    torch.testing.assert_close(cache.draft_hidden(17, embed), ref, rtol=1e-12, atol=1e-12)
    expected = (ref[0, 1:] @ drafter.lm_head.weight.T).argmax(-1) * 2
    assert cache.draft(17, embed) == expected.tolist()
    cache.reset()
    assert cache.length == 0


def test_a_drafter_that_does_not_fit_the_target_is_refused(target):
    drafter = dflash_drafter(target)
    drafter.config.num_target_layers = 36
    with pytest.raises(ValueError, match="num_target_layers=36 but the target has 4"):
        DFlashGenerator(target, drafter)
    with pytest.raises(ValueError, match="layer_ids is required"):
        DFlashGenerator(target, PlannedOracle([], 3, [0], 10))


@pytest.mark.slow
def test_a_drafter_trained_by_the_dflash_objective_is_accepted_by_the_decoder():
    """Training and decoding agree end to end: a drafter trained with `dflash_loss` on 24 of the target's own greedy
    continuations until its training metric (simulated greedy acceptance per block) is ~B decodes those prompts with
    tau ~B (every block accepted whole), losslessly. Negative control: the same drafter fed the features one layer
    too early (the "layer-index off by one" of served drafters) loses most of it.
    Measured: tau 4.0 vs 1.24 (B=4), 28 s."""
    from eagle3_zoo.drafters.dflash.loss import dflash_loss, select_anchors

    target = tiny_target("llama")
    adapter = adapter_for(target)
    n, length, p = 24, 40, 4
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (p,), generator=rng) for _ in range(n)]
    data = torch.stack([torch.cat([q, torch.tensor(plain_generate(target, q, length - p, eos_token_id=[]).tokens)])
                        for q in prompts])
    drafter = dflash_drafter(target, block_size=4)
    with torch.no_grad():
        for w in drafter.parameters():
            if w.dim() > 1:
                w.normal_(0.0, 0.02)
        aux, _, _ = adapter.forward_features(target, data, layer_ids=drafter.config.aux_layer_ids)
    drafter.train().requires_grad_(True)
    mask = torch.ones_like(data, dtype=torch.bool)
    mask[:, :p] = False
    embed, head = adapter.embed_tokens(target).weight, adapter.lm_head(target).weight
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(250):
        anchors, valid = select_anchors(mask, 12, generator=rng)
        out = dflash_loss(drafter, aux, data, mask, anchors, valid, embed, head)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert float(out.acceptance_length) > 3.5
    drafter.eval().requires_grad_(False)
    trained = measure(DFlashGenerator(target, drafter), prompts[:6], length - p, eos_token_id=[], warmup=0)
    assert trained["lossless"] is True and trained["tau"] >= 3.5
    shifted = measure(DFlashGenerator(target, drafter, layer_ids=(0, 1, 2)), prompts[:6], length - p,
                      eos_token_id=[], warmup=0)
    assert shifted["lossless"] is True and shifted["tau"] <= 2.5
