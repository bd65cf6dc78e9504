"""scripts/trace_run_assembly.py: the counts of modules, stays, returns and calls follow its stated definitions, on
stand-in package modules and one foreign one (no run is built here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

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
    trace = trace_run_assembly.AssemblyTrace(all_functions=True, once=once)
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


RECIPE_MODULES = {
    # b: `reads` receives the recipe, `plain` (same module) and `section` do not
    "eagle3_zoo.fake_b": "def plain(x):\n    return x\n"
                         "def reads(recipe):\n    return plain(recipe.data)\n"
                         "def section(data):\n    return data\n",
    # c: a holder of the recipe (its methods receive it through `self`) and a function that does not receive it
    "eagle3_zoo.fake_c": "class Holder:\n    def __init__(self, recipe):\n        self.recipe = recipe\n"
                         "    def method(self):\n        return 1\n"
                         "def unrelated(x):\n    return x\n",
    # a foreign library that hands the recipe to a package function
    "somelib.hooks": "def run_hook(fn, *args):\n    return fn(*args)\n",
    "eagle3_zoo.fake_a": "def outer(recipe):\n"
                         "    unrelated(1)\n"  # not counted: no change
                         "    reads(recipe)\n"  # b, then a: plain inside it does not count
                         "    section(recipe.data)\n"  # a section is not the recipe: no change
                         "    holder = Holder(recipe)\n"  # c (the recipe is an argument of __init__), then a
                         "    holder.method()\n"  # c (its self holds the recipe), then a
                         "    run_hook(reads, recipe)\n"  # through somelib: b, then a (the edge outer -> reads again)
                         "    return 0\n",
}


def _recipe_trace(once: bool) -> dict[str, int]:
    spaces: dict[str, dict] = {}
    for name, source in RECIPE_MODULES.items():
        space = {"__name__": name}
        for other in spaces.values():
            space.update({k: v for k, v in other.items() if not k.startswith("__")})
        exec(source, space)
        spaces[name] = space
    recipe = SimpleNamespace(data=SimpleNamespace(path="x"))
    trace = trace_run_assembly.AssemblyTrace(follow=recipe, once=once)
    sys.setprofile(trace.profile)
    try:
        spaces["eagle3_zoo.fake_a"]["outer"](recipe)
    finally:
        sys.setprofile(None)
    return trace.counts() | {"sequence": trace.stays}


def test_following_the_recipe_counts_only_the_calls_that_receive_it_or_an_object_holding_it():
    got = _recipe_trace(once=True)
    a, b, c = "eagle3_zoo.fake_a", "eagle3_zoo.fake_b", "eagle3_zoo.fake_c"
    # `unrelated`, `plain` and `section` do not receive the recipe; the call through somelib repeats outer -> reads
    assert got["sequence"] == [(a, "start"), (b, "call"), (a, "return"), (c, "call"), (a, "return"), (c, "call"),
                               (a, "return")]
    assert (got["modules"], got["stays"], got["returns"], got["calls"]) == (3, 7, 3, 3)


def test_following_the_recipe_returns_to_the_nearest_receiving_caller_through_a_foreign_frame():
    got = _recipe_trace(once=False)
    a, b = "eagle3_zoo.fake_a", "eagle3_zoo.fake_b"
    # the call through somelib now counts: b, and its return goes past somelib's frame back to outer in a
    assert got["sequence"][-2:] == [(b, "call"), (a, "return")]
    assert (got["modules"], got["stays"], got["returns"], got["calls"]) == (3, 9, 4, 4)


def test_receives_reads_every_argument_and_one_level_of_attributes():
    recipe = object()

    class Slotted:
        __slots__ = ("recipe",)

        def __init__(self, recipe):
            self.recipe = recipe

    def frame_of(*args, **kwargs):
        return sys._getframe()

    def named(first, *, key):
        return sys._getframe()

    receives = trace_run_assembly._receives
    assert receives(frame_of(1, recipe), recipe)  # *args
    assert receives(frame_of(key=recipe), recipe)  # **kwargs
    assert receives(named(1, key=recipe), recipe)  # keyword-only
    assert receives(frame_of(Slotted(recipe)), recipe)  # a slot
    assert receives(frame_of(SimpleNamespace(recipe=recipe)), recipe)  # an instance attribute
    assert not receives(frame_of(SimpleNamespace(inner=SimpleNamespace(recipe=recipe))), recipe)  # two levels down
    assert not receives(frame_of({"recipe": recipe}, [recipe]), recipe)  # a container's items are not attributes
    assert not receives(named(1, key=2), recipe)


def test_following_nothing_is_refused():
    with pytest.raises(ValueError, match="follow=None"):
        trace_run_assembly.AssemblyTrace()
