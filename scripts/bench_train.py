#!/usr/bin/env python
"""Training throughput of a recipe on this machine: online (target in the step) vs offline (stored features).

Builds the run exactly as `fit` does (`eagle3_zoo.training.build.build_run`: same data, drafter, module and
batches), then trains `--warmup` + `--steps` optimizer steps in a Lightning Trainer without checkpoints, loggers or
validation, and times the timed steps (batch start -> batch end, forward + backward + optimizer). Tokens/s counts
the real (non-pad) tokens of the batches; supervised tokens/s the positions with loss. The TTT schedule is fixed
at the recipe's full K so that both modes do the same work. Offline mode first runs (and times) the feature job on
the same examples and reports the store's bytes per token.

`--packing off,on` times each mode without and with sequence packing (`data.packing`), the configurations
alternating `--rounds` times (a shared machine drifts: compare the ratios of neighbouring runs), and reports the
padding fraction of the timed batches (pad positions / all positions of the padded `[B, T]` batches).

    python scripts/bench_train.py                               # SmolLM2 recipe, 48 conversations, 1 + 3 steps
    python scripts/bench_train.py --steps 5 data.max_length=256 # any recipe override after the options
    python scripts/bench_train.py --modes offline --packing off,on --rounds 2 --samples 128 data.max_length=384
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch


class StepTimer(L.Callback):
    """Wall time and token counts of each training batch."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, int]] = []  # (seconds, tokens, supervised tokens, padded size)
        self._start = 0.0

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.steps.append((time.perf_counter() - self._start, int(batch["attention_mask"].sum()),
                           int(batch["loss_mask"].sum()), batch["input_ids"].numel()))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bench_mode(recipe: Any, mode: str, warmup: int, steps: int, packing: bool = False) -> dict[str, Any]:
    from eagle3_zoo.training.build import build_run
    from eagle3_zoo.training.callbacks import TTTScheduleCallback

    recipe.data.mode, recipe.data.packing = mode, packing
    start = time.perf_counter()
    run = build_run(recipe)
    setup_s = time.perf_counter() - start
    timer = StepTimer()
    t = recipe.trainer
    trainer = L.Trainer(accelerator="auto", devices=1, precision=t.precision, max_steps=warmup + steps,
                        max_epochs=None, gradient_clip_val=recipe.optim.grad_clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[TTTScheduleCallback(recipe.ttt.steps, "constant"), timer])
    trainer.fit(run.module, datamodule=run.datamodule)
    timed = timer.steps[warmup:]
    seconds, tokens, supervised, padded = (sum(col) for col in zip(*timed))
    out = {"mode": mode, "packing": packing, "setup_s": setup_s, "steps": len(timed),
           "s_per_step": seconds / len(timed), "tokens_per_s": tokens / seconds,
           "supervised_per_s": supervised / seconds, "tokens_per_step": tokens / len(timed),
           "padding": 1 - tokens / padded}
    if mode == "offline":
        out.update(run.features)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2_135m.yaml")
    parser.add_argument("--samples", type=int, default=48, help="conversations read (data.max_samples)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default="online,offline")
    parser.add_argument("--packing", default="off", help="off, on, or off,on / on,off (each mode both ways, in this "
                        "order)")
    parser.add_argument("--rounds", type=int, default=1, help="times the configurations alternate")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = parser.parse_args()

    from eagle3_zoo.data.feature_job import extract_features
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.targets.loading import load_recipe_target

    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    recipe = load_recipe(args.recipe, [
        # original ShareGPT answers: full 512-token batches, and no regeneration inside a throughput benchmark
        f"data.max_samples={args.samples}", "data.val_fraction=0", "optim.warmup_steps=0",
        "data.regenerate.enabled=false",
        f"trainer.max_steps={args.warmup + args.steps}", "trainer.max_epochs=null",
        "trainer.tau_eval.every_n_steps=null",
        f"output_dir={work / 'run'}", f"data.cache_dir={work / 'cache'}", *args.overrides])
    t = recipe.trainer
    print(f"setup: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cuda={torch.cuda.is_available()}, lightning {L.__version__}")
    print(f"recipe: {args.recipe} (target {recipe.target.name_or_path}, {recipe.target.dtype}); batch {t.batch_size} "
          f"x <= {recipe.data.max_length} tokens; TTT K={recipe.ttt.steps} (constant); draft vocab "
          f"{recipe.drafter.draft_vocab_size}; precision {t.precision}; features {recipe.data.features_dtype}; "
          f"{args.samples} conversations; {args.warmup} warm-up + {args.steps} timed steps")
    results = []
    packings = [{"off": False, "on": True}[p] for p in args.packing.split(",")]
    for mode in args.modes.split(","):
        if mode == "offline":  # time the feature job on its own (build_run then finds the store complete)
            from eagle3_zoo.data.prepare import prepare_data

            target, tokenizer, adapter = load_recipe_target(recipe.target, recipe.drafter, recipe.trainer)
            data = prepare_data(recipe, tokenizer, adapter, target_id=recipe.target.name_or_path,
                                vocab_size=target.config.vocab_size)
            start = time.perf_counter()
            extract_features(recipe, target=target, tokenizer=tokenizer, adapter=adapter, data=data)
            extract_s = time.perf_counter() - start
            n_tokens = sum(int(e["input_ids"].numel()) for e in data.train + data.val)
            print(f"feature job: {n_tokens} tokens in {extract_s:.1f} s = {n_tokens / extract_s:.0f} tokens/s")
            del target
        for _ in range(args.rounds):
            for packing in packings:
                results.append(bench_mode(recipe, mode, args.warmup, args.steps, packing))
                r = results[-1]  # as it comes: a long comparison on a loaded machine may be cut short
                print(f"done: {mode}, packing {'on' if packing else 'off'}: {r['tokens_per_s']:.1f} tokens/s, "
                      f"padding {r['padding']:.1%}, {r['s_per_step']:.2f} s/step", flush=True)
    print(f"{'mode':8} {'packing':8} {'s/step':>8} {'tokens/step':>12} {'padding':>8} {'tokens/s':>10} "
          f"{'supervised/s':>13}")
    for r in results:
        print(f"{r['mode']:8} {'on' if r['packing'] else 'off':8} {r['s_per_step']:8.2f} {r['tokens_per_step']:12.0f} "
              f"{r['padding']:8.1%} {r['tokens_per_s']:10.1f} {r['supervised_per_s']:13.1f}")
    for r in results:
        if r["mode"] == "offline":
            print(f"offline cache: {r['bytes_per_token']:.0f} bytes/token ({r['dtype']}) in {r['features_dir']}")
            break
    if len(packings) == 2:  # neighbouring runs of one round: packed / unpacked tokens/s
        ratios = [(b["tokens_per_s"] / a["tokens_per_s"]) ** (1 if b["packing"] else -1)
                  for a, b in zip(results[::2], results[1::2])]
        print("tokens/s packed / unpacked, per round: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
