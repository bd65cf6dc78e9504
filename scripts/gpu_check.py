"""One-shot GPU check of the training step: speed, memory and correctness in one table. No downloads: every model
is built in code with random weights.

1. bf16 TTT train step (forward + backward, autocast as `bf16-mixed`) of the Llama-3.1-8B drafter shape (hidden
   4096, 32 heads / 8 KV heads, intermediate 14336, draft vocab 32000, target vocab 128256, K=7) at T=2048 and
   T=8192: eagle3-zoo (`ttt_loss`) against the naive formulation (full fp32 causal scores plus one column per
   earlier step, lm_head and log-softmax over every position) on the same weights and batch: tokens/s, peak memory,
   and the loss and every gradient of both, compared (not assumed).
2. The device's TTT attention backend (`ttt_backend`: FlexAttention on CUDA) against `ttt_attention_reference`:
   largest error of the output and of every gradient, fp32 and bf16 autocast.
3. A few `bf16-mixed` training steps built exactly as `fit` builds them, on a random-weight Llama-3.2-1B-shaped
   target (online: the frozen target runs in the step): tokens/s and peak memory.

    bash scripts/gpu_check.sh               # one CUDA GPU (H200-class: ~5 min)
    bash scripts/gpu_check.sh --cpu-smoke   # the same code on tiny shapes on a CPU (part of the test suite)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from bench_train import StepTimer  # noqa: E402

from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab  # noqa: E402
from eagle3_zoo.modeling.attention import ttt_attention, ttt_attention_reference, ttt_backend  # noqa: E402
from eagle3_zoo.training.loss import ttt_loss  # noqa: E402
from eagle3_zoo.training.reference import reference_ttt_loss  # noqa: E402

# agreement bounds (relative: ||a - b|| / ||b||); bf16 keeps 8 mantissa bits (unit roundoff 2e-3)
STEP_TOL = {"loss": 1e-2, "grad": 5e-2}  # bf16 eagle3-zoo vs bf16 naive (whose attention is fp32)
ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # one attention call vs the fp32 reference


@dataclass
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    draft_vocab: int
    vocab: int
    steps: int
    seq_lens: tuple[int, ...]
    iters: int
    attn_seq_len: int
    fit_target: dict  # LlamaConfig kwargs of the online target
    fit_turns: int
    fit_steps: tuple[int, int]  # warm-up, timed


GPU = Shapes(hidden=4096, heads=32, kv_heads=8, intermediate=14336, draft_vocab=32000, vocab=128256, steps=7,
             seq_lens=(2048, 8192), iters=3, attn_seq_len=2048,
             fit_target=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             tie_word_embeddings=True),  # Llama-3.2-1B
             fit_turns=40, fit_steps=(2, 4))
CPU_SMOKE = Shapes(hidden=64, heads=4, kv_heads=2, intermediate=128, draft_vocab=96, vocab=160, steps=3,
                   seq_lens=(40, 70), iters=1, attn_seq_len=50,
                   fit_target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   tie_word_embeddings=False),
                   fit_turns=1, fit_steps=(1, 1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_start(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gib(device: torch.device, base: int) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    return f"{(torch.cuda.max_memory_allocated(device) - base) / 2**30:.1f} GiB"


# ------------------------------------------------------------------------------------------------ 1. TTT step
def _drafter(s: Shapes, device: torch.device) -> tuple[Eagle3Drafter, torch.nn.Embedding]:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       intermediate_size=s.intermediate, vocab_size=s.vocab, draft_vocab_size=s.draft_vocab,
                       target_hidden_size=s.hidden, rope_theta=500000.0, aux_layer_ids=(2, 16, 29))
    with device:
        drafter = Eagle3Drafter(cfg)  # fp32 master weights, as under bf16-mixed
        embed = torch.nn.Embedding(s.vocab, s.hidden, dtype=torch.bfloat16).requires_grad_(False)
    drafter.set_vocab(*build_draft_vocab(torch.randint(0, 1000, (s.vocab,)), s.draft_vocab))
    return drafter, embed


def _batch(s: Shapes, drafter: Eagle3Drafter, t: int, device: torch.device):
    g = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, s.vocab, (1, t), device=device, generator=g)
    aux = torch.randn(1, t, 3 * s.hidden, device=device, generator=g)
    logits = torch.randn(1, t, s.draft_vocab, device=device, generator=g) * 2  # draft-vocab columns, as `fit` keeps
    valid = torch.rand(1, t, device=device, generator=g) < 0.98  # share of target argmaxes inside the draft vocab
    mask = torch.zeros(1, t, dtype=torch.long, device=device)
    mask[:, t // 3 :] = 1  # prompt, then the supervised answer (66% of positions, as on ShareGPT)
    return ids, aux, logits, valid, mask


def check_ttt_step(s: Shapes, t: int, device: torch.device) -> dict:
    drafter, embed = _drafter(s, device)
    ids, aux, logits, valid, mask = _batch(s, drafter, t, device)
    weights = [0.8**k for k in range(s.steps)]
    params = list(drafter.parameters())

    def ours():
        return ttt_loss(drafter, embed, ids, aux, logits, mask, steps=s.steps, step_weights=weights,
                        target_valid=valid).loss

    def naive():
        return reference_ttt_loss(drafter, embed, ids, aux, logits, valid, mask, s.steps, weights)

    result = {"T": t}
    for name, fn in (("ours", ours), ("naive", naive)):
        try:
            times, base = [], 0
            for i in range(1 + s.iters):  # the first call warms up (and compiles the CUDA attention kernels)
                drafter.zero_grad(set_to_none=True)
                if i == 1:
                    base = _peak_start(device)
                _sync(device)
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = fn()
                loss.backward()
                _sync(device)
                times.append(time.perf_counter() - start)
            result[name] = {"tok_s": t / min(times[1:]), "mem": _peak_gib(device, base), "loss": loss.detach(),
                            "grads": [p.grad.detach().clone() for p in params]}
        except torch.OutOfMemoryError:
            drafter.zero_grad(set_to_none=True)
            result[name] = {"oom": True}
            torch.cuda.empty_cache()
    if "grads" in result["ours"] and "grads" in result["naive"]:
        result["loss_err"] = _rel(result["ours"]["loss"], result["naive"]["loss"])
        result["grad_err"] = max(_rel(a, b) for a, b in zip(result["ours"]["grads"], result["naive"]["grads"]))
        result["ok"] = result["loss_err"] < STEP_TOL["loss"] and result["grad_err"] < STEP_TOL["grad"]
    else:
        result["ok"] = "oom" not in result["ours"]  # the naive formulation running out of memory is a finding
    for name in ("ours", "naive"):
        result[name].pop("grads", None)
    return result


# ---------------------------------------------------------------------------------------------- 2. attention
def check_attention(s: Shapes, device: torch.device, amp: torch.dtype) -> dict:
    g = torch.Generator(device).manual_seed(2)
    t, d = s.attn_seq_len, s.hidden // s.heads

    def rand(heads):
        return torch.randn(1, heads, t, d, device=device, generator=g).requires_grad_()

    q = rand(s.heads)
    ks, vs = [rand(s.kv_heads) for _ in range(s.steps)], [rand(s.kv_heads) for _ in range(s.steps)]
    leaves = [q, *ks, *vs]
    d_out = torch.randn(q.shape, device=device, generator=g)
    ref = ttt_attention_reference(q, ks, vs)
    ref_grads = torch.autograd.grad((ref * d_out).sum(), leaves)
    backend = ttt_backend(device.type)
    with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
        out = ttt_attention(q, ks, vs)
    grads = torch.autograd.grad((out.float() * d_out).sum(), leaves)
    out = out.detach()
    fwd_abs = float((out.float() - ref).abs().max())
    grad_abs = max(float((a.float() - r).abs().max()) for a, r in zip(grads, ref_grads))
    fwd_rel, grad_rel = _rel(out, ref), max(_rel(a, r) for a, r in zip(grads, ref_grads))
    return {"backend": backend, "dtype": str(amp).replace("torch.", ""), "fwd_abs": fwd_abs, "grad_abs": grad_abs,
            "fwd_rel": fwd_rel, "grad_rel": grad_rel, "ok": max(fwd_rel, grad_rel) < ATTN_TOL[amp]}


# ----------------------------------------------------------------------------------------------------- 3. fit
def check_fit(s: Shapes, device: torch.device, work: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.recipe import load_recipe
    from eagle3_zoo.training.build import build_run
    from eagle3_zoo.training.fit import build_trainer
    from tests.training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    adapter = get_adapter("llama")
    torch.manual_seed(0)
    config = LlamaConfig(**s.fit_target)
    with device:
        target = LlamaForCausalLM(config).to(torch.bfloat16)
    target.save_pretrained(work / "target")
    adapter.tiny_tokenizer().save_pretrained(work / "target")
    del target
    n_layers = config.num_hidden_layers
    data = write_chat_jsonl(work / "chat.jsonl", n=24, turns=s.fit_turns)
    warmup, timed = s.fit_steps
    recipe = tiny_recipe(work, work / "target", data,
                         target={"dtype": "bfloat16"},
                         drafter={"draft_vocab_size": min(32000, config.vocab_size),
                                  "aux_layer_ids": [2, n_layers // 2, n_layers - 3] if n_layers >= 8 else [1, 2, 3]},
                         data={"max_length": 2048, "val_fraction": 0.0},
                         ttt={"steps": s.steps},
                         # no fc preconditioning: it runs the target over 64 samples on the CPU before training
                         optim={"precondition_fc": False},
                         trainer={"precision": "bf16-mixed", "max_steps": warmup + timed,
                                  "checkpoint_every_n_steps": 10_000, "val_check_interval": None, "logger": []})
    recipe = load_recipe(write_recipe(work / "recipe.yaml", recipe))
    run = build_run(recipe)
    timer = StepTimer()
    trainer = build_trainer(recipe, run.adapter, [timer], has_val=False, logger=False, enable_progress_bar=False,
                            enable_model_summary=False)
    base = _peak_start(device)
    trainer.fit(run.module, datamodule=run.datamodule)
    steps = timer.steps[warmup:]
    seconds, tokens, _ = (sum(col) for col in zip(*steps))
    loss = float(trainer.callback_metrics.get("train/loss", float("nan")))
    return {"steps": len(steps), "tok_s": tokens / seconds, "tokens_per_step": tokens / len(steps),
            "mem": _peak_gib(device, base), "loss": loss, "ok": math.isfinite(loss) and len(steps) == timed}


# ------------------------------------------------------------------------------------------------------ main
def _fmt_step(r: dict, name: str) -> str:
    x = r[name]
    return "OOM" if x.get("oom") else f"{x['tok_s']:,.0f} tok/s, {x['mem']}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the test suite runs this)")
    args = p.parse_args()
    if args.cpu_smoke:
        device, s = torch.device("cpu"), CPU_SMOKE
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device; on a CPU run `scripts/gpu_check.sh --cpu-smoke`", file=sys.stderr)
            return 2
        device, s = torch.device("cuda"), GPU
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check: {name}, torch {torch.__version__}, drafter hidden {s.hidden}, {s.heads}/{s.kv_heads} heads, "
          f"intermediate {s.intermediate}, draft vocab {s.draft_vocab}, vocab {s.vocab}, K={s.steps}", flush=True)
    rows = []
    for t in s.seq_lens:
        r = check_ttt_step(s, t, device)
        agree = (f"loss {r['loss_err']:.1e}, grads {r['grad_err']:.1e} (tol {STEP_TOL['loss']:.0e} / "
                 f"{STEP_TOL['grad']:.0e})") if "loss_err" in r else "not compared (naive OOM)"
        rows.append((f"TTT train step bf16, T={t}", _fmt_step(r, "ours"), _fmt_step(r, "naive"), agree, r["ok"]))
        print(f"  done: {rows[-1][0]} ({time.perf_counter() - start:.0f} s)", flush=True)
    for amp in (torch.float32, torch.bfloat16):
        r = check_attention(s, device, amp)
        rows.append((f"TTT attention '{r['backend']}' {r['dtype']}, T={s.attn_seq_len}, {s.steps} steps",
                     f"max abs err out {r['fwd_abs']:.1e}, grads {r['grad_abs']:.1e}", "ttt_attention_reference fp32",
                     f"rel. out {r['fwd_rel']:.1e}, grads {r['grad_rel']:.1e} (tol {ATTN_TOL[amp]:.0e})", r["ok"]))
        print(f"  done: {rows[-1][0]} ({time.perf_counter() - start:.0f} s)", flush=True)
    with tempfile.TemporaryDirectory() as work:
        r = check_fit(s, device, Path(work))
    target = "1B-shaped" if device.type == "cuda" else "tiny"
    rows.append((f"fit bf16-mixed, {target} target online, {r['steps']} timed steps",
                 f"{r['tok_s']:,.0f} tok/s, {r['mem']}", f"{r['tokens_per_step']:.0f} tokens/step",
                 f"final loss {r['loss']:.3f}", r["ok"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    header = ("check", "eagle3-zoo", "naive / reference", "agreement")
    widths = [max(w, len(h)) for w, h in zip(widths, header)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " | ok   |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|------|")
    for row in rows:
        cells = " | ".join(str(c).ljust(w) for c, w in zip(row[:4], widths))
        print(f"| {cells} | {'PASS' if row[4] else 'FAIL'} |")
    if device.type == "cuda":
        from torch._dynamo.utils import counters

        print(f"\ncompiled graphs: {counters['stats'].get('unique_graphs', 0)}; "
              f"total {time.perf_counter() - start:.0f} s")
    return 0 if all(row[4] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
