"""Fixtures for the speculative-decoding tests: tiny random targets of each family and oracle drafters.

The oracle implements the generator's `DraftModel` protocol and proposes the target's own greedy continuation of
every node's path (or never proposes it, or hides it at a context-dependent rank). It rebuilds each node's path
from the visibility mask and checks the generator's bookkeeping (rows, depths, ancestors) on every call, so a
wrong tree mask or position shows up as a wrong path and a lower tau.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from eagle3_zoo.adapters import available_adapters, get_adapter
from eagle3_zoo.modeling import DraftStepOutput, Eagle3Config, Eagle3Drafter, identity_vocab

FAMILIES = tuple(available_adapters())  # every registered family


def assert_same_float32(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 64) -> None:
    """Two float32 computations of the same values (a tree forward and a path forward, a kept cache and a prefill):
    equal up to `ulps` float32 epsilons of the tensor's largest magnitude. Summation order differs with the CPU's
    kernels (AVX2, AVX-512, scalar), so a per-element rtol fails on values near zero of a residual stream whose
    largest entries are ~30. Measured worst case over the families and ATEN_CPU_CAPABILITY=default/avx2/avx512: 27
    epsilons (gpt_oss, scalar kernels), 3-8 for the others; a wrong mask, position or cache entry is off by O(1)."""
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=ulps * torch.finfo(torch.float32).eps * scale)


def tiny_target(family: str = "llama", seed: int = 0, init_std: float = 0.2, **overrides):
    """A tiny random target from the adapter's `tiny_config()`, initialised wide enough that greedy text varies."""
    config = get_adapter(family).tiny_config()
    config.initializer_range = init_std  # the 0.02 default gives near-uniform logits and repetitive greedy text
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def random_drafter(target, seed: int = 1, draft_vocab_size: int | None = None) -> Eagle3Drafter:
    """A random drafter sized from the target (aux layers 1, N//2, N-1 of the 4-layer tiny targets)."""
    n = target.config.num_hidden_layers
    vocab = target.config.vocab_size
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=draft_vocab_size or vocab,
                                          aux_layer_ids=(1, n // 2, n - 1))
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    drafter.reset_parameters(std=0.2)
    if draft_vocab_size is None or draft_vocab_size == vocab:
        drafter.set_vocab(*identity_vocab(vocab))
    else:  # a draft vocabulary of every other target id, so d2t is a real mapping
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(0, vocab, 2)[:draft_vocab_size]] = True
        used = t2d.nonzero().squeeze(-1)
        drafter.set_vocab(used - torch.arange(draft_vocab_size), t2d)
    return drafter.eval().requires_grad_(False)


class OracleDraftModel:
    """Proposes the target's greedy next token of each node's path.

    Args:
        target: The target whose greedy continuation is proposed.
        kind: ``"right"`` (greedy token ranked first), ``"wrong"`` (greedy token ranked last: never drafted), or
            ``"noisy"`` (greedy token at a context-dependent rank 0..3, so some paths go through 2nd children and
            some miss).
    """

    def __init__(self, target, kind: str = "right"):
        self.target, self.kind = target, kind
        self.vocab = target.config.vocab_size
        self.order = torch.randperm(self.vocab, generator=torch.Generator().manual_seed(7)).tolist()
        self.reset()

    def reset(self) -> None:
        self.rows: list[int] = []  # x_0..x_{n-1}: the tokens of the context rows
        self.last: int | None = None  # x_n: the newest emitted token
        self.tree: list[int] = []  # tokens of the cached tree entries

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def _greedy(self, contexts: list[list[int]]) -> list[int]:
        return self.target(torch.tensor(contexts)).logits[:, -1].argmax(-1).tolist()

    def _rank(self, context: list[int]) -> int:
        if self.kind == "right":
            return 0
        if self.kind == "wrong":
            return self.vocab - 1
        return (sum(context) * 31 + len(context)) % 4

    def _logits(self, contexts: list[list[int]]) -> torch.Tensor:
        logits = torch.empty(1, len(contexts), self.vocab)
        for i, (context, greedy) in enumerate(zip(contexts, self._greedy(contexts))):
            ranked = [t for t in self.order if t != greedy]
            ranked.insert(self._rank(context), greedy)
            logits[0, i, ranked] = -0.5 * torch.arange(self.vocab, dtype=torch.float)
            if self.kind == "right":
                logits[0, i, greedy] = 50.0  # all the mass: the greedy path outranks every other tree node
        return logits

    def extend(self, aux_hidden, input_ids, next_ids) -> DraftStepOutput:
        inputs, nexts = input_ids.tolist(), next_ids.tolist()
        assert inputs[1:] == nexts[:-1], "context rows must read (x_t, x_t+1) pairs"
        assert aux_hidden.shape[1] == len(inputs)
        if self.rows:
            assert inputs[0] == self.last, "new rows must continue the accepted context"
        self.rows += inputs
        self.last = nexts[-1]
        self.tree = []
        return DraftStepOutput(logits=self._logits([self.rows + [self.last]]), hidden=torch.zeros(1, 1, 1))

    def expand(self, token_ids, hidden, depths, visible) -> DraftStepOutput:
        self.tree += token_ids.tolist()
        assert visible.shape == (len(token_ids), len(self.tree))
        contexts = []
        for row, depth in zip(visible.tolist(), depths.tolist()):
            path = [t for t, seen in zip(self.tree, row) if seen]
            assert len(path) == depth, "a node must see exactly its ancestors and itself"
            contexts.append(self.rows + [self.last] + path)
        return DraftStepOutput(logits=self._logits(contexts), hidden=torch.zeros(1, len(contexts), 1))


_MODEL_DEFAULT = object()


def reference(target, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=_MODEL_DEFAULT) -> list[int]:
    """`target.generate(do_sample=False)`'s new tokens; `eos_token_id` None = no stop token, default = the model's.

    (generate merges an unset/None EOS with the model's generation_config, so the stop ids are set there.)
    """
    saved = target.generation_config.eos_token_id
    if eos_token_id is not _MODEL_DEFAULT:
        target.generation_config.eos_token_id = eos_token_id
    try:
        out = target.generate(prompt.view(1, -1), do_sample=False, max_new_tokens=max_new_tokens)
    finally:
        target.generation_config.eos_token_id = saved
    return out[0, prompt.numel():].tolist()


# ---- the fixtures themselves -----------------------------------------------------------------------------------


def test_tiny_targets_are_not_degenerate():
    for family in FAMILIES:
        target = tiny_target(family)
        tokens = reference(target, torch.arange(5, 17), 40, eos_token_id=None)
        assert len(set(tokens)) > 20, f"{family}: greedy text is repetitive: {tokens}"


def test_oracle_proposes_the_greedy_token():
    target = tiny_target("llama")
    oracle = OracleDraftModel(target)
    prompt = torch.arange(3, 15)
    expected = reference(target, prompt, 3, eos_token_id=None)
    out = oracle.extend(torch.zeros(1, 12, 1), prompt, torch.cat([prompt[1:], torch.tensor([expected[0]])]))
    assert int(out.logits[0, -1].argmax()) == expected[1]
    out = oracle.expand(torch.tensor([expected[1]]), out.hidden, torch.tensor([1]), torch.ones(1, 1, dtype=torch.bool))
    assert int(out.logits[0, -1].argmax()) == expected[2]
