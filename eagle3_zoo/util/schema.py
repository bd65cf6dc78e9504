"""Typed YAML configs: dataclass schemas whose fields carry their own value rules, read with every problem at once.

The recipe (`eagle3_zoo.recipe.sections`), the zoo registry (`resources/zoo.yaml`) and the chat formats
(`resources/chat_formats/*.yaml`) are read this way. A schema is a dataclass tree; types and choices come from the
annotations (`Literal[...]`, `X | None`, `list[X]`, `tuple[X, ...]`, nested dataclasses) and a value rule sits on
its field (`ruled(default, check)`):

    problems = []
    raw = check_types(yaml.safe_load(text), MySchema, "", problems)  # unknown keys, missing keys, wrong types
    if not problems:
        problems = value_problems(MySchema(**raw))  # each field's own rule
    problems += unechoed(cross_field_problems, problems)  # rules over several fields, unless they read a bad key
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

try:  # omegaconf's marker of a required field; the value rules work without omegaconf (the lent GPU image has none)
    from omegaconf import MISSING
except ImportError:  # then nothing here meets a field OmegaConf marked
    MISSING = "???"

Check = Callable[[Any], "str | None"]  # a value rule: why a (non-null) value is bad, or None
BAD = object()  # `check_types`: no part of the value has the expected type
_NO_VALUE = object()


def ruled(default: Any = None, check: Check | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field whose value must pass `check` unless it is null (= off/default)."""
    return field(metadata={"check": check}, **({"default_factory": factory} if factory else {"default": default}))


def rule(ok: Callable[[Any], bool], message: str) -> Check:
    """A value rule from a predicate and the message for values that fail it."""
    return lambda v: None if ok(v) else message


GT0, GE0, UNIT = (rule(lambda v: v > 0, "must be > 0"), rule(lambda v: v >= 0, "must be >= 0"),
                  rule(lambda v: 0 <= v <= 1, "must be in [0, 1]"))


@dataclass
class ConfigProblem:
    """One problem in a config: where it comes from, the dotted key, the bad value and what is expected."""
    key: str
    message: str
    value: Any = _NO_VALUE
    source: str = ""  # the file (or override) it comes from
    related: tuple[str, ...] = ()  # other keys the check read; a type error there makes this check moot

    def __str__(self) -> str:
        return f"{self.source}: {self.key}{'' if self.value is _NO_VALUE else f' = {self.value!r}'}: {self.message}"


class ConfigError(ValueError):
    """All problems of a config, reported at once."""
    what = "config"

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid {self.what} ({len(self.problems)} {noun}):\n" +
                         "\n".join(f"  - {p}" for p in problems))


def did_you_mean(word: Any, choices: Iterable[str], prefix: str = "") -> str:
    """"; did you mean 'X'?" for the choice closest to `word` (or the first it is a prefix of, 32 -> 32-true)."""
    choices = [str(c) for c in choices]
    match = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    match = match or [c for c in choices if c.startswith(str(word))][:1]
    return f"; did you mean '{prefix}{match[0]}'?" if match else ""


def describe(tp: Any) -> str:
    """A type annotation in words, as error messages say what is expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is list or (origin is tuple and args[1:] == (...,)):
        plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(args[0])
        plural = "mappings" if dataclasses.is_dataclass(args[0]) else plural
        return f"a list of {plural or 'values, each ' + describe(args[0])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}.get(
        origin or tp, str(tp))


def _leaf_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Leaf name -> dotted key over a whole schema, to suggest `optim.lr` for a misplaced `trainer.lr`."""
    out: dict[str, str] = {}
    for name, tp in typing.get_type_hints(cls).items():
        out.update(_leaf_keys(tp, f"{prefix}{name}.")) if dataclasses.is_dataclass(tp) else \
            out.setdefault(name, prefix + name)
    return out


def check_types(raw: Any, tp: Any, key: str, problems: list[ConfigProblem], root: type | None = None) -> Any:
    """The part of `raw` that has type `tp` (`BAD`: none), each mismatch added to `problems`: unknown keys with a
    "did you mean" (over the whole schema `root`), missing required keys, bad list items one by one (a bad mapping
    in a list is left out, the others kept). Types are strict: no "4" for an integer, no true for 1. A
    `tuple[X, ...]` is read from a list; a mapping for a `Section | None` is checked as that section."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(raw, dict):
        hints, clean, section = typing.get_type_hints(tp), {}, f"{key}." if key else ""
        for name, value in raw.items():
            if name not in hints:
                dotted = _leaf_keys(root or tp).get(name)
                hint = did_you_mean(name, hints, section) or (
                    f"; did you mean '{dotted}'?" if dotted and not dotted.startswith(key + ".") else "")
                problems.append(ConfigProblem(section + str(name), "unknown key; " + (
                    hint[2:] or f"valid keys here: {', '.join(hints)}")))
            elif (value := check_types(value, hints[name], section + name, problems, root or tp)) is not BAD:
                clean[name] = value
        missing = [f.name for f in dataclasses.fields(tp) if f.name not in raw and (f.default is MISSING or (
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING))]
        problems += [ConfigProblem(section + n, f"required key missing (expected {describe(hints[n])})")
                     for n in missing]
        return BAD if missing else clean
    if (origin is list or (origin is tuple and args[1:] == (...,))) and isinstance(raw, list):  # YAML: lists
        items = [check_types(v, args[0], f"{key}[{i}]", problems, root) for i, v in enumerate(raw)]
        good = [v for v in items if v is not BAD]
        return origin(good) if len(good) == len(items) or dataclasses.is_dataclass(args[0]) else BAD
    if origin in (typing.Union, types.UnionType):
        if isinstance(raw, dict) and (section := next((a for a in args if dataclasses.is_dataclass(a)), None)):
            return check_types(raw, section, key, problems, root)  # an optional section given: checked as one
        ok = any(check_types(raw, a, key, [], root) is not BAD for a in args)
    elif origin is Literal:
        ok = isinstance(raw, str) and raw in args
    else:  # a bool is no integer; an integer is a number
        ok = not dataclasses.is_dataclass(tp) and isinstance(raw, bool) == (tp is bool) and isinstance(
            raw, (int, float) if tp is float else origin or tp)
    if ok:
        return raw
    choices = [c for a in (tp, *args) if typing.get_origin(a) is Literal for c in typing.get_args(a)]
    hint = did_you_mean(raw, choices) if isinstance(raw, str) and choices else ""
    problems.append(ConfigProblem(key or "<root>", f"expected {describe(tp)}{hint}", raw))
    return BAD


def value_problems(obj: Any, prefix: str = "") -> list[ConfigProblem]:
    """Each field's own rule (`ruled`) over a typed config, nested sections and list items included."""
    out = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if value is not None and f.metadata.get("check") and (msg := f.metadata["check"](value)):
            out.append(ConfigProblem(key, msg, value))
        for i, sub in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if dataclasses.is_dataclass(sub):
                out += value_problems(sub, f"{key}." if i is None else f"{key}[{i}].")
    return out


def unechoed(checks: list[ConfigProblem], problems: list[ConfigProblem]) -> list[ConfigProblem]:
    """The `checks` that read (`key`, `related`) no key with a problem in `problems`, nor a key or item under it: a
    check over a badly typed value would only echo that problem."""
    bad = {p.key for p in problems}
    return [c for c in checks if not any(
        b == k or b.startswith((k + ".", k + "[")) for b in bad for k in (c.key, *c.related))]
