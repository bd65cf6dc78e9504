"""The model zoo: known EAGLE-3 drafters and recipes (the packaged registry, `eagle3_zoo.values.zoo_registry`), listed,
looked up by name and resolved to the Hub repo to download.

The zoo is data (as litgpt's config hub): a new drafter is one YAML entry with its source link, no code.
"""

from __future__ import annotations

import difflib
from typing import Any

from eagle3_zoo.values.zoo_registry import ZooEntry, registry, target_hub_id


def list_zoo(family: str | None = None, target: str | None = None) -> list[ZooEntry]:
    """The zoo entries, in registry order; optionally only one target family and/or one target.

    Args:
        family: HF ``model_type`` of the target (``qwen3``, ``gpt_oss``, ...), case-insensitive; a family includes
            its variants named ``<family>_*`` (``qwen3`` lists the ``qwen3_moe`` drafters too).
        target: Hub id or local name of the target (``Qwen/Qwen3-8B``, ``smollm2-135m-instruct``), case-insensitive.

    Raises:
        KeyError: a filter value no entry has, naming the closest known values.
    """
    entries = [ZooEntry(**{**e, "notes": e.get("notes") or ""}) for e in registry()["drafters"]]
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


HINT_CUTOFF = 0.8


def zoo_hint(name: str, list_all: bool = True) -> str:
    """"did you mean A, B?" with the zoo names (or repo ids) close to `name` (or starting with it); else the known
    names (`list_all`) or a pointer to `eagle3-zoo zoo list`.

    Close means a similarity of at least `HINT_CUTOFF`: nearly every name ends in "eagle3", so at difflib's usual
    0.6 an unrelated name ("foo/bar-eagle3") would be offered three drafters it has nothing to do with.
    """
    entries = list_zoo()
    by_lower = {e.name.lower(): e.name for e in entries} | {e.repo_id.lower(): e.repo_id for e in entries if e.repo_id}
    wanted = name.lower()
    starting = [k for k in by_lower if len(wanted) >= 4 and k.startswith(wanted)]
    close = list(dict.fromkeys([*difflib.get_close_matches(wanted, list(by_lower), n=3, cutoff=HINT_CUTOFF),
                                *starting]))[:3]
    if close:
        return f"did you mean {', '.join(by_lower[c] for c in close)}?"
    return f"known: {', '.join(e.name for e in entries)}" if list_all else "see `eagle3-zoo zoo list`"


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
