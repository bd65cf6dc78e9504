"""Typed training recipes: schema, loading with dotlist overrides, and validation.

A recipe is a YAML file loaded into the `Recipe` dataclass tree (an OmegaConf structured config). Types and choices
come from the annotations and each value rule sits on its field (`_f(default, check)`), so a new key is one field.
Every problem (unknown key, wrong type, bad value, missing file) is raised at once in one `RecipeError`.

    recipe = load_recipe("recipes/qwen25_7b.yaml", ["trainer.max_steps=2000"])
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_zoo.dtypes import DTYPE_NAMES

EMBEDDED_TARGET = "smollm2-135m-instruct"  # the embedded GGUF target (eagle3_zoo.adapters.embedded)
EMBEDDED_NAMES = (EMBEDDED_TARGET, "embedded")
EMBEDDED_SHAREGPT = "sharegpt-embedded"  # the embedded ShareGPT sample (eagle3_zoo.data.readers)
_DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet", ".yaml", ".txt")
Check = Callable[[Any], "str | None"]  # a value rule: why a (non-null) value is bad, or None


def _f(default: Any = None, check: Check | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field whose value must pass `check` unless it is null (= off/default)."""
    return field(metadata={"check": check}, **({"default_factory": factory} if factory else {"default": default}))


def _rule(ok: Callable[[Any], bool], message: str) -> Check:
    return lambda v: None if ok(v) else message


GT0, GE0, UNIT = (_rule(lambda v: v > 0, "must be > 0"), _rule(lambda v: v >= 0, "must be >= 0"),
                  _rule(lambda v: 0 <= v <= 1, "must be in [0, 1]"))


def _missing_path(path: str, explicit_only: bool = False) -> bool:
    """A local path that does not exist: not `org/name` without a file suffix (a Hub id, checked when downloaded);
    `explicit_only`: only paths that cannot be Hub ids."""
    if path == EMBEDDED_SHAREGPT or Path(path).expanduser().exists():
        return False
    parts = path.split("/")
    if explicit_only:
        return path.startswith(("/", "./", "../", "~"))
    return not (len(parts) == 2 and all(parts) and not path.startswith(".") and not path.endswith(_DATA_SUFFIXES))


def _path_problem(path: str, directory: bool = True, expected: str | None = None) -> str | None:
    """Why `path` cannot be (or become) a directory or a file: something of the other kind is in the way. `expected`
    None = an output directory, which must be writable too (a cache prepared elsewhere may be read-only)."""
    p = Path(path).expanduser().absolute()
    ancestor = next(a for a in (p, *p.parents) if a.exists())
    if ancestor == p and p.is_dir() != directory:
        return f"is a {'file' if directory else 'directory'}; expected {expected}" if expected else \
            "exists and is not a directory"
    if ancestor != p and not ancestor.is_dir():
        return f"cannot be created: '{ancestor}' is a file" + (f"; expected {expected}" if expected else "")
    if expected is None and not os.access(ancestor, os.W_OK | os.X_OK):
        return f"not writable: no write permission on '{ancestor}'"
    return None


def _target_problem(name: str) -> str | None:
    """Local paths only (Hub ids are resolved when loaded; a folder without config.json is reported then too)."""
    if name not in EMBEDDED_NAMES and Path(name).expanduser().is_file():
        return (f"is a file; expected a local model folder with config.json, a Hub repo id 'org/name' or the embedded "
                f"target ({' or '.join(repr(n) for n in EMBEDDED_NAMES)})")
    return "local path does not exist" if _missing_path(name, explicit_only=True) else None


def _family_problem(family: str) -> str | None:
    from eagle3_zoo.adapters import available_adapters  # the registry: a new family needs no edit here

    families = sorted(available_adapters())
    return None if family == "auto" or family in families else \
        f"unknown adapter family; available: auto, {', '.join(families)}" + _did_you_mean(family, families)


def _aux_problem(ids: list[int]) -> str | None:
    return next((msg for broken, msg in [
        (len(ids) not in (1, 3), f"expected 1 or 3 layer ids (low, mid, high), got {len(ids)}"),
        (any(i < 0 for i in ids), "layer ids must be >= 0 (HF output_hidden_states indices)"),
        (any(b <= a for a, b in zip(ids, ids[1:])), "layer ids must be strictly increasing (low, mid, high)")]
        if broken), None)


