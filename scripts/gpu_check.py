"""One-shot GPU check of training and decoding: speed, memory and correctness, one table row at a time. No downloads:
every model is built in code with random weights. Each row is printed as soon as it is measured and appended to a
JSON-lines file (`--jsonl`, flushed and synced per row, so a run cut short keeps what it measured); a check that
fails prints its error and the others still run; warm-up (compile) time is its own column. The planned time of
every check on one H200 is printed before the first one runs.

1. TTT train step (forward + backward, bf16 autocast as `bf16-mixed`) of the Llama-3.1-8B drafter shape (hidden
   4096, 32 / 8 heads, intermediate 14336, draft vocab 32000, vocab 128256, K=7), eagle3-zoo (`ttt_loss`) against
   the naive formulation (full causal scores plus one column per earlier step, lm_head and log-softmax over every
   position; `training.reference`), both bf16 on the same weights and batch: tokens/s and the peak memory of forward
   AND backward (no `empty_cache` inside the timed region). The loss and every gradient are compared with the naive
   formulation in fp32 with autocast off (T=2048, and T=2000, which is not a multiple of FlexAttention's 128-block:
   the padding path); at T=8192 with the bf16 naive one (if it fits).
2. The device's TTT attention backend (`ttt_backend`: FlexAttention on CUDA) against `ttt_attention_reference`:
   largest error of the output and of every gradient, fp32 and bf16 autocast, at T=2048 and T=1000 (padding).
3. Lossless greedy speculative decoding (EAGLE-2 tree and chain) on a random Llama-3.2-1B-shaped target (fp32)
   against plain greedy decoding, with a drafter that accepts: a real `Eagle3DraftModel` runs every call (its compute
   and cache as in decoding) and an oracle overrides its proposals on the greedy path, ranking the target's greedy
   token first except at chosen depths of each cycle (second there: the accepted path goes through a later child; or
   absent: acceptance stops). The same tokens, tokens/s of each, tau, and the target-cache prunings that ran. It runs
   before the `fit` checks, so a hang there cannot lose it.
4. `fit` as shipped (recipe file, dotlist overrides, `eagle3_zoo.training.fit.fit`), a few bf16-mixed steps on the
   random-weight 1B-shaped target online: strategy auto, with the host-device syncs of one whole fit step counted
   (every callback `fit` installs, the optimizer step, Lightning's logging and the next batch's transfer:
   `torch.cuda.set_sync_debug_mode` on CUDA, the ops that would sync on a CPU), then `trainer.strategy=fsdp
   trainer.devices=1` (FSDP2 on a one-rank NCCL mesh, the target loaded as a skeleton and filled shard by shard, a
   sharded checkpoint written): tokens/s, peak memory.

    bash scripts/gpu_check.sh --jsonl $OUT/gpu_check.jsonl  # one CUDA GPU (no omegaconf there: see gpu_check.sh)
    bash scripts/gpu_check.sh --cpu-smoke   # the same code on tiny shapes on a CPU (part of the test suite)
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from eagle3_zoo.drafters.eagle3.ttt import ttt_loss  # noqa: E402
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab, identity_vocab  # noqa: E402
from eagle3_zoo.modeling.attention import ttt_attention, ttt_attention_reference, ttt_backend  # noqa: E402
from eagle3_zoo.training.reference import reference_ttt_loss  # noqa: E402

# agreement bounds (relative: ||a - b|| / ||b||); bf16 keeps 8 mantissa bits (unit roundoff 4e-3)
STEP_TOL = {"loss": 1e-2, "grad": 5e-2}  # bf16 eagle3-zoo vs the naive formulation (fp32, or bf16 at 8192)
ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # one attention call vs the fp32 reference
# host-device syncs of one whole `fit` step (no terminal bar, not a logging step, no progress line due): the read of
# the loss's supervised-row counts, which brings the previous step's non-finite flag and the bar's metrics along
# (8 at 179c5a7: the TTT schedule's float logged as a device tensor, the progress callback's token count, the module
# and loss's nonzero / tolist / non-finite check, transformers' packed-sequence check, and Lightning turning the two
# `prog_bar=True` metrics into Python numbers after every batch)
SYNC_BUDGET = 1


@dataclass
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    draft_vocab: int
    vocab: int
    steps: int
    seq_lens: tuple[int, ...]  # (fp32-checked, long, odd)
    iters: int
    attn_seq_lens: tuple[int, ...]
    fit_target: dict  # LlamaConfig kwargs of the online target (and the decoding target)
    fit_turns: int
    fit_steps: tuple[int, int]  # warm-up, timed (then one step with its syncs counted, then the checkpoint step)
    new_tokens: int


GPU = Shapes(hidden=4096, heads=32, kv_heads=8, intermediate=14336, draft_vocab=32000, vocab=128256, steps=7,
             seq_lens=(2048, 8192, 2000), iters=3, attn_seq_lens=(2048, 1000),
             fit_target=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             tie_word_embeddings=True),  # Llama-3.2-1B
             fit_turns=40, fit_steps=(2, 4), new_tokens=64)
CPU_SMOKE = Shapes(hidden=64, heads=4, kv_heads=2, intermediate=128, draft_vocab=96, vocab=160, steps=3,
                   seq_lens=(40, 70, 37), iters=1, attn_seq_lens=(50, 37),
                   fit_target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   tie_word_embeddings=False),
                   fit_turns=1, fit_steps=(1, 1), new_tokens=24)
HEADER = ("check", "eagle3-zoo", "reference", "agreement", "warm-up s", "ok")
WIDTHS = (44, 34, 34, 44, 9, 4)
RESULTS: list[bool] = []
WARMUPS: list[float] = []  # warm-up seconds of each row (compilation included)
_DRAFTERS: dict = {}
# Planned seconds of each check on one H200, compilation included, and of the machine's start (the machine, the
# copy of the checkout, the omegaconf wheel, imports), from the first two runs on one H200 (2026-12-04, a87afc1 and
# 8df84b1; JSON-lines rows in docs/performance.md): measured 39-55 s for the first TTT step check (FlexAttention's
# fwd+bwd compiles, 19-29 s), 12-17 s for the first fp32 attention check (its compile), under 11 s for every other
# kernel check, 6-9 s decoding, 26-35 s `fit` auto and 13-22 s `fit` fsdp (the second run profiled one step more),
# 107-153 s in all, the start 60-70 s; each estimate is about 1.5x the larger figure. Each JSON-lines row records its
# estimate beside the measured seconds; a check that runs past HANG_FACTOR times its estimate (at least HANG_MIN_S)
# stops the run with every thread's stack (a hang in NCCL or a compile must not spend the device time).
START_S = 90
ESTIMATE_S = {"TTT train step T=2048": 80, "TTT train step T=8192": 10, "TTT train step T=2000": 20,
              "TTT attention float32 T=2048": 30, "TTT attention bfloat16 T=2048": 5,
              "TTT attention float32 T=1000": 5, "TTT attention bfloat16 T=1000": 5, "speculative decoding": 15,
              "fit auto": 55, "fit fsdp": 35}
LIMIT_S = 480  # the whole run, start included, on one H200
HANG_FACTOR, HANG_MIN_S = 4, 180
PROFILE_DIR: Path | None = None  # --profile-fit


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _peak(device: torch.device) -> Iterator[dict]:
    """`{"mem": "<peak above the start> GiB", "gib": <float>}` once the block ends (CUDA; "n/a" on a CPU). It does
    not empty the allocator's cache: the block may be timed, and a freed cache would time cudaFree and the
    cudaMallocs after it (`main` empties it between checks)."""
    out: dict = {"mem": "n/a (CPU)", "gib": None}
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    yield out
    if device.type == "cuda":
        out["gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        out["mem"] = f"{out['gib']:.1f} GiB"


class Journal:
    """The run's JSON-lines file: a header line, then one line per table row, each flushed and synced to disk when
    written (a run killed at its time limit keeps every row it measured). `check`, `started`, `estimate`: the
    running check, when it started, its planned seconds on one H200."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.check, self.started, self.estimate = path, "", time.perf_counter(), None
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


