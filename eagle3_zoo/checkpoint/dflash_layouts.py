"""The two folder layouts of a DFlash drafter, registered in the layout registry (`eagle3_zoo.checkpoint.layouts`).

- `dflash` (aliases `z-lab`, `zlab`): what `DFlashDrafter.save_pretrained` writes and z-lab publishes. A Qwen3 config
  with `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`, `layer_types` and
  `dflash_config: {mask_token_id, target_layer_ids}` (0-based target decoder-layer OUTPUT ids). vLLM 0.32 and SGLang
  load it as it is when told the method (`--speculative-config '{"method": "dflash", ...}'`).
- `speculators-dflash` (`export --format speculators` of a DFlash folder): vLLM speculators' format,
  `speculators_model_type: dflash`, the draft layers' Qwen3 config nested in `transformer_layer_config`, the feature
  layers in `aux_hidden_state_layer_ids` in vLLM's aux convention (= target_layer_id + 1: vLLM 0.32's converter
  `transformers_utils/configs/speculators/algos.py` `update_dflash` stores `[i - 1 for i in aux ids]` as
  `dflash_config.target_layer_ids`), `mask_token_id`, `block_size`, `draft_vocab_size`, `target_hidden_size`, and
  `sliding_window_non_causal: true` (vLLM's converter sets `dflash_config.causal = not sliding_window_non_causal`,
  default true; a false value serves the drafter causal, which this package never trained).

Both layouts hold the same tensors under the same names (those vLLM 0.32's `qwen3_dflash.py` loads:
`DFlashConfig.parameter_shapes`, plus `d2t` with a reduced draft vocabulary), so a conversion is the config's only
and the weights round-trip bit for bit.

A DSpark drafter (the DFlash backbone with Markov and confidence heads) has one layout here, `dspark`: what
`DSparkDrafter.save_pretrained` writes and vLLM 0.32's `qwen3_dspark.py` loads, the z-lab config with
`architectures: ["Qwen3DSparkModel"]` and DSpark's top-level keys (`eagle3_zoo.drafters.dspark.config`), the DFlash
tensors plus `markov_head.*` and `confidence_head.*` (`DSparkConfig.parameter_shapes`). vLLM's speculators converter
reads a second one (`speculators_model_type: dspark`); it is not written or read here yet. No torch at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.formats import read_config, speculators_verifier, target_architectures
from eagle3_zoo.checkpoint.layout_base import Layout, load_exact_state
from eagle3_zoo.drafters.dflash.config import ARCHITECTURE, DFlashConfig
from eagle3_zoo.drafters.dspark.config import ARCHITECTURE as DSPARK_ARCHITECTURE
from eagle3_zoo.drafters.dspark.config import DSparkConfig
from eagle3_zoo.values.layout_names import DFLASH, DSPARK, SPECULATORS_DFLASH

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.drafters.dflash.model import DFlashDrafter

SPECULATORS_DFLASH_ARCHITECTURE = "DFlashSpeculator"  # speculators' class name for its DFlash drafters
# dflash_config keys this package reads; any other (use_swa, sample_from_anchor, ...) changes the forward pass
_DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids", "causal"}
# the transformer_layer_config keys the speculators layout carries (the draft layers' Qwen3 config)
_LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "hidden_act", "vocab_size", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings",
               "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "tie_word_embeddings", "layer_types")
# HF config bookkeeping z-lab's configs carry (no effect on the drafter's forward pass): kept through conversions, in
# the speculators layout's transformer_layer_config
_BOOKKEEPING = ("attention_dropout", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                "max_window_layers", "use_cache", "transformers_version", "sliding_window", "use_sliding_window")
# speculators-layout keys that change the forward pass and that a DFlashDrafter cannot represent, with the value it has
_SPECULATORS_FIXED = {"sliding_window_non_causal": True, "sample_from_anchor": False}


def _zlab_raw(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A z-lab config.json as `DFlashConfig.from_json_dict` reads it: `dtype` (transformers 5's name) as
    `torch_dtype`, `dflash_config.block_size` as `block_size`; what changes the forward pass and a `DFlashConfig` cannot
    represent (sliding-window attention, other `dflash_config` options) is refused.

    Raises:
        ValueError: such an option, naming the file and the key."""
    raw = dict(raw)
    if "dtype" in raw:
        dtype = raw.pop("dtype")
        raw.setdefault("torch_dtype", dtype)
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window={raw['use_sliding_window']!r} (sliding_window="
                         f"{raw.get('sliding_window')!r}): sliding-window draft layers are a variant this package "
                         "cannot represent (full attention only: use_sliding_window false)")
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict):
        dflash = dict(dflash)
        if "block_size" in dflash:
            inner = dflash.pop("block_size")
            if raw.setdefault("block_size", inner) != inner:
                raise ValueError(f"{source}: block_size={raw['block_size']!r} but dflash_config.block_size={inner!r}")
        other = sorted(set(dflash) - _DFLASH_CONFIG_KEYS)
        if other:
            raise ValueError(f"{source}: dflash_config has {', '.join(other)}: options of a DFlash variant this "
                             f"package cannot represent (it reads {', '.join(sorted(_DFLASH_CONFIG_KEYS))}, "
                             "causal only as false)")
        raw["dflash_config"] = dflash
    return raw


