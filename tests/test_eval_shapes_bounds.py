"""Draft shapes are checked against the target's context and --max-new-tokens before any decoding: a chain deeper
than the room left (one drafter step per depth, every cycle: it never ends) or a tree with more nodes than the
context holds (its attention mask alone is gigabytes) is refused at once, in one line, through `eval`."""

from __future__ import annotations

import time

import pytest

from eagle3_zoo.values.draft_shapes import MAX_DRAFT_TOKENS, TreeSpec, shape_problem
from tests.test_speculative_eval import _saved_target_and_drafter


@pytest.mark.parametrize("shape, context, max_new, expected", [
    ("chain:99999999", 2048, 256, "draft shape chain:99999999: depth 99999999 exceeds the target's context of 2048 "
                                  "tokens minus --max-new-tokens 256 = 1792"),
    ("tree:100/100/100000", 2048, 256, "draft shape tree:100/100/100000: verified tokens 100001 exceeds"),
    ("tree:8/10/2000", 2048, 256, "verified tokens 2001 exceeds"),
    ("chain:5", 64, 60, "depth 5 exceeds the target's context of 64 tokens minus --max-new-tokens 60 = 4"),
    ("chain:9000", None, 256, f"depth 9000 exceeds {MAX_DRAFT_TOKENS} (the target does not say its context"),
    ("chain:1", 64, 64, "--max-new-tokens 64 leaves no room for a draft"),
])
def test_shapes_that_cannot_fit_are_refused(shape, context, max_new, expected):
    assert expected in shape_problem(TreeSpec.parse(shape), context, max_new)


@pytest.mark.parametrize("shape, context, max_new", [
    ("chain:7", 2048, 256), ("tree:8/10/60", 2048, 256), ("chain:20", 2048, 8), ("tree:8/10/60", None, 100000)])
def test_shapes_that_fit_pass(shape, context, max_new):
    assert shape_problem(TreeSpec.parse(shape), context, max_new) is None


@pytest.mark.parametrize("args", [["--shapes", "chain:99999999"], ["--shapes", "chain:1,tree:100/100/100000"],
                                  ["--mode", "chain", "--depth", "5000"]])
def test_eval_refuses_such_a_shape_before_decoding(tmp_path, capsys, args):
    from eagle3_zoo.cli import main

    _, drafter_dir = _saved_target_and_drafter(tmp_path, context=512)
    capsys.readouterr()
    out = tmp_path / "res.json"
    start = time.monotonic()
    code = main(["eval", str(drafter_dir), "--bench", "humaneval", "--limit", "1", "--max-new-tokens", "16",
                 "--warmup", "1", "--no-progress", "--out", str(out), *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]  # (the rest: the target's loading bar)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: draft shape ") and "exceeds the target's context of 512 tokens minus " \
        "--max-new-tokens 16 = 496" in lines[0]
    assert time.monotonic() - start < 60 and not out.exists()  # refused, not decoded for ever
