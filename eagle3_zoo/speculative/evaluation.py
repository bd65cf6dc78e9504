"""Acceptance benchmarks: speculative vs plain decoding on the same prompts, with tau, per-depth acceptance,
speedup and the lossless check (see `metrics.PROTOCOL`). The decode loop lives here; the JSON, tables and plots it
reports through are in `report.py`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from eagle3_zoo.adapters import TargetAdapter, adapter_for
from eagle3_zoo.chat.conversation import Message
from eagle3_zoo.chat.formats import ChatFormat
from eagle3_zoo.drafters import kind_of
from eagle3_zoo.speculative.acceptance import SamplingParams
from eagle3_zoo.speculative.benchmarks import (
    Benchmark,
    BenchPrompt,
    chat_input_ids,
    completion_input_ids,
    load_benchmark,
    prompt_chat_format,
)
from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
from eagle3_zoo.speculative.draft import DraftModel
from eagle3_zoo.speculative.generate import (
    GenerationOutput,
    SpeculativeGenerator,
    eos_ids,
    plain_generate,
    tree_spec,
)
from eagle3_zoo.speculative.metrics import PROTOCOL, BenchStats
from eagle3_zoo.speculative.report import (  # noqa: F401 (format_* and write_results: the package's public API)
    format_shapes_table,
    format_table,
    plot_acceptance,
    plot_shapes,
    write_results,
)
from eagle3_zoo.util.progress import Progress
from eagle3_zoo.util.provenance import load_average, machine_info, versions
from eagle3_zoo.values.draft_shapes import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS, TreeSpec, shape_problem

log = logging.getLogger(__name__)
# where HF configs keep the context length (Llama/Qwen/DeepSeek, GPT-2, some remote-code models)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def turn_input_ids(prompt: BenchPrompt, turn: int, history: list[Message], tokenizer: Any,
                   chat_format: ChatFormat | None = None,
                   template_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Input ids of `prompt`'s turn `turn`; chat turns are appended to `history` (the model's answers go there) and
    rendered as `chat_input_ids` renders them (the template, `template_kwargs` and `chat_format` of training)."""
    if not prompt.is_chat:
        return completion_input_ids(tokenizer, prompt.text)
    if turn == 0 and prompt.system:
        history.append(Message("system", prompt.system))
    history.append(Message("user", prompt.turns[turn]))
    return chat_input_ids(tokenizer, history, chat_format, template_kwargs)


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation decodes and how (`evaluate`, `evaluate_shapes`; `eagle3-zoo eval` builds one from its
    options). Recorded in the results' ``settings``.

    Attributes:
        benches: `mtbench`, `humaneval`, JSONL paths; a comma-separated string is split.
        mode: `tree` (EAGLE-2 dynamic tree) or `chain` (`depth` draft tokens); `evaluate` only (`evaluate_shapes`
            decodes the shapes it is given instead of `mode`, `depth`, `top_k`, `total_tokens`, `min_prob`).
        depth, top_k, total_tokens: Draft tree shape (chain uses `depth` only).
        min_prob: Draft only nodes whose cumulative draft probability reaches it (`TreeSpec.min_prob`; 0 = off).
        temperature: 0 = greedy (lossless check on); > 0 = lossless rejection sampling.
        sample_top_k, sample_top_p: Sampling warpers, identical for speculative and plain decoding.
        max_new_tokens: Per request.
        limit: First `limit` prompts of each benchmark (all turns of each).
        spread: Take the `limit` prompts evenly spaced over each benchmark instead (see `load_benchmark`).
        baseline: Also run plain KV-cache decoding on every request (speedup, lossless check).
        warmup: Untimed warm-up requests (first prompt, both decoders) before measuring.
        seed: Request i samples with seed + i (speculative and baseline alike).
        eos_token_id: Stop ids; default the target's generation_config, else the tokenizer's EOS.
        chat_template_kwargs: Variables of the chat template for chat prompts: those the drafter was trained with
            (its recipe's ``data.chat_template_kwargs``, e.g. ``{"enable_thinking": False}``), so that it is
            measured on prompts rendered as its training data was.
    """

    benches: tuple[str, ...] = ("mtbench",)
    mode: str = "tree"
    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K
    total_tokens: int = DEFAULT_TOTAL_TOKENS
    min_prob: float = 0.0
    temperature: float = 0.0
    sample_top_k: int = 0
    sample_top_p: float = 1.0
    max_new_tokens: int = 256
    limit: int | None = None
    spread: bool = False
    baseline: bool = True
    warmup: int = 1
    seed: int = 0
    eos_token_id: int | Iterable[int] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        benches = self.benches.split(",") if isinstance(self.benches, str) else self.benches
        object.__setattr__(self, "benches", tuple(b.strip() if isinstance(self.benches, str) else b for b in benches))
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs or {}))

    @property
    def tree(self) -> TreeSpec:
        """The draft shape of `mode`, `depth`, `top_k`, `total_tokens`, `min_prob`."""
        return tree_spec(self.mode, self.depth, self.top_k, self.total_tokens, self.min_prob)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.sample_top_k, top_p=self.sample_top_p)


class BlockDecoder:
    """A drafter whose kind decodes in blocks (`DrafterKind.decoding` "block", e.g. DFlash), driven by
    `DFlashGenerator` with the kind's `block_proposer`, behind the decoder interface the evaluation calls
    (`generate(ids, max_new_tokens, sampling, stop, rng)`, `runner`, `tree`). Greedy only.

    `tree` is the chain of `num_draft` tokens one cycle verifies (what `shape_problem` checks against the target's
    context); the tree options of `EvalSettings` do not apply.
    """

    def __init__(self, target: nn.Module, drafter: nn.Module, adapter: TargetAdapter | None = None):
        kind = kind_of(drafter)
        problems = kind.target_mismatches(drafter, target.config)
        if problems:
            raise ValueError(f"{kind.name} drafter does not fit the target: " + "; ".join(problems))
        adapter = adapter or adapter_for(target)
        proposer = kind.block_proposer(drafter, adapter.embed_tokens(target).weight, adapter.lm_head(target).weight)
        self.kind = kind.name
        self.generator = DFlashGenerator(target, proposer, adapter, kind.features(drafter.config).aux_layer_ids)
        self.runner = self.generator.runner
        self.num_draft = proposer.num_draft
        self.block_size = getattr(drafter.config, "block_size", self.num_draft + 1)
        self.tree = TreeSpec.chain(self.num_draft)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams | None = None,
                 eos_token_id: int | Iterable[int] | None = None,
                 generator: torch.Generator | None = None) -> GenerationOutput:
        if sampling is not None and not sampling.greedy:
            raise ValueError(f"a {self.kind} drafter is decoded greedily only (temperature 0), got {sampling}")
        return self.generator.generate(input_ids, max_new_tokens, eos_token_id)


def decoder_for(target: nn.Module, drafter: nn.Module | DraftModel, tree: TreeSpec,
                adapter: TargetAdapter | None = None) -> SpeculativeGenerator | BlockDecoder:
    """The speculative decoder of `drafter`, as its kind decodes (`DrafterKind.decoding`): a `BlockDecoder` for a
    block kind, else a `SpeculativeGenerator` drafting `tree` (a `DraftModel` is always drafted as a tree)."""
    if not isinstance(drafter, DraftModel) and kind_of(drafter).decoding == "block":
        return BlockDecoder(target, drafter, adapter)
    return SpeculativeGenerator(target, drafter, tree, adapter)


TREE_FIELDS = ("mode", "depth", "top_k", "total_tokens", "min_prob")


def block_settings_check(kind: str, settings: EvalSettings) -> None:
    """Refuse `settings` that a block drafter of kind `kind` cannot honour: tree options other than the defaults
    (a block drafter drafts its own block size) and sampling (it is decoded greedily only).

    Raises:
        ValueError: naming the fields and what to do.
    """
    default = EvalSettings()
    given = [f"{k}={getattr(settings, k)!r}" for k in TREE_FIELDS if getattr(settings, k) != getattr(default, k)]
    if given:
        raise ValueError(f"a {kind} drafter drafts one block of its own size per cycle; the tree options "
                         f"{', '.join(given)} do not apply to it: leave mode, depth, top_k, total_tokens and min_prob "
                         "at their defaults")
    if not settings.sampling.greedy:
        raise ValueError(f"a {kind} drafter is decoded greedily only: temperature must be 0, got "
                         f"{settings.temperature}")


def is_block_drafter(drafter: nn.Module | DraftModel) -> bool:
    """Whether `drafter`'s kind drafts blocks (the tree options of `EvalSettings` do not apply to it)."""
    return not isinstance(drafter, DraftModel) and kind_of(drafter).decoding == "block"


class EvalResults(TypedDict):
    """What `evaluate` returns and writes as JSON (see `metrics.PROTOCOL` for what each figure means)."""

    protocol: str
    settings: dict[str, Any]  # the `EvalSettings` as decoded, the shape, the target, device, stop ids, extras
    machine: dict[str, Any]
    versions: dict[str, Any]
    benchmarks: dict[str, dict[str, Any]]  # per benchmark: source, prompts, the `BenchStats` summary, skipped
    overall: dict[str, Any]  # the summary pooled over every request
    lossless: bool | None  # every greedy output equal to plain decoding's (None: not checked)
    requests: dict[str, list[dict[str, Any]]]  # per benchmark, one row per request
    skipped: dict[str, list[dict[str, Any]]]  # per benchmark, the requests past the target's context


class ShapeResults(TypedDict):
    """One shape of `ShapesResults`: its label and serving flags, and the figures `EvalResults` has."""

    shape: str
    depth: int
    top_k: int
    total_tokens: int
    min_prob: float
    verified_tokens: int
    benchmarks: dict[str, dict[str, Any]]
    overall: dict[str, Any]
    lossless: bool | None
    requests: dict[str, list[dict[str, Any]]]


class ShapesResults(TypedDict):
    """What `evaluate_shapes` returns and writes as JSON."""

    protocol: str
    settings: dict[str, Any]
    machine: dict[str, Any]
    versions: dict[str, Any]
    shapes: list[ShapeResults]
    fastest: str | None  # the label with the highest pooled speedup (None without a baseline)
    lossless: bool | None  # False if any shape differed from plain greedy decoding


def evaluate(
    drafter: nn.Module | DraftModel,
    target: nn.Module,
    tokenizer: Any,
    settings: EvalSettings = EvalSettings(),
    *,
    adapter: TargetAdapter | None = None,
    out: str | os.PathLike | None = None,
    plot: str | os.PathLike | None = None,
    progress: bool = True,
    extra_settings: dict[str, Any] | None = None,
) -> EvalResults:
    """Run speculative decoding (and the plain baseline) over benchmarks and measure acceptance and speed.

    Args:
        drafter: The drafter (of a registered kind: `eagle3_zoo.drafters`), or any `DraftModel`.
        target: The target ``*ForCausalLM``.
        tokenizer: The target's tokenizer (chat template for chat benchmarks).
        settings: What to decode and how (`EvalSettings`).
        adapter: The target's adapter (default: from its config).
        out: Write the results JSON here (and the plot next to it unless `plot` is given).
        plot: Write the per-depth acceptance PNG here.
        progress: Show a progress bar over prompts.
        extra_settings: Merged into ``results["settings"]`` (e.g. the drafter path).

    A drafter whose kind decodes in blocks (`DrafterKind.decoding` "block": DFlash, DSpark) is decoded by
    `BlockDecoder`: one block of draft tokens per cycle, verified as a chain, greedy only; ``settings`` records
    ``mode: block``, the draft tokens per block as ``depth``, and the drafter's ``block_size``. Its tree options do
    not apply: a `settings` whose ``mode, depth, top_k, total_tokens, min_prob`` differ from `EvalSettings`'s
    defaults is refused.

    Returns:
        `EvalResults`. A request whose prompt plus ``max_new_tokens`` exceeds the target's context is not decoded: it
        is logged, counted (``skipped`` of its benchmark and of ``overall``) and listed with its reason in
        ``skipped``.

    Raises:
        ValueError: bad benchmark names or files, or no request fits the target's context; for a block drafter,
            tree options or a temperature above 0.
    """
    loaded = _load_benches(settings)
    if is_block_drafter(drafter):
        block_settings_check(kind_of(drafter).name, settings)
    generator = decoder_for(target, drafter, settings.tree, adapter)
    spec = generator.tree
    stop = _stop_ids(target, tokenizer, settings.eos_token_id)
    load = load_average()
    (found,) = _decode([generator], target, tokenizer, loaded, settings, stop, progress=progress)
    results: dict[str, Any] = {"protocol": PROTOCOL, **found}
    if isinstance(generator, BlockDecoder):  # one chain of num_draft tokens per cycle; no tree options
        shape = {"mode": "block", "drafter_kind": generator.kind, "depth": spec.depth, "top_k": 1,
                 "total_tokens": spec.total_tokens, "min_prob": 0.0, "block_size": generator.block_size}
    else:
        shape = {"mode": settings.mode, "depth": spec.depth, "top_k": spec.top_k, "total_tokens": spec.total_tokens,
                 "min_prob": spec.min_prob}
    results["settings"] = {**shape, **_common_settings(target, generator, settings, stop, extra_settings)}
    results["machine"] = machine_info(generator.runner.device, load)
    results["versions"] = versions()
    return _save(results, out, plot, plot_acceptance)


def evaluate_shapes(
    drafter: nn.Module | DraftModel,
    target: nn.Module,
    tokenizer: Any,
    shapes: Sequence[TreeSpec | str] = ("chain:1", "chain:3", "chain:7", "tree:8/10/60"),
    settings: EvalSettings = EvalSettings(),
    *,
    adapter: TargetAdapter | None = None,
    out: str | os.PathLike | None = None,
    plot: str | os.PathLike | None = None,
    progress: bool = True,
    extra_settings: dict[str, Any] | None = None,
) -> ShapesResults:
    """Compare draft shapes on the same requests: which shape decodes fastest with this drafter on this machine.

    Every request is decoded by each shape in turn and then once by plain decoding, whose time and tokens serve
    every shape (speedup, lossless check), so machine noise falls on all shapes alike and the baseline runs once.
    A later chat turn is conditioned on the first shape's answer, for every decoder (at temperature 0 a lossless
    run gives every shape the same answer). Arguments as `evaluate`, with `shapes` (`TreeSpec`s or their text
    form, `chain:K` / `tree:D/K/N`) instead of the shape of `settings`.

    Returns:
        `ShapesResults`: ``shapes`` is one entry per shape (its ``shape`` label, ``depth, top_k, total_tokens,
        verified_tokens``, serving flags, and ``benchmarks, overall, lossless, requests`` as `evaluate` reports
        them); ``fastest`` is the label with the highest pooled speedup (None without a baseline); ``lossless`` is
        False if any shape differed from plain greedy decoding.
    """
    specs = [s if isinstance(s, TreeSpec) else TreeSpec.parse(s) for s in shapes]
    labels = [s.label for s in specs]
    if not specs or len(set(labels)) != len(labels):
        raise ValueError(f"evaluate_shapes needs distinct draft shapes, got {labels}")
    if is_block_drafter(drafter):
        raise ValueError(f"a {kind_of(drafter).name} drafter drafts one block per cycle, not a tree: there are no "
                         "draft shapes to compare (evaluate it with `evaluate`, without shapes)")
    loaded = _load_benches(settings)
    generators = [SpeculativeGenerator(target, drafter, spec, adapter) for spec in specs]
    stop = _stop_ids(target, tokenizer, settings.eos_token_id)
    load = load_average()
    per_shape = _decode(generators, target, tokenizer, loaded, settings, stop, progress=progress)
    entries = [{"shape": spec.label, "depth": spec.depth, "top_k": spec.top_k, "total_tokens": spec.total_tokens,
                "min_prob": spec.min_prob, "verified_tokens": spec.verified_tokens, **spec.serving_flags(), **res}
               for spec, res in zip(specs, per_shape)]
    speeds = [(e["overall"]["speedup"], e["shape"]) for e in entries if e["overall"]["speedup"] is not None]
    checked = [e["lossless"] for e in entries if e["lossless"] is not None]
    results: dict[str, Any] = {
        "protocol": PROTOCOL + " " + SHAPES_PROTOCOL,
        "settings": {"shapes": labels, **_common_settings(target, generators[0], settings, stop, extra_settings)},
        "machine": machine_info(generators[0].runner.device, load),
        "versions": versions(),
        "shapes": entries,
        "fastest": max(speeds)[1] if speeds else None,
        "lossless": all(checked) if checked else None,
    }
    return _save(results, out, plot, plot_shapes)


SHAPES_PROTOCOL = (
    "Shape comparison: every request is decoded by each shape in turn, then once by plain decoding, whose time and "
    "tokens serve every shape; a later chat turn is conditioned on the first shape's answer for every decoder."
)


def _save(results: dict[str, Any], out: str | os.PathLike | None, plot: str | os.PathLike | None,
          plotter: Any) -> dict[str, Any]:
    """Write the results JSON to `out` and the plot to `plot` (default: next to `out`, `.png`); return `results`."""
    if out is not None:
        write_results(results, out)
        plot = plot if plot is not None else Path(out).with_suffix(".png")
    if plot is not None:
        plotter(results, plot)
    return results


def _load_benches(settings: EvalSettings) -> list[Benchmark]:
    # fail on bad names before any decoding
    loaded = [load_benchmark(name, settings.limit, settings.spread) for name in settings.benches]
    names = [b.name for b in loaded]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmarks {list(settings.benches)} give duplicate report names {names}; rename the JSONL "
                         "files")
    return loaded


