"""The model card shows only evaluation results measured on the folder's own weights: a rerun of `fit` keeps the
user's old eval_results*.json in the drafter folder, and their figures must not be presented as the new drafter's."""

from __future__ import annotations

import json
import logging

from eagle3_zoo.hub.card import card_variables
from eagle3_zoo.hub.weights import weights_digest
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
    assert "drafter_weights_sha256" not in card_variables(folder)["settings"]  # a digest is no setting to show

    edit_weights(folder, lambda s: s["norm.weight"].mul_(2))  # new weights, as a rerun of fit writes them
    with caplog.at_level(logging.WARNING):
        assert card_variables(folder).get("benchmarks") in (None, [])
    assert "measured on other weights" in caplog.text

    (folder / "eval_results.json").write_text(_results(None, 2.0))  # no digest (older eval): kept as it is
    assert [r["tau"] for r in card_variables(folder)["benchmarks"]] == ["2.00"]
