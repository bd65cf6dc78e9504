#!/usr/bin/env bash
# One-shot GPU check (scripts/gpu_check.py): bf16 TTT step speed/memory vs the naive formulation with loss and
# gradients compared to fp32 (padding path included), the CUDA attention backend vs the reference, `fit` steps
# (auto with its host-device syncs counted; fsdp on one GPU with skeleton loading and a sharded checkpoint), lossless
# greedy speculative decoding. Rows print as they are measured. No downloads; <= 8 min on one H200-class GPU.
#   bash scripts/gpu_check.sh --fetch-wheels   # here, once: omegaconf's wheel into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh                  # on the CUDA machine, from a bare checkout with .whl/ carried along
#   bash scripts/gpu_check.sh --cpu-smoke      # tiny shapes on a CPU (what the test suite runs)
# Python: $PYTHON, else .venv/bin/python, else python3 (a GPU image's own torch). A machine without omegaconf (the
# lent H200: torch 2.11, transformers 5.17, Lightning 2.6, no internet) gets the carried .whl/*.whl installed into
# a temporary directory first; without them only the fit checks fail (saying so) and the others run.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if [ "${1:-}" = "--fetch-wheels" ]; then
  exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" omegaconf==2.4.0
fi
if ! "$PY" -c "import omegaconf" 2>/dev/null; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: no omegaconf and no $WHEELS/*.whl (bash scripts/gpu_check.sh --fetch-wheels, then carry" \
         ".whl): the fit and decoding checks will fail, the others run" >&2
  fi
fi
export PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py "$@"
