"""Slow: lossless greedy speculative decoding on the real embedded SmolLM2-135M-Instruct, all 80 MT-bench questions.

Run with ``pytest -m slow tests/test_speculative_smollm2.py`` (first run converts the embedded GGUF once, ~1 min;
then about 6 minutes on one CPU thread; use OMP_NUM_THREADS=1 on a shared machine).
"""

from __future__ import annotations

import pytest
import torch

from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter
from eagle3_zoo.speculative import SpeculativeGenerator, load_benchmark, tree_spec
from eagle3_zoo.speculative.benchmarks import chat_input_ids
from tests.test_speculative_support import OracleDraftModel

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 10
CPU_TREE = dict(depth=6, top_k=8, total_tokens=32)  # the 60-node default costs ~4 plain steps per cycle on CPU


@pytest.fixture(scope="module")
def smollm2():
    from eagle3_zoo.adapters import load_target

    return load_target("smollm2-135m-instruct")


def test_mtbench_first_turns_are_lossless(smollm2):
    target, tokenizer, adapter = smollm2
    config = Eagle3Config.from_target_config(target.config, draft_vocab_size=8192)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).eval()  # random, sized like an EAGLE-3 drafter for this target
    generators = {mode: SpeculativeGenerator(target, drafter, tree_spec(mode, **CPU_TREE), adapter)
                  for mode in ("tree", "chain")}
    prompts = load_benchmark("mtbench").prompts
    assert len(prompts) == 80
    mismatches = []
    for i, prompt in enumerate(prompts):
        ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        expected = target.generate(ids[None], do_sample=False, max_new_tokens=MAX_NEW_TOKENS)[0, ids.numel():]
        mode = "tree" if i % 2 == 0 else "chain"  # both draft shapes, 40 questions each
        out = generators[mode].generate(ids, MAX_NEW_TOKENS)
        if out.tokens != expected.tolist():
            mismatches.append((prompt.id, mode))
    assert not mismatches, f"speculative output differs from generate for {mismatches}"


def test_multi_token_acceptance_is_lossless(smollm2):
    """A drafter that is often right (noisy oracle): deep accepted paths, pruned caches, on the real model."""
    target, tokenizer, adapter = smollm2
    oracle = OracleDraftModel(target, "noisy")
    for mode in ("tree", "chain"):
        gen = SpeculativeGenerator(target, oracle, tree_spec(mode, depth=4, top_k=3, total_tokens=10), adapter)
        for prompt in load_benchmark("mtbench", limit=1).prompts:
            ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
            expected = target.generate(ids[None], do_sample=False, max_new_tokens=20)[0, ids.numel():].tolist()
            out = gen.generate(ids, 20)
            assert out.tokens == expected
            assert max(out.accept_lengths) >= 2
