"""`eagle3-zoo fit | prepare | plan | serve | consolidate`: a recipe's data stage, training, memory plan, the engine
side of a recipe, and the drafter folder of a checkpoint."""

from __future__ import annotations

import argparse
import json


def _print_config(args: argparse.Namespace) -> bool:
    """`--print-config`: print the fully resolved recipe and tell the caller to stop."""
    if not args.print_config:
        return False
    from eagle3_zoo.recipe.sections import load_recipe, resolved_recipe_yaml

    print(resolved_recipe_yaml(load_recipe(args.recipe, args.overrides)), end="")
    return True


def cmd_fit(args: argparse.Namespace) -> int:
    if _print_config(args):
        return 0
    from eagle3_zoo.recipe.decisions import require_accelerator
    from eagle3_zoo.recipe.sections import load_recipe

    # a bad recipe, or GPUs this machine lacks, is refused before Lightning and torch are imported (seconds to a
    # minute on a loaded machine)
    recipe = load_recipe(args.recipe, args.overrides)
    require_accelerator(recipe.trainer, args.recipe)
    from eagle3_zoo.training.fit import fit

    print(fit(recipe, source=args.recipe))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    if _print_config(args):
        return 0
    from eagle3_zoo.recipe.sections import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # refused before the data stage's imports (torch) are paid
    from eagle3_zoo.data.stage import prepare_recipe

    summary = prepare_recipe(recipe, rank=args.rank, world_size=args.world_size)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from eagle3_zoo.recipe.sections import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # refused before the plan's imports (torch) are paid
    from eagle3_zoo.training.planner.plan import plan_recipe

    plan = plan_recipe(recipe, source=args.recipe)
    print(plan.table())  # its last line names the phases that do not fit
    # any phase that does not fit fails the plan: a regeneration or feature job that cannot run blocks as training does
    return 1 if plan.not_fitting() else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.targets.deployment import serve_recipe

    print(serve_recipe(load_recipe(args.recipe, args.overrides), args.host, args.port, dry_run=args.print_command,
                       allow_no_key=args.no_api_key, node_rank=args.node_rank, source=args.recipe))
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from eagle3_zoo.training.rundir.outputs import consolidate_checkpoint

    print(consolidate_checkpoint(args.checkpoint, args.out_dir))
    return 0


def _recipe_arguments(p: argparse.ArgumentParser, overrides_help: str, print_config: str | None = None) -> None:
    """The recipe YAML and its dotlist overrides, the positionals of `fit`, `prepare` and `plan`, and
    `--print-config` where the command has it (`print_config`: what it does instead of running)."""
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", default=[], help=overrides_help)
    if print_config:
        p.add_argument("--print-config", action="store_true", help="print the fully resolved recipe (defaults + "
                       f"file + overrides) and exit {print_config}")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add fit, prepare, plan, serve and consolidate to the `eagle3-zoo` subcommands."""
    p = sub.add_parser("fit", help="train a drafter from a recipe", description="Train a drafter from a recipe.",
                       parents=[common])
    _recipe_arguments(p, "OmegaConf dotlist overrides, e.g. trainer.max_steps=2000", "without training")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("prepare", help="run a recipe's data stage once (regeneration, tokens, features), no training",
                       description="Run the data stage of a recipe as `fit` would (read, regenerate with the target, "
                       "tokenise, draft-vocab counts; offline recipes: the feature job) and cache it, so that `fit` "
                       "starts training at once. Resumable: rerun after an interruption.", intermixed=True,
                       parents=[common])
    _recipe_arguments(p, "OmegaConf dotlist overrides (the same ones `fit` will get), before or after the options",
                      "without preparing anything")
    p.add_argument("--rank", type=int, default=0, help="this process's share of a distributed data stage: "
                   "regeneration (the ranks wait for each other) and feature job (0 <= rank < world size; all ranks "
                   "must share data.cache_dir)")
    p.add_argument("--world-size", type=int, default=1, help="processes of a distributed data stage (>= 1)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("plan", help="per-GPU memory of every phase of a recipe's run, and whether each fits",
                       description="Print the run's decisions (world size, what of the target each trainer rank "
                       "loads, shard layout, dtypes, where each phase runs) and what one GPU holds in every phase: "
                       "regeneration (in process: the target + its KV cache; in an engine: weights per GPU and KV "
                       "budget), hidden states (training step, feature job or engine), the training step and the tau "
                       "evaluation, each against the GPU memory it runs on (trainer.gpu_memory_gb, "
                       "engine.gpu_memory_gb); exit 1 naming the phases that do not fit. Offline: uses the target "
                       "configs shipped in the package for zoo targets.", parents=[common])
    _recipe_arguments(p, "OmegaConf dotlist overrides, e.g. trainer.devices=4")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("serve", help="start the recipe's engine (a vLLM hidden-states server) on this node",
                       description="Start one vLLM server as the recipe's engine section describes it (parallelism, "
                       "quantisation, context length, extra arguments), extracting the hidden states the recipe's "
                       "drafter reads into engine.hidden_states_dir (a directory the trainers see too). The trainers "
                       "attach to it: engine.mode=attach engine.urls=[http://THIS-HOST:PORT] (serve with --host "
                       "0.0.0.0 for other nodes; with engine.api_key_env the server requires that key and the "
                       "trainers send it).", intermixed=True,
                       parents=[common])
    _recipe_arguments(p, "OmegaConf dotlist overrides (the same ones the trainer gets)")
    p.add_argument("--host", default="127.0.0.1", help="interface to serve on (default: 127.0.0.1, this machine "
                   "only; 0.0.0.0 for the trainers of other nodes, which needs engine.api_key_env or --no-api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535 (default: 8000)")
    p.add_argument("--no-api-key", action="store_true", help="serve a non-loopback --host without an API key (any "
                   "host that reaches the port can use the engine; only on a network you trust)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank in an engine over engine.num_nodes "
                   "nodes (default 0: the node that serves the API; 1..N-1 start headless workers that join it at "
                   "engine.master_addr)")
    p.add_argument("--print-command", action="store_true", help="print the command line for the engine's machine "
                   "(engine.platform; this one or another) and exit")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("consolidate", help="write the drafter folder of a training checkpoint (e.g. FSDP sharded)",
                       description="Write the canonical drafter folder (config.json, model.safetensors, recipe.yaml, "
                       "provenance.json: the files a finished run writes) from a checkpoint of `fit`: an FSDP run's "
                       "sharded checkpoint directory (checkpoints/last.ckpt), read in this one process whatever the "
                       "number of ranks that wrote it, or a single-file checkpoint.", parents=[common])
    p.add_argument("checkpoint", help="a run's checkpoints/last.ckpt (directory or file)")
    p.add_argument("out_dir", help="the drafter folder to write (replaced if it exists)")
    p.set_defaults(func=cmd_consolidate)
