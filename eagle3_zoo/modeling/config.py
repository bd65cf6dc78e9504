"""Drafter configuration and the config.json of the canonical (SGLang / official / vLLM) checkpoint layout."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_zoo.values.dtypes import DTYPE_NAMES

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low/mid/high selection in the internal convention (HF hidden-state indices), as SGLang and
    vLLM compute it: the one place this rule lives.

    Raises:
        ValueError: fewer than 4 decoder layers (the high id N-3 would be the embeddings, which SGLang cannot name).
    """
    if num_layers < 4:
        raise ValueError(f"default aux layers (2, N//2, N-3) need >= 4 decoder layers, the target has {num_layers}; "
                         "pass explicit ids (drafter.aux_layer_ids)")
    return (2, num_layers // 2, num_layers - 3)


def to_sglang_layer_ids(ids: tuple[int, ...] | list[int]) -> list[int]:
    """Internal ids (hidden state ENTERING layer i) -> SGLang `eagle_aux_hidden_state_layer_ids` (output of i-1).

    SGLang captures the input of layer `id + 1`, so the two conventions differ by exactly one.
    """
    if any(i < 1 for i in ids):
        raise ValueError(f"aux layer ids {list(ids)}: id 0 (the embeddings) has no SGLang output-layer index")
    return [int(i) - 1 for i in ids]


def from_sglang_layer_ids(ids: list[int]) -> tuple[int, ...]:
    """SGLang `eagle_aux_hidden_state_layer_ids` -> internal ids (HF hidden-state indices)."""
    return tuple(int(i) + 1 for i in ids)


_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
          "draft_vocab_size", "max_position_embeddings")
_OPTIONAL_SIZES = ("target_hidden_size", "head_dim")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field_problems(c: Eagle3Config) -> list[str]:
    """Type and range of every field the drafter reads (a wrong type fails deep in torch, a bad value gives NaN)."""
    out = [f"{name}={getattr(c, name)!r}; expected an integer >= 1" for name in _SIZES
           if not _is_int(getattr(c, name)) or getattr(c, name) < 1]
    out += [f"{name}={getattr(c, name)!r}; expected an integer >= 1 or null" for name in _OPTIONAL_SIZES
            if getattr(c, name) is not None and (not _is_int(getattr(c, name)) or getattr(c, name) < 1)]
    if not _is_number(c.rms_norm_eps) or not 0 < c.rms_norm_eps < 1:
        out.append(f"rms_norm_eps={c.rms_norm_eps!r}; expected a number in (0, 1), e.g. 1e-05 (<= 0 makes every "
                   "output NaN)")
    if not _is_number(c.rope_theta) or c.rope_theta <= 0:
        out.append(f"rope_theta={c.rope_theta!r}; expected a number > 0, e.g. 10000.0")
    if c.rope_scaling is not None and not (isinstance(c.rope_scaling, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, (str, int, float, list))) for k, v in
            c.rope_scaling.items()) and isinstance(c.rope_scaling.get("rope_type", ""), str)):
        out.append(f"rope_scaling={c.rope_scaling!r}; expected null or an object of RoPE settings with a string "
                   "rope_type, e.g. {\"rope_type\": \"llama3\", \"factor\": 8.0}")
    ids = c.aux_layer_ids
    if ids is not None and not (isinstance(ids, (list, tuple)) and len(ids) in (1, 3)
                                and all(_is_int(i) and i >= 0 for i in ids)):
        out.append(f"aux_layer_ids={ids!r}; expected 1 or 3 integer layer ids >= 0")
    for name in ("hidden_act", "torch_dtype"):
        if not isinstance(getattr(c, name), str):
            out.append(f"{name}={getattr(c, name)!r}; expected a string")
    for name in ("target_model_type", "target_name_or_path"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), str):
            out.append(f"{name}={getattr(c, name)!r}; expected a string or null")
    return out


