"""README's error promise, for every subcommand through `eagle3_zoo.cli.main`: an error is one line (`error: ...`),
exit 2 for bad input and 1 otherwise, `--debug` (before or after the subcommand) or EAGLE3_ZOO_DEBUG=1 shows the
traceback; argparse's refusals are one line too; what `eval` is given is checked before its target loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from eagle3_zoo.cli import main
from tests.hub_fixtures import canonical_dir


def _closed_port_url() -> str:
    with socket.socket() as sock:  # bound then closed: a connection is refused at once, like a machine offline
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def no_target(monkeypatch):
    """Loading a target fails the test: what these commands are given must be refused before that."""
    def fail(*args, **kwargs):
        pytest.fail("the target must not be loaded")

    monkeypatch.setattr("eagle3_zoo.adapters.load_target", fail)


def _failing_commands(tmp_path) -> dict[str, tuple[list[str], int]]:
    """One failing invocation per subcommand and the exit code README promises for it."""
    src, _ = canonical_dir(tmp_path)
    missing = str(tmp_path / "missing")
    return {
        "fit": (["fit", f"{missing}.yaml"], 2),
        "prepare": (["prepare", f"{missing}.yaml"], 2),
        "plan": (["plan", f"{missing}.yaml"], 2),
        "serve": (["serve", f"{missing}.yaml"], 2),
        "consolidate": (["consolidate", f"{missing}.ckpt", str(tmp_path / "out")], 2),
        "eval": (["eval", missing, "--out", str(tmp_path / "r.json")], 2),
        "export": (["export", missing, "--out", str(tmp_path / "o")], 2),
        "check": (["check", str(src), "--target", "nobody/no-such-model"], 2),
        "publish": (["publish", str(src), "--repo-id", "no namespace", "--dry-run"], 2),
        "pull": (["pull", "me/nothing-here", "--endpoint", _closed_port_url(), "--out", str(tmp_path / "dl")], 1),
        "zoo": (["zoo", "show", "nosuch"], 2),
    }


COMMANDS = ["fit", "prepare", "plan", "serve", "consolidate", "eval", "export", "check", "publish", "pull", "zoo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_fails_in_one_line_and_shows_its_traceback_with_debug(command, tmp_path, monkeypatch,
                                                                               capsys, no_target):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EAGLE3_ZOO_DEBUG", raising=False)
    argv, code = _failing_commands(tmp_path)[command]
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for debug_argv in (["--debug", *argv], [*argv, "--debug"]):  # before or after the subcommand
        assert main(debug_argv) == code
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("error: "), err
    monkeypatch.setenv("EAGLE3_ZOO_DEBUG", "1")
    assert main(argv) == code
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["fit"], ["eval", "d", "--depth", "two"], ["zoo", "lst"], ["nosuch"],
                                  ["check", "d", "--engine", "sglang"], ["fit", "r.yaml", "--unknown"]])
def test_argparse_errors_are_one_line_with_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: eagle3-zoo") and len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert "--help" in err


def test_help_and_version_exit_0(capsys):
    assert main(["--version"]) == 0 and "eagle3-zoo" in capsys.readouterr().out
    assert main(["eval", "--help"]) == 0 and "--bench" in capsys.readouterr().out


def test_plan_fails_when_any_phase_does_not_fit(capsys):
    """DeepSeek-V3's training fits a GPU, an in-process feature job (the whole 671B target per process) does not."""
    assert main(["plan", "recipes/deepseek_v3.yaml", "data.mode=offline", "data.features_backend=hf"]) == 1
    out = capsys.readouterr().out
    assert "training: fits" in out and "hidden states: does NOT fit" in out
    assert out.rstrip().splitlines()[-1] == "plan: does NOT fit: hidden states"


def test_an_unreachable_hub_is_not_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_but_long_enough")
    src, _ = canonical_dir(tmp_path)
    url = _closed_port_url()
    assert main(["publish", str(src), "--repo-id", "me/tiny-eagle3", "--endpoint", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: HubUnreachableError: Hub endpoint {url} is not reachable")
    assert len(err.strip().splitlines()) == 1 and "--debug" in err


def test_eval_refuses_a_misspelt_benchmark_before_loading_the_target(tmp_path, capsys, no_target):
    src, _ = canonical_dir(tmp_path)
    assert main(["eval", str(src), "--bench", "mtbenc", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'mtbenc'" in err and "did you mean 'mtbench'?" in err
    assert len(err.strip().splitlines()) == 1


def test_eval_reports_a_mismatched_target_offline_as_check_does(tmp_path, monkeypatch, capsys, no_target):
    """A drafter for another target is refused from the target's shipped config, offline, with the check's codes
    (not "not reachable" after trying to download the target)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src, _ = canonical_dir(tmp_path)  # a tiny drafter: hidden 32, vocab 96
    assert main(["eval", str(src), "--target", "Qwen/Qwen2.5-7B-Instruct", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "refusing to evaluate with target Qwen/Qwen2.5-7B-Instruct an invalid drafter" in err
    assert "HIDDEN_SIZE_MISMATCH" in err and "not reachable" not in err and len(err.strip().splitlines()) == 1


def test_zoo_show_of_an_unknown_name_is_short(capsys):
    assert main(["zoo", "show", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: no zoo entry named 'nosuch'; see `eagle3-zoo zoo list`"
    assert main(["zoo", "show", "qwen3-8b-speculator.eagl3"]) == 2
    assert "did you mean qwen3-8b-speculator.eagle3," in capsys.readouterr().err


def test_python_dash_m_runs_the_same_command_line():
    out = subprocess.run([sys.executable, "-m", "eagle3_zoo", "zoo", "show", "nosuch"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == "error: no zoo entry named 'nosuch'; see `eagle3-zoo zoo list`"


def test_a_bad_log_interval_is_refused_before_any_work(monkeypatch, capsys):
    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "soon")
    assert main(["plan", "recipes/smollm2_135m.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: EAGLE3_ZOO_LOG_EVERY_S='soon': expected a number of seconds >= 0 (0: a line per step)"


def test_the_failing_commands_cover_every_subcommand():
    """A subcommand added to the CLI must join the table above (its exit code and --debug traceback tested)."""
    import argparse

    from eagle3_zoo.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subparsers.choices) == sorted(COMMANDS)
