"""What `eagle3-zoo eval` runs when its options are left out: the paper's tree on a GPU; on a CPU, where every verified
node costs time, the same tree cut at draft probability 0.2, 128 new tokens and 8 prompts spread over each benchmark
(the first eval a newcomer types answers in minutes, not 12); options given are taken as given."""

from __future__ import annotations

import argparse

import pytest

from eagle3_zoo.cli.evaluate import add_eval_arguments, settings_for


def _args(*argv: str) -> argparse.Namespace:
    return add_eval_arguments(argparse.ArgumentParser()).parse_args(["drafter", *argv])


def test_defaults_per_device():
    cpu, gpu = settings_for(_args(), "cpu"), settings_for(_args(), "cuda")
    assert (gpu["mode"], gpu["depth"], gpu["top_k"], gpu["total_tokens"], gpu["min_prob"]) == ("tree", 8, 10, 60, 0)
    assert (gpu["max_new_tokens"], gpu["limit"], gpu["spread"]) == (256, None, False)
    assert (cpu["depth"], cpu["top_k"], cpu["total_tokens"], cpu["min_prob"]) == (8, 10, 60, 0.2)
    assert (cpu["max_new_tokens"], cpu["limit"], cpu["spread"]) == (128, 8, True)


def test_given_options_are_taken_as_given():
    s = settings_for(_args("--mode", "chain", "--depth", "3", "--max-new-tokens", "32", "--limit", "2"), "cpu")
    assert (s["mode"], s["depth"], s["min_prob"], s["max_new_tokens"], s["limit"], s["spread"]) == (
        "chain", 3, 0.0, 32, 2, False)  # a shape given is not cut, --limit without --spread takes the first N
    assert settings_for(_args("--min-prob", "0.3"), "cpu")["min_prob"] == 0.3
    assert settings_for(_args("--spread"), "cuda")["spread"] is True
    with pytest.raises(ValueError, match="drop --depth or --shapes"):
        settings_for(_args("--shapes", "chain:1", "--depth", "2"), "cpu")
