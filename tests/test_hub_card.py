"""Model cards rendered from the packaged template: metadata, tau table, plot, training details; parse back."""

from __future__ import annotations

import json

import jinja2
from huggingface_hub import ModelCard

from eagle3_zoo.checkpoint.convert import extra_files
from eagle3_zoo.hub import render_card
from eagle3_zoo.hub.card import template_text
from tests.hub_fixtures import canonical_dir

# TEST DATA: shaped like eagle3_zoo.speculative.evaluate's output; the numbers are made up for this test.
EVAL_RESULTS = {
    "_note": "test data written by tests/test_hub_card.py, not a measurement",
    "protocol": "tau = tokens per verification cycle (accepted draft tokens + 1 bonus token), pooled",
    "settings": {"mode": "tree", "depth": 6, "top_k": 8, "total_tokens": 48, "temperature": 0.0,
                 "max_new_tokens": 128, "benches": ["mtbench", "humaneval"], "eos_token_ids": [2]},
    "benchmarks": {
        "mtbench": {"requests": 160, "tau": 3.2146, "tau_per_request_mean": 3.1, "speedup": 1.874,
                    "spec_tokens_per_s": 51.27, "baseline_tokens_per_s": 27.36,
                    "acceptance_per_depth": [0.81, 0.66, 0.52, None], "lossless": True},
        "humaneval": {"requests": 164, "tau": 3.9, "tau_per_request_mean": 3.8, "speedup": None,
                      "acceptance_per_depth": [0.88, 0.74]},
    },
    "overall": {"requests": 324, "tau": 3.55, "lossless": True},
    "machine": {"platform": "Linux-x86_64", "device": "cpu", "cpu_count": 2},
}
RECIPE = """\
target:
  name_or_path: tiny-org/tiny-llama
  family: llama
drafter:
  draft_vocab_size: 64
data:
  sources:
  - path: tiny-org/tiny-chats
  - path: local/chats.jsonl
  max_samples: 2000
  max_length: 512
  regenerate:
    enabled: false
ttt:
  steps: 7
  schedule: ramp
optim:
  lr: 0.0003
  warmup_steps: 20
  decay: cosine
trainer:
  max_steps: 400
  batch_size: 4
  devices: 1
  precision: 32-true
"""
PROVENANCE = {"git_sha": "0123abc", "target": "tiny-org/tiny-llama", "hardware": "2 CPU cores",
              "train_time_s": 512.4, "global_step": 400, "versions": {"torch": "2.13", "transformers": "5.24"}}


