"""Benchmarks, the evaluate() report (JSON + PNG + table), the eval CLI function and the training callback."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch

from eagle3_zoo.adapters import get_adapter
from eagle3_zoo.cli import main as cli_main
from eagle3_zoo.speculative import PROTOCOL, TauEvalCallback, evaluate, format_table, load_benchmark
from eagle3_zoo.speculative.evaluation import EvalSettings, evaluate_shapes, format_shapes_table
from eagle3_zoo.values.draft_shapes import TreeSpec, parse_shapes
from tests.hub_fixtures import edit_config, edit_weights
from tests.test_speculative_support import OracleDraftModel, random_drafter, tiny_target


def test_builtin_benchmarks():
    mt = load_benchmark("mtbench")
    assert len(mt.prompts) == 80 and all(len(p.turns) == 2 and p.is_chat for p in mt.prompts)
    he = load_benchmark("humaneval", limit=5)
    assert len(he.prompts) == 5 and len(load_benchmark("humaneval").prompts) == 164
    assert he.prompts[0].id == "HumanEval/0"
    assert he.prompts[0].turns[0].startswith("Complete the following Python function:\n```python\n")
    assert he.prompts[0].turns[0].endswith("```")


def test_spread_subset_covers_every_mtbench_category():
    import collections
    import json

    from eagle3_zoo.speculative.benchmarks import mtbench_path

    category = {str(r["question_id"]): r["category"] for r in map(json.loads, open(mtbench_path()))}
    assert len(set(category.values())) == 8
    first = [category[p.id] for p in load_benchmark("mtbench", limit=16).prompts]
    assert set(first) == {"writing", "roleplay"}  # the first 16 are two categories only
    spread = load_benchmark("mtbench", limit=16, spread=True).prompts
    assert collections.Counter(category[p.id] for p in spread) == {c: 2 for c in set(category.values())}
    assert len({p.id for p in spread}) == 16
    he = load_benchmark("humaneval", limit=4, spread=True).prompts
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/123"]
    assert len({p.id for p in load_benchmark("humaneval", limit=500, spread=True).prompts}) == 164  # all, once
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("humaneval", limit=0)


def test_jsonl_benchmarks(tmp_path):
    path = tmp_path / "mine.jsonl"
    records = [{"turns": ["a", "b"]}, {"prompt": "def f(x):"},
               {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                             {"role": "assistant", "content": "x"}, {"role": "user", "content": "u2"}]},
               {"id": "sg", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    bench = load_benchmark(str(path))
    assert bench.name == "mine"
    p0, p1, p2, p3 = bench.prompts
    assert p0.turns == ("a", "b") and not p1.is_chat and p1.text == "def f(x):"
    assert p2.turns == ("u1", "u2") and p2.system == "S" and p3.id == "sg" and p3.turns == ("hi",)
    path.write_text('{"turns": ["ok"]}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:2: record has no usable prompt"):
        load_benchmark(str(path))
    with pytest.raises(ValueError, match="built-in: mtbench, humaneval"):
        load_benchmark("mtbenchh")


def _tiny_chat_target(context: int = 2048):
    """The tiny Qwen2 target and its chat tokenizer; `context` fits the longest built-in benchmark prompt (1,198
    tokens: prompts past the context are skipped) unless a test wants a short one."""
    adapter = get_adapter("qwen2")
    tokenizer = adapter.tiny_tokenizer()
    target = tiny_target("qwen2", max_position_embeddings=context)
    assert len(tokenizer) <= target.config.vocab_size
    return target, tokenizer, adapter


def test_evaluate_writes_json_and_plot(tmp_path):
    target, tokenizer, adapter = _tiny_chat_target()
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(json.dumps({"prompt": "The quick brown fox"}) + "\n")
    out = tmp_path / "res" / "results.json"
    settings = EvalSettings(f"mtbench,humaneval,{jsonl}", mode="tree", max_new_tokens=12, limit=2, depth=3, top_k=2,
                            total_tokens=6)
    results = evaluate(OracleDraftModel(target, "noisy"), target, tokenizer, settings, adapter=adapter, out=out,
                       progress=False, extra_settings={"drafter": "oracle"})
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(results))
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(saved) >= {"protocol", "settings", "machine", "versions", "benchmarks", "overall", "lossless"}
    assert saved["protocol"] == PROTOCOL and saved["lossless"] is True
    assert saved["settings"]["drafter"] == "oracle" and saved["settings"]["depth"] == 3
    assert saved["machine"]["torch_threads"] >= 1 and saved["versions"]["transformers"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    if head.returncode == 0:  # results name the commit they ran on (a checkout; None from an installed wheel)
        assert saved["versions"]["git"]["sha"] == head.stdout.strip()
    mt, he, extra = (saved["benchmarks"][k] for k in ("mtbench", "humaneval", "extra"))
    assert (mt["requests"], he["requests"], extra["requests"]) == (4, 2, 1)  # 2 questions x 2 turns
    assert [r["id"] for r in saved["requests"]["mtbench"]][:2] == ["81/turn1", "81/turn2"]
    # the second turn is conditioned on the first answer, so its prompt is longer
    assert saved["requests"]["mtbench"][1]["prompt_tokens"] > saved["requests"]["mtbench"][0]["prompt_tokens"]
    rows = {k: saved["requests"][k] for k in ("mtbench", "humaneval", "extra")}
    rows["overall"] = [r for k in ("mtbench", "humaneval", "extra") for r in rows[k]]
    for name, bench in (("mtbench", mt), ("humaneval", he), ("extra", extra), ("overall", saved["overall"])):
        # tau pools the requests' cycles (tokens per verification), and the noisy oracle's drafts are accepted often
        cycles = sum(r["cycles"] for r in rows[name])
        assert bench["cycles"] == cycles and bench["tau"] == pytest.approx(
            sum(r["tau"] * r["cycles"] for r in rows[name]) / cycles)
        assert bench["tau"] > 1.5 and bench["lossless"] is True
        assert bench["speedup"] == pytest.approx(bench["spec_tokens_per_s"] / bench["baseline_tokens_per_s"])
        assert all(0 <= r <= 1 for r in bench["acceptance_per_depth"] if r is not None)
    overall = saved["overall"]
    assert overall["requests"] == 7 and overall["cycles"] == mt["cycles"] + he["cycles"] + extra["cycles"]
    table = format_table(results)
    assert "overall" in table and "protocol:" in table and "acc@1" in table


def test_evaluate_sampling_reports_no_lossless_check(tmp_path):
    target, tokenizer, adapter = _tiny_chat_target()
    settings = EvalSettings(["humaneval"], mode="chain", temperature=0.8, max_new_tokens=6, limit=1, depth=2,
                            warmup=0, baseline=False)
    results = evaluate(random_drafter(target), target, tokenizer, settings, adapter=adapter, plot=tmp_path / "p.png",
                       progress=False)
    assert results["lossless"] is None and results["overall"]["speedup"] is None
    assert results["settings"]["top_k"] == 1 and (tmp_path / "p.png").is_file()


def eval_main(argv: list[str]) -> int:
    """`eagle3-zoo eval ARGV...` through the command line's one entry point."""
    return cli_main(["eval", *argv])


