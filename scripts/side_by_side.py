#!/usr/bin/env python
"""EAGLE-3 vs EAGLE-3.1, soft cross-entropy vs an acceptance loss, side by side at one fixed budget on SmolLM2.

Four arms, each the SmolLM2 recipe (recipes/smollm2_135m.yaml: the same regenerated data, cached features, seed,
batches and schedule) trained for the same `--steps`, changing only:

    eagle3_ce    EAGLE-3 + soft cross-entropy (today's recipe)
    eagle31_ce   drafter.fc_norm=true drafter.norm_output=true
    eagle3_acc   loss.name=ACC (--acceptance-loss, default lk_hybrid)
    eagle31_acc  both

Per arm: validation acceptance per TTT step (`val/alpha_k`, the expected acceptance of a drafted token, and top-1
`val/acc_k`, on the run's held-out conversations), and real tau (`eagle3-zoo eval`, T=0, lossless check against
plain greedy decoding) of chain 7 and the EAGLE-2 tree 8/10/60 on MT-bench (`--limit` questions spread over the
categories, both turns) and on the run's held-out conversations (scripts/val_bench.py), each with a 95% bootstrap
interval over requests, and the difference to eagle3_ce with a paired 95% bootstrap interval (an interval that
contains 0 is no difference this measurement resolves).

Each arm (its `fit` and its evaluations) runs under one `flock LOCK` acquisition, so that other heavy jobs on a shared
machine interleave between arms; finished pieces are not redone, so an interrupted run resumes. Wall seconds of each
fit and of each arm's evaluations go to OUT/<arm>.fit_seconds / .eval_seconds, the machine's load before and after
each piece to OUT/<arm>.log. The table goes to OUT/table.md.

    python scripts/side_by_side.py --steps 400 --out runs/side_by_side --lock /work/notes/heavy.lock \\
        data.cache_dir=$HOME/.cache/eagle3_zoo
    python scripts/side_by_side.py --table-only --out runs/side_by_side     # the table of what exists
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "eagle3_ce": ("EAGLE-3 + soft CE", []),
    "eagle31_ce": ("EAGLE-3.1 + soft CE", ["drafter.fc_norm=true", "drafter.norm_output=true"]),
    "eagle3_acc": ("EAGLE-3 + {loss}", ["loss.name={loss}"]),
    "eagle31_acc": ("EAGLE-3.1 + {loss}", ["drafter.fc_norm=true", "drafter.norm_output=true", "loss.name={loss}"]),
}
REFERENCE = "eagle3_ce"
SHAPES = ("chain:7", "tree:8/10/60")
BENCHES = ("mtbench", "heldout")


def _ablation_table():
    spec = importlib.util.spec_from_file_location("ablation_table", ROOT / "scripts" / "ablation_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tau_interval(result: dict | None, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float] | None:
    """Pooled tau (new tokens / cycles) of one evaluation with a 95% bootstrap interval over its requests."""
    at = _ablation_table()
    return at.pooled_ratio_interval(at._requests(result), resamples=resamples, seed=seed)


def shape_result(evaluation: dict | None, shape: str) -> dict | None:
    """The entry of one draft shape in an `eval --shapes` result."""
    return next((e for e in (evaluation or {}).get("shapes", []) if e.get("shape") == shape), None)


def _run(groups: list[tuple[list[list[str]], Path]], lock: str | None, log: Path) -> None:
    """Run each group's commands in turn under ONE `flock lock` acquisition, appending their output and the machine's
    load to `log`; each group's wall seconds (the wait for the lock excluded) go to its file."""
    parts = ["cat /proc/loadavg"]
    for cmds, seconds in groups:
        parts.append("SECONDS=0; " + " && ".join(shlex.join(c) for c in cmds) +
                     f" || exit $?; echo $SECONDS > {shlex.quote(str(seconds))}; cat /proc/loadavg")
    script = "; ".join(parts)
    for cmds, _ in groups:
        for cmd in cmds:
            print(f"$ {shlex.join(cmd)}", flush=True)
    with log.open("a") as f:
        f.write(f"$ {script}\n")
        f.flush()
        subprocess.run((["flock", lock] if lock else []) + ["bash", "-c", script], check=True, stdout=f,
                       stderr=subprocess.STDOUT, cwd=ROOT)


