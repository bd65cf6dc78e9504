#!/usr/bin/env python
"""Time one EAGLE-3 TTT train step (forward + backward): eagle3-zoo vs the straightforward eager formulation of the
same loss, in the same process, on the same weights and batch.

Baseline ("reference", `eagle3_zoo.training.reference.reference_ttt_loss`, after SafeAILab/EAGLE's trainer): per
step a full T x T fp32 score matrix plus one column per earlier step's key, lm_head logits and log_softmax over
every position, a masked soft cross-entropy. It computes the same function as `ttt_loss` (positions t + k, the same
masks and draft-vocabulary targets): before anything is timed, both losses and every gradient are computed on
weights that are not near zero and compared; the script exits with an error if they disagree. eagle3-zoo: flash
causal attention + log-space diagonal merge, lm_head + soft CE fused and computed only on supervised rows; the
step as `fit` runs it between logging steps (`with_alpha=False`: the per-step acceptance alpha, a metric only, is
formed on the steps whose metrics a logger records).

Tokens/s are timed alternately in this process; peak memory is the peak RSS growth of a forked child running
one step of each in a fresh interpreter (the RSS grown after the batch is built).

    python scripts/bench_ttt.py                       # the issue's shape: K=7, T=2048, H=576, Vd=32000, V=49152
    python scripts/bench_ttt.py --seq-len 512 --iters 1   # quick
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
import time

import torch

from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab
from eagle3_zoo.training.reference import reference_ttt_loss

IMPLS = ("reference", "eagle3-zoo")
TOLERANCE = {"loss": 1e-5, "grad": 1e-4}  # relative (||a - b|| / ||b||), fp32


def build_drafter(args) -> Eagle3Drafter:
    """The drafter of the benchmark's shape (seed 0), its weights well away from zero, and its draft vocabulary."""
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       intermediate_size=args.intermediate, vocab_size=args.vocab, draft_vocab_size=args.draft_vocab,
                       rope_theta=10000.0, aux_layer_ids=(2, 15, 27))
    drafter = Eagle3Drafter(cfg)
    # weights well away from zero, so that the agreement check below says something about the two formulations
    drafter.reset_parameters(std=0.05)
    for name, param in drafter.named_parameters():
        if param.dim() == 1:  # RMSNorm weights
            param.data.uniform_(0.5, 1.5)
    counts = torch.randint(0, 1000, (args.vocab,))
    drafter.set_vocab(*build_draft_vocab(counts, args.draft_vocab))
    return drafter


def build(args):
    drafter = build_drafter(args)
    embed = torch.nn.Embedding(args.vocab, args.hidden).requires_grad_(False)
    b, t = args.batch, args.seq_len
    ids = torch.randint(0, args.vocab, (b, t))
    aux = torch.randn(b, t, 3 * args.hidden)
    target_logits = torch.randn(b, t, args.vocab)
    # real data: ~97-99% of target argmaxes fall inside a 32k draft vocab (random logits would give 65%)
    boost = torch.rand(b, t) < args.coverage
    target_logits[boost] += drafter.t2d.float() * 8.0
    mask = torch.zeros(b, t, dtype=torch.long)
    mask[:, int(t * (1 - args.supervised_fraction)) :] = 1  # prompt first, then the supervised answer
    return drafter, embed, ids, aux, target_logits, mask


def run_step(impl, drafter, embed, batch, steps, weights):
    ids, aux, target_logits, mask = batch
    drafter.zero_grad(set_to_none=True)
    if impl == "eagle3-zoo":
        # as `fit` runs a step whose metrics no logger records (alpha, a metric only, on logging steps)
        loss = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps, step_weights=weights,
                        with_alpha=False).loss
    else:
        loss = reference_ttt_loss(drafter, embed, ids, aux, target_logits, None, mask, steps, weights)
    loss.backward()
    return float(loss.detach())


def agreement(drafter, embed, batch, steps, weights) -> dict[str, float]:
    """Relative difference of the two losses and the largest one over the gradients; SystemExit if beyond
    `TOLERANCE` (the timings would compare two different computations)."""
    out = {}
    for impl in IMPLS:
        loss = run_step(impl, drafter, embed, batch, steps, weights)
        out[impl] = (loss, [p.grad.detach().clone() for p in drafter.parameters() if p.requires_grad])
    (ref_loss, ref_grads), (loss, grads) = out["reference"], out["eagle3-zoo"]
    return check_agreement("the reference", loss, ref_loss, grads, ref_grads)


