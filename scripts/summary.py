"""The quickstart's closing summary: one table of what was measured (tau, speedup, lossless per benchmark and draft
shape, the same rows the model card shows) and where the drafter, card and logs are.

    python scripts/summary.py runs/smollm2_135m_smoke [--card runs/smollm2_135m_smoke/card/README.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_zoo.hub.card import card_variables
from eagle3_zoo.hub.records import TrainingRecord, read_training_record

COLUMNS = (("name", "benchmark (shape)"), ("requests", "requests"), ("tau", "tau"), ("speedup", "speedup"),
           ("tokens_per_s", "spec tok/s"), ("plain_tokens_per_s", "plain tok/s"), ("lossless", "lossless"))


def table(rows: list[dict[str, str]]) -> str:
    """A plain-text table with aligned columns."""
    cells = [[h for _, h in COLUMNS]] + [[str(r.get(k, "-")) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(run_dir: Path, card: Path | None = None) -> str:
    drafter = run_dir / "drafter"
    if not (drafter / "config.json").is_file():
        raise FileNotFoundError(f"{drafter}: no drafter folder (did `eagle3-zoo fit` finish?)")
    variables = card_variables(drafter)
    rows = variables.get("benchmarks") or []
    path = drafter / "provenance.json"
    prov = read_training_record(path) if path.is_file() else TrainingRecord()
    out = ["", "== eagle3-zoo quickstart summary =="]
    if prov.steps is not None or prov.train_time_s is not None or prov.final_metrics:
        acc = prov.final_metrics.get("val/acc_0")
        out.append(f"trained {prov.steps} steps in {prov.train_time_s} s"
                   + (f"; validation acc_0 {acc:.3f}" if acc is not None else ""))
    out.append(table(rows) if rows else "no evaluation results next to the drafter (run `eagle3-zoo eval`)")
    out += [f"machine: {m}" for m in variables.get("machines") or []]  # speeds depend on how busy it was
    lossless = {r.get("lossless") for r in rows}
    if "NO" in lossless:
        out.append("WARNING: speculative output differed from plain greedy decoding on some request (see the JSON)")
    out += [f"drafter: {drafter}", f"results: {', '.join(str(p) for p in sorted(drafter.glob('eval_results*.json')))}",
            f"logs:    {run_dir / 'logs'} (CSV: metrics.csv per version; TensorBoard: tensorboard --logdir "
            f"{run_dir / 'logs'})"]
    if card is not None:
        out.append(f"card:    {card}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's output_dir (holding drafter/)")
    parser.add_argument("--card", type=Path, help="the rendered model card, to point at")
    args = parser.parse_args(argv)
    try:
        print(summary(args.run_dir, args.card))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
