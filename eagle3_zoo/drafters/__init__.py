"""Drafter kinds, one subpackage each, and their registry (torch-free at import: recipe validation reads
`kind_names`).

`get_kind(name)` returns the registered `DrafterKind` (`eagle3_zoo.drafters.base`); a built-in kind registers itself
when first asked for. `kind_of(drafter)` finds the kind of a built drafter, `kind_of_config(config)` the kind a
drafter config is of.
"""

from __future__ import annotations

import importlib
from typing import Any

from eagle3_zoo.drafters.base import (
    GUIDE,
    BlockProposer,
    DrafterKind,
    DraftModel,
    FeatureNeeds,
    StepLine,
    StepSizing,
    TargetLayers,
    register_kind,
    registered,
    unregister_kind,
)

DEFAULT_KIND = "eagle3"
BUILTIN_KINDS = ("eagle3", "dflash", "dspark")  # imported (and registered) on first use: `_load_builtin`


def kind_names() -> tuple[str, ...]:
    """The valid values of the recipe's `drafter.kind`: the built-in kinds, then any registered since."""
    return BUILTIN_KINDS + tuple(sorted(set(registered()) - set(BUILTIN_KINDS)))


def unknown_kind_message(name: Any) -> str:
    return (f"unknown drafter kind {name!r}; valid: {', '.join(kind_names())} (a new kind is registered with "
            f"eagle3_zoo.drafters.register_kind: {GUIDE})")


def _load_builtin(name: str) -> None:
    if name == "eagle3":
        from eagle3_zoo.drafters.eagle3 import kind  # noqa: F401 (registers the kind)
    elif name == "dflash":
        from eagle3_zoo.drafters.dflash import kind  # noqa: F401,F811 (registers the kind)
    elif name == "dspark":
        from eagle3_zoo.drafters.dspark import kind  # noqa: F401,F811 (registers the kind)


def get_kind(name: str) -> DrafterKind:
    """The drafter kind registered as `name`.

    Raises:
        ValueError: no such kind (the message names the valid ones and how to add one).
    """
    kinds = registered()
    if name not in kinds and name in BUILTIN_KINDS:
        _load_builtin(name)
        kinds = registered()
    if name not in kinds:
        raise ValueError(unknown_kind_message(name))
    return kinds[name]


# built-in kinds whose `config_from` and `step_lines` are torch-free functions of a module of their own: answered
# without importing the kind, whose module imports torch and its model code (`plan` imports no model code)
_TORCH_FREE_SIZING = {"eagle3": "eagle3_zoo.drafters.eagle3.sizing", "dflash": "eagle3_zoo.drafters.dflash.sizing"}


def _sized_by(name: str, function: str) -> Any:
    """The kind's `function` (`config_from`, `step_lines`): the torch-free module's for a built-in kind not imported
    yet, else the registered kind's method."""
    light = _TORCH_FREE_SIZING.get(name)
    if light is not None and name not in registered():
        return getattr(importlib.import_module(light), function)
    return getattr(get_kind(name), function)


def config_from(name: str, section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                defaults: dict[str, Any], target_name: str, torch_dtype: str) -> Any:
    """`DrafterKind.config_from` of the kind registered as `name`: the config of a fresh drafter sized like the
    target. A built-in kind not imported yet that builds its config without torch is not imported.

    Raises:
        ValueError: no such kind (`get_kind`).
    """
    return _sized_by(name, "config_from")(section, target_config, aux_layer_ids=aux_layer_ids, defaults=defaults,
                                          target_name=target_name, torch_dtype=torch_dtype)


def step_lines(name: str, section: Any, config: Any, target_config: Any, sizing: StepSizing) -> list[StepLine]:
    """`DrafterKind.step_lines` of the kind registered as `name`: the buffers of its training step, for `plan`. A
    built-in kind not imported yet is not imported.

    Raises:
        ValueError: no such kind (`get_kind`); NotImplementedError: a kind that does not size its step.
    """
    return _sized_by(name, "step_lines")(section, config, target_config, sizing)


def _specificity(kind: DrafterKind) -> int:
    return len(kind.drafter_class.__mro__) + len(kind.config_class.__mro__)


def _find_kind(owns: Any, what: str) -> DrafterKind:
    """The registered kind `owns` accepts; where several do (a kind whose drafter and config subclass another's, as
    DSpark's do DFlash's), the most derived one."""
    for name in BUILTIN_KINDS:
        get_kind(name)
    found = [kind for kind in registered().values() if owns(kind)]
    if found:
        return max(found, key=_specificity)  # the first of equals: registration order
    raise TypeError(f"{what} of no registered drafter kind ({', '.join(kind_names())}); see {GUIDE}")


def kind_of(drafter: Any) -> DrafterKind:
    """The kind whose drafter `drafter` is.

    Raises:
        TypeError: `drafter` belongs to no registered kind.
    """
    return _find_kind(lambda kind: kind.owns(drafter), f"{type(drafter).__name__} is the drafter")


def kind_of_config(config: Any) -> DrafterKind:
    """The kind whose drafters `config` configures (an instance of its `config_class`).

    Raises:
        TypeError: `config` belongs to no registered kind.
    """
    return _find_kind(lambda kind: isinstance(config, kind.config_class), f"{type(config).__name__} is the config")


__all__ = [
    "BUILTIN_KINDS",
    "BlockProposer",
    "DEFAULT_KIND",
    "DraftModel",
    "DrafterKind",
    "FeatureNeeds",
    "StepLine",
    "StepSizing",
    "TargetLayers",
    "config_from",
    "get_kind",
    "kind_names",
    "kind_of",
    "kind_of_config",
    "register_kind",
    "step_lines",
    "unknown_kind_message",
    "unregister_kind",
]
