#!/usr/bin/env python
"""Teacher-forced step-0 agreement of a drafter on the target's own greedy answers, at every position and right
after a miss (where chain-decoding cycles start), with fp32 and with bf16-rounded target features.

Explains the gap between a run's `val/acc_0` and the acceptance@1 that `eagle3-zoo eval --mode chain` measures on
the same prompts: a cycle's first draft token comes right after the bonus token, i.e. (for cycles that stopped at
depth 1) right after a position the drafter missed. If the agreement after a miss here matches the evaluation's
acceptance@1, training and inference agree and the gap is position selection, not a mismatch. The bf16 row tells
whether training on bf16-stored features (the offline feature store) costs anything at fp32 inference. Recall@k
(the target's token among the drafter's top k: what the first level of a top-k tree can accept) and the fraction of
the target's tokens inside the draft vocabulary (a hard cap on any acceptance) complete the picture.

For the first turn of each prompt of a benchmark (as `eagle3-zoo eval` renders it; e.g. a `scripts/val_bench.py` file),
the target answers greedily (`max_new_tokens`); the drafter's step-0 prediction at position t (target features at t,
embedding of token t+1) is compared with token t+2 over the answer.

    python scripts/teacher_forced_gap.py runs/smollm2_135m/drafter runs/smollm2_135m/val_bench.jsonl --max-new 128
    python scripts/teacher_forced_gap.py runs/smollm2_135m/drafter mtbench --limit 16 --spread --threads 1
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter")
    ap.add_argument("bench", help="mtbench, humaneval, or a JSONL of prompts (any `eagle3-zoo eval --bench` file)")
    ap.add_argument("--target", default=None, help="default: the drafter's target_name_or_path")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=10, help="also report recall@k (the first level of a top-k tree)")
    ap.add_argument("--limit", type=int, default=None, help="N prompts only (the first ones, or see --spread)")
    ap.add_argument("--spread", action="store_true", help="with --limit: evenly spaced prompts, as `eval --spread`")
    args = ap.parse_args()

    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.modeling import Eagle3Drafter
    from eagle3_zoo.speculative.benchmarks import load_benchmark, prompt_chat_format, trained_chat_template_kwargs
    from eagle3_zoo.speculative.evaluation import turn_input_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    drafter = Eagle3Drafter.from_pretrained(args.drafter).eval()
    target_name = args.target or drafter.config.target_name_or_path
    target, tokenizer, adapter = load_target(target_name, dtype=torch.float32)
    embed = adapter.embed_tokens(target)
    # rendered as `eagle3-zoo eval` renders them: the template variables the drafter was trained with
    chat_format, template_kwargs = prompt_chat_format(adapter, tokenizer), trained_chat_template_kwargs(args.drafter)
    hits = {"fp32": [0, 0], "bf16": [0, 0]}
    after = {"miss": [0, 0], "hit": [0, 0]}
    recall = {"all": [0, 0], "after a miss": [0, 0]}
    in_vocab = [0, 0]
    prompts = load_benchmark(args.bench, limit=args.limit, spread=args.spread).prompts
    with torch.no_grad():
        for prompt in prompts:
            # first turn, as the evaluation renders it
            ids = turn_input_ids(prompt, 0, [], tokenizer, chat_format, template_kwargs).view(1, -1)
            seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new,
                                  do_sample=False)
            aux, _, _ = adapter.forward_features(target, seq, layer_ids=drafter.config.aux_layer_ids, use_cache=False)
            nxt = torch.cat([seq[:, 1:], seq.new_zeros(1, 1)], dim=1)
            positions = torch.arange(ids.shape[1] - 1, seq.shape[1] - 2)  # predicts answer tokens 2..end
            for name, features in (("fp32", aux), ("bf16", aux.to(torch.bfloat16).float())):
                hidden = next(iter(drafter.ttt_rollout(embed(nxt), features, 1)))
                logits = drafter.logits(hidden)
                pred = drafter.draft_to_target(logits.argmax(-1))
                gold = seq[0, positions + 2]
                ok = pred[0, positions] == gold
                hits[name][0] += int(ok.sum())
                hits[name][1] += ok.numel()
                if name == "fp32":
                    top = drafter.draft_to_target(logits.topk(args.top_k, dim=-1).indices)[0, positions]
                    found = (top == gold[:, None]).any(-1)
                    recall["all"][0] += int(found.sum())
                    recall["all"][1] += found.numel()
                    recall["after a miss"][0] += int(found[1:][~ok[:-1]].sum())
                    recall["after a miss"][1] += int((~ok[:-1]).sum())
                    in_vocab[0] += int(drafter.t2d[gold].sum())
                    in_vocab[1] += gold.numel()
                    prev, cur = ok[:-1], ok[1:]
                    after["miss"][0] += int(cur[~prev].sum())
                    after["miss"][1] += int((~prev).sum())
                    after["hit"][0] += int(cur[prev].sum())
                    after["hit"][1] += int(prev.sum())
    print(f"{args.drafter} on {len(prompts)} prompts of {args.bench}, target {target_name}, "
          f"{args.max_new} greedy tokens")
    for name, (c, n) in hits.items():
        print(f"step-0 agreement, {name} features: {c / max(n, 1):.3f} over {n} positions")
    for name, (c, n) in after.items():
        print(f"step-0 agreement right after a {name}: {c / max(n, 1):.3f} over {n} positions (fp32)")
    for name, (c, n) in recall.items():
        print(f"step-0 recall@{args.top_k} (target token among the drafter's top {args.top_k}), {name}: "
              f"{c / max(n, 1):.3f} over {n} positions (fp32)")
    print(f"target tokens inside the draft vocabulary: {in_vocab[0] / max(in_vocab[1], 1):.3f} over {in_vocab[1]}")


if __name__ == "__main__":
    main()
