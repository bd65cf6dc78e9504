"""The card reads each JSON file once, typed (`eagle3_zoo.hub.records`): a field of the wrong type is an error naming
the file and the key path (not a "–" in the card), and the older layouts the card has always read still render."""

from __future__ import annotations

import json

import pytest

from eagle3_zoo.hub import render_card
from tests.hub_fixtures import canonical_dir

# TEST DATA: shaped like `eagle3-zoo eval` results and fit's provenance.json; the numbers are made up.
BENCH = {"requests": 4, "tau": 2.5, "speedup": 1.5, "spec_tokens_per_s": 30.0, "baseline_tokens_per_s": 20.0,
         "acceptance_per_depth": [0.6, 0.3], "lossless": True}
RESULTS = {"settings": {"mode": "chain", "depth": 2, "temperature": 0.0, "benches": ["mtbench"]},
           "benchmarks": {"mtbench": BENCH}, "overall": BENCH,
           "machine": {"processor": "AMD EPYC", "device": "cpu", "cpu_count": 2,
                       "load_average": {"start": [1.0, 1.0, 1.0], "end": [2.0, 1.0, 1.0]}}}


def _card(tmp_path, results=None, provenance=None) -> str:
    folder, _ = canonical_dir(tmp_path)
    if results is not None:
        (folder / "eval_results.json").write_text(json.dumps(results))
    if provenance is not None:
        (folder / "provenance.json").write_text(json.dumps(provenance))
    return render_card(folder, repo_id="me/x").text


def _with(data: dict, path: tuple, value) -> dict:
    """A deep copy of `data` with the value at `path` replaced."""
    out = json.loads(json.dumps(data))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def test_the_well_formed_results_render(tmp_path):
    text = _card(tmp_path, RESULTS)
    assert "| mtbench | 4 | 2.50 | – | 1.50x | 30.0 | 20.0 | 0.60, 0.30 | yes |" in text
    assert "AMD EPYC (cpu, 2 cores)" in text and "1.00 at the start, 2.00 at the end" in text


@pytest.mark.parametrize("path, value, message", [
    (("benchmarks", "mtbench", "tau"), "2.5", r"`benchmarks\.mtbench\.tau` should be a number or null, not a string"),
    (("benchmarks", "mtbench", "acceptance_per_depth"), [0.6, "0.3"],
     r"`benchmarks\.mtbench\.acceptance_per_depth\[1\]` should be a number"),
    (("benchmarks", "mtbench", "lossless"), "yes", r"`benchmarks\.mtbench\.lossless` should be true, false or null"),
    (("overall", "speedup"), True, r"`overall\.speedup` should be a number or null, not true"),
    (("settings", "depth"), "2", r"`settings\.depth` should be an integer or null"),
    (("machine", "load_average"), [1.0, 1.0, 1.0], r"`machine\.load_average` should be an object, not a list"),
    (("settings",), ["chain"], r"`settings` should be an object, not a list"),
])
def test_a_wrong_typed_result_is_an_error_naming_the_file_and_key(tmp_path, path, value, message):
    # before the typed reading, each of these rendered a card with "–" (or nothing) where the figure belonged
    with pytest.raises(ValueError, match=r"eval_results\.json: " + message):
        _card(tmp_path, _with(RESULTS, path, value))


def test_a_wrong_typed_shape_comparison_names_the_shape(tmp_path):
    shapes = {"settings": {"shapes": ["chain:1"]},
              "shapes": [{"shape": "chain:1", "benchmarks": {"mtbench": BENCH},
                          "overall": {**BENCH, "requests": "4"}}]}
    with pytest.raises(ValueError, match=r"eval_results\.json: `shapes\[0\]\.overall\.requests` should be an integer"):
        _card(tmp_path, shapes)
    with pytest.raises(ValueError, match=r"`shapes\[0\]\.shape` should be the shape's label"):
        _card(tmp_path, {"shapes": [{"benchmarks": {}}]})


@pytest.mark.parametrize("provenance, message", [
    ({"created_unix": "2026-12-02"}, r"`created_unix` should be an integer or null, not a string"),
    ({"training": {"global_step": "sixty"}}, r"`training\.global_step` should be an integer"),
    ({"global_step": 60.5}, r"`global_step` should be an integer"),  # the older flat layout: the path says so
    ({"data": {"train_examples": 19, "train_tokens": "1742"}}, r"`data\.train_tokens` should be an integer"),
    ({"data": {"train_examples": 19, "skipped_by_reader": {"no_user_turn": "1"}}},
     r"`data\.skipped_by_reader\.no_user_turn` should be an integer"),
    ({"git": "0123abc"}, r"`git` should be an object, not a string"),
    ({"packages": {"torch": 2.13}}, r"`packages\.torch` should be a string or null"),
])
def test_a_wrong_typed_provenance_is_an_error_naming_the_file_and_key(tmp_path, provenance, message):
    with pytest.raises(ValueError, match=r"provenance\.json: " + message):
        _card(tmp_path, provenance=provenance)


def test_results_of_an_older_layout_still_render(tmp_path):
    # benchmarks as a list of named entries (read as the mapping it stands for)
    listed = {**RESULTS, "benchmarks": [{"name": "mtbench", **BENCH}], "overall": None}
    assert "| mtbench | 4 | 2.50 | – | 1.50x | 30.0 | 20.0 | 0.60, 0.30 | yes |" in _card(tmp_path / "a", listed)
    # a benchmark given as its tau alone, and no settings at all
    bare = _card(tmp_path / "b", {"benchmarks": {"mtbench": 2.5}})
    assert "| mtbench | – | 2.50 | – | – | – | – | – | – |" in bare
    # an engine run: only the pooled counters, named by the benchmarks it ran
    engine = {"tau": 1.5, "settings": {"engine": "vllm", "num_speculative_tokens": 2, "benches": ["mtbench"]},
              "overall": {"requests": 8, "tau": 1.5, "speedup": 1.1}}
    assert "| mtbench | 8 | 1.50 | – | 1.10x |" in _card(tmp_path / "c", engine)


def test_provenance_of_the_older_flat_layout_still_renders(tmp_path):
    flat = {"git_sha": "0123abc", "target": "tiny-org/tiny-llama", "hardware": "2 CPU cores", "train_time_s": 512.4,
            "global_step": 400, "versions": {"torch": "2.13", "transformers": "5.24"}}
    text = _card(tmp_path, provenance=flat)
    for row in ("| Steps | 400 |", "| Hardware | 2 CPU cores |", "| Training time | 8 min 32 s |",
                "| Software | torch 2.13, transformers 5.24 |", "| Target | tiny-org/tiny-llama |"):
        assert row in text


@pytest.mark.parametrize("data", [[RESULTS], []])
def test_a_results_file_that_is_not_an_object_is_an_error(tmp_path, data):
    with pytest.raises(ValueError, match=r"eval_results\.json: `\(the whole file\)` should be an object, not a list"):
        _card(tmp_path, data)
    with pytest.raises(ValueError, match=r"provenance\.json: `\(the whole file\)` should be an object, not a list"):
        _card(tmp_path / "p", provenance=data)
