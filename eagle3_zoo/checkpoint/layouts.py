"""Drafter-folder layouts as objects, and their registry: a layout is one `Layout`.

A layout holds everything that differs between two folders of the same EAGLE-3 weights: how it is recognised
(`claims` its config.json, or the kind of weight file `weight_kind`), its config read into an `Eagle3Config`
(`read_config`) and written back (`write`), its key map (`key_prefixes`), where its config stores the aux layer ids
and in which convention (`stored_aux_ids`, `aux_convention_problems`), its own checks (`architecture_problems`,
`config_problems`), and whether the engines of its `info` (`eagle3_zoo.values.layout_names.LayoutInfo`: names, aliases,
card text, engines, card tags) load a folder of it as shipped (`served_as_is`). `register` adds one; everything that
reads, checks, converts, serves or publishes a drafter folder asks the registry (`detect_layout`, `get_layout`,
`export_layout`), never a layout's name.

Three are built in (`eagle3_zoo.checkpoint.formats` describes them): `sglang` (canonical), `official`, `speculators`.
No torch at import: the writers import it when they write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.dflash_layouts import DSparkLayout, SpeculatorsDFlashLayout, ZLabDFlashLayout
from eagle3_zoo.checkpoint.formats import (
    EAGLE31_FLAGS,
    LAYER_CONFIG_KEYS,
    SPECULATORS_ARCHITECTURE,
    canonical_keys,
    read_config,
    refuse_unsupported_variants,
    speculators_config,
    verifier_resolvable,
)
from eagle3_zoo.checkpoint.layout_base import Layout
from eagle3_zoo.checkpoint.weights import CheckpointError, find_weight_files
from eagle3_zoo.modeling import Eagle3Config
from eagle3_zoo.modeling.config import ARCHITECTURE
from eagle3_zoo.values import layout_names

if TYPE_CHECKING:
    from eagle3_zoo.modeling import Eagle3Drafter


class CanonicalLayout(Layout):
    """`sglang` (canonical): what `Eagle3Drafter.save_pretrained` writes; SpecForge's safetensors too."""

    info = layout_names.SGLANG
    weight_kind = "safetensors"
    copies_canonical_bytes = True

    def write(self, drafter: Eagle3Drafter, out: Path, **options: Any) -> None:
        drafter.save_pretrained(out)

    def served_as_is(self, folder: Path) -> bool:
        return is_canonical(folder)  # SpecForge's `model.`-prefixed keys are exported first


class OfficialLayout(Layout):
    """`official`: the yuhuili/EAGLE3-* releases (`pytorch_model.bin`, read safely); read, never written."""

    info = layout_names.OFFICIAL
    weight_kind = "pickle"


