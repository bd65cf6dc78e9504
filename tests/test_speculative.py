"""Speculative decoding at temperature 0: tree verification, cache bookkeeping, losslessness, tau with oracles."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3_zoo.adapters import capture_aux_hidden, get_adapter
from eagle3_zoo.drafters.eagle3.decode import Eagle3DraftModel
from eagle3_zoo.modeling import DraftStepOutput
from eagle3_zoo.speculative import (
    DraftTree,
    SpeculativeGenerator,
    TargetRunner,
    build_tree,
    plain_generate,
    tree_spec,
)
from eagle3_zoo.speculative.metrics import BenchStats
from eagle3_zoo.values.draft_shapes import TreeSpec
from tests.test_speculative_support import (
    FAMILIES,
    OracleDraftModel,
    assert_same_float32,
    random_drafter,
    reference,
    tiny_target,
)

SMALL_TREE = dict(depth=4, top_k=3, total_tokens=12)


def _prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g) for n in (1, 9, 150)]  # one token, short, long


def _hand_tree(root: int) -> DraftTree:
    # root -> a, b ; a -> c, d ; c -> e
    return DraftTree(tokens=torch.tensor([root, 11, 12, 13, 14, 15]), parents=torch.tensor([-1, 0, 0, 1, 1, 3]),
                     depths=torch.tensor([0, 1, 1, 2, 2, 3]), children=[[1, 2], [3, 4], [], [5], [], []])


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_verify_equals_path_forwards_and_cache_keeps_the_path(family):
    target = tiny_target(family)
    adapter = get_adapter(family)
    runner = TargetRunner(target, adapter, layer_ids=(1, 2, 3))
    prompt = torch.arange(20, 37)
    runner.prefill(prompt)
    tree = _hand_tree(root=5)
    logits, aux = runner.verify(tree)
    paths = {0: [5], 1: [5, 11], 2: [5, 12], 3: [5, 11, 13], 4: [5, 11, 14], 5: [5, 11, 13, 15]}
    for node, path in paths.items():
        full = torch.cat([prompt, torch.tensor(path)])[None]
        with capture_aux_hidden(target, adapter, (1, 2, 3)) as cap:
            ref = target(full).logits[0, -1]
        assert_same_float32(logits[node], ref)
        assert_same_float32(aux[0, node], cap.aux_hidden[0, -1])
    runner.keep_path([0, 1, 3, 5])
    fresh = TargetRunner(target, adapter, layer_ids=(1, 2, 3))
    fresh.prefill(torch.cat([prompt, torch.tensor([5, 11, 13, 15])]))
    assert runner.length == fresh.length == prompt.numel() + 4
    for kept, ref in zip(runner.cache.layers, fresh.cache.layers):
        assert_same_float32(kept.keys, ref.keys)
        assert_same_float32(kept.values, ref.values)


def test_node_logits_compute_a_node_and_its_first_child_in_one_matmul():
    """The row of a node's first child comes with the node's (one weight read for two rows); every row equals the
    lm_head applied to that node alone, and a node that is not a first child is computed when asked for."""
    from eagle3_zoo.speculative.target import NodeLogits

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    calls = []
    lm_head.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    hidden = torch.randn(6, 16)
    # root -> 1, 2 ; 1 -> 3 ; 3 -> 4 ; 2 -> 5
    logits = NodeLogits(hidden, lm_head, first_child=[1, 3, 5, 4, -1, -1])
    for node in (0, 1, 3, 4, 2):  # an accepted path 0 -> 1 -> 3 -> 4, then a sibling
        ref = torch.nn.functional.linear(hidden[node], lm_head.weight).detach()  # the node alone, outside the hook
        torch.testing.assert_close(logits[node], ref, atol=1e-6, rtol=1e-6)
    assert calls == [2, 2, 2]  # rows [0, 1], [3, 4], [2, 5]: three matmuls for five nodes
    assert sorted(logits._rows) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("path", [[0, 1, 2], [0], [0, 1, 2, 3]], ids=["prefix", "root-only", "whole-chain"])
def test_keep_path_of_a_chain_prefix_equals_a_fresh_prefill(path):
    """A chain's accepted path (nodes 0..a) is kept in place, without moving entries; the cache equals a prefill."""
    target = tiny_target("llama")
    adapter = get_adapter("llama")
    runner = TargetRunner(target, adapter, layer_ids=(1, 2, 3))
    prompt = torch.arange(20, 37)
    runner.prefill(prompt)
    chain = DraftTree(tokens=torch.tensor([5, 11, 12, 13]), parents=torch.tensor([-1, 0, 1, 2]),
                      depths=torch.arange(4), children=[[1], [2], [3], []])
    runner.verify(chain)
    runner.keep_path(path)
    fresh = TargetRunner(target, adapter, layer_ids=(1, 2, 3))
    fresh.prefill(torch.cat([prompt, chain.tokens[path]]))
    assert runner.length == fresh.length == prompt.numel() + len(path)
    for kept, ref in zip(runner.cache.layers, fresh.cache.layers):
        assert_same_float32(kept.keys, ref.keys)
        assert_same_float32(kept.values, ref.values)