JOURNAL = Journal()


def _line(cells) -> None:
    print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, WIDTHS)) + " |", flush=True)


def row(*cells, **data) -> None:
    """Append one table row to the JSON-lines file and print it, now: the cells of HEADER, the last one whether the
    check passed; `data`: the row's numbers (tokens/s, GiB, errors, counts) for the file."""
    *text, ok = cells
    RESULTS.append(bool(ok))
    with contextlib.suppress(ValueError):
        WARMUPS.append(float(text[4]))
    JOURNAL.write({"key": JOURNAL.check, "ok": bool(ok), "seconds": round(time.perf_counter() - JOURNAL.started, 2),
                   "estimate_s_h200": JOURNAL.estimate, **dict(zip(HEADER, text)), **data})
    _line([*text, "PASS" if ok else "FAIL"])


# ------------------------------------------------------------------------------------------------ 1. TTT step
def _drafter(s: Shapes, device: torch.device) -> tuple[Eagle3Drafter, torch.nn.Embedding]:
    """The random drafter and embedding of `s` (built once: the checks only take gradients)."""
    if id(s) not in _DRAFTERS:
        _DRAFTERS[id(s)] = _new_drafter(s, device)
    return _DRAFTERS[id(s)]


def _new_drafter(s: Shapes, device: torch.device) -> tuple[Eagle3Drafter, torch.nn.Embedding]:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       intermediate_size=s.intermediate, vocab_size=s.vocab, draft_vocab_size=s.draft_vocab,
                       target_hidden_size=s.hidden, rope_theta=500000.0, aux_layer_ids=(2, 16, 29))
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(*build_draft_vocab(torch.randint(0, 1000, (s.vocab,)), s.draft_vocab))
    # built on the CPU and moved, as Lightning moves it (fp32 master weights, as under bf16-mixed)
    embed = torch.nn.Embedding(s.vocab, s.hidden, dtype=torch.bfloat16).requires_grad_(False)
    return drafter.to(device), embed.to(device)