def _devices_ok(devices: int | str) -> bool:
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    parts = [p.strip() for p in devices.split(",") if p.strip()]
    return devices == "auto" or (bool(parts) and all(p.isdigit() for p in parts))


def _source_problem(path: str) -> str | None:
    return "must not be empty" if not path.strip() else (
        f"data file not found (relative paths are resolved against the working directory {os.getcwd()}; or use "
        f"'{EMBEDDED_SHAREGPT}')" if _missing_path(path) else None)


HUB_OR_LOCAL = _rule(lambda v: not _missing_path(v), "local path does not exist (and it is not a Hub id 'org/name')")


# ------------------------------------------------------------------------------------------------ schema
@dataclass
class TargetConfig:
    """The frozen target model the drafter learns to predict."""
    name_or_path: str = _f(EMBEDDED_TARGET, _target_problem)  # Hub id, local folder or the embedded GGUF model
    family: str = _f("auto", _family_problem)  # adapter (HF model_type); "auto" = read from the target config
    dtype: Literal[DTYPE_NAMES] = "bfloat16"  # dtype the frozen target runs in
    lora_path: str | None = _f(None, HUB_OR_LOCAL)  # PEFT LoRA adapter merged into the target before extraction
    trust_remote_code: bool = False  # passed to transformers; off: it executes code from the Hub


@dataclass
class DrafterConfig:
    """Shape of the EAGLE-3 drafter (one Llama decoder layer); null fields follow the target."""
    hidden_size: int | None = _f(None, GT0)  # must equal the target's: its frozen embedding feeds the drafter
    intermediate_size: int | None = _f(None, GT0)  # MLP width of the single decoder layer
    num_attention_heads: int | None = _f(None, GT0)
    num_key_value_heads: int | None = _f(None, GT0)
    head_dim: int | None = _f(None, GT0)
    draft_vocab_size: int = _f(32000, GT0)  # most frequent supervised target tokens (EAGLE-3 uses 32000)
    aux_layer_ids: list[int] | None = _f(None, _aux_problem)  # HF output_hidden_states ids (low, mid, high) or one
    init_from: str | None = _f(None, HUB_OR_LOCAL)  # an existing drafter (local dir or Hub id) to start from
    # random = normal(0, 0.02) (official EAGLE-3); target = the target's lm_head rows and final norm (vLLM speculators)
    init_head: Literal["random", "target"] = "random"  # the same accuracy on SmolLM2 after 200 steps (recipes/README)


@dataclass
class DataSourceConfig:
    """One conversation source."""
    path: str = _f(MISSING, _source_problem)  # JSON/JSONL file or folder, a Hub dataset id, or "sharegpt-embedded"
    format: Literal["auto", "sharegpt", "messages", "jsonl"] = "auto"  # auto: JSON list/JSONL, ShareGPT/OpenAI
    max_samples: int | None = _f(None, _rule(lambda v: v > 0, "must be > 0 (or null = all)"))
    split: Literal["train", "val"] | None = None  # null = split by data.val_fraction; else feed one split only


@dataclass
class RegenerateConfig:
    """Regeneration of assistant turns by the target before training (as EAGLE-3 does: raises acceptance)."""
    enabled: bool = False
    max_new_tokens: int = _f(1024, GT0)
    temperature: float = _f(0.0, GE0)  # 0 = greedy, matching T=0 evaluation
    batch_size: int = _f(8, GT0)
    max_turns: int | None = _f(None, GT0)  # answer at most this many assistant turns per conversation; null = all
    output: str | None = _f(None, lambda v: _path_problem(v, False, "a JSONL file path for the regenerated "
                                                         "conversations (or null = in data.cache_dir)"))
    # hf = `generate` in this process; openai = any OpenAI-compatible server at base_url (vLLM, SGLang, ...);
    # vllm = a vLLM server started for the target (scripts/setup_engine.sh). Same output file and cache key.
    backend: Literal["hf", "openai", "vllm"] = "hf"
    base_url: str | None = None  # backend openai: the server root, e.g. http://10.0.0.5:8000
    api_key_env: str | None = None  # backend openai: the environment variable holding the API key (null = none)
    concurrency: int = 4  # backend openai/vllm: conversations in flight at once (the server batches them)
    timeout: float = 600.0  # backend openai/vllm: seconds per request
    retries: int = 4  # backend openai/vllm: retries of a failed request (429, 5xx, timeouts), backoff from 1 s


