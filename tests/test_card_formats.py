"""One drafter, one evaluation, every export layout: each published card shows the same evaluation rows (the
results are tied to the weights, not to their layout), names only the engines that load the layout it ships, and
carries Hub metadata that parses offline (base_model, datasets, library_name, tags; no pipeline_tag)."""

from __future__ import annotations

import json
import logging
import re

import pytest
from huggingface_hub import ModelCard, ModelCardData

from eagle3_zoo.cli import main
from tests.hub_fixtures import edit_config
from tests.test_speculative_eval import _saved_target_and_drafter

RECIPE = """\
demo: false
target:
  name_or_path: smollm2-135m-instruct
data:
  sources:
  - path: sharegpt-embedded
  max_samples: 128
  max_length: 384
  regenerate:
    enabled: true
"""
PROVENANCE = {"created_unix": 1764619200, "git": {"sha": "0123456789abcdef0123", "dirty": False},
              "packages": {"eagle3-zoo": "0.1.0", "torch": "2.13.0+cpu"}, "python": "3.11.9",
              "training": {"global_step": 60, "epochs": 2, "wall_time_s": 203.5, "hardware": "2 CPU cores",
                           "final_metrics": {"val/acc_0": 0.15}}}


def _rows(text: str) -> list[str]:
    table = text.split("## Evaluation", 1)[1].split("## Training", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Benchmark")]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A drafter evaluated by `eagle3-zoo eval` (canonical layout), then given the embedded target's name and a
    recipe, as a quickstart run leaves it."""
    tmp = tmp_path_factory.mktemp("cards")
    _, drafter = _saved_target_and_drafter(tmp)
    for name, extra in (("eval_results", ["--mode", "tree", "--depth", "3", "--top-k", "2", "--total-tokens", "5"]),
                        ("eval_results_chain", ["--mode", "chain", "--depth", "2"])):
        assert main(["eval", str(drafter), "--bench", "mtbench", "--limit", "1", "--max-new-tokens", "6",
                     "--warmup", "0", "--no-progress", *extra, "--out", str(drafter / f"{name}.json")]) == 0
    edit_config(drafter, lambda c: c["eagle3_zoo"].update(target_name_or_path="smollm2-135m-instruct"))
    (drafter / "recipe.yaml").write_text(RECIPE)
    (drafter / "provenance.json").write_text(json.dumps(PROVENANCE))
    return tmp, drafter


@pytest.fixture(scope="module")
def cards(evaluated):
    """The card of a `publish --dry-run` of each layout, and what was logged while staging it."""
    tmp, drafter = evaluated
    out = {}
    for fmt in ("sglang", "speculators"):
        stage = tmp / f"stage-{fmt}"
        handler = _Collect()
        logging.getLogger().addHandler(handler)
        try:
            assert main(["publish", str(drafter), "--repo-id", "me/tiny-eagle3", "--format", fmt, "--dry-run",
                         "--stage-dir", str(stage)]) == 0
        finally:
            logging.getLogger().removeHandler(handler)
        out[fmt] = (ModelCard.load(stage / "README.md"), handler.messages, stage)
    return out


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_every_layout_shows_the_same_evaluation_rows(cards):
    rows = {fmt: _rows(card.text) for fmt, (card, _, _) in cards.items()}
    assert len(rows["sglang"]) == 2 and rows["speculators"] == rows["sglang"]  # MT-bench: tree, chain
    assert any("(chain 2)" in r for r in rows["sglang"]) and any("(tree 3/2/5)" in r for r in rows["sglang"])
    for fmt, (card, warnings, stage) in cards.items():
        assert not [w for w in warnings if "other weights" in w], (fmt, warnings)  # same weights, another layout
        assert "No evaluation results" not in card.text
        shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", card.text)
        assert shown == ["eval_results.png", "eval_results_chain.png"] and all((stage / p).is_file() for p in shown)


def test_each_card_names_only_the_engines_that_load_its_layout(cards):
    sglang, speculators = cards["sglang"][0].text, cards["speculators"][0].text
    assert "python -m sglang.launch_server" in sglang and "vllm serve" in sglang
    assert "python -m sglang.launch_server" not in speculators and "vllm serve" in speculators
    assert "SGLang does not load this layout" in speculators
    for text in (sglang, speculators):  # vLLM drafts chains: the snippet names the measured chain, 2 tokens
        assert '"num_speculative_tokens": 2' in text and "the shape *chain 2* evaluated below" in text
    # the speculators config's own draft length (export default 3) was not measured, and the card says so
    assert "drafts 3 tokens, a chain length whose acceptance this card does not show" in speculators


def test_card_metadata_parses_offline_with_the_hub_fields(cards):
    for fmt, (card, _, _) in cards.items():
        data = card.data.to_dict()
        assert ModelCardData(**data).to_dict() == data  # huggingface_hub's own parser, no network
        assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert data["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]  # a Hub id, not our alias
        assert data["library_name"] == "eagle3-zoo" and "pipeline_tag" not in data
        assert {"eagle3", "speculative-decoding", "draft-model", "eagle3-zoo", "vllm"} <= set(data["tags"])
        assert ("sglang" in data["tags"]) == (fmt == "sglang") and ("speculators" in data["tags"]) == (
            fmt == "speculators")
        assert all(re.fullmatch(r"[\w.-]+/[\w.-]+", d) for d in data["datasets"])


def test_card_is_compact_and_readable(cards):
    text = cards["sglang"][0].text
    provenance = text.split("## Provenance", 1)[1].split("## License", 1)[0]
    rows = [line for line in provenance.splitlines() if line.startswith("| ") and line != "| | |"]
    assert len(rows) <= 8 and "| Created | 2025-12-01 20:00 UTC |" in rows  # not a raw unix time
    assert "1764619200" not in text and '{"' not in provenance  # no raw JSON
    assert "| Code | commit 0123456789 |" in rows and "| Training time | 3 min 24 s |" in text
    assert re.search(r"\*\*Machine\.\*\* .*load average \(1 min\) during each run: tree 3/2/5: \d+\.\d\d at the start, "
                     r"\d+\.\d\d at the end; chain 2: \d", text)
