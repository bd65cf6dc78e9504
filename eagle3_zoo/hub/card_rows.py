"""The rows of a model card, from the JSON files `eval` and `fit` write (read once into typed records by
`eagle3_zoo.hub.records`): one evaluation row per benchmark and draft shape (the same rows for every export layout of
the same weights), the shapes they measured (which serving snippets may name), the machines and their load, and the
compact training and provenance records."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from eagle3_zoo.hub.records import BenchStats, DataRecord, EvalRecord, ShapeRecord, TargetRecord, TrainingRecord
from eagle3_zoo.values.draft_shapes import TreeSpec, spec_from_settings

PROTOCOL_SHORT = (
    "tau = tokens per target forward pass (accepted draft tokens + the target's bonus token), pooled over the "
    "requests; acceptance per depth is conditional on reaching that depth; speedup = tokens/s of speculative "
    "decoding over plain KV-cache decoding of the same requests, in the same run, batch size 1. The full protocol "
    "is the `protocol` entry of each `eval_results*.json` next to the weights.")


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value: float | None, fmt: str = "{:.2f}", suffix: str = "") -> str:
    return "–" if value is None else fmt.format(value) + suffix


def draft_shape(results: EvalRecord) -> str | None:
    """"tree 8/10/60", "chain 7" or "block of 15 drafted tokens" from an eval results' settings (None if they do not
    say)."""
    s = results.settings
    if s.engine:  # `eval --engine`: measured by the serving engine's own counters
        return f"{s.engine} engine, chain {s.num_speculative_tokens}"
    cut = f" cut at draft probability {s.min_prob:g}" if s.min_prob else ""
    if s.mode == "chain":
        return f"chain {s.depth}{cut}"
    if s.mode == "tree":
        return f"tree {s.depth}/{s.top_k}/{s.total_tokens}{cut}"
    if s.mode == "block":  # a block drafter (DFlash): `depth` tokens drafted per block, in one forward
        return f"block of {s.depth} drafted tokens"
    return None


def _bench_rows(results: EvalRecord | ShapeRecord, benches_run: tuple[str, ...], label: str | None,
                cut: bool) -> list[dict[str, str]]:
    benches: dict[str, BenchStats] = dict(results.benchmarks)
    if not benches and results.overall is not None:  # an engine run reports its pooled counters only
        benches = {", ".join(benches_run) or "all": results.overall}
    if results.overall is not None and len(benches) > 1:
        benches["all (pooled)"] = results.overall
    rows = []
    for name, b in benches.items():
        attempts, cycles = b.depth_attempts, b.cycles
        # a shape cut at a draft probability drafts in only some cycles: its acceptance counts those alone
        drafted = attempts[0] / cycles if cut and attempts and attempts[0] is not None and cycles else None
        rows.append({
            "name": _cell(f"{name} ({label})" if label else name), "requests": _cell(b.requests),
            "tau": _num(b.tau), "tau_per_request_mean": _num(b.tau_per_request_mean),
            "speedup": _num(b.speedup, suffix="x"),
            "tokens_per_s": _num(b.spec_tokens_per_s, "{:.1f}"),
            "plain_tokens_per_s": _num(b.baseline_tokens_per_s, "{:.1f}"),
            "drafted": "–" if drafted is None else f"{drafted:.0%}",
            "acceptance_per_depth": "–" if b.acceptance_per_depth is None else ", ".join(
                _num(x) for x in b.acceptance_per_depth),
            "lossless": "–" if b.lossless is None else ("yes" if b.lossless else "NO"),
        })
    return rows


def _pooled_tau(results: EvalRecord | ShapeRecord, top: float | None = None) -> float | None:
    """The pooled tau, else `top` (an engine run's own), else the first benchmark's."""
    return next((t for t in (results.overall.tau if results.overall else None, top,
                             *(b.tau for b in results.benchmarks.values())) if t is not None), None)


def evaluation_rows(evals: Mapping[str, EvalRecord]) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """The table rows of every eval results file (name -> results; labelled by draft shape when there are several
    files) and the shapes they measured: ``{"label", "spec": TreeSpec | None, "engine", "tau"}``."""
    rows: list[dict[str, str]] = []
    measured: list[dict[str, Any]] = []
    for results in evals.values():
        if results.shapes is not None:  # an `eval --shapes` comparison: rows per shape
            for entry in results.shapes:
                rows += _bench_rows(entry, (), entry.shape, "@" in entry.shape)
                measured.append({"label": entry.shape, "spec": _parse(entry.shape), "engine": None,
                                 "tau": _pooled_tau(entry)})
            continue
        s = results.settings
        label = draft_shape(results)
        rows += _bench_rows(results, s.benches, label if len(evals) > 1 else None, bool(s.min_prob))
        spec = TreeSpec.chain(s.num_speculative_tokens) if s.engine and s.num_speculative_tokens is not None \
            else spec_from_settings(dict(s.entries))
        measured.append({"label": label or "the evaluation", "spec": spec, "engine": s.engine,
                         "tau": _pooled_tau(results, results.tau)})
    return rows, measured


def _parse(label: str) -> TreeSpec | None:
    try:
        return TreeSpec.parse(label)
    except ValueError:
        return None


def sglang_shape(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """SGLang's flags for the measured shape (our decoder, no draft-probability cut: SGLang has none) with the
    highest tau."""
    ok = [m for m in measured if m["spec"] is not None and not m["engine"] and not m["spec"].min_prob and m["tau"]]
    if not ok:
        return None
    best = max(ok, key=lambda m: m["tau"])
    f = best["spec"].serving_flags()
    flags = (f"--speculative-num-steps {f['sglang_num_steps']} --speculative-eagle-topk {f['sglang_topk']} "
             f"--speculative-num-draft-tokens {f['sglang_num_draft_tokens']}")
    return {"label": best["label"], "flags": flags}


def vllm_shape(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """vLLM drafts chains: the measured chain (ours or vLLM's own, uncut) with the highest tau, as its length."""
    ok = [m for m in measured if m["spec"] is not None and m["spec"].is_chain and not m["spec"].min_prob and m["tau"]]
    if not ok:
        return None
    best = max(ok, key=lambda m: m["tau"])
    return {"label": best["label"], "k": min(best["spec"].depth, best["spec"].total_tokens)}


_UNSHOWN_SETTINGS = ("eos_token_ids", "drafter", "drafter_weights_sha256", "drafter_tensors_sha256", "benches",
                     "drafter_dir_served", "target_dir_served", "server_url", "baseline_url", "greedy_only_reason")


def _what(results: EvalRecord) -> str:
    return draft_shape(results) or ("shape comparison" if results.shapes else "evaluation")


def settings_lines(evals: Mapping[str, EvalRecord]) -> list[dict[str, str]]:
    """The settings of each evaluation (``{"label", "text"}``), to reproduce it (not the local paths and digests it
    recorded)."""
    lines = []
    for results in evals.values():
        shown = {k: v for k, v in results.settings.entries.items() if k not in _UNSHOWN_SETTINGS and v is not None}
        if shown:
            lines.append({"label": _what(results), "text": "; ".join(f"{k}: {_cell(v)}" for k, v in shown.items())})
    return lines


def decoding(temperature: float | None) -> str:
    return "greedy, T=0" if temperature in (None, 0, 0.0) else f"lossless sampling, T={temperature}"


def _load(start: tuple[float | None, ...], end: tuple[float | None, ...]) -> str | None:
    if not (start and end) or start[0] is None or end[0] is None:
        return None
    return f"{start[0]:.2f} at the start, {end[0]:.2f} at the end"


def machines(evals: Mapping[str, EvalRecord]) -> list[str]:
    """One line per distinct machine of the evaluations, with the load average (1 minute) during each run."""
    lines: dict[str, list[str]] = {}
    for results in evals.values():
        m = results.machine
        if m is None:
            continue
        where = m.gpu or m.processor or m.platform or "unknown machine"
        threads = f", {m.torch_threads} torch threads" if m.torch_threads and not m.gpu else ""
        cores = f", {m.cpu_count} cores" if m.cpu_count else ""
        what = f"{where} ({m.device or 'cpu'}{cores}{threads})"
        lines.setdefault(what, []).append(f"{_what(results)}: {_load(m.load_start, m.load_end) or 'not recorded'}")
    return [f"{what}; load average (1 min) during each run: {'; '.join(loads)}" for what, loads in lines.items()]


def plot_caption(results: EvalRecord) -> str:
    """Alt text of an `eval` plot, its own for each image: what it shows, for which shape, benchmarks and requests."""
    benches = ", ".join(results.settings.benches) or "the benchmarks"
    if results.shapes is not None:
        first = results.shapes[0].overall if results.shapes else None
        count = f", {first.requests} requests" if first and first.requests else ""
        return f"Tau and speedup per draft shape ({', '.join(e.shape for e in results.shapes)}) on {benches}{count}"
    requests = (results.overall.requests if results.overall else None) or sum(
        b.requests or 0 for b in results.benchmarks.values())
    count = f", {requests} requests" if requests else ""
    return f"Acceptance per draft depth, {draft_shape(results) or 'draft'} on {benches}{count}"


def duration(seconds: float | None) -> str | None:
    """"74 s", "3 min 24 s", "2 h 05 min"."""
    if seconds is None:
        return None
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def data_line(recipe: dict[str, Any]) -> str | None:
    """The training data in words: the sources (with their Hub ids), the selection and the regeneration."""
    from eagle3_zoo.values.zoo_registry import dataset_hub_id

    data = recipe.get("data") or {}
    sources = [str(s.get("path")) for s in data.get("sources") or [] if isinstance(s, dict)]
    if not sources:
        return None
    named = ", ".join(f"`{s}` ([{h}](https://huggingface.co/datasets/{h}))" if (h := dataset_hub_id(s)) and h != s
                      else f"[{s}](https://huggingface.co/datasets/{s})" if h else f"`{s.split('/')[-1]}`"
                      for s in sources)
    regenerated = (data.get("regenerate") or {}).get("enabled")
    limit = f", at most {data['max_samples']:,} conversations" if isinstance(data.get("max_samples"), int) else ""
    answers = "; assistant turns regenerated by the target itself" if regenerated else ""
    return f"{named}{limit}, at most {data.get('max_length')} tokens each{answers}"


def training_rows(recipe: dict[str, Any], prov: TrainingRecord) -> list[tuple[str, str]]:
    get = lambda section, key: (recipe.get(section) or {}).get(key)  # noqa: E731
    val = ", ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in sorted(prov.final_metrics.items())
                    if k.startswith("val/") and k.split("/", 1)[1] in ("loss", "acc_0", "acc_1", "acc_2", "tau")
                    and v is not None)
    rows = [
        ("Data", data_line(recipe)),
        ("Training-time test", get("ttt", "steps") and f"{get('ttt', 'steps')} steps ({get('ttt', 'schedule')})"),
        ("Optimizer", get("optim", "lr") and f"AdamW, lr {get('optim', 'lr')}, warmup {get('optim', 'warmup_steps')}, "
                                             f"{get('optim', 'decay')} decay"),
        ("Steps", prov.steps or get("trainer", "max_steps")),
        ("Epochs", prov.epochs),
        ("Batch", get("trainer", "batch_size") and f"{get('trainer', 'batch_size')} per device x "
                                                  f"{get('trainer', 'devices')} devices x "
                                                  f"{get('trainer', 'accumulate_grad_batches') or 1} accumulation"),
        ("Precision / strategy", get("trainer", "precision") and
         f"{get('trainer', 'precision')} / {get('trainer', 'strategy') or 'auto'}"),
        ("Hardware", prov.hardware),
        ("Training time", prov.train_time or duration(prov.train_time_s)),
        ("Final validation", val or None),
    ]
    return [(k, _cell(v)) for k, v in rows if v is not None and v != "" and v != "–"]


def provenance_rows(prov: TrainingRecord) -> list[tuple[str, str]]:
    """A few lines of `provenance.json` (the file itself travels with the weights): when, which code, which target
    and data; not its raw JSON, and not the recipe again (shown above)."""
    created = prov.created_unix
    rows = [
        ("Created", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(created)) if created is not None else None),
        ("Code", prov.git_sha and f"commit {prov.git_sha[:10]}" + (" with uncommitted changes" if prov.git_dirty
                                                                   else "")),
        ("Software", ", ".join(f"{k} {v}" for k, v in prov.packages.items() if v) or None),
        ("Python", prov.python),
        ("Target", prov.target_text or _target_line(prov.target)),
        ("Data", _data_counts(prov.data)),
    ]
    return [(k, _cell(v)) for k, v in rows if v]


def _target_line(target: TargetRecord | None) -> str | None:
    if target is None or not target.name_or_path:
        return None
    shape = ", ".join(w.format(n) for n, w in ((target.num_hidden_layers, "{} layers"), (target.hidden_size,
                                                                                         "hidden {}"),
                                               (target.vocab_size, "vocab {}")) if n)
    return f"{target.name_or_path} ({target.model_type or '?'}, {target.dtype or '?'}; {shape})"


def _data_counts(data: DataRecord | None) -> str | None:
    if data is None or data.train_examples is None:
        return None
    parts = [f"{data.conversations_read:,} conversations read" if data.conversations_read is not None else None,
             f"{data.train_examples:,} train / {data.val_examples or 0:,} validation examples",
             f"{data.train_tokens:,} tokens ({data.train_supervised_tokens or 0:,} supervised)"
             if data.train_tokens is not None else None,
             f"draft vocabulary covers {data.draft_vocab_coverage:.1%} of supervised tokens"
             if data.draft_vocab_coverage is not None else None,
             ("dropped: " + ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in sorted(data.dropped.items())))
             if data.dropped else None]
    return "; ".join(p for p in parts if p)
