"""`eagle3_zoo.util.lazy.lazy_exports`: the `__getattr__` / `__dir__` of every package `__init__` that exports names
imported on first use."""

from __future__ import annotations

import importlib
import sys

import pytest

import eagle3_zoo


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package `lazypkg` exporting `VALUE` (from `lazypkg.heavy`, cached) and `OTHER` (from `lazypkg.sub.more`, full
    name, looked up on every use in the `nocache` twin)."""
    for name, cache in (("lazypkg", True), ("lazypkg_nocache", False)):
        root = tmp_path / name
        (root / "sub").mkdir(parents=True)
        (root / "__init__.py").write_text(
            "from eagle3_zoo.util.lazy import lazy_exports\n"
            f"_EXPORTS = {{'VALUE': 'heavy', 'OTHER': '{name}.sub.more'}}\n"
            f"__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, cache={cache})\n")
        (root / "heavy.py").write_text("VALUE = 41\n")
        (root / "sub" / "__init__.py").write_text("")
        (root / "sub" / "more.py").write_text("OTHER = 'other'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in ("lazypkg", "lazypkg_nocache")]:
        del sys.modules[name]


def test_a_name_is_imported_on_first_use_and_kept(package):
    pkg = importlib.import_module("lazypkg")
    assert "lazypkg.heavy" not in sys.modules
    assert pkg.VALUE == 41 and "lazypkg.heavy" in sys.modules
    assert vars(pkg)["VALUE"] == 41  # kept: later lookups skip __getattr__
    assert pkg.OTHER == "other"  # a full dotted module name works too
    assert {"VALUE", "OTHER"} <= set(dir(pkg))
    with pytest.raises(AttributeError, match="module 'lazypkg' has no attribute 'MISSING'"):
        pkg.MISSING


def test_cache_false_reads_the_module_on_every_use(package):
    pkg = importlib.import_module("lazypkg_nocache")
    assert pkg.VALUE == 41 and "VALUE" not in vars(pkg)
    sys.modules["lazypkg_nocache.heavy"].VALUE = 42
    assert pkg.VALUE == 42


def test_the_package_exports_resolve():
    for name in eagle3_zoo.__all__:
        assert getattr(eagle3_zoo, name).__name__ == name
    assert "DrafterFolder" in dir(eagle3_zoo)
