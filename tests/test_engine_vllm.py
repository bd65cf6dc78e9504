"""The `engine` tier: the target in a real vLLM server on loopback (SmolLM2-135M-Instruct, CPU, fp32).

    bash scripts/test.sh -m engine          # installs .venv-vllm first (scripts/setup_engine.sh), then these tests

What it shows: vLLM's hidden states equal HF's (every aux layer and the final state, position by position);
regeneration through the server gives the HF backend's greedy answers; a server killed mid-regeneration loses and
duplicates nothing after a rerun; `eval --engine vllm` on a trained drafter reports engine-measured tau with greedy
equality against plain vLLM; regeneration in the recipe's engine (launch mode) writes the file the openai backend
writes; `check --engine vllm` loads and accepts, the speculators export as shipped too.
`EAGLE3_ZOO_ENGINE_DRAFTER=DIR` evaluates that drafter instead of training a small one here. An EAGLE-3.1 drafter
(fc_norm, norm_output) we wrote loads in vLLM and its counters equal our decoder's draft for draft
(`EAGLE3_ZOO_ENGINE_DRAFTER31=DIR` evaluates that one instead).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from engine_fixtures import engine_venv  # noqa: F401 (the module's autouse fixture: the engine venv)

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"
# fp32 on both sides; the only differences are kernel summation orders. Position 0 (the attention sink) holds
# activations of ~2.5e4 in SmolLM2's middle layers, so the bound is relative to each position's scale.
RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    from eagle3_zoo.targets.server import VLLMServer

    with VLLMServer(TARGET, log_path=tmp_path_factory.mktemp("vllm") / "plain.log") as server:
        yield server


def _conversations(n):
    from eagle3_zoo.data.readers import Conversation

    questions = ["What is the capital of France?", "Write a haiku about autumn.", "Explain recursion briefly.",
                 "List three prime numbers.", "How do I boil an egg?", "Name two planets.", "What is 12 times 7?",
                 "Give me a synonym for happy."]
    return [Conversation(id=f"e{i}", source="engine-test", index=i,
                         messages=[{"role": "user", "content": questions[i % len(questions)]},
                                   {"role": "assistant", "content": "old"}]) for i in range(n)]


def test_vllm_hidden_states_equal_hf(hf_target, tmp_path):
    from eagle3_zoo.targets.vllm_features import VLLMFeatureExtractor

    model, tok, adapter = hf_target
    aux_ids = adapter.aux_layer_ids(model.config.num_hidden_layers)
    texts = ["Hello there!", "The quick brown fox jumps over the lazy dog. " * 6]
    seqs = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    seqs = [s["input_ids"] if hasattr(s, "keys") else s for s in seqs]
    with VLLMFeatureExtractor(TARGET, aux_ids, log_path=tmp_path / "hs.log") as ex:
        got = [ex.features(s) for s in seqs]
    h = model.config.hidden_size
    for ids, (aux, final) in zip(seqs, got):
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert aux.shape == (len(ids), len(aux_ids) * h) and final.shape == (len(ids), h)
        for j, k in enumerate(aux_ids):
            for t in range(len(ids)):
                r = ref[k][0, t]
                scale = float(r.abs().max())
                torch.testing.assert_close(aux[t, j * h:(j + 1) * h], r, rtol=RTOL, atol=ATOL * max(1.0, scale),
                                           msg=lambda m, k=k, t=t: f"aux layer {k}, position {t}: {m}")
        torch.testing.assert_close(final, ref[-1][0], rtol=RTOL, atol=ATOL)


def test_vllm_regeneration_equals_hf_greedy(hf_target, plain_server, tmp_path):
    from eagle3_zoo.data.engine.regenerate_server import regenerate_with_client
    from eagle3_zoo.data.regenerate import regenerate_conversations

    model, tok, adapter = hf_target
    convs = _conversations(4)
    kw = dict(max_new_tokens=48, temperature=0.0)
    hf, _ = regenerate_conversations(convs, model, tok, adapter, tmp_path / "hf.jsonl", batch_size=1, **kw)
    served, stats = regenerate_with_client(convs, plain_server.client(), tok, adapter, tmp_path / "vllm.jsonl",
                                           concurrency=4, **kw)
    assert stats.generated == 4
    differ = [c.uid for c, d in zip(hf, served) if c.messages != d.messages]
    print(f"regeneration: {len(convs) - len(differ)}/{len(convs)} conversations identical to HF greedy")
    assert differ == []


def test_vllm_killed_mid_regeneration_resumes(hf_target, plain_server, tmp_path):
    from eagle3_zoo.data.engine.regenerate_server import regenerate_with_client
    from eagle3_zoo.targets.openai_client import OpenAIClient, ServerError
    from eagle3_zoo.targets.server import VLLMServer

    _, tok, adapter = hf_target
    convs = _conversations(8)
    path, kw = tmp_path / "answers.jsonl", dict(max_new_tokens=48, temperature=0.0, concurrency=2)
    with VLLMServer(TARGET, log_path=tmp_path / "victim.log") as victim:
        class KillingClient(OpenAIClient):
            """SIGKILLs the server's process group 0.5 s into the 4th completion (a request in flight)."""

            calls = 0

            def post(self, path, payload, **kwargs):
                KillingClient.calls += 1
                if KillingClient.calls == 4:
                    threading.Timer(0.5, os.killpg, (victim.proc.pid, signal.SIGKILL)).start()
                return super().post(path, payload, **kwargs)

        with pytest.raises(ServerError, match=r"of 8 conversations done this run are kept") as failure:
            regenerate_with_client(convs, KillingClient(victim.base_url, retries=1, backoff=0.5), tok, adapter,
                                   path, **kw)
    kept = path.read_text().count("\n")
    assert 1 <= kept < len(convs) and f"{kept} of 8 conversations done" in str(failure.value)
    out, stats = regenerate_with_client(convs, plain_server.client(), tok, adapter, path, **kw)
    assert (stats.reused, stats.generated) == (kept, len(convs) - kept)
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert sorted(ids) == sorted(c.uid for c in convs)  # nothing lost, nothing twice
    clean, _ = regenerate_with_client(convs, plain_server.client(), tok, adapter, tmp_path / "clean.jsonl", **kw)
    assert [c.messages for c in out] == [c.messages for c in clean]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    given = os.environ.get("EAGLE3_ZOO_ENGINE_DRAFTER")
    if given:
        return Path(given)
    return _fit_small(tmp_path_factory.mktemp("fit"), samples=32, steps=40)


