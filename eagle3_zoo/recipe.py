"""Typed training recipes: schema, loading with dotlist overrides, and validation.

A recipe is a YAML file loaded into the `Recipe` dataclass tree (an OmegaConf structured config). Every problem
(unknown key, wrong type, bad value, missing file) is collected first and raised together in one `RecipeError`,
so a user fixes a recipe in one round trip instead of one error per launch.

    recipe = load_recipe("recipes/qwen25_7b.yaml", ["trainer.max_steps=2000"])
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

EMBEDDED_TARGET = "smollm2-135m-instruct"
EMBEDDED_SHAREGPT = "sharegpt-embedded"
_STATIC_FAMILIES = ("deepseek_v3", "llama", "qwen2")


@dataclass
class TargetConfig:
    """The frozen target model the drafter learns to predict."""

    name_or_path: str = EMBEDDED_TARGET
    """Hub id or local directory of the frozen target; "smollm2-135m-instruct" = the embedded GGUF model."""
    family: str = "auto"
    """Adapter family (HF `model_type`): "auto" reads it from the target config, else a registered adapter."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype the frozen target runs in."""
    lora_path: str | None = None
    """Optional PEFT LoRA adapter merged into the target before feature extraction."""
    trust_remote_code: bool = False
    """Passed to transformers; off by default because it executes code from the Hub."""


@dataclass
class DrafterConfig:
    """Shape of the EAGLE-3 drafter (one Llama decoder layer); null fields follow the target."""

    hidden_size: int | None = None
    """Drafter width; null = the target's (the frozen target embedding is fed to the drafter unchanged)."""
    intermediate_size: int | None = None
    """MLP width of the single decoder layer; null = the target's."""
    num_attention_heads: int | None = None
    """null = the target's."""
    num_key_value_heads: int | None = None
    """null = the target's."""
    head_dim: int | None = None
    """null = the target's."""
    draft_vocab_size: int = 32000
    """Most frequent supervised target tokens kept as the draft vocabulary (EAGLE-3 uses 32000)."""
    aux_layer_ids: list[int] | None = None
    """HF `output_hidden_states` indices (low, mid, high), or one id for ablations; null = adapter default."""
    init_from: str | None = None
    """Optional existing drafter (local dir or Hub id) to start from."""
    init_head: Literal["random", "target"] = "random"
    """Fresh drafters: "random" = normal(0, 0.02) like every other weight (official EAGLE-3); "target" copies the
    target's lm_head rows of the draft vocabulary and its final norm (as vLLM speculators does). On SmolLM2 the two
    reached the same accuracy after 200 steps (recipes/README.md)."""


@dataclass
class DataSourceConfig:
    """One conversation source."""

    path: str = MISSING
    """Local JSON/JSONL file or directory, a Hub dataset id, or "sharegpt-embedded"."""
    format: Literal["auto", "sharegpt", "messages", "jsonl"] = "auto"
    """"auto" detects JSON list vs JSONL and ShareGPT (`conversations`) vs OpenAI (`messages`) records."""
    max_samples: int | None = None
    """Keep at most this many conversations from this source."""
    split: Literal["train", "val"] | None = None
    """null = split by `data.val_fraction`; "train"/"val" = feed this source to one split only."""


@dataclass
class RegenerateConfig:
    """Regeneration of assistant turns by the target before training."""

    enabled: bool = False
    """Regenerate assistant turns with the target itself, as EAGLE-3 does (raises acceptance)."""
    max_new_tokens: int = 1024
    temperature: float = 0.0
    """0 = greedy, matching T=0 evaluation."""
    batch_size: int = 8
    max_turns: int | None = None
    """Answer at most this many assistant turns per conversation (later turns are dropped); null = all."""
    output: str | None = None
    """Where regenerated conversations go; null = inside `data.cache_dir`."""
    backend: Literal["hf", "openai", "vllm"] = "hf"
    """hf = `generate` in this process; openai = any OpenAI-compatible server at `base_url` (vLLM, SGLang, ...);
    vllm = a vLLM server started for the target (`bash scripts/setup_engine.sh`). Same output file and cache key."""
    base_url: str | None = None
    """backend openai: the server root, e.g. http://10.0.0.5:8000."""
    api_key_env: str | None = None
    """backend openai: the name of the environment variable holding the API key (null = no key)."""
    concurrency: int = 4
    """backend openai/vllm: conversations in flight at once (the server batches them)."""
    timeout: float = 600.0
    """backend openai/vllm: seconds per request."""
    retries: int = 4
    """backend openai/vllm: retries of a failed request (429, 5xx, timeouts), with exponential backoff from 1 s."""