def _saved_target_and_drafter(tmp_path, context: int = 2048):
    """A tiny chat target and a random drafter naming it, saved as folders (what the CLI loads)."""
    target, tokenizer, _ = _tiny_chat_target(context)
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    drafter = random_drafter(target, draft_vocab_size=128)
    drafter.config.target_name_or_path = str(target_dir)
    drafter.save_pretrained(drafter_dir)
    return target_dir, drafter_dir


def test_eval_cli_end_to_end(tmp_path, capsys):
    target_dir, drafter_dir = _saved_target_and_drafter(tmp_path)
    out = tmp_path / "cli.json"
    code = eval_main([str(drafter_dir), "--bench", "mtbench", "--limit", "1", "--max-new-tokens", "8",
                      "--mode", "tree", "--depth", "3", "--top-k", "2", "--total-tokens", "5", "--out", str(out),
                      "--no-progress", "--strict"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "mtbench" in printed and "lossless" in printed
    saved = json.loads(out.read_text())
    assert saved["lossless"] is True and saved["benchmarks"]["mtbench"]["requests"] == 2
    assert saved["settings"]["target"] == str(target_dir) and out.with_suffix(".png").is_file()
    from eagle3_zoo.util.fileio import sha256_file

    assert saved["settings"]["drafter_weights_sha256"] == sha256_file(drafter_dir / "model.safetensors")
    assert eval_main([str(drafter_dir), "--bench", "nope", "--out", str(out)]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_eval_reads_a_drafter_in_the_speculators_format_as_its_canonical_twin(tmp_path):
    """`eval` takes any drafter format `check` accepts: the same weights exported for vLLM (speculators) decode
    exactly as the canonical folder (the same cycles, drafts and acceptances)."""
    from eagle3_zoo.checkpoint import export_drafter

    _, drafter_dir = _saved_target_and_drafter(tmp_path)
    spec_dir = export_drafter(drafter_dir, "speculators", tmp_path / "speculators")
    runs = {}
    for name, folder in (("canonical", drafter_dir), ("speculators", spec_dir)):
        out = tmp_path / f"{name}.json"
        assert eval_main([str(folder), "--bench", "mtbench", "--limit", "1", "--max-new-tokens", "8", "--out",
                          str(out), "--no-progress", "--strict", "--no-baseline"]) == 0
        runs[name] = json.loads(out.read_text())["benchmarks"]["mtbench"]
    keys = ("requests", "new_tokens", "cycles", "tau", "depth_attempts", "depth_accepts")
    assert {k: runs["speculators"][k] for k in keys} == {k: runs["canonical"][k] for k in keys}


def test_draft_shape_text_and_serving_flags():
    assert TreeSpec.parse("chain:3") == TreeSpec.chain(3) and TreeSpec.parse(" tree:8/10/60 ") == TreeSpec()
    assert TreeSpec.chain(3).label == "chain:3" and TreeSpec().label == "tree:8/10/60"
    assert TreeSpec(depth=8, top_k=1, total_tokens=3).label == "chain:3"  # a top-1 tree is the chain it is
    # SGLang counts the root among the draft tokens: a chain of K verifies K + 1, a 60-node tree 61
    assert TreeSpec.chain(3).serving_flags() == {"sglang_num_steps": 3, "sglang_topk": 1,
                                                 "sglang_num_draft_tokens": 4, "vllm_num_speculative_tokens": 3}
    assert TreeSpec().serving_flags()["sglang_num_draft_tokens"] == 61 and TreeSpec().verified_tokens == 61
    assert [s.label for s in parse_shapes("chain:1,tree:1/2/2")] == ["chain:1", "tree:1/2/2"]
    for bad in ("chain", "chain:0", "tree:8/10", "tree:8/0/60", "line:3", "chain:x"):
        with pytest.raises(ValueError, match=r"expected chain:K .* or tree:D/K/N"):
            TreeSpec.parse(bad)
    with pytest.raises(ValueError, match="duplicate draft shape"):
        parse_shapes("chain:3,tree:3/1/3")


def test_evaluate_shapes_shares_one_baseline_and_matches_single_shape_runs(tmp_path):
    target, tokenizer, adapter = _tiny_chat_target()
    draft = OracleDraftModel(target, "noisy")
    shapes = ["chain:1", "tree:3/2/6", "chain:3"]
    settings = EvalSettings("mtbench,humaneval", max_new_tokens=10, limit=1, warmup=0)
    kwargs = dict(adapter=adapter, progress=False)
    out = tmp_path / "shapes.json"
    results = evaluate_shapes(draft, target, tokenizer, shapes, settings, out=out, **kwargs)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [e["shape"] for e in results["shapes"]] == shapes and results["settings"]["shapes"] == shapes
    assert results["lossless"] is True and all(e["lossless"] is True for e in results["shapes"])
    assert [e["verified_tokens"] for e in results["shapes"]] == [2, 7, 4]
    # one plain-decoding run per request serves every shape
    base = [[r["baseline_seconds"] for b in e["requests"].values() for r in b] for e in results["shapes"]]
    assert len(base[0]) == 3 and base[0] == base[1] == base[2]
    speeds = {e["shape"]: e["overall"]["speedup"] for e in results["shapes"]}
    assert results["fastest"] == max(speeds, key=speeds.get)
    # each shape decodes exactly as a single-shape evaluation of it does (same cycles and acceptance)
    for entry, (mode, depth, top_k, total) in zip(results["shapes"], [("chain", 1, 1, 1), ("tree", 3, 2, 6),
                                                                       ("chain", 3, 1, 3)]):
        single = evaluate(draft, target, tokenizer, dataclasses.replace(settings, mode=mode, depth=depth, top_k=top_k,
                                                                        total_tokens=total), **kwargs)
        for key in ("cycles", "tau", "depth_accepts", "depth_attempts", "new_tokens"):
            assert entry["overall"][key] == single["overall"][key], (entry["shape"], key)
    assert {e["shape"]: e["overall"]["tau"] for e in results["shapes"]}["tree:3/2/6"] > 1  # the noisy oracle hits
    table = format_shapes_table(results)
    assert "tree:3/2/6" in table and "overall" in table and f"fastest here: {results['fastest']}" in table
    assert "--speculative-num-draft-tokens" in table
    slowest = {**results, "shapes": [{**e, "overall": {**e["overall"], "speedup": 0.5}} for e in results["shapes"]]}
    assert "plain decoding is faster still" in format_shapes_table(slowest)
    assert "plain decoding is faster still" not in format_shapes_table(
        {**results, "shapes": [{**e, "overall": {**e["overall"], "speedup": 1.5}} for e in results["shapes"]]})
    with pytest.raises(ValueError, match="distinct draft shapes"):
        evaluate_shapes(draft, target, tokenizer, ["chain:2", "tree:2/1/2"], EvalSettings("mtbench"), **kwargs)


def test_min_prob_cut_drafts_only_confident_nodes_and_stays_lossless():
    """The noisy oracle gives its top guess p ~ 0.39, its second ~ 0.24, any depth-2 path <= 0.16: a 0.3 cut keeps
    just the top first token (the tree decodes as chain 1 does), a 0.5 cut drafts nothing (one token per cycle)."""
    target, tokenizer, adapter = _tiny_chat_target()
    draft = OracleDraftModel(target, "noisy")
    results = evaluate_shapes(draft, target, tokenizer, ["chain:1", "tree:3/2/6@0.3", "chain:4@0.5"],
                              EvalSettings("mtbench", max_new_tokens=10, limit=1, warmup=0), adapter=adapter,
                              progress=False)
    chain1, cut, nothing = (e["overall"] for e in results["shapes"])
    assert results["lossless"] is True and results["shapes"][1]["min_prob"] == 0.3
    for key in ("cycles", "tau", "depth_accepts", "depth_attempts"):
        assert cut[key] == chain1[key], key
    assert chain1["tau"] > 1 and nothing["tau"] == 1.0 and nothing["depth_attempts"] == []
    assert nothing["cycles"] == nothing["new_tokens"] - 2  # 2 requests: each prefill gives one token, cycles one each


def test_eval_cli_shapes(tmp_path, capsys):
    _, drafter_dir = _saved_target_and_drafter(tmp_path)
    out = tmp_path / "sweep.json"
    args = [str(drafter_dir), "--bench", "humaneval", "--limit", "1", "--max-new-tokens", "6", "--warmup", "0",
            "--out", str(out), "--no-progress", "--strict"]
    assert eval_main([*args, "--shapes", "chain:2,tree:2/2/3"]) == 0
    printed = capsys.readouterr().out
    assert "chain:2" in printed and "tree:2/2/3" in printed and "fastest here:" in printed
    saved = json.loads(out.read_text())
    assert [e["shape"] for e in saved["shapes"]] == ["chain:2", "tree:2/2/3"] and saved["lossless"] is True
    assert eval_main([*args, "--mode", "chain", "--depth", "3", "--min-prob", "0.5"]) == 0
    saved = json.loads(out.read_text())
    assert saved["settings"]["min_prob"] == 0.5 and saved["settings"]["depth"] == 3 and saved["lossless"] is True
    assert "min_prob=0.5" in capsys.readouterr().out
    assert eval_main([*args, "--shapes", "chain:2", "--depth", "3"]) == 2
    assert "drop --depth or --shapes" in capsys.readouterr().err
    assert eval_main([*args, "--shapes", "tree:2/2"]) == 2
    err = capsys.readouterr().err
    assert "expected chain:K" in err and len(err.strip().splitlines()) == 1


class _Module(L.LightningModule):
    def __init__(self, target, drafter, tokenizer):
        super().__init__()
        self.drafter = drafter.requires_grad_(True).train()
        self._frozen = (target,)  # like DrafterModule: the frozen target is not a submodule
        self.tokenizer = tokenizer

    @property
    def target(self):
        return self._frozen[0]

    def training_step(self, batch, batch_idx):
        return sum(p.square().sum() for p in self.drafter.parameters()) * 1e-6

    def configure_optimizers(self):
        return torch.optim.SGD(self.drafter.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=1)


def test_tau_eval_callback_logs_val_tau():
    target, tokenizer, _ = _tiny_chat_target()
    module = _Module(target, random_drafter(target), tokenizer)
    callback = TauEvalCallback(["Hello, how are you?", [5, 6, 7, 8]], every_n_steps=2, max_new_tokens=6,
                               mode="chain", depth=3)
    trainer = L.Trainer(max_steps=4, callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module)
    assert callback.last["requests"] == 2
    # the figure is the tau of the module's drafter (after the last step) on these prompts, decoded independently
    from eagle3_zoo.speculative.generate import SpeculativeGenerator

    module.drafter.eval()
    generator = SpeculativeGenerator(target, module.drafter, callback.tree, None)
    outs = [generator.generate(ids, 6) for ids in callback._input_ids(module)]
    assert callback.last["tau"] == pytest.approx(sum(o.tau * o.cycles for o in outs) / sum(o.cycles for o in outs))
    module.drafter.train()
    assert float(trainer.callback_metrics["val/tau"]) == pytest.approx(callback.last["tau"])
    assert module.drafter.training  # restored after the evaluation
    with pytest.raises(ValueError, match="at least one prompt"):
        TauEvalCallback([])


def test_eval_parser_imports_no_torch():
    """`eagle3-zoo --help` builds the eval parser: it must stay instant."""
    import subprocess
    import sys

    from eagle3_zoo.cli.evaluate import BUILTIN_BENCHES, MODES
    from eagle3_zoo.speculative.benchmarks import BUILTIN
    from eagle3_zoo.speculative.generate import MODES as GENERATOR_MODES

    assert MODES == GENERATOR_MODES and BUILTIN_BENCHES == BUILTIN
    code = ("import argparse, sys; from eagle3_zoo.cli.evaluate import add_eval_arguments; "
            "add_eval_arguments(argparse.ArgumentParser()); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_lazy_exports_resolve_to_objects_not_submodules():
    import eagle3_zoo.speculative as spec
    import eagle3_zoo.speculative.generate  # noqa: F401  (submodules imported first must not shadow exports)

    assert all(not isinstance(getattr(spec, name), type(spec)) for name in spec.__all__)


def _truncate(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


@pytest.mark.parametrize("damage, code", [
    (_truncate, "CORRUPT_WEIGHTS"),
    (lambda d: edit_config(d, lambda c: c.update(hidden_size=48)), "SHAPE_MISMATCH"),  # config disagrees with weights
    (lambda d: edit_weights(d, lambda s: s.__setitem__("t2d", s["t2d"][:-10])), "VOCAB_MAP_SHAPE"),  # a short t2d
    (lambda d: edit_weights(d, lambda s: s["d2t"].__setitem__(-1, 10_000)), "D2T_OUT_OF_RANGE"),
])
def test_eval_refuses_an_invalid_drafter_with_the_check_codes(tmp_path, capsys, damage, code):
    _, drafter_dir = _saved_target_and_drafter(tmp_path)
    damage(drafter_dir)
    capsys.readouterr()  # the progress bars of saving the target
    out = tmp_path / "res.json"
    assert cli_main(["eval", str(drafter_dir), "--bench", "humaneval", "--limit", "1", "--max-new-tokens", "4",
                     "--warmup", "0", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {drafter_dir}: refusing to evaluate an invalid drafter: ") and f"{code}: " in err
    assert len(err.splitlines()) == 1 and "fix:" in err and not out.exists()


def test_eval_refuses_a_drafter_for_another_target(tmp_path, capsys):
    _, drafter_dir = _saved_target_and_drafter(tmp_path)
    _, tokenizer, _ = _tiny_chat_target()
    other = tmp_path / "wider-target"  # hidden 96 instead of the 64 the drafter was built for
    tiny_target("qwen2", hidden_size=96).save_pretrained(other)
    tokenizer.save_pretrained(other)
    capsys.readouterr()
    out = tmp_path / "res.json"
    assert eval_main([str(drafter_dir), "--target", str(other), "--bench", "humaneval", "--limit", "1",
                      "--max-new-tokens", "4", "--warmup", "0", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"refusing to evaluate with target {other} an invalid drafter: HIDDEN_SIZE_MISMATCH" in err
    assert not out.exists()


def test_requests_longer_than_the_context_are_skipped_counted_and_listed(tmp_path, caplog):
    target, tokenizer, adapter = _tiny_chat_target(context=256)
    long_text = "one two three four five six seven eight nine ten " * 40
    bench = tmp_path / "mixed.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in [
        {"id": "long", "prompt": long_text},
        {"id": "fits", "prompt": "The quick brown fox"},
        {"id": "chat", "turns": [long_text, "and then?"]},  # the second turn needs the first one's answer
    ]) + "\n")
    out = tmp_path / "res.json"
    caplog.set_level("WARNING")
    results = evaluate(OracleDraftModel(target, "noisy"), target, tokenizer,
                       EvalSettings(str(bench), mode="chain", depth=2, max_new_tokens=8), adapter=adapter, out=out,
                       progress=False)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(results))
    assert saved["benchmarks"]["mixed"]["requests"] == 1 and saved["benchmarks"]["mixed"]["skipped"] == 3
    assert saved["overall"]["requests"] == 1 and saved["overall"]["skipped"] == 3
    assert [r["id"] for r in saved["requests"]["mixed"]] == ["fits"]
    skipped = saved["skipped"]["mixed"]
    assert [r["id"] for r in skipped] == ["long", "chat/turn1", "chat/turn2"]
    assert skipped[0]["prompt_tokens"] + 8 > 256 and "exceed the target's context of 256 tokens" in skipped[0]["reason"]
    assert skipped[2]["reason"] == "turn 1 of this prompt was skipped"
    assert "skipping request long" in caplog.text and "skipped 3 of 4 requests" in caplog.text
    assert "skipped: 3 request(s)" in format_table(results)


def test_eval_with_no_request_that_fits_or_an_empty_benchmark_is_an_error(tmp_path, capsys):
    _, drafter_dir = _saved_target_and_drafter(tmp_path, context=256)
    long_only, empty = tmp_path / "long.jsonl", tmp_path / "empty.jsonl"
    long_only.write_text(json.dumps({"prompt": "one two three four five six seven eight " * 60}) + "\n")
    empty.write_text("\n\n")
    capsys.readouterr()
    out = tmp_path / "res.json"
    args = ["--max-new-tokens", "8", "--warmup", "0", "--no-progress", "--out", str(out)]
    assert eval_main([str(drafter_dir), "--bench", str(long_only), *args]) == 2
    err = capsys.readouterr().err
    assert f"no request of {long_only} fits the target's context of 256 tokens" in err and "1 skipped" in err
    assert eval_main([str(drafter_dir), "--bench", f"humaneval,{empty}", *args]) == 2
    assert f"error: {empty}: empty benchmark file" in capsys.readouterr().err
    assert not out.exists()
