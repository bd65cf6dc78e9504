"""The packaged zoo registry `resources/zoo.yaml`, read and checked: its drafter entries and its maps from local
target and dataset names to Hub ids. Data only (no network, no torch), so every layer may read it: the shipped
target configs, the drafter-folder formats, the model card and the zoo commands (`eagle3_zoo.hub.zoo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

import yaml

from eagle3_zoo.util import schema
from eagle3_zoo.values import layout_names
from eagle3_zoo.values.locations import looks_like_hub_id

STATUSES = ("published", "not-yet-published", "recipe-only")
FORMATS = (*layout_names.BUILT_IN, *layout_names.DFLASH_BUILT_IN)  # the layouts a zoo entry's `format` may name
KINDS = ("eagle3", "dflash")  # the drafter kinds a zoo entry's `kind` may name (its format is a layout of that kind)


@dataclass(frozen=True)
class ZooEntry:
    """One known drafter (or a recipe that trains one)."""

    name: str
    repo_id: str | None  # None: not on the Hub
    target: str
    family: str
    format: Literal[FORMATS]
    recipe: str | None  # path from the repository root
    status: Literal[STATUSES]
    verified: bool  # the repo name was confirmed in the cited source
    source: str
    notes: str = ""
    kind: Literal[KINDS] = "eagle3"  # the drafter kind; `pull` refuses a download whose layout is of another kind


@dataclass
class _Registry:
    """The layout of zoo.yaml."""
    targets: dict = field(default_factory=dict)  # local target name -> Hub id
    datasets: dict = field(default_factory=dict)  # local data name -> Hub dataset id
    drafters: list[ZooEntry] = field(default_factory=list)


class ZooRegistryError(schema.ConfigError):
    """All problems of a zoo registry file, reported at once."""
    what = "zoo registry"


def read_registry(text: str, source: str = "zoo.yaml") -> dict[str, Any]:
    """The registry in `text` (zoo.yaml), checked against `ZooEntry`: every unknown or missing field, wrong type and
    unknown status or format is raised at once (`ZooRegistryError`), each naming its entry (`drafters[3].status`)."""
    data, problems = yaml.safe_load(text), []
    schema.check_types(data, _Registry, "", problems)
    names = [e.get("name") for e in (data or {}).get("drafters") or [] if isinstance(e, dict)] if not problems else []
    problems += [schema.ConfigProblem(f"drafters[{i}].name", "used by an earlier entry too", name)
                 for i, name in enumerate(names) if name in names[:i]]
    if not problems:
        for i, e in enumerate(data.get("drafters") or []):
            layout, kind = layout_names.info(e["format"]), e.get("kind", "eagle3")
            if layout is not None and layout.kind != kind:
                problems.append(schema.ConfigProblem(
                    f"drafters[{i}].kind", f"format {e['format']!r} is a layout of {layout.kind} drafters; formats of "
                    f"{kind} drafters: {', '.join(layout_names.layout_names(kind))}", kind))
    for p in problems:
        p.source = source
    if problems:
        raise ZooRegistryError(problems)
    return data


@lru_cache(maxsize=1)
def registry() -> dict[str, Any]:
    path = resources.files("eagle3_zoo").joinpath("resources", "zoo.yaml")
    return read_registry(path.read_text(encoding="utf-8"), str(path))


def _hub_id(section: str, name: str | None, is_id: Any) -> str | None:
    """The registry's Hub id for a local name in `section` (targets, datasets), else `name` where `is_id(name)`."""
    if not name:
        return None
    return (registry().get(section) or {}).get(name) or (name if is_id(name) else None)


def target_hub_id(target: str | None) -> str | None:
    """Hub id of a target name: the registry's `targets` map for local names, else the name if it looks like one."""
    return _hub_id("targets", target, looks_like_hub_id)


def dataset_hub_id(path: str | None) -> str | None:
    """Hub dataset id of a recipe data source: the registry's `datasets` map for local names (the embedded ShareGPT),
    else the path if it can only be a Hub id (not a local file)."""
    from eagle3_zoo.values.locations import is_hub_id

    return _hub_id("datasets", path, is_hub_id)