@dataclass
class DataConfig:
    """Conversations -> tokens, loss masks and (offline) features."""

    sources: list[DataSourceConfig] = field(default_factory=lambda: [DataSourceConfig(path=EMBEDDED_SHAREGPT)])
    """Conversation sources, read in order."""
    max_length: int = 2048  # EAGLE-3 trains on 2048-token sequences
    overflow: Literal["truncate", "drop"] = "truncate"
    """What to do with a conversation longer than `max_length` tokens."""
    max_samples: int | None = None
    """Cap on conversations over all sources."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad records: stop with the file and record index, or skip them with a logged count per reason."""
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra chat-template variables for regeneration and tokenisation, e.g. `{enable_thinking: false}` (Qwen3) or
    `{reasoning_effort: low}` (gpt-oss); {} = the template's defaults (Qwen3 and gpt-oss think)."""
    cache_dir: str = ".cache/eagle3_zoo"
    """Token counts, regenerated data and features, keyed by content fingerprints (shared across runs)."""
    mode: Literal["online", "offline"] = "online"
    """online = frozen target in the training step; offline = precomputed feature shards."""
    features_dir: str | None = None
    """Offline feature shards; null = a fingerprinted directory inside `cache_dir`."""
    features_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    features_shard_size: int = 256
    """Samples per feature shard (a crash loses at most one shard)."""
    features_backend: Literal["hf", "vllm"] = "hf"
    """Who computes offline features: hf = the target in this process; vllm = a vLLM server started for the
    target, hidden states through its extract_hidden_states method (`bash scripts/setup_engine.sh`)."""
    val_fraction: float = 0.01
    num_workers: int = 2
    seed: int = 0
    """Seed of the train/val split and shuffling."""


@dataclass
class TTTConfig:
    """Training-time test: the K-step unrolled loss (DESIGN.md section 5)."""

    steps: int = 7  # official EAGLE-3 unroll length
    """Training-time-test unroll length K."""
    step_weight_decay: float = 0.8
    """Step k has weight `step_weight_decay ** k` unless `step_weights` is given."""
    step_weights: list[float] | None = None
    """Explicit per-step weights (length `steps`)."""
    schedule: Literal["constant", "ramp"] = "constant"
    """constant = all K steps from the start; ramp = active steps grow 1 -> K."""
    ramp_fraction: float = 0.3
    """Fraction of training over which the ramp reaches K."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 1e-4  # SpecForge default; the official EAGLE-3 8B run uses 5e-5 (recipes set it)
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # official EAGLE-3 AdamW betas
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr`."""
    grad_clip: float | None = 0.5  # official EAGLE-3 gradient clipping
    """Gradient norm clip; null = off."""
    precondition_fc: bool = False
    """Train the fc layer on features scaled to unit RMS per dimension (measured on the first training samples) and
    fold the scale into fc.weight when the drafter is written: same exported format, but a few "massive
    activation" dims of the target no longer dominate the fused state (recipes/README.md has the measurement)."""


@dataclass
class TauEvalConfig:
    """Periodic acceptance-length measurement during training."""

    every_n_steps: int | None = None
    """Measure acceptance length tau with real speculative decoding every N steps; null = off."""
    num_prompts: int = 8
    max_new_tokens: int = 64