class _ScoredDraft:
    """A DraftModel whose logits depend only on the depth and the node token, to check the EAGLE-2 tree shape."""

    def __init__(self, vocab: int = 20):
        self.vocab = vocab
        self.calls: list[int] = []

    def reset(self):
        pass

    def to_target(self, ids):
        return ids + 100  # a visible draft -> target mapping

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(sum(tokens) + 1)
        return torch.randn(1, len(tokens), self.vocab, generator=g) * 3

    def expand(self, token_ids, hidden, depths, visible):
        self.calls.append(len(token_ids))
        return DraftStepOutput(logits=self._logits(token_ids.tolist()), hidden=hidden)


@pytest.mark.parametrize("depth,top_k,total", [(8, 10, 60), (4, 3, 12), (5, 1, 5), (3, 4, 100), (1, 5, 3)])
def test_build_tree_is_eagle2_shaped(depth, top_k, total):
    draft = _ScoredDraft()
    root = DraftStepOutput(logits=draft._logits([0]), hidden=torch.zeros(1, 1, 2))
    tree = build_tree(draft, 7, root, TreeSpec(depth=depth, top_k=top_k, total_tokens=total))
    n = len(tree) - 1
    max_candidates = top_k + (depth - 1) * top_k * top_k
    assert n == min(total, max_candidates)
    assert draft.calls == [top_k] * (depth - 1)  # one drafter pass per depth for the whole frontier
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and tree.tokens[0] == 7 and max(depths) <= depth
    assert all(parents[i] < i and depths[i] == depths[parents[i]] + 1 for i in range(1, n + 1))
    assert all(t >= 100 for t in tree.tokens[1:].tolist())  # mapped to target ids
    for node, kids in enumerate(tree.children):
        assert kids == [i for i in range(1, n + 1) if parents[i] == node]
        assert len({tree.tokens[k].item() for k in kids}) == len(kids) <= top_k
    mask = tree.ancestor_mask()
    assert all(int(mask[i].sum()) == depths[i] + 1 for i in range(n + 1))


class _PerNodeDraft(_ScoredDraft):
    """Each node's child logits depend on the node's own token only (not on the rest of the frontier)."""

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        return torch.stack([torch.randn(self.vocab, generator=torch.Generator().manual_seed(t + 1)) * 3
                            for t in tokens]).unsqueeze(0)