def fit_command(arm: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    overrides = [o.format(loss=args.acceptance_loss) for o in ARMS[arm][1]]
    common = [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps // 2}",
              "trainer.checkpoint_every_n_steps=100", "trainer.tau_eval.every_n_steps=null",
              f"output_dir={args.out / arm}"]
    return [sys.executable, "-m", "eagle3_zoo.cli", "fit", args.recipe, *common, *extra, *overrides]


def eval_command(arm: str, bench: str, args: argparse.Namespace) -> list[str]:
    run = args.out / arm
    where = {"mtbench": ["--bench", "mtbench", "--limit", str(args.limit), "--spread"],
             "heldout": ["--bench", str(args.out / "heldout.jsonl")]}[bench]
    return [sys.executable, "-m", "eagle3_zoo.cli", "eval", str(run / "drafter"), "--shapes", ",".join(SHAPES),
            "--temperature", "0", "--max-new-tokens", str(args.max_new), "--no-progress",
            *(["--threads", str(args.threads)] if args.threads else []), *where,
            "--out", str(run / f"eval_{bench}.json")]


def run_arm(arm: str, args: argparse.Namespace, extra: list[str]) -> None:
    """Train the arm (unless its drafter exists), write the held-out benchmark (once, for every arm) and evaluate
    the arm (what is missing), all under one acquisition of the lock."""
    run, out = args.out / arm, args.out
    groups = []
    if not (run / "drafter" / "config.json").is_file():
        groups.append(([fit_command(arm, args, extra)], out / f"{arm}.fit_seconds"))
    if not (out / "heldout.jsonl").is_file():
        groups.append(([[sys.executable, "scripts/val_bench.py", args.recipe, *extra, "--out",
                         str(out / "heldout.jsonl")]], out / "heldout.seconds"))
    evals = [eval_command(arm, b, args) for b in BENCHES if not (run / f"eval_{b}.json").is_file()]
    if evals:
        groups.append((evals, out / f"{arm}.eval_seconds"))
    if groups:
        out.mkdir(parents=True, exist_ok=True)
        _run(groups, args.lock, out / f"{arm}.log")


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _ci(v: tuple[float, float, float] | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    f = "+.2f" if signed else ".2f"
    return f"{v[0]:{f}} [{v[1]:{f}}, {v[2]:{f}}]"


def _per_step(metrics: dict, name: str, steps: int = 7) -> str:
    vals = [metrics.get(f"val/{name}_{k}") for k in range(steps)]
    return " / ".join("-" if v is None else f"{v:.3f}" for v in vals)


def table(args: argparse.Namespace) -> str:
    """The markdown table of every arm found under `args.out` (missing pieces shown as "-")."""
    at = _ablation_table()
    loss = args.acceptance_loss
    evals = {arm: {b: _load(args.out / arm / f"eval_{b}.json") for b in BENCHES} for arm in ARMS}
    head = ["Arm", "fit s", "val alpha_0..6", "val acc_0..6"]
    for bench in BENCHES:
        for shape in SHAPES:
            head += [f"{bench} {shape} tau [95% CI]", f"vs {REFERENCE} [paired 95% CI]"]
    head.append("identical to greedy")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, (label, _) in ARMS.items():
        prov = _load(args.out / arm / "drafter" / "provenance.json") or {}
        metrics = (prov.get("training") or {}).get("final_metrics") or {}
        seconds = (args.out / f"{arm}.fit_seconds").read_text().strip() if (args.out / f"{arm}.fit_seconds").is_file() \
            else "-"
        cells = [label.format(loss=loss), seconds, _per_step(metrics, "alpha"), _per_step(metrics, "acc")]
        checked = bad = 0
        for bench in BENCHES:
            for shape in SHAPES:
                res, ref = shape_result(evals[arm][bench], shape), shape_result(evals[REFERENCE][bench], shape)
                cells.append(_ci(tau_interval(res)))
                cells.append("-" if arm == REFERENCE else _ci(at.paired_tau_difference(ref, res), signed=True))
                o = (res or {}).get("overall") or {}
                checked += int(o.get("lossless_checked") or 0)
                bad += len(o.get("lossless_mismatches") or [])
        cells.append(f"{checked - bad}/{checked}" if checked else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every arm (e.g. data.cache_dir=...)")
    ap.add_argument("--recipe", default="recipes/smollm2_135m.yaml")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps of every arm")
    ap.add_argument("--acceptance-loss", default="lk_hybrid", choices=("tv", "neg_log_alpha", "lk_hybrid"))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma list of arms to run")
    ap.add_argument("--limit", type=int, default=16, help="MT-bench questions (spread over the categories)")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lock", default=None, help="flock this file around each fit and each arm's evaluations")
    ap.add_argument("--out", type=Path, default=Path("runs/side_by_side"))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; valid: {', '.join(ARMS)}")
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    if not args.table_only:
        start = time.monotonic()
        for arm in args.arms.split(","):  # arm by arm: its training and evaluations in one acquisition of the lock
            run_arm(arm, args, args.overrides)
        print(f"side by side: {time.monotonic() - start:.0f} s wall", flush=True)
    text = table(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
