"""Lossless speculative decoding with EAGLE-3 drafters (chain and EAGLE-2 dynamic trees) and acceptance benchmarks.

Batch size 1. Data flow of one request: `TargetRunner.prefill` -> loop { `build_tree` (drafter) ->
`TargetRunner.verify` (one target forward) -> `accept` -> prune caches } -> stop like `generate`.

Names are loaded on first use (PEP 562; no submodule shares a name with an export), so `eagle3-zoo --help` and
the eval argument parser import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_zoo.util.lazy import lazy_exports

_EXPORTS = {
    "Acceptance": "acceptance", "SamplingParams": "acceptance", "accept": "acceptance", "next_token": "acceptance",
    "BenchPrompt": "benchmarks", "Benchmark": "benchmarks", "load_benchmark": "benchmarks",
    "TauEvalCallback": "callback",
    "DraftModel": "draft",
    "EvalResults": "evaluation", "EvalSettings": "evaluation", "evaluate": "evaluation",
    "format_table": "evaluation", "plot_acceptance": "evaluation",
    "write_results": "evaluation",
    "MODES": "generate", "GenerationOutput": "generate", "SpeculativeGenerator": "generate",
    "plain_generate": "generate", "tree_spec": "generate",
    "PROTOCOL": "metrics", "BenchStats": "metrics",
    "NodeLogits": "target", "TargetRunner": "target",
    "DraftTree": "tree", "build_tree": "tree",
}

if TYPE_CHECKING:
    from eagle3_zoo.speculative.acceptance import Acceptance, SamplingParams, accept, next_token
    from eagle3_zoo.speculative.benchmarks import Benchmark, BenchPrompt, load_benchmark
    from eagle3_zoo.speculative.callback import TauEvalCallback
    from eagle3_zoo.speculative.draft import DraftModel
    from eagle3_zoo.speculative.evaluation import (
        EvalResults,
        EvalSettings,
        evaluate,
        format_table,
        plot_acceptance,
        write_results,
    )
    from eagle3_zoo.speculative.generate import MODES, GenerationOutput, SpeculativeGenerator, plain_generate, tree_spec
    from eagle3_zoo.speculative.metrics import PROTOCOL, BenchStats
    from eagle3_zoo.speculative.target import NodeLogits, TargetRunner
    from eagle3_zoo.speculative.tree import DraftTree, build_tree

# looked up in their module on every use (not kept here)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, cache=False)


__all__ = [
    "MODES",
    "PROTOCOL",
    "Acceptance",
    "BenchPrompt",
    "BenchStats",
    "Benchmark",
    "DraftModel",
    "DraftTree",
    "EvalResults",
    "EvalSettings",
    "GenerationOutput",
    "NodeLogits",
    "SamplingParams",
    "SpeculativeGenerator",
    "TargetRunner",
    "TauEvalCallback",
    "accept",
    "build_tree",
    "evaluate",
    "format_table",
    "load_benchmark",
    "next_token",
    "plain_generate",
    "plot_acceptance",
    "tree_spec",
    "write_results",
]