def _batch(s: Shapes, t: int, device: torch.device):
    g = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, s.vocab, (1, t), device=device, generator=g)
    aux = torch.randn(1, t, 3 * s.hidden, device=device, generator=g)
    logits = torch.randn(1, t, s.draft_vocab, device=device, generator=g) * 2  # draft-vocab columns, as `fit` keeps
    valid = torch.rand(1, t, device=device, generator=g) < 0.98  # share of target argmaxes inside the draft vocab
    mask = torch.zeros(1, t, dtype=torch.long, device=device)
    mask[:, t // 3 :] = 1  # prompt, then the supervised answer (66% of positions, as on ShareGPT)
    return ids, aux, logits, valid, mask


def _run_step(fn: Callable[[], torch.Tensor], params: list, device: torch.device, iters: int,
              amp: torch.dtype | None) -> dict:
    """Warm-up call (compiles on CUDA), then `iters` timed calls: seconds, the peak memory of forward and backward
    (the largest of the timed calls), loss and grads."""
    times, peaks = [], []
    for _ in range(1 + iters):
        for p in params:
            p.grad = None
        _sync(device)
        with _peak(device) as peak:
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = fn()
            loss.backward()
            _sync(device)
            times.append(time.perf_counter() - start)
        peaks.append(peak)
    peak = max(peaks[1:] or peaks, key=lambda p: p["gib"] or 0.0)
    return {"warmup": times[0], "seconds": min(times[1:] or times), "mem": peak["mem"], "gib": peak["gib"],
            "loss": loss.detach(), "grads": [p.grad.detach().clone() for p in params]}


def check_ttt_step(s: Shapes, t: int, device: torch.device, fp32_reference: bool) -> None:
    drafter, embed = _drafter(s, device)
    ids, aux, logits, valid, mask = _batch(s, t, device)
    weights = [0.8**k for k in range(s.steps)]
    params = list(drafter.parameters())

    def ours():
        return ttt_loss(drafter, embed, ids, aux, logits, mask, steps=s.steps, step_weights=weights,
                        target_valid=valid).loss

    def naive():
        return reference_ttt_loss(drafter, embed, ids, aux, logits, valid, mask, s.steps, weights)

    mine = _run_step(ours, params, device, s.iters, torch.bfloat16)
    try:
        naive_bf16 = _run_step(naive, params, device, s.iters, torch.bfloat16)
        naive_cell = f"{t / naive_bf16['seconds']:,.0f} tok/s, {naive_bf16['mem']} (naive bf16)"
    except torch.OutOfMemoryError:
        naive_bf16, naive_cell = None, "naive bf16: out of memory"
        torch.cuda.empty_cache()
    ref, what = naive_bf16, "naive bf16"
    if fp32_reference:  # the fp32 ground truth: autocast off (under autocast its matmuls would run in bf16)
        ref, what = _run_step(naive, params, device, 0, None), "naive fp32, autocast off"
    loss_err = grad_err = None
    if ref is None:
        agree, ok = "not compared (naive out of memory)", True
    else:
        loss_err = _rel(mine["loss"], ref["loss"])
        grad_err = max(_rel(a, b) for a, b in zip(mine["grads"], ref["grads"]))
        agree = f"vs {what}: loss {loss_err:.1e}, grads {grad_err:.1e}"
        ok = loss_err < STEP_TOL["loss"] and grad_err < STEP_TOL["grad"]
    pad = "" if t % 128 == 0 else " (padded)"
    row(f"TTT train step bf16, T={t}{pad}", f"{t / mine['seconds']:,.0f} tok/s, {mine['mem']}", naive_cell, agree,
        f"{mine['warmup']:.1f}", ok, tokens_per_s=t / mine["seconds"], peak_gib=mine["gib"],
        naive_tokens_per_s=naive_bf16 and t / naive_bf16["seconds"], naive_peak_gib=naive_bf16 and naive_bf16["gib"],
        loss_rel_err=loss_err, grad_rel_err=grad_err)


# ---------------------------------------------------------------------------------------------- 2. attention
def check_attention(s: Shapes, t: int, device: torch.device, amp: torch.dtype) -> None:
    g = torch.Generator(device).manual_seed(2)
    d = s.hidden // s.heads

    def rand(heads):
        return torch.randn(1, heads, t, d, device=device, generator=g).requires_grad_()

    q = rand(s.heads)
    ks, vs = [rand(s.kv_heads) for _ in range(s.steps)], [rand(s.kv_heads) for _ in range(s.steps)]
    leaves = [q, *ks, *vs]
    d_out = torch.randn(q.shape, device=device, generator=g)
    ref = ttt_attention_reference(q, ks, vs)
    ref_grads = torch.autograd.grad((ref * d_out).sum(), leaves)
    backend = ttt_backend(device.type)
    # CPU smoke: FlexAttention has no CPU backward, so the CPU runs its own backend
    times = []
    for _ in range(2):  # the first call compiles (CUDA)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            out = ttt_attention(q, ks, vs)
        grads = torch.autograd.grad((out.float() * d_out).sum(), leaves)
        _sync(device)
        times.append(time.perf_counter() - start)
    out = out.detach()
    fwd_abs = float((out.float() - ref).abs().max())
    grad_abs = max(float((a.float() - r).abs().max()) for a, r in zip(grads, ref_grads))
    fwd_rel, grad_rel = _rel(out, ref), max(_rel(a, r) for a, r in zip(grads, ref_grads))
    dtype = str(amp).removeprefix("torch.")
    pad = "" if t % 128 == 0 else " (padded)"
    row(f"TTT attention '{backend}' {dtype}, T={t}{pad}", f"max abs err out {fwd_abs:.1e}, grads {grad_abs:.1e}",
        "ttt_attention_reference fp32", f"rel. out {fwd_rel:.1e}, grads {grad_rel:.1e} (tol {ATTN_TOL[amp]:.0e})",
        f"{times[0]:.1f}", max(fwd_rel, grad_rel) < ATTN_TOL[amp], out_rel_err=fwd_rel, grad_rel_err=grad_rel)


# --------------------------------------------------------------------------------------------------- 3. decode
def _target_config(s: Shapes):
    from transformers import LlamaConfig

    return LlamaConfig(**s.fit_target)


class GreedyOracle:
    """A `DraftModel` that accepts: a real `Eagle3DraftModel` runs every call (its compute and KV cache as in
    decoding), and on the greedy path its proposals are overridden from `sequence` (the prompt and the target's
    greedy continuation): the greedy token ranks first, except at the depths that `SCHEDULE` names for the cycle,
    where it ranks second behind a confident wrong token (a tree then accepts through a later child; a chain stops)
    or is absent (acceptance stops there). Off the greedy path, or past the end of `sequence`, the drafter's own
    logits stand (the draft vocabulary is the whole target vocabulary, so a proposal is a target id)."""

    # per cycle (one `extend` each, cycling): depth of the proposal -> "second" or "absent"; unnamed depths rank first
    SCHEDULE = ({}, {3: "absent"}, {2: "second", 5: "absent"}, {1: "absent"}, {4: "second"}, {2: "absent"})

    def __init__(self, inner, sequence: list[int]) -> None:
        self.inner, self.sequence = inner, sequence
        self.reset()

    def reset(self) -> None:
        self.inner.reset()
        self.rows: list[int] = []  # tokens of the drafter's context rows
        self.last: int | None = None  # the newest emitted token
        self.tree: list[int] = []  # tokens of the tree nodes run this cycle
        self.cycle = -1

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.to_target(draft_ids)

    def _override(self, out, contexts: list[list[int]]):
        logits = out.logits
        for i, context in enumerate(contexts):
            n = len(context)
            if n >= len(self.sequence) or context != self.sequence[:n]:
                continue
            greedy, depth = self.sequence[n], n - len(self.rows)  # the proposal's depth below the last context row
            wrong = (greedy + 1) % logits.shape[-1]
            how = self.SCHEDULE[self.cycle % len(self.SCHEDULE)].get(depth, "first")
            top = logits[0, i].max()  # stays on the device: no host sync
            if how == "first":
                logits[0, i, greedy] = top + 30
            else:
                logits[0, i, wrong] = top + 30.5
                logits[0, i, greedy] = top + 30 if how == "second" else logits[0, i].min() - 30
        return out

    def extend(self, aux_hidden, input_ids, next_ids):
        out = self.inner.extend(aux_hidden, input_ids, next_ids)
        self.rows += input_ids.tolist()
        self.last, self.tree, self.cycle = int(next_ids[-1]), [], self.cycle + 1
        return self._override(out, [self.rows + [self.last]])

    def expand(self, token_ids, hidden, depths, visible):
        out = self.inner.expand(token_ids, hidden, depths, visible)
        self.tree += token_ids.tolist()
        paths = [[t for t, seen in zip(self.tree, row) if seen] for row in visible.tolist()]
        return self._override(out, [self.rows + [self.last] + path for path in paths])


def check_decode(s: Shapes, device: torch.device) -> None:
    """Greedy speculative decoding (tree, chain) with an accepting drafter (`GreedyOracle`) equals plain greedy
    decoding, token for token, on the random target in fp32 (bf16 near-ties could flip an argmax between two
    kernels); acceptance ran (varied accepted lengths) and so did the target cache's pruning to the accepted path."""
    from transformers import LlamaForCausalLM

    from eagle3_zoo.speculative.generate import SpeculativeGenerator, plain_generate, tree_spec

    config = _target_config(s)
    torch.manual_seed(0)
    with device:
        target = LlamaForCausalLM(config).eval().requires_grad_(False)
    n = config.num_hidden_layers
    cfg = Eagle3Config.from_target_config(config, draft_vocab_size=config.vocab_size,
                                          aux_layer_ids=(2, n // 2, n - 3) if n >= 8 else (1, 2, 3))
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(*identity_vocab(config.vocab_size))
    drafter = drafter.to(device).eval().requires_grad_(False)
    prompt = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(3))
    specs = {"tree": tree_spec("tree", depth=8), "chain": tree_spec("chain", depth=6)}
    horizon = s.new_tokens + max(spec.depth for spec in specs.values()) + 1  # the oracle also drafts past the end
    with _peak(device) as peak:
        plain_generate(target, prompt, 4, eos_token_id=[])  # warm-up
        plain = plain_generate(target, prompt, horizon, eos_token_id=[])
        sequence = prompt[0].tolist() + plain.tokens
        expected = plain.tokens[: s.new_tokens]
        results, moved = {}, {}
        for mode, spec in specs.items():
            gen = SpeculativeGenerator(target, drafter, spec, layer_ids=cfg.aux_layer_ids)
            gen.draft = GreedyOracle(gen.draft, sequence)
            keep_path, kept = gen.runner.keep_path, []

            def counting_keep_path(nodes, keep_path=keep_path, kept=kept):
                kept.append(list(nodes))
                keep_path(nodes)

            gen.runner.keep_path = counting_keep_path
            gen.generate(prompt, 4, eos_token_id=[])  # warm-up
            kept.clear()
            results[mode] = gen.generate(prompt, s.new_tokens, eos_token_id=[])
            # pruned: more than the root kept; moved: the kept nodes were not slots 0..a (gathered, not cropped)
            moved[mode] = (sum(len(k) > 1 for k in kept), sum(k != list(range(len(k))) for k in kept))
    same = {m: r.tokens == expected for m, r in results.items()}
    accepted = {m: sorted(set(r.accept_lengths)) for m, r in results.items()}
    # acceptance ran (tau well above 1, several accepted lengths) and so did the pruning of the target's cache to
    # the accepted path (a tree's path is gathered by index, a chain's cropped in place)
    accepting = all((r.tau or 0) > 1.5 and len(accepted[m]) >= 2 and max(accepted[m]) >= 2 and moved[m][0] > 0
                    for m, r in results.items()) and moved["tree"][1] > 0
    ours = ", ".join(f"{m} {len(r.tokens) / r.seconds:,.0f} tok/s tau {r.tau:.2f}" for m, r in results.items())
    kept_cell = "; ".join(f"{m} accepted {accepted[m]}, {moved[m][0]} prunings ({moved[m][1]} gathered)"
                          for m in results)
    row(f"speculative decoding, oracle drafter, {s.new_tokens} tokens, fp32", f"{ours}, {peak['mem']}",
        f"plain greedy {len(plain.tokens) / plain.seconds:,.0f} tok/s",
        "lossless: " + ", ".join(f"{m} {'same tokens' if v else 'DIFFERENT tokens'}" for m, v in same.items())
        + f"; {kept_cell}", "-", all(same.values()) and accepting,
        tokens_per_s={m: len(r.tokens) / r.seconds for m, r in results.items()},
        plain_tokens_per_s=len(plain.tokens) / plain.seconds, tau={m: r.tau for m, r in results.items()},
        accept_lengths={m: r.accept_lengths for m, r in results.items()}, same_tokens=same,
        cache_prunings={m: {"pruned": v[0], "gathered": v[1]} for m, v in moved.items()}, peak_gib=peak["gib"])


# ----------------------------------------------------------------------------------------------------- 4. fit
class FitMeter:
    """Times the timed steps of a `fit` and counts the host-device syncs of one whole step after them, as two
    callbacks: `first` goes before every callback `fit` installs and `last` after them.

    A timed step runs from `first.on_train_batch_start` (after a device sync) to `last.on_train_batch_end` (after
    another). The counted step (`warmup + timed`, untimed: the timer's own syncs stay out of it) runs from
    `first.on_train_batch_start` to the same hook of the next step: every callback's hooks, forward, backward, the
    optimizer step, Lightning's logging after the batch and the next batch's fetch and transfer. On CUDA each sync
    is reported by `torch.cuda.set_sync_debug_mode("warn")`; on a CPU the ops that would sync are counted
    (`tests.device_checks.SyncCounter`, as the test suite counts them), less those that stay on the host under CUDA
    (`_host_only`).
    """

    def __init__(self, warmup: int, timed: int, profile: Path | None = None) -> None:
        self.warmup, self.timed = warmup, timed
        self.profile, self._profiler = profile, None  # `profile`: where the table of the untimed last step goes
        self.steps: list[tuple[float, int]] = []  # (seconds, tokens) of every timed step, warm-up ones included
        self.count: int | None = None
        self.where: list[str] = []
        self.first, self.last = _MeterHook(self, "first"), _MeterHook(self, "last")
        self._start = 0.0
        self._counting: tuple | None = None

    def step_start(self, trainer, pl_module, batch) -> None:
        step = trainer.global_step
        if self._counting is not None:
            self._stop_counting(pl_module.device)
        if step < self.warmup + self.timed:
            _sync(pl_module.device)
            self._start = time.perf_counter()
        elif step == self.warmup + self.timed:
            self._start_counting(pl_module.device)
        elif step == self.warmup + self.timed + 1 and self.profile is not None:
            from torch.profiler import ProfilerActivity, profile

            cuda = pl_module.device.type == "cuda"
            self._profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self._profiler.__enter__()

    def step_end(self, trainer, pl_module, batch) -> None:
        if trainer.global_step - 1 < self.warmup + self.timed:  # global_step has moved on past the optimizer step
            _sync(pl_module.device)
            self.steps.append((time.perf_counter() - self._start, int(batch["attention_mask"].sum())))
        elif self._profiler is not None:
            _sync(pl_module.device)
            self._profiler.__exit__(None, None, None)
            cuda = pl_module.device.type == "cuda"
            table = self._profiler.key_averages().table(
                sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40,
                max_name_column_width=70)
            self.profile.write_text(table)
            print("\n".join(table.splitlines()[:18]), flush=True)
            self._profiler = None

    def _start_counting(self, device: torch.device) -> None:
        caught = warnings.catch_warnings(record=True)
        seen = caught.__enter__()
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
            self._counting = (caught, seen, None)
        else:
            from tests.device_checks import SyncCounter, counting_host_reads

            class FitStepCounter(SyncCounter):
                def record(self, kind: str) -> None:
                    if not _host_only():
                        super().record(kind)

            counter = FitStepCounter()
            reads = counting_host_reads(counter)
            reads.__enter__()
            counter.__enter__()
            self._counting = (caught, seen, (counter, reads))

    def _stop_counting(self, device: torch.device) -> None:
        caught, seen, cpu = self._counting
        self._counting = None
        if cpu is None:
            torch.cuda.set_sync_debug_mode(0)
            events = cuda_sync_events(seen)
        else:
            counter, reads = cpu
            counter.__exit__(None, None, None)
            reads.__exit__(None, None, None)
            events = [f"{kind} at {where.split(' ')[0].rsplit('/', 1)[-1]}" for kind, where in counter.events]
        caught.__exit__(None, None, None)
        self.count, self.where = len(events), events


def cuda_sync_events(seen: list[warnings.WarningMessage]) -> list[str]:
    """The syncs that `torch.cuda.set_sync_debug_mode("warn")` reported among recorded warnings, as "sync at
    file:line". The mode's own one-time notice ("Synchronization debug mode is a prototype feature and does not yet
    detect all synchronizing operations", raised where the mode is set) is not one: the first GPU run counted it."""
    return [f"sync at {Path(w.filename).name}:{w.lineno}" for w in seen
            if "called a synchronizing CUDA operation" in str(w.message)]


def _host_only() -> bool:
    """Whether the op being counted on a CPU runs on host tensors when the step runs on CUDA too: a batch built by
    the data loader (copied to the device after), the batch's host-side counts taken before that copy
    (`with_host_counts`), or torch.optim's own per-parameter step counters (host tensors for a non-fused,
    non-capturable AdamW; the closure's forward and backward run inside `optimizer.step` too, so only ops whose
    innermost caller is torch.optim count as its own)."""
    frames = traceback.extract_stack()
    if any(f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}" in f.filename or f.name == "with_host_counts"
           for f in frames):
        return True
    torch_dir, counting = str(Path(torch.__file__).parent), (__file__, "device_checks.py")
    for frame in reversed(frames):
        if frame.filename.endswith(counting):  # the counter's own frames
            continue
        if not frame.filename.startswith(torch_dir):
            return False
        if f"{os.sep}optim{os.sep}" in frame.filename:
            return True
    return False


class _MeterHook(L.Callback):
    def __init__(self, meter: FitMeter, end: str) -> None:
        self.meter, self.end = meter, end

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.end == "first":
            self.meter.step_start(trainer, pl_module, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.end == "last":
            self.meter.step_end(trainer, pl_module, batch)

    def on_train_end(self, trainer, pl_module):
        if self.end == "first" and self.meter._counting is not None:  # no step followed the counted one
            self.meter._stop_counting(pl_module.device)


class ShardReads(logging.Handler):
    """Keeps the log line in which a rank reports the target slices it read (skeleton loading under FSDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "read its target shards" in record.getMessage():
            self.lines.append(record.getMessage())


def _fit_recipe(s: Shapes, work: Path, device: torch.device) -> Path:
    """A random-weight target saved in `work/target` and a recipe for it (written once, shared by the fit checks)."""
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter
    from tests.training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    recipe_file = work / "recipe.yaml"
    if recipe_file.exists():
        return recipe_file
    adapter = get_adapter("llama")
    torch.manual_seed(0)
    config = _target_config(s)
    with device:
        target = LlamaForCausalLM(config).to(torch.bfloat16)
    target.save_pretrained(work / "target")
    adapter.tiny_tokenizer().save_pretrained(work / "target")
    del target
    n_layers = config.num_hidden_layers
    data = write_chat_jsonl(work / "chat.jsonl", n=24, turns=s.fit_turns)
    warmup, timed = s.fit_steps
    steps = warmup + timed + 2  # + the counted step + the last one (it writes the checkpoint)
    recipe = tiny_recipe(work, work / "target", data,
                         target={"dtype": "bfloat16"},
                         drafter={"draft_vocab_size": min(32000, config.vocab_size),
                                  "aux_layer_ids": [2, n_layers // 2, n_layers - 3] if n_layers >= 8 else [1, 2, 3]},
                         data={"max_length": 2048, "val_fraction": 0.0},
                         ttt={"steps": s.steps},
                         # no fc preconditioning: it runs the target over 64 samples before training
                         optim={"precondition_fc": False},
                         # log_every_n_steps: the recipe default, so the counted step is not a logging one
                         trainer={"precision": "bf16-mixed", "max_steps": steps, "checkpoint_every_n_steps": steps,
                                  "val_check_interval": None, "logger": [], "log_every_n_steps": 10})
    return write_recipe(recipe_file, recipe)


def check_fit(s: Shapes, device: torch.device, work: Path, strategy: str) -> None:
    """`fit` as shipped: the recipe file with dotlist overrides, through `eagle3_zoo.training.fit.fit`."""
    import eagle3_zoo.training.fit as fit_module
    from eagle3_zoo.recipe.sections import load_recipe  # needs omegaconf (carried as a wheel: scripts/gpu_check.sh)
    from eagle3_zoo.util.progress import LOG_EVERY_ENV

    recipe_file = _fit_recipe(s, work, device)
    warmup, timed = s.fit_steps
    meter, reads = FitMeter(warmup, timed, PROFILE_DIR and PROFILE_DIR / f"fit_{strategy}_profile.txt"), ShardReads()
    accel = ["trainer.accelerator=gpu"] if device.type == "cuda" else ["trainer.accelerator=cpu"]
    overrides = [*accel, f"trainer.strategy={strategy}", "trainer.devices=1", f"output_dir={work / strategy}"]
    recipe = load_recipe(recipe_file, overrides)
    build_trainer = fit_module.build_trainer
    # a progress line is due every 30 s by default, one step in many on a GPU: none in the counted step, which is
    # then a typical one (as a step that logs is not: log_every_n_steps below)
    interval = os.environ.get(LOG_EVERY_ENV)
    os.environ[LOG_EVERY_ENV] = "3600"

    def with_meters(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        trainer.callbacks.insert(0, meter.first)
        trainer.callbacks.append(meter.last)
        return trainer

    fit_module.build_trainer = with_meters
    package_logger = logging.getLogger("eagle3_zoo")
    level = package_logger.level
    package_logger.addHandler(reads)
    package_logger.setLevel(logging.INFO)
    try:
        with _peak(device) as peak:
            drafter_dir = fit_module.fit(recipe, source=str(recipe_file))
    finally:
        fit_module.build_trainer = build_trainer
        if interval is None:
            del os.environ[LOG_EVERY_ENV]
        else:
            os.environ[LOG_EVERY_ENV] = interval
        package_logger.removeHandler(reads)
        package_logger.setLevel(level)
    steps = meter.steps[warmup:]
    seconds, tokens = (sum(col) for col in zip(*steps)) if steps else (float("nan"), 0)
    first = meter.steps[0][0] if meter.steps else float("nan")
    ok = len(steps) == timed and meter.count is not None and (drafter_dir / "model.safetensors").is_file()
    ours = f"{tokens / seconds:,.0f} tok/s, {peak['mem']}, {tokens / max(len(steps), 1):.0f} tok/step"
    if strategy == "fsdp":
        last = work / strategy / "checkpoints" / "last.ckpt"
        sharded = last.is_dir() and (last / ".metadata").is_file()
        ok = ok and sharded and bool(reads.lines)
        ref = "skeleton: " + (reads.lines[0].split(": ", 1)[-1] if reads.lines else "NOT read shard by shard")
        agree = f"sharded checkpoint {'written' if sharded else 'MISSING'} ({last.name}); syncs in a step {meter.count}"
    else:
        ok = ok and meter.count <= SYNC_BUDGET
        ref = f"syncs in a whole fit step: {meter.count} (budget {SYNC_BUDGET})"
        agree = "; ".join(meter.where[:SYNC_BUDGET + 2]) if meter.count else "-"
    target = "1B-shaped" if device.type == "cuda" else "tiny"
    row(f"fit bf16-mixed {strategy}, {target} target, {len(steps)} timed steps", ours, ref, agree, f"{first:.1f}", ok,
        tokens_per_s=tokens / seconds, peak_gib=peak["gib"], step_seconds=[round(t, 4) for t, _ in meter.steps],
        syncs=meter.count, sync_events=meter.where)
    if meter.count and meter.count > SYNC_BUDGET:
        print("  syncs: " + "\n  syncs: ".join(meter.where), flush=True)


# ------------------------------------------------------------------------------------------------------ main
def _checks(s: Shapes, device: torch.device, work: Path) -> list[tuple[str, Callable[[], None]]]:
    """(key, check) in the order they run: decoding before the fits (a hang in NCCL or FSDP must not lose it)."""
    long_t, odd_t = s.seq_lens[1], s.seq_lens[2]
    checks = [(f"TTT train step T={s.seq_lens[0]}", lambda: check_ttt_step(s, s.seq_lens[0], device, True)),
              (f"TTT train step T={long_t}", lambda: check_ttt_step(s, long_t, device, False)),
              (f"TTT train step T={odd_t}", lambda: check_ttt_step(s, odd_t, device, True))]
    for t in s.attn_seq_lens:
        for amp in (torch.float32, torch.bfloat16):
            name = str(amp).removeprefix("torch.")
            checks.append((f"TTT attention {name} T={t}", lambda t=t, amp=amp: check_attention(s, t, device, amp)))
    checks += [("speculative decoding", lambda: check_decode(s, device)),
               ("fit auto", lambda: check_fit(s, device, work, "auto")),
               ("fit fsdp", lambda: check_fit(s, device, work, "fsdp"))]
    return checks


def plan(keys: list[str]) -> str:
    """The planned time of a GPU run on one H200, start included (raises if it does not fit in LIMIT_S)."""
    missing = [k for k in keys if k not in ESTIMATE_S]
    if missing:
        raise KeyError(f"no H200 estimate for {missing}: add them to ESTIMATE_S")
    total = START_S + sum(ESTIMATE_S[k] for k in keys)
    if total > LIMIT_S:
        raise ValueError(f"planned {total} s on one H200 is over the {LIMIT_S} s limit")
    return (f"planned on one H200: start {START_S} s + checks {total - START_S} s = {total} s "
            f"(limit {LIMIT_S} s); per check: " + ", ".join(f"{k} {ESTIMATE_S[k]} s" for k in keys))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the test suite runs this)")
    p.add_argument("--jsonl", type=Path, default=None,
                   help="JSON-lines file of the rows, written as each is measured (default: "
                        "runs/gpu_check-<time>.jsonl)")
    p.add_argument("--profile-fit", type=Path, default=None, metavar="DIR",
                   help="profile the fit checks' last (untimed) step: DIR/fit_<strategy>_profile.txt, top rows printed")
    args = p.parse_args()
    global PROFILE_DIR
    PROFILE_DIR = args.profile_fit
    if args.cpu_smoke:
        device, s = torch.device("cpu"), CPU_SMOKE
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device; on a CPU run `scripts/gpu_check.sh --cpu-smoke`", file=sys.stderr)
            return 2
        device, s = torch.device("cuda"), GPU
    start = time.perf_counter()
    global JOURNAL
    JOURNAL = Journal(args.jsonl or REPO / "runs" / time.strftime("gpu_check-%Y%m%d-%H%M%S.jsonl"))
    with tempfile.TemporaryDirectory() as work:
        checks = _checks(s, device, Path(work))
        planned = [key for key, _ in _checks(GPU, device, Path(work))]  # the GPU run's checks, in the same order
        print(plan(planned), flush=True)  # before the slow imports: it shows at once
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", message=".*(deprecated|requires_grad=True to a scalar|litlogger).*")

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"gpu_check {time.strftime('%Y-%m-%d')}: {name}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, lightning {L.__version__}; drafter hidden {s.hidden}, "
              f"{s.heads}/{s.kv_heads} heads, intermediate {s.intermediate}, draft vocab {s.draft_vocab}, vocab "
              f"{s.vocab}, K={s.steps}; rows also in {JOURNAL.path}", flush=True)
        JOURNAL.write({"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
                       "lightning": L.__version__, "shapes": "cpu-smoke" if args.cpu_smoke else "gpu",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "planned_s_h200": START_S + sum(ESTIMATE_S[key] for key in planned)})
        _line(HEADER)
        print("|" + "|".join("-" * (w + 2) for w in WIDTHS) + "|", flush=True)
        failed = []
        for (key, check), gpu_key in zip(checks, planned):
            JOURNAL.check, JOURNAL.started, JOURNAL.estimate = key, time.perf_counter(), ESTIMATE_S[gpu_key]
            if device.type == "cuda":  # a hung check stops the run with every thread's stack, not the device time
                faulthandler.dump_traceback_later(max(HANG_FACTOR * JOURNAL.estimate, HANG_MIN_S), exit=True)
            try:
                check()
            except Exception as e:  # a failing check reports and the others still run
                failed.append(key)
                row(key, f"ERROR {type(e).__name__}", "-", str(e).splitlines()[0][:200] if str(e) else "-", "-",
                    False, error=traceback.format_exc()[-2000:])
                print("  " + "  ".join(traceback.format_exc().splitlines(True)[-6:]), end="", flush=True)
            finally:
                faulthandler.cancel_dump_traceback_later()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    from torch._dynamo.utils import counters

    total = time.perf_counter() - start
    print(f"\ncompiled graphs: {counters['stats'].get('unique_graphs', 0)}; warm-up (compile) {sum(WARMUPS):.0f} s "
          f"of total {total:.0f} s{'; errors in: ' + ', '.join(failed) if failed else ''}", flush=True)
    JOURNAL.check, JOURNAL.started = "", start
    JOURNAL.write({"done": True, "ok": bool(RESULTS) and all(RESULTS), "seconds": round(total, 1), "errors": failed})
    return 0 if RESULTS and all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