def _path_probs(tree, root_logits, draft) -> dict[tuple[int, ...], float]:
    """Cumulative draft probability of every draft node, keyed by its token path."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    logp, path = {0: 0.0}, {0: ()}
    for i in range(1, len(tree)):
        p = parents[i]
        parent_logits = root_logits if p == 0 else draft._logits([tokens[p]])[0, 0]  # expand sees target ids
        logp[i] = logp[p] + float(torch.log_softmax(parent_logits, -1)[tokens[i] - 100])
        path[i] = (*path[p], tokens[i])
    return {path[i]: math.exp(logp[i]) for i in range(1, len(tree))}


@pytest.mark.parametrize("min_prob", [0.01, 0.05, 0.2, 0.4, 0.6])
def test_min_prob_keeps_exactly_the_nodes_above_it(min_prob):
    draft = _PerNodeDraft()
    root = DraftStepOutput(logits=draft._logits([0]), hidden=torch.zeros(1, 1, 2))
    full = build_tree(draft, 7, root, TreeSpec(depth=4, top_k=3, total_tokens=100))  # every candidate
    full_probs = _path_probs(full, root.logits[0, 0], draft)
    draft.calls.clear()
    cut = build_tree(draft, 7, root, TreeSpec(depth=4, top_k=3, total_tokens=100, min_prob=min_prob))
    cut_probs = _path_probs(cut, root.logits[0, 0], draft)
    assert set(cut_probs) == {path for path, prob in full_probs.items() if prob >= min_prob}
    assert len(cut_probs) < len(full_probs)
    # the drafter runs only below frontiers that still have nodes above the floor (depth 4: at most 3 passes)
    assert len(draft.calls) == min(max(map(len, cut_probs), default=0), 3)


def test_min_prob_above_every_guess_drafts_nothing():
    draft = _PerNodeDraft()
    root = DraftStepOutput(logits=draft._logits([0]), hidden=torch.zeros(1, 1, 2))
    top = float(torch.softmax(root.logits[0, 0], -1).max())
    tree = build_tree(draft, 7, root, TreeSpec(depth=4, top_k=3, total_tokens=10, min_prob=min(0.99, top + 0.01)))
    assert len(tree) == 1 and tree.tokens.tolist() == [7] and tree.children == [[]] and draft.calls == []
    assert TreeSpec.chain(3, 0.25).label == "chain:3@0.25" and TreeSpec.parse("tree:4/3/10@0.05").min_prob == 0.05
    with pytest.raises(ValueError, match=r"min_prob must be in \[0, 1\)"):
        TreeSpec(min_prob=1.0)


def test_chain_spec_and_mode_errors():
    assert tree_spec("chain", depth=5) == TreeSpec(depth=5, top_k=1, total_tokens=5)
    with pytest.raises(ValueError, match="valid: tree, chain"):
        tree_spec("beam")
    with pytest.raises(ValueError, match="depth must be >= 1"):
        TreeSpec(depth=0)


def test_tree_drafting_equals_sequential_drafter_rollouts():
    """A node's logits from the batched tree pass equal stepping its path alone through the drafter cache."""
    target = tiny_target("llama")
    drafter = random_drafter(target, draft_vocab_size=200)
    embed = get_adapter("llama").embed_tokens(target)
    aux = torch.randn(1, 10, drafter.fc.in_features)
    ids = torch.randint(3, 500, (11,))
    draft = Eagle3DraftModel(drafter, embed)
    calls = []
    original = draft.expand

    def recording_expand(token_ids, hidden, depths, visible):
        out = original(token_ids, hidden, depths, visible)
        calls.append((token_ids, depths, visible, out.logits[0]))
        return out

    draft.expand = recording_expand
    root = draft.extend(aux, ids[:-1], ids[1:])
    build_tree(draft, int(ids[-1]), root, TreeSpec(depth=4, top_k=3, total_tokens=30))
    cached = torch.cat([c[0] for c in calls]).tolist()  # tokens of the drafter's tree entries, in cache order
    token_ids, depths, visible, logits = calls[-1]  # the depth-3 frontier
    assert depths.tolist() == [3, 3, 3]
    for i in range(3):
        path = [t for t, seen in zip(cached, visible[i].tolist()) if seen]
        alone = Eagle3DraftModel(drafter, embed)
        out = alone.extend(aux, ids[:-1], ids[1:])
        for d, tok in enumerate(path, start=1):
            out = alone.expand(torch.tensor([tok]), out.hidden, torch.tensor([d]), torch.ones(1, d, dtype=torch.bool))
        assert_same_float32(out.logits[0, 0], logits[i])


class _NoisyWithEagleCache(OracleDraftModel):
    """Noisy-oracle proposals, while a real Eagle3DraftModel follows every extend (to check its cache)."""

    def __init__(self, target, eagle: Eagle3DraftModel):
        super().__init__(target, "noisy")
        self.eagle = eagle

    def reset(self):
        super().reset()
        if hasattr(self, "eagle"):
            self.eagle.reset()

    def extend(self, aux_hidden, input_ids, next_ids):
        self.eagle.extend(aux_hidden, input_ids, next_ids)
        return super().extend(aux_hidden, input_ids, next_ids)


