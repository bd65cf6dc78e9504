"""Lazy exports of a package (PEP 562): an exported name is imported from its module on first use, so importing the
package loads no torch or transformers. The one helper behind every package `__init__` that exports names this way.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], *, cache: bool = True
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package` for the names of `exports`.

    Args:
        package: the package's `__name__`.
        exports: exported name -> the module that defines it: its name relative to `package` (`"card"`,
            `"checkpoint.check_report"`) or its full dotted name.
        cache: keep a name in the package's namespace after its first use, so later lookups skip `__getattr__` (and
            monkeypatch saves and restores it there); False looks the name up in its module on every use.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module if module.startswith(f"{package}.") else f"{package}.{module}"),
                        name)
        if cache:
            setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
