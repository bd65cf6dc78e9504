#!/usr/bin/env python
"""EAGLE-3 vs DFlash on SmolLM2: the same data, the same seed and the same wall-clock training budget, judged by our
decoder and by vLLM, with bootstrap intervals over requests.

Two arms, each its SmolLM2 recipe (`recipes/smollm2_135m.yaml`, `recipes/smollm2_135m_dflash.yaml`) with the same
overrides (the positional ones: data slice, cache), so both read the same regenerated conversations, the same
split and the same seed (each kind then runs its own feature job: EAGLE-3 stores 3 target layers, DFlash 5):

    eagle3   EAGLE-3, TTT 7 (trainer.tau_eval off)
    dflash   DFlash, block 16, 2 layers (`--dflash-init target`: its layers start as copies of the target's last ones)

Training: both `fit`s run AT THE SAME TIME, each with one torch thread (`--threads 1`), each with
`trainer.max_time = --budget-s` (Lightning stops a run at the first step past it; data preparation and model loading
are not counted) and the same `trainer.max_steps = --schedule-steps` (the length of the LR and TTT schedules, which
neither run is meant to reach). Running both at once puts any other load of a shared machine on both alike. Each
fit's wall seconds go to OUT/<arm>.fit_seconds, its steps to the drafter's provenance.

Evaluation, one after the other, T=0 with the lossless check, on MT-bench (`--limit` questions spread over the
categories, both turns, `--max-new` tokens):
- our decoder (`eagle3-zoo eval`): EAGLE-3 chain 7 and the EAGLE-2 tree 8/10/60, DFlash its block;
- vLLM (`eagle3-zoo eval --engine vllm`): EAGLE-3 with 7 speculative tokens, DFlash its block (method dflash), each
  request's acceptance read from vLLM's counters before and after it (requests run one at a time).
Per row: tau (tokens per cycle, accepted + bonus, for our decoder; 1 + accepted / drafts for vLLM) and the speedup on
this machine (plain-decoding seconds / speculative seconds over the same requests: the tokens/s ratio when the outputs
are identical),
each with a 95% bootstrap interval over requests, and the difference to EAGLE-3 chain 7 of the same judge with a
paired 95% bootstrap interval (an interval that contains 0 is no difference this measurement resolves).
Validation acceptance per position comes from each run's last validation (`val/acc_k`: EAGLE-3 TTT step k, DFlash
block slot k).

Run it alone on the machine, e.g. under the heavy-jobs lock for the whole command; pieces already done are not
redone (an interrupted run resumes; delete OUT/<arm> to redo an arm):

    flock /work/notes/heavy.lock python scripts/kinds_side_by_side.py --out runs/kinds_sbs \\
        data.max_samples=128 data.max_length=384 data.regenerate.max_new_tokens=128
    python scripts/kinds_side_by_side.py --table-only --out runs/kinds_sbs
"""

from __future__ import annotations

import argparse
import csv
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
    "eagle3": ("EAGLE-3 (TTT 7)", "recipes/smollm2_135m.yaml", ["trainer.tau_eval.every_n_steps=null"]),
    "dflash": ("DFlash (block 16, 2 layers)", "recipes/smollm2_135m_dflash.yaml",
               ["drafter.dflash.init_layers={dflash_init}"]),
}
# (arm, judge, shape) rows of the table; shape None = the drafter's own (DFlash: its block)
ROWS = (("eagle3", "ours", "chain:7"), ("eagle3", "ours", "tree:8/10/60"), ("dflash", "ours", None),
        ("eagle3", "vllm", "chain:7"), ("dflash", "vllm", None))
REFERENCE = {"ours": ("eagle3", "chain:7"), "vllm": ("eagle3", "chain:7")}
EAGLE3_SHAPES = ("chain:7", "tree:8/10/60")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_sbs = _module("side_by_side")
_at = _sbs._ablation_table()


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def request_pairs(result: dict | None, judge: str) -> tuple[dict[str, tuple[float, float]],
                                                               dict[str, tuple[float, float]]]:
    """Per request id: (tau numerator, denominator) and (plain-decoding seconds, speculative seconds) of one
    evaluation. Ours: the request's tau x cycles / cycles (its tau counts the tokens of its cycles, as the overall
    tau of `eval` does); vLLM: (drafts + accepted) / drafts from the request's own counters.
    A request without the needed fields is left out."""
    tau, speed = {}, {}
    if judge == "vllm":
        rows = [(r["id"], r) for r in (result or {}).get("requests") or []]
    else:
        rows = [(f"{b}/{r['id']}", r) for b, rs in ((result or {}).get("requests") or {}).items() for r in rs]
    for rid, r in rows:
        if judge == "vllm":
            spec = r.get("spec") or {}
            if spec.get("drafts"):
                tau[rid] = (spec["drafts"] + spec["accepted_tokens"], spec["drafts"])
        elif r.get("cycles"):  # tokens the cycles produced (accepted + bonus: the prefill's token not counted)
            tau[rid] = (r["tau"] * r["cycles"] if r.get("tau") is not None else r["new_tokens"], r["cycles"])
        if r.get("baseline_seconds") and r.get("seconds"):
            speed[rid] = (r["baseline_seconds"], r["seconds"])
    return tau, speed