def _object(d: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    """`d[key]` when it is an object (absent or null: {}); anything else is refused naming the key."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {key} = {value!r}; expected a JSON object")
    return value


def _layer_ids(value: Any, key: str, source: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(i) for i in value):
        raise ValueError(f"{source}: {key} = {value!r}; expected a list of integer layer ids")
    return value


@dataclass
class Eagle3Config:
    """Shape and provenance of an EAGLE-3 drafter (one Llama decoder layer reading fused target features).

    `aux_layer_ids` are in the internal convention: HF `output_hidden_states` indices, i.e. the residual stream
    entering those decoder layers of the target (vLLM/speculators use the same; SGLang stores `id - 1`).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary; embeddings and d2t live in this id space
    draft_vocab_size: int
    target_hidden_size: int | None = None  # None = hidden_size
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict (e.g. {"rope_type": "llama3", ...})
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    aux_layer_ids: tuple[int, ...] | None = None
    # EAGLE-3.1 (arXiv 2605.09992), the config keys and meaning vLLM reads: one RMSNorm per aux hidden state on its
    # chunk of the fc input (weights fc_norm.{i}.weight), and the post-norm output fed back to the next step
    fc_norm: bool = False
    norm_output: bool = False
    torch_dtype: str = "float32"
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept for round trips

    def __post_init__(self) -> None:
        problems = _field_problems(self)  # types and ranges first: the rules below compute with the values
        if problems:
            raise ValueError("invalid Eagle3Config: " + "; ".join(problems))
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if self.head_dim < 1:
            problems.append(f"head_dim = hidden_size // num_attention_heads = {self.head_dim}; must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        if self.torch_dtype not in DTYPE_NAMES:
            problems.append(f"torch_dtype={self.torch_dtype!r}; valid: {', '.join(DTYPE_NAMES)}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r}; EAGLE-3 drafters use 'silu'")
        for flag in ("fc_norm", "norm_output"):  # engines test truthiness: the string "false" would switch it on
            if not isinstance(getattr(self, flag), bool):
                problems.append(f"{flag}={getattr(self, flag)!r}; expected true or false (a JSON boolean)")
        if problems:
            raise ValueError("invalid Eagle3Config: " + "; ".join(problems))

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3

    def parameter_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every parameter of the `Eagle3Drafter` this config builds: name -> (shape, "linear" | "norm"), computed
        without torch or transformers (`plan` sizes a drafter from it in a fraction of a second). Equal to the
        meta-device build's `named_parameters()` for every shipped recipe and each option (tests/test_plan.py)."""
        h, ht, d, i = self.hidden_size, self.target_hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[tuple[int, ...], str]] = {"fc.weight": ((h, self.num_aux_layers * ht), "linear")}
        if self.fc_norm:
            shapes.update({f"fc_norm.{n}.weight": ((ht,), "norm") for n in range(self.num_aux_layers)})
        layer = {"input_layernorm.weight": ((h,), "norm"), "hidden_norm.weight": ((h,), "norm"),
                 "self_attn.q_proj.weight": ((q, 2 * h), "linear"), "self_attn.k_proj.weight": ((kv, 2 * h), "linear"),
                 "self_attn.v_proj.weight": ((kv, 2 * h), "linear"), "self_attn.o_proj.weight": ((h, q), "linear"),
                 "post_attention_layernorm.weight": ((h,), "norm"), "mlp.gate_proj.weight": ((i, h), "linear"),
                 "mlp.up_proj.weight": ((i, h), "linear"), "mlp.down_proj.weight": ((h, i), "linear")}
        shapes.update({f"midlayer.{n}": v for n, v in layer.items()})
        shapes["norm.weight"] = ((h,), "norm")
        shapes["lm_head.weight"] = ((self.draft_vocab_size, h), "linear")
        return shapes

    @property
    def eagle31(self) -> bool:
        """Whether this drafter uses an EAGLE-3.1 option (`fc_norm` or `norm_output`)."""
        return self.fc_norm or self.norm_output

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...] | list[int] | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """Size a drafter like its target (hidden, heads, MLP, RoPE), as EAGLE-3 does by default."""
        tc = target_config
        rope = getattr(tc, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        rope_scaling = None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
        num_layers = tc.num_hidden_layers
        kwargs: dict[str, Any] = dict(
            hidden_size=tc.hidden_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            intermediate_size=tc.intermediate_size,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers),
            target_model_type=getattr(tc, "model_type", None),
            target_name_or_path=getattr(tc, "_name_or_path", None) or None,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def target_mismatches(self, target_config: Any) -> list[str]:
        """Why this drafter cannot run on a target with `target_config` (empty when it fits)."""
        problems = []
        if self.vocab_size != target_config.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab {target_config.vocab_size}")
        if self.target_hidden_size != target_config.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} != target hidden "
                            f"{target_config.hidden_size}")
        if self.hidden_size != target_config.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden {target_config.hidden_size} (the target "
                            "embedding feeds the drafter)")
        return problems

    def to_llama_config(self) -> Any:
        """A transformers LlamaConfig with this drafter's attention/RoPE settings (for the rotary embedding)."""
        from transformers import LlamaConfig

        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_hidden_layers=1,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=rope,
        )

    # ---- config.json (canonical layout) ----
    def to_json_dict(self) -> dict[str, Any]:
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            # Older loaders and the speculators converter read only the top-level rope_theta / rope_scaling;
            # transformers 5 reads rope_parameters. Write all three.
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": self.torch_dtype,
        }
        # written only when on, so an EAGLE-3 folder stays byte for byte what it was; vLLM and SGLang read both
        # flags from the top level of config.json
        d.update({flag: True for flag in ("fc_norm", "norm_output") if getattr(self, flag)})
        if self.aux_layer_ids is not None:
            # upstream vLLM reads only this top-level field, in HF hidden-state indices (= our internal ids)
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            d["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": to_sglang_layer_ids(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            }
        d["eagle3_zoo"] = {
            "aux_layer_ids_convention": "sglang eagle_aux_hidden_state_layer_ids = HF hidden_states index - 1",
            "target_model_type": self.target_model_type,
            "target_name_or_path": self.target_name_or_path,
        }
        d.update(self.extra)
        return d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], source: str = "config.json") -> Eagle3Config:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing} for an EAGLE-3 drafter config")
        kwargs: dict[str, Any] = {k: d.pop(k) for k in list(d) if k in known and k not in ("extra",)}
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        kwargs.setdefault("draft_vocab_size", kwargs["vocab_size"])
        rope_parameters = _object(d, "rope_parameters", source)
        d.pop("rope_parameters", None)
        if "rope_theta" not in kwargs:  # official releases omit it: Llama's default base 10000
            theta = rope_parameters.get("rope_theta", 10000.0)
            kwargs["rope_theta"] = float(theta) if _is_number(theta) else theta  # a bad value: refused below
        if kwargs.get("rope_scaling") is None and rope_parameters.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        scaling = kwargs.get("rope_scaling")
        if isinstance(scaling, dict) and "rope_type" not in scaling and "type" in scaling:  # pre-4.45 HF spelling
            kwargs["rope_scaling"] = {**scaling, "rope_type": scaling["type"]}
        eagle = _object(d, "eagle_config", source)
        d.pop("eagle_config", None)
        vllm_ids = d.pop("eagle_aux_hidden_state_layer_ids", None)
        if vllm_ids is not None:
            _layer_ids(vllm_ids, "eagle_aux_hidden_state_layer_ids", source)
        if eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
            kwargs["aux_layer_ids"] = from_sglang_layer_ids(_layer_ids(
                eagle["eagle_aux_hidden_state_layer_ids"], "eagle_config.eagle_aux_hidden_state_layer_ids", source))
            if vllm_ids is not None and tuple(vllm_ids) != kwargs["aux_layer_ids"]:
                raise ValueError(
                    f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids "
                    f"{eagle['eagle_aux_hidden_state_layer_ids']} (SGLang: HF index - 1) disagrees with top-level "
                    f"eagle_aux_hidden_state_layer_ids {vllm_ids} "
                    "(vLLM: HF index); they must differ by exactly one"
                )
        elif vllm_ids is not None:
            kwargs["aux_layer_ids"] = tuple(int(i) for i in vllm_ids)
        for flag in ("fc_norm", "norm_output"):  # null = absent = off, as the engines read it
            if kwargs.get(flag, False) is None:
                kwargs.pop(flag)
        zoo = _object(d, "eagle3_zoo", source)
        d.pop("eagle3_zoo", None)
        kwargs.setdefault("target_model_type", zoo.get("target_model_type"))
        kwargs.setdefault("target_name_or_path", zoo.get("target_name_or_path"))
        if kwargs.get("torch_dtype") not in DTYPE_NAMES:
            kwargs["torch_dtype"] = "float32" if kwargs.get("torch_dtype") is None else str(kwargs["torch_dtype"])
        for k in ("architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "attention_bias"):
            d.pop(k, None)
        kwargs["extra"] = d
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    def save(self, path: str | Path) -> None:
        from eagle3_zoo.util.fileio import atomic_write_text

        atomic_write_text(Path(path), json.dumps(self.to_json_dict(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Eagle3Config:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
        return cls.from_json_dict(d, source=str(path))
