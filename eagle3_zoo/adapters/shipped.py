"""Target configs shipped inside the package (`resources/targets/<org>--<name>.json`), so that planning a recipe and
checking a drafter against a zoo target work offline. Architecture fields only, each file citing its source."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

_DIR = ("resources", "targets")


def _file_name(hub_id: str) -> str:
    return hub_id.replace("/", "--") + ".json"


def shipped_target_ids() -> list[str]:
    """Hub ids of every shipped target config."""
    folder = resources.files("eagle3_zoo").joinpath(*_DIR)
    return sorted(p.name[: -len(".json")].replace("--", "/", 1) for p in folder.iterdir() if p.name.endswith(".json"))


def shipped_target_dict(name: str) -> dict[str, Any] | None:
    """The shipped config.json of a target (Hub id, or a local alias the zoo maps to one), or None."""
    from eagle3_zoo.values.zoo_registry import target_hub_id

    hub_id = target_hub_id(name) or name
    path = resources.files("eagle3_zoo").joinpath(*_DIR, _file_name(hub_id))
    if "/" not in hub_id or not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("_source", None)
    return {**data, "_name_or_path": hub_id}


def shipped_target_config(name: str) -> Any | None:
    """The shipped config of a target as a transformers `PretrainedConfig`, or None."""
    data = shipped_target_dict(name)
    if data is None:
        return None
    from transformers import AutoConfig

    name_or_path = data.pop("_name_or_path")
    config = AutoConfig.for_model(**data)
    config._name_or_path = name_or_path
    return config


class ResolvedConfig:
    """A target config as transformers resolved it (its `to_dict()`, defaults filled in), read back without
    transformers: attribute access and `to_dict()`, what planning reads. `eagle3_zoo.training.planner.plan` keeps one
    per shipped target, with the transformers version that resolved it."""

    def __init__(self, data: dict[str, Any], name_or_path: str) -> None:
        self.__dict__.update(data)
        self._name_or_path = name_or_path

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ResolvedConfig({self._name_or_path!r}, model_type={getattr(self, 'model_type', None)!r})"
