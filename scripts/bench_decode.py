"""What one speculative cycle costs on this machine, in units of one plain decoding step.

Measures, for the embedded SmolLM2-135M target (fp32) and a drafter of the same shape as the recipe's:
  * the plain KV-cache decoding step (1 token + lm_head row), the baseline's cost per token;
  * the target forward over q tree nodes (q = 1..60, 4D tree mask, `TargetRunner.verify`) after a prompt;
  * one drafter tree-expansion call over w frontier nodes (w = 1 for a chain, top-k for a tree);
  * one extension of the drafter's context by the m rows a cycle accepted (path + bonus token).
From these, the break-even tau of a draft shape is cost(cycle) / cost(plain step): a chain of K tokens needs
tau > (verify(K+1) + extension + (K-1) expansions) / plain step to be faster than plain decoding.

    .venv/bin/python scripts/bench_decode.py [--threads 2] [--context 256] [--draft-vocab 8192] [--reps 15]

The drafter weights are random: cost does not depend on them. Prints its setup and a table; the figures in
docs come from this script on a quiet machine.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from eagle3_zoo.adapters import load_target
from eagle3_zoo.drafters.eagle3.decode import Eagle3DraftModel
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter
from eagle3_zoo.speculative.generate import plain_generate
from eagle3_zoo.speculative.target import TargetRunner
from eagle3_zoo.speculative.tree import DraftTree


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1000


def _chain_tree(q: int) -> DraftTree:
    parents = [-1] + list(range(q - 1))
    return DraftTree(tokens=torch.randint(100, 40000, (q,)), parents=torch.tensor(parents),
                     depths=torch.arange(q), children=[[i + 1] for i in range(q - 1)] + [[]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--context", type=int, default=256, help="prompt tokens already in the cache")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, _, adapter = load_target("smollm2-135m-instruct", dtype=torch.float32)
    prompt = torch.randint(100, 40000, (args.context,))
    print(f"setup: SmolLM2-135M fp32, context {args.context}, draft vocab {args.draft_vocab}, threads {args.threads}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")

    # plain step: time per token of plain_generate over 32 new tokens (prefill excluded by differencing)
    n = 32

    def plain(k: int) -> float:
        return plain_generate(target, prompt, k, eos_token_id=[]).seconds

    plain(4)
    plain_ms = min((plain(n + 1) - plain(1)) / n for _ in range(3)) * 1000
    print(f"plain decoding step: {plain_ms:.1f} ms/token")

    runner = TargetRunner(target, adapter)
    rows = []
    runner.prefill(prompt)
    for q in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 61):
        tree = _chain_tree(q)

        def verify(tree=tree, q=q) -> None:
            logits, _ = runner.verify(tree)
            logits[q - 1]  # one lm_head row, as acceptance computes per visited node
            runner.cache.crop(-q)  # drop the verified entries again

        verify()
        rows.append((q, _median(verify, args.reps)))

    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=args.draft_vocab)
    drafter = Eagle3Drafter(cfg).eval()
    draft = Eagle3DraftModel(drafter, adapter.embed_tokens(target))
    aux = torch.randn(1, args.context, cfg.num_aux_layers * target.config.hidden_size)
    draft_rows = []
    with torch.no_grad():
        for w in (1, 4, 10):
            draft.reset()
            out = draft.extend(aux, prompt, prompt)

            def expand(w=w, out=out) -> None:
                draft.cache.crop(draft.ctx_len)
                draft.expand(torch.randint(100, 40000, (w,)), out.hidden.expand(1, w, -1),
                             torch.ones(w, dtype=torch.long), torch.eye(w, dtype=torch.bool))

            expand()
            draft_rows.append((w, _median(expand, args.reps)))
        extend_rows = []
        for m in (1, 2, 4):
            draft.reset()
            draft.extend(aux, prompt, prompt)
            ctx = draft.ctx_len

            def extend(m=m, ctx=ctx) -> None:  # the accepted path + bonus token, appended after each cycle
                draft.cache.crop(ctx)
                draft.ctx_len = ctx
                draft.extend(aux[:, :m], prompt[:m], prompt[:m])

            extend()
            extend_rows.append((m, _median(extend, args.reps)))

    print("\n| target forward over q nodes | ms | x plain step |\n|---|---|---|")
    for q, ms in rows:
        print(f"| q = {q} | {ms:.1f} | {ms / plain_ms:.2f} |")
    print("\n| drafter expansion of w nodes | ms | x plain step |\n|---|---|---|")
    for w, ms in draft_rows:
        print(f"| w = {w} | {ms:.2f} | {ms / plain_ms:.3f} |")
    print("\n| drafter context extension by m rows | ms | x plain step |\n|---|---|---|")
    for m, ms in extend_rows:
        print(f"| m = {m} | {ms:.2f} | {ms / plain_ms:.3f} |")
    verify_ms = dict(rows)
    d1, d10 = dict(draft_rows)[1], dict(draft_rows)[10]
    ext = dict(extend_rows)[2]  # a cycle appends its accepted path plus the bonus token: ~2 rows at tau ~1.5-2
    print("\nbreak-even tau (cycle cost / plain step; 2x needs twice this): verify q nodes with one lm_head row,")
    print("one extension by 2 rows, one expansion per draft depth after the first:")
    for k in (1, 2, 3, 4, 5, 7):
        if k + 1 in verify_ms:
            cyc = verify_ms[k + 1] + ext + (k - 1) * d1
            print(f"  chain {k}: {cyc / plain_ms:.2f}")
    cyc = verify_ms[61] + ext + 7 * d10
    print(f"  tree depth 8 / top-k 10 / 60 nodes: {cyc / plain_ms:.2f}")


if __name__ == "__main__":
    main()