def test_card_has_metadata_tau_table_plot_and_training(tmp_path):
    src, _ = canonical_dir(tmp_path)
    (src / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))
    (src / "eval_results.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (src / "recipe.yaml").write_text(RECIPE)
    (src / "provenance.json").write_text(json.dumps(PROVENANCE))

    card = render_card(src, repo_id="me/tiny-eagle3", tags=("tiny",), published=True)
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")  # parses back (YAML header + body)
    data = loaded.data.to_dict()
    assert data["base_model"] == "tiny-org/tiny-llama"
    # no pipeline_tag: a draft head is no text-generation model the Hub's widget could run
    assert data["library_name"] == "eagle3-zoo" and "pipeline_tag" not in data
    assert {"eagle3", "speculative-decoding", "llama", "tiny", "sglang", "vllm"} <= set(data["tags"])
    assert data["datasets"] == ["tiny-org/tiny-chats"] and data["license"] == "apache-2.0"

    text = loaded.text
    assert "| mtbench | 160 | 3.21 | 3.10 | 1.87x | 51.3 | 27.4 | 0.81, 0.66, 0.52, – | yes |" in text  # plain tok/s
    assert "on a shared machine they are lower" in text and "**Machine.** Linux-x86_64 (cpu, 2 cores)" in text
    assert "| humaneval | 164 | 3.90 | 3.80 | – | – | – | 0.88, 0.74 | – |" in text
    assert "| all (pooled) | 324 | 3.55 |" in text
    assert "![Acceptance per draft depth, tree 6/8/48 on mtbench, humaneval, 324 requests](eval_results.png)" in text
    assert "tau = tokens per target forward pass" in text and "depth: 6" in text
    assert "--speculative-num-steps 6 --speculative-eagle-topk 8 --speculative-num-draft-tokens 49" in text  # + root
    assert "(the draft shape *tree 6/8/48* evaluated below)" in text
    # vLLM drafts chains: no chain was measured, so no num_speculative_tokens is named
    assert "num_speculative_tokens" not in text.replace("names no `num_speculative_tokens`", "")
    assert "--model-path tiny-org/tiny-llama" in text
    assert "| Training-time test | 7 steps (ramp) |" in text and "| Hardware | 2 CPU cores |" in text
    assert "| Training time | 8 min 32 s |" in text and "| Steps | 400 |" in text
    assert "| Software | torch 2.13, transformers 5.24 |" in text and "```yaml\ntarget:" in text
    assert "HF hidden-state indices [2, 4, 5] (SGLang eagle_config: [1, 3, 4])" in text


def test_card_shows_every_eval_run_labelled_by_draft_shape(tmp_path):
    src, _ = canonical_dir(tmp_path)
    (src / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))
    chain = {**EVAL_RESULTS, "settings": {**EVAL_RESULTS["settings"], "mode": "chain", "depth": 7},
             "benchmarks": {"mtbench": {"requests": 40, "tau": 3.05, "speedup": 2.11, "lossless": True}}}
    (src / "eval_results_chain.json").write_text(json.dumps(chain))
    text = render_card(src, repo_id="me/tiny-eagle3").text
    assert "| mtbench (tree 6/8/48) | 160 | 3.21 |" in text
    assert "| humaneval (tree 6/8/48) | 164 | 3.90 |" in text
    assert "| mtbench (chain 7) | 40 | 3.05 | – | 2.11x |" in text
    assert "eval_results_chain.json" in [p.name for p in extra_files(src)]  # uploaded with the card
    # the serving snippets name shapes the table shows: vLLM the measured chain, SGLang the tree with the best tau
    assert '"num_speculative_tokens": 7' in text and "7 tokens, the shape *chain 7* evaluated below" in text
    assert "--speculative-num-steps 6 --speculative-eagle-topk 8" in text and "*tree 6/8/48* evaluated" in text
    # an `eval --shapes` comparison: one row per shape
    shapes = {"protocol": "p", "settings": {"shapes": ["chain:1", "tree:8/10/60@0.2"]}, "fastest": "chain:1",
              "shapes": [{"shape": "chain:1",
                          "benchmarks": {"mtbench": {"requests": 32, "tau": 1.34, "speedup": 1.08}}},
                         {"shape": "tree:8/10/60@0.2",
                          "benchmarks": {"mtbench": {"requests": 32, "tau": 1.36, "speedup": 1.07}}}]}
    (src / "eval_results_shapes.json").write_text(json.dumps(shapes))
    (src / "eval_results_shapes.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    text = render_card(src, repo_id="me/tiny-eagle3").text
    assert "![Tau and speedup per draft shape (chain:1, tree:8/10/60@0.2) on the benchmarks]" \
           "(eval_results_shapes.png)" in text
    assert "| mtbench (chain:1) | 32 | 1.34 | – | 1.08x |" in text
    assert "| mtbench (tree:8/10/60@0.2) | 32 | 1.36 | – | 1.07x |" in text
    assert "| mtbench (chain 7) | 40 | 3.05 |" in text


def test_unpublished_card_points_its_snippets_at_the_folder_not_at_a_repo(tmp_path):
    src, _ = canonical_dir(tmp_path)
    (src / "eval_results.json").write_text(json.dumps({**EVAL_RESULTS, "settings": {
        **EVAL_RESULTS["settings"], "mode": "chain", "depth": 3}}))
    snippets = ("--speculative-draft-model-path {} ", '"model": "{}", "num_speculative_tokens"')
    for text in (render_card(src, repo_id="me/tiny-eagle3").text, render_card(src).text):  # a dry run; no repo
        assert all(s.format(src) in text for s in snippets)
        assert not any(s.format(name) in text for s in snippets for name in ("me/tiny-eagle3", "ORG/NAME"))
        assert "> **Not on the Hub.**" in text and "publish DRAFTER --repo-id YOUR_ORG/NAME` has uploaded it" in text
    planned = render_card(src, repo_id="me/tiny-eagle3").text
    assert "so `me/tiny-eagle3`, the repo id it was rendered for, may not exist" in planned
    published = render_card(src, repo_id="me/tiny-eagle3", published=True).text  # uploaded to that repo with it
    assert all(s.format("me/tiny-eagle3") in published for s in snippets)
    assert "Not on the Hub" not in published and str(src) not in published


def test_card_settings_leave_out_the_local_drafter_path(tmp_path):
    src, _ = canonical_dir(tmp_path)
    results = {**EVAL_RESULTS, "settings": {**EVAL_RESULTS["settings"], "drafter": "/home/me/runs/x/drafter"}}
    (src / "eval_results.json").write_text(json.dumps(results))
    text = render_card(src, repo_id="me/tiny-eagle3").text
    assert "max_new_tokens: 128" in text and "/home/me" not in text


def test_card_reads_the_training_section_fit_writes(tmp_path):
    src, _ = canonical_dir(tmp_path)
    (src / "recipe.yaml").write_text(RECIPE)
    (src / "provenance.json").write_text(json.dumps({"training": {
        "global_step": 1000, "wall_time_s": 4991.1, "hardware": "Intel(R) Xeon(R) Processor, 2 cores, 2 threads"}}))
    text = render_card(src, repo_id="me/tiny-eagle3").text
    assert "| Steps | 1000 |" in text and "| Training time | 1 h 23 min |" in text
    assert "| Hardware | Intel(R) Xeon(R) Processor, 2 cores, 2 threads |" in text


def test_bare_checkpoint_gets_a_valid_card(tmp_path):
    src, _ = canonical_dir(tmp_path, target_name_or_path="smollm2-135m-instruct")
    card = render_card(src)
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert loaded.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded target's Hub id (zoo)
    assert "No evaluation results were recorded" in loaded.text
    assert "SGLang picks its own, whose acceptance this card does not show" in loaded.text
    assert "speculative-num-steps" not in loaded.text and "no chain was evaluated" in loaded.text
    assert "--model-path HuggingFaceTB/SmolLM2-135M-Instruct" in loaded.text


def test_every_template_variable_has_a_default():
    text = jinja2.Template(template_text(), undefined=jinja2.StrictUndefined).render()  # no variable at all
    assert "ORG/NAME" in text and "EAGLE-3 drafter" in text
