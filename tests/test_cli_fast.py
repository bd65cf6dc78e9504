"""Commands that answer bad input in seconds: recipe validation, `--help`, `zoo`, `check` of a folder without a valid
config and a GPU recipe on a machine without GPUs answer before torch, transformers or Lightning is imported (each
takes seconds to a minute to import on a loaded machine), and `plan` before Lightning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_zoo.training.run_plan import gpu_driver_present

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "lightning")
# runs one command line through the CLI's `main`, then says which heavy packages it imported
_RUNNER = f"""import json, sys
from eagle3_zoo.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"rc": code, "imported": sorted(m for m in {HEAVY!r} if m in sys.modules)}}), file=sys.stderr)"""


def _run(*argv: str) -> tuple[int, list[str], str]:
    """(exit code, heavy packages imported, stderr before the report) of `eagle3-zoo ARGV` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _RUNNER, *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    *err, report = out.stderr.strip().splitlines()
    result = json.loads(report)
    return result["rc"], result["imported"], "\n".join(err)


@pytest.mark.parametrize("argv, rc, says", [
    (["fit", "recipes/smollm2_135m.yaml", "trainer.max_step=10"], 2, "did you mean 'trainer.max_steps'?"),
    (["plan", "recipes/llama3_8b.yaml", "trainer.batch_sise=2"], 2, "did you mean 'trainer.batch_size'?"),
    (["prepare", "recipes/smollm2_135m.yaml", "data.max_lenght=8"], 2, "did you mean 'data.max_length'?"),
    (["fit", "recipes/smollm2_135m.yaml", "--print-config"], 0, ""),
    (["--help"], 0, ""),
    (["fit", "--help"], 0, ""),
    (["zoo", "list"], 0, ""),
    (["zoo", "show", "nosuch"], 2, "no zoo entry named 'nosuch'"),
    (["check", "tests"], 1, ""),  # a folder without config.json: CONFIG_MISSING, on stdout
], ids=["typo", "plan-typo", "prepare-typo", "print-config", "help", "fit-help", "zoo-list",
        "zoo-show", "check"])
def test_bad_input_and_light_commands_import_no_torch(argv, rc, says):
    code, imported, err = _run(*argv)
    assert code == rc, err
    assert says in err
    assert imported == [], f"`eagle3-zoo {' '.join(argv)}` imported {imported} before answering"


@pytest.mark.skipif(gpu_driver_present(), reason="this machine has a GPU driver: torch is asked how many GPUs")
def test_gpu_recipe_on_a_machine_without_gpus_is_refused_before_torch():
    code, imported, err = _run("fit", "recipes/qwen25_7b.yaml")
    assert code == 2 and "trainer.accelerator = 'gpu'" in err and "no CUDA GPU" in err, err
    assert imported == []


@pytest.mark.slow  # imports torch and transformers and builds the target on the meta device: 5-15 s
def test_plan_imports_no_lightning():
    """`plan` builds the target and the drafter on the meta device (torch and transformers: parameter counts come
    from the models themselves), and nothing of the training loop."""
    code, imported, err = _run("plan", "recipes/smollm2_135m.yaml")
    assert code == 0, err
    assert "lightning" not in imported