def check_agreement(other: str, loss: float, other_loss: float, grads: list[torch.Tensor],
                    other_grads: list[torch.Tensor]) -> dict[str, float]:
    """Relative difference of eagle3-zoo's loss from `other`'s and the largest one over the gradients (paired);
    SystemExit if beyond `TOLERANCE`."""
    err = {"loss": abs(loss - other_loss) / abs(other_loss),
           "grad": max(float((g - r).norm() / r.norm()) for g, r in zip(grads, other_grads))}
    if not all(math.isfinite(v) and v <= TOLERANCE[k] for k, v in err.items()):
        raise SystemExit(f"eagle3-zoo and {other} disagree (relative loss error {err['loss']:.2e}, largest "
                         f"gradient error {err['grad']:.2e}; tolerance {TOLERANCE}): not timing them")
    print(f"agreement: loss {other_loss:.6f} vs {loss:.6f} (relative error {err['loss']:.1e}), largest relative "
          f"gradient error {err['grad']:.1e} over {len(grads)} parameters (tolerance {TOLERANCE})")
    return err


def peak_memory_mb(impl: str, argv: list[str]) -> float:
    """Peak RSS growth (MiB, Linux VmHWM) of one step in a fresh interpreter that first builds the same batch."""
    if torch.cuda.is_available():
        raise SystemExit("on CUDA, use torch.cuda.max_memory_allocated in-process (not implemented here)")
    out = subprocess.run([sys.executable, __file__, *argv, "--measure-memory", impl], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure_memory_child(impl: str, args) -> None:
    drafter, embed, *batch = build(args)
    weights = [0.8**k for k in range(args.steps)]
    # ru_maxrss survives fork+exec (it would report the parent's peak); VmHWM is per address space and can be reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_kib("VmRSS")
    run_step(impl, drafter, embed, batch, args.steps, weights)
    print((_status_kib("VmHWM") - start) / 1024)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The drafter's shape (SmolLM2-135M's target: hidden 576, 9/3 heads, vocab 49152)."""
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--vocab", type=int, default=49152)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    add_shape_args(p)
    p.add_argument("--supervised-fraction", type=float, default=0.66,
                   help="fraction of positions with loss_mask 1; 0.66 = measured on the embedded ShareGPT with the "
                        "SmolLM2 chat template at max_length 2048 (300 conversations); 1.0 = worst case for us")
    p.add_argument("--coverage", type=float, default=0.98, help="fraction of target argmaxes inside the draft vocab")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--measure-memory", choices=IMPLS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_memory:
        return _measure_memory_child(args.measure_memory, args)
    argv = [a for a in sys.argv[1:]]
    drafter, embed, *batch = build(args)
    weights = [0.8**k for k in range(args.steps)]
    tokens = args.batch * args.seq_len
    print(f"setup: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"threads={torch.get_num_threads()}, fp32, K={args.steps}, B={args.batch}, T={args.seq_len}, "
          f"H={args.hidden}, heads={args.heads}/{args.kv_heads}, I={args.intermediate}, Vd={args.draft_vocab}, "
          f"V={args.vocab}, supervised={args.supervised_fraction:.2f}, draft-vocab coverage={args.coverage:.2f}")
    impls = IMPLS
    agreement(drafter, embed, batch, args.steps, weights)  # also the warm-up of both
    times = {i: [] for i in impls}
    for _ in range(args.iters):
        for i in impls:  # alternate so machine noise hits both
            t0 = time.perf_counter()
            run_step(i, drafter, embed, batch, args.steps, weights)
            times[i].append(time.perf_counter() - t0)
    del batch, drafter, embed
    mem = {i: peak_memory_mb(i, argv) for i in impls}
    tps = {i: tokens / min(times[i]) for i in impls}
    for i in impls:
        print(f"{i:>15}: {tps[i]:8.1f} tokens/s  (best of {args.iters}: {min(times[i]):.2f} s/step)  "
              f"peak memory {mem[i]:8.1f} MiB")
    print(f"ratio eagle3-zoo / reference: tokens/s x{tps['eagle3-zoo'] / tps['reference']:.2f}, "
          f"peak memory x{mem['eagle3-zoo'] / mem['reference']:.2f}")


if __name__ == "__main__":
    main()
