"""`eagle3-zoo eval DRAFTER --target T --bench mtbench,humaneval ...`: argparse wiring over `evaluate`.

The lead's `eagle3_zoo/cli.py` adds a subcommand with `add_eval_arguments(subparser)` and calls `run_eval_cli(args)`;
`eval_main(argv)` is the same as a standalone entry point (returns an exit code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_zoo.dtypes import DTYPE_NAMES
from eagle3_zoo.speculative.shapes import SHAPE_SYNTAX, TreeSpec, parse_shapes

# kept free of torch/transformers imports: `eagle3-zoo --help` builds this parser
MODES = ("tree", "chain")  # = eagle3_zoo.speculative.generate.MODES
_SHAPE_DEFAULTS = {"mode": "tree", "depth": 8, "top_k": 10, "total_tokens": 60, "min_prob": 0.0}


def _shapes_arg(text: str) -> list[TreeSpec]:
    try:
        return parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `eval` options to `parser` (a top-level parser or a subcommand's)."""
    parser.add_argument("drafter", help="drafter folder (canonical layout: config.json + model.safetensors)")
    parser.add_argument("--target", default=None,
                        help="target hub id / folder / 'smollm2-135m-instruct' (default: the drafter's "
                             "target_name_or_path)")
    parser.add_argument("--bench", default="mtbench",
                        help="comma-separated: mtbench, humaneval, or JSONL files (default: mtbench)")
    parser.add_argument("--mode", choices=MODES, default=None, help="draft shape (default: tree)")
    parser.add_argument("--depth", type=int, default=None, help="tree depth / chain length K (default: 8)")
    parser.add_argument("--top-k", type=int, default=None, help="tree branching per node (default: 10)")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help="draft nodes per tree, the root not counted (default: 60)")
    parser.add_argument("--min-prob", type=float, default=None,
                        help="draft only nodes whose cumulative draft probability is >= this (0 = off; default: 0): "
                             "smaller drafts where the drafter is unsure, for machines where verifying more tokens "
                             "costs time (a CPU)")
    parser.add_argument("--shapes", type=_shapes_arg, default=None, metavar="SHAPE[,SHAPE...]",
                        help="compare draft shapes on the same requests instead of one --mode: " + SHAPE_SYNTAX +
                             ", e.g. chain:1,chain:3,tree:1/2/2,tree:8/10/60; prints tau and speedup per shape and "
                             "the fastest (the plain baseline runs once per request and serves every shape)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy + lossless check (default: 0)")
    parser.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k, 0 = off (default: 0)")
    parser.add_argument("--sample-top-p", type=float, default=1.0, help="sampling top-p, 1 = off (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per request (default: 256)")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each benchmark")
    parser.add_argument("--spread", action="store_true",
                        help="with --limit N: N prompts evenly spaced over each benchmark instead of the first N "
                             "(MT-bench is sorted by category: --limit 16 --spread = 2 per category)")
    parser.add_argument("--out", default="eval_results.json", help="results JSON (default: eval_results.json)")
    parser.add_argument("--plot", default=None, help="acceptance PNG (default: the --out path with .png)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip plain decoding (no speedup, no lossless check)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="target and drafter dtype")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda if available, else cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--strict", action="store_true", help="exit code 1 if the lossless check fails")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="hf: our own decoder in this process (default); vllm: EAGLE-3 inside a vLLM server, "
                             "judged by its own counters, greedy only (--depth = num_speculative_tokens, default 3; "
                             "the engine venv comes from EAGLE3_ZOO_VLLM_PYTHON or .venv-vllm)")
    parser.add_argument("--engine-url", default=None,
                        help="with --engine vllm: a running vLLM server with the drafter loaded (default: start one)")
    parser.add_argument("--engine-baseline-url", default=None,
                        help="with --engine vllm: a running vLLM server of the target without speculation")
    parser.add_argument("--engine-compare", action="store_true",
                        help="with --engine vllm: also decode the same requests with our own decoder (chain of "
                             "--depth) and report both tau figures side by side")
    return parser


def run_eval_cli(args: argparse.Namespace) -> dict[str, Any]:
    """Load the drafter and target named by `args`, evaluate, print the table, write JSON + PNG.

    Raises:
        ValueError / OSError: bad paths, names or incompatible drafter and target.
    """
    if getattr(args, "engine", "hf") == "vllm":
        from eagle3_zoo.speculative.engine_eval import run_engine_eval_cli

        return run_engine_eval_cli(args)
    import torch

    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.hub.check import require_valid_drafter
    from eagle3_zoo.hub.convert import import_drafter
    from eagle3_zoo.hub.weights import weights_digest
    from eagle3_zoo.speculative.evaluation import evaluate, evaluate_shapes, format_shapes_table, format_table

    single = {k: getattr(args, k) for k in _SHAPE_DEFAULTS if getattr(args, k) is not None}
    if args.shapes and single:
        flags = ", ".join("--" + k.replace("_", "-") for k in single)
        raise ValueError(f"--shapes compares the shapes it lists; drop {flags} or --shapes")
    shape = {**_SHAPE_DEFAULTS, **single}
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the checks of `eagle3-zoo check`, so that a broken drafter is refused with its problem codes instead of
    # failing deep in decoding: on its own before the (possibly large) target loads, then against the target
    report = require_valid_drafter(args.drafter, purpose="evaluate")
    target_name = args.target or report.config.target_name_or_path
    if not target_name:
        raise ValueError(f"{args.drafter}: the drafter config names no target (eagle3_zoo.target_name_or_path); "
                         f"pass --target")
    target, tokenizer, adapter = load_target(target_name, dtype=dtype, device=device)
    require_valid_drafter(args.drafter, target.config, purpose=f"evaluate with target {target_name}")
    drafter = import_drafter(args.drafter, dtype=dtype, device=device).eval()  # any format `check` accepts
    common = dict(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, limit=args.limit, spread=args.spread,
        sample_top_k=args.sample_top_k, sample_top_p=args.sample_top_p, baseline=not args.no_baseline,
        warmup=args.warmup, seed=args.seed, adapter=adapter, out=args.out, plot=args.plot,
        progress=not args.no_progress,
        # the weights' digest ties the results to these weights: the model card leaves out results of other weights
        extra_settings={"drafter": str(Path(args.drafter).resolve()), "target": str(target_name),
                        "drafter_weights_sha256": weights_digest(args.drafter)},
    )
    if args.shapes:
        results = evaluate_shapes(drafter, target, tokenizer, args.bench, shapes=args.shapes, **common)
        print(format_shapes_table(results))
    else:
        results = evaluate(drafter, target, tokenizer, args.bench, mode=shape["mode"], depth=shape["depth"],
                           top_k=shape["top_k"], total_tokens=shape["total_tokens"], min_prob=shape["min_prob"],
                           **common)
        print(format_table(results))
    print(f"wrote {args.out} and {args.plot or Path(args.out).with_suffix('.png')}")
    return results


def eval_main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: parse `argv`, run; exit code 2 on errors, 1 on a failed lossless check with --strict."""
    parser = add_eval_arguments(argparse.ArgumentParser(prog="eagle3-zoo eval", description=__doc__))
    args = parser.parse_args(argv)
    try:
        results = run_eval_cli(args)
    except (ValueError, OSError) as e:  # bad names/paths, incompatible models, unreadable files
        print(f"error: {e}", file=sys.stderr)
        return 2
    if results["lossless"] is False:
        print("warning: speculative greedy output differs from plain decoding (see lossless_mismatches)",
              file=sys.stderr)
        return 1 if args.strict else 0
    return 0
