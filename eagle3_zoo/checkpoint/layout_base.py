"""The base class of a drafter-folder layout (`Layout`); `eagle3_zoo.checkpoint.layouts` holds the registry and the
built-in layouts, `eagle3_zoo.checkpoint.dflash_layouts` the DFlash ones. No torch at import."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.formats import DROPPED_KEYS, STRIPPED_PREFIXES
from eagle3_zoo.modeling import Eagle3Config
from eagle3_zoo.modeling.config import ARCHITECTURE
from eagle3_zoo.values import layout_names
from eagle3_zoo.values.layout_names import LayoutInfo

if TYPE_CHECKING:
    from eagle3_zoo.modeling import Eagle3Drafter

# architectures some loaders accept besides the canonical one (official releases; vLLM's own class name)
_TOLERATED_ARCHITECTURES = {
    "LlamaForCausalLM": "the official releases' name; serving engines map it to their EAGLE-3 class only when told "
                        "the method (some SGLang versions need LlamaForCausalLMEagle3)",
    "Eagle3LlamaForCausalLM": "vLLM's class name; SGLang registers LlamaForCausalLMEagle3",
}


class Layout:
    """One drafter-folder layout. The defaults are the canonical layout's; a layout overrides what differs.

    Attributes:
        info: its names, aliases, card text, engines and card tags (torch-free, `eagle3_zoo.values.layout_names`).
        weight_kind: the weight-file kind (`find_weight_files`: "safetensors", "pickle") by which a folder no layout
            `claims` by its config is this layout; None: recognised by its config only.
        key_prefixes: canonical key prefix -> the prefix this layout stores it under (inverted on import).
        copies_canonical_bytes: exporting an exactly canonical folder (`is_canonical`) to this layout copies its
            config.json and weights byte for byte instead of rewriting them.
        norm_output_ambiguous: `norm_output` in a folder of this layout that eagle3-zoo did not write may carry
            SpecForge's older meaning (the check warns).
        kind: the drafter kind of its folders ("eagle3"; `eagle3_zoo.checkpoint.dflash_layouts`: "dflash"); the
            checks, import and export of a folder follow its layout's kind.
        speculators_model_type: the `speculators_model_type` its config.json carries (speculators layouts only).
    """

    info: LayoutInfo
    weight_kind: str | None = None
    key_prefixes: dict[str, str] = {}
    copies_canonical_bytes = False
    norm_output_ambiguous = True
    kind = "eagle3"
    speculators_model_type: str | None = None

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def claims(self, raw: dict[str, Any], source: str) -> bool:
        """Whether config.json `raw` marks its folder as this layout (whatever its weight files).

        Raises:
            ValueError: the config marks this layout but in a variant it cannot read (`source` names the file).
        """
        return False

    def read_config(self, raw: dict[str, Any], source: str) -> Eagle3Config:
        """The `Eagle3Config` of this layout's config.json `raw` (unsupported variants are refused before: see
        `drafter_config`)."""
        return Eagle3Config.from_json_dict(raw, source=source)

    def write(self, drafter: Eagle3Drafter, out: Path, **options: Any) -> None:
        """Write `drafter` into the folder `out` in this layout (config.json and weights). `options`: those of
        `export_drafter` (num_speculative_tokens, verifier_architectures, verifier); a layout ignores the others."""
        raise ValueError(f"the {self.name} layout is read, not written; write one of "
                         f"{', '.join(layout_names.export_names())}")

    def canonical_name(self, key: str) -> str | None:
        """A key of this layout -> its canonical key, or None for tensors that are not part of the drafter."""
        for prefix in STRIPPED_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
        if key in DROPPED_KEYS:
            return None
        for canon, theirs in self.key_prefixes.items():
            if key.startswith(theirs):
                return canon + key[len(theirs):]
        return key

    def stored_name(self, key: str) -> str:
        """A canonical key -> the key this layout stores it under."""
        for canon, theirs in self.key_prefixes.items():
            if key.startswith(canon):
                return theirs + key[len(canon):]
        return key

    def stored_aux_ids(self, raw: dict[str, Any]) -> Any:
        """The aux layer ids as config.json `raw` stores them (this layout's field and convention)."""
        return (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")

    def aux_convention_problems(self, raw: dict[str, Any], ids: tuple[int, ...], default: tuple[int, ...],
                                report: CheckReport) -> None:
        """Warn when aux ids `ids` (internal: HF hidden-state indices) look stored in another convention than this
        layout's, or where an engine does not read them. SGLang's `eagle_config` field stores `id - 1`."""
        if tuple(i - 1 for i in ids) == default:
            report.add("AUX_LAYER_CONVENTION", f"eagle_config.eagle_aux_hidden_state_layer_ids = {list(default)} "
                       f"equals the default in HF hidden-state indices, but SGLang reads this field as output-layer "
                       f"indices (adds 1): it will capture {[i + 1 for i in default]}, one layer off the default. The "
                       "ids look like HF indices stored in SGLang's field",
                       f"if the drafter was trained on the default layers, store {[i - 1 for i in default]} in "
                       "eagle_config (SGLang field = HF index - 1)", "warning")
        elif ids != default and not raw.get("eagle_aux_hidden_state_layer_ids"):
            report.add("VLLM_AUX_IDS_IGNORED", f"aux layers {list(ids)} differ from the default {list(default)} and "
                       "are stored only in eagle_config, which upstream vLLM does not read: vLLM feeds the default "
                       "layers", "for vLLM, use `eagle3-zoo export DIR --format speculators` (writes the top-level "
                       "field)", "warning")

    def architecture_problems(self, raw: dict[str, Any], report: CheckReport) -> None:
        """The config's `architectures` against what the engines build for this layout."""
        arch = raw.get("architectures")
        if arch == [ARCHITECTURE]:
            return
        name = arch[0] if isinstance(arch, list) and len(arch) == 1 else None
        if name in _TOLERATED_ARCHITECTURES:
            report.add("ARCHITECTURE_NONCANONICAL", f"architectures=['{name}']: {_TOLERATED_ARCHITECTURES[name]}",
                       f"export with `eagle3-zoo export DIR --format sglang` (writes ['{ARCHITECTURE}'])", "warning")
        else:
            report.add("ARCHITECTURE", f"architectures={arch}: not an EAGLE-3 drafter class; SGLang and vLLM would "
                       "build a different model (or refuse) from this config", f"set architectures to "
                       f"['{ARCHITECTURE}'] if this really is an EAGLE-3 drafter; otherwise this is the wrong "
                       "checkpoint")

    def config_problems(self, raw: dict[str, Any], report: CheckReport) -> None:
        """Fields of this layout's config.json the engines misread or miss."""
        if raw.get("tie_word_embeddings"):
            report.add("TIED_EMBEDDINGS", "tie_word_embeddings=true: SGLang then uses the embedding as lm_head and "
                       "ignores the drafter's own lm_head.weight", "set tie_word_embeddings to false")
        if "draft_vocab_size" not in raw:
            report.add("DRAFT_VOCAB_MISSING", "config has no draft_vocab_size: SGLang and vLLM then assume the full "
                       "target vocab (SGLang even loads lm_head from the target)",
                       "add draft_vocab_size = rows of lm_head.weight", "warning")

    def served_as_is(self, folder: Path) -> bool:
        """Whether the engines of `info.engines` load this folder as it is (else it is exported to the canonical
        layout first)."""
        return False

    def served_draft_tokens(self, folder: Path) -> int | None:
        """The draft length an engine given this folder alone serves with (None: the folder does not say)."""
        return None


def load_exact_state(model: Any, state: dict[str, Any], folder: Any, label: str) -> Any:
    """Load `state` into `model` when its keys and shapes are exactly the model's; returns `model`.

    Raises:
        ValueError: missing, unexpected or misshapen tensors, named with the folder and `label` (its layout)."""
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} (expected {tuple(expected[k].shape)})"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{folder} ({label}): missing keys {missing}, unexpected keys {unexpected}, "
                         f"wrong shapes {wrong}; run `eagle3-zoo check {folder}` for details")
    model.load_state_dict(state)
    return model