def _result(evals: dict, arm: str, judge: str, shape: str | None) -> dict | None:
    res = evals.get((arm, judge))
    return _sbs.shape_result(res, shape) if judge == "ours" and arm == "eagle3" else res


def _lossless(res: dict | None, judge: str) -> str:
    o = (res or {}).get("overall") or {}
    if judge == "vllm":
        checked = len((res or {}).get("requests") or []) if o.get("lossless_checked") else 0
    else:
        checked = int(o.get("lossless_checked") or 0)
    bad = len(o.get("lossless_mismatches") or [])
    return f"{checked - bad}/{checked}" if checked else "-"


def _depths(res: dict | None, n: int = 3) -> str:
    acc = ((res or {}).get("overall") or {}).get("acceptance_per_depth") or []
    return " / ".join("-" if a is None else f"{a:.2f}" for a in acc[:n]) if acc else "-"


def _val(metrics: dict, arm: str) -> str:
    ks = range(7) if arm == "eagle3" else range(1, 16)
    vals = [metrics.get(f"val/acc_{k}") for k in ks]
    return " / ".join("-" if v is None else f"{v:.2f}" for v in vals)


def last_validation_step(run: Path) -> str:
    """The step of the run's last validation, from its CSV log (`logs/version_*/metrics.csv`); "-" without one."""
    step = None
    for path in sorted(run.glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("val/loss"):
                    step = row.get("step")
    return "-" if step is None else str(int(step) + 1)  # the logged step counts from 0


def training_table(out: Path) -> str:
    lines = ["| Arm | recipe | steps in the budget | `fit` wall s (data preparation included) | training record s "
             "| validation top-1 acceptance per position (EAGLE-3 `acc_0..6`, DFlash `acc_1..15`) | at step |",
             "|---|---|---|---|---|---|---|"]
    for arm, (label, recipe, _) in ARMS.items():
        training = ((_load(out / arm / "drafter" / "provenance.json") or {}).get("training") or {})
        seconds = (out / f"{arm}.fit_seconds").read_text().strip() if (out / f"{arm}.fit_seconds").is_file() else "-"
        lines.append(f"| {label} | `{recipe}` | {training.get('global_step', '-')} | {seconds} "
                     f"| {training.get('wall_time_s', '-')} | {_val(training.get('final_metrics') or {}, arm)} "
                     f"| {last_validation_step(out / arm)} |")
    return "\n".join(lines)


def judged_table(out: Path) -> str:
    """Tau and speedup per (arm, judge, shape) with 95% intervals, each paired against its judge's reference."""
    evals = {(arm, judge): _load(out / arm / f"eval_{judge}.json") for arm in ARMS for judge in ("ours", "vllm")}
    lines = ["| Judge | Arm | draft shape | requests | tau [95% CI] | vs EAGLE-3 chain 7 [paired 95% CI] "
             "| speedup on this CPU [95% CI] | vs EAGLE-3 chain 7 [paired 95% CI] | acceptance @1 / @2 / @3 "
             "| identical to plain greedy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, judge, shape in ROWS:
        res = _result(evals, arm, judge, shape)
        tau, speed = request_pairs(res, judge)
        ref_arm, ref_shape = REFERENCE[judge]
        ref_tau, ref_speed = request_pairs(_result(evals, ref_arm, judge, ref_shape), judge)
        is_ref = (arm, shape) == (ref_arm, ref_shape)
        paired = (lambda r, o: "-") if is_ref else (lambda r, o: _sbs._ci(_at.paired_ratio_difference(r, o),
                                                                          signed=True))
        block = ((_load(out / arm / "drafter" / "config.json") or {}).get("block_size"))
        label = shape or (f"block {block} ({block - 1} drafted)" if block else "block")
        if judge == "vllm" and arm == "eagle3":
            label = "chain 7 (num_speculative_tokens 7)"
        lines.append(f"| {'our decoder' if judge == 'ours' else 'vLLM'} | {ARMS[arm][0]} | {label} | {len(tau) or '-'} "
                     f"| {_sbs._ci(_at.pooled_ratio_interval(tau))} | {paired(ref_tau, tau)} "
                     f"| {_sbs._ci(_at.pooled_ratio_interval(speed))} | {paired(ref_speed, speed)} "
                     f"| {_depths(res)} | {_lossless(res, judge)} |")
    return "\n".join(lines)


def fit_command(arm: str, args: argparse.Namespace) -> list[str]:
    _, recipe, extra = ARMS[arm]
    every = max(1, args.schedule_steps // 20)
    return [sys.executable, "-m", "eagle3_zoo.cli", "--threads", "1", "fit", recipe, *args.overrides,
            f"trainer.max_time={args.budget_s}", f"trainer.max_steps={args.schedule_steps}",
            f"trainer.val_check_interval={every}", f"trainer.checkpoint_every_n_steps={every}",
            f"trainer.seed={args.seed}", f"output_dir={args.out / arm}",
            *[e.format(dflash_init=args.dflash_init) for e in extra]]


def eval_command(arm: str, judge: str, args: argparse.Namespace) -> list[str]:
    run = args.out / arm
    cmd = [sys.executable, "-m", "eagle3_zoo.cli", "eval", str(run / "drafter"), "--bench", "mtbench", "--limit",
           str(args.limit), "--spread", "--temperature", "0", "--max-new-tokens", str(args.max_new), "--no-progress",
           "--out", str(run / f"eval_{judge}.json")]
    if judge == "vllm":
        return cmd + ["--engine", "vllm", *(["--depth", "7"] if arm == "eagle3" else [])]
    return cmd + (["--shapes", ",".join(EAGLE3_SHAPES)] if arm == "eagle3" else [])


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_fits(args: argparse.Namespace, log) -> None:
    """Both fits at once (one thread each); each one's wall seconds to OUT/<arm>.fit_seconds."""
    todo = [arm for arm in ARMS if not (args.out / arm / "drafter" / "config.json").is_file()]
    procs = {}
    for arm in todo:
        cmd = fit_command(arm, args)
        print(f"$ {shlex.join(cmd)}", flush=True)
        log.write(f"$ {shlex.join(cmd)}\n")
        procs[arm] = (subprocess.Popen(cmd, cwd=ROOT, stdout=(args.out / f"{arm}.fit.log").open("a"),
                                       stderr=subprocess.STDOUT), time.monotonic())
    for arm, (proc, start) in procs.items():
        if proc.wait():
            raise SystemExit(f"{arm}: fit failed (exit {proc.returncode}); see {args.out / f'{arm}.fit.log'}")
        (args.out / f"{arm}.fit_seconds").write_text(f"{time.monotonic() - start:.0f}\n")
        log.write(f"{arm}: fit {time.monotonic() - start:.0f} s, load {_loadavg()}\n")


def run_evals(args: argparse.Namespace, log) -> None:
    for judge in ("ours", "vllm"):
        for arm in ARMS:
            if (args.out / arm / f"eval_{judge}.json").is_file():
                continue
            cmd = eval_command(arm, judge, args)
            print(f"$ {shlex.join(cmd)}", flush=True)
            start = time.monotonic()
            log.write(f"$ {shlex.join(cmd)}\nload {_loadavg()}\n")
            log.flush()
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
            log.write(f"{arm} {judge}: {time.monotonic() - start:.0f} s, load {_loadavg()}\n")
            log.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="recipe overrides for both arms (data slice, data.cache_dir...)")
    ap.add_argument("--budget-s", type=float, default=480, help="trainer.max_time of each fit, seconds")
    ap.add_argument("--schedule-steps", type=int, default=400,
                    help="trainer.max_steps of each fit: the LR/TTT schedule length (not meant to be reached)")
    ap.add_argument("--dflash-init", default="target", choices=("target", "random"),
                    help="drafter.dflash.init_layers of the DFlash arm")
    ap.add_argument("--seed", type=int, default=42, help="trainer.seed of both arms")
    ap.add_argument("--limit", type=int, default=8, help="MT-bench questions (spread over the categories)")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--out", type=Path, default=Path("runs/kinds_sbs"))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    args.out = args.out.resolve()
    if not args.table_only:
        args.out.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with (args.out / "run.log").open("a") as log:
            log.write(f"start {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {_loadavg()}\n")
            log.flush()
            run_fits(args, log)
            run_evals(args, log)
            log.write(f"end, {time.monotonic() - start:.0f} s wall, load {_loadavg()}\n")
        print(f"EAGLE-3 vs DFlash: {time.monotonic() - start:.0f} s wall", flush=True)
    text = training_table(args.out) + "\n\n" + judged_table(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