@dataclass
class DataConfig:
    """Conversations -> tokens, loss masks and (offline) features."""
    sources: list[DataSourceConfig] = _f(check=_rule(bool, "at least one data source is required"),
                                         factory=lambda: [DataSourceConfig(path=EMBEDDED_SHAREGPT)])
    max_length: int = _f(2048, _rule(lambda v: v >= 2, "must be >= 2 tokens"))  # EAGLE-3 trains on 2048 tokens
    overflow: Literal["truncate", "drop"] = "truncate"  # a conversation longer than max_length tokens
    max_samples: int | None = _f(None, GT0)  # cap on conversations over all sources
    on_error: Literal["raise", "skip"] = "raise"  # bad records: stop naming file and record, or skip and count
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # extra chat-template variables for regeneration and tokenisation, e.g. {enable_thinking: false} (Qwen3) or
    # {reasoning_effort: low} (gpt-oss); {} = the template's defaults (Qwen3 and gpt-oss think)
    chat_template_kwargs: dict = field(default_factory=dict)
    # token counts, regenerated data and features, keyed by content fingerprints (shared across runs)
    cache_dir: str = _f(".cache/eagle3_zoo", lambda v: _path_problem(v, True, "a directory (token counts, "
                                                                     "regenerated data and features)"))
    mode: Literal["online", "offline"] = "online"  # online = target in the training step; offline = feature shards
    features_dir: str | None = _f(None, lambda v: _path_problem(v, True, "a directory of feature shards (or null = "
                                                                "in data.cache_dir)"))
    features_dtype: Literal[DTYPE_NAMES] = "bfloat16"
    features_shard_size: int = _f(256, GT0)  # samples per feature shard (a crash loses at most one shard)
    # hf = the target in this process; vllm = a vLLM server started for the target (its extract_hidden_states)
    features_backend: Literal["hf", "vllm"] = "hf"
    val_fraction: float = _f(0.01, _rule(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    num_workers: int = _f(2, GE0)
    seed: int = 0  # seed of the train/val split and shuffling


@dataclass
class TTTConfig:
    """Training-time test: the K-step unrolled loss (DESIGN.md section 5)."""
    steps: int = _f(7, _rule(lambda v: v >= 1, "must be >= 1 (number of TTT unroll steps)"))  # official EAGLE-3 K
    step_weight_decay: float = _f(0.8, GT0)  # step k weighs step_weight_decay ** k unless step_weights is given
    step_weights: list[float] | None = None  # explicit per-step weights (length ttt.steps)
    schedule: Literal["constant", "ramp"] = "constant"  # constant = all K steps at once; ramp = grow 1 -> K
    ramp_fraction: float = _f(0.3, UNIT)  # fraction of training over which the ramp reaches K


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""
    lr: float = _f(1e-4, GT0)  # SpecForge default; the official EAGLE-3 8B run uses 5e-5 (recipes set it)
    weight_decay: float = _f(0.0, GE0)
    betas: list[float] = _f(check=_rule(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), "expected two AdamW "
                                        "betas in [0, 1), e.g. [0.9, 0.95]"), factory=lambda: [0.9, 0.95])  # EAGLE-3's
    warmup_steps: int = _f(0, GE0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = _f(0.0, UNIT)  # final learning rate as a fraction of lr
    grad_clip: float | None = _f(0.5, GT0)  # gradient norm clip (official EAGLE-3); null = off
    # train fc on features scaled to unit RMS per dimension (measured on the first training samples), folded into
    # fc.weight on export: same format, but a few "massive activation" dims no longer dominate (recipes/README.md)
    precondition_fc: bool = False


@dataclass
class TauEvalConfig:
    """Periodic acceptance-length measurement during training."""
    every_n_steps: int | None = _f(None, GT0)  # measure tau with real speculative decoding every N steps; null = off
    num_prompts: int = _f(8, GT0)
    max_new_tokens: int = _f(64, GT0)


@dataclass
class TrainerConfig:
    """Lightning Trainer switches; parallelism stays coarse (one strategy builder reads them)."""
    max_steps: int | None = _f(None, GT0)  # optimizer steps; null = run max_epochs
    max_epochs: int | None = _f(1, GT0)
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"] = "32-true"
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"  # gpu: stop at once without CUDA GPUs; auto: else the CPU
    devices: int | str = _f("auto", _rule(_devices_ok, 'expected a count >= 1, -1 (all), "auto" or a comma list of '
                                          'indices like "0,1"'))
    num_nodes: int = _f(1, GT0)
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    accumulate_grad_batches: int = _f(1, GT0)
    batch_size: int = _f(1, GT0)  # per-device micro-batch (conversations)
    checkpoint_every_n_steps: int | None = _f(1000, GT0)
    val_check_interval: int | None = _f(None, GT0)  # validate every N training batches; null = once per epoch
    log_every_n_steps: int = _f(10, GT0)
    logger: list[Literal["csv", "tensorboard"]] = field(default_factory=lambda: ["csv", "tensorboard"])
    seed: int = 42  # seed of the drafter initialisation and data order
    activation_checkpointing: bool = False
    gpu_memory_gb: float | None = None  # memory of one GPU the recipe is planned for; `eagle3-zoo plan` checks it
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
    # checkpoints, logs, the resolved recipe and the exported drafter
    output_dir: str = _f("runs/eagle3", lambda v: _path_problem(v) if v.strip() else "must not be empty")
    demo: bool = False  # a smoke/demo run (e.g. the quickstart's): its model card says it is not a drafter to serve


def _cross_field_rules(r: Recipe) -> list[tuple[str, bool, str, tuple[str, ...]]]:
    """Rules that read several fields: (key, broken, message, the other keys read)."""
    d, t, tr, w = r.drafter, r.ttt, r.trainer, r.ttt.step_weights
    heads, kv = d.num_attention_heads, d.num_key_value_heads
    return [
        ("drafter.num_key_value_heads", bool(heads and kv and kv > 0 and heads % kv),
         f"must divide num_attention_heads ({heads})", ("drafter.num_attention_heads",)),
        ("ttt.step_weights", w is not None and len(w) != t.steps,
         f"has {len(w or [])} entries but ttt.steps = {t.steps}", ("ttt.steps",)),
        ("ttt.step_weights", w is not None and len(w) == t.steps and (any(x < 0 for x in w) or not any(w)),
         "weights must be >= 0 and not all 0", ()),
        ("optim.warmup_steps", tr.max_steps is not None and r.optim.warmup_steps > tr.max_steps,
         f"exceeds trainer.max_steps ({tr.max_steps})", ("trainer.max_steps",)),
        ("trainer.max_steps", tr.max_steps is None and tr.max_epochs is None,
         "set trainer.max_steps or trainer.max_epochs (both are null)", ("trainer.max_epochs",)),
        ("trainer.strategy", tr.num_nodes > 1 and tr.strategy == "auto",
         "multi-node training needs an explicit strategy: ddp or fsdp", ("trainer.num_nodes",)),
        ("ttt.schedule", t.schedule == "ramp" and t.steps == 1, "a ramp needs ttt.steps > 1", ("ttt.steps",))]


# --------------------------------------------------------------------------------------------------- errors
_NO_VALUE, _BAD = object(), object()


@dataclass
class RecipeProblem:
    """One problem in a recipe: where it comes from, the dotted key, the bad value and what is expected."""
    key: str
    message: str
    value: Any = _NO_VALUE
    source: str = "recipe"
    related: tuple[str, ...] = ()  # other keys the check read; a type error there makes this check moot

    def __str__(self) -> str:
        return f"{self.source}: {self.key}{'' if self.value is _NO_VALUE else f' = {self.value!r}'}: {self.message}"


class RecipeError(ValueError):
    """All problems of a recipe, reported at once."""

    def __init__(self, problems: list[RecipeProblem]):
        self.problems = list(problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid recipe ({len(self.problems)} {noun}):\n" + "\n".join(f"  - {p}" for p in problems))


def _did_you_mean(word: Any, choices: typing.Iterable[str], prefix: str = "") -> str:
    choices = [str(c) for c in choices]
    match = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    match = match or [c for c in choices if c.startswith(str(word))][:1]  # 32 -> 32-true
    return f"; did you mean '{prefix}{match[0]}'?" if match else ""


# ------------------------------------------------------------------------------------------------- checking
def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is list:
        plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(args[0])
        plural = "mappings" if dataclasses.is_dataclass(args[0]) else plural
        return f"a list of {plural or 'values, each ' + _describe(args[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _schema_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Leaf name -> dotted key over the whole schema, to suggest `optim.lr` for a misplaced `trainer.lr`."""
    out: dict[str, str] = {}
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(_schema_keys(tp, f"{prefix}{name}."))
        else:
            out.setdefault(name, prefix + name)
    return out


def _check(raw: Any, tp: Any, key: str, problems: list[RecipeProblem]) -> Any:
    """The part of `raw` that has type `tp` (`_BAD`: none), each mismatch reported: unknown keys with a "did you
    mean", missing required keys, bad list items one by one (a bad source is left out, the others kept). YAML types
    are strict: no "4" for an integer, no true for 1 (OmegaConf would convert both)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(raw, dict):
            problems.append(RecipeProblem(key or "<root>", f"expected a mapping of {tp.__name__} fields", raw))
            return _BAD
        hints, clean, section = typing.get_type_hints(tp), {}, f"{key}." if key else ""
        for name, value in raw.items():
            if name not in hints:
                hint = _did_you_mean(name, hints, section)
                dotted = _schema_keys(Recipe).get(name)
                hint = hint or (f"; did you mean '{dotted}'?" if dotted and not dotted.startswith(key + ".") else "")
                problems.append(RecipeProblem(section + str(name), "unknown key; " + (
                    hint[2:] or f"valid keys here: {', '.join(hints)}")))
            elif (value := _check(value, hints[name], section + name, problems)) is not _BAD:
                clean[name] = value
        missing = [f.name for f in dataclasses.fields(tp) if f.default is MISSING and f.name not in raw]
        for name in missing:
            problems.append(RecipeProblem(section + name, f"required key missing (expected {_describe(hints[name])})"))
        return _BAD if missing else clean
    if origin is list and isinstance(raw, list):
        items = [_check(v, args[0], f"{key}[{i}]", problems) for i, v in enumerate(raw)]
        good = [v for v in items if v is not _BAD]
        return good if len(good) == len(items) or dataclasses.is_dataclass(args[0]) else _BAD
    if origin in (typing.Union, types.UnionType):
        ok = any(_check(raw, a, key, []) is not _BAD for a in args)
    elif origin is Literal:
        ok = isinstance(raw, str) and raw in args
    else:  # a bool is no integer; an integer is a number
        ok = origin is None and isinstance(raw, bool) == (tp is bool) and isinstance(raw, (int, float) if tp is float
                                                                                     else tp)
    if ok:
        return raw
    choices = [c for a in (tp, *args) if typing.get_origin(a) is Literal for c in typing.get_args(a)]
    hint = _did_you_mean(raw, choices) if isinstance(raw, str) and choices else ""
    problems.append(RecipeProblem(key, f"expected {_describe(tp)}{hint}", raw))
    return _BAD


def _value_problems(obj: Any, prefix: str = "") -> list[RecipeProblem]:
    """Each field's own rule over a typed recipe (sections and list items included), then the cross-field rules."""
    out = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if value is not None and f.metadata.get("check") and (msg := f.metadata["check"](value)):
            out.append(RecipeProblem(key, msg, value))
        for i, sub in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if dataclasses.is_dataclass(sub):
                out += _value_problems(sub, f"{key}." if i is None else f"{key}[{i}].")
    return out + ([RecipeProblem(k, msg, operator.attrgetter(k)(obj), related=rel)
                   for k, broken, msg, rel in _cross_field_rules(obj) if broken] if isinstance(obj, Recipe) else [])


def validate_recipe(cfg: Recipe | DictConfig, source: str = "recipe") -> None:
    """Check the values of a typed recipe or its structured config (ranges, paths, cross-field rules).

    Raises:
        RecipeError: every problem found, attributed to `source` (a file path).
    """
    problems = _value_problems(OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg)
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
    d = recipe.drafter
    problems = [RecipeProblem(key, message, value, source) for key, value, broken, message in [
        ("drafter.draft_vocab_size", d.draft_vocab_size, d.draft_vocab_size > vocab_size,
         f"exceeds the target vocabulary ({vocab_size})"),
        ("drafter.aux_layer_ids", d.aux_layer_ids, any(not 0 <= i < num_layers for i in d.aux_layer_ids or []),
         f"out of range for a {num_layers}-layer target (valid 0..{num_layers - 1})"),
        ("drafter.hidden_size", d.hidden_size, d.hidden_size not in (None, hidden_size),
         f"must equal the target hidden size ({hidden_size}) because the frozen target embedding is fed to the "
         "drafter")] if broken]
    if problems:
        raise RecipeError(problems)


# ------------------------------------------------------------------------------------------------ loading
def _parse_yaml(text: str, source: str) -> DictConfig:
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark, reason = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e)
        raise RecipeError([RecipeProblem("<yaml>", f"YAML syntax error at line {mark.line + 1 if mark else '?'}: "
                                         f"{reason}", source=f"{source}:{mark.line + 1}:{mark.column + 1}"
                                         if mark else source)]) from None
    if not isinstance(parsed, dict):
        raise RecipeError([RecipeProblem("<file>", "empty recipe file (no keys)", source=source) if parsed is None
                           else RecipeProblem("<root>", "expected a mapping at the top level", parsed, source)])
    try:  # OmegaConf's own loader: it reads 1e-4 as a float, where PyYAML's YAML 1.1 rules give a string
        return OmegaConf.create(text)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise RecipeError([RecipeProblem("<yaml>", str(e).splitlines()[0], source=source)]) from None


def load_recipe(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Recipe:
    """The typed `Recipe` (interpolations resolved) of a YAML file with OmegaConf dotlist `overrides` applied in
    order (e.g. `["trainer.max_steps=2000"]`), validated.

    Raises:
        RecipeError: every problem at once (file or override, dotted key, bad value, what is expected).
    """
    source, applied, problems = str(path), {}, []
    if not Path(path).is_file():
        raise RecipeError([RecipeProblem("<file>", "recipe file not found", source, source)])
    cfg = _parse_yaml(Path(path).read_text(encoding="utf-8"), source)
    for ov in overrides:
        (key, sep, _), src = ov.partition("="), f"override '{ov}'"
        try:
            if not sep or not key.strip():
                raise ValueError("an override must look like key=value")
            cfg.merge_with_dotlist([ov])
            applied[key.strip()] = src
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
            why = str(e) if not sep or not key.strip() else f"cannot apply override: {str(e).splitlines()[0]}"
            problems.append(RecipeProblem(key or ov, why, source=src))

    def source_of(key: str) -> str:  # the last override that set the key (or a section above or an item under it)
        return next((src for k, src in reversed(applied.items()) if key == k or key.startswith((k + ".", k + "["))
                     or k.startswith(key + ".")), source)

    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeError([*problems, RecipeProblem(getattr(e, "full_key", None) or "<interpolation>",
                                                    str(e).splitlines()[0], source=source)]) from None
    clean = _check(raw, Recipe, "", problems)
    for p in problems:
        p.source = p.source if p.source != "recipe" else source_of(p.key)
    try:  # the typed values (an integer for a number becomes a float) over the defaults
        recipe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), clean))
    except OmegaConfBaseException:  # only after a schema problem
        raise RecipeError(problems) from None
    bad_keys = {p.key for p in problems}
    for p in _value_problems(recipe):
        # a check that read a key with a schema problem (or an item under it) would only echo that problem
        if not any(bad == k or bad.startswith((k + ".", k + "[")) for bad in bad_keys for k in (p.key, *p.related)):
            p.source = source_of(p.key)
            problems.append(p)
    if problems:
        raise RecipeError(problems)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain nested dict of a recipe (for loggers' hyperparameters and model cards)."""
    return OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)


def resolved_recipe_yaml(recipe: Recipe | DictConfig) -> str:
    """The resolved recipe (defaults + file + overrides) as YAML, as `fit --print-config` shows it."""
    return OmegaConf.to_yaml(recipe if isinstance(recipe, DictConfig) else OmegaConf.structured(recipe), resolve=True)


def save_resolved_recipe(recipe: Recipe | DictConfig, path: str | os.PathLike) -> Path:
    """Write the resolved recipe as YAML atomically (temp file in the same directory, fsync, rename); the path."""
    from eagle3_zoo.modeling.io import atomic_write_text

    atomic_write_text(Path(path), resolved_recipe_yaml(recipe))
    return Path(path)
