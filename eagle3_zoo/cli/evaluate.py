"""`eagle3-zoo eval DRAFTER --target T --bench mtbench,humaneval ...`: real speculative decoding, in this process
(`eagle3_zoo.api.DrafterFolder.evaluate`: the drafter folder read once) or inside vLLM
(`eagle3_zoo.speculative.engine_eval`).

Everything the arguments name is checked before the target loads: the drafter (the checks of `eagle3-zoo check`,
against the target's shipped config when the package has one, so a mismatch is reported offline), the benchmark
names and files, the draft shape.

On a CPU the defaults are what this kind of machine can answer in minutes (verifying a node costs time there, see
docs/performance.md *Draft shapes on this CPU*): the 60-node tree cut at draft probability 0.2, 128 new tokens, 8
prompts spread over each benchmark. On a GPU: the EAGLE-3 paper's tree 8/10/60, 256 new tokens, every prompt.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from eagle3_zoo.values.draft_shapes import (
    DEFAULT_DEPTH,
    DEFAULT_TOP_K,
    DEFAULT_TOTAL_TOKENS,
    SHAPE_SYNTAX,
    TreeSpec,
    parse_shapes,
)
from eagle3_zoo.values.dtypes import DTYPE_NAMES

log = logging.getLogger(__name__)

# kept free of torch/transformers imports: `eagle3-zoo --help` builds this parser
MODES = ("tree", "chain")  # = eagle3_zoo.speculative.generate.MODES
BUILTIN_BENCHES = ("mtbench", "humaneval")  # = eagle3_zoo.speculative.benchmarks.BUILTIN
_SHAPE_FLAGS = ("mode", "depth", "top_k", "total_tokens", "min_prob")
DEFAULTS = {  # per device type: the shape, the answer length and the prompts of an `eval` without those options
    "cuda": {"mode": "tree", "depth": DEFAULT_DEPTH, "top_k": DEFAULT_TOP_K,
             "total_tokens": DEFAULT_TOTAL_TOKENS, "min_prob": 0.0, "max_new_tokens": 256,
             "limit": None, "spread": False},
    "cpu": {"mode": "tree", "depth": DEFAULT_DEPTH, "top_k": DEFAULT_TOP_K,
             "total_tokens": DEFAULT_TOTAL_TOKENS, "min_prob": 0.2, "max_new_tokens": 128,
            "limit": 8, "spread": True},
}


def _shapes_arg(text: str) -> list[TreeSpec]:
    try:
        return parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict[str, Any]:
    """`--chat-template-kwargs`: a JSON object of template variables."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): {text!r}; expected an object "
                                         "such as '{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of template variables such as "
                                         f"'{{\"enable_thinking\": false}}', got a JSON {type(value).__name__}")
    return value


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `eval` options to `parser`."""
    parser.add_argument("drafter", help="drafter folder in any format `eagle3-zoo check` reads (canonical/SGLang, "
                        "official EAGLE-3, speculators; a DFlash folder: one block per cycle, greedy, no tree "
                        "options)")
    parser.add_argument("--target", default=None,
                        help="target hub id / folder / 'smollm2-135m-instruct' (default: the drafter's "
                             "target_name_or_path)")
    parser.add_argument("--bench", default="mtbench",
                        help="comma-separated: mtbench, humaneval, or JSONL files (default: mtbench)")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="draft shape (default: tree 8/10/60; on a CPU cut at draft probability 0.2)")
    parser.add_argument("--depth", type=int, default=None, help="tree depth / chain length K (default: 8)")
    parser.add_argument("--top-k", type=int, default=None, help="tree branching per node (default: 10)")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help="draft nodes per tree, the root not counted (default: 60)")
    parser.add_argument("--min-prob", type=float, default=None,
                        help="draft only nodes whose cumulative draft probability is >= this (0 = off; default: 0 on "
                             "a GPU, 0.2 on a CPU): smaller drafts where the drafter is unsure, for machines where "
                             "verifying more tokens costs time (a CPU)")
    parser.add_argument("--shapes", type=_shapes_arg, default=None, metavar="SHAPE[,SHAPE...]",
                        help="compare draft shapes on the same requests instead of one --mode: " + SHAPE_SYNTAX +
                             ", e.g. chain:1,chain:3,tree:1/2/2,tree:8/10/60; prints tau and speedup per shape and "
                             "the fastest (the plain baseline runs once per request and serves every shape)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy + lossless check (default: 0)")
    parser.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k, 0 = off (default: 0)")
    parser.add_argument("--sample-top-p", type=float, default=1.0, help="sampling top-p, 1 = off (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per request (default: 256; 128 on a CPU)")
    parser.add_argument("--limit", type=int, default=None,
                        help="N prompts of each benchmark (default: all; on a CPU 8, spread)")
    parser.add_argument("--spread", action="store_true", default=None,
                        help="with --limit N: N prompts evenly spaced over each benchmark instead of the first N "
                             "(MT-bench is sorted by category: --limit 16 --spread = 2 per category)")
    parser.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                        help="variables of the target's chat template for chat prompts, a JSON object such as "
                             "'{\"enable_thinking\": false}' (default: data.chat_template_kwargs of the drafter "
                             "folder's recipe.yaml, the ones it was trained with; none without a recipe.yaml)")
    parser.add_argument("--out", default="eval_results.json", help="results JSON (default: eval_results.json)")
    parser.add_argument("--plot", default=None, help="acceptance PNG (default: the --out path with .png)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip plain decoding (no speedup, no lossless check)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="target and drafter dtype")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda if available, else cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--strict", action="store_true", help="exit code 1 if the lossless check fails")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="hf: our own decoder in this process (default); vllm: the drafter inside a vLLM server, "
                             "judged by its own counters, greedy only (EAGLE-3: --depth = num_speculative_tokens, "
                             "default 3; DFlash: method dflash, block_size - 1 tokens; "
                             "the engine venv comes from EAGLE3_ZOO_VLLM_PYTHON or .venv-vllm)")
    parser.add_argument("--engine-url", default=None,
                        help="with --engine vllm: a running vLLM server with the drafter loaded (default: start one)")
    parser.add_argument("--engine-baseline-url", default=None,
                        help="with --engine vllm: a running vLLM server of the target without speculation")
    parser.add_argument("--engine-compare", action="store_true",
                        help="with --engine vllm: also decode the same requests with our own decoder (chain of "
                             "--depth) and report both tau figures side by side")
    return parser


def check_benches(benches: str) -> list[str]:
    """The names of `--bench`, each a built-in benchmark or an existing file; a typo gets a "did you mean".

    Raises:
        ValueError: an unknown name, or an empty list.
    """
    names = [b.strip() for b in benches.split(",") if b.strip()]
    if not names:
        raise ValueError(f"--bench {benches!r}: no benchmark named; built-in: {', '.join(BUILTIN_BENCHES)}, or a "
                         "JSONL file")
    for name in names:
        if name in BUILTIN_BENCHES or Path(name).is_file():
            continue
        close = difflib.get_close_matches(name, BUILTIN_BENCHES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"--bench: unknown benchmark {name!r} (neither built-in nor a file); {hint}built-in: "
                         f"{', '.join(BUILTIN_BENCHES)}, or a JSONL file of prompts")
    return names


def settings_for(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    """The shape, answer length and prompt selection of this run: the options given, else the device's defaults.

    Raises:
        ValueError: `--shapes` combined with single-shape options.
    """
    given = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    if args.shapes and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"--shapes compares the shapes it lists; drop {flags} or --shapes")
    defaults = DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    out = {**defaults, **given}
    if given and "min_prob" not in given:  # a shape given without a cut is taken as given, uncut
        out["min_prob"] = 0.0
    for key in ("max_new_tokens", "limit", "spread"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.limit is not None and args.spread is None:
        out["spread"] = False
    return out


def chat_template_kwargs_for(args: argparse.Namespace) -> dict[str, Any]:
    """The chat-template variables of this evaluation: `--chat-template-kwargs`, else those the drafter was trained
    with (its folder's recipe.yaml), else none.

    Raises:
        ValueError: the folder's recipe.yaml cannot be read or holds no valid ``data.chat_template_kwargs``.
    """
    from eagle3_zoo.speculative.benchmarks import trained_chat_template_kwargs

    if args.chat_template_kwargs is not None:
        log.info("chat prompts rendered with --chat-template-kwargs %s", json.dumps(args.chat_template_kwargs))
        return dict(args.chat_template_kwargs)
    trained = trained_chat_template_kwargs(args.drafter)
    if trained is None:
        log.info("%s has no recipe.yaml: chat prompts rendered with the template's defaults (set the variables the "
                 "drafter was trained with by --chat-template-kwargs)", args.drafter)
        return {}
    log.info("chat prompts rendered with the drafter's training chat_template_kwargs %s (recipe.yaml)",
             json.dumps(trained))
    return trained


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Check, load, evaluate (`eagle3_zoo.api.DrafterFolder.evaluate`); prints the table and returns the results
    (written to `--out`)."""
    if args.engine == "vllm":
        return run_engine_eval(args)
    import torch

    from eagle3_zoo.api import DrafterFolder
    from eagle3_zoo.speculative.benchmarks import load_benchmark
    from eagle3_zoo.speculative.evaluation import EvalSettings, format_shapes_table, format_table

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = settings_for(args, torch.device(device).type)
    benches = check_benches(args.bench)
    for name in benches:  # bad records and empty files too, before minutes of loading
        load_benchmark(name, s["limit"], s["spread"])
    template_kwargs = chat_template_kwargs_for(args)
    # the checks of `eagle3-zoo check`, so that a broken drafter is refused with its problem codes instead of
    # failing deep in decoding: before the (possibly large) target loads, against its shipped config if any
    folder = DrafterFolder.open(args.drafter)
    target_name = folder.eval_target(args.target)
    kind = get_kind_of_folder(folder)
    if kind.decoding == "block":
        s = block_eval_settings(args, kind.name, s, device)
    else:
        _log_plan(args, s, device)
    settings = EvalSettings(
        benches=tuple(benches), mode=s["mode"], depth=s["depth"], top_k=s["top_k"], total_tokens=s["total_tokens"],
        min_prob=s["min_prob"], temperature=args.temperature, sample_top_k=args.sample_top_k,
        sample_top_p=args.sample_top_p, max_new_tokens=s["max_new_tokens"], limit=s["limit"], spread=s["spread"],
        baseline=not args.no_baseline, warmup=args.warmup, seed=args.seed, chat_template_kwargs=template_kwargs)
    results = folder.evaluate(target_name, settings, shapes=args.shapes, device=device, dtype=args.dtype,
                              out=args.out, plot=args.plot, progress=not args.no_progress)
    print(format_shapes_table(results) if args.shapes else format_table(results))
    print(f"wrote {args.out} and {args.plot or Path(args.out).with_suffix('.png')}")
    return results


def get_kind_of_folder(folder: Any) -> Any:
    """The drafter kind (`eagle3_zoo.drafters.DrafterKind`) of an opened drafter folder, from its config."""
    from eagle3_zoo.drafters import kind_of_config

    return kind_of_config(folder.config)


def block_eval_settings(args: argparse.Namespace, kind: str, s: dict[str, Any], device: str) -> dict[str, Any]:
    """`s` for a drafter of a block kind (DFlash): it drafts one block of its own size per cycle, verified as a chain,
    greedily; the tree options are refused when given and left at `EvalSettings`'s defaults (unused) otherwise.

    Raises:
        ValueError: a tree option (--shapes, --mode, --depth, --top-k, --total-tokens, --min-prob) or a
            temperature above 0.
    """
    from eagle3_zoo.speculative.evaluation import EvalSettings

    given = [f"--{k.replace('_', '-')}" for k in _SHAPE_FLAGS if getattr(args, k) is not None]
    given += ["--shapes"] if args.shapes else []
    if given:
        raise ValueError(f"{args.drafter} is a {kind} drafter: it drafts one block of its own size per cycle, so the "
                         f"tree options {', '.join(given)} do not apply; drop them")
    if args.temperature != 0:
        raise ValueError(f"{args.drafter} is a {kind} drafter, decoded greedily only: drop --temperature "
                         f"{args.temperature} (or pass 0)")
    default = EvalSettings()
    out = {**s, **{k: getattr(default, k) for k in _SHAPE_FLAGS}}
    prompts = f"{s['limit']} prompts{' spread' if s['spread'] else ''} of each benchmark" if s["limit"] else \
        "every prompt of each benchmark"
    log.info("eval on %s: %s drafter, one block per cycle verified as a chain (the tree options do not apply), %s, "
             "up to %d new tokens per request%s", device, kind, prompts, s["max_new_tokens"],
             "" if args.no_baseline else ", then plain decoding of each request")
    return out


def _log_plan(args: argparse.Namespace, s: dict[str, Any], device: str) -> None:
    shapes = ", ".join(t.label for t in args.shapes) if args.shapes else TreeSpec(
        s["depth"], 1 if s["mode"] == "chain" else s["top_k"],
        s["depth"] if s["mode"] == "chain" else s["total_tokens"], s["min_prob"]).label
    prompts = f"{s['limit']} prompts{' spread' if s['spread'] else ''} of each benchmark" if s["limit"] else \
        "every prompt of each benchmark"
    defaulted = defaulted_options(args)
    log.info("eval on %s: %s, %s, up to %d new tokens per request%s%s", device, shapes, prompts, s["max_new_tokens"],
             "" if args.no_baseline else ", then plain decoding of each request",
             f" (the {'GPU' if device.startswith('cuda') else 'CPU'} defaults of the options not given: "
             f"{', '.join(defaulted)})" if defaulted else "")


def defaulted_options(args: argparse.Namespace) -> list[str]:
    """The options whose value `settings_for` takes from the device's defaults, as flags (`--depth`): none of the
    shape's under --shapes, and no --min-prob once a shape option is given (uncut), no --spread once --limit is."""
    shape_given = bool(args.shapes) or any(getattr(args, k) is not None for k in _SHAPE_FLAGS)
    keys = [k for k in _SHAPE_FLAGS if not args.shapes and getattr(args, k) is None
            and not (k == "min_prob" and shape_given)]
    keys += [k for k in ("max_new_tokens", "limit") if getattr(args, k) is None]
    if args.spread is None and args.limit is None:
        keys.append("spread")
    return ["--" + k.replace("_", "-") for k in keys]


def run_engine_eval(args: argparse.Namespace) -> dict[str, Any]:
    """`eval --engine vllm`: the options that apply to the engine, the table, the JSON.

    Raises:
        ValueError: an option the engine path does not support (tree shapes, sampling).
    """
    from eagle3_zoo.speculative.engine_eval import compare_with_our_decoder, evaluate_in_vllm, format_engine_table
    from eagle3_zoo.speculative.report import write_results

    unsupported = [flag for flag, given in (("--shapes", args.shapes), ("--mode tree", args.mode == "tree"),
                                           ("--top-k", args.top_k), ("--total-tokens", args.total_tokens),
                                           ("--min-prob", args.min_prob)) if given]
    if unsupported:
        raise ValueError(f"--engine vllm drafts chains of --depth tokens (vLLM's num_speculative_tokens); drop "
                         f"{', '.join(unsupported)}")
    benches = ",".join(check_benches(args.bench))
    out, max_new = Path(args.out), args.max_new_tokens or DEFAULTS["cuda"]["max_new_tokens"]
    template_kwargs = chat_template_kwargs_for(args)
    results = evaluate_in_vllm(
        args.drafter, args.target, benches, num_speculative_tokens=args.depth, max_new_tokens=max_new,
        limit=args.limit, spread=bool(args.spread), temperature=args.temperature, top_p=args.sample_top_p,
        top_k=args.sample_top_k, baseline=not args.no_baseline,
        url=args.engine_url, baseline_url=args.engine_baseline_url, work_dir=out.parent / f"{out.stem}-vllm",
        out=None, chat_template_kwargs=template_kwargs)
    if args.engine_compare:
        results["hf_decoder"] = compare_with_our_decoder(results, benches, max_new_tokens=max_new, limit=args.limit,
                                                         spread=bool(args.spread), baseline=not args.no_baseline,
                                                         progress=not args.no_progress)
    write_results(results, out)
    print(format_engine_table(results))
    print(f"wrote {out}")
    return results


def cmd_eval(args: argparse.Namespace) -> int:
    results = run_eval(args)
    if results.get("lossless") is False:
        print("warning: speculative greedy output differs from plain decoding (see lossless_mismatches)",
              file=sys.stderr)
        return 1 if args.strict else 0
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add `eval` to the `eagle3-zoo` subcommands."""
    p = sub.add_parser("eval", help="real speculative decoding: tau, per-depth acceptance, speedup, lossless check",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
                       parents=[common])
    add_eval_arguments(p)
    p.set_defaults(func=cmd_eval)
