"""`eagle3-zoo export | check | publish | pull | zoo`: drafter folders and the Hub.

Handlers return 0, or 1 when `check` / `pull` found problems; exceptions go to `eagle3_zoo.cli.main` like every
other command's. They never print the Hub token, and no command takes one on the command line (shell history,
process lists): use `HF_TOKEN` or `hf auth login`.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict

from eagle3_zoo.values import layout_names

log = logging.getLogger(__name__)


def cmd_export(args: argparse.Namespace) -> int:
    from eagle3_zoo.api import DrafterFolder
    from eagle3_zoo.checkpoint.layouts import detect_format

    out = DrafterFolder.open(args.drafter_dir).export(args.out, args.format, force=args.force, verifier=args.verifier,
                                                      num_speculative_tokens=args.num_speculative_tokens)
    # the name asked for (canonical = sglang), else the layout written (the drafter kind's default)
    print(f"exported {args.drafter_dir} -> {out} ({args.format or detect_format(out)} format)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from eagle3_zoo.api import DrafterFolder

    if args.config_only:
        from eagle3_zoo.checkpoint.check import check_drafter

        report = check_drafter(args.path, args.target, config_only=True)
    else:
        report = DrafterFolder.open(args.path).check(target=args.target)
    if args.json:
        print(json.dumps({"path": report.path, "format": report.format, "ok": report.ok,
                          "problems": [asdict(p) for p in report.problems]}, indent=2))
    else:
        print(report if report.problems else f"{report.path} ({report.format}): no problems found")
    failed = report.errors or (args.strict and report.warnings)
    if getattr(args, "engine", None) == "vllm" and not report.errors:
        from eagle3_zoo.speculative.engine_eval import engine_smoke

        smoke = engine_smoke(args.path, target=args.target)
        print(smoke["message"])
        failed = failed or not smoke["ok"]
    return 1 if failed else 0


def cmd_publish(args: argparse.Namespace) -> int:
    from eagle3_zoo.hub.upload import publish

    result = publish(args.drafter_dir, args.repo_id, private=args.private, create_pr=args.create_pr,
                     dry_run=args.dry_run, endpoint=args.endpoint, stage_dir=args.stage_dir, fmt=args.format,
                     license=args.license, force=args.force)
    if result.dry_run:
        print(f"dry run: staged {len(result.files)} files in {result.stage_dir} (no request made):")
        print("\n".join(f"  {f}" for f in result.files))
    else:
        print(f"published {result.repo_id}: {result.pr_url or result.commit_url}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from eagle3_zoo.hub.download import pull

    result = pull(args.repo, revision=args.revision, target=args.target, convert_to=args.convert_to,
                  out_dir=args.out, endpoint=args.endpoint)
    print(f"pulled {result.repo_id} ({result.format} format) into {result.path}")
    if result.converted_path:
        print(f"converted copy: {result.converted_path}")
    elif args.convert_to:
        print(f"not converted to {args.convert_to}: the check found errors")
    print(result.report if result.report.problems else "check: no problems found")
    return 0 if result.report.ok else 1


def cmd_zoo(args: argparse.Namespace) -> int:
    from eagle3_zoo.hub.zoo import list_zoo, show_zoo

    if args.action == "show":
        if not args.name:
            raise ValueError("zoo show needs a NAME (see `eagle3-zoo zoo list`)")
        entry = show_zoo(args.name)
        print(json.dumps(asdict(entry), indent=2) if args.json else
              "\n".join(f"{k:>9}: {v}" for k, v in asdict(entry).items()))
        return 0
    entries = list_zoo(family=args.family, target=args.target)
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=2))
        return 0
    header = ("name", "repo", "target", "family", "kind", "format", "status", "recipe")
    rows = [(e.name, e.repo_id or "-", e.target, e.family, e.kind, e.format, e.status, e.recipe or "-")
            for e in entries]
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add export, check, publish, pull and zoo to the `eagle3-zoo` subcommands; each sets `func=handler`."""
    layouts = layout_names.export_choices()  # the written layouts' names and aliases (torch-free)
    p = subparsers.add_parser("export", help="write a drafter in the SGLang (canonical) or speculators layout",
                              parents=[common])
    p.add_argument("drafter_dir", help="drafter folder (any supported format)")
    p.add_argument("--format", choices=layouts, default=None,
                   help="EAGLE-3: sglang or canonical (two names of one format, the same files byte for byte: SGLang, "
                   "vLLM and the official loaders read it) or speculators (vLLM's own format); DFlash: dflash (z-lab) "
                   "or speculators; default: sglang for EAGLE-3, dflash for DFlash")
    p.add_argument("--out", required=True, help="output folder (replaced in one rename; in an existing drafter "
                   "folder, files of other names are kept)")
    p.add_argument("--force", action="store_true", help="write into an existing --out that is not a drafter folder "
                   "(files of the names export writes are replaced, the others kept)")
    p.add_argument("--verifier", help="speculators: the target as speculators resolves it, a Hub id or a local folder "
                   "(default: the drafter's target, mapped to its Hub id when it is a zoo alias)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="speculators: vLLM's default draft length (default: 3 for EAGLE-3, block_size - 1 for DFlash)")
    p.set_defaults(func=cmd_export)

    p = subparsers.add_parser("check", help="check a drafter folder for loader/target incompatibilities",
                              parents=[common])
    p.add_argument("path", help="drafter folder")
    p.add_argument("--target", help="target Hub id or local folder to check against (config.json only)")
    p.add_argument("--strict", action="store_true", help="warnings fail too")
    p.add_argument("--config-only", action="store_true", help="check config.json alone, no weights (a published "
                   "drafter's config before downloading it)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--engine", choices=["vllm"], default=None,
                   help="also load the drafter in vLLM with the target and decode two short prompts: fails if it "
                        "does not load or accepts no draft token (the engine venv: scripts/setup_engine.sh)")
    p.set_defaults(func=cmd_check)

    p = subparsers.add_parser("publish", help="check, stage and upload a drafter with its model card",
                              parents=[common])
    p.add_argument("drafter_dir", help="drafter folder to publish (e.g. runs/NAME/drafter)")
    p.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub")
    p.add_argument("--format", choices=layouts, default=None,
                   help="layout of the uploaded weights (see export; default: sglang for EAGLE-3, dflash for DFlash)")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to main")
    p.add_argument("--dry-run", action="store_true", help="stage the folder only; no network request")
    p.add_argument("--stage-dir", help="where to stage (default: a temporary folder): a new or empty folder, or one "
                   "an earlier publish staged (replaced)")
    p.add_argument("--force", action="store_true", help="stage into a non-empty --stage-dir that no publish staged "
                   "(its files of other names are kept and uploaded too)")
    p.add_argument("--license", default="apache-2.0", help="license of the drafter weights (card metadata)")
    p.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    p.set_defaults(func=cmd_publish)

    p = subparsers.add_parser("pull", help="download a drafter (Hub id or zoo name), check it, optionally convert",
                              parents=[common])
    p.add_argument("repo", help="Hub repo id or zoo name")
    p.add_argument("--revision", help="branch, tag or commit of the repository (default: main)")
    p.add_argument("--target", help="target Hub id or local folder to check against")
    p.add_argument("--convert-to", choices=layouts, help="also write the drafter in this layout next to the download")
    p.add_argument("--out", help="download folder (default: the Hugging Face cache)")
    p.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    p.set_defaults(func=cmd_pull)

    p = subparsers.add_parser("zoo", help="known drafters and recipes",
                              parents=[common])
    p.add_argument("action", choices=["list", "show"], nargs="?", default="list",
                   help="list every entry, or show one (default: list)")
    p.add_argument("name", nargs="?", help="zoo name or repo id (for show)")
    p.add_argument("--family", help="list only drafters for targets of this family (HF model_type, e.g. qwen3)")
    p.add_argument("--target", help="list only drafters for this target (Hub id or local name, e.g. Qwen/Qwen3-8B)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_zoo)