def test_drafter_cache_follows_the_accepted_path():
    target = tiny_target("llama")
    adapter = get_adapter("llama")
    drafter = random_drafter(target)
    eagle = Eagle3DraftModel(drafter, adapter.embed_tokens(target))
    draft = _NoisyWithEagleCache(target, eagle)
    gen = SpeculativeGenerator(target, draft, tree_spec("tree", **SMALL_TREE), adapter, layer_ids=(1, 2, 3))
    prompt = torch.arange(30, 42)
    out = gen.generate(prompt, 30, eos_token_id=[])
    assert max(out.accept_lengths) >= 2 and len(set(out.accept_lengths)) > 1  # multi-token, varied extends
    # recompute the drafter's context rows from scratch over the final accepted sequence
    tokens = torch.cat([prompt, torch.tensor(out.tokens[:-1])])
    with capture_aux_hidden(target, adapter, (1, 2, 3)) as cap:
        target(tokens[None])
    fresh = Eagle3DraftModel(drafter, adapter.embed_tokens(target))
    fresh.extend(cap.aux_hidden, tokens, torch.cat([tokens[1:], torch.tensor(out.tokens[-1:])]))
    n = eagle.ctx_len
    assert n <= fresh.ctx_len
    assert_same_float32(eagle.cache.keys[..., :n, :], fresh.cache.keys[..., :n, :])
    assert_same_float32(eagle.cache.values[..., :n, :], fresh.cache.values[..., :n, :])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("drafter_kind", ["random", "noisy"])
def test_greedy_is_lossless(family, mode, drafter_kind):
    target = tiny_target(family)
    if drafter_kind == "random":  # a real EAGLE-3 drafter with a reduced draft vocabulary (d2t mapping in play)
        draft, layer_ids = random_drafter(target, draft_vocab_size=256), None
        prompts, n_new = _prompts(target.config.vocab_size), 24
    else:  # a "trained" drafter: right often, through first and later children, wrong sometimes
        draft, layer_ids = OracleDraftModel(target, "noisy"), (1, 2, 3)
        prompts, n_new = _prompts(target.config.vocab_size)[1:2], 40
    gen = SpeculativeGenerator(target, draft, tree_spec(mode, **SMALL_TREE), layer_ids=layer_ids)
    for prompt in prompts:
        expected = reference(target, prompt, n_new)  # the model's default EOS applies on both sides
        out = gen.generate(prompt, n_new)
        assert out.tokens == expected, f"prompt of {prompt.numel()} tokens"
        assert plain_generate(target, prompt, n_new).tokens == expected
    if drafter_kind == "noisy":
        assert sum(out.accept_lengths) > 0 and out.tau > 1.2


def test_default_tree_is_lossless_and_oracle_reaches_full_depth():
    target = tiny_target("qwen2")
    prompt = torch.arange(40, 60)
    expected = reference(target, prompt, 30)
    for draft in (random_drafter(target), OracleDraftModel(target, "right")):
        out = SpeculativeGenerator(target, draft, TreeSpec(), layer_ids=(1, 2, 3)).generate(prompt, 30)
        assert out.tokens == expected
    assert out.accept_lengths[0] == 8  # default depth 8, top-k 10, 60 nodes


@pytest.mark.parametrize("mode,spec,tau", [("chain", dict(depth=5), 6.0), ("chain", dict(depth=1), 2.0),
                                           ("tree", dict(depth=6, top_k=4, total_tokens=20), 7.0),
                                           ("tree", dict(depth=3, top_k=10, total_tokens=60), 4.0)])
