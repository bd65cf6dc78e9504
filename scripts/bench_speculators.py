#!/usr/bin/env python
"""eagle3-zoo's TTT train step side by side with vLLM speculators' Eagle3 training step, on the same weights and
batch, in one process (CPU, fp32).

speculators is not a dependency of eagle3-zoo: run this with a Python that has both, e.g. a venv with this
project's torch, `pip install --no-deps speculators==0.9.0` and what its `speculators.models.eagle3` import needs
(pydantic, pydantic-settings, loguru, transformers <= 5.19, openai, datasets, hs-connectors), with this checkout on
PYTHONPATH. Without speculators it exits 2 and says so.

    PYTHONPATH=$PWD /work/venvs/spec/bin/python scripts/bench_speculators.py              # the 2 x 2 grid below
    PYTHONPATH=$PWD /work/venvs/spec/bin/python scripts/bench_speculators.py --seq-lens 256 --steps 3 --iters 1

Both sides get one sequence of T tokens: token ids, the target's aux hidden states, its last hidden state and the
draft-vocabulary rows of its lm_head (what speculators' trainer reads), and a loss mask (prompt first, then the
supervised answer). speculators: `Eagle3DraftModel.forward` on the batch after its own `shift_batch` (the
trainer's collate: position ids from 1, one document), with `ttt_steps=K`, `ttt_step_loss_decay=0.8`, the eager
KL loss (its fused losses need Triton) and `--draft-attn-impl sdpa` (its default, `simple_flex_attention`, has no
backward on a CPU; `--peer-attn eager` picks its other choice), then `loss.backward()`. eagle3-zoo: the target
logits from the same head, then `ttt_loss(..., with_alpha=False)` (a step whose metrics no logger records) and
`backward()`.

Differences in the two projects' defaults, and what is done about them:
- speculators freezes the draft lm_head (`load_verifier_weights`); eagle3-zoo trains it. Here both train it
  (`--frozen-lm-head` freezes it on both sides).
- speculators' mask for the target at position j is j's own loss mask; eagle3-zoo's is that of the token the
  target predicts (j + 1). speculators gets eagle3-zoo's mask shifted by one, so both supervise the same rows.
- speculators trains against the target's draft-vocabulary logits with no check of the full-vocabulary argmax;
  eagle3-zoo gets those logits with `target_valid` unset (every position usable), so both use the same rows.
- Its loss is the KL divergence, ours the soft cross-entropy: they differ by the target's entropy (no gradient),
  which is added to speculators' loss before comparing.
- RoPE positions start at 1 there and 0 here (attention depends on position differences only).
Before anything is timed, the loss and every trained parameter's gradient are compared at each (T, K); the script
stops if they differ by more than `bench_ttt.TOLERANCE` (relative, fp32).

Steps are timed alternately (ours, theirs, ours, ...) per (T, K); the ratio uses the fastest step of each. Peak
memory is the peak RSS growth during one step in a fresh interpreter that first builds the same batch (as
`scripts/bench_ttt.py` measures it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from eagle3_zoo.drafters.eagle3.ttt import step_masks, ttt_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ttt import _status_kib, add_shape_args, build_drafter, check_agreement  # noqa: E402

PEER = "speculators"
PEER_VERSION = "0.9.0"  # the release the README's table compares against
IMPLS = ("eagle3-zoo", PEER)
DECAY = 0.8  # EAGLE-3's step weights 0.8**k (speculators' --ttt-step-loss-decay)
RMS_EPS = 1e-6


def import_peer():
    """speculators' Eagle3 pieces, or SystemExit(2) naming what is missing."""
    try:
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig, shift_batch
        from speculators.proposals.greedy import GreedyTokenProposalConfig
    except ImportError as e:
        print(f"{PEER} is not importable in {sys.executable} ({e}): nothing to compare against. Install it in a "
              f"separate venv with this project's torch: pip install --no-deps {PEER}=={PEER_VERSION} (and the "
              "packages its eagle3 model imports; see this script's docstring)", file=sys.stderr)
        raise SystemExit(2) from None
    return argparse.Namespace(version=importlib.metadata.version(PEER), SpeculatorsConfig=SpeculatorsConfig,
                              VerifierConfig=VerifierConfig, resolve_loss_config=resolve_loss_config,
                              Eagle3DraftModel=Eagle3DraftModel, Eagle3SpeculatorConfig=Eagle3SpeculatorConfig,
                              shift_batch=shift_batch, GreedyTokenProposalConfig=GreedyTokenProposalConfig)