@dataclass
class TrainerConfig:
    """Lightning Trainer switches; parallelism stays coarse (one strategy builder reads them)."""

    max_steps: int | None = None
    """Optimizer steps; null = run `max_epochs`."""
    max_epochs: int | None = 1
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"] = "32-true"
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    """"gpu": the recipe needs CUDA GPUs and stops at once without them; "auto": GPUs when present, else the CPU."""
    devices: int | str = "auto"
    """Lightning devices: a count, -1 (all), "auto" or a comma list such as "0,1"."""
    num_nodes: int = 1
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    accumulate_grad_batches: int = 1
    batch_size: int = 1
    """Per-device micro-batch (conversations)."""
    checkpoint_every_n_steps: int | None = 1000
    val_check_interval: int | None = None
    """Validate every N training batches; null = once per epoch."""
    log_every_n_steps: int = 10
    logger: list[Literal["csv", "tensorboard"]] = field(default_factory=lambda: ["csv", "tensorboard"])
    seed: int = 42
    """Seed of the drafter initialisation and data order."""
    activation_checkpointing: bool = False
    gpu_memory_gb: float | None = None
    """Memory of one GPU this recipe is planned for (GB); `eagle3-zoo plan` says whether the run fits it."""
    tau_eval: TauEvalConfig = field(default_factory=TauEvalConfig)