class DFlashLayout(Layout):
    """A layout of DFlash drafter folders: read into a `DFlashConfig`, its tensors named as vLLM 0.32 loads them."""

    kind = "dflash"
    architecture = ARCHITECTURE  # what a folder of the layout's z-lab config names in `architectures`
    loader = "qwen3_dflash"  # the vLLM 0.32 module that loads its folders (named in the check's messages)

    def drafter_class(self) -> type:
        from eagle3_zoo.drafters.dflash.model import DFlashDrafter

        return DFlashDrafter

    def stored_name(self, key: str) -> str:
        return key

    def canonical_name(self, key: str) -> str | None:
        return key

    def served_as_is(self, folder: Path) -> bool:
        return True  # both layouts are loaded as shipped (given `"method": "dflash"`)

    def architecture_problems(self, raw: dict[str, Any], report: CheckReport) -> None:
        return None  # the config check (`eagle3_zoo.checkpoint.dflash_check`) reports it with the rest

    def config_problems(self, raw: dict[str, Any], report: CheckReport) -> None:
        return None

    def drafter_from_state(self, cfg: DFlashConfig, state: dict[str, torch.Tensor], folder: Path,
                           dtype: torch.dtype | None = None, device: str = "cpu") -> DFlashDrafter:
        """The `DFlashDrafter` of a config and the tensors of its folder (keys and shapes must match exactly).

        Raises:
            ValueError: missing, unexpected or misshapen tensors (named, with the folder)."""
        from eagle3_zoo.values.dtypes import torch_dtype

        model = load_exact_state(self.drafter_class()(cfg), state, folder, f"{self.name} layout")
        return model.to(device=device, dtype=dtype or torch_dtype(cfg.torch_dtype))

    def _write_weights(self, drafter: DFlashDrafter, out: Path) -> None:
        from safetensors.torch import save_file

        from eagle3_zoo.drafters.dflash.model import WEIGHTS_NAME
        from eagle3_zoo.util.fileio import atomic_write
        from eagle3_zoo.values.dtypes import torch_dtype

        dtype = torch_dtype(drafter.config.torch_dtype)
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
                   for k, v in drafter.state_dict().items()}
        atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


