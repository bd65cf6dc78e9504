"""Reporting of speculative-decoding evaluations: the results JSON, the text tables and the plots (the machine and
software they ran on: `eagle3_zoo.util.provenance`). No decoding here (`evaluation.py` decodes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3_zoo.util.fileio import atomic_write_text


def write_results(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the results JSON atomically."""
    path = Path(path)
    atomic_write_text(path, json.dumps(results, indent=2) + "\n")
    return path


def plot_acceptance(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """PNG of acceptance@d per benchmark (matplotlib, Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, bench in results["benchmarks"].items():
        rates = bench["acceptance_per_depth"]
        points = [(d + 1, r) for d, r in enumerate(rates) if r is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{name} (tau {bench['tau']:.2f})")
    s = results["settings"]
    ax.set(xlabel="draft depth d", ylabel="acceptance@d (given d-1 accepted)", ylim=(0, 1.05),
           xlim=(0.5, s["depth"] + 0.5), xticks=range(1, s["depth"] + 1),
           title=f"{s['mode']} depth {s['depth']} top-k {s['top_k']} T={s['temperature']}")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_shapes(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """PNG of a shape comparison: pooled tau and speedup per shape (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = [e["shape"] for e in results["shapes"]]
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    # tau is at least 1 (the target's own token every cycle): bars start there, so the drafter's share is the bar
    taus = [e["overall"]["tau"] or 1.0 for e in results["shapes"]]
    ax_tau.bar(labels, [t - 1 for t in taus], bottom=1.0, color="tab:blue")
    ax_tau.set_ylim(bottom=1.0)
    benches = ", ".join(results["settings"].get("benches") or [])
    requests = results["shapes"][0]["overall"].get("requests") if results["shapes"] else None
    ax_tau.set(ylabel="tau (tokens per verification)",
               title=f"acceptance length: {benches}" + (f", {requests} requests" if requests else ""))
    speeds = [e["overall"]["speedup"] for e in results["shapes"]]
    if any(x is not None for x in speeds):
        ax_speed.bar(labels, [x or 0 for x in speeds], color="tab:green")
        ax_speed.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_speed.set(ylabel="speedup over plain decoding", title=f"wall clock ({results['settings']['device']})")
    for ax in (ax_tau, ax_speed):
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_shapes_table(results: dict[str, Any], max_depth: int = 3) -> str:
    """A plain-text comparison of `evaluate_shapes` results: one row per shape and benchmark (and pooled), the
    fastest shape and its serving flags."""

    def fmt(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    header = ["shape", "verified", "bench", "requests", "tau", *[f"acc@{d}" for d in range(1, max_depth + 1)],
              "spec tok/s", "base tok/s", "speedup", "lossless"]
    rows = [header]
    for e in results["shapes"]:
        benches = list(e["benchmarks"].items())
        for name, b in benches + ([("overall", e["overall"])] if len(benches) > 1 else []):
            acc = (b["acceptance_per_depth"] + [None] * max_depth)[:max_depth]
            lossless = {None: "-", True: "yes"}.get(b["lossless"], f"NO ({len(b['lossless_mismatches'])} differ)")
            rows.append([e["shape"], str(e["verified_tokens"]), name, str(b["requests"]), fmt(b["tau"]),
                         *map(fmt, acc), fmt(b["spec_tokens_per_s"], ".1f"), fmt(b["baseline_tokens_per_s"], ".1f"),
                         fmt(b["speedup"]), lossless])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    s = results["settings"]
    lines.insert(0, f"shapes={','.join(s['shapes'])} T={s['temperature']} max_new_tokens={s['max_new_tokens']} "
                    f"device={s['device']}")
    fastest = next((e for e in results["shapes"] if e["shape"] == results["fastest"]), None)
    if fastest is not None:
        flags = (f"--speculative-num-steps {fastest['sglang_num_steps']} --speculative-eagle-topk "
                 f"{fastest['sglang_topk']} --speculative-num-draft-tokens {fastest['sglang_num_draft_tokens']}")
        speedup = fastest["overall"]["speedup"]
        slower = "; plain decoding is faster still on this machine with this drafter" if speedup < 1 else ""
        lines += ["", f"fastest here: {fastest['shape']} ({speedup:.2f}x{slower}); the same shape in SGLang: {flags}"]
    skipped = _skipped_note(results["shapes"][0]["overall"]) if results["shapes"] else []
    return "\n".join([*lines, *skipped, "", *_footer(results)])


def format_table(results: dict[str, Any], max_depth: int = 6) -> str:
    """A plain-text table of the results (one row per benchmark plus the pooled row) and the metric protocol."""

    def fmt(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    header = ["bench", "requests", "tau", "tau/req", *[f"acc@{d}" for d in range(1, max_depth + 1)],
              "spec tok/s", "base tok/s", "speedup", "lossless"]
    rows = [header]
    for name, b in [*results["benchmarks"].items(), ("overall", results["overall"])]:
        acc = (b["acceptance_per_depth"] + [None] * max_depth)[:max_depth]
        lossless = {None: "-", True: "yes"}.get(b["lossless"], f"NO ({len(b['lossless_mismatches'])} differ)")
        rows.append([name, str(b["requests"]), fmt(b["tau"]), fmt(b["tau_per_request_mean"]), *map(fmt, acc),
                     fmt(b["spec_tokens_per_s"], ".1f"), fmt(b["baseline_tokens_per_s"], ".1f"),
                     fmt(b["speedup"]), lossless])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    s = results["settings"]
    setting = (f"mode={s['mode']} depth={s['depth']} top_k={s['top_k']} total_tokens={s['total_tokens']} "
               f"min_prob={s.get('min_prob', 0):g} "
               f"T={s['temperature']} max_new_tokens={s['max_new_tokens']} device={s['device']}")
    return "\n".join([setting, *lines, *_skipped_note(results["overall"]), "", *_footer(results)])


PROTOCOL_LINE = ("protocol: tau = tokens per target forward (bonus token included), acc@d conditional on reaching "
                 "depth d, speedup over plain decoding of the same requests in this run; the full protocol is under "
                 "'protocol' in the results JSON")


def _footer(results: dict[str, Any]) -> list[str]:
    """The protocol in one line (the JSON holds it whole) and the machine's load during the run."""
    machine = results.get("machine") or {}
    load = machine.get("load_average") or {}
    start, end = load.get("start"), load.get("end")
    where = (f"machine: {machine.get('gpu') or machine.get('processor')}, {machine.get('torch_threads')} torch threads"
             + (f"; load average {start[0]:.2f} at the start, {end[0]:.2f} at the end (speeds scale with it)"
                if start and end else ""))
    return [PROTOCOL_LINE, where] if machine else [PROTOCOL_LINE]


def _skipped_note(overall: dict[str, Any]) -> list[str]:
    n = overall.get("skipped")
    return [f"skipped: {n} request(s) exceeding the target's context (listed under 'skipped' in the results JSON)"] \
        if n else []
