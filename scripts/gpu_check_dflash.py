"""The DFlash drafter's block attention on one GPU: compiled FlexAttention (a block mask) against the dense-mask
reference, forward and backward, then the training step at a Qwen3-8B shape (speed, peak memory).

    python scripts/gpu_check_dflash.py --jsonl $OUT/dflash.jsonl    # one CUDA GPU (about 2-3 min, compiles included)
    python scripts/gpu_check_dflash.py --cpu-smoke                  # tiny shapes, forward only (what the tests run)

Rows print as they are measured and go to a JSON-lines file at once. Models are built in code with random weights.
Checks:
1. equality, fp32 and bf16 autocast: the loss and every parameter gradient of `dflash_loss` with `attention="flex"`
   against `attention="dense"` (relative error; on a CPU FlexAttention has no backward: the forward only);
2. the training step (forward + backward of `dflash_loss`, bf16 autocast) at hidden 4096, 32/8 heads, head_dim 128,
   MLP 12288, Ld=5, B=16, 5 feature layers, vocab 151936, a 2048-token context, 512 anchors: tokens/s (context
   tokens), peak memory; the dense reference at 128 anchors beside flex at 128 (the dense mask's scores grow with
   anchors x context).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3_zoo.drafters.dflash.config import DFlashConfig  # noqa: E402
from eagle3_zoo.drafters.dflash.loss import dflash_loss, select_anchors  # noqa: E402
from eagle3_zoo.drafters.dflash.model import DFlashDrafter  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    context: int
    anchors: int


GPU_EQ = Shape(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, layers=2, vocab=4096, context=512,
               anchors=32)
GPU_BIG = Shape(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, layers=5, vocab=151936,
                context=2048, anchors=512)
CPU_EQ = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=2, vocab=200, context=40,
               anchors=6)
CPU_BIG = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=2, vocab=200, context=64,
                anchors=16)
BLOCK, FEATURES = 16, 5
_OUT = None


def row(name: str, ok: bool, **data) -> None:
    text = f"| {name} | {'PASS' if ok else 'FAIL'} | " + ", ".join(f"{k}={_fmt(v)}" for k, v in data.items()) + " |"
    print(text, flush=True)
    if _OUT is not None:
        with open(_OUT, "a") as f:
            f.write(json.dumps({"check": name, "ok": ok, **data}) + "\n")


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else v


def _setup(s: Shape, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       head_dim=s.head_dim, intermediate_size=s.intermediate, vocab_size=s.vocab,
                       num_target_layers=36, target_layer_ids=(1, 9, 17, 25, 33)[:FEATURES], mask_token_id=s.vocab - 1,
                       num_hidden_layers=s.layers, block_size=BLOCK)
    drafter = DFlashDrafter(cfg).to(device, dtype)
    aux = torch.randn(1, s.context, FEATURES * s.hidden, device=device, dtype=dtype)
    ids = torch.randint(0, s.vocab - 1, (1, s.context), device=device)
    embed = torch.randn(s.vocab, s.hidden, device=device, dtype=dtype) * 0.02
    head = torch.randn(s.vocab, s.hidden, device=device, dtype=dtype) * 0.02
    mask = torch.ones(1, s.context, dtype=torch.bool, device=device)
    mask[:, : s.context // 8] = False  # a prompt: no anchors there
    anchors, valid = select_anchors(mask, s.anchors, generator=torch.Generator().manual_seed(0))
    return drafter, (aux, ids, mask, anchors.to(device), valid.to(device), embed, head)


def _loss(drafter, batch, attention: str, amp: bool, grad: bool = True):
    aux, ids, mask, anchors, valid, embed, head = batch
    with torch.autocast(aux.device.type, dtype=torch.bfloat16, enabled=amp), torch.set_grad_enabled(grad):
        return dflash_loss(drafter, aux, ids, mask, anchors, valid, embed, head, attention=attention)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def check_equality(s: Shape, device: torch.device, amp: bool) -> bool:
    drafter, batch = _setup(s, device)
    backward = device.type == "cuda"
    out = {}
    for attention in ("dense", "flex"):
        drafter.zero_grad(set_to_none=True)
        res = _loss(drafter, batch, attention, amp, grad=backward)
        if backward:
            res.loss.backward()
        out[attention] = (res.loss.detach(), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()
                                              if p.grad is not None}, res.acceptance_length)
    loss_err = _rel(out["flex"][0], out["dense"][0])
    grad_err = max((_rel(out["flex"][1][n], g) for n, g in out["dense"][1].items()), default=0.0)
    tol = (2e-2, 5e-2) if amp else (1e-4, 1e-3)
    ok = loss_err < tol[0] and grad_err < tol[1] and (not backward or len(out["dense"][1]) == len(out["flex"][1]) > 0)
    row(f"flex vs dense, {'bf16 autocast' if amp else 'fp32'}, context {s.context}, {s.anchors} anchors", ok,
        loss_rel_err=loss_err, grad_rel_err=grad_err if backward else "n/a (no flex backward on CPU)",
        tol=str(tol), loss=float(out["dense"][0]))
    return ok


def check_step(s: Shape, device: torch.device, attention: str, anchors: int, iters: int) -> bool:
    s = Shape(**{**s.__dict__, "anchors": anchors})
    drafter, batch = _setup(s, device)
    backward = device.type == "cuda" or attention == "dense"

    def step():
        drafter.zero_grad(set_to_none=True)
        res = _loss(drafter, batch, attention, amp=True, grad=backward)
        if backward:
            res.loss.backward()
        return res

    try:
        t0 = time.perf_counter()
        step()  # warm-up (compile)
        _sync(device)
        warm = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            res = step()
        _sync(device)
        sec = (time.perf_counter() - t0) / iters
    except torch.OutOfMemoryError:
        row(f"train step {attention}, context {s.context}, {anchors} anchors", attention == "dense",
            result="out of memory")
        return attention == "dense"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    ok = bool(torch.isfinite(res.loss))
    row(f"train step {attention}, context {s.context}, {anchors} anchors, bf16 autocast", ok,
        seconds=sec, context_tokens_per_s=s.context / sec, query_tokens_per_s=anchors * BLOCK / sec,
        peak_gib=peak, warmup_s=warm, accept_len=float(res.acceptance_length), backward=backward)
    return ok


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--jsonl", type=Path, default=None)
    args = p.parse_args()
    global _OUT
    _OUT = args.jsonl
    if args.cpu_smoke:
        device, eq, big, iters = torch.device("cpu"), CPU_EQ, CPU_BIG, 1
    elif not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU run `--cpu-smoke`", file=sys.stderr)
        return 2
    else:
        device, eq, big, iters = torch.device("cuda"), GPU_EQ, GPU_BIG, 3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check_dflash {time.strftime('%Y-%m-%d')}: {name}, torch {torch.__version__}; block {BLOCK}, "
          f"{FEATURES} feature layers", flush=True)
    start = time.perf_counter()
    results = []
    for check in (lambda: check_equality(eq, device, amp=False), lambda: check_equality(eq, device, amp=True),
                  lambda: check_step(big, device, "flex", big.anchors, iters),
                  lambda: check_step(big, device, "flex", big.anchors // 4, iters),
                  lambda: check_step(big, device, "dense", big.anchors // 4, iters)):
        try:
            results.append(check())
        except Exception as e:  # a failing check reports and the others still run
            row("error", False, error=f"{type(e).__name__}: {str(e)[:300]}")
            results.append(False)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
