"""scripts/trace_run_assembly.py: the counts of modules, stays, returns and calls follow its stated definitions, on
two stand-in package modules and one foreign one (no run is built here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_run_assembly.py"
spec = importlib.util.spec_from_file_location("trace_run_assembly", SCRIPT)
trace_run_assembly = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = trace_run_assembly  # its dataclass resolves annotations through sys.modules
spec.loader.exec_module(trace_run_assembly)


def _modules():
    """`eagle3_zoo.fake_a.outer` calls `eagle3_zoo.fake_b.leaf` three times directly and twice through a function of
    a foreign module; `leaf` calls a helper of its own module."""
    b = {"__name__": "eagle3_zoo.fake_b"}
    exec("def helper():\n    return 1\ndef leaf():\n    return helper()\n", b)
    other = {"__name__": "somelib.hooks", "leaf": b["leaf"]}
    exec("def run_hooks():\n    leaf()\n    leaf()\n", other)
    a = {"__name__": "eagle3_zoo.fake_a", "leaf": b["leaf"], "run_hooks": other["run_hooks"]}
    exec("def outer():\n    for _ in range(3):\n        leaf()\n    run_hooks()\n    return 0\n", a)
    return a["outer"]


def _trace(once: bool) -> dict[str, int]:
    outer = _modules()
    trace = trace_run_assembly.AssemblyTrace(once=once)
    sys.setprofile(trace.profile)
    try:
        outer()
    finally:
        sys.setprofile(None)
    return trace.counts() | {"sequence": trace.stays}


def test_each_call_edge_is_followed_once():
    got = _trace(once=True)
    # a (start), b (the call outer -> leaf), a (its return); the next two direct calls repeat that edge, and so do
    # the calls through somelib (their nearest package caller is outer too): all skipped
    assert got["sequence"] == [("eagle3_zoo.fake_a", "start"), ("eagle3_zoo.fake_b", "call"),
                               ("eagle3_zoo.fake_a", "return")]
    assert (got["modules"], got["stays"], got["returns"], got["calls"]) == (2, 3, 1, 1)


def test_every_call_counts_returns_through_a_foreign_frame_once_control_is_back_in_the_package():
    got = _trace(once=False)
    # three direct calls: b, a each time (6 stays after the start); the foreign run_hooks calls leaf twice: b, and
    # the return lands in somelib (no change), the second call stays in b, and run_hooks returning to outer is the
    # return into a: 2 more
    assert [how for _, how in got["sequence"]] == ["start"] + ["call", "return"] * 4
    assert (got["modules"], got["stays"], got["returns"], got["calls"]) == (2, 9, 4, 4)
    assert got["stays"] == 1 + got["calls"] + got["returns"]
