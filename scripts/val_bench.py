#!/usr/bin/env python
"""Write a recipe's held-out validation conversations as an `eagle3-zoo eval` benchmark (JSONL of user turns).

A drafter that accepts less on a benchmark than its validation accuracy promises is either mismatched between
training and inference, or trained on data unlike the benchmark. Evaluating these prompts (the target answers
them again, as at inference) separates the two: chain acceptance@1 here should reproduce the run's `val/acc_0`;
if it does, the gap to MT-bench is a data shift, not a bug.

Runs the recipe's data stage exactly as `fit` does (`prepare_data`: same sources, regeneration, split and seed), so
it is quick when `fit` has filled the caches, and regenerates (long) when it has not. Conversations with an empty
user turn are left out and counted.

    python scripts/val_bench.py recipes/smollm2_135m.yaml --out runs/smollm2_135m/val_bench.jsonl
    eagle3-zoo eval runs/smollm2_135m/drafter --bench runs/smollm2_135m/val_bench.jsonl --mode chain --depth 7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def bench_records(conversations: list) -> tuple[list[dict], int]:
    """`{"id", "messages"}` records (system + user turns) of `conversations`, and how many were left out."""
    records, skipped = [], 0
    for conv in conversations:
        messages = [{"role": m["role"], "content": m["content"]} for m in conv.messages
                    if m["role"] in ("system", "user")]
        users = [m for m in messages if m["role"] == "user"]
        if not users or any(not m["content"].strip() for m in users):
            skipped += 1
            continue
        records.append({"id": conv.uid.rsplit("/", 1)[-1], "messages": messages})
    return records, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key=value (as for `eagle3-zoo fit`)")
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--limit", type=int, default=None, help="first N held-out conversations")
    args = ap.parse_args()

    from eagle3_zoo.data.features import atomic_write_bytes
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.targets.loading import load_recipe_target

    recipe = load_recipe(args.recipe, args.overrides)
    target, tokenizer, adapter = load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, args.recipe)
    data = prepare_data(recipe, tokenizer, adapter, target=target, target_id=recipe.target.name_or_path)
    records, skipped = bench_records(data.val_conversations[: args.limit])
    if not records:
        raise SystemExit(f"{args.recipe}: no held-out conversation with a non-empty user turn "
                         f"(data.val_fraction = {recipe.data.val_fraction})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    print(f"wrote {len(records)} held-out conversations to {out} ({skipped} with an empty user turn left out; "
          f"{len(data.val)} validation examples in training)")


if __name__ == "__main__":
    main()
