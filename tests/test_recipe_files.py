"""What a recipe file that is not a mapping of keys gives: one RecipeError line, never a traceback or a silent pass."""

from __future__ import annotations

import pytest

from eagle3_zoo.recipe.sections import Recipe, RecipeError, load_recipe


@pytest.mark.parametrize("text,message", [
    ("5\n", "<root> = 5: expected a mapping at the top level"),
    ("foo\n", "<root> = 'foo': expected a mapping at the top level"),
    ("- a\n- b\n", "<root> = ['a', 'b']: expected a mapping at the top level"),
    ("null\n", "<file>: empty recipe file (no keys)"),
    ("a: 1\na: 2\n", "<yaml>: while constructing a mapping"),  # a duplicate key (OmegaConf's loader refuses it)
])
def test_a_file_that_is_no_mapping_is_one_problem(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert [str(p) for p in exc.value.problems] == [f"{path}: {message}"]


def test_an_empty_mapping_is_all_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text("{}\n")
    assert load_recipe(tmp_path / "r.yaml") == Recipe()
