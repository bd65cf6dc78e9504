"""How many package modules a reader passes through when following the recipe from `fit` until the run is built.

Builds the tests' tiny run (a random 4-layer Llama target saved to a temporary folder, 24 chat conversations, the
recipe of `tests/training_fixtures.py`, `trainer.max_steps=1`), loads the recipe untraced, then calls
`eagle3_zoo.training.fit.fit(recipe)` under `sys.setprofile` and stops counting when Lightning's
`Trainer._run_stage` starts: by then Lightning has run the `setup` hooks (DataModule, callbacks, LightningModule),
`configure_model` and the checkpoint restore, and nothing has trained or validated yet. The run then finishes its
one step untraced. The same script measures any commit of the repository it is run in (copy it there when the
commit predates it).

Definitions (main thread; module = the frame's `__name__`; package = `eagle3_zoo` and its submodules):

* **Following the recipe** (the default): a call counts when it is a call of a package function that receives the
  recipe object `fit` was given, i.e. one of its arguments at call time (`*args` and `**kwargs` items included)
  *is* that object, or has it as a direct attribute (an instance or class `__dict__` entry or a slot: a bound
  method whose `self` holds `self.recipe` counts). A function that receives a section of the recipe
  (`recipe.data`), a value read from it, a dict holding it, or reads it from a closure or a global does not count.
  The counted frames form a stack: a counted call makes its module active; when a counted frame returns, control
  comes back to the counted frame below it (its nearest counted caller, through any uncounted or other libraries'
  frames), whose module becomes active again. Uncounted frames change nothing.
* **Following every function** (`--all-functions`): every package function's call counts, and the active module
  also changes when any frame (package or not) returns into a package frame (control resumes in the caller's
  module). Calls into other libraries (torch, Lightning) leave the active module as it was: a package function that
  Lightning calls as a hook becomes active when called, and the package function that called `trainer.fit` becomes
  active again when `trainer.fit` returns to it.
* The run sees the script's command line without its options (the run folder records the command line, one
  redaction call per word), so the options do not change the count.
* The garbage collector is off while tracing (a finalizer it runs at an arbitrary point is no step of the run).
* Frames run while a module is imported (below `importlib`'s `_find_and_load`) are not counted: the count is of
  calls, not of first imports, so it does not depend on what an earlier command already imported.
* A call is followed once: a counted call of a function that the same function (its nearest counted caller; with
  `--all-functions`, the nearest package frame below it) has already called is skipped with everything below it
  and its return, as a reader who has read that call does not read it again. The count then does not grow with the
  number of conversations, batches or layers a loop walks over. `--every-call` counts every call instead.
* **modules**: the distinct package modules that were active at least once.
* **stays**: the maximal stretches of the sequence of active modules in one module (1 + the number of changes).
* **returns**: the changes caused by a `return`, i.e. control coming back into a module from a different one.
* **calls**: the changes caused by a `call` (stays = 1 + calls + returns).

    PYTHONPATH=$PWD .venv/bin/python scripts/trace_run_assembly.py [--all-functions] [--every-call] [--sequence]

Prints the commit (`git rev-parse --short HEAD`), the rule and the four counts, and with `--sequence` the stays in
order (how control got there, and the module). Takes about 10 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "eagle3_zoo"


def _in_package(frame: Any) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _package_caller(frame: Any) -> Any:
    """The code of the nearest package frame below `frame` (through other libraries' frames), or None."""
    frame = frame.f_back
    while frame is not None and not _in_package(frame):
        frame = frame.f_back
    return None if frame is None else frame.f_code


def _attributes(value: Any) -> list[Any]:
    """The direct attributes of `value`: its `__dict__` entries and its slots (read without running its code)."""
    found = []
    try:
        found.extend(object.__getattribute__(value, "__dict__").values())
    except (AttributeError, TypeError):
        pass
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            try:
                found.append(object.__getattribute__(value, slot))
            except (AttributeError, TypeError):
                pass
    return found


def _receives(frame: Any, followed: Any) -> bool:
    """Whether one of the arguments `frame` was called with is `followed` or has it as a direct attribute."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    var_positional = bool(code.co_flags & inspect.CO_VARARGS)
    var_keyword = bool(code.co_flags & inspect.CO_VARKEYWORDS)
    names = code.co_varnames[: count + var_positional + var_keyword]
    local = frame.f_locals
    values = [local.get(name) for name in names[:count]]
    if var_positional:
        values.extend(local.get(names[count], ()))
    if var_keyword:
        values.extend(local.get(names[-1], {}).values())
    return any(value is followed or any(a is followed for a in _attributes(value)) for value in values)


@dataclass
class AssemblyTrace:
    """The active-module sequence of one traced call (see the module docstring for the definitions).

    `follow` is the object to follow (the recipe): only package functions that receive it are counted. With
    `all_functions`, every package function is.
    """

    follow: Any = None
    all_functions: bool = False
    once: bool = True  # follow each call edge once (a reader's count); False: every call (grows with the data)
    stays: list[tuple[str, str]] = field(default_factory=list)  # (module, "call" | "return" | "start")
    importing: int = 0
    done: bool = False
    edges: set[tuple[Any, Any]] = field(default_factory=set)
    skipping: Any = None  # the frame of a call already followed once, until it returns
    counted: list[Any] = field(default_factory=list)  # the counted frames not yet returned (following `follow`)

    def __post_init__(self) -> None:
        if self.follow is None and not self.all_functions:
            raise ValueError("AssemblyTrace: follow=None; pass the object to follow (the recipe) or all_functions=True")

    def _enter(self, module: str, how: str) -> None:
        if not self.stays:
            self.stays.append((module, "start"))
        elif self.stays[-1][0] != module:
            self.stays.append((module, how))

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if self.done:
            return
        code = frame.f_code
        if self.skipping is not None:
            if event == "return" and frame is self.skipping:
                self.skipping = None
            return
        importlib_frame = code.co_name == "_find_and_load" and code.co_filename.startswith("<frozen importlib")
        if event == "call":
            if importlib_frame:
                self.importing += 1
            elif code.co_name == "_run_stage" and code.co_filename.endswith("lightning/pytorch/trainer/trainer.py"):
                self.done = True  # the run is built; training and validation start here
            elif not self.importing and _in_package(frame):
                if self.all_functions:
                    caller = _package_caller(frame)
                elif _receives(frame, self.follow):
                    caller = self.counted[-1].f_code if self.counted else None
                else:
                    return
                edge = (caller, code)
                if self.once and edge in self.edges:
                    self.skipping = frame
                    return
                self.edges.add(edge)
                if not self.all_functions:
                    self.counted.append(frame)
                self._enter(frame.f_globals["__name__"], "call")
        elif event == "return":
            if importlib_frame:
                self.importing -= 1
            elif self.importing:
                return
            elif self.all_functions:
                if frame.f_back is not None and _in_package(frame.f_back):
                    self._enter(frame.f_back.f_globals["__name__"], "return")
            elif self.counted and frame is self.counted[-1]:
                self.counted.pop()
                if self.counted:
                    self._enter(self.counted[-1].f_globals["__name__"], "return")

    def counts(self) -> dict[str, int]:
        hows = [how for _, how in self.stays]
        return {"modules": len({m for m, _ in self.stays}), "stays": len(self.stays),
                "returns": hows.count("return"), "calls": hows.count("call")}


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequence", action="store_true", help="print every stay in order")
    parser.add_argument("--all-functions", action="store_true",
                        help="count every package function, not only those that receive the recipe")
    parser.add_argument("--every-call", action="store_true", help="follow repeated calls too")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from training_fixtures import tiny_run_files

    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training import fit as fit_module

    with tempfile.TemporaryDirectory(prefix="trace-assembly-") as tmp:
        recipe_path = tiny_run_files(Path(tmp))
        recipe = load_recipe(recipe_path, ["trainer.max_steps=1"])
        trace = AssemblyTrace(follow=recipe, all_functions=args.all_functions, once=not args.every_call)
        command, sys.argv = sys.argv, sys.argv[:1]  # the run records (and redacts) its command line: no options
        gc.disable()  # a finalizer that the collector runs at an arbitrary point would be counted as a call
        sys.setprofile(trace.profile)
        try:
            fit_module.fit(recipe, source=str(recipe_path))
        finally:
            sys.setprofile(None)
            gc.enable()
            sys.argv = command
    if not trace.done:
        raise SystemExit("error: Lightning's Trainer._run_stage was never called; the trace has no end")
    if args.sequence:
        for module, how in trace.stays:
            print(f"{how:>6}  {module}")
    counts = trace.counts()
    rule = ("every package function" if args.all_functions else "the functions that receive the recipe") + (
        ", every call" if args.every_call else ", each call edge once")
    print(f"commit {_commit()} ({rule}): fit -> Trainer._run_stage visits {counts['modules']} modules with "
          f"{counts['stays']} stays, {counts['returns']} returns and {counts['calls']} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
