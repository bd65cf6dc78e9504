"""`eagle3-zoo` command line: a thin layer that turns subcommands into API calls and exceptions into exit codes.

Heavy imports (torch, transformers, Lightning) happen inside the handlers, so `eagle3-zoo --help` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

# errors a user can fix (bad recipe/data/paths/arguments): printed as one message, exit code 2; any other exception
# (a diverged run, an unreachable server, a bug) is printed as one line too, exit code 1, its traceback behind --debug
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError, KeyError)
DEBUG_ENV = "EAGLE3_ZOO_DEBUG"


def _print_config(args: argparse.Namespace) -> bool:
    """`--print-config`: print the fully resolved recipe and tell the caller to stop."""
    if not args.print_config:
        return False
    from eagle3_zoo.recipe import load_recipe, resolved_recipe_yaml

    print(resolved_recipe_yaml(load_recipe(args.recipe, args.overrides)), end="")
    return True


def _cmd_fit(args: argparse.Namespace) -> int:
    if _print_config(args):
        return 0
    from eagle3_zoo.training.fit import fit_main

    print(fit_main(args.recipe, args.overrides))
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    if _print_config(args):
        return 0
    import json

    from eagle3_zoo.data.extract import prepare_recipe
    from eagle3_zoo.recipe import load_recipe

    summary = prepare_recipe(load_recipe(args.recipe, args.overrides), rank=args.rank, world_size=args.world_size)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from eagle3_zoo.speculative.eval_cli import run_eval_cli

    results = run_eval_cli(args)
    if results.get("lossless") is False:
        print("warning: speculative greedy output differs from plain decoding (see lossless_mismatches)",
              file=sys.stderr)
        return 1 if args.strict else 0
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from eagle3_zoo.recipe import load_recipe
    from eagle3_zoo.training.plan import plan_recipe

    plan = plan_recipe(load_recipe(args.recipe, args.overrides), source=args.recipe)
    print(plan.table())
    return 1 if plan.fits is False else 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from eagle3_zoo.recipe import load_recipe
    from eagle3_zoo.targets.deployment import serve_recipe

    shown = serve_recipe(load_recipe(args.recipe, args.overrides), args.host, args.port, dry_run=args.print_command)
    print(shown)
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from eagle3_zoo.training.outputs import consolidate_checkpoint

    print(consolidate_checkpoint(args.checkpoint, args.out_dir))
    return 0


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser; `intermixed=True` accepts options between positionals (`prepare r.yaml --rank 0
    trainer.seed=3`): plain argparse gives a `nargs="*"` positional only the words before the first option."""

    def __init__(self, *args: Any, intermixed: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._in_intermixed = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # the subcommand dispatcher calls this method, and on older Pythons the intermixed parse calls it again
        if not self.intermixed or self._in_intermixed:
            return super().parse_known_args(args, namespace)
        self._in_intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._in_intermixed = False


def _add_recipe_arguments(p: argparse.ArgumentParser, overrides_help: str) -> None:
    """The recipe YAML and its dotlist overrides, the positionals of `fit`, `prepare` and `plan`."""
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", default=[], help=overrides_help)


def build_parser() -> argparse.ArgumentParser:
    from eagle3_zoo import __version__

    parser = argparse.ArgumentParser(prog="eagle3-zoo", description="Train, evaluate and publish EAGLE-3 drafters.")
    parser.add_argument("--version", action="version", version=f"eagle3-zoo {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true",
                        help=f"show the Python traceback of an error (also: {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_SubcommandParser)

    p = sub.add_parser("fit", help="train a drafter from a recipe", description="Train a drafter from a recipe.")
    _add_recipe_arguments(p, "OmegaConf dotlist overrides, e.g. trainer.max_steps=2000")
    p.add_argument("--print-config", action="store_true",
                   help="print the fully resolved recipe (defaults + file + overrides) and exit without training")
    p.set_defaults(func=_cmd_fit)

    p = sub.add_parser("prepare", help="run a recipe's data stage once (regeneration, tokens, features), no training",
                       description="Run the data stage of a recipe as `fit` would (read, regenerate with the target, "
                       "tokenise, draft-vocab counts; offline recipes: the feature job) and cache it, so that `fit` "
                       "starts training at once. Resumable: rerun after an interruption.", intermixed=True)
    _add_recipe_arguments(p, "OmegaConf dotlist overrides (the same ones `fit` will get), before or after the options")
    p.add_argument("--rank", type=int, default=0, help="this process's share of a distributed data stage: "
                   "regeneration (the ranks wait for each other) and feature job (0 <= rank < world size; all ranks "
                   "must share data.cache_dir)")
    p.add_argument("--world-size", type=int, default=1, help="processes of a distributed data stage (>= 1)")
    p.add_argument("--print-config", action="store_true",
                   help="print the fully resolved recipe (defaults + file + overrides) and exit")
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser("plan", help="per-GPU memory of a recipe's training (and feature job), and whether it fits",
                       description="Print what one GPU holds when the recipe trains (target shard, drafter weights + "
                       "grads + AdamW, TTT activations, loss buffers, reserve) and whether it fits "
                       "trainer.gpu_memory_gb; exit 1 when it does not. Offline: uses the target configs shipped in "
                       "the package for zoo targets.")
    _add_recipe_arguments(p, "OmegaConf dotlist overrides, e.g. trainer.devices=4")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("serve", help="start the recipe's engine (a vLLM hidden-states server) on this node",
                       description="Start one vLLM server as the recipe's engine section describes it (parallelism, "
                       "quantisation, context length, extra arguments), extracting the hidden states the recipe's "
                       "drafter reads into engine.hidden_states_dir (a directory the trainers see too). The trainers "
                       "attach to it: engine.mode=attach engine.urls=[http://THIS-HOST:PORT].", intermixed=True)
    _add_recipe_arguments(p, "OmegaConf dotlist overrides (the same ones the trainer gets)")
    p.add_argument("--host", default="0.0.0.0", help="interface to serve on (default: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--print-command", action="store_true", help="print the server command line and exit")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("consolidate", help="write the drafter folder of a training checkpoint (e.g. FSDP sharded)",
                       description="Write the canonical drafter folder (config.json, model.safetensors, recipe.yaml, "
                       "provenance.json: the files a finished run writes) from a checkpoint of `fit`: an FSDP run's "
                       "sharded checkpoint directory (checkpoints/last.ckpt), read in this one process whatever the "
                       "number of ranks that wrote it, or a single-file checkpoint.")
    p.add_argument("checkpoint", help="a run's checkpoints/last.ckpt (directory or file)")
    p.add_argument("out_dir", help="the drafter folder to write (replaced if it exists)")
    p.set_defaults(func=_cmd_consolidate)

    from eagle3_zoo.speculative.eval_cli import add_eval_arguments

    p = sub.add_parser("eval", help="real speculative decoding: tau, per-depth acceptance, speedup, lossless check")
    add_eval_arguments(p)
    p.set_defaults(func=_cmd_eval)

    from eagle3_zoo.hub.cli_commands import add_subparsers

    add_subparsers(sub)  # export, check, publish, pull, zoo
    return parser


def _not_printed_by_lightning(record: logging.LogRecord) -> bool:
    """Root-handler filter: Lightning's records are printed by the console handler that `import lightning` attaches
    to its own logger (whenever it is imported, so the CLI cannot remove it up front without importing torch)."""
    return not (record.name.startswith("lightning") and logging.getLogger("lightning").handlers)


def configure_logging(level: int) -> None:
    """One line per log record: ours through the root handler, Lightning's through its own."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_not_printed_by_lightning)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `fit RECIPE --print-config a=b`: argparse stops filling a positional list at the first option; dotlist
    # overrides after an option are still overrides
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # library code raises; only here does an exception become a message and an exit code
        if debug:
            traceback.print_exc()
        user = isinstance(e, USER_ERRORS)
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        text = f"{message}" if user else f"{type(e).__name__}: {message}"
        hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
        print(f"error: {text}{'' if user else hint}", file=sys.stderr)
        return 2 if user else 1


if __name__ == "__main__":
    sys.exit(main())
