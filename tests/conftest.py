import os

import pytest
import torch

# two shared cores: one intra-op thread per test process keeps the suite predictable
torch.set_num_threads(int(os.environ.get("EAGLE3_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def hf_target():
    """The embedded SmolLM2-135M-Instruct target in fp32, as the engine tier serves it (model, tokenizer, adapter)."""
    from eagle3_zoo.adapters import load_target

    return load_target("smollm2-135m-instruct", dtype=torch.float32)
