"""The package's import graph: no circle between modules, and imports run only downwards through the layers below.

Every module of the package is parsed with `ast`; every import counts, wherever it is written (module level, inside a
function or method, under `if TYPE_CHECKING:`, in a `try:`), absolute or relative, and `from package import name`
where `name` is a submodule is an import of that submodule. Only imports of the package's own modules are read.

The folders (and the top-level modules), top to bottom; a module may import its own layer and the layers below:

    __main__ > cli > api > training > speculative > data > hub > targets > checkpoint > recipe > adapters > chat
        > modeling, drafters > losses > values > util (and the package's own __init__)

A folder's sub-folders (training/planner, training/rundir, data/engine) sit in its layer.

`EAGLE3_ZOO_LAYERING_ROOT=/path/to/eagle3_zoo` runs the checks on another checkout's package folder.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from pathlib import Path

import eagle3_zoo

PACKAGE = Path(os.environ.get("EAGLE3_ZOO_LAYERING_ROOT") or Path(eagle3_zoo.__file__).parent)
NAME = PACKAGE.name

LAYERS = (  # top to bottom
    ("__main__",),
    ("cli",),
    ("api",),  # the Python API of a drafter folder (check, export, evaluate) that the CLI calls
    ("training",),  # the run: recipe -> data stage -> Lightning fit -> drafter folder; planner/, rundir/
    ("speculative",),  # decoding, evaluation and the tau callback; no training code
    ("data",),  # the data stage (regeneration, tokenisation, features); engine/: a served target's side of it
    ("hub",),  # the network: endpoint probe, pull, publish, card, zoo commands
    ("targets",),  # the frozen target: in-process load, engine deployment, OpenAI-compatible client
    ("checkpoint",),  # drafter folders: formats, weights, convert, checks, the folder writer
    ("recipe",),  # the recipe: its typed sections and checks, the engine section, the run's decisions
    ("adapters",),  # per-family target adapters, shipped target configs
    ("chat",),  # the conversation type, the chat formats with the prompt renderer and loss mask, tiny tokenizers
    ("modeling", "drafters"),  # the drafter models (EAGLE-3; the other kinds, one subpackage each)
    ("losses",),  # the per-position TTT losses: the registry (read by recipe validation) and their math
    ("values",),  # small torch-free value types and tables: draft shapes, dtype and layout names, locations, the zoo
    ("util", ""),  # utilities (file IO, progress, threads, redaction, provenance, typed YAML, lazy exports); "" = the
    # package's own __init__
)
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules(PACKAGE)


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module of the package) for every import statement in `module`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` imports pkg
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import pkg.mod.attr` style names: the module they live in
                name = name.rpartition(".")[0]
            if name and name != module:
                found.append((node.lineno, name))
    return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}
EDGES = {(a, b) for a, found in IMPORTS.items() for _, b in found}


def _folder(module: str) -> str:
    """The layer key of a module: its folder below the package, or its own name for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one circle through them."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(MODULES)))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(set(MODULES) | set(graph)):
        if v not in index:
            visit(v)
    return [_circle(c, graph) for c in components]


def _circle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle a -> ... -> a inside a strongly connected component (breadth-first back to its first module)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def _lines(a: str, b: str) -> str:
    path = MODULES[a].relative_to(PACKAGE.parent)
    return ", ".join(sorted({f"{path}:{line}" for line, name in IMPORTS[a] if name == b}))


def test_every_folder_has_a_layer():
    missing = sorted({_folder(m) for m in MODULES} - set(RANK))
    assert not missing, f"folders / top-level modules with no place in LAYERS: {missing}; add each where it belongs"


def test_no_import_circle():
    cycles = _cycles(EDGES)
    assert not cycles, "import circles (imports inside functions count too):\n" + "\n".join(
        " -> ".join(c) + "\n    " + "; ".join(f"{a} -> {b} at {_lines(a, b)}" for a, b in zip(c, c[1:]))
        for c in cycles)


def test_imports_run_downwards():
    upward = sorted((a, b) for a, b in EDGES
                    if _folder(a) in RANK and _folder(b) in RANK and RANK[_folder(a)] > RANK[_folder(b)])
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"{_lines(a, b)}: {a} ({_folder(a) or NAME}) imports {b} ({_folder(b) or NAME})" for a, b in upward)


def test_hub_imports_neither_speculative_nor_training():
    bad = sorted((a, b) for a, b in EDGES if _folder(a) == "hub" and _folder(b) in ("speculative", "training"))
    assert not bad, "\n".join(f"{_lines(a, b)}: {a} imports {b}" for a, b in bad)


def test_the_parser_sees_every_kind_of_import(tmp_path):
    """Imports inside functions and methods, relative ones and `from package import submodule` are all edges."""
    global MODULES
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    for name in ("__init__.py", "low/__init__.py", "low/a.py", "low/b.py", "low/c.py", "low/d.py"):
        (root / name).write_text("")
    (root / "top.py").write_text(
        "def f():\n    from pkg.low import a\n"
        "class C:\n    def m(self):\n        from .low.b import x\n"
        "import pkg.low.c.attr\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import d\n")
    saved, MODULES = MODULES, _modules(root)
    try:
        found = _imports("pkg.top", root / "top.py")
    finally:
        MODULES = saved
    assert sorted(name for _, name in found) == ["pkg.low.a", "pkg.low.b", "pkg.low.c", "pkg.low.d"]
    assert _cycles({("x", "y"), ("y", "z"), ("z", "x"), ("z", "w")}) == [["x", "y", "z", "x"]]