class SpeculatorsLayout(Layout):
    """`speculators`: vLLM's format, a nested `transformer_layer_config`, `layers.0.*` keys, aux ids at the top level
    in HF hidden-state indices (the internal convention)."""

    info = layout_names.SPECULATORS
    key_prefixes = {"midlayer.": "layers.0."}
    norm_output_ambiguous = False
    speculators_model_type = "eagle3"

    def claims(self, raw: dict[str, Any], source: str) -> bool:
        if "speculators_model_type" not in raw:
            return False
        model_type = raw["speculators_model_type"]
        if model_type == self.speculators_model_type:
            return True
        known = [t for t in (layout.speculators_model_type for layout in _LAYOUTS.values()) if t]
        if model_type in known:
            return False  # another registered layout's (speculators-dflash)
        raise ValueError(f"{source}: speculators_model_type={model_type!r}; only {', '.join(map(repr, known))} "
                         "checkpoints (EAGLE-3 and DFlash drafters) are read here")

    def read_config(self, raw: dict[str, Any], source: str) -> Eagle3Config:
        layer = raw.get("transformer_layer_config") or raw.get("transformer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{source}: speculators config without a transformer_layer_config object")
        flat: dict[str, Any] = {k: layer[k] for k in LAYER_CONFIG_KEYS if k in layer}
        flat["torch_dtype"] = raw.get("torch_dtype") or layer.get("torch_dtype") or layer.get("dtype")
        flat["draft_vocab_size"] = raw.get("draft_vocab_size", 32000)  # speculators' schema default
        flat["target_hidden_size"] = raw.get("target_hidden_size")
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
        zoo = dict(raw.get("eagle3_zoo") or {})
        zoo.setdefault("target_name_or_path", verifier.get("name_or_path"))
        flat["eagle3_zoo"] = zoo
        flat.update({k: raw[k] for k in EAGLE31_FLAGS if k in raw})  # speculators writes them at the top level too
        cfg = Eagle3Config.from_json_dict(flat, source=source)
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        cfg.aux_layer_ids = tuple(int(i) for i in ids) if ids else None  # speculators ids = internal convention
        return cfg

    def write(self, drafter: Eagle3Drafter, out: Path, *, num_speculative_tokens: int = 3,
              verifier_architectures: list[str] | None = None, verifier: str | None = None, **_: Any) -> None:
        from safetensors.torch import save_file

        from eagle3_zoo.checkpoint.weights import SAFETENSORS_NAME
        from eagle3_zoo.modeling import CONFIG_NAME
        from eagle3_zoo.util.fileio import atomic_write, atomic_write_text
        from eagle3_zoo.values.dtypes import torch_dtype

        config = speculators_config(drafter.config, num_speculative_tokens, verifier_architectures, verifier)
        dtype = torch_dtype(drafter.config.torch_dtype)
        tensors = {self.stored_name(k): (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
                   for k, v in drafter.state_dict().items()}
        atomic_write(out / SAFETENSORS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2) + "\n")

    def stored_aux_ids(self, raw: dict[str, Any]) -> Any:
        return raw.get("eagle_aux_hidden_state_layer_ids")

    def aux_convention_problems(self, raw: dict[str, Any], ids: tuple[int, ...], default: tuple[int, ...],
                                report: CheckReport) -> None:
        if tuple(i + 1 for i in ids) == default:
            report.add("AUX_LAYER_CONVENTION", f"eagle_aux_hidden_state_layer_ids = {list(ids)} equals SGLang's "
                       f"output-index form of the default {list(default)}, but vLLM reads this field as HF "
                       "hidden-state indices: it will capture one layer earlier than the default. The ids look like "
                       "SGLang indices stored in vLLM's field", f"if the drafter was trained on the default layers, "
                       f"store {list(default)}", "warning")

    def architecture_problems(self, raw: dict[str, Any], report: CheckReport) -> None:
        arch = raw.get("architectures")
        if arch != [SPECULATORS_ARCHITECTURE]:
            report.add("ARCHITECTURE", f"architectures={arch}, expected ['{SPECULATORS_ARCHITECTURE}'] for a "
                       "speculators checkpoint", f"set architectures to ['{SPECULATORS_ARCHITECTURE}']", "warning")

    def config_problems(self, raw: dict[str, Any], report: CheckReport) -> None:
        spec = raw.get("speculators_config") or {}
        methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
        missing = [name for name, ok in (
            ("speculators_config.proposal_methods[0].speculative_tokens",
             isinstance(methods, list) and methods and isinstance(methods[0], dict)
             and "speculative_tokens" in methods[0]),
            ("speculators_config.verifier.name_or_path", bool((spec.get("verifier") or {}).get("name_or_path"))),
        ) if not ok]
        if missing:
            report.add("SPECULATORS_CONFIG", f"vLLM's speculators loader requires {', '.join(missing)}",
                       "export with `eagle3-zoo export DIR --format speculators`")
        verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec, dict) else None
        if isinstance(verifier, str) and verifier and not verifier_resolvable(verifier):
            report.add("VERIFIER_UNRESOLVABLE", f"speculators_config.verifier.name_or_path = {verifier!r} is neither "
                       "a Hub id (ORG/NAME) nor a folder here: speculators' from_pretrained cannot load the verifier "
                       "(vLLM, given the target separately, is not affected)",
                       "re-export with `eagle3-zoo export DIR --format speculators --verifier HUB_ID_OR_FOLDER`",
                       "warning")
        if "norm_before_residual" not in raw:
            report.add("NORM_BEFORE_RESIDUAL_MISSING", "norm_before_residual is absent: vLLM then defaults it to true, "
                       "a different forward pass than canonical EAGLE-3 (tau close to 1)",
                       "write norm_before_residual: false")

    def served_as_is(self, folder: Path) -> bool:
        return True  # vLLM's own format: what a user downloads is what is checked

    def served_draft_tokens(self, folder: Path) -> int | None:
        methods = (read_config(folder).get("speculators_config") or {}).get("proposal_methods") or [{}]
        k = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
        return k if isinstance(k, int) else None


_LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    """Add a layout (and its names: `eagle3_zoo.values.layout_names.register_info`): from then on it is detected, read,
    checked and, when its info says `writable`, written by `export`, `publish` and `pull --convert-to`.

    Raises:
        ValueError: its name or an alias names another layout.
    """
    if _LAYOUTS.get(layout.name) not in (None, layout):
        raise ValueError(f"layout {layout.name!r} is registered already ({_LAYOUTS[layout.name]!r})")
    layout_names.register_info(layout.info)
    _LAYOUTS[layout.name] = layout
    return layout


def unregister(name: str) -> None:
    """Remove a layout `register` added (the built-in ones stay)."""
    layout_names.unregister_info(name)
    _LAYOUTS.pop(name, None)


for _layout in (CanonicalLayout(), OfficialLayout(), SpeculatorsLayout(), ZLabDFlashLayout(),
                SpeculatorsDFlashLayout(), DSparkLayout()):
    register(_layout)


