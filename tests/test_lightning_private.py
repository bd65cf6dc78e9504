"""The private Lightning and torch names the package needs live in `eagle3_zoo.training.lightning_private` only,
and each one still exists on the installed versions: an upgrade that removes one fails here, not in a run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from eagle3_zoo.training import lightning_private

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_zoo"
PRIVATE_MODULE = PACKAGE / "training" / "lightning_private.py"


@pytest.mark.parametrize("module, path", lightning_private.PRIVATE_NAMES)
def test_every_private_name_exists_on_the_installed_versions(module, path):
    lightning_private.resolve(module, path)  # raises if it is gone
    assert path.split(".")[-1] in PRIVATE_MODULE.read_text().split('"""', 2)[1]  # the docstring says why


def test_resolve_fails_loudly_on_a_missing_name():
    with pytest.raises(AttributeError):
        lightning_private.resolve("lightning.pytorch.callbacks", "ModelCheckpoint._no_such_name")


def _private_imports(path: Path) -> list[str]:
    """`lightning...`/`torch...` imports of `path` whose module or imported name has a private component."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in ("lightning", "torch") and any(p.startswith("_") and not p.startswith("__")
                                                          for p in parts):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    return found


def test_no_other_module_imports_a_private_lightning_or_torch_name():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PRIVATE_MODULE for hit in _private_imports(path)]
    assert found == [], "import these through eagle3_zoo.training.lightning_private:\n" + "\n".join(found)


def test_no_other_module_reaches_a_listed_private_attribute():
    leaves = {path.split(".")[-1] for _, path in lightning_private.PRIVATE_NAMES if path.split(".")[-1][0] == "_"}
    found = [f"{path.relative_to(PACKAGE.parent)}: {leaf}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PRIVATE_MODULE for leaf in sorted(leaves) if re.search(rf"\.{leaf}\b", path.read_text())]
    assert found == [], found
