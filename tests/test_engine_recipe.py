"""The recipe's `engine` section: one-line problems, all at once, before any work; what the shipped DeepSeek-V3 recipe
deploys (`fit --print-config`, `serve --print-command`); how a deployment's servers are started and pinned."""

from __future__ import annotations

import pytest
import yaml

from eagle3_zoo.cli import main
from eagle3_zoo.recipe.engine import replica_devices
from eagle3_zoo.recipe.sections import RecipeError, load_recipe, streams_features, target_sharded_in_trainer
from eagle3_zoo.targets.deployment import EngineDeployment, device_env, server_args

SMOL = "recipes/smollm2_135m.yaml"
VLLM = ["data.features_backend=vllm"]


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(RecipeError) as err:
        load_recipe(SMOL, overrides)
    return [f"{p.key}: {p.message}" for p in err.value.problems]


@pytest.mark.parametrize("overrides, expected", [
    (["engine.mode=attach"], "engine.mode: attach needs the servers' URLs in engine.urls"),
    (["engine.urls=[http://10.0.0.5:8000]"], "engine.urls: launch starts its own servers, but engine.urls lists"),
    (["engine.mode=attach", "engine.urls=[http://h:1]", *VLLM],
     "engine.hidden_states_dir: attach mode with data.features_backend: vllm needs the directory"),
    (["data.mode=hybrid"], "data.mode: hybrid (the first pass streams from the engine and writes the feature store) "
                           "needs data.features_backend: vllm"),
    (["engine.devices=0,1,2", "engine.replicas=2"], "engine.devices: 3 devices cannot be split evenly over 2"),
    (["engine.devices=2,3", "trainer.accelerator=gpu", "trainer.devices=4"],
     "engine.devices: GPUs [2, 3] are also the trainer's"),
    (["engine.devices=4,4"], "engine.devices: expected distinct device indices"),
    (["engine.mode=attach", "engine.urls=[http://h:1]", "engine.replicas=2"],
     "engine.replicas: replicas are started in launch mode only"),
    (["engine.max_model_len=512", *VLLM], "engine.max_model_len: must exceed data.max_length (512)"),
    (["engine.mode=attach", "engine.urls=[http://h:1,http://h:1]"], "engine.urls: the same server is listed twice"),
    (["engine.mode=attach", "engine.urls=[10.0.0.5:8000]"], "engine.urls[0]: expected a server root like"),
    (["engine.tensor_parallel_size=0"], "engine.tensor_parallel_size: must be > 0"),
    (["data.prefetch_disk_gib=0"], "data.prefetch_disk_gib: must be > 0"),
    (["engine.num_nodes=2", "engine.master_addr=10.0.0.5"], "engine.num_nodes: launch starts servers on this node "
                                                            "only; a server over several nodes is started by"),
    (["engine.mode=attach", "engine.urls=[http://h:1]", "engine.num_nodes=2"],
     "engine.master_addr: a server over 2 nodes needs node 0's address"),
    (["engine.mode=attach", "engine.urls=[http://h:1]", "engine.num_nodes=2", "engine.master_addr=h",
      "engine.tensor_parallel_size=3"], "engine.num_nodes: the server's 3 GPUs (tensor_parallel_size x "
                                        "data_parallel_size) cannot be split evenly over 2 nodes"),
    (["engine.master_addr='a b'"], "engine.master_addr: expected node 0's address or host name"),
    (["engine.master_port=0"], "engine.master_port: expected a TCP port in 1-65535"),
    (["engine.platform=tpu"], "engine.platform"),
    (["engine.platform=cpu", "engine.gpu_memory_utilization=0.9"], "engine.gpu_memory_utilization: is for GPU "
                                                                   "engines, but engine.platform is cpu"),
])
def test_engine_section_problems_are_one_line_each(overrides, expected):
    problems = _problems(overrides)
    assert any(p.startswith(expected) for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_all_engine_problems_come_at_once_and_credentials_are_not_echoed():
    with pytest.raises(RecipeError) as err:
        load_recipe(SMOL, ["engine.mode=attach", "engine.urls=[http://user:s3cret@h:1]", "data.mode=hybrid",
                           "engine.replicas=3"])
    text = str(err.value)
    assert "s3cret" not in text and "http://***@h:1" in text
    assert {p.key for p in err.value.problems} == {"engine.urls[0]", "data.mode", "engine.replicas"}


def test_deepseek_print_config_shows_the_engine_deployment(capsys):
    assert main(["fit", "recipes/deepseek_v3.yaml", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["engine"]["mode"] == "attach" and cfg["engine"]["urls"] == ["http://ENGINE_NODE:8000"]
    assert cfg["engine"]["tensor_parallel_size"] == 8 and cfg["engine"]["expert_parallel"] is True
    assert cfg["engine"]["quantization"] is None  # served as the checkpoint declares: FP8
    assert cfg["engine"]["hidden_states_dir"] and cfg["data"]["features_backend"] == "vllm"
    assert cfg["data"]["mode"] == "online" and cfg["data"]["regenerate"]["enabled"] is True
    assert cfg["data"]["regenerate"]["backend"] == "engine"  # the FP8 target answers in the engine, not the trainer
    recipe = load_recipe("recipes/deepseek_v3.yaml")
    # the trainer reads the heads only
    assert streams_features(recipe.data) and not target_sharded_in_trainer(recipe.data, recipe.trainer)


def test_serve_prints_the_engine_command_of_the_recipe(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the layer count comes from the shipped config
    assert main(["serve", "recipes/deepseek_v3.yaml", "--print-command", "--port", "8123", "--host", "0.0.0.0"]) == 0
    out = capsys.readouterr().out
    assert "--model deepseek-ai/DeepSeek-V3" in out and "--host 0.0.0.0 --port 8123" in out
    assert 'VLLM_API_KEY="$EAGLE3_ZOO_ENGINE_KEY"' in out  # the recipe's key variable, by name
    assert "--tensor-parallel-size 8" in out and "--enable-expert-parallel" in out and "--quantization" not in out
    assert '"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]' in out  # aux layers + the last (61 layers)
    # the context of a regeneration request: data.max_length 2048 + data.regenerate.max_new_tokens 2048
    assert "runs/deepseek_v3/engine/hidden_states" in out and "--max-model-len 4096" in out


def test_features_backend_vllm_alone_launches_one_server_as_before():
    recipe = load_recipe(SMOL, VLLM)
    d = EngineDeployment(recipe, (2, 15, 27), 30)
    assert d.mode == "launch" and replica_devices(recipe.engine) == [None] and d.max_model_len == 513
    assert str(d.storage).endswith("runs/smollm2_135m/engine/hidden_states") and d.dtype == "float32"
    assert server_args(recipe.engine, cuda=False) == []


def test_replicas_are_pinned_to_their_share_of_the_devices():
    recipe = load_recipe(SMOL, ["engine.replicas=2", "engine.devices=4,5,6,7", "engine.tensor_parallel_size=2",
                                "engine.expert_parallel=true", "engine.gpu_memory_utilization=0.8",
                                "engine.extra_args=[--max-num-seqs,'64']"])
    shares = replica_devices(recipe.engine)
    assert shares == [[4, 5], [6, 7]]
    assert device_env(shares[1], 2, cuda=True) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert device_env([0, 1], 2, cuda=False) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per TP rank
    assert device_env([1], 1, cuda=False) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert server_args(recipe.engine, cuda=True) == ["--tensor-parallel-size", "2", "--enable-expert-parallel",
                                                     "--gpu-memory-utilization", "0.8", "--max-num-seqs", "64"]
