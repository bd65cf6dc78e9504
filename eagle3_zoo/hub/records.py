"""Typed readings of the two JSON files a model card reads: an evaluation's results (`eval_results*.json`, what
`eagle3-zoo eval` writes) and a run's `provenance.json` (what `fit` writes). Each file is checked once, here, by one
parser (`read_eval_record`, `read_training_record`) into small frozen dataclasses; the card reads their attributes.

A field of the wrong type is an error naming the file, the key path and what was expected (a results file of
another tool, say). Missing fields are None. The older layouts the card reads besides the current one:

- results: ``benchmarks`` as a list of ``{"name": ..., ...}``, or a benchmark given as its tau alone; an engine run
  (`eval --engine`) with the pooled counters (``overall``, top-level ``tau``) and no benchmarks; no ``settings``.
- provenance: the training fields at the top level instead of under ``training``, under the names ``steps`` /
  ``max_steps``, ``device`` / ``accelerator`` / ``devices``, ``train_time`` / ``wall_time`` / ``duration`` (text)
  and ``train_time_s`` / ``duration_s`` (seconds) besides fit's ``global_step``, ``hardware`` and ``wall_time_s``;
  ``versions`` instead of ``packages``.

This module reads plain JSON only: it knows the layouts, not the code that writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
          list: "a list"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float)) else repr(value)
    return f"{_KINDS.get(type(value), type(value).__name__)} ({text if len(text) <= 60 else text[:57] + '...'})"


class _Reader:
    """Checks of one file's JSON values; every error names the file and the key path."""

    def __init__(self, file: str | Path):
        self.file = str(file)

    def error(self, path: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"{self.file}: `{path}` should be {expected}, not {_kind(value)}")

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        """An object (None: empty)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(path, "an object", value)
        return value

    def number(self, value: Any, path: str) -> float | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise self.error(path, "a number or null", value)
        return value

    def integer(self, value: Any, path: str) -> int | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.error(path, "an integer or null", value)
        return value

    def text(self, value: Any, path: str) -> str | None:
        if value is not None and not isinstance(value, str):
            raise self.error(path, "a string or null", value)
        return value

    def flag(self, value: Any, path: str) -> bool | None:
        if value is not None and not isinstance(value, bool):
            raise self.error(path, "true, false or null", value)
        return value

    def items(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(path, "a list", value)
        return value

    def numbers(self, value: Any, path: str) -> tuple[float | None, ...]:
        return tuple(self.number(x, f"{path}[{i}]") for i, x in enumerate(self.items(value, path)))

    def counts(self, value: Any, path: str) -> dict[str, int]:
        """An object of integers (`{reason: count}`)."""
        out: dict[str, int] = {}
        for key, count in self.mapping(value, path).items():
            if isinstance(count, bool) or not isinstance(count, int):
                raise self.error(f"{path}.{key}", "an integer", count)
            out[key] = count
        return out


def _first(mapping: Mapping[str, Any], *keys: str) -> tuple[str, Any]:
    """The first of `keys` with a value, and the value (the last key and None if none has one)."""
    return next(((k, mapping[k]) for k in keys if mapping.get(k) is not None), (keys[-1], None))


# --- eval_results*.json ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchStats:
    """The figures of one benchmark, or of all requests pooled (``overall``)."""

    requests: int | None = None
    tau: float | None = None
    tau_per_request_mean: float | None = None
    speedup: float | None = None
    spec_tokens_per_s: float | None = None  # or the older `tokens_per_s`
    baseline_tokens_per_s: float | None = None
    acceptance_per_depth: tuple[float | None, ...] | None = None
    depth_attempts: tuple[int | None, ...] = ()
    cycles: int | None = None
    lossless: bool | None = None


@dataclass(frozen=True)
class EvalSettingsRecord:
    """The settings an evaluation recorded: the ones the card interprets, typed, and all of them (`entries`, in the
    file's order) for the settings lines."""

    entries: Mapping[str, Any] = field(default_factory=dict)
    mode: str | None = None
    depth: int | None = None
    top_k: int | None = None
    total_tokens: int | None = None
    min_prob: float | None = None
    temperature: float | None = None
    engine: str | None = None  # `eval --engine`: measured by the serving engine's own counters
    num_speculative_tokens: int | None = None
    benches: tuple[str, ...] = ()
    drafter_tensors_sha256: str | None = None
    drafter_weights_sha256: str | None = None  # older `eval`: the digest of the weight file


@dataclass(frozen=True)
class MachineRecord:
    """What the evaluation ran on, and the 1/5/15-minute load average at its start and end (empty: not recorded)."""

    platform: str | None = None
    processor: str | None = None
    gpu: str | None = None
    device: str | None = None
    cpu_count: int | None = None
    torch_threads: int | None = None
    load_start: tuple[float | None, ...] = ()
    load_end: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class ShapeRecord:
    """One shape of an `eval --shapes` comparison."""

    shape: str
    benchmarks: Mapping[str, BenchStats]
    overall: BenchStats | None = None


@dataclass(frozen=True)
class EvalRecord:
    """An evaluation's results file. `shapes` is None unless it is an `eval --shapes` comparison; `tau` is the
    top-level pooled tau an engine run records; `machine` is None when not recorded."""

    settings: EvalSettingsRecord
    benchmarks: Mapping[str, BenchStats]
    overall: BenchStats | None = None
    tau: float | None = None
    shapes: tuple[ShapeRecord, ...] | None = None
    machine: MachineRecord | None = None


def _bench(r: _Reader, value: Any, path: str) -> BenchStats:
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # older: a benchmark given as its tau
        return BenchStats(tau=value)
    b = r.mapping(value, path)
    rate_key, rate = _first(b, "spec_tokens_per_s", "tokens_per_s")
    depth = b.get("acceptance_per_depth")
    attempts = r.items(b.get("depth_attempts"), f"{path}.depth_attempts")
    return BenchStats(
        requests=r.integer(b.get("requests"), f"{path}.requests"), tau=r.number(b.get("tau"), f"{path}.tau"),
        tau_per_request_mean=r.number(b.get("tau_per_request_mean"), f"{path}.tau_per_request_mean"),
        speedup=r.number(b.get("speedup"), f"{path}.speedup"),
        spec_tokens_per_s=r.number(rate, f"{path}.{rate_key}"),
        baseline_tokens_per_s=r.number(b.get("baseline_tokens_per_s"), f"{path}.baseline_tokens_per_s"),
        acceptance_per_depth=None if depth is None else r.numbers(depth, f"{path}.acceptance_per_depth"),
        depth_attempts=tuple(r.integer(x, f"{path}.depth_attempts[{i}]") for i, x in enumerate(attempts)),
        cycles=r.integer(b.get("cycles"), f"{path}.cycles"), lossless=r.flag(b.get("lossless"), f"{path}.lossless"))


def _benchmarks(r: _Reader, value: Any, path: str) -> dict[str, BenchStats]:
    if isinstance(value, list):  # older: [{"name": ..., ...}]
        named = {}
        for i, b in enumerate(value):
            name = r.mapping(b, f"{path}[{i}]").get("name", i)
            named[str(name)] = _bench(r, b, f"{path}[{i}]")
        return named
    return {str(name): _bench(r, b, f"{path}.{name}") for name, b in r.mapping(value, path).items()}


def _overall(r: _Reader, value: Any, path: str) -> BenchStats | None:
    return None if value is None else _bench(r, r.mapping(value, path), path)


def _settings(r: _Reader, value: Any) -> EvalSettingsRecord:
    s = r.mapping(value, "settings")
    get = lambda key, check: check(s.get(key), f"settings.{key}")  # noqa: E731
    benches = r.items(s.get("benches"), "settings.benches")
    return EvalSettingsRecord(
        entries=dict(s), mode=get("mode", r.text), depth=get("depth", r.integer), top_k=get("top_k", r.integer),
        total_tokens=get("total_tokens", r.integer), min_prob=get("min_prob", r.number),
        temperature=get("temperature", r.number), engine=get("engine", r.text),
        num_speculative_tokens=get("num_speculative_tokens", r.integer),
        benches=tuple(r.text(b, f"settings.benches[{i}]") or "" for i, b in enumerate(benches)),
        drafter_tensors_sha256=get("drafter_tensors_sha256", r.text),
        drafter_weights_sha256=get("drafter_weights_sha256", r.text))


def _machine(r: _Reader, value: Any) -> MachineRecord | None:
    m = r.mapping(value, "machine")
    if not m:
        return None
    load = r.mapping(m.get("load_average"), "machine.load_average")
    get = lambda key, check: check(m.get(key), f"machine.{key}")  # noqa: E731
    return MachineRecord(
        platform=get("platform", r.text), processor=get("processor", r.text), gpu=get("gpu", r.text),
        device=get("device", r.text), cpu_count=get("cpu_count", r.integer),
        torch_threads=get("torch_threads", r.integer),
        load_start=r.numbers(load.get("start"), "machine.load_average.start"),
        load_end=r.numbers(load.get("end"), "machine.load_average.end"))


def parse_eval_record(data: Any, file: str | Path = "eval results") -> EvalRecord:
    """An `eval` results JSON (already decoded) as an `EvalRecord`.

    Raises:
        ValueError: naming `file`, the key path and what was expected, for a field of the wrong type.
    """
    r = _Reader(file)
    data = r.mapping(data, "(the whole file)")
    shapes = None
    if data.get("shapes") is not None:  # an `eval --shapes` comparison
        shapes = []
        for i, entry in enumerate(r.items(data["shapes"], "shapes")):
            e = r.mapping(entry, f"shapes[{i}]")
            shape = e.get("shape")
            if not isinstance(shape, str):
                raise r.error(f"shapes[{i}].shape", "the shape's label, a string", shape)
            shapes.append(ShapeRecord(shape=shape, benchmarks=_benchmarks(r, e.get("benchmarks"),
                                                                          f"shapes[{i}].benchmarks"),
                                      overall=_overall(r, e.get("overall"), f"shapes[{i}].overall")))
        shapes = tuple(shapes)
    return EvalRecord(settings=_settings(r, data.get("settings")),
                      benchmarks=_benchmarks(r, data.get("benchmarks"), "benchmarks"),
                      overall=_overall(r, data.get("overall"), "overall"), tau=r.number(data.get("tau"), "tau"),
                      shapes=shapes, machine=_machine(r, data.get("machine")))


def read_eval_record(path: str | Path) -> EvalRecord:
    """`parse_eval_record` of a results file (ValueError also for a file that is not JSON)."""
    path = Path(path)
    return parse_eval_record(_load(path), path)


# --- provenance.json ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TargetRecord:
    name_or_path: str | None = None
    model_type: str | None = None
    dtype: str | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class DataRecord:
    """The data summary; `dropped` merges the reader's, the regeneration's and the tokenization's skip counts."""

    train_examples: int | None = None
    val_examples: int | None = None
    conversations_read: int | None = None
    train_tokens: int | None = None
    train_supervised_tokens: int | None = None
    draft_vocab_coverage: float | None = None
    dropped: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingRecord:
    """A run's provenance.json: when, which code and packages, which target and data, and the training record."""

    created_unix: int | None = None
    git_sha: str | None = None
    git_dirty: bool = False
    packages: Mapping[str, str | None] = field(default_factory=dict)  # or the older `versions`
    python: str | None = None
    target: TargetRecord | None = None
    target_text: str | None = None  # older: the target's name alone, instead of `target`
    data: DataRecord | None = None
    steps: int | None = None
    epochs: int | None = None
    hardware: str | None = None
    train_time: str | None = None  # as text (older)
    train_time_s: float | None = None
    final_metrics: Mapping[str, float | None] = field(default_factory=dict)


def _target(r: _Reader, value: Any) -> TargetRecord | None:
    if value is None:
        return None
    t = r.mapping(value, "target")
    get = lambda key, check: check(t.get(key), f"target.{key}")  # noqa: E731
    return TargetRecord(name_or_path=get("name_or_path", r.text), model_type=get("model_type", r.text),
                        dtype=get("dtype", r.text), num_hidden_layers=get("num_hidden_layers", r.integer),
                        hidden_size=get("hidden_size", r.integer), vocab_size=get("vocab_size", r.integer))


def _data(r: _Reader, value: Any) -> DataRecord | None:
    if value is None:
        return None
    d = r.mapping(value, "data")
    get = lambda key, check: check(d.get(key), f"data.{key}")  # noqa: E731
    regeneration = r.mapping(d.get("regeneration"), "data.regeneration")
    tokenization = r.mapping(d.get("tokenization"), "data.tokenization")
    dropped = {**r.counts(d.get("skipped_by_reader"), "data.skipped_by_reader"),
               **r.counts(regeneration.get("skipped"), "data.regeneration.skipped"),
               **r.counts(tokenization.get("skipped"), "data.tokenization.skipped")}
    return DataRecord(train_examples=get("train_examples", r.integer), val_examples=get("val_examples", r.integer),
                      conversations_read=get("conversations_read", r.integer),
                      train_tokens=get("train_tokens", r.integer),
                      train_supervised_tokens=get("train_supervised_tokens", r.integer),
                      draft_vocab_coverage=get("draft_vocab_coverage", r.number), dropped=dropped)


def parse_training_record(data: Any, file: str | Path = "provenance.json") -> TrainingRecord:
    """fit's provenance.json (already decoded) as a `TrainingRecord`.

    Raises:
        ValueError: naming `file`, the key path and what was expected, for a field of the wrong type.
    """
    r = _Reader(file)
    prov = r.mapping(data, "(the whole file)")
    section = r.mapping(prov.get("training"), "training")
    where = (lambda key: f"training.{key}" if key in section else key)  # noqa: E731
    record = {**prov, **section}  # older: the training fields at the top level
    git = r.mapping(prov.get("git"), "git")
    packages_key = "packages" if prov.get("packages") else "versions"
    packages = {k: r.text(v, f"{packages_key}.{k}") for k, v in r.mapping(prov.get(packages_key), packages_key).items()}
    steps_key, steps = _first(record, "global_step", "steps", "max_steps")
    hardware_key, hardware = _first(record, "hardware", "device", "accelerator", "devices")
    time_key, train_time = _first(record, "train_time", "wall_time", "duration")
    seconds_key, seconds = _first(record, "train_time_s", "wall_time_s", "duration_s")
    metrics = r.mapping(record.get("final_metrics"), where("final_metrics"))
    target = prov.get("target")
    return TrainingRecord(
        created_unix=r.integer(prov.get("created_unix"), "created_unix"),
        git_sha=r.text(git.get("sha"), "git.sha"), git_dirty=bool(r.flag(git.get("dirty"), "git.dirty")),
        packages=packages, python=r.text(prov.get("python"), "python"),
        target=None if isinstance(target, str) else _target(r, target),
        target_text=target if isinstance(target, str) else None,
        data=_data(r, prov.get("data")), steps=r.integer(steps, where(steps_key)),
        epochs=r.integer(record.get("epochs"), where("epochs")), hardware=r.text(hardware, where(hardware_key)),
        train_time=r.text(train_time, where(time_key)), train_time_s=r.number(seconds, where(seconds_key)),
        final_metrics={k: r.number(v, f"{where('final_metrics')}.{k}") for k, v in metrics.items()})


def read_training_record(path: str | Path) -> TrainingRecord:
    """`parse_training_record` of a provenance.json (ValueError also for a file that is not JSON)."""
    path = Path(path)
    return parse_training_record(_load(path), path)


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