def _stop_ids(target: nn.Module, tokenizer: Any, eos_token_id: int | Iterable[int] | None) -> set[int]:
    stop = eos_ids(target, eos_token_id)
    if eos_token_id is None and not stop:  # no generation_config EOS: the tokenizer's
        stop = eos_ids(target, getattr(tokenizer, "eos_token_id", None))
    return stop


def _decode(generators: Sequence[SpeculativeGenerator | BlockDecoder], target: nn.Module, tokenizer: Any,
            loaded: Sequence[Benchmark], settings: EvalSettings, stop: set[int], *,
            progress: bool) -> list[dict[str, Any]]:
    """Decode every request with each generator, then (optionally) plain decoding; per generator its
    ``benchmarks, overall, lossless, requests``. Chat prompts are rendered with the settings' template kwargs."""
    s = settings
    sampling, max_new_tokens, baseline, seed, template_kwargs = (s.sampling, s.max_new_tokens, s.baseline, s.seed,
                                                                 s.chat_template_kwargs)
    device = generators[0].runner.device
    chat_format = prompt_chat_format(generators[0].runner.adapter, tokenizer)

    def input_ids(prompt: BenchPrompt, turn: int, history: list[Message]) -> torch.Tensor:
        return turn_input_ids(prompt, turn, history, tokenizer, chat_format, template_kwargs)

    context = context_length(target)
    for generator in generators:  # before any decoding: a shape that cannot fit would run for ever or exhaust memory
        if problem := shape_problem(generator.tree, context, max_new_tokens):
            raise ValueError(problem)

    def too_long(ids: torch.Tensor) -> str | None:
        """Why a request cannot run within the target's context (positions past it are outside its training)."""
        if context is None or ids.numel() + max_new_tokens <= context:
            return None
        return (f"{ids.numel()} prompt tokens + max_new_tokens {max_new_tokens} exceed the target's context of "
                f"{context} tokens")

    def rng(index: int) -> torch.Generator | None:
        return None if sampling.greedy else torch.Generator(device=device).manual_seed(seed + index)

    def run(ids: torch.Tensor, index: int, n_new: int = max_new_tokens):
        spec_outs = [g.generate(ids, n_new, sampling, stop, rng(index)) for g in generators]
        base_out = plain_generate(target, ids, n_new, sampling, stop, rng(index)) if baseline else None
        return spec_outs, base_out

    first_turns = (input_ids(p, 0, []) for b in loaded for p in b.prompts)
    first = next((ids for ids in first_turns if too_long(ids) is None), None)
    for _ in range(settings.warmup if first is not None else 0):
        run(first, 0, min(max_new_tokens, 32))

    found: list[dict[str, Any]] = [{"benchmarks": {}, "requests": {}, "skipped": {}} for _ in generators]
    overall, index, total_skipped = [BenchStats() for _ in generators], 0, 0
    total = sum(len(p.turns) if p.is_chat else 1 for b in loaded for p in b.prompts)
    with Progress(total, "eval", "request", logger=log, enabled=progress) as bar:
        for bench in loaded:
            stats, rows, skipped = [BenchStats() for _ in generators], [[] for _ in generators], []
            for prompt in bench.prompts:
                history: list[Message] = []
                n_turns = len(prompt.turns) if prompt.is_chat else 1
                for turn in range(n_turns):
                    ids = input_ids(prompt, turn, history)
                    rid = prompt.id if n_turns == 1 else f"{prompt.id}/turn{turn + 1}"
                    if reason := too_long(ids):
                        log.warning("%s: skipping request %s: %s", bench.name, rid, reason)
                        skipped.append({"id": rid, "prompt_tokens": int(ids.numel()), "reason": reason})
                        # later turns build on this turn's answer, which does not exist
                        skipped += [{"id": f"{prompt.id}/turn{later + 1}", "prompt_tokens": None,
                                     "reason": f"turn {turn + 1} of this prompt was skipped"}
                                    for later in range(turn + 1, n_turns)]
                        bar.update(n_turns - turn)
                        break
                    spec_outs, base_out = run(ids, index)
                    index += 1
                    for k, spec_out in enumerate(spec_outs):
                        stats[k].add(spec_out, base_out, rid, check_lossless=sampling.greedy)
                        rows[k].append(_request_row(rid, ids, spec_out, base_out))
                    cycles = overall[0].cycles + stats[0].cycles  # the first decoder's tau over all requests so far
                    tau = (overall[0].cycle_tokens + stats[0].cycle_tokens) / cycles if cycles else None
                    bar.update(1, status=f"{bench.name}, running tau {tau:.2f}" if tau else bench.name)
                    # the next turn is conditioned on the model's own answer (MT-bench protocol)
                    answer = tokenizer.decode(spec_outs[0].tokens, skip_special_tokens=True)
                    history.append(Message("assistant", answer))
            total_skipped += len(skipped)
            for k in range(len(generators)):
                found[k]["benchmarks"][bench.name] = {"source": bench.source, "prompts": len(bench.prompts),
                                                      **stats[k].summary(), "skipped": len(skipped)}
                found[k]["requests"][bench.name] = rows[k]
                found[k]["skipped"][bench.name] = skipped
                overall[k].merge(stats[k])
    if total_skipped:
        done = overall[0].requests
        if not done:
            raise ValueError(f"no request of {', '.join(b.source for b in loaded)} fits the target's context of "
                             f"{context} tokens with max_new_tokens={max_new_tokens} (all {total_skipped} skipped); "
                             "lower --max-new-tokens or use shorter prompts")
        log.warning("skipped %d of %d requests that exceed the target's context of %d tokens with max_new_tokens=%d "
                    "(listed under 'skipped' in the results)", total_skipped, total_skipped + done, context,
                    max_new_tokens)
    for k, res in enumerate(found):
        res["overall"] = {**overall[k].summary(), "skipped": total_skipped}
        res["lossless"] = res["overall"]["lossless"]
    return found


