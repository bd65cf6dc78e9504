"""One-shot GPU check of training and decoding: speed, memory and correctness, one table row at a time. No downloads:
every model is built in code with random weights. Each row is printed as soon as it is measured; a check that fails
prints its error and the others still run; warm-up (compile) time is its own column.

1. TTT train step (forward + backward, bf16 autocast as `bf16-mixed`) of the Llama-3.1-8B drafter shape (hidden
   4096, 32 / 8 heads, intermediate 14336, draft vocab 32000, vocab 128256, K=7), eagle3-zoo (`ttt_loss`) against
   the naive formulation (full causal scores plus one column per earlier step, lm_head and log-softmax over every
   position; `training.reference`), both bf16 on the same weights and batch: tokens/s and peak memory. The loss and
   every gradient are compared with the naive formulation in fp32 with autocast off (T=2048, and T=2000, which is
   not a multiple of FlexAttention's 128-block: the padding path); at T=8192 with the bf16 naive one (if it fits).
2. The device's TTT attention backend (`ttt_backend`: FlexAttention on CUDA) against `ttt_attention_reference`:
   largest error of the output and of every gradient, fp32 and bf16 autocast, at T=2048 and T=1000 (padding).
3. `fit` as shipped (recipe file, dotlist overrides, `eagle3_zoo.training.fit.fit`), a few bf16-mixed steps on a
   random-weight Llama-3.2-1B-shaped target online: strategy auto (with the host-device syncs of one step counted:
   `torch.cuda.set_sync_debug_mode`), then `trainer.strategy=fsdp trainer.devices=1` (FSDP2 on a one-rank NCCL mesh,
   the target loaded as a skeleton and filled shard by shard, a sharded checkpoint written): tokens/s, peak memory.
4. Lossless greedy speculative decoding (EAGLE-2 tree and chain) with a random drafter on the random target (fp32)
   against plain greedy decoding: the same tokens, tokens/s of each, tau.

    bash scripts/gpu_check.sh               # one CUDA GPU (H200: ~5 min; no omegaconf there: see gpu_check.sh)
    bash scripts/gpu_check.sh --cpu-smoke   # the same code on tiny shapes on a CPU (part of the test suite)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
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

from bench_train import StepTimer  # noqa: E402

from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab  # noqa: E402
from eagle3_zoo.modeling.attention import ttt_attention, ttt_attention_reference, ttt_backend  # noqa: E402
from eagle3_zoo.training.loss import ttt_loss  # noqa: E402
from eagle3_zoo.training.reference import reference_ttt_loss  # noqa: E402

# agreement bounds (relative: ||a - b|| / ||b||); bf16 keeps 8 mantissa bits (unit roundoff 4e-3)
STEP_TOL = {"loss": 1e-2, "grad": 5e-2}  # bf16 eagle3-zoo vs the naive formulation (fp32, or bf16 at 8192)
ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # one attention call vs the fp32 reference
# host-device syncs of one training step: eagle3-zoo's 3 (tests/test_gpu_paths.py pins them on a CPU) + at most 2 in
# transformers' mask creation for the target forward (1 in transformers 5.24)
SYNC_BUDGET = 5


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
    fit_target: dict  # LlamaConfig kwargs of the online target
    fit_turns: int
    fit_steps: tuple[int, int]  # warm-up, timed
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
                   fit_turns=1, fit_steps=(1, 1), new_tokens=12)
HEADER = ("check", "eagle3-zoo", "reference", "agreement", "warm-up s", "ok")
WIDTHS = (44, 34, 34, 44, 9, 4)
RESULTS: list[bool] = []
WARMUPS: list[float] = []  # warm-up seconds of each row (compilation included)
_DRAFTERS: dict = {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _peak(device: torch.device) -> Iterator[dict]:
    """`{"mem": "<peak above the start> GiB"}` once the block ends (CUDA; "n/a" on a CPU)."""
    out = {"mem": "n/a (CPU)"}
    base = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    yield out
    if device.type == "cuda":
        out["mem"] = f"{(torch.cuda.max_memory_allocated(device) - base) / 2**30:.1f} GiB"


def _line(cells) -> None:
    print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, WIDTHS)) + " |", flush=True)


def row(*cells) -> None:
    """Print one table row now: the cells of HEADER, the last one whether the check passed."""
    *text, ok = cells
    RESULTS.append(bool(ok))
    with contextlib.suppress(ValueError):
        WARMUPS.append(float(text[4]))
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
    """Warm-up call (compiles on CUDA), then `iters` timed calls: seconds, peak memory, loss and grads."""
    times = []
    for i in range(1 + iters):
        for p in params:
            p.grad = None
        _sync(device)
        start = time.perf_counter()
        with _peak(device) as peak, torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = fn()
        loss.backward()
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"warmup": times[0], "seconds": min(times[1:] or times), "mem": peak["mem"], "loss": loss.detach(),
            "grads": [p.grad.detach().clone() for p in params]}


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
    if ref is None:
        agree, ok = "not compared (naive out of memory)", True
    else:
        loss_err = _rel(mine["loss"], ref["loss"])
        grad_err = max(_rel(a, b) for a, b in zip(mine["grads"], ref["grads"]))
        agree = f"vs {what}: loss {loss_err:.1e}, grads {grad_err:.1e}"
        ok = loss_err < STEP_TOL["loss"] and grad_err < STEP_TOL["grad"]
    pad = "" if t % 128 == 0 else " (padded)"
    row(f"TTT train step bf16, T={t}{pad}", f"{t / mine['seconds']:,.0f} tok/s, {mine['mem']}", naive_cell, agree,
        f"{mine['warmup']:.1f}", ok)


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
        f"{times[0]:.1f}", max(fwd_rel, grad_rel) < ATTN_TOL[amp])


# ----------------------------------------------------------------------------------------------------- 3. fit
class SyncCount(L.Callback):
    """Host-device syncs of the last timed training step (after the batch is on the device, through backward): CUDA
    reports each one (`set_sync_debug_mode`); on a CPU the ops that would sync are counted (tests/device_checks)."""

    def __init__(self, step: int) -> None:
        self.step, self.count, self.where = step, None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        self._warnings = warnings.catch_warnings(record=True)
        self._seen = self._warnings.__enter__()
        warnings.simplefilter("always")
        if pl_module.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        else:
            from tests.device_checks import SyncCounter, counting_host_reads

            self._counter = SyncCounter()
            self._reads = counting_host_reads(self._counter)
            self._reads.__enter__()
            self._counter.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != self.step or self.count is not None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            events = [f"sync at {Path(w.filename).name}:{w.lineno}" for w in self._seen
                      if "synchroniz" in str(w.message)]
        else:
            self._counter.__exit__(None, None, None)
            self._reads.__exit__(None, None, None)
            events = [f"{kind} at {where.split(' ')[0].rsplit('/', 1)[-1]}" for kind, where in self._counter.events]
        self._warnings.__exit__(None, None, None)
        self.count, self.where = len(events), events


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
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter
    from tests.training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    recipe_file = work / "recipe.yaml"
    if recipe_file.exists():
        return recipe_file
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
                         # no fc preconditioning: it runs the target over 64 samples before training
                         optim={"precondition_fc": False},
                         trainer={"precision": "bf16-mixed", "max_steps": warmup + timed,
                                  "checkpoint_every_n_steps": warmup + timed, "val_check_interval": None,
                                  "logger": []})
    return write_recipe(recipe_file, recipe)


def check_fit(s: Shapes, device: torch.device, work: Path, strategy: str) -> None:
    """`fit` as shipped: the recipe file with dotlist overrides, through `eagle3_zoo.training.fit.fit`."""
    import eagle3_zoo.training.fit as fit_module
    from eagle3_zoo.recipe import load_recipe  # needs omegaconf (carried as a wheel: scripts/gpu_check.sh)

    recipe_file = _fit_recipe(s, work, device)
    warmup, timed = s.fit_steps
    timer, syncs, reads = StepTimer(), SyncCount(step=warmup + timed - 1), ShardReads()
    accel = ["trainer.accelerator=gpu"] if device.type == "cuda" else ["trainer.accelerator=cpu"]
    overrides = [*accel, f"trainer.strategy={strategy}", "trainer.devices=1", f"output_dir={work / strategy}"]
    recipe = load_recipe(recipe_file, overrides)
    build_trainer = fit_module.build_trainer

    def with_meters(recipe, callbacks=(), *args, **kwargs):
        return build_trainer(recipe, [*callbacks, timer, syncs], *args, **kwargs)

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
        package_logger.removeHandler(reads)
        package_logger.setLevel(level)
    steps = timer.steps[warmup:]
    seconds, tokens, _ = (sum(col) for col in zip(*steps))
    first = timer.steps[0][0] if timer.steps else float("nan")
    ok = len(steps) == timed and (drafter_dir / "model.safetensors").is_file()
    ours = f"{tokens / seconds:,.0f} tok/s, {peak['mem']}, {tokens / len(steps):.0f} tok/step"
    if strategy == "fsdp":
        last = work / strategy / "checkpoints" / "last.ckpt"
        sharded = last.is_dir() and (last / ".metadata").is_file()
        ok = ok and sharded and bool(reads.lines)
        ref = "skeleton: " + (reads.lines[0].split(": ", 1)[-1] if reads.lines else "NOT read shard by shard")
        agree = f"sharded checkpoint {'written' if sharded else 'MISSING'} ({last.name})"
    else:
        ok = ok and syncs.count is not None and syncs.count <= SYNC_BUDGET
        ref = f"syncs in one step: {syncs.count} (budget {SYNC_BUDGET})"
        agree = "; ".join(syncs.where[:SYNC_BUDGET + 2]) if syncs.count else "-"
    target = "1B-shaped" if device.type == "cuda" else "tiny"
    row(f"fit bf16-mixed {strategy}, {target} target, {len(steps)} timed steps", ours, ref, agree, f"{first:.1f}", ok)
    if syncs.count and syncs.count > SYNC_BUDGET:
        print("  syncs: " + "\n  syncs: ".join(syncs.where), flush=True)


# --------------------------------------------------------------------------------------------------- 4. decode
def check_decode(s: Shapes, device: torch.device, work: Path) -> None:
    """Greedy speculative decoding (tree, chain) with a random drafter equals plain greedy decoding, token for
    token, on the random target in fp32 (bf16 near-ties could flip an argmax between two kernels)."""
    from transformers import AutoModelForCausalLM

    from eagle3_zoo.speculative.generate import SpeculativeGenerator, plain_generate, tree_spec

    _fit_recipe(s, work, device)
    target = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.float32).to(device).eval()
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=min(32000, target.config.vocab_size),
                                          aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).to(device).eval()
    prompt = torch.randint(0, target.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(3))
    with _peak(device) as peak:
        plain_generate(target, prompt, 4, eos_token_id=[])  # warm-up
        plain = plain_generate(target, prompt, s.new_tokens, eos_token_id=[])
        results = {}
        for mode in ("tree", "chain"):
            gen = SpeculativeGenerator(target, drafter, tree_spec(mode, depth=6 if mode == "chain" else 8))
            gen.generate(prompt, 4, eos_token_id=[])  # warm-up
            results[mode] = gen.generate(prompt, s.new_tokens, eos_token_id=[])
    same = {m: r.tokens == plain.tokens for m, r in results.items()}
    ours = ", ".join(f"{m} {len(r.tokens) / r.seconds:,.0f} tok/s tau {r.tau:.2f}" for m, r in results.items())
    row(f"greedy speculative decoding, {s.new_tokens} tokens, fp32", f"{ours}, {peak['mem']}",
        f"plain greedy {len(plain.tokens) / plain.seconds:,.0f} tok/s",
        "lossless: " + ", ".join(f"{m} {'same tokens' if v else 'DIFFERENT tokens'}" for m, v in same.items()),
        "-", all(same.values()))


# ------------------------------------------------------------------------------------------------------ main
def _checks(s: Shapes, device: torch.device, work: Path) -> list[tuple[str, Callable[[], None]]]:
    long_t, odd_t = s.seq_lens[1], s.seq_lens[2]
    checks = [(f"TTT train step T={s.seq_lens[0]}", lambda: check_ttt_step(s, s.seq_lens[0], device, True)),
              (f"TTT train step T={long_t}", lambda: check_ttt_step(s, long_t, device, False)),
              (f"TTT train step T={odd_t}", lambda: check_ttt_step(s, odd_t, device, True))]
    for t in s.attn_seq_lens:
        for amp in (torch.float32, torch.bfloat16):
            checks.append((f"TTT attention {amp} T={t}", lambda t=t, amp=amp: check_attention(s, t, device, amp)))
    checks += [("fit auto", lambda: check_fit(s, device, work, "auto")),
               ("fit fsdp", lambda: check_fit(s, device, work, "fsdp")),
               ("speculative decoding", lambda: check_decode(s, device, work))]
    return checks


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
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*(deprecated|requires_grad=True to a scalar|litlogger).*")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check {time.strftime('%Y-%m-%d')}: {name}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, lightning {L.__version__}; drafter hidden {s.hidden}, {s.heads}/{s.kv_heads} "
          f"heads, intermediate {s.intermediate}, draft vocab {s.draft_vocab}, vocab {s.vocab}, K={s.steps}",
          flush=True)
    _line(HEADER)
    print("|" + "|".join("-" * (w + 2) for w in WIDTHS) + "|", flush=True)
    failed = []
    with tempfile.TemporaryDirectory() as work:
        for title, check in _checks(s, device, Path(work)):
            try:
                check()
            except Exception as e:  # a failing check reports and the others still run
                failed.append(title)
                row(title, f"ERROR {type(e).__name__}", "-", str(e).splitlines()[0][:200] if str(e) else "-", "-",
                    False)
                print("  " + "  ".join(traceback.format_exc().splitlines(True)[-6:]), end="", flush=True)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    from torch._dynamo.utils import counters

    print(f"\ncompiled graphs: {counters['stats'].get('unique_graphs', 0)}; warm-up (compile) {sum(WARMUPS):.0f} s "
          f"of total {time.perf_counter() - start:.0f} s"
          f"{'; errors in: ' + ', '.join(failed) if failed else ''}", flush=True)
    return 0 if RESULTS and all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