def test_oracle_tau_is_depth_plus_one(mode, spec, tau):
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, OracleDraftModel(target, "right"), tree_spec(mode, **spec),
                               layer_ids=(1, 2, 3))
    stats = BenchStats()
    for prompt in _prompts(target.config.vocab_size)[:2]:
        out = gen.generate(prompt, 33, eos_token_id=[])
        assert out.tokens == reference(target, prompt, 33, None)
        stats.add(out)
    summary = stats.summary()
    assert summary["tau"] == tau and summary["tau_per_request_mean"] == tau
    assert summary["acceptance_per_depth"] == [1.0] * (int(tau) - 1)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_always_wrong_drafter_tau_is_one(mode):
    target = tiny_target("deepseek_v3")
    gen = SpeculativeGenerator(target, OracleDraftModel(target, "wrong"), tree_spec(mode, **SMALL_TREE),
                               layer_ids=(1, 2, 3))
    prompt = torch.arange(7, 19)
    out = gen.generate(prompt, 20, eos_token_id=[])
    assert out.tokens == reference(target, prompt, 20, None)
    assert out.tau == 1.0 and out.cycles == 19
    stats = BenchStats()
    stats.add(out)
    assert stats.summary()["acceptance_per_depth"] == [0.0]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_eos_inside_an_accepted_draft_stops_there(mode):
    target = tiny_target("llama")
    prompt = torch.arange(100, 112)
    free = reference(target, prompt, 40, None)
    eos = free[9]  # a token the target emits mid-stream
    expected = reference(target, prompt, 40, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) == free.index(eos) + 1
    gen = SpeculativeGenerator(target, OracleDraftModel(target, "right"), tree_spec(mode, depth=6, top_k=3,
                                                                                  total_tokens=12),
                               layer_ids=(1, 2, 3))
    out = gen.generate(prompt, 40, eos_token_id=eos)
    assert out.tokens == expected and out.stop_reason == "eos"
    assert out.accept_lengths[-1] == 6  # the EOS sat inside a fully accepted draft
    # also with several stop ids, as generate's list form
    out = gen.generate(prompt, 40, eos_token_id=[free[12], eos])
    assert out.tokens == reference(target, prompt, 40, eos_token_id=[free[12], eos])


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("max_new", [1, 2, 7, 10])
def test_max_new_tokens_inside_an_accepted_draft(mode, max_new):
    target = tiny_target("qwen2")
    prompt = torch.arange(50, 61)
    gen = SpeculativeGenerator(target, OracleDraftModel(target, "right"), tree_spec(mode, depth=4, top_k=2,
                                                                                  total_tokens=8),
                               layer_ids=(1, 2, 3))
    out = gen.generate(prompt, max_new, eos_token_id=[])
    assert out.tokens == reference(target, prompt, max_new, None)
    assert out.stop_reason == "length" and out.cycles == (max_new - 1 + 4) // 5


def test_speculative_and_plain_decoding_take_a_request_alike():
    """Both decoders: greedy and the model's generation_config EOS by default, a `[1, n]` prompt as `[n]`, and the
    same refusals."""
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, OracleDraftModel(target, "right"), tree_spec("chain", depth=3),
                               layer_ids=(1, 2, 3))
    prompt = torch.arange(100, 112)
    free = reference(target, prompt, 20, None)
    saved, target.generation_config.eos_token_id = target.generation_config.eos_token_id, free[7]
    try:
        for decode in (gen.generate, lambda *a: plain_generate(target, *a)):
            out = decode(prompt.view(1, -1), 20)
            assert out.tokens == free[: free.index(free[7]) + 1] and out.stop_reason == "eos"
            with pytest.raises(ValueError, match="batch size 1"):
                decode(torch.ones(2, 3, dtype=torch.long), 5)
            with pytest.raises(ValueError, match="input_ids is empty"):
                decode(torch.ones(0, dtype=torch.long), 5)
            with pytest.raises(ValueError, match="max_new_tokens"):
                decode(torch.ones(3, dtype=torch.long), 0)
    finally:
        target.generation_config.eos_token_id = saved


def test_generator_rejects_a_drafter_of_another_target():
    target = tiny_target("llama")
    other = tiny_target("llama", hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="does not fit the target"):
        SpeculativeGenerator(other, random_drafter(target))


def test_sliding_window_target_keeps_full_caches_and_masks_its_windows():
    """A Qwen2 with its last two layers sliding (window 8): the verification cache keeps full-length layers, and
    tree nodes far past the window see exactly what a plain forward of their path sees."""
    target = tiny_target("qwen2", use_sliding_window=True, sliding_window=8,
                         layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    runner = TargetRunner(target, layer_ids=(1, 2, 3))
    prompt = torch.arange(5, 25)
    runner.prefill(prompt)
    assert all(type(layer).__name__ == "DynamicLayer" for layer in runner.cache.layers)
    logits, _ = runner.verify(_hand_tree(root=5))
    for node, path in {3: [5, 11, 13], 5: [5, 11, 13, 15]}.items():
        ref = target(torch.cat([prompt, torch.tensor(path)])[None]).logits[0, -1]
        assert_same_float32(logits[node], ref)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_every_layer_sliding_is_lossless(mode):
    """Mistral-7B-v0.1 style: `sliding_window` set and no `layer_types`, so one window mask serves every layer."""
    target = tiny_target("mistral", sliding_window=8)
    gen = SpeculativeGenerator(target, OracleDraftModel(target, "noisy"), tree_spec(mode, **SMALL_TREE),
                               layer_ids=(1, 2, 3))
    prompt = _prompts(target.config.vocab_size)[1]
    expected = reference(target, prompt, 40, None)
    out = gen.generate(prompt, 40, eos_token_id=[])
    assert out.tokens == expected and out.tau > 1.2
