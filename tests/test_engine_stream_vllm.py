"""The `engine` tier for hidden states streamed to training: SmolLM2-135M-Instruct in real vLLM servers on loopback.

    bash scripts/test.sh -m engine

Two servers started outside the project (`eagle3-zoo serve`, one core each: data parallel 2) feed `fit` in attach
mode. Shown: a fit fed online equals a fit from the feature store the engine wrote (same sample order), and the
stored states equal HF's; a trainer SIGKILLed mid-epoch and a (launched) server SIGKILLed mid-epoch each resume to
the weights of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_fixtures import engine_venv  # noqa: F401 (the module's autouse fixture: the engine venv)
from safetensors.torch import load_file

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2_135m.yaml"
RTOL, ATOL = 1e-4, 1e-4  # the engine tier's bound (tests/test_engine_vllm.py): fp32, kernel summation orders
SMALL = ["data.regenerate.enabled=false", "data.mode=online", "data.max_samples=26", "data.max_length=96",
         "data.val_fraction=0.1", "drafter.draft_vocab_size=2048", "ttt.steps=3", "ttt.schedule=constant",
         "optim.warmup_steps=2", "trainer.max_steps=null", "trainer.max_epochs=1", "trainer.batch_size=2",
         "trainer.val_check_interval=null", "trainer.checkpoint_every_n_steps=3", "trainer.log_every_n_steps=1",
         "trainer.logger=[csv]", "data.features_dtype=float32", "data.features_backend=vllm",
         "engine.max_model_len=128", "engine.retries=3"]


def _env() -> dict[str, str]:
    from training_fixtures import subprocess_env

    env = subprocess_env(PYTHONPATH=str(ROOT), EAGLE3_ZOO_LOG_EVERY_S="0")  # a log line per step: kill_at
    env.setdefault("EAGLE3_ZOO_VLLM_PYTHON", os.environ.get("EAGLE3_ZOO_VLLM_PYTHON",
                                                           str(ROOT / ".venv-vllm" / "bin" / "python")))
    return env


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("stream")


@pytest.fixture(scope="module")
def servers(work):
    """Two hidden-states servers started the way a user starts them on an engine node, one core each."""
    from eagle3_zoo.targets.openai_client import OpenAIClient
    from eagle3_zoo.targets.server import free_port

    ports, procs = [free_port(), free_port()], []
    for core, port in enumerate(ports):
        log = open(work / f"serve-{core}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "eagle3_zoo.cli", "serve", str(RECIPE), *SMALL, f"engine.devices={core}",
             f"engine.hidden_states_dir={work / 'hs'}", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**_env(), "HF_HUB_OFFLINE": "1"}, start_new_session=True))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 900
    while not all(OpenAIClient(u).healthy() for u in urls):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (work / "serve-0.log").read_text()
        time.sleep(2)
    yield urls
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        p.wait(60)


def _attach(work: Path, urls: list[str]) -> list[str]:
    return ["engine.mode=attach", f"engine.urls=[{','.join(urls)}]", f"engine.hidden_states_dir={work / 'hs'}",
            f"data.cache_dir={work / 'cache'}", f"data.features_dir={work / 'store'}"]


def _fit(out: Path, *overrides: str, kill_at: str | None = None, victim=None) -> tuple[int, str]:
    """`fit` in a subprocess; with `kill_at`, `victim(process)` is called once that text appears in its log."""
    cmd = [sys.executable, "-m", "eagle3_zoo.cli", "fit", str(RECIPE), *SMALL, *overrides, f"output_dir={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if kill_at and kill_at in line:
            victim(proc)
            kill_at = None
    proc.wait(900)
    return proc.returncode, "".join(lines)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "drafter" / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def online(work, servers):
    code, log = _fit(work / "online", *_attach(work, servers))
    assert code == 0, log[-4000:]
    return _weights(work / "online"), log


def test_online_fit_from_two_servers_equals_the_fit_from_the_store_the_engine_wrote(work, servers, online):
    weights, log = online
    counts = json.loads(log.split("per server ", 1)[1].split("; ", 1)[0].replace("'", '"'))
    assert sorted(counts) == sorted(servers) and all(n > 0 for n in counts.values()), counts  # DP = 2 shared it
    code, offline_log = _fit(work / "offline", *_attach(work, servers), "data.mode=offline")
    assert code == 0, offline_log[-4000:]
    diff = _max_diff(weights, _weights(work / "offline"))
    print(f"online vs engine-written store: max |dw| = {diff:.3g}")
    assert diff <= 1e-6
    assert not list((work / "hs").glob("*.safetensors*"))  # nothing left behind by either run


def test_the_engine_written_store_equals_hf(work, online):
    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.data.features import FeatureReader

    model, _, adapter = load_target("smollm2-135m-instruct", dtype=torch.float32)
    reader = FeatureReader(work / "store", verify="hash")
    h, aux_ids = model.config.hidden_size, adapter.aux_layer_ids(model.config.num_hidden_layers)
    for i in range(0, len(reader), max(1, len(reader) // 4)):
        sample = reader[i]
        with torch.no_grad():
            ref = model(sample["input_ids"][None], output_hidden_states=True).hidden_states
        for j, k in enumerate(aux_ids):
            for t in range(sample["input_ids"].numel()):
                torch.testing.assert_close(sample["aux_hidden"][t, j * h:(j + 1) * h], ref[k][0, t], rtol=RTOL,
                                           atol=ATOL * max(1.0, float(ref[k][0, t].abs().max())))
        torch.testing.assert_close(sample["final_hidden"], ref[-1][0], rtol=RTOL, atol=ATOL)


def test_a_trainer_killed_mid_epoch_resumes_to_the_same_weights(work, servers, online):
    out = work / "killed-trainer"
    code, log = _fit(out, *_attach(work, servers), kill_at="step 5, ",
                     victim=lambda p: os.killpg(p.pid, signal.SIGKILL))
    assert code == -signal.SIGKILL and (out / "checkpoints" / "last.ckpt").exists(), log[-3000:]
    code, log = _fit(out, *_attach(work, servers))
    assert code == 0 and "resuming from" in log, log[-4000:]
    diff = _max_diff(online[0], _weights(out))
    print(f"trainer SIGKILLed at step 5, resumed: max |dw| = {diff:.3g}")
    assert diff <= 1e-6


def test_a_server_killed_mid_epoch_is_restarted_and_the_weights_are_the_same(work, online):
    out = work / "killed-server"

    def kill_server(_):
        storage = str(out / "engine" / "hidden_states")
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "vllm.entrypoints.openai.api_server" in cmdline and storage in cmdline:
                os.killpg(pid, signal.SIGKILL)  # the server this fit launched (its own process group)
                return
        raise AssertionError("the launched server was not found")

    code, log = _fit(out, f"data.cache_dir={work / 'cache'}", "engine.devices=0", kill_at="step 5, ",
                     victim=kill_server)
    assert code == 0, log[-4000:]
    assert "exited (code -9); restarting it (1 of 2" in log
    diff = _max_diff(online[0], _weights(out))
    print(f"server SIGKILLed at step 5, restarted: max |dw| = {diff:.3g}")
    assert diff <= 1e-6