@dataclass
class Recipe:
    """A complete training recipe."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    output_dir: str = "runs/eagle3"
    demo: bool = False
    """A smoke/demo run (e.g. the quickstart's): its model card says it is not a drafter to serve."""
    """Checkpoints, logs, the resolved recipe and the exported drafter."""


# --------------------------------------------------------------------------------------------------- errors
_NO_VALUE = object()


@dataclass
class RecipeProblem:
    """One problem in a recipe: where it comes from, the dotted key, the bad value and what is expected."""

    key: str
    message: str
    value: Any = _NO_VALUE
    source: str = "recipe"
    related: tuple[str, ...] = ()  # other keys the check read; a type error there makes this check moot

    def __str__(self) -> str:
        value = "" if self.value is _NO_VALUE else f" = {self.value!r}"
        return f"{self.source}: {self.key}{value}: {self.message}"


class RecipeError(ValueError):
    """All problems of a recipe, reported at once."""

    def __init__(self, problems: list[RecipeProblem]):
        self.problems = list(problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid recipe ({len(self.problems)} {noun}):\n{lines}")


def _did_you_mean(word: Any, choices: typing.Iterable[str], prefix: str = "") -> str:
    choices = [str(c) for c in choices]
    match = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    match = match or [c for c in choices if c.startswith(str(word))][:1]  # 32 -> 32-true
    return f"; did you mean '{prefix}{match[0]}'?" if match else ""


def _known_families() -> tuple[str, ...]:
    """Adapter families, from the adapter registry (`eagle3_zoo.adapters.available_adapters`) when importable.

    The static tuple is only a fallback for when the adapters package cannot be imported; the registry is the
    single source of truth, so a new `@register_adapter` family is accepted here without an edit.
    """
    try:
        from eagle3_zoo import adapters
    except ImportError:
        return _STATIC_FAMILIES
    registry = getattr(adapters, "available_adapters", None) or getattr(adapters, "available_families", None)
    return tuple(sorted(registry())) if registry is not None else _STATIC_FAMILIES


# ------------------------------------------------------------------------------------ schema (type) checks
def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is list:
        plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(args[0])
        return f"a list of {plural or 'values, each ' + _describe(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def _schema_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Leaf name -> dotted key over the whole schema, to suggest `optim.lr` for a misplaced `trainer.lr`."""
    out: dict[str, str] = {}
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(_schema_keys(tp, f"{prefix}{name}."))
        else:
            out.setdefault(name, prefix + name)
    return out


def _check_mapping(raw: Any, cls: type, key: str, problems: list[RecipeProblem]) -> dict | None:
    """Type-check `raw` against dataclass `cls`; return the valid entries, None if a required key is missing."""
    if not isinstance(raw, dict):
        problems.append(RecipeProblem(key or "<root>", f"expected a mapping of {cls.__name__} fields", raw))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    clean: dict[str, Any] = {}
    for name, value in raw.items():
        dotted = f"{key}.{name}" if key else str(name)
        if name not in hints:
            hint = _did_you_mean(name, hints, f"{key}." if key else "") or _misplaced(str(name), key)
            valid = hint[2:] if hint else f"valid keys here: {', '.join(hints)}"
            problems.append(RecipeProblem(dotted, f"unknown key; {valid}"))
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            clean[name] = _check_mapping(value, tp, dotted, problems) or {}
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            if not isinstance(value, list):
                problems.append(RecipeProblem(dotted, "expected a list of mappings", value))
                continue
            item_cls = typing.get_args(tp)[0]
            items = [_check_mapping(v, item_cls, f"{dotted}[{i}]", problems) for i, v in enumerate(value)]
            clean[name] = [item for item in items if item is not None]
        elif _check_leaf(value, tp, dotted, problems):
            clean[name] = value
    missing = [name for name, f in fields.items() if f.default is MISSING and name not in raw]
    for name in missing:
        dotted = f"{key}.{name}" if key else name
        problems.append(RecipeProblem(dotted, f"required key missing (expected {_describe(hints[name])})"))
    return None if missing else clean


def _misplaced(name: str, section: str) -> str:
    dotted = _schema_keys(Recipe).get(name)
    return f"; did you mean '{dotted}'?" if dotted and not dotted.startswith(section + ".") else ""


def _literal_choices(tp: Any) -> list[str]:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [c for arm in typing.get_args(tp) for c in _literal_choices(arm)]


def _check_leaf(value: Any, tp: Any, key: str, problems: list[RecipeProblem]) -> bool:
    """Report a type mismatch (each bad list item separately, with a "did you mean" for choices)."""
    if _matches(value, tp):
        return True
    item_tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
    if item_tp is not None and isinstance(value, list):
        for i, item in enumerate(value):
            _check_leaf(item, item_tp, f"{key}[{i}]", problems)
        return False
    choices = _literal_choices(tp)
    hint = _did_you_mean(value, choices) if isinstance(value, str) and choices else ""
    problems.append(RecipeProblem(key, f"expected {_describe(tp)}{hint}", value))
    return False


# ------------------------------------------------------------------------------------------- value checks
def _gt0(v: Any) -> bool:
    return v > 0


def _ge0(v: Any) -> bool:
    return v >= 0


# Range rules, declared once: dotted key -> (predicate, what is expected). null always passes (= "off"/"default").
_RANGES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    **{k: (_gt0, "> 0") for k in (
        "drafter.hidden_size", "drafter.intermediate_size", "drafter.num_attention_heads",
        "drafter.num_key_value_heads", "drafter.head_dim", "drafter.draft_vocab_size", "data.max_samples",
        "data.features_shard_size", "data.regenerate.max_new_tokens", "data.regenerate.batch_size",
        "data.regenerate.max_turns",
        "ttt.step_weight_decay", "optim.lr", "optim.grad_clip", "trainer.max_steps", "trainer.max_epochs",
        "trainer.num_nodes", "trainer.accumulate_grad_batches", "trainer.batch_size",
        "trainer.checkpoint_every_n_steps", "trainer.val_check_interval", "trainer.log_every_n_steps",
        "trainer.tau_eval.every_n_steps", "trainer.tau_eval.num_prompts", "trainer.tau_eval.max_new_tokens")},
    **{k: (_ge0, ">= 0") for k in (
        "data.num_workers", "data.regenerate.temperature", "optim.weight_decay", "optim.warmup_steps")},
    "ttt.steps": (lambda v: v >= 1, ">= 1 (number of TTT unroll steps)"),
    "data.max_length": (lambda v: v >= 2, ">= 2 tokens"),
    "data.val_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "ttt.ramp_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}
_DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet", ".yaml", ".txt")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _looks_like_hub_id(path: str) -> bool:
    """`org/name` with no file suffix: a Hub repo id, which is resolved (and checked) when downloaded."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith(".") and not path.endswith(_DATA_SUFFIXES)


def _missing_path(path: str, explicit_only: bool = False) -> bool:
    """True for a local path that does not exist. `explicit_only`: only judge paths that cannot be Hub ids."""
    if path == EMBEDDED_SHAREGPT or Path(path).expanduser().exists():
        return False
    if explicit_only:
        return path.startswith(("/", "./", "../", "~"))
    return not _looks_like_hub_id(path)


def _existing_ancestor(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def _writable_dir_problem(path: str) -> str | None:
    """Why `path` cannot become an output directory, judged at its nearest existing ancestor."""
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        return "exists and is not a directory"
    ancestor = _existing_ancestor(p)
    if not ancestor.is_dir():
        return f"cannot be created: '{ancestor}' is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"not writable: no write permission on '{ancestor}'"
    return None


def _path_kind_problem(path: str, directory: bool, expected: str) -> str | None:
    """Why `path` cannot be (or become) a directory (`directory`) or a file: something of the other kind is in the
    way. Permissions are not judged: a cache or feature store prepared elsewhere may be read-only."""
    p = Path(path).expanduser().absolute()
    if p.exists():
        return None if p.is_dir() == directory else f"is a {'file' if directory else 'directory'}; expected {expected}"
    ancestor = _existing_ancestor(p.parent)
    if not ancestor.is_dir():
        return f"cannot be created: '{ancestor}' is a file; expected {expected}"
    return None


def _target_problem(name: str) -> str | None:
    """Why `target.name_or_path` names no loadable target (local paths only; Hub ids are resolved when loaded)."""
    from eagle3_zoo.adapters.embedded import EMBEDDED_NAMES

    if name in EMBEDDED_NAMES:
        return None
    expected = (f"expected a local model folder with config.json, a Hub repo id 'org/name' or the embedded target "
                f"({' or '.join(repr(n) for n in EMBEDDED_NAMES)})")
    if Path(name).expanduser().is_file():  # a folder without config.json is reported when the target is loaded
        return f"is a file; {expected}"
    if _missing_path(name, explicit_only=True):
        return "local path does not exist"
    return None


def _aux_problem(ids: list[int]) -> str | None:
    if len(ids) not in (1, 3):
        return f"expected 1 or 3 layer ids (low, mid, high), got {len(ids)}"
    if any(i < 0 for i in ids):
        return "layer ids must be >= 0 (HF output_hidden_states indices)"
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return "layer ids must be strictly increasing (low, mid, high)"
    return None


def _semantic_problems(r: Recipe) -> list[RecipeProblem]:
    out: list[RecipeProblem] = []

    def bad(key: str, message: str, related: tuple[str, ...] = ()) -> None:
        value = _get(r, key) if not key.startswith("data.sources[") else _NO_VALUE
        out.append(RecipeProblem(key, message, value, related=related))

    for key, (ok, expected) in _RANGES.items():
        value = _get(r, key)
        if value is not None and not ok(value):
            bad(key, f"must be {expected}")
    families = _known_families()
    if r.target.family != "auto" and r.target.family not in families:
        bad("target.family", f"unknown adapter family; available: auto, {', '.join(families)}"
            + _did_you_mean(r.target.family, families))
    if msg := _target_problem(r.target.name_or_path):
        bad("target.name_or_path", msg)
    for key in ("target.lora_path", "drafter.init_from"):
        if _get(r, key) is not None and _missing_path(_get(r, key)):
            bad(key, "local path does not exist (and it is not a Hub id 'org/name')")
    heads, kv_heads = r.drafter.num_attention_heads, r.drafter.num_key_value_heads
    if heads and kv_heads and kv_heads > 0 and heads % kv_heads:
        bad("drafter.num_key_value_heads", f"must divide num_attention_heads ({heads})",
            ("drafter.num_attention_heads",))
    if r.drafter.aux_layer_ids is not None and (msg := _aux_problem(r.drafter.aux_layer_ids)):
        bad("drafter.aux_layer_ids", msg)
    _data_problems(r, out)
    weights = r.ttt.step_weights
    if weights is not None:
        if len(weights) != r.ttt.steps:
            bad("ttt.step_weights", f"has {len(weights)} entries but ttt.steps = {r.ttt.steps}", ("ttt.steps",))
        elif any(w < 0 for w in weights) or not any(weights):
            bad("ttt.step_weights", "weights must be >= 0 and not all 0")
    if len(r.optim.betas) != 2 or not all(0 <= b < 1 for b in r.optim.betas):
        bad("optim.betas", "expected two AdamW betas in [0, 1), e.g. [0.9, 0.95]")
    if r.trainer.max_steps is not None and r.optim.warmup_steps > r.trainer.max_steps:
        bad("optim.warmup_steps", f"exceeds trainer.max_steps ({r.trainer.max_steps})", ("trainer.max_steps",))
    if r.trainer.max_steps is None and r.trainer.max_epochs is None:
        bad("trainer.max_steps", "set trainer.max_steps or trainer.max_epochs (both are null)", ("trainer.max_epochs",))
    if not _valid_devices(r.trainer.devices):
        bad("trainer.devices", 'expected a count >= 1, -1 (all), "auto" or a comma list of indices like "0,1"')
    if r.trainer.num_nodes > 1 and r.trainer.strategy == "auto":
        bad("trainer.strategy", "multi-node training needs an explicit strategy: ddp or fsdp",
            ("trainer.num_nodes",))
    if r.ttt.schedule == "ramp" and r.ttt.steps == 1:
        bad("ttt.schedule", "a ramp needs ttt.steps > 1", ("ttt.steps",))
    if not r.output_dir.strip():
        bad("output_dir", "must not be empty")
    elif reason := _writable_dir_problem(r.output_dir):
        bad("output_dir", reason)
    return out


def _data_problems(r: Recipe, out: list[RecipeProblem]) -> None:
    if not r.data.sources:
        out.append(RecipeProblem("data.sources", "at least one data source is required", []))
    for i, src in enumerate(r.data.sources):
        key = f"data.sources[{i}]"
        if not src.path.strip():
            out.append(RecipeProblem(f"{key}.path", "must not be empty", src.path))
        elif _missing_path(src.path):
            out.append(RecipeProblem(f"{key}.path", "data file not found (relative paths are resolved against the "
                                     f"working directory {os.getcwd()}; or use '{EMBEDDED_SHAREGPT}')", src.path))
        if src.max_samples is not None and src.max_samples <= 0:
            out.append(RecipeProblem(f"{key}.max_samples", "must be > 0 (or null = all)", src.max_samples))
    d = r.data
    kinds = [("data.cache_dir", d.cache_dir, True, "a directory (token counts, regenerated data and features)"),
             ("data.features_dir", d.features_dir, True, "a directory of feature shards (or null = in data.cache_dir)"),
             ("data.regenerate.output", d.regenerate.output, False,
              "a JSONL file path for the regenerated conversations (or null = in data.cache_dir)")]
    for key, value, directory, expected in kinds:
        if value is not None and (msg := _path_kind_problem(value, directory, expected)):
            out.append(RecipeProblem(key, msg, value))


def _valid_devices(devices: int | str) -> bool:
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    parts = [p.strip() for p in devices.split(",") if p.strip()]
    return devices == "auto" or (bool(parts) and all(p.isdigit() for p in parts))


def validate_recipe(cfg: Recipe | DictConfig, source: str = "recipe") -> None:
    """Check the values of a typed recipe (ranges, choices, paths, cross-field rules).

    Args:
        cfg: a `Recipe` or an OmegaConf structured config built from it.
        source: what the problems are attributed to (a file path).

    Raises:
        RecipeError: listing every problem found.
    """
    recipe = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
    problems = _semantic_problems(recipe)
    for p in problems:
        p.source = source
    if problems:
        raise RecipeError(problems)


def validate_against_target(recipe: Recipe, num_layers: int, vocab_size: int, hidden_size: int,
                            source: str = "recipe") -> None:
    """Cross-check a recipe against the target's config (known only once the target config is read).

    Raises:
        RecipeError: draft vocab larger than the target vocab, aux layer ids out of range, or a drafter width
            that differs from the target's (the frozen target embedding feeds the drafter directly).
    """
    problems = []
    d = recipe.drafter
    if d.draft_vocab_size > vocab_size:
        problems.append(RecipeProblem("drafter.draft_vocab_size", f"exceeds the target vocabulary ({vocab_size})",
                                      d.draft_vocab_size, source))
    if d.aux_layer_ids is not None and any(not 0 <= i < num_layers for i in d.aux_layer_ids):
        problems.append(RecipeProblem("drafter.aux_layer_ids", f"out of range for a {num_layers}-layer target "
                                      f"(valid 0..{num_layers - 1})", d.aux_layer_ids, source))
    if d.hidden_size is not None and d.hidden_size != hidden_size:
        problems.append(RecipeProblem("drafter.hidden_size", f"must equal the target hidden size ({hidden_size}) "
                                      "because the frozen target embedding is fed to the drafter", d.hidden_size,
                                      source))
    if problems:
        raise RecipeError(problems)


# ------------------------------------------------------------------------------------------------ loading
def _parse_yaml(text: str, source: str) -> DictConfig:
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        reason = getattr(e, "problem", None) or str(e)
        raise RecipeError([RecipeProblem("<yaml>", f"YAML syntax error at line {mark.line + 1 if mark else '?'}: "
                                         f"{reason}", source=where)]) from None
    if parsed is None:
        raise RecipeError([RecipeProblem("<file>", "empty recipe file (no keys)", source=source)])
    if not isinstance(parsed, dict):
        raise RecipeError([RecipeProblem("<root>", "expected a mapping at the top level", parsed, source)])
    try:  # OmegaConf's own loader: it reads 1e-4 as a float, where PyYAML's YAML 1.1 rules give a string
        return OmegaConf.create(text)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise RecipeError([RecipeProblem("<yaml>", str(e).splitlines()[0], source=source)]) from None


def _apply_overrides(cfg: DictConfig, overrides: typing.Sequence[str]) -> tuple[dict[str, str], list]:
    applied: dict[str, str] = {}
    problems = []
    for ov in overrides:
        key, sep, _ = ov.partition("=")
        src = f"override '{ov}'"
        if not sep or not key.strip():
            problems.append(RecipeProblem(key or ov, "an override must look like key=value", source=src))
            continue
        try:
            cfg.merge_with_dotlist([ov])
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
            problems.append(RecipeProblem(key, f"cannot apply override: {str(e).splitlines()[0]}", source=src))
            continue
        applied[key.strip()] = src
    return applied, problems


def _source_of(key: str, applied: dict[str, str], default: str) -> str:
    for ov_key, src in reversed(list(applied.items())):
        if key == ov_key or key.startswith((ov_key + ".", ov_key + "[")) or ov_key.startswith(key + "."):
            return src
    return default


def load_recipe(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Load a YAML recipe, apply OmegaConf dotlist overrides, and validate it.

    Args:
        path: the recipe file.
        overrides: dotlist overrides applied in order, e.g. `["trainer.max_steps=2000", "data.max_samples=500"]`.

    Returns:
        The typed `Recipe` (interpolations resolved).

    Raises:
        RecipeError: every problem at once (file, dotted key, bad value, what is expected).
    """
    source = str(path)
    if not Path(path).is_file():
        raise RecipeError([RecipeProblem("<file>", "recipe file not found", source, source)])
    cfg = _parse_yaml(Path(path).read_text(encoding="utf-8"), source)
    applied, problems = _apply_overrides(cfg, overrides)
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeError([*problems, RecipeProblem(getattr(e, "full_key", None) or "<interpolation>",
                                                    str(e).splitlines()[0], source=source)]) from None
    clean = _check_mapping(raw, Recipe, "", problems)
    for p in problems:
        p.source = p.source if p.source != "recipe" else _source_of(p.key, applied, source)
    try:
        recipe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), clean))
    except OmegaConfBaseException:  # only after a schema problem (e.g. a source without `path`)
        raise RecipeError(problems) from None
    bad_keys = {p.key for p in problems}
    for p in _semantic_problems(recipe):
        # a check that read a key with a schema problem (or an item under it) would only echo that problem
        if not any(bad == k or bad.startswith((k + ".", k + "[")) for bad in bad_keys for k in (p.key, *p.related)):
            p.source = _source_of(p.key, applied, source)
            problems.append(p)
    if problems:
        raise RecipeError(problems)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain nested dict of a recipe (for loggers' hyperparameters and model cards)."""
    return OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)


def resolved_recipe_yaml(recipe: Recipe | DictConfig) -> str:
    """The resolved recipe (defaults + file + overrides) as YAML, as `fit --print-config` shows it."""
    cfg = recipe if isinstance(recipe, DictConfig) else OmegaConf.structured(recipe)
    return OmegaConf.to_yaml(cfg, resolve=True)


def save_resolved_recipe(recipe: Recipe | DictConfig, path: str | os.PathLike) -> Path:
    """Write the resolved recipe as YAML atomically (temp file in the same directory, fsync, rename).

    Returns:
        The written path.
    """
    from eagle3_zoo.modeling.io import atomic_write_text

    path = Path(path)
    atomic_write_text(path, resolved_recipe_yaml(recipe))
    return path
