"""The drafter-kind registry: names without torch, the unknown-kind message, the recipe's `drafter.kind`, EAGLE-3 as
the first kind, and a resume identity saved before `drafter.kind` existed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eagle3_zoo.drafters import DrafterKind, get_kind, kind_names, kind_of, register_kind, unregister_kind


def test_kind_names_import_no_torch():
    code = ("import sys; from eagle3_zoo.drafters import kind_names; names = kind_names(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(names)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "eagle3" in out


def test_unknown_kind_names_the_valid_ones_and_the_guide():
    with pytest.raises(ValueError, match=r"unknown drafter kind 'nope'; valid: eagle3.*adding-a-drafter-kind\.md"):
        get_kind("nope")


def test_eagle3_is_the_kind_of_an_eagle3_drafter():
    from tests.tiny import tiny_drafter

    kind = get_kind("eagle3")
    assert kind_of(tiny_drafter()[0]) is kind and kind.layouts and "sglang" in kind.layouts


def test_a_registered_kind_is_a_valid_recipe_kind():
    class Toy(DrafterKind):
        name = "toy_kind"

    register_kind(Toy())
    try:
        assert "toy_kind" in kind_names()
        with pytest.raises(ValueError, match="registered already"):
            register_kind(Toy())
    finally:
        unregister_kind("toy_kind")
    assert "toy_kind" not in kind_names()


def test_recipe_refuses_an_unknown_kind(tmp_path):
    from eagle3_zoo.recipe import RecipeError, load_recipe
    from tests.training_fixtures import tiny_recipe, write_recipe

    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path / "t", tmp_path / "d.jsonl",
                                                          drafter={"kind": "dflashh"}))
    with pytest.raises(RecipeError, match="unknown drafter kind 'dflashh'"):
        load_recipe(path)


def test_an_identity_saved_before_drafter_kind_resumes():
    from eagle3_zoo.training.resume import identity_differences

    old = {"drafter.fc_norm": "False"}
    assert identity_differences(old, {**old, "drafter.kind": repr("eagle3")}) == []
    assert identity_differences(old, {**old, "drafter.kind": repr("toy")})
