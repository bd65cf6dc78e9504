"""Live compatibility check: a short real speculative decode with the target, catching the drafter that loads
fine and then accepts almost nothing (tau close to 1), which no static check can prove absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from eagle3_zoo.hub.check import CheckReport, Problem
from eagle3_zoo.modeling import Eagle3Drafter

_HINTS = ("aux layer ids in the wrong convention (SGLang field = HF index - 1)", "a d2t that does not belong to this "
          "target's vocabulary", "a different RoPE base than training", "a drafter trained for another target or "
          "chat template", "an untrained or barely trained drafter")


@dataclass
class LiveCheckResult:
    """Measured tau (pooled over prompts) against `min_tau`, with static findings that may explain a low value."""

    tau: float | None
    per_prompt_tau: list[float | None]
    min_tau: float
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)


def _prompt_ids(prompt: str | Sequence[int] | torch.Tensor, tokenizer: Any) -> torch.Tensor:
    if isinstance(prompt, torch.Tensor):
        return prompt.reshape(-1).long()
    if not isinstance(prompt, str):
        return torch.tensor(list(prompt), dtype=torch.long)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=False)
        return torch.as_tensor(ids).reshape(-1)
    return torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.long)


def live_check(
    drafter: Eagle3Drafter,
    target: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str | Sequence[int] | torch.Tensor],
    min_tau: float = 1.5,
    max_new_tokens: int = 32,
    depth: int = 4,
) -> LiveCheckResult:
    """Decode `prompts` greedily with chain drafting (depth `depth`) and require tau >= `min_tau`.

    Args:
        drafter: the drafter to check (already loaded, e.g. with `import_drafter`).
        target: the target `*ForCausalLM` (eval mode).
        tokenizer: the target's tokenizer (chat template applied to string prompts); unused for token-id prompts.
        prompts: a few prompts (strings, or token ids).
        min_tau: the lowest acceptable tokens per verification cycle (1.0 = nothing ever accepted).
        max_new_tokens: tokens per prompt.
        depth: draft tokens per cycle.

    Returns:
        A `LiveCheckResult`; a LOW_TAU error lists the usual causes plus any static problem of the drafter config
        against `target.config`.
    """
    from eagle3_zoo.speculative import SpeculativeGenerator, tree_spec

    if not prompts:
        raise ValueError("live_check needs at least one prompt")
    generator = SpeculativeGenerator(target, drafter, tree_spec("chain", depth=depth))
    taus, accepted, cycles = [], 0, 0
    for prompt in prompts:
        out = generator.generate(_prompt_ids(prompt, tokenizer), max_new_tokens)
        taus.append(out.tau)
        accepted, cycles = accepted + sum(out.accept_lengths), cycles + out.cycles
    tau = (accepted + cycles) / cycles if cycles else None
    result = LiveCheckResult(tau, taus, min_tau)
    if tau is not None and tau < min_tau:
        from eagle3_zoo.hub.check_target import target_problems

        report = CheckReport("drafter")
        target_problems(drafter.config.to_json_dict(), "sglang", drafter.config, target.config, report)
        found = "; ".join(f"{p.code}: {p.message}" for p in report.problems) or "no static problem found"
        result.problems.append(Problem(
            "LOW_TAU", f"measured tau {tau:.2f} < {min_tau} over {len(prompts)} prompt(s) ({cycles} cycles): the "
            f"drafter loads but its proposals are rejected. Static findings: {found}",
            "check for " + ", ".join(_HINTS)))
        result.problems += report.problems
    return result
