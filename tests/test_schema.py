"""The one checker for YAML read into dataclasses (`eagle3_zoo.util.schema`), on its own: what `check_types` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eagle3_zoo.util.schema import BAD, check_types


@dataclass
class Item:
    name: str
    size: int = 1


@dataclass
class Conf:
    items: list[Item] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    pair: tuple[str, ...] = ()
    mode: Literal["a", "b"] = "a"
    rate: float = 1.0
    flag: bool = False


def _check(raw):
    problems = []
    return check_types(raw, Conf, "", problems), [f"{p.key}: {p.message}" for p in problems]


def test_a_mapping_without_a_required_key_is_left_out_and_the_good_ones_kept():
    clean, problems = _check({"items": [{"name": "x"}, {"size": 2}, {"name": "y", "size": 3}]})
    assert clean == {"items": [{"name": "x"}, {"name": "y", "size": 3}]}
    assert problems == ["items[1].name: required key missing (expected a string)"]
    assert check_types({"size": 2}, Item, "", []) is BAD  # never a partial mapping that cannot build the dataclass


def test_types_are_strict_and_a_list_with_a_bad_scalar_is_dropped_whole():
    clean, problems = _check({"ids": [1, "2"], "rate": 2, "flag": 1, "mode": "c", "pair": ["p", "q"],
                              "items": [{"name": "z", "size": True}]})
    assert clean == {"rate": 2, "pair": ("p", "q"), "items": [{"name": "z"}]}  # a list becomes the tuple declared
    assert problems == ["ids[1]: expected an integer", "flag: expected true or false", "mode: expected one of a, b",
                        "items[0].size: expected an integer"]  # true is no integer (YAML would not say 1)
