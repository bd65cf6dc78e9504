"""The CUDA paths of the training step, checked on a CPU: the host-device sync budget of one training step (a
dispatch-mode count), RoPE frequencies that move with the drafter, the FlexAttention block mask built once per
shape and compiled without a recompile per sequence length (dynamo with a CPU backend), `init_head: target` with
the target on a (fake) CUDA device, and fp16 (16-mixed) gradients of the fused soft cross-entropy at a realistic
size."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from eagle3_zoo.drafters.eagle3.ttt import fused_soft_cross_entropy
from eagle3_zoo.modeling import Eagle3Drafter
from eagle3_zoo.modeling.attention import _ttt_block_mask, ttt_attention, ttt_attention_reference
from tests.device_checks import DeviceMoves, MixedDevices, SyncCounter, counting_host_reads
from tests.tiny import tiny_drafter


class _CountSteps(L.Callback):
    """A `SyncCounter` around each training step, from the first callback's `on_train_batch_start` (the batch is on
    the device) through backward, the optimizer step, every callback's `on_train_batch_end` (progress bars,
    checkpoints) and Lightning's logging at the batch's end (`close_after` its logger connector): put it first in
    `trainer.callbacks`."""

    def __init__(self) -> None:
        self.steps: list[SyncCounter] = []
        self.counter: SyncCounter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # Adam's step counters live on the host on a GPU too (torch keeps them there unless capturable or fused)
        self.counter = SyncCounter(host_tensors=[state["step"] for optimizer in trainer.optimizers
                                                 for state in optimizer.state.values() if "step" in state])
        self.reads = counting_host_reads(self.counter)
        self.reads.__enter__()
        self.counter.__enter__()

    def close(self) -> None:
        if self.counter is None:  # a validation batch's end: no training step open
            return
        self.counter.__exit__(None, None, None)
        self.reads.__exit__(None, None, None)
        self.steps.append(self.counter)
        self.counter = None

    def close_after(self, trainer) -> None:
        """Close each step after Lightning's `_LoggerConnector.on_batch_end`, the last thing a training batch does
        (it turns the step's `prog_bar` metrics into Python numbers: a wait each on a GPU)."""
        connector = trainer._logger_connector
        inner = connector.on_batch_end

        def on_batch_end(*args, **kwargs):
            inner(*args, **kwargs)
            self.close()

        connector.on_batch_end = on_batch_end


def _fit_step_events(tmp_path, monkeypatch, bar: bool) -> list[list[tuple[str, str]]]:
    """The host waits of each training step of a real `fit` (the recipe's Trainer with every callback `fit` installs:
    TTT schedule, checkpoints, progress lines or the live bar, run record, identity, interrupt watch), on the tiny
    online recipe with 3 TTT steps; the steps between the first (Lightning builds its logging state, the first
    progress line) and the last (the last progress line, the final checkpoint)."""
    from training_fixtures import tiny_run_files

    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training import fit as fit_module

    monkeypatch.setenv("EAGLE3_ZOO_LOG_EVERY_S", "3600")  # progress lines only at the first and the last step
    monkeypatch.setattr(fit_module, "use_bar", lambda: bar)
    counts = _CountSteps()
    build = fit_module.build_trainer

    def build_trainer(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.callbacks.insert(0, counts)
        counts.close_after(trainer)
        return trainer

    monkeypatch.setattr(fit_module, "build_trainer", build_trainer)
    recipe = tiny_run_files(tmp_path, n=16, trainer={"max_steps": 5, "log_every_n_steps": 50,
                                                     "checkpoint_every_n_steps": 50, "val_check_interval": None})
    fit_module.fit(load_recipe(recipe))
    assert len(counts.steps) == 5
    return [step.events for step in counts.steps[1:-1]]


@pytest.mark.filterwarnings("ignore:The number of training batches")  # log_every_n_steps past the run on purpose
@pytest.mark.parametrize("bar", [False, True], ids=["log-lines", "bar"])
def test_a_fit_step_waits_for_the_device_once(tmp_path, monkeypatch, bar):
    """A whole training step of `fit`, callbacks included, waits for the device once: the read of the loss's
    supervised-row counts, which also brings the previous step's non-finite flag and the bar's metrics. Before: 6
    waits with log lines (the TTT schedule's logged float copied to the device, the tokens of the device batch
    counted for the progress line, transformers' packed-sequence check, the target rows found by `nonzero`, the
    loss's counts, the non-finite check), 9 with the bar (it counted the tokens too and read the loss and acc_0 at
    every refresh). (Earlier still, 16 of ours with 3 TTT steps in the loss alone.)"""
    for events in _fit_step_events(tmp_path, monkeypatch, bar):
        assert [(kind, where.split(" ")[-1]) for kind, where in events] == [("to host", "(read_counts)")], events


def test_a_validation_batch_waits_for_the_device_once():
    """The loss's counts are the one wait of a validation batch: the per-step metrics add on the device and are read
    once per epoch. Before: 30 more with 3 TTT steps, 10 per step (a `float()` of its count, then for its loss,
    accuracy and alpha a host tensor of the weight and torchmetrics' two NaN checks)."""
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter
    from eagle3_zoo.data.datamodule import collate_right_padded
    from eagle3_zoo.modeling import Eagle3Config, build_draft_vocab
    from eagle3_zoo.training.module import DrafterModule, with_host_counts

    adapter = get_adapter("llama")
    target = LlamaForCausalLM(adapter.tiny_config()).eval().requires_grad_(False)
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(*build_draft_vocab(torch.arange(512) % 7, 64))
    module = DrafterModule(drafter, adapter, target, ttt_steps=3)
    g = torch.Generator().manual_seed(1)
    batches = [with_host_counts(collate_right_padded([{"input_ids": torch.randint(512, (n,), generator=g),
                                                        "loss_mask": torch.ones(n, dtype=torch.long)} for n in sizes]))
               for sizes in ((12, 9), (20, 17))]
    for i, batch in enumerate(batches):
        with SyncCounter() as counter, counting_host_reads(counter):
            module.validation_step(batch, i)
        assert [(kind, where.split(" ")[-1]) for kind, where in counter.events] == [("to host", "(read_counts)")], \
            counter.events
    metrics = module.val_metrics.compute("val")
    assert {f"val/{name}_{k}" for name in ("loss", "acc", "alpha") for k in range(3)} | {"val/tau_est"} == set(metrics)


def test_rope_frequencies_move_with_the_drafter_stay_fp32_and_are_not_saved(tmp_path):
    # on the meta device (a stand-in for a GPU) RoPE and the projections copy nothing from the host
    drafter, _ = tiny_drafter()
    cfg = drafter.config
    drafter.to("meta")
    embeds = torch.randn(1, 10, cfg.hidden_size, device="meta")
    hidden = drafter.fuse(torch.randn(1, 10, 3 * cfg.target_hidden_size, device="meta"))
    with DeviceMoves() as moves:
        x = drafter.midlayer.attn_input(embeds, hidden)
        cos, sin = drafter._rope(x, torch.arange(10, device="meta")[None] + 2)
        q, k, v = drafter.midlayer.self_attn.project(x, cos, sin)
    assert moves.moves == [] and {t.device.type for t in (cos, sin, q, k, v)} == {"meta"}
    # the frequencies are a buffer that stays fp32 under any cast and is not part of the checkpoint
    drafter, _ = tiny_drafter()
    freqs = drafter.rotary_emb.inv_freq.clone()
    keys = set(drafter.state_dict())
    assert not any("rotary" in k for k in keys)
    drafter.to(torch.bfloat16)
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(drafter.rotary_emb.inv_freq, freqs)
    drafter.save_pretrained(tmp_path)
    assert set(Eagle3Drafter.from_pretrained(tmp_path).state_dict()) == keys
    drafter.to_empty(device="cpu")  # uninitialised memory everywhere else; the frequencies are put back
    assert torch.equal(drafter.rotary_emb.inv_freq, freqs)


def _qkv(t: int, steps: int, grad: bool = True, batch: int = 1):
    g = torch.Generator().manual_seed(t)

    def rand(heads):
        return torch.randn(batch, heads, t, 8, generator=g).requires_grad_(grad)

    return rand(4), [rand(2) for _ in range(steps)], [rand(2) for _ in range(steps)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_is_built_once_per_shape():
    q, ks, vs = _qkv(150, 3, grad=False)  # eager FlexAttention on a CPU: dense math, forward only
    torch.testing.assert_close(ttt_attention(q, ks, vs, backend="flex"), ttt_attention_reference(q, ks, vs),
                               atol=1e-5, rtol=1e-4)  # (150 -> one padded 256-key segment per step)
    with SyncCounter() as counter:
        again = _ttt_block_mask(256, 2, q.device)  # what the call above built
    assert counter.events == []  # not rebuilt: no `torch.tensor(seg_len, device=...)`, no launches at all
    assert again is _ttt_block_mask(256, 2, q.device) and again is not _ttt_block_mask(256, 1, q.device)


def test_flex_graphs_leave_headroom_below_the_recompile_limit_for_every_batch_shape(monkeypatch):
    """The CUDA path's compiled FlexAttention (`_compiled_flex`, built with its own compile options, a CPU dynamo
    backend swapped in; forward only: no CPU backward) over what the length-bucketed sampler gives: long batches,
    then short ones (<= 128 tokens: one FlexAttention block), lengths that are not multiples of 128, 1-3 TTT steps,
    and a last batch of one sequence. No new graph for the short batches, and room for 2 more graphs below dynamo's
    recompile limit (past it, FlexAttention would fall back to dense eager attention). Before: the short batches
    added 2 graphs (a batch of one block specialised the block count to 1) and the whole sequence made 8, the limit
    (4 now)."""
    import torch._dynamo
    import torch.nn.attention.flex_attention as flex
    from torch._dynamo.testing import CompileCounterWithBackend

    from eagle3_zoo.modeling import attention

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": counter}))
    attention._compiled_flex.cache_clear()
    try:
        compiled = attention._compiled_flex()
    finally:
        attention._compiled_flex.cache_clear()  # the next CUDA caller compiles with the real backend
    monkeypatch.setattr(flex, "flex_attention", compiled)  # what the CPU path calls
    graphs = []
    long, short, last = [(2, t) for t in (411, 520, 130, 300)], [(2, t) for t in (128, 37, 100, 5)], [(1, 90), (1, 200)]
    for b, t in long + short + last:
        for steps in (1, 2, 3):
            q, ks, vs = _qkv(t, steps, grad=False, batch=b)
            out = ttt_attention(q, ks, vs, backend="flex")
        torch.testing.assert_close(out, ttt_attention_reference(q, ks, vs), atol=1e-5, rtol=1e-4)
        graphs.append(counter.frame_count)
    torch._dynamo.reset()
    assert graphs[len(long) - 1] == graphs[len(long) + len(short) - 1], graphs  # short after long: no new graph
    # room for 2 more below dynamo's limit (8), which the compiled FlexAttention raises for itself besides
    assert graphs[-1] + 2 <= torch._dynamo.config.recompile_limit, graphs


def test_compiled_flex_has_its_own_recompile_limit(monkeypatch):
    """Under a process-wide recompile limit of 1 the compiled FlexAttention still compiles the second graph a batch
    of one sequence needs (dynamo specialises size 1) instead of falling back to its dense eager implementation
    (which warns): its own limit is `FLEX_GRAPHS`. The process's limit stays as it was."""
    import warnings

    import torch._dynamo
    import torch.nn.attention.flex_attention as flex

    from eagle3_zoo.modeling import attention

    torch._dynamo.reset()
    # the config's own patch, not monkeypatch: setattr-ing the old value back leaves the name hidden in torch 2.13
    # (dynamo's alias of torch.compiler.config), which breaks every later eager FlexAttention call
    with torch._dynamo.config.patch(recompile_limit=1):
        compile_ = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
        attention._compiled_flex.cache_clear()
        try:
            monkeypatch.setattr(flex, "flex_attention", attention._compiled_flex())
        finally:
            attention._compiled_flex.cache_clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for batch in (2, 1):
                q, ks, vs = _qkv(300, 2, grad=False, batch=batch)
                torch.testing.assert_close(ttt_attention(q, ks, vs, backend="flex"), ttt_attention_reference(q, ks, vs),
                                           atol=1e-5, rtol=1e-4)
        torch._dynamo.reset()
        assert not [w for w in seen if "without torch.compile" in str(w.message)]
        assert torch._dynamo.config.recompile_limit == 1


def test_init_head_from_target_on_a_cuda_target():
    """The target's lm_head on a (fake) CUDA device, the fresh drafter on the CPU: no op may mix the two."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    drafter, _ = tiny_drafter()
    cfg = drafter.config
    with FakeTensorMode(allow_non_fake_inputs=True), MixedDevices():
        weight = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        norm = torch.ones(cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        drafter.init_head_from_target(weight, norm)
    # the same call on real CPU tensors picks the draft vocabulary's rows
    weight, norm = torch.randn(cfg.vocab_size, cfg.hidden_size), torch.rand(cfg.hidden_size)
    drafter.init_head_from_target(weight, norm)
    rows = torch.arange(cfg.draft_vocab_size) + drafter.d2t
    assert torch.equal(drafter.lm_head.weight, weight[rows]) and torch.equal(drafter.norm.weight, norm)


def _fused_grads(n: int, vocab: int, hidden: int, amp: torch.dtype | None):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
    probs = torch.softmax(torch.randn(n, vocab, generator=g) * 3, -1)
    steps = 7  # the rows of 7 TTT steps, weighted w_k / n_k as `ttt_loss` weights them
    row_weights = torch.cat([torch.full((n // steps + (k < n % steps),), 0.8**k / (n // steps)) for k in range(steps)])
    with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
        fused_soft_cross_entropy(h, w, probs, row_weights=row_weights).loss.backward()
    return h.grad, w.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n, vocab", [(2048, 32000)])
def test_fp16_fused_cross_entropy_gradients_match_fp32(n, vocab):
    """16-mixed: the row weights (~4e-4 here) applied before the fp16 cast flushed most of the logits gradient
    (~1/vocab per entry) to zero (5.6% relative error of the hidden gradient at this size); applied after, fp16
    rounding is all that is left (3.5e-4). bf16 (same range as fp32, 2.9e-3) is checked alongside."""
    ref = _fused_grads(n, vocab, 64, None)
    for amp, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        grads = _fused_grads(n, vocab, 64, amp)
        errors = [_rel(a, b) for a, b in zip(grads, ref)]
        assert max(errors) < tol, (amp, errors)