def context_length(target: nn.Module) -> int | None:
    """The target's context length in tokens from its config (None if the config does not say)."""
    config = getattr(target, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _common_settings(target: nn.Module, generator: SpeculativeGenerator | BlockDecoder, settings: EvalSettings,
                     stop: set[int], extra_settings: dict[str, Any] | None) -> dict[str, Any]:
    s = settings
    return {
        "temperature": s.temperature, "sample_top_k": s.sample_top_k, "sample_top_p": s.sample_top_p,
        "max_new_tokens": s.max_new_tokens, "limit": s.limit, "spread": s.spread, "benches": list(s.benches),
        "seed": s.seed, "warmup": s.warmup,
        "baseline": s.baseline, "batch_size": 1, "eos_token_ids": sorted(stop), "humaneval_format": "chat",
        "chat_template_kwargs": dict(s.chat_template_kwargs),
        "target": getattr(target.config, "_name_or_path", None) or None,
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "device": str(generator.runner.device),
        **(extra_settings or {}),
    }


def _request_row(rid: str, ids: torch.Tensor, spec_out, base_out) -> dict[str, Any]:
    row = {"id": rid, "prompt_tokens": int(ids.numel()), "new_tokens": len(spec_out.tokens), "cycles": spec_out.cycles,
           "tau": spec_out.tau, "seconds": spec_out.seconds, "stop": spec_out.stop_reason}
    if base_out is not None:
        row.update(baseline_seconds=base_out.seconds, matches_baseline=spec_out.tokens == base_out.tokens)
    return row
