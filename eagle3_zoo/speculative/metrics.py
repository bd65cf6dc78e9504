"""Acceptance and speed metrics of speculative decoding, pooled over the requests of a benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_zoo.speculative.generate import GenerationOutput

PROTOCOL = (
    "tau = tokens per verification cycle = (accepted draft tokens + 1 bonus token) summed over all cycles of the "
    "benchmark / number of cycles (pooled); tau_per_request_mean averages each request's own tau. A cycle is one "
    "target forward verifying a draft; the token the prompt prefill produces is not a cycle. A final cycle cut "
    "short by EOS or max_new_tokens counts what the verifier accepted. acceptance@d = cycles accepting >= d draft "
    "tokens / cycles that accepted >= d-1 and had a draft token at depth d below the last accepted one. "
    "tokens/s = new tokens (prefill token included) / wall time of the requests (prefill included), batch size 1. "
    "speedup = speculative tokens/s / plain KV-cache target decoding tokens/s, same prompts, same process, after "
    "warm-up; a later chat turn is conditioned on the speculative answer for both decoders. "
    "lossless (temperature 0) = the speculative tokens equal the plain greedy tokens for every request."
)


@dataclass
class BenchStats:
    """Running totals of one benchmark (or of all of them)."""

    requests: int = 0
    new_tokens: int = 0
    spec_seconds: float = 0.0
    cycles: int = 0
    cycle_tokens: int = 0  # accepted drafts + bonus, summed over cycles
    request_taus: list[float] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    baseline_requests: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    lossless_checked: int = 0

    def add(self, spec: GenerationOutput, baseline: GenerationOutput | None = None, request_id: str = "",
            check_lossless: bool = False) -> None:
        """Account one request (its speculative output and, optionally, the plain baseline on the same prompt)."""
        self.requests += 1
        self.new_tokens += len(spec.tokens)
        self.spec_seconds += spec.seconds
        self.cycles += spec.cycles
        self.cycle_tokens += sum(spec.accept_lengths) + spec.cycles
        if spec.tau is not None:
            self.request_taus.append(spec.tau)
        for accepted, attempted in zip(spec.accept_lengths, spec.attempted_next):
            self._grow(accepted + int(attempted))
            for d in range(accepted):
                self.depth_attempts[d] += 1
                self.depth_accepts[d] += 1
            if attempted:
                self.depth_attempts[accepted] += 1
        if baseline is not None:
            self.baseline_requests += 1
            self.baseline_tokens += len(baseline.tokens)
            self.baseline_seconds += baseline.seconds
            if check_lossless:
                self.lossless_checked += 1
                if spec.tokens != baseline.tokens:
                    first = next((i for i, (a, b) in enumerate(zip(spec.tokens, baseline.tokens)) if a != b),
                                 min(len(spec.tokens), len(baseline.tokens)))
                    self.mismatches.append({"request": request_id, "first_diff": first})

    def _grow(self, n: int) -> None:
        while len(self.depth_attempts) < n:
            self.depth_attempts.append(0)
            self.depth_accepts.append(0)

    def merge(self, other: BenchStats) -> None:
        """Add another benchmark's totals (for the pooled `overall` row)."""
        for name in ("requests", "new_tokens", "spec_seconds", "cycles", "cycle_tokens", "baseline_tokens",
                     "baseline_seconds", "baseline_requests", "lossless_checked"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.request_taus += other.request_taus
        self.mismatches += other.mismatches
        self._grow(len(other.depth_attempts))
        for d, (a, c) in enumerate(zip(other.depth_attempts, other.depth_accepts)):
            self.depth_attempts[d] += a
            self.depth_accepts[d] += c

    def summary(self) -> dict[str, Any]:
        """The reported numbers (JSON-ready); speed and lossless fields are None when not measured."""
        spec_tps = self.new_tokens / self.spec_seconds if self.spec_seconds > 0 else None
        base_tps = self.baseline_tokens / self.baseline_seconds if self.baseline_seconds > 0 else None
        return {
            "requests": self.requests,
            "new_tokens": self.new_tokens,
            "cycles": self.cycles,
            "tau": self.cycle_tokens / self.cycles if self.cycles else None,
            "tau_per_request_mean": sum(self.request_taus) / len(self.request_taus) if self.request_taus else None,
            "acceptance_per_depth": [c / a if a else None for a, c in zip(self.depth_attempts, self.depth_accepts)],
            "depth_attempts": list(self.depth_attempts),
            "depth_accepts": list(self.depth_accepts),
            "spec_tokens_per_s": spec_tps,
            "baseline_tokens_per_s": base_tps,
            "speedup": spec_tps / base_tps if spec_tps and base_tps else None,
            "lossless": (not self.mismatches) if self.lossless_checked else None,
            "lossless_checked": self.lossless_checked,
            "lossless_mismatches": list(self.mismatches),
        }