def _fit_small(out: Path, samples: int, steps: int, extra: tuple[str, ...] = ()) -> Path:
    """A small offline run (features once, then drafter-only steps) on the original ShareGPT answers; its drafter."""
    overrides = ["data.regenerate.enabled=false", f"data.max_samples={samples}", "data.max_length=256",
                 f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                 f"trainer.checkpoint_every_n_steps={steps}", "optim.warmup_steps=5", "drafter.init_head=target",
                 f"output_dir={out}", f"data.cache_dir={out / 'cache'}", *extra]
    subprocess.run([sys.executable, "-m", "eagle3_zoo.cli", "fit", str(ROOT / "recipes" / "smollm2_135m.yaml"),
                    *overrides], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out / "drafter"


def test_eval_engine_vllm_greedy_equality(drafter_dir, plain_server, tmp_path):
    from eagle3_zoo.speculative.engine_eval import evaluate_in_vllm

    res = evaluate_in_vllm(drafter_dir, TARGET, "mtbench", num_speculative_tokens=3, max_new_tokens=48, limit=2,
                           baseline_url=plain_server.base_url, work_dir=tmp_path, out=tmp_path / "eval.json")
    o = res["overall"]
    print(f"engine eval: tau {o['tau']:.3f}, acceptance per position {o['acceptance_per_position']}")
    assert res["settings"]["measured_by"] == "engine" and res["settings"]["temperature"] == 0.0
    assert o["requests"] == 4 and o["drafts"] > 0 and o["draft_tokens"] == 3 * o["drafts"]
    assert len(o["acceptance_per_position"]) == 3
    assert o["lossless"] is True, o["lossless_mismatches"]
    assert json.loads((tmp_path / "eval.json").read_text())["overall"]["tau"] == o["tau"]


def test_check_engine_vllm(drafter_dir, capsys):
    from eagle3_zoo.cli import main

    assert main(["check", str(drafter_dir), "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "draft tokens accepted" in out and "FAILED" not in out


def test_check_engine_vllm_loads_the_speculators_export_as_shipped(drafter_dir, tmp_path):
    """The speculators folder goes to vLLM itself (no conversion back to canonical first) and accepts exactly what the
    canonical folder of the same weights accepts on the same prompts."""
    from eagle3_zoo.checkpoint import export_drafter
    from eagle3_zoo.speculative.engine_eval import engine_smoke

    spec = export_drafter(drafter_dir, "speculators", tmp_path / "speculators")
    shipped = engine_smoke(spec, TARGET, work_dir=tmp_path / "spec-work")
    canonical = engine_smoke(drafter_dir, TARGET, work_dir=tmp_path / "canon-work")
    print(shipped["message"])
    assert "loaded as shipped (speculators layout)" in shipped["message"] and shipped["ok"]
    assert not (tmp_path / "spec-work" / "drafter").exists()  # nothing was converted
    assert (shipped["accepted_tokens"], shipped["draft_tokens"]) == (canonical["accepted_tokens"],
                                                                     canonical["draft_tokens"])


def test_check_engine_vllm_fails_a_drafter_that_accepts_nothing(hf_target, tmp_path, capsys):
    """A loadable drafter whose weights are random: vLLM runs it, and accepts none of its tokens."""
    from eagle3_zoo.cli import main
    from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab

    model, _, adapter = hf_target
    config = Eagle3Config.from_target_config(model.config, draft_vocab_size=2048, target_name_or_path=TARGET,
                                             aux_layer_ids=adapter.aux_layer_ids(model.config.num_hidden_layers),
                                             torch_dtype="float32")
    drafter = Eagle3Drafter(config)
    drafter.set_vocab(*build_draft_vocab(torch.arange(model.config.vocab_size, 0, -1).float(), 2048))
    drafter.save_pretrained(tmp_path / "random")
    assert main(["check", str(tmp_path / "random"), "--engine", "vllm"]) == 1
    assert "FAILED: no draft token accepted" in capsys.readouterr().out


@pytest.fixture(scope="module")
def drafter31_dir(tmp_path_factory):
    """An EAGLE-3.1 drafter (fc_norm + norm_output) we trained and wrote; `EAGLE3_ZOO_ENGINE_DRAFTER31=DIR` instead."""
    given = os.environ.get("EAGLE3_ZOO_ENGINE_DRAFTER31")
    if given:
        return Path(given)
    return _fit_small(tmp_path_factory.mktemp("fit31"), samples=48, steps=80,
                      extra=("drafter.fc_norm=true", "drafter.norm_output=true"))


def _our_chain(drafter_dir, hf_target, depth, limit, max_new, without_fc_norm=False):
    """Our decoder's overall figures (chain of `depth`, greedy) on the MT-bench requests `evaluate_in_vllm` sends."""
    from eagle3_zoo.modeling import Eagle3Drafter
    from eagle3_zoo.speculative.evaluation import EvalSettings, evaluate

    model, tok, adapter = hf_target
    drafter = Eagle3Drafter.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    if without_fc_norm:  # the same weights served as another forward pass (an engine that ignored fc_norm)
        drafter.fc_norm = None
    settings = EvalSettings("mtbench", mode="chain", depth=depth, top_k=1, total_tokens=depth, temperature=0.0,
                            max_new_tokens=max_new, limit=limit, baseline=True, warmup=0)
    res = evaluate(drafter, model, tok, settings, adapter=adapter, out=None, plot=None, progress=False)
    return res["overall"]


def test_vllm_counts_an_eagle31_drafter_as_our_decoder_does(drafter31_dir, hf_target, plain_server, tmp_path):
    """vLLM loads the EAGLE-3.1 folder we wrote (fc_norm weights, norm_output) and its own spec-decode counters
    equal our decoder's on the same requests: the same number of drafts and, at every draft position, the same
    number of accepted tokens; both greedy outputs equal their engine's plain decoding."""
    cfg = json.loads((drafter31_dir / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    depth, limit, max_new = 3, 2, 48
    from eagle3_zoo.speculative.engine_eval import evaluate_in_vllm

    engine = evaluate_in_vllm(drafter31_dir, TARGET, "mtbench", num_speculative_tokens=depth, max_new_tokens=max_new,
                              limit=limit, baseline_url=plain_server.base_url, work_dir=tmp_path,
                              out=tmp_path / "eval31.json")["overall"]
    ours = _our_chain(drafter31_dir, hf_target, depth, limit, max_new)
    print(f"EAGLE-3.1 in vLLM: {engine['drafts']} drafts, accepted per position {engine['accepted_per_position']}; "
          f"ours: {ours['cycles']} cycles, accepted per depth {ours['depth_accepts']}, tau {ours['tau']:.3f}")
    assert engine["lossless"] is True and ours["lossless"] is True
    assert ours["requests"] == engine["requests"] == 2 * limit
    assert engine["accepted_tokens"] > 0  # a comparison of zeros would show nothing
    assert engine["drafts"] == ours["cycles"]
    accepted = ours["depth_accepts"] + [0] * (depth - len(ours["depth_accepts"]))
    assert engine["accepted_per_position"] == accepted[:depth]
    assert engine["tau"] == pytest.approx(ours["tau"], abs=1e-12)
    # the comparison separates forward passes: the same weights without fc_norm accept differently
    assert _our_chain(drafter31_dir, hf_target, depth, limit, max_new, without_fc_norm=True)["depth_accepts"] != \
        ours["depth_accepts"]


def test_regeneration_in_the_engine_launched_equals_the_openai_backend(hf_target, plain_server, tmp_path):
    """backend engine, launch mode: the deployment's server is started without the hidden-states method for the
    regeneration and stopped after it; its file equals the one backend openai writes against a plain server."""
    from eagle3_zoo.data.engine.regenerate_server import regenerate_for_recipe
    from eagle3_zoo.recipe.sections import load_recipe

    _, tok, adapter = hf_target
    convs = _conversations(3)
    common = ["data.regenerate.enabled=true", "data.regenerate.max_new_tokens=32", "target.dtype=float32",
              f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    openai = load_recipe(ROOT / "recipes" / "smollm2_135m.yaml", [*common, "data.regenerate.backend=openai",
                                                                  f"data.regenerate.base_url={plain_server.base_url}"])
    engine = load_recipe(ROOT / "recipes" / "smollm2_135m.yaml", [*common, "data.regenerate.backend=engine"])
    ref, _ = regenerate_for_recipe(openai, convs, tok, adapter, tmp_path / "openai.jsonl")
    out, stats = regenerate_for_recipe(engine, convs, tok, adapter, tmp_path / "engine.jsonl")
    assert stats.generated == 3
    assert (tmp_path / "engine.jsonl").read_bytes() == (tmp_path / "openai.jsonl").read_bytes()
    log = (tmp_path / "run" / "engine" / "regenerate-server-0.log").read_text()
    assert "extract_hidden_states" not in log  # vLLM logs its non-default arguments: a plain server
    assert not list((tmp_path / "run" / "engine").glob("hidden_states*"))  # no hidden-states store made


# the engine venv's python reads what `serve` prints with vLLM's own command-line parser
_PARSE = """
import shlex, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
for line in sys.stdin:
    words = shlex.split(line)
    args = words[words.index("-m") + 2:]
    args = args[1:] if args[:1] == ["serve"] else args  # the worker runs vLLM's `serve` command
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    print(ns.model, ns.headless, ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.tensor_parallel_size,
          ns.data_parallel_size, ns.enable_expert_parallel, ns.host)
"""


def test_the_two_node_serve_commands_are_what_vllms_cli_reads(monkeypatch):
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.targets.deployment import serve_recipe
    from eagle3_zoo.targets.engine import vllm_python

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = load_recipe(ROOT / "recipes" / "deepseek_v3.yaml", ["engine.num_nodes=2", "engine.data_parallel_size=2",
                                                                 "engine.gpu_memory_gb=80", "engine.master_addr=h0"])
    lines = [serve_recipe(recipe, "0.0.0.0", 8000, dry_run=True, node_rank=r) for r in (0, 1)]
    out = subprocess.run([str(vllm_python()), "-c", _PARSE], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, timeout=600, check=True).stdout.splitlines()
    assert out == ["deepseek-ai/DeepSeek-V3 False 2 0 h0 29501 8 2 True 0.0.0.0",
                   "deepseek-ai/DeepSeek-V3 True 2 1 h0 29501 8 2 True None"]


_WRITE = """
import os, sys, torch
import eagle3_zoo_hs_connector as c
from safetensors.torch import load_file

class Copied:  # the CUDA event of the device-to-host copy, already complete
    def synchronize(self):
        pass

assert issubclass(c.CPUHiddenStatesConnector, c.AtomicHiddenStatesConnector)
states = {"hidden_states": torch.randn(5, 4, 8), "token_ids": torch.arange(5)}
c.AtomicHiddenStatesConnector._write_tensors(states, Copied(), sys.argv[1], None)
assert all(torch.equal(load_file(sys.argv[1])[k], v) for k, v in states.items())
print(sorted(os.listdir(os.path.dirname(sys.argv[1]))))
"""


def test_the_gpu_connectors_writer_hands_its_file_over_by_rename(tmp_path):
    """The GPU build's connector (vLLM's asynchronous writer threads) loads against this vLLM (its writer's
    signature is checked at import) and its writer leaves only the final name (no CUDA here: the copy's event is a
    stand-in)."""
    from eagle3_zoo.targets.engine import PLUGIN_DIR, vllm_python

    path = tmp_path / "cmpl-x-0-ab12.safetensors"
    out = subprocess.run([str(vllm_python()), "-c", _WRITE, str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(PLUGIN_DIR)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"['{path.name}']"
