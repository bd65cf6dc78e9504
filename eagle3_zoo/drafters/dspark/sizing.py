"""The buffers of a DSpark training step (`DSparkKind.step_lines`, for `plan`): DFlash's (the same backbone over the
same blocks, `eagle3_zoo.drafters.dflash.sizing.step_lines`) plus what DSpark adds. Imports no torch."""

from __future__ import annotations

from typing import Any

from eagle3_zoo.drafters.base import StepLine, StepSizing
from eagle3_zoo.drafters.dflash import sizing as dflash_sizing


def step_lines(section: Any, config: Any, target_config: Any, sizing: StepSizing) -> list[StepLine]:
    """DFlash's lines (`drafter.dspark`'s backbone), plus an estimate from DSpark's shapes: the target's last hidden
    state over the batch, and per supervised row (batch x anchors x block_size at most: every slot predicts) the
    Markov embedding, the target's hidden row and the confidence head's fp32 input kept for backward, and the target
    side of one checkpointed chunk (the target's fp32 logits over the whole vocabulary and their softmax). DFlash's
    "loss chunk" line counts block_size - 1 rows per block, one fewer than DSpark supervises."""
    lines = dflash_sizing.step_lines(section, config, target_config, sizing, subsection="dspark", title="DSpark")
    d = section.dspark
    batch, length = sizing.batch_size, sizing.max_length
    tokens, rows = batch * length, batch * min(d.num_anchors, length) * config.block_size
    fdt = sizing.feature_dtype
    h, r = config.target_hidden_size, config.markov_rank
    per_row = r * 4 + h * fdt.itemsize + ((config.hidden_size + r) * 4 if config.enable_confidence_head else 0) + 4 * 4
    chunk = sizing.logits_chunk * config.vocab_size * 4 * 3
    lines.append(StepLine("DSpark target distribution and heads", tokens * h * fdt.itemsize + rows * per_row + chunk,
                          f"the target's last hidden state ({tokens} tokens, {str(fdt).removeprefix('torch.')}); "
                          f"{rows} supervised rows at most x (Markov embedding r={r}, target hidden row"
                          f"{', confidence input' if config.enable_confidence_head else ''}); one "
                          f"[{sizing.logits_chunk}, {config.vocab_size}] fp32 target logits chunk and its softmax"))
    return lines