def layouts() -> tuple[Layout, ...]:
    """Every registered layout, built-in first."""
    return tuple(_LAYOUTS.values())


def find_layout(name: str | None) -> Layout | None:
    """The layout of a name or alias, or None."""
    found = layout_names.info(name)
    return _LAYOUTS.get(found.name) if found is not None else None


def get_layout(name: str) -> Layout:
    """The layout of a name or alias.

    Raises:
        ValueError: no layout has that name (the message lists them).
    """
    found = find_layout(name)
    if found is None:
        raise ValueError(f"unknown drafter layout {name!r}; valid: {', '.join(_LAYOUTS)}")
    return found


def export_layout(fmt: str, kind: str | None = None) -> Layout:
    """The layout `export --format fmt` writes (a name or alias of a writable layout); with `kind`, for a drafter of
    that kind (`speculators` of a DFlash drafter is `speculators-dflash`).

    Raises:
        ValueError: `fmt` names no writable layout, or none of the drafter's kind (the message lists the valid names).
    """
    names = layout_names.export_names()
    if fmt not in names:
        raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(names)}")
    if kind is None:
        return _LAYOUTS[names[fmt]]
    own = layout_names.export_names(kind)
    if fmt not in own:
        raise ValueError(f"export format {fmt!r} is a layout of {_LAYOUTS[names[fmt]].kind} drafters; a {kind} "
                         f"drafter is written as one of: {', '.join(own)}")
    return _LAYOUTS[own[fmt]]


def claimed_layout(path: str | Path) -> Layout | None:
    """The layout whose `claims` marks a drafter folder's config.json as its own (None: no layout claims it; its
    weight files then decide, `detect_layout`). Reads config.json only.

    Raises:
        FileNotFoundError / ValueError: no config.json, unreadable config, or a config that marks a layout in a variant
            it cannot read (a speculators model type no layout reads).
    """
    raw = read_config(path)
    source = str(Path(path) / "config.json")
    for layout in _LAYOUTS.values():
        if layout.claims(raw, source):
            return layout
    return None


def detect_layout(path: str | Path) -> Layout:
    """The layout of a drafter folder: the first that `claims` its config.json, else the one whose `weight_kind` its
    weight files are (safetensors -> sglang, pytorch_model.bin -> official).

    Raises:
        FileNotFoundError / ValueError / CheckpointError: no config.json, unreadable config, no weights, or a config
            that marks a layout in a variant it cannot read (a speculators model type other than eagle3).
    """
    claimed = claimed_layout(path)
    if claimed is not None:
        return claimed
    kind, files = find_weight_files(path)
    for layout in _LAYOUTS.values():
        if layout.weight_kind == kind:
            return layout
    raise CheckpointError(f"{path}: {kind} weights ({files[0].name}) and no layout reads them; layouts: "
                          f"{', '.join(_LAYOUTS)}")


def detect_format(path: str | Path) -> str:
    """The name of a drafter folder's layout ("sglang", "official", "speculators" or a registered one); see
    `detect_layout`."""
    return detect_layout(path).name


def canonical_name(name: str, fmt: str) -> str | None:
    """Checkpoint key of layout `fmt` -> canonical key, or None for tensors that are not part of the drafter."""
    return get_layout(fmt).canonical_name(name)


def format_name(name: str, fmt: str) -> str:
    """Canonical key -> the key layout `fmt` stores it under."""
    return get_layout(fmt).stored_name(name)


def drafter_config(raw: dict[str, Any], fmt: str, source: str = "config.json") -> Eagle3Config:
    """Translate a raw config.json of layout `fmt` into an `Eagle3Config`.

    Raises:
        ValueError: missing fields, or a checkpoint using a non-canonical training variant (`NonCanonicalDrafterError`).
    """
    layout = get_layout(fmt)
    if layout.kind == "eagle3":
        refuse_unsupported_variants(raw, fmt, source)
    return layout.read_config(raw, source)


def load_drafter_config(folder: str | Path) -> tuple[Eagle3Config, str]:
    """(`Eagle3Config`, layout name) of a drafter folder in any registered layout."""
    fmt = detect_format(folder)
    return drafter_config(read_config(folder), fmt, source=str(Path(folder) / "config.json")), fmt


def is_canonical(folder: str | Path) -> bool:
    """Whether a folder is exactly what `Eagle3Drafter.save_pretrained` writes (safe to copy byte for byte)."""
    canonical = layout_names.CANONICAL
    try:
        if detect_format(folder) != canonical or read_config(folder).get("architectures") != [ARCHITECTURE]:
            return False
        from eagle3_zoo.checkpoint.weights import read_infos

        infos, _, files = read_infos(folder)
        cfg = drafter_config(read_config(folder), canonical)
    except (OSError, ValueError, CheckpointError):
        return False
    return len(files) == 1 and set(infos) == set(canonical_keys(cfg))
