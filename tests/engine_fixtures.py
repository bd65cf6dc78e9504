"""The engine venv fixture the engine-tier files share (built by scripts/setup_engine.sh unless
EAGLE3_ZOO_VLLM_PYTHON names one); a file imports it by name, which makes it that module's autouse fixture. The fp32
SmolLM2 target they serve (`hf_target`) is in conftest.py."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def engine_venv():
    if not os.environ.get("EAGLE3_ZOO_VLLM_PYTHON"):
        start = time.monotonic()
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_engine.sh")], check=True)
        print(f"engine venv ready ({time.monotonic() - start:.0f} s)")
        os.environ["EAGLE3_ZOO_VLLM_PYTHON"] = str(ROOT / ".venv-vllm" / "bin" / "python")
    yield