class ZLabDFlashLayout(DFlashLayout):
    """`dflash`: the z-lab layout (`DFlashDrafter.save_pretrained`; z-lab's published folders)."""

    info = DFLASH

    def claims(self, raw: dict[str, Any], source: str) -> bool:
        if "speculators_model_type" in raw or raw.get("architectures") == [DSPARK_ARCHITECTURE]:
            return False  # a DSpark folder carries a dflash_config too (`DSparkLayout`)
        return raw.get("architectures") == [ARCHITECTURE] or "dflash_config" in raw

    def read_config(self, raw: dict[str, Any], source: str) -> DFlashConfig:
        return DFlashConfig.from_json_dict(_zlab_raw(raw, source), source=source)

    def stored_aux_ids(self, raw: dict[str, Any]) -> Any:
        return (raw.get("dflash_config") or {}).get("target_layer_ids")

    def write(self, drafter: DFlashDrafter, out: Path, **_: Any) -> None:
        drafter.save_pretrained(out)


class SpeculatorsDFlashLayout(DFlashLayout):
    """`speculators-dflash`: vLLM speculators' DFlash format (see the module docstring)."""

    info = SPECULATORS_DFLASH
    speculators_model_type = "dflash"

    def claims(self, raw: dict[str, Any], source: str) -> bool:
        return raw.get("speculators_model_type") == "dflash"

    def stored_aux_ids(self, raw: dict[str, Any]) -> Any:
        return raw.get("aux_hidden_state_layer_ids")

    def read_config(self, raw: dict[str, Any], source: str) -> DFlashConfig:
        return DFlashConfig.from_json_dict(_zlab_raw(zlab_config(raw, source), source), source=source)

    def write(self, drafter: DFlashDrafter, out: Path, *, num_speculative_tokens: int | None = None,
              verifier_architectures: list[str] | None = None, verifier: str | None = None, **_: Any) -> None:
        import json

        from eagle3_zoo.drafters.dflash.model import CONFIG_NAME
        from eagle3_zoo.util.fileio import atomic_write_text

        config = speculators_dflash_config(drafter.config, num_speculative_tokens, verifier_architectures, verifier)
        self._write_weights(drafter, out)
        atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2) + "\n")

    def served_draft_tokens(self, folder: Path) -> int | None:
        methods = (read_config(folder).get("speculators_config") or {}).get("proposal_methods") or [{}]
        k = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
        return k if isinstance(k, int) else None


class DSparkLayout(ZLabDFlashLayout):
    """`dspark`: the DSpark folder vLLM 0.32's `qwen3_dspark.py` loads (`DSparkDrafter.save_pretrained`)."""

    info = DSPARK
    kind = "dspark"
    architecture = DSPARK_ARCHITECTURE
    loader = "qwen3_dspark"

    def drafter_class(self) -> type:
        from eagle3_zoo.drafters.dspark.model import DSparkDrafter

        return DSparkDrafter

    def claims(self, raw: dict[str, Any], source: str) -> bool:
        return "speculators_model_type" not in raw and raw.get("architectures") == [DSPARK_ARCHITECTURE]

    def read_config(self, raw: dict[str, Any], source: str) -> DSparkConfig:
        return DSparkConfig.from_json_dict(_zlab_raw(raw, source), source=source)


