"""`eagle3-zoo eval` (our own decoder) and `DrafterFolder.evaluate` of a block drafter: the decoder is the one the
drafter's kind names (`DrafterKind.decoding` "block"), so a DFlash folder written by `fit` is decoded by
`DFlashGenerator` and reports the tau, acceptance per position and per-request figures that `DFlashGenerator` run
directly gives, lossless against plain greedy decoding; the tree options and sampling are refused naming the option;
a DSpark drafter goes through the same path (its kind's `DSparkProposer`)."""

from __future__ import annotations

import json

import pytest
import torch
from test_dflash_fit import _fit, write_counting_jsonl
from training_fixtures import save_tiny_target

from eagle3_zoo.cli import main as cli_main

PROMPTS = ["Count on.", "Count on, please.", "Hello, how are you today?"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny target, a DFlash folder `fit` wrote for it (block 4), and a JSONL benchmark of completion prompts."""
    tmp = tmp_path_factory.mktemp("dflash_eval")
    target = save_tiny_target(tmp / "target")
    data = write_counting_jsonl(tmp / "count.jsonl")
    torch.set_num_threads(1)
    folder = _fit(tmp, target, data, "run", "trainer.max_steps=20")
    bench = tmp / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"id": f"p{i}", "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    return tmp, target, folder, bench


def _input_ids(target, tok, bench):
    """The benchmark's chat prompts rendered as the evaluation renders them."""
    from eagle3_zoo.adapters import adapter_for
    from eagle3_zoo.speculative.benchmarks import load_benchmark, prompt_chat_format
    from eagle3_zoo.speculative.evaluation import turn_input_ids

    fmt = prompt_chat_format(adapter_for(target), tok)
    return [turn_input_ids(p, 0, [], tok, fmt) for p in load_benchmark(str(bench)).prompts]


def _direct(target_dir, folder, bench):
    """Every prompt of the benchmark decoded by `DFlashGenerator` itself (the target's stop ids, as eval uses)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from eagle3_zoo.drafters.dflash.model import DFlashDrafter
    from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
    from eagle3_zoo.speculative.generate import eos_ids

    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    gen = DFlashGenerator(target, DFlashDrafter.from_pretrained(folder).eval())
    stop = eos_ids(target, None) or eos_ids(target, tok.eos_token_id)
    return [gen.generate(ids, MAX_NEW, stop) for ids in _input_ids(target, tok, bench)]


def _same_as_direct(results, direct, block_size):
    rows = results["requests"]["prompts"]
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"]
    for row, out in zip(rows, direct):
        assert (row["new_tokens"], row["cycles"]) == (len(out.tokens), out.cycles)
        assert row["tau"] == pytest.approx(out.tau) and row["matches_baseline"] is True
    pooled = sum(a + 1 for o in direct for a in o.accept_lengths) / sum(o.cycles for o in direct)
    overall = results["overall"]
    assert overall["tau"] == pytest.approx(pooled)
    assert results["lossless"] is True and overall["speedup"] is not None
    assert len(overall["acceptance_per_depth"]) <= block_size - 1 and overall["acceptance_per_depth"]
    s = results["settings"]
    assert s["mode"] == "block" and s["drafter_kind"] == "dflash" and s["block_size"] == block_size
    assert s["depth"] == block_size - 1


def test_eval_cli_of_a_fitted_dflash_folder_reports_what_dflash_generator_measures(fitted, capsys):
    tmp, target_dir, folder, bench = fitted
    out = tmp / "cli.json"
    code = cli_main(["eval", str(folder), "--target", str(target_dir), "--bench", str(bench), "--device", "cpu",
                     "--max-new-tokens", str(MAX_NEW), "--out", str(out), "--no-progress", "--strict"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "mode=block depth=3" in printed and "prompts" in printed
    saved = json.loads(out.read_text())
    direct = _direct(target_dir, folder, bench)
    _same_as_direct(saved, direct, block_size=4)
    assert saved["settings"]["drafter_tensors_sha256"] and out.with_suffix(".png").is_file()
    # a model card labels these figures by the block, not as a tree of the stored depth/top_k/total_tokens
    from eagle3_zoo.hub.card_rows import draft_shape
    from eagle3_zoo.hub.records import read_eval_record

    assert draft_shape(read_eval_record(out)) == "block of 3 drafted tokens"


def test_drafter_folder_evaluate_of_a_dflash_folder(fitted):
    from eagle3_zoo.api import DrafterFolder
    from eagle3_zoo.speculative.evaluation import EvalSettings

    tmp, target_dir, folder, bench = fitted
    f = DrafterFolder.open(folder)
    results = f.evaluate(str(target_dir), EvalSettings(benches=(str(bench),), max_new_tokens=MAX_NEW), device="cpu",
                         progress=False)
    _same_as_direct(results, _direct(target_dir, folder, bench), block_size=4)
    with pytest.raises(ValueError, match=r"tree options depth=3 do not apply"):
        f.evaluate(str(target_dir), EvalSettings(benches=(str(bench),), depth=3), device="cpu", progress=False)
    with pytest.raises(ValueError, match="greedily only"):
        f.evaluate(str(target_dir), EvalSettings(benches=(str(bench),), temperature=0.7), device="cpu",
                   progress=False)
    with pytest.raises(ValueError, match="no draft shapes to compare"):
        f.evaluate(str(target_dir), EvalSettings(benches=(str(bench),)), shapes=["chain:3"], device="cpu",
                   progress=False)


def test_eval_takes_the_block_proposer_from_the_drafters_kind(fitted, monkeypatch):
    """The evaluation drives whatever `block_proposer` the kind returns: with a proposer that drafts the target's
    own greedy continuation right for a planned number of tokens per cycle, the accepted lengths, tau and acceptance
    per position are the plan's, as `DFlashGenerator` run directly on the same proposer reports them."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from eagle3_zoo.drafters import get_kind
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter
    from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
    from eagle3_zoo.speculative.evaluation import EvalSettings, evaluate
    from eagle3_zoo.speculative.generate import plain_generate
    from tests.test_dflash_decode import PlannedOracle

    tmp, target_dir, folder, bench = fitted
    one = tmp / "one.jsonl"
    one.write_text(json.dumps({"id": "p0", "turns": [PROMPTS[0]]}) + "\n")
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    (ids,) = _input_ids(target, tok, one)
    sequence = ids.tolist() + plain_generate(target, ids, MAX_NEW + 8, eos_token_id=[]).tokens
    plan = [3, 1, 0, 2]
    kind = get_kind("dflash")
    made = []

    def oracle(drafter, embed_weight, lm_head_weight):
        made.append(PlannedOracle(sequence, drafter.config.block_size - 1, plan, drafter.config.vocab_size))
        return made[-1]

    monkeypatch.setattr(type(kind), "block_proposer", lambda self, *a: oracle(*a))
    drafter = DFlashDrafter.from_pretrained(folder).eval()
    settings = EvalSettings(benches=(str(one),), max_new_tokens=MAX_NEW, eos_token_id=[], warmup=0)
    results = evaluate(drafter, target, tok, settings, progress=False)
    assert len(made) == 1
    direct = DFlashGenerator(target, oracle(drafter, None, None), layer_ids=drafter.config.aux_layer_ids)
    out = direct.generate(ids, MAX_NEW, [])
    assert out.accept_lengths[:4] == plan  # the plan, cycle by cycle (the last cycle may be cut by the length)
    row = results["requests"]["one"][0]
    assert (row["new_tokens"], row["cycles"]) == (len(out.tokens), out.cycles) == (MAX_NEW, out.cycles)
    assert results["overall"]["tau"] == pytest.approx(sum(a + 1 for a in out.accept_lengths) / out.cycles)
    assert results["overall"]["tau"] > 2 and results["lossless"] is True
    assert results["overall"]["acceptance_per_depth"][0] == pytest.approx(3 / 4, abs=0.1)


@pytest.mark.parametrize("flags, named", [
    (["--depth", "3"], "--depth"), (["--mode", "chain", "--top-k", "2"], "--mode, --top-k"),
    (["--min-prob", "0.2"], "--min-prob"), (["--shapes", "chain:1,tree:1/2/2"], "--shapes"),
    (["--temperature", "0.5"], "greedily only: drop --temperature 0.5"),
])
def test_eval_cli_refuses_tree_options_and_sampling_for_a_dflash_folder(fitted, capsys, flags, named):
    tmp, target_dir, folder, bench = fitted
    code = cli_main(["eval", str(folder), "--target", str(target_dir), "--bench", str(bench), "--device", "cpu",
                     "--out", str(tmp / "refused.json"), "--no-progress", *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert "dflash drafter" in err and named in err
    assert not (tmp / "refused.json").exists()


def test_evaluate_decodes_a_dspark_drafter_through_its_kind(tmp_path):
    """`speculative.evaluate` of a (random) DSpark drafter: the kind's `DSparkProposer` behind the block decoder,
    the same tokens and cycles as `DSparkGenerator`, lossless."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from eagle3_zoo.speculative.dspark_decode import DSparkGenerator
    from eagle3_zoo.speculative.evaluation import EvalSettings, evaluate
    from tests.test_dspark_decode import dspark_drafter

    target_dir = save_tiny_target(tmp_path / "target")
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    bench = tmp_path / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"id": f"p{i}", "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    drafter = dspark_drafter(target, block_size=3)
    results = evaluate(drafter, target, tok, EvalSettings(benches=(str(bench),), max_new_tokens=16), progress=False)
    gen = DSparkGenerator(target, drafter)
    direct = [gen.generate(ids, 16, results["settings"]["eos_token_ids"]) for ids in _input_ids(target, tok, bench)]
    rows = results["requests"]["prompts"]
    assert [(r["new_tokens"], r["cycles"]) for r in rows] == [(len(o.tokens), o.cycles) for o in direct]
    assert results["lossless"] is True and results["settings"]["block_size"] == 3
    assert results["settings"]["depth"] == 3  # every slot of a DSpark block drafts, the anchor's included
