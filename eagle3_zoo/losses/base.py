"""The loss registry: a `Loss` is one class in one module of this package, registered by name, with its own
parameters dataclass (`Loss.Params`, read from the recipe's `loss.params`).

This module and the loss modules import no torch at the top: recipe validation reads the registry (the names and
each loss's `Params`) and must answer before torch is imported. A loss's methods run on tensors (`chunk`, in the
fused lm_head loss of every training step; `reference`, in the tests) and import torch where they need it.
"""

from __future__ import annotations

import abc
import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from eagle3_zoo.util import schema
from eagle3_zoo.util.schema import ConfigProblem

GUIDE = "docs/contributing/adding-a-loss.md"


@dataclasses.dataclass
class NoParams:
    """The parameters of a loss that has none."""


class Loss(abc.ABC):
    """A per-position objective of a TTT step: a function of the drafter's logits z over the draft vocabulary and
    the target's distribution p over it (rows summing to 1); `drafters.eagle3.ttt.ttt_loss` sums it over the supervised
    positions with the TTT step weights.

    A subclass sets `Params` (a dataclass whose fields carry their value rules, `eagle3_zoo.util.schema.ruled`; the
    recipe's `loss.params` is read into it) and implements `chunk` and `reference`; `@register_loss("name")` makes
    it a recipe's `loss.name`.
    """

    name: ClassVar[str] = ""  # set by `register_loss`
    Params: ClassVar[type] = NoParams

    def __init__(self, params: Any = None):
        self.params = self.Params() if params is None else params

    @abc.abstractmethod
    def chunk(self, c: Any) -> Any:
        """The loss of each row of a chunk, and its gradient d loss / d logits formed by hand (no autograd), from
        the softmax pass every loss shares (`c`: an `eagle3_zoo.losses.chunk.Chunk`: q, p, the cross-entropy, the
        acceptance terms; this module imports no torch, hence the loose annotations). The gradient
        may be written into `c.q` (the logits buffer); every entry must be at most 2 in magnitude (the fused loss
        casts it to bf16/fp16). Returns `c.result(loss, reported alpha, grad)`."""

    @abc.abstractmethod
    def reference(self, r: Any) -> Any:
        """`[n]` the same loss written naively from `r` (a `chunk.ReferenceTerms`), differentiable by autograd
        through `r.logq` (tests compare the two: value and gradient)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"


_L = TypeVar("_L", bound=type[Loss])
_REGISTRY: dict[str, type[Loss]] = {}


class UnknownLossError(ValueError):
    """A loss name no module registered."""


def register_loss(name: str) -> Callable[[_L], _L]:
    """Class decorator registering a `Loss` subclass as the recipe's `loss.name == name`.

    Raises:
        ValueError: another class is already registered under `name`, or `Params` is not a dataclass.
    """

    def decorate(cls: _L) -> _L:
        known = _REGISTRY.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"loss '{name}' is already registered by {known.__module__}.{known.__qualname__}")
        if not dataclasses.is_dataclass(cls.Params):
            raise ValueError(f"loss '{name}': {cls.__qualname__}.Params must be a dataclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_losses() -> list[str]:
    """Registered loss names, sorted."""
    return sorted(_REGISTRY)


def unknown_loss_message(name: str) -> str:
    """What is wrong with a loss name no module registered, and where to read on."""
    names = available_losses()
    return f"expected one of {', '.join(names)}" + schema.did_you_mean(name, names) + f"; to add a loss see {GUIDE}"


def get_loss(name: str) -> type[Loss]:
    """The class registered as `name`.

    Raises:
        UnknownLossError: naming the registered losses and the page on adding one.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        names = available_losses()
        raise UnknownLossError(f"unknown TTT loss {name!r}; valid: {', '.join(names)}" +
                               schema.did_you_mean(name, names) + f"; to add a loss see {GUIDE}")
    return cls


def params_problems(name: str, params: Mapping[str, Any], key: str = "loss.params") -> list[ConfigProblem]:
    """The problems of `params` for the loss `name` (unknown keys, types, each field's rule), keyed `key.<field>`;
    none for an unknown name (its own problem)."""
    cls = _REGISTRY.get(name)
    if cls is None:
        return []
    problems: list[ConfigProblem] = []
    if not isinstance(params, Mapping):
        return [ConfigProblem(key, f"expected a mapping of {cls.Params.__name__} fields", params)]
    if not dataclasses.fields(cls.Params) and params:
        return [ConfigProblem(f"{key}.{k}", f"unknown key; loss '{name}' has no parameters (see {GUIDE})")
                for k in params]
    clean = schema.check_types(dict(params), cls.Params, key, problems)
    for p in problems:
        if p.message.startswith("unknown key"):
            p.message += f" (the parameters of loss '{name}')"
    if not problems:
        problems = schema.value_problems(cls.Params(**clean), f"{key}.")
    return problems


def make_loss(name: str, params: Mapping[str, Any] | None = None) -> Loss:
    """The loss `name` with `params` (a mapping of its `Params` fields; missing ones take their defaults).

    Raises:
        UnknownLossError: `name` is not registered.
        ValueError: `params` do not fit the loss's `Params`, every problem named.
    """
    cls = get_loss(name)
    params = dict(params or {})
    problems = params_problems(name, params)
    if problems:
        raise ValueError(f"bad parameters for TTT loss {name!r}: " + "; ".join(str(p).lstrip(": ") for p in problems))
    hints = typing.get_type_hints(cls.Params)  # a recipe's 5 for a float field is 5.0, as the recipe's own floats
    return cls(cls.Params(**{k: float(v) if hints[k] is float and type(v) is int else v for k, v in params.items()}))
