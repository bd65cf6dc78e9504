"""The names of the drafter-folder layouts, and what is said of each without reading a folder: no torch, no package
import, so the CLI's choices, the zoo registry's `format` field and the model card read them at no cost.

A layout (`eagle3_zoo.checkpoint.layouts.Layout`: detection, config, key map, aux-id convention, writer) carries its
`LayoutInfo`; the built-in layouts' infos are declared here, and `register_info` adds another's (a layout object
registered with `eagle3_zoo.checkpoint.layouts.register` registers its info too).
"""

from __future__ import annotations

from dataclasses import dataclass

CANONICAL = "sglang"  # the EAGLE-3 layout eagle3-zoo writes, SGLang and vLLM load, `from_pretrained` reads


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
        kind: the drafter kind whose folders it holds ("eagle3", "dflash", "dspark"); a folder is written only in a
            layout of its own kind.
        kind_aliases: names of a layout of another kind that mean this layout for a drafter of this kind
            (`export --format speculators` of a DFlash folder writes `speculators-dflash`).
    """

    name: str
    aliases: tuple[str, ...] = ()
    writable: bool = False
    description: str | None = None
    engines: tuple[str, ...] = ()
    card_tags: tuple[str, ...] = ()
    kind: str = "eagle3"
    kind_aliases: tuple[str, ...] = ()


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

DFLASH = LayoutInfo(
    "dflash", aliases=("z-lab", "zlab"), writable=True,
    description="z-lab DFlash layout (`DFlashDraftModel`, `dflash_config` with 0-based target-layer-output ids)",
    engines=("vllm", "sglang"), kind="dflash")
SPECULATORS_DFLASH = LayoutInfo(
    "speculators-dflash", aliases=("dflash-speculators",), writable=True,
    description="vLLM speculators DFlash format (`speculators_model_type: dflash`, `aux_hidden_state_layer_ids` = "
                "target layer id + 1, `sliding_window_non_causal: true`)",
    engines=("vllm",), card_tags=("speculators",), kind="dflash", kind_aliases=("speculators",))

DSPARK = LayoutInfo(
    "dspark", writable=True,
    description="DSpark layout vLLM 0.32's `qwen3_dspark.py` loads (`Qwen3DSparkModel`: the z-lab DFlash config with "
                "`markov_rank`, `enable_confidence_head`, `sample_from_anchor`; `markov_head.*`, `confidence_head.*`)",
    engines=("vllm",), kind="dspark")

_INFOS: dict[str, LayoutInfo] = {info.name: info for info in (SGLANG, OFFICIAL, SPECULATORS)}
BUILT_IN = tuple(_INFOS)  # ("sglang", "official", "speculators"): the EAGLE-3 layouts this package reads
_INFOS.update({info.name: info for info in (DFLASH, SPECULATORS_DFLASH)})
DFLASH_BUILT_IN = (DFLASH.name, SPECULATORS_DFLASH.name)  # the DFlash layouts this package reads and writes
_INFOS[DSPARK.name] = DSPARK
DSPARK_BUILT_IN = (DSPARK.name,)  # the DSpark layout this package reads and writes (speculators' dspark: not yet)


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
    if name in BUILT_IN or name in DFLASH_BUILT_IN or name in DSPARK_BUILT_IN:
        raise ValueError(f"{name!r} is a built-in layout; it cannot be removed")
    _INFOS.pop(name, None)


def layout_names(kind: str | None = None) -> tuple[str, ...]:
    """Every layout read (with `kind`: those of that drafter kind), built-in first."""
    return tuple(n for n, i in _INFOS.items() if kind is None or i.kind == kind)


def export_names(kind: str | None = None) -> dict[str, str]:
    """Name or alias -> layout name, for every layout that is written (`export --format` and the like); with `kind`,
    the names a drafter of that kind is written under (its layouts' names, aliases and `kind_aliases`)."""
    if kind is None:
        return {n: i.name for i in _INFOS.values() if i.writable for n in (i.name, *i.aliases)}
    return {n: i.name for i in _INFOS.values() if i.writable and i.kind == kind
            for n in (i.name, *i.aliases, *i.kind_aliases)}


def default_layout(kind: str | None) -> str:
    """The layout a drafter of `kind` is written in when no format is named: the canonical one for EAGLE-3 (and an
    unknown kind), the first written layout of another kind (`dflash` for DFlash)."""
    return next((i.name for i in _INFOS.values() if i.writable and i.kind == kind and kind != "eagle3"), CANONICAL)


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
