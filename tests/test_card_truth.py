"""A card that tells the truth: only results measured on the folder's own weights (a rerun of `fit` keeps the user's
old eval_results*.json, whose figures must not be shown as the new drafter's), a demo drafter labelled as one, the
target weights actually used, plain tokens/s next to each speedup, and the cycles a cut shape drafted in."""

from __future__ import annotations

import json
import logging

from eagle3_zoo.checkpoint.weights import weights_digest
from eagle3_zoo.hub.card import card_variables, render_card
from tests.hub_fixtures import canonical_dir, edit_weights


def _results(digest: str | None, tau: float) -> str:
    settings = {"temperature": 0} | ({"drafter_weights_sha256": digest} if digest else {})
    return json.dumps({"settings": settings, "benchmarks": {"mtbench": {"requests": 4, "tau": tau}}})


def test_card_leaves_out_results_of_other_weights(tmp_path, caplog):
    folder, _ = canonical_dir(tmp_path)
    (folder / "eval_results.json").write_text(_results(weights_digest(folder), 1.44))
    (folder / "eval_results_chain.json").write_text(_results(weights_digest(folder), 1.16))
    rows = card_variables(folder)["benchmarks"]
    assert [r["tau"] for r in rows] == ["1.44", "1.16"]
    assert "sha256" not in json.dumps(card_variables(folder)["settings"])  # a digest is no setting to show

    edit_weights(folder, lambda s: s["norm.weight"].mul_(2))  # new weights, as a rerun of fit writes them
    with caplog.at_level(logging.WARNING):
        assert card_variables(folder).get("benchmarks") in (None, [])
    assert "measured on other weights" in caplog.text

    (folder / "eval_results.json").write_text(_results(None, 2.0))  # no digest (older eval): kept as it is
    assert [r["tau"] for r in card_variables(folder)["benchmarks"]] == ["2.00"]


def test_demo_drafter_and_embedded_target_weights_are_stated(tmp_path):
    folder, _ = canonical_dir(tmp_path, target_name_or_path="smollm2-135m-instruct")
    (folder / "recipe.yaml").write_text("demo: true\ntarget:\n  name_or_path: smollm2-135m-instruct\n")
    (folder / "provenance.json").write_text(json.dumps({"training": {"global_step": 60},
                                                        "data": {"train_supervised_tokens": 12345}}))
    text = render_card(folder, repo_id="me/x-smoke").text
    assert "> **Demo drafter.** This is a demo drafter: trained by a short smoke configuration (60 steps on 12,345 " \
           "supervised tokens)" in text and "not meant for serving" in text
    assert "- **Target weights:** SmolLM2-135M-Instruct dequantised from the Q4_1 GGUF" in text
    (folder / "recipe.yaml").write_text("target:\n  name_or_path: smollm2-135m-instruct\n")  # the full recipe
    assert "Demo drafter" not in render_card(folder, repo_id="me/x").text


def test_cut_shapes_show_the_cycles_they_drafted_in(tmp_path):
    folder, _ = canonical_dir(tmp_path)
    bench = {"requests": 32, "tau": 1.28, "cycles": 200, "depth_attempts": [110, 40], "depth_accepts": [57, 10],
             "speedup": 1.08, "spec_tokens_per_s": 32.1, "baseline_tokens_per_s": 29.7}
    shapes = {"settings": {"shapes": ["chain:1", "chain:1@0.2"], "benches": ["mtbench"]},
              "shapes": [{"shape": "chain:1", "benchmarks": {"mtbench": {**bench, "depth_attempts": [200]}},
                          "overall": {"requests": 32}},
                         {"shape": "chain:1@0.2", "benchmarks": {"mtbench": bench}, "overall": {"requests": 32}}]}
    (folder / "eval_results_shapes.json").write_text(json.dumps(shapes))
    text = render_card(folder, repo_id="me/x").text
    assert "| Cycles with a draft |" in text
    assert "| mtbench (chain:1@0.2) | 32 | 1.28 | – | 55% | 1.08x | 32.1 | 29.7 |" in text
    assert "| mtbench (chain:1) | 32 | 1.28 | – | – | 1.08x |" in text  # an uncut shape drafts every cycle


def test_engine_measured_results_get_their_own_row(tmp_path):
    folder, _ = canonical_dir(tmp_path)
    (folder / "eval_results.json").write_text(_results(weights_digest(folder), 1.17))  # our decoder
    engine = {"protocol": "vLLM spec-decode counters", "tau": 1.1667,
              "settings": {"engine": "vllm", "measured_by": "engine", "num_speculative_tokens": 3, "temperature": 0.0,
                           "benches": ["mtbench"], "drafter_weights_sha256": weights_digest(folder)},
              "overall": {"requests": 8, "tau": 1.1667, "acceptance_per_depth": [0.153, 0.076, 0.2],
                          "spec_tokens_per_s": 18.9, "baseline_tokens_per_s": 17.8, "speedup": 1.066,
                          "lossless": True}}
    (folder / "eval_results_vllm.json").write_text(json.dumps(engine))
    text = render_card(folder, repo_id="me/x").text
    assert "| mtbench (vllm engine, chain 3) | 8 | 1.17 | – | 1.07x | 18.9 | 17.8 | 0.15, 0.08, 0.20 | yes |" in text
    assert "| mtbench | 4 | 1.17 |" in text  # our decoder's row beside it
