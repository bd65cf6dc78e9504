"""Markdown table of an ablation directory written by scripts/ablate_smollm2.sh.

    python scripts/ablation_table.py runs/ablate eagle3 ttt1 last_layer no_regen

Per variant it reads `<dir>/<variant>/drafter/provenance.json` (training steps, validation accuracy),
`<dir>/<variant>.fit_seconds` (wall time of `eagle3-zoo fit`, data preparation included) and
`<dir>/<variant>/eval_{tree,chain}.json` (`eagle3-zoo eval` results). A missing file is shown as "-".

Every variant after the first is also compared with the first (the reference) request by request: the difference
of tau with a 95% paired-bootstrap interval over the requests both evaluated (tau = new tokens / cycles of the
resampled requests). An interval that contains 0 means this evaluation does not separate the two.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

LABELS = {
    "eagle3": "EAGLE-3 as specified (3 layers, TTT 7, regenerated data)",
    "ttt1": "TTT depth 1",
    "last_layer": "last-layer-only features (HF index 29)",
    "no_regen": "no regeneration (original ShareGPT answers)",
}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _requests(result: dict | None) -> dict[str, tuple[int, int]]:
    """request id -> (new tokens, cycles), over every benchmark of an `eagle3-zoo eval` result."""
    out = {}
    for bench, rows in ((result or {}).get("requests") or {}).items():
        for r in rows:
            out[f"{bench}/{r['id']}"] = (int(r["new_tokens"]), int(r["cycles"]))
    return out


def _bounds(boot: list[float]) -> tuple[float, float]:
    n = len(boot)
    return boot[int(0.025 * n)], boot[min(n - 1, int(0.975 * n))]


def pooled_ratio_interval(rows: dict[str, tuple[float, float]], *, resamples: int = 2000,
                          seed: int = 0) -> tuple[float, float, float] | None:
    """sum(numerator) / sum(denominator) over `rows` (request id -> (numerator, denominator)), e.g. tau = new tokens
    / cycles, with a 95% bootstrap interval over the requests; None without rows."""
    values = list(rows.values())
    if not values:
        return None

    def ratio(sample: list[tuple[float, float]]) -> float:
        return sum(n for n, _ in sample) / max(1e-12, sum(d for _, d in sample))

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(values) for _ in values]) for _ in range(resamples))
    return (ratio(values), *_bounds(boot))


def paired_ratio_difference(reference: dict[str, tuple[float, float]], other: dict[str, tuple[float, float]], *,
                            resamples: int = 2000, seed: int = 0) -> tuple[float, float, float] | None:
    """ratio(other) - ratio(reference) (`pooled_ratio_interval`'s ratio) over the request ids both hold, with a 95%
    paired-bootstrap interval (each resample draws the same requests for both); None when they share none."""
    ids = sorted(set(reference) & set(other))
    if not ids:
        return None

    def diff(sample: list[str]) -> float:
        def ratio(d: dict[str, tuple[float, float]]) -> float:
            return sum(d[i][0] for i in sample) / max(1e-12, sum(d[i][1] for i in sample))
        return ratio(other) - ratio(reference)

    rng = random.Random(seed)
    boot = sorted(diff([rng.choice(ids) for _ in ids]) for _ in range(resamples))
    return (diff(ids), *_bounds(boot))


def paired_tau_difference(reference: dict | None, other: dict | None, *, resamples: int = 2000,
                          seed: int = 0) -> tuple[float, float, float] | None:
    """tau(other) - tau(reference) over the requests both evaluated, with a 95% paired-bootstrap interval
    (tau = new tokens / cycles of the resampled requests); None when they share no request."""
    return paired_ratio_difference(_requests(reference), _requests(other), resamples=resamples, seed=seed)


def _fmt_diff(d: tuple[float, float, float] | None) -> str:
    return "-" if d is None else f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]"


MODES = ("tree", "chain")


def _evals(root: Path, variant: str) -> dict[str, dict | None]:
    return {mode: _load(root / variant / f"eval_{mode}.json") for mode in MODES}


def lossless_cell(evals: dict[str, dict | None]) -> str:
    """Requests whose speculative output matched plain greedy decoding, over those checked (every mode): "32/32",
    "not checked" (run with --no-baseline) or "-" (no eval)."""
    overall = [(e or {}).get("overall", {}) for e in evals.values() if e]
    checked = sum(int(o.get("lossless_checked") or 0) for o in overall)
    if not overall:
        return "-"
    if not checked:
        return "not checked"
    bad = sum(len(o.get("lossless_mismatches") or []) for o in overall)
    return f"{checked - bad}/{checked}"


def row(root: Path, variant: str, reference: dict[str, dict | None] | None = None) -> str:
    """One table row; `reference` = the evals (`_evals`) of the variant to compare with, None for the reference."""
    run = root / variant
    prov = _load(run / "drafter" / "provenance.json") or {}
    training = prov.get("training", {})
    metrics = training.get("final_metrics", {})
    seconds = (root / f"{variant}.fit_seconds").read_text().strip() if (root / f"{variant}.fit_seconds").is_file() \
        else None
    cells = [LABELS.get(variant, variant), str(training.get("global_step", "-")), seconds or "-",
             _fmt(metrics.get("val/acc_0"), ".3f")]
    evals = _evals(root, variant)
    for mode in MODES:
        overall = (evals[mode] or {}).get("overall", {})
        cells.append(_fmt(overall.get("tau")))
        if mode == "chain":
            acc = overall.get("acceptance_per_depth") or []
            cells.append(" / ".join(_fmt(a) for a in acc[:3]) if acc else "-")
    for mode in MODES:
        cells.append("-" if reference is None else _fmt_diff(paired_tau_difference(reference[mode], evals[mode])))
    cells.append(lossless_cell(evals))
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    reference = argv[1]
    print("| Variant | Steps | `fit` wall time, data preparation included (s) | val acc_0 | tau tree 8/10/60 "
          f"| tau chain 7 | chain accept d1/d2/d3 | tree tau vs {reference} [95% CI] "
          f"| chain tau vs {reference} [95% CI] | identical to greedy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(row(root, reference))
    evals = _evals(root, reference)
    for variant in argv[2:]:
        print(row(root, variant, evals))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