def peer_model(peer, drafter, embed_weight: torch.Tensor, head: torch.Tensor, steps: int, frozen_head: bool,
               attn: str):
    """speculators' Eagle3DraftModel with the drafter's weights, the target's embedding and draft-vocab head."""
    from transformers import LlamaConfig

    c = drafter.config
    layer = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                        rope_theta=c.rope_theta, num_hidden_layers=1, max_position_embeddings=c.max_position_embeddings,
                        hidden_act=c.hidden_act, attn_implementation=attn)
    verifier = peer.VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])
    proposal = peer.GreedyTokenProposalConfig(speculative_tokens=steps)
    cfg = peer.Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=c.draft_vocab_size, norm_before_residual=False,
        speculators_config=peer.SpeculatorsConfig(algorithm="eagle3", proposal_methods=[proposal],
                                                  default_proposal_method="greedy", verifier=verifier))
    model = peer.Eagle3DraftModel(cfg)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in drafter.state_dict().items()}
    state.update({"embed_tokens.weight": embed_weight, "verifier_lm_head.weight": head,
                  "verifier_norm.weight": torch.ones(c.hidden_size)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"{PEER} {peer.version}: its Eagle3 weights no longer match eagle3-zoo's "
                         f"(missing {missing}, unexpected {unexpected})")
    model.lm_head.weight.requires_grad_(not frozen_head)
    return model.train()


def build(args, seq_len: int, steps: int, peer):
    """Both models on the same weights and one batch (our inputs, speculators' inputs)."""
    drafter = build_drafter(args)
    if args.frozen_lm_head:
        drafter.lm_head.weight.requires_grad_(False)
    h, t = args.hidden, seq_len
    embed = torch.nn.Embedding(args.vocab, h).requires_grad_(False)
    head = torch.randn(args.draft_vocab, h) * 0.1  # the target lm_head's draft-vocabulary rows
    ids = torch.randint(0, args.vocab, (1, t))
    aux = torch.randn(1, t, 3 * h)
    last = torch.randn(1, t, h)  # the target's last hidden state (before its final norm)
    mask = torch.zeros(1, t, dtype=torch.long)
    mask[:, int(t * (1 - args.supervised_fraction)) :] = 1
    ours = (drafter, embed, ids, aux, last, head, mask)
    model = peer_model(peer, drafter, embed.weight.detach(), head, steps, args.frozen_lm_head, args.peer_attn)
    # speculators masks the target at j with j's own mask, eagle3-zoo with that of token j + 1
    own_mask = torch.cat([mask[0, 1:], mask.new_zeros(1)]).bool()
    sample = {"input_ids": ids[0], "hidden_states": aux[0], "verifier_last_hidden_states": last[0],
              "loss_mask": own_mask, "lengths": torch.tensor([t]), "position_ids": torch.arange(t)}
    shifted = peer.shift_batch(sample)
    theirs = (model, {"input_ids": shifted["input_ids"][None], "hidden_states": shifted["hidden_states"][None],
                      "verifier_last_hidden_states": shifted["verifier_last_hidden_states"][None],
                      "loss_mask": shifted["loss_mask"][None], "position_ids": shifted["position_ids"][None],
                      "document_ids": torch.zeros(1, t - 1, dtype=torch.long)},
              peer.resolve_loss_config("kl_div", "eager"))
    return ours, theirs


def step(impl: str, ours, theirs, steps: int) -> torch.Tensor:
    """One train step (forward + backward) of `impl`; returns the detached loss."""
    if impl == PEER:
        model, batch, loss_config = theirs
        model.zero_grad(set_to_none=True)
        _, loss, _ = model(**batch, ttt_steps=steps, ttt_step_loss_decay=DECAY, loss_config=loss_config)
    else:
        drafter, embed, ids, aux, last, head, mask = ours
        drafter.zero_grad(set_to_none=True)
        with torch.no_grad():
            target_logits = F.linear(F.rms_norm(last, (last.shape[-1],), eps=RMS_EPS), head)
        loss = ttt_loss(drafter, embed, ids, aux, target_logits, mask, steps=steps,
                        step_weights=[DECAY**k for k in range(steps)], with_alpha=False).loss
    loss.backward()
    return loss.detach()


def target_entropy_term(ours, steps: int) -> float:
    """sum_k w_k * mean entropy of the step-k targets: soft cross-entropy minus KL divergence."""
    _, _, _, _, last, head, mask = ours
    with torch.no_grad():
        logp = torch.log_softmax(F.linear(F.rms_norm(last, (last.shape[-1],), eps=RMS_EPS), head), -1)
        entropy = -(logp.exp() * logp).sum(-1)[0]  # [T]
        masks = step_masks(mask, torch.ones_like(mask, dtype=torch.bool), steps)[:, 0]  # [K, T]; row t -> t+1+k
        total = 0.0
        for k in range(steps):
            rows = masks[k].nonzero().squeeze(-1)
            total += DECAY**k * float(entropy[rows + 1 + k].mean()) if rows.numel() else 0.0
    return total


def agreement(ours, theirs, steps: int) -> dict[str, float]:
    """Relative error of the losses (entropy added to speculators' KL) and the largest over the gradients of the
    parameters both train; SystemExit beyond `bench_ttt.TOLERANCE`."""
    drafter, model = ours[0], theirs[0]
    loss = float(step("eagle3-zoo", ours, theirs, steps))
    peer_loss = float(step(PEER, ours, theirs, steps)) + target_entropy_term(ours, steps)
    peer_grads = {k.replace("layers.0.", "midlayer."): p.grad for k, p in model.named_parameters()
                  if p.requires_grad}
    trained = [(name, p) for name, p in drafter.named_parameters() if p.requires_grad]
    for name, _ in trained:
        if peer_grads.get(name) is None:
            raise SystemExit(f"{PEER} does not train {name}, which eagle3-zoo trains: not the same computation")
    return check_agreement(PEER, loss, peer_loss, [p.grad for _, p in trained], [peer_grads[n] for n, _ in trained])


def _measure_memory_child(args, impl: str, seq_len: int, steps: int) -> None:
    ours, theirs = build(args, seq_len, steps, import_peer())
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here (see bench_ttt)
        f.write("5")
    start = _status_kib("VmRSS")
    step(impl, ours, theirs, steps)
    print((_status_kib("VmHWM") - start) / 1024)


def peak_memory_mb(argv: list[str], impl: str, seq_len: int, steps: int) -> float:
    out = subprocess.run([sys.executable, __file__, *argv, "--measure-memory", impl, str(seq_len), str(steps)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--steps", type=int, nargs="+", default=[3, 7], help="TTT steps K")
    p.add_argument("--iters", type=int, default=3, help="timed steps of each side per (T, K)")
    p.add_argument("--threads", type=int, default=2)
    add_shape_args(p)
    p.add_argument("--supervised-fraction", type=float, default=0.66)
    p.add_argument("--frozen-lm-head", action="store_true", help="freeze the draft lm_head on both sides "
                   f"({PEER}'s trainer default)")
    p.add_argument("--peer-attn", choices=("sdpa", "eager"), default="sdpa",
                   help=f"{PEER}'s --draft-attn-impl (its default, simple_flex_attention, has no backward on a CPU)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument("--measure-memory", nargs=3, metavar=("IMPL", "T", "K"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.measure_memory:
        impl, t, k = args.measure_memory
        return _measure_memory_child(args, impl, int(t), int(k))
    peer = import_peer()
    argv = [a for a in sys.argv[1:]]
    print(f"setup: torch {torch.__version__}, {PEER} {peer.version}, {platform.processor() or platform.machine()}, "
          f"threads={torch.get_num_threads()}, fp32, H={args.hidden}, heads={args.heads}/{args.kv_heads}, "
          f"I={args.intermediate}, Vd={args.draft_vocab}, V={args.vocab}, supervised={args.supervised_fraction:.2f}, "
          f"lm_head {'frozen' if args.frozen_lm_head else 'trained'}, {PEER} attention {args.peer_attn}")
    print(f"load before: {_loadavg()}")
    rows = []
    for t in args.seq_lens:
        for k in args.steps:
            print(f"T={t} K={k}")
            ours, theirs = build(args, t, k, peer)
            agreement(ours, theirs, k)  # also the warm-up of both
            times = {i: [] for i in IMPLS}
            for _ in range(args.iters):
                for i in IMPLS:  # alternate so machine noise hits both
                    t0 = time.perf_counter()
                    step(i, ours, theirs, k)
                    times[i].append(time.perf_counter() - t0)
            del ours, theirs
            mem = {i: math.nan if args.no_memory else peak_memory_mb(argv, i, t, k) for i in IMPLS}
            best = {i: min(times[i]) for i in IMPLS}
            print("  " + "; ".join(f"{i}: {', '.join(f'{s:.2f}' for s in times[i])} s/step, peak {mem[i]:.0f} MiB"
                                   for i in IMPLS))
            rows.append((t, k, best, mem))
    print(f"load after: {_loadavg()}")
    print(f"\n| T | K | eagle3-zoo s/step (min) | {PEER} s/step (min) | speed ratio | eagle3-zoo peak MiB | "
          f"{PEER} peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for t, k, best, mem in rows:
        print(f"| {t} | {k} | {best['eagle3-zoo']:.2f} | {best[PEER]:.2f} | **{best[PEER] / best['eagle3-zoo']:.2f}x** "
              f"| {mem['eagle3-zoo']:.0f} | {mem[PEER]:.0f} | {mem['eagle3-zoo'] / mem[PEER]:.2f}x |")


if __name__ == "__main__":
    main()
