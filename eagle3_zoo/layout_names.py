"""The names of the drafter-folder layouts, and what is said of each without reading a folder: no torch, no package
import, so the CLI's choices, the zoo registry's `format` field and the model card read them at no cost.

A layout (`eagle3_zoo.checkpoint.layouts.Layout`: detection, config, key map, aux-id convention, writer) carries its
`LayoutInfo`; the built-in layouts' infos are declared here, and `register_info` adds another's (a layout object
registered with `eagle3_zoo.checkpoint.layouts.register` registers its info too).
"""

from __future__ import annotations

from dataclasses import dataclass

CANONICAL = "sglang"  # the layout eagle3-zoo writes, SGLang and vLLM load, and `Eagle3Drafter.from_pretrained` reads


@dataclass(frozen=True)
class LayoutInfo:
    """What names a layout and what a model card says of it.

    Attributes:
        name: the layout's name (`detect_format` returns it; `resources/zoo.yaml` entries use it).
        aliases: other names `export --format`, `publish --format` and `pull --convert-to` accept for it.
        writable: `export`, `publish` and `pull --convert-to` write it (its `Layout` has a writer).
        description: what a model card says of the layout; None: the card describes the canonical layout (the
            layout is read, never published).
        engines: the serving engines that load a folder of this layout as shipped (card snippets and tags; vLLM is
            given such a folder as it is by `eval --engine vllm`).
        card_tags: Hub tags a card of this layout adds besides the engines.
    """

    name: str
    aliases: tuple[str, ...] = ()
    writable: bool = False
    description: str | None = None
    engines: tuple[str, ...] = ()
    card_tags: tuple[str, ...] = ()


SGLANG = LayoutInfo(
    CANONICAL, aliases=("canonical",), writable=True,
    description="SGLang / canonical EAGLE-3 layout (`model.safetensors` with `midlayer.*` keys, "
                "`LlamaForCausalLMEagle3`)",
    engines=("sglang", "vllm"))
OFFICIAL = LayoutInfo("official")  # the yuhuili/EAGLE3-* releases: read, converted, never written
SPECULATORS = LayoutInfo(
    "speculators", writable=True,
    description="vLLM speculators format (`Eagle3Speculator`, `speculators_model_type: eagle3`)",
    engines=("vllm",), card_tags=("speculators",))

_INFOS: dict[str, LayoutInfo] = {info.name: info for info in (SGLANG, OFFICIAL, SPECULATORS)}
BUILT_IN = tuple(_INFOS)  # ("sglang", "official", "speculators"): the layouts this package reads


def register_info(info: LayoutInfo) -> None:
    """Add a layout's names (a new layout's name and aliases must be new: no layout is replaced).

    Raises:
        ValueError: the name or an alias is taken.
    """
    taken = {n for i in _INFOS.values() for n in (i.name, *i.aliases)}
    clash = [n for n in (info.name, *info.aliases) if n in taken]
    if clash and _INFOS.get(info.name) != info:
        raise ValueError(f"layout {info.name!r}: {', '.join(map(repr, clash))} already names a layout; taken: "
                         f"{', '.join(sorted(taken))}")
    _INFOS[info.name] = info


def unregister_info(name: str) -> None:
    """Remove a layout added by `register_info` (the built-in ones stay)."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is a built-in layout; it cannot be removed")
    _INFOS.pop(name, None)


def layout_names() -> tuple[str, ...]:
    """Every layout read, built-in first."""
    return tuple(_INFOS)


def export_names() -> dict[str, str]:
    """Name or alias -> layout name, for every layout that is written (`export --format` and the like)."""
    return {n: i.name for i in _INFOS.values() if i.writable for n in (i.name, *i.aliases)}


def export_choices() -> list[str]:
    """The names `export --format`, `publish --format` and `pull --convert-to` accept, sorted."""
    return sorted(export_names())


def info(name: str | None) -> LayoutInfo | None:
    """The info of a layout by its name or one of its aliases (None: no such layout)."""
    if name is None:
        return None
    return _INFOS.get(name) or next((i for i in _INFOS.values() if name in i.aliases), None)


def card_info(name: str | None) -> LayoutInfo:
    """The info a model card describes for a folder of layout `name`: its own when it has a description (a published
    layout), else the canonical layout's (a layout only read, an unknown name, or None)."""
    found = info(name)
    return found if found is not None and found.description is not None else _INFOS[CANONICAL]
