#!/usr/bin/env bash
# One-shot GPU check of the training step (scripts/gpu_check.py): bf16 TTT step speed/memory vs the naive
# formulation with loss and gradients compared, the CUDA attention backend vs the reference, a few bf16-mixed fit
# steps on a random-weight 1B-shaped target. No downloads; <= 8 min on one H200-class GPU.
#   bash scripts/gpu_check.sh               # on a CUDA machine
#   bash scripts/gpu_check.sh --cpu-smoke   # tiny shapes on a CPU (what the test suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" scripts/gpu_check.py "$@"
