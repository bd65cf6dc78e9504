"""The model zoo: known EAGLE-3 drafters and recipes, read from the packaged registry `resources/zoo.yaml`.

The zoo is data (as litgpt's config hub): a new drafter is one YAML entry with its source link, no code.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

import yaml

from eagle3_zoo import schema
from eagle3_zoo.locations import looks_like_hub_id

STATUSES = ("published", "not-yet-published", "recipe-only")
FORMATS = ("sglang", "official", "speculators")  # eagle3_zoo.hub.formats.FORMATS (not imported: it loads torch)


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
    for p in problems:
        p.source = source
    if problems:
        raise ZooRegistryError(problems)
    return data


@lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    path = resources.files("eagle3_zoo").joinpath("resources", "zoo.yaml")
    return read_registry(path.read_text(encoding="utf-8"), str(path))


def list_zoo(family: str | None = None, target: str | None = None) -> list[ZooEntry]:
    """The zoo entries, in registry order; optionally only one target family and/or one target.

    Args:
        family: HF ``model_type`` of the target (``qwen3``, ``gpt_oss``, ...), case-insensitive; a family includes
            its variants named ``<family>_*`` (``qwen3`` lists the ``qwen3_moe`` drafters too).
        target: Hub id or local name of the target (``Qwen/Qwen3-8B``, ``smollm2-135m-instruct``), case-insensitive.

    Raises:
        KeyError: a filter value no entry has, naming the closest known values.
    """
    entries = [ZooEntry(**{**e, "notes": e.get("notes") or ""}) for e in _registry()["drafters"]]
    if family is not None:
        entries = _filtered(entries, "family", family, _family_names)
    if target is not None:
        entries = _filtered(entries, "target", target, lambda e: {e.target, target_hub_id(e.target) or e.target})
    return entries


def _family_names(entry: ZooEntry) -> set[str]:
    """The family names that select `entry`: its own and every base it extends (`qwen3_moe` -> `qwen3`)."""
    parts = entry.family.split("_")
    return {"_".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _filtered(entries: list[ZooEntry], what: str, value: str, keys: Any) -> list[ZooEntry]:
    kept = [e for e in entries if value.lower() in {k.lower() for k in keys(e)}]
    if not kept:
        known = sorted({k for e in entries for k in keys(e)})
        close = difflib.get_close_matches(value, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise KeyError(f"no zoo entry has {what} {value!r}; {hint}known values: {', '.join(known)}")
    return kept


def show_zoo(name: str) -> ZooEntry:
    """The entry whose zoo name or Hub repo id is `name` (case-insensitive).

    Raises:
        KeyError: unknown name, with the closest names.
    """
    entry = find_zoo(name)
    if entry is None:
        raise KeyError(f"no zoo entry named {name!r}; {zoo_hint(name, list_all=False)}")
    return entry


def find_zoo(name: str) -> ZooEntry | None:
    """The entry whose zoo name or Hub repo id is `name` (case-insensitive), else None."""
    return next((e for e in list_zoo() if name.lower() in (e.name.lower(), (e.repo_id or "").lower())), None)


def zoo_hint(name: str, list_all: bool = True) -> str:
    """"did you mean A, B?" with the zoo names (or repo ids) closest to `name`; else the known names (`list_all`)
    or a pointer to `eagle3-zoo zoo list`."""
    entries = list_zoo()
    by_lower = {e.name.lower(): e.name for e in entries} | {e.repo_id.lower(): e.repo_id for e in entries if e.repo_id}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    if close:
        return f"did you mean {', '.join(by_lower[c] for c in close)}?"
    return f"known: {', '.join(e.name for e in entries)}" if list_all else "see `eagle3-zoo zoo list`"


def _hub_id(section: str, name: str | None, is_id: Any) -> str | None:
    """The registry's Hub id for a local name in `section` (targets, datasets), else `name` where `is_id(name)`."""
    if not name:
        return None
    return (_registry().get(section) or {}).get(name) or (name if is_id(name) else None)


def target_hub_id(target: str | None) -> str | None:
    """Hub id of a target name: the registry's `targets` map for local names, else the name if it looks like one."""
    return _hub_id("targets", target, looks_like_hub_id)


def dataset_hub_id(path: str | None) -> str | None:
    """Hub dataset id of a recipe data source: the registry's `datasets` map for local names (the embedded ShareGPT),
    else the path if it can only be a Hub id (not a local file)."""
    from eagle3_zoo.locations import is_hub_id

    return _hub_id("datasets", path, is_hub_id)


def resolve_repo_id(name: str) -> str:
    """A Hub repo id for `name`: a zoo entry's repo, or `name` itself when it is not a zoo name.

    Raises:
        ValueError: the zoo entry is not published (nothing to download).
    """
    entry = find_zoo(name)
    if entry is None:
        return name
    if not entry.repo_id:
        raise ValueError(f"zoo entry {entry.name!r} is {entry.status}: nothing to download. "
                         + (f"Train it with `eagle3-zoo fit {entry.recipe}`." if entry.recipe else ""))
    return entry.repo_id
