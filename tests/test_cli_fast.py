"""Commands that answer bad input in seconds: recipe validation, `--help`, `zoo`, `check` of a folder without a valid
config and a GPU recipe on a machine without GPUs answer before torch, transformers or Lightning is imported (each
takes seconds to a minute to import on a loaded machine), and `plan` before Lightning; and the messages of the CLI's
smaller refusals (a recipe path, a zoo name, the plan of a CPU run, export's format, the eval log)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_errors import _closed_port_url

from eagle3_zoo.cli import main
from eagle3_zoo.recipe.decisions import gpu_driver_present

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
    (["fit", "recipes/smolm2_135m.yaml"], 2, "did you mean 'recipes/smollm2_135m.yaml'?"),
    (["plan", "recipes/llama3_8b.yaml", "trainer.batch_sise=2"], 2, "did you mean 'trainer.batch_size'?"),
    (["prepare", "recipes/smollm2_135m.yaml", "data.max_lenght=8"], 2, "did you mean 'data.max_length'?"),
    (["fit", "recipes/smollm2_135m.yaml", "loss.name=lk_hybrid", "loss.params.etta=1"], 2,
     "did you mean 'loss.params.eta'? (the parameters of loss 'lk_hybrid')"),
    (["fit", "recipes/smollm2_135m.yaml", "--print-config"], 0, ""),
    (["--help"], 0, ""),
    (["fit", "--help"], 0, ""),
    (["zoo", "list"], 0, ""),
    (["zoo", "show", "nosuch"], 2, "no zoo entry named 'nosuch'"),
    (["check", "tests"], 1, ""),  # a folder without config.json: CONFIG_MISSING, on stdout
], ids=["typo", "recipe-path", "plan-typo", "prepare-typo", "loss-params", "print-config", "help", "fit-help",
        "zoo-list", "zoo-show", "check"])
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


def test_plan_of_a_cpu_run_says_per_cpu_process(capsys):
    assert main(["plan", "recipes/smollm2_135m.yaml", "trainer.accelerator=cpu"]) == 0
    out = capsys.readouterr().out
    assert "GPU:" not in out and "per trainer CPU process:" in out and "; per CPU process:" in out
    assert main(["plan", "recipes/llama3_8b.yaml"]) in (0, 1)
    assert "per trainer GPU:" in capsys.readouterr().out


def test_unknown_pull_id_offline_gets_no_unrelated_zoo_names(capsys):
    url = _closed_port_url()
    assert main(["pull", "foo/bar-eagle3", "--endpoint", url]) == 1
    err = capsys.readouterr().err
    assert "'foo/bar-eagle3' is neither a known zoo name (see `eagle3-zoo zoo list`)" in err, err
    assert "did you mean" not in err
    assert main(["pull", "Qwen/Qwen3-8B-eagl3", "--endpoint", url]) == 1
    assert "(did you mean qwen3-8b-eagle3?)" in capsys.readouterr().err  # a close name is still offered


def test_export_canonical_says_canonical(tmp_path, capsys):
    from hub_fixtures import canonical_dir

    src, _ = canonical_dir(tmp_path)
    assert main(["export", str(src), "--format", "canonical", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "(canonical format)" in out and "sglang" not in out


def _eval_args(*argv: str) -> argparse.Namespace:
    from eagle3_zoo.cli.evaluate import add_eval_arguments

    return add_eval_arguments(argparse.ArgumentParser()).parse_args(["drafter", "--no-baseline", *argv])


def test_eval_log_names_only_the_options_left_to_defaults(caplog):
    from eagle3_zoo.cli.evaluate import _log_plan, settings_for

    every = _eval_args("--mode", "tree", "--depth", "4", "--top-k", "4", "--total-tokens", "16", "--min-prob", "0",
                       "--max-new-tokens", "32", "--limit", "2", "--spread")
    some = _eval_args("--depth", "4", "--limit", "2")
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.cli.evaluate"):
        for args in (every, some, _eval_args()):
            _log_plan(args, settings_for(args, "cpu"), "cpu")
    full, partial, none = (r.getMessage() for r in caplog.records)
    assert "default" not in full, full
    # a shape option given: --min-prob is 0 (uncut), not the CPU's 0.2; --limit given: --spread is off
    assert partial.endswith("(the CPU defaults of the options not given: --mode, --top-k, --total-tokens, "
                            "--max-new-tokens)"), partial
    assert none.endswith("(the CPU defaults of the options not given: --mode, --depth, --top-k, --total-tokens, "
                         "--min-prob, --max-new-tokens, --limit, --spread)"), none
