"""Engine-fed online training against in-process online training, on the embedded SmolLM2-135M-Instruct, in one run.

    python scripts/bench_engine_feed.py [--steps 24 --rounds 2 --batch 4 --max-length 256 --engine-cores 1]

Both arms train the same drafter on the same batches (the recipe's online mode, `recipes/smollm2_135m.yaml` with the
overrides printed below) for `--steps` optimizer steps; they alternate (in process, engine, in process, engine ...)
so that the machine's load falls on both alike. Arm "in process": the frozen target runs in the training step. Arm
"engine": one vLLM server launched for the run (`engine.mode: launch`, pinned to `--engine-cores` cores) extracts the
hidden states, streamed to the trainer (prefetch `--prefetch` batches). Per arm, after `--warmup` steps: training
tokens/s (non-pad input tokens per wall second) and the trainer's wait fraction, the share of the wall time spent in
Lightning's fetch of the next batch (between one batch's end and the next one's start: for the engine arm, the wait
for the engine's files and their read; in process, the collation). The server start is not timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def overrides(args: argparse.Namespace, out: Path, engine: bool) -> list[str]:
    base = ["data.regenerate.enabled=false", f"data.max_samples={args.samples}", f"data.max_length={args.max_length}",
            "data.val_fraction=0", "data.mode=online", "drafter.draft_vocab_size=4096", "ttt.steps=3",
            "ttt.schedule=constant", "optim.warmup_steps=0", f"trainer.batch_size={args.batch}",
            f"trainer.max_steps={args.steps}",
            "trainer.max_epochs=null", "trainer.checkpoint_every_n_steps=null", "trainer.logger=[]",
            f"data.cache_dir={out / 'cache'}", f"output_dir={out / ('engine' if engine else 'in_process')}"]
    if engine:
        cores = ",".join(str(c) for c in range(os.cpu_count() - args.engine_cores, os.cpu_count()))
        base += ["data.features_backend=vllm", f"engine.devices={cores}", f"data.prefetch_batches={args.prefetch}",
                 f"engine.max_model_len={args.max_length + 1}"]
    return base


def run_arm(recipe, engine: bool, warmup: int) -> dict[str, float]:
    """Train `recipe` for its max_steps; tokens/s and wait fraction after `warmup` steps."""
    import lightning as L

    from eagle3_zoo.training.build import build_run
    from eagle3_zoo.training.callbacks import batch_tokens

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.start = self.last_end = None
            self.tokens, self.wait = 0, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.monotonic()
            if self.last_end is not None and self.start is not None:
                self.wait += now - self.last_end
            if trainer.global_step == warmup:
                self.start = now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.last_end = time.monotonic()
            if self.start is not None:
                self.tokens += batch_tokens(batch)

    run = build_run(recipe)
    clock = Clock()
    trainer = L.Trainer(max_steps=recipe.trainer.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[clock], precision="32-true")
    try:
        trainer.fit(run.module, datamodule=run.datamodule)
    finally:
        feed = getattr(run.datamodule, "feed", None)
        if feed is not None:
            feed.close()
    elapsed = clock.last_end - clock.start
    return {"tokens_per_s": clock.tokens / elapsed, "wait_fraction": clock.wait / elapsed, "seconds": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--engine-cores", type=int, default=1, help="cores the vLLM server is pinned to (the last)")
    parser.add_argument("--out", default="/tmp/eagle3-zoo-bench-engine-feed")
    args = parser.parse_args()

    import torch

    from eagle3_zoo.recipe.sections import load_recipe

    out = Path(args.out)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads in the trainer")
    print(f"loadavg at start: {loadavg()}")
    arms = {"in process": overrides(args, out, False), "engine": overrides(args, out, True)}
    for name, ov in arms.items():
        print(f"arm {name}: recipes/smollm2_135m.yaml " + " ".join(ov))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, ov in arms.items():
            res = run_arm(load_recipe(ROOT / "recipes" / "smollm2_135m.yaml", ov), name == "engine", args.warmup)
            results[name].append(res)
            print(f"round {r + 1} {name:>10}: {res['tokens_per_s']:7.1f} tokens/s, wait {res['wait_fraction']:.1%} "
                  f"({res['seconds']:.1f} s for {args.steps - args.warmup} steps); loadavg {loadavg()}", flush=True)
    print("\n| arm | training tokens/s (median) | trainer wait fraction (median) |\n|---|---|---|")
    med = {n: (statistics.median(x["tokens_per_s"] for x in v), statistics.median(x["wait_fraction"] for x in v))
           for n, v in results.items()}
    for name, (tps, wait) in med.items():
        print(f"| {name} | {tps:.1f} | {wait:.1%} |")
    print(f"\nengine / in process tokens/s: {med['engine'][0] / med['in process'][0]:.2f}x")
    print(f"loadavg at end: {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
