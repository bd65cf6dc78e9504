import os

import pytest
import torch

# two shared cores: one intra-op thread per test process keeps the suite predictable
torch.set_num_threads(int(os.environ.get("EAGLE3_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
