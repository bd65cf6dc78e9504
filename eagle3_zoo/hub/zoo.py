"""The model zoo: known EAGLE-3 drafters and recipes, read from the packaged registry `resources/zoo.yaml`.

The zoo is data (as litgpt's config hub): a new drafter is one YAML entry with its source link, no code.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

STATUSES = ("published", "not-yet-published", "recipe-only")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ZooEntry:
    """One known drafter (or a recipe that trains one)."""

    name: str
    repo_id: str | None  # None: not on the Hub
    target: str
    family: str
    format: str  # sglang | official | speculators
    recipe: str | None  # path from the repository root
    status: str
    verified: bool  # the repo name was confirmed in the cited source
    source: str
    notes: str = ""


@lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    text = resources.files("eagle3_zoo").joinpath("resources", "zoo.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    known = {f.name for f in fields(ZooEntry)}
    for i, entry in enumerate(data["drafters"]):
        unknown, missing = set(entry) - known, known - set(entry) - {"notes"}
        if unknown or missing or entry["status"] not in STATUSES:
            raise ValueError(f"zoo.yaml drafters[{i}] ({entry.get('name')}): unknown fields {sorted(unknown)}, missing "
                             f"{sorted(missing)}, status {entry.get('status')!r} (valid: {', '.join(STATUSES)})")
    return data


def list_zoo(family: str | None = None, target: str | None = None) -> list[ZooEntry]:
    """The zoo entries, in registry order; optionally only one target family and/or one target.

    Args:
        family: HF ``model_type`` of the target (``qwen3``, ``gpt_oss``, ...), case-insensitive.
        target: Hub id or local name of the target (``Qwen/Qwen3-8B``, ``smollm2-135m-instruct``), case-insensitive.

    Raises:
        KeyError: a filter value no entry has, naming the closest known values.
    """
    entries = [ZooEntry(**{**e, "notes": e.get("notes") or ""}) for e in _registry()["drafters"]]
    if family is not None:
        entries = _filtered(entries, "family", family, lambda e: {e.family})
    if target is not None:
        entries = _filtered(entries, "target", target, lambda e: {e.target, target_hub_id(e.target) or e.target})
    return entries


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
        raise KeyError(f"no zoo entry named {name!r}; {zoo_hint(name)}")
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


def target_hub_id(target: str | None) -> str | None:
    """Hub id of a target name: the registry's `targets` map for local names, else the name if it looks like one."""
    if not target:
        return None
    mapped = (_registry().get("targets") or {}).get(target)
    if mapped:
        return mapped
    return target if _HUB_ID.fullmatch(target) else None


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
