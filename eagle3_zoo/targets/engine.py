"""Where the inference engine lives: its own virtual environment, found by a setting, never imported here.

vLLM pins its own torch and transformers, so it is installed into a separate venv (`bash scripts/setup_engine.sh`
creates `.venv-vllm` at the repository root) and the project only starts that venv's python as a server process.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

VLLM_PYTHON_ENV = "EAGLE3_ZOO_VLLM_PYTHON"
DEFAULT_VENV = ".venv-vllm"


def vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The python interpreter of the vLLM environment.

    Looked up in order: `explicit`, `$EAGLE3_ZOO_VLLM_PYTHON`, `.venv-vllm/bin/python` in the current directory.

    Raises:
        FileNotFoundError: none of them exists (the message says how to create one).
    """
    candidates = [(str(explicit), "the argument")] if explicit else []
    if os.environ.get(VLLM_PYTHON_ENV):
        candidates.append((os.environ[VLLM_PYTHON_ENV], f"${VLLM_PYTHON_ENV}"))
    candidates.append((str(Path(DEFAULT_VENV) / "bin" / "python"), f"{DEFAULT_VENV} in the current directory"))
    for path, _ in candidates:
        found = shutil.which(path) if os.sep not in path else (path if os.access(path, os.X_OK) else None)
        if found:
            return Path(found)
    tried = "; ".join(f"{p} ({why})" for p, why in candidates)
    raise FileNotFoundError(f"no vLLM python found (tried {tried}): run `bash scripts/setup_engine.sh` in the "
                            f"repository root, or set {VLLM_PYTHON_ENV} to the python of an environment with vllm")
