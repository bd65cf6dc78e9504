"""The data flow runs one way: `targets/` sits below `data/` and `training/` (the whole order: test_layering.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle3_zoo

PACKAGE = Path(eagle3_zoo.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in _imported_modules(path):
            if name.startswith(forbidden):
                bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return bad


def test_data_does_not_import_training():
    assert _offenders("data", ("eagle3_zoo.training",)) == []


def test_targets_import_neither_data_nor_training():
    assert _offenders("targets", ("eagle3_zoo.training", "eagle3_zoo.data", "eagle3_zoo.speculative")) == []


def test_old_import_path_still_works():
    from eagle3_zoo.targets.loading import aux_layer_ids_for, load_recipe_target
    from eagle3_zoo.training import build

    assert build.load_recipe_target is load_recipe_target
    assert build.aux_layer_ids_for is aux_layer_ids_for
