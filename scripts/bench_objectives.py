#!/usr/bin/env python
"""Time one TTT train step (forward + backward) with each loss option, on the same weights and batch, in one process.

The step is `ttt_loss` as `fit` runs it (fused, chunked lm_head loss; `loss.name` = each of
`eagle3_zoo.losses.available_losses()`), on the drafter and batch `scripts/bench_ttt.py` builds (same options).
Objectives are timed alternately so that machine noise falls on all of them; the ratio to soft_ce is the figure to
quote. Before timing, each objective's loss is checked to be finite.

    python scripts/bench_objectives.py --seq-len 512 --iters 3
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

import torch

from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.losses import available_losses


def _bench_ttt():
    spec = importlib.util.spec_from_file_location("bench_ttt", Path(__file__).with_name("bench_ttt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(name: str, drafter, embed, batch, steps: int) -> float:
    ids, aux, target_logits, mask = batch
    drafter.zero_grad(set_to_none=True)
    out = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, objective=name)
    out.loss.backward()
    return float(out.loss.detach())


def main() -> None:
    bench_ttt = _bench_ttt()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("--steps", 7), ("--seq-len", 512), ("--batch", 1), ("--hidden", 576), ("--heads", 9),
                          ("--kv-heads", 3), ("--intermediate", 1536), ("--draft-vocab", 32000), ("--vocab", 49152),
                          ("--iters", 3)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--supervised-fraction", type=float, default=0.66)
    parser.add_argument("--coverage", type=float, default=0.98)
    args = parser.parse_args()
    drafter, embed, *batch = bench_ttt.build(args)
    print(f"setup: torch {torch.__version__}, threads={torch.get_num_threads()}, fp32, K={args.steps}, "
          f"B={args.batch}, T={args.seq_len}, H={args.hidden}, Vd={args.draft_vocab}, V={args.vocab}, "
          f"supervised={args.supervised_fraction:.2f}; load {Path('/proc/loadavg').read_text().split()[:3]}")
    for name in available_losses():  # warm-up and a sanity check of each
        loss = step(name, drafter, embed, batch, args.steps)
        if not math.isfinite(loss):
            raise SystemExit(f"{name}: loss {loss} is not finite")
    times = {name: [] for name in available_losses()}
    for _ in range(args.iters):
        for name in available_losses():
            t0 = time.perf_counter()
            step(name, drafter, embed, batch, args.steps)
            times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq_len
    best = {name: min(t) for name, t in times.items()}
    for name in available_losses():
        print(f"{name:>14}: {tokens / best[name]:8.1f} tokens/s (best of {args.iters}: {best[name]:.3f} s/step), "
              f"x{best['soft_ce'] / best[name]:.3f} of soft_ce's tokens/s")
    print(f"load after: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