def zlab_config(raw: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """A speculators-layout DFlash config.json -> the z-lab config.json of the same drafter.

    Raises:
        ValueError: a missing field vLLM's converter requires (`mask_token_id`, `aux_hidden_state_layer_ids`,
            `transformer_layer_config`), aux ids below 1, or an option this package cannot represent (a causal
            drafter, `sample_from_anchor`); each names the file and the key.
    """
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{source}: transformer_layer_config = {layer!r}; a speculators DFlash config nests the draft "
                         "layers' Qwen3 config there (vLLM requires it)")
    missing = [k for k in ("mask_token_id", "aux_hidden_state_layer_ids") if k not in raw]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}; vLLM's speculators converter requires them for "
                         "speculators_model_type 'dflash'")
    for key, value in _SPECULATORS_FIXED.items():
        if raw.get(key, value) != value:
            raise ValueError(f"{source}: {key} = {raw[key]!r}; a DFlash drafter here is served with {key} = "
                             f"{str(value).lower()} (bidirectional blocks, slot 0 = the anchor), the variant it was "
                             "trained as; this package cannot represent the other")
    aux = raw["aux_hidden_state_layer_ids"]
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and not isinstance(i, bool) and i >= 1
                                                  for i in aux)):
        raise ValueError(f"{source}: aux_hidden_state_layer_ids = {aux!r}; expected a list of target hidden-state "
                         "indices >= 1 (vLLM's aux id = z-lab target_layer_id + 1)")
    out = {k: layer[k] for k in (*_LAYER_KEYS, *_BOOKKEEPING) if k in layer}
    zoo = dict(raw.get("eagle3_zoo") or {})
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    zoo.setdefault("target_name_or_path", verifier.get("name_or_path"))
    zoo.pop("aux_layer_ids_convention", None)
    num_target_layers = raw.get("num_target_layers", zoo.pop("num_target_layers", None))
    if num_target_layers is None:
        raise ValueError(f"{source}: no num_target_layers (top level or eagle3_zoo.num_target_layers): the depth of "
                         "the target the aux ids index; write it (the target config's num_hidden_layers)")
    out.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "draft_vocab_size": raw.get("draft_vocab_size", layer.get("vocab_size")),
        "target_hidden_size": raw.get("target_hidden_size"),
        "torch_dtype": raw.get("torch_dtype") or layer.get("torch_dtype") or layer.get("dtype") or "float32",
        "block_size": raw.get("block_size", 8),  # speculators' schema default
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": raw["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]},
        "eagle3_zoo": zoo,
    })
    if out["target_hidden_size"] is None:
        out.pop("target_hidden_size")
    return out


def speculators_dflash_config(cfg: DFlashConfig, num_speculative_tokens: int | None = None,
                              verifier_architectures: list[str] | None = None,
                              verifier: str | None = None) -> dict[str, Any]:
    """config.json of a DFlash drafter in the speculators layout (what vLLM 0.32's speculators converter reads).

    `num_speculative_tokens` (default: block_size - 1, one block) is the proposal length vLLM serves by default.

    Raises:
        ValueError: what the layout cannot represent: no target to name as the verifier (pass `verifier`), a
            verifier speculators cannot resolve, config keys this package does not know the meaning of (`extra`),
            or more speculative tokens than a block drafts.
    """
    name = speculators_verifier(cfg.target_name_or_path, verifier, "layout")
    unknown = sorted(set(cfg.extra) - set(_BOOKKEEPING))
    if unknown:
        raise ValueError(f"config.json keys {unknown} have no place in the speculators layout (their meaning to the "
                         "engines is unknown here); export to the dflash (z-lab) layout, which keeps them, or remove "
                         "them")
    k = cfg.block_size - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
    if not 1 <= k <= cfg.block_size - 1:
        raise ValueError(f"num_speculative_tokens={k}; a DFlash block of block_size={cfg.block_size} drafts 1.."
                         f"{cfg.block_size - 1} tokens")
    zlab = cfg.to_json_dict()
    layer = {key: zlab[key] for key in (*_LAYER_KEYS, *_BOOKKEEPING) if key in zlab}
    layer["model_type"] = "qwen3"
    layer["torch_dtype"] = cfg.torch_dtype
    return {
        "architectures": [SPECULATORS_DFLASH_ARCHITECTURE],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),  # vLLM's aux id = z-lab target_layer_id + 1
        "sliding_window_non_causal": True,  # bidirectional blocks: vLLM's converter sets causal = not this
        "num_target_layers": cfg.num_target_layers,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name,
                         "architectures": verifier_architectures or target_architectures(cfg.target_model_type)},
        },
        "torch_dtype": cfg.torch_dtype,
        "eagle3_zoo": {**zlab["eagle3_zoo"], "target_layer_ids_convention":
                       "aux_hidden_state_layer_ids = z-lab target_layer_id + 1 (vLLM's aux id)"},
    }
