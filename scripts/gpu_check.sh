#!/usr/bin/env bash
# One-shot GPU check (scripts/gpu_check.py): bf16 TTT step speed/memory vs the naive formulation with loss and
# gradients compared to fp32 (padding path included), the CUDA attention backend vs the reference, lossless greedy
# speculative decoding with an accepting (oracle) drafter, then `fit` steps (auto with the host-device syncs of a
# whole step counted; fsdp on one GPU with skeleton loading and a sharded checkpoint). Rows print as they are
# measured and go to a JSON-lines file (--jsonl PATH) at once. No model downloads; planned for <= 8 min on one H200.
#   bash scripts/gpu_check.sh --fetch-wheels   # here, once: omegaconf's wheel into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh                  # on the CUDA machine, from a bare checkout with .whl/ carried along
#   bash scripts/gpu_check.sh --cpu-smoke      # tiny shapes on a CPU (what the test suite runs)
# Python: $PYTHON, else .venv/bin/python, else python3 (a GPU image's own torch; the project need not be installed).
# omegaconf (the recipe loader's) is the one dependency a CUDA image lacks (the lent H200: torch 2.11, transformers
# 5.17, Lightning 2.6, no internet): without it, the .whl/*.whl wheels go into a temporary directory first; with no
# wheels there, they are fetched when a package index answers (a CPU machine's bare copy), and on a machine without
# one the checks that load a recipe fail, saying so, and the others run.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
WHEELS=${GPU_CHECK_WHEELS:-.whl}
fetch_wheels() {  # pure-Python wheels (py3-none-any), so the --python-version of the GPU image fits any machine
  "$PY" -m pip download -q --disable-pip-version-check --timeout 15 --retries 1 --no-deps --only-binary=:all: \
    --python-version 3.12 -d "$WHEELS" omegaconf==2.4.0
}
if [ "${1:-}" = "--fetch-wheels" ]; then
  fetch_wheels
  exit
fi
if ! "$PY" -c "import omegaconf" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: no omegaconf and no $WHEELS/*.whl: fetching the wheel" >&2
    fetch_wheels || echo "gpu_check: could not fetch omegaconf (no package index here? run" \
      "\`bash scripts/gpu_check.sh --fetch-wheels\` on a machine with one and carry $WHEELS): the checks that load a" \
      "recipe will fail, the others run" >&2
  fi
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --target "$site" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py "$@"
