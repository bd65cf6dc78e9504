"""CPU threads: chosen from the cores this process may use minus the ones other work keeps busy, overridable by
--threads / EAGLE3_ZOO_THREADS / a user's OMP_NUM_THREADS, and set before torch starts its OpenMP pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle3_zoo.cli import main
from eagle3_zoo.util import threads

_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", threads.ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    return monkeypatch


@pytest.mark.parametrize("busy, expected", [(0, 2), (1, 1), (3, 1)])
def test_auto_takes_the_usable_cores_not_busy_elsewhere(clean_env, busy, expected):
    clean_env.setattr(threads, "busy_elsewhere", lambda: busy)
    choice = threads.choose_threads()
    assert choice.threads == expected and choice.reason.startswith("auto") and choice.busy_elsewhere == busy
    assert choice.wait_policy == "PASSIVE"


def test_an_explicit_choice_wins_in_order(clean_env):
    clean_env.setattr(threads, "busy_elsewhere", lambda: pytest.fail("an explicit choice samples no load"))
    clean_env.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_threads().threads == 3  # a user's OpenMP setting is kept
    clean_env.setenv(threads.ENV, "4")
    assert threads.choose_threads().threads == 4
    assert threads.choose_threads("5").threads == 5 and threads.choose_threads(6).reason == "--threads"
    clean_env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert threads.choose_threads(1).wait_policy == "ACTIVE"  # how threads wait, when the user said so, is kept


def test_the_runnable_count_excludes_this_process():
    assert threads._runnable("cpu  1 2 3\nprocs_running 3\nprocs_blocked 0\n") == 3
    assert threads._runnable("no such line\n") is None
    assert threads.busy_elsewhere(samples=3, gap_s=0.0) >= 0


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_is_bad_input(bad, capsys, monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    assert main(["--threads", bad, "zoo", "list"]) == 2
    assert f"--threads={bad!r}: expected a positive number of CPU threads or 'auto'" in capsys.readouterr().err
    monkeypatch.setenv(threads.ENV, bad)
    assert main(["zoo", "list"]) == 2
    assert f"{threads.ENV}={bad!r}" in capsys.readouterr().err


def test_the_choice_is_in_torch_before_its_pool_starts():
    """A command line process sets OpenMP's environment before torch loads: torch runs with the chosen count, and
    waiting threads yield (OMP_WAIT_POLICY=PASSIVE) unless the user said otherwise."""
    code = ("import json, os, sys; from eagle3_zoo.util.threads import configure_threads; "
            "configure_threads(sys.argv[1]); import torch; "
            "print(json.dumps([torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY'), "
            "'torch' in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if k not in _VARS}
    for requested, expected in (("1", 1), ("2", 2)):
        out = subprocess.run([sys.executable, "-c", code, requested], capture_output=True, text=True, env=env,
                             check=True)
        assert json.loads(out.stdout) == [expected, "PASSIVE", True]
