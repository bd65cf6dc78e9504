"""DFlash drafter configuration (torch-free) and the z-lab `config.json` layout vLLM 0.32 loads.

Target layer ids: `target_layer_ids` are stored as z-lab and vLLM's `dflash_config.target_layer_ids` store them,
0-based ids of target decoder layers whose OUTPUT is read. The rest of the package (`eagle3_zoo.modeling.config`,
the data stage's `aux_layer_ids`) names a feature by the hidden state ENTERING a layer (= the HF `output_hidden_states`
index), so `aux_layer_ids == tuple(i + 1 for i in target_layer_ids)`; vLLM's aux id is the same `id + 1`
(`get_eagle3_aux_layers_from_config`). Example: Qwen3-8B (36 layers), 5 features -> target_layer_ids (1, 9, 17, 25,
33), aux_layer_ids (2, 10, 18, 26, 34).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from eagle3_zoo.values.dtypes import DTYPE_NAMES

ARCHITECTURE = "DFlashDraftModel"  # z-lab's architecture name, which vLLM maps to its DFlash Qwen3 drafter


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> tuple[int, ...]:
    """z-lab's default feature layers: `num_features` decoder-layer outputs evenly spread from layer 1 to N-3
    (rounded half to even, as Python's `round` and the reference implementation do); one feature reads layer N//2.

    Raises:
        ValueError: fewer features than 1, or a target too shallow for distinct ids.
    """
    if num_features < 1:
        raise ValueError(f"num_features={num_features}; expected >= 1")
    if num_features == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    ids = tuple(int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features))
    if len(set(ids)) != len(ids) or end < start:
        raise ValueError(f"{num_features} evenly spread feature layers in 1..N-3 are not distinct for a target with "
                         f"{num_target_layers} layers ({list(ids)}); pass target_layer_ids or fewer features")
    return ids


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
          "num_hidden_layers", "num_target_layers", "max_position_embeddings")


@dataclass
class DFlashConfig:
    """Shape of a DFlash drafter: `num_hidden_layers` (Ld) Qwen3-style decoder layers at the target's width that
    draft a block of `block_size` tokens ([anchor, MASK x (B-1)]) in one forward pass, reading the concatenated
    outputs of the target decoder layers `target_layer_ids` (z-lab convention: see the module docstring)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (the embedding, the mask token and the labels live here)
    num_target_layers: int  # N, decoder layers of the target
    target_layer_ids: tuple[int, ...]  # 0-based target decoder-layer OUTPUT ids (z-lab / dflash_config)
    mask_token_id: int  # the id embedded at the B-1 masked slots of a block
    num_hidden_layers: int = 5  # Ld, draft decoder layers
    block_size: int = 16  # B: the anchor plus B-1 drafted tokens
    draft_vocab_size: int | None = None  # None = vocab_size (the target's lm_head is used, none is saved)
    target_hidden_size: int | None = None  # None = hidden_size
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    rope_theta: float = 1000000.0  # Qwen3's base; from_target_config copies the target's
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept for round trips

    def __post_init__(self) -> None:
        problems = [f"{n}={getattr(self, n)!r}; expected an integer >= 1" for n in _SIZES
                    if not _is_int(getattr(self, n)) or getattr(self, n) < 1]
        for n in ("draft_vocab_size", "target_hidden_size", "head_dim"):
            v = getattr(self, n)
            if v is not None and (not _is_int(v) or v < 1):
                problems.append(f"{n}={v!r}; expected an integer >= 1 or null")
        if not _is_int(self.block_size) or self.block_size < 2:
            problems.append(f"block_size={self.block_size!r}; expected an integer >= 2 (the anchor and at least one "
                            "drafted token)")
        if not isinstance(self.rms_norm_eps, (int, float)) or not 0 < self.rms_norm_eps < 1:
            problems.append(f"rms_norm_eps={self.rms_norm_eps!r}; expected a number in (0, 1)")
        if not isinstance(self.rope_theta, (int, float)) or not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            problems.append(f"rope_theta={self.rope_theta!r}; expected a number > 0")
        if problems:
            raise ValueError("invalid DFlashConfig: " + "; ".join(problems))
        self.target_layer_ids = tuple(self.target_layer_ids) if isinstance(self.target_layer_ids, (list, tuple)) \
            else self.target_layer_ids
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        ids = self.target_layer_ids
        if not (isinstance(ids, tuple) and ids and all(_is_int(i) for i in ids)
                and len(set(ids)) == len(ids) and all(0 <= i < self.num_target_layers for i in ids)):
            problems.append(f"target_layer_ids={ids!r}; expected distinct decoder-layer ids in 0..num_target_layers-1="
                            f"{self.num_target_layers - 1} (0-based layer outputs)")
        if not _is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id={self.mask_token_id!r}; expected an id in 0..vocab_size-1="
                            f"{self.vocab_size - 1} (the target embedding's row that masked slots read)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim < 1:
            problems.append(f"head_dim = hidden_size // num_attention_heads = {self.head_dim}; must be >= 1")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r}; DFlash drafters use 'silu' (SwiGLU)")
        if self.torch_dtype not in DTYPE_NAMES:
            problems.append(f"torch_dtype={self.torch_dtype!r}; valid: {', '.join(DTYPE_NAMES)}")
        if problems:
            raise ValueError("invalid DFlashConfig: " + "; ".join(problems))

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The feature layers in the package's internal convention (hidden state entering layer i = HF
        `output_hidden_states[i]`), which is also vLLM's aux id: `target_layer_id + 1`."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        """Whether the drafter has its own (smaller) lm_head and a `d2t` map instead of the target's lm_head."""
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_target_config(cls, target_config: Any, mask_token_id: int, num_hidden_layers: int = 5,
                           num_features: int = 5, target_layer_ids: tuple[int, ...] | list[int] | None = None,
                           **overrides: Any) -> DFlashConfig:
        """Size a drafter like its target (width, heads, MLP, RoPE); `num_features` feature layers evenly spread
        from layer 1 to N-3 unless `target_layer_ids` (0-based layer outputs) are given."""
        tc = target_config
        rope = getattr(tc, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        n = tc.num_hidden_layers
        kwargs: dict[str, Any] = dict(
            hidden_size=tc.hidden_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            intermediate_size=tc.intermediate_size,
            vocab_size=tc.vocab_size,
            num_target_layers=n,
            target_layer_ids=tuple(target_layer_ids) if target_layer_ids is not None
            else default_target_layer_ids(n, num_features),
            mask_token_id=mask_token_id,
            num_hidden_layers=num_hidden_layers,
            target_hidden_size=tc.hidden_size,
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 40960),
            target_model_type=getattr(tc, "model_type", None),
            target_name_or_path=getattr(tc, "_name_or_path", None) or None,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def parameter_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every parameter of the `DFlashDrafter` this config builds: name -> (shape, "linear" | "norm"), without
        torch. The names are those of the saved file (= what vLLM 0.32's `qwen3_dflash.py` loads); `d2t` (a buffer,
        with a reduced draft vocabulary) is not a parameter and not listed."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[tuple[int, ...], str]] = {
            "fc.weight": ((h, self.num_features * self.target_hidden_size), "linear"),
            "hidden_norm.weight": ((h,), "norm"),
        }
        layer = {"input_layernorm.weight": ((h,), "norm"),
                 "self_attn.q_proj.weight": ((q, h), "linear"), "self_attn.k_proj.weight": ((kv, h), "linear"),
                 "self_attn.v_proj.weight": ((kv, h), "linear"), "self_attn.o_proj.weight": ((h, q), "linear"),
                 "self_attn.q_norm.weight": ((d,), "norm"), "self_attn.k_norm.weight": ((d,), "norm"),
                 "post_attention_layernorm.weight": ((h,), "norm"), "mlp.gate_proj.weight": ((i, h), "linear"),
                 "mlp.up_proj.weight": ((i, h), "linear"), "mlp.down_proj.weight": ((h, i), "linear")}
        for n in range(self.num_hidden_layers):
            shapes.update({f"layers.{n}.{k}": v for k, v in layer.items()})
        shapes["norm.weight"] = ((h,), "norm")
        if self.reduced_vocab:
            shapes["lm_head.weight"] = ((self.draft_vocab_size, h), "linear")
        return shapes

    # ---- config.json (z-lab layout, as vLLM 0.32 reads it) ----
    def to_json_dict(self) -> dict[str, Any]:
        """The z-lab `config.json`: a Qwen3 config of the draft layers plus `block_size`, `num_target_layers`,
        `layer_types` (all "full_attention": vLLM serves such layers non-causal) and `dflash_config`. No top-level
        `eagle_aux_hidden_state_layer_ids`: vLLM would read it first, as HF indices, instead of the dflash ids."""
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "eagle3_zoo": {"target_layer_ids_convention": "0-based target decoder-layer outputs; vLLM aux id = id + 1",
                           "target_model_type": self.target_model_type,
                           "target_name_or_path": self.target_name_or_path},
        }
        d.update(self.extra)
        return d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], source: str = "config.json") -> DFlashConfig:
        """Read a z-lab layout `config.json` (the inverse of `to_json_dict`)."""
        d = dict(d)
        dflash = d.pop("dflash_config", None)
        if not isinstance(dflash, dict) or "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError(f"{source}: dflash_config = {dflash!r}; expected an object with target_layer_ids and "
                             "mask_token_id (the z-lab DFlash layout)")
        layer_types = d.pop("layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{source}: layer_types = {layer_types!r}; only 'full_attention' (bidirectional "
                             "blocks) is supported")
        if dflash.get("causal"):
            raise ValueError(f"{source}: dflash_config.causal = true; DFlash blocks here are bidirectional")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "target_layer_ids", "mask_token_id"}
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                               "num_target_layers") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing} for a DFlash drafter config")
        kwargs: dict[str, Any] = {k: d.pop(k) for k in list(d) if k in known}
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        rope = d.pop("rope_parameters", None) or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if kwargs.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        zoo = d.pop("eagle3_zoo", None) or {}
        kwargs.setdefault("target_model_type", zoo.get("target_model_type"))
        kwargs.setdefault("target_name_or_path", zoo.get("target_name_or_path"))
        for k in ("architectures", "model_type", "attention_bias", "tie_word_embeddings"):
            d.pop(k, None)
        try:
            return cls(target_layer_ids=dflash["target_layer_ids"], mask_token_id=dflash["mask_token_id"],
                       extra=d, **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e
