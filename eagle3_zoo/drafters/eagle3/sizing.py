"""The config of a fresh EAGLE-3 drafter from the recipe's `drafter` section and the target's config
(`Eagle3Kind.config_from`), and the buffers of its training step (`Eagle3Kind.step_lines`: the TTT rollout's saved
tensors, `ttt_saved_bytes`). Imports no torch: `plan` builds and sizes it without the kind's model code (`config_from`
and `step_lines` of `eagle3_zoo.drafters`)."""

from __future__ import annotations

import math
from typing import Any

from eagle3_zoo.drafters.base import StepLine, StepSizing
from eagle3_zoo.modeling.config import Eagle3Config

# the recipe's drafter-shape fields (null: the target family's published-drafter shape, else the target's)
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def config_from(section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                defaults: dict[str, Any], target_name: str, torch_dtype: str) -> Eagle3Config:
    """An `Eagle3Config` sized like the target: the family's published-drafter shape (`defaults`), then the
    section's non-null shape fields on top; its draft vocabulary size and EAGLE-3.1 flags from the section."""
    overrides = {k: defaults[k] for k in SHAPE_FIELDS if k in defaults}
    overrides.update({k: getattr(section, k) for k in SHAPE_FIELDS if getattr(section, k) is not None})
    return Eagle3Config.from_target_config(
        target_config, draft_vocab_size=section.draft_vocab_size, aux_layer_ids=aux_layer_ids,
        target_name_or_path=target_name, torch_dtype=torch_dtype, fc_norm=section.fc_norm,
        norm_output=section.norm_output, **overrides)


def ttt_saved_bytes(config: Any, tokens: int, steps: int, compute: Any = None,
                    supervised: float | None = None) -> dict[str, float]:
    """Bytes the TTT rollout and loss keep for backward (an estimate from the drafter's shapes, per dtype).

    `compute` is the matmuls' dtype (a torch dtype: autocast's under `*-mixed`, the weights' under `*-true`; None:
    float32). Per token and TTT step k, in `compute`: the norm outputs, the one cast attention input (2H) and MLP
    input, i.e. 6H; q and the attention output (2 q-widths); the MLP gate, activation, up and product (4I); the keys
    and values the attention reads, k0 and v0 at step 0, the stacked diagonal keys/values (2k kv-widths) and, below
    fp32, k0 cast again. In fp32 whatever the compute dtype: the two norm inputs that need a gradient (2H) and their
    scales, RoPE's cos/sin and the log-sum-exp and diagonal weights (heads x (k + 1)). Per supervised row and step:
    the gathered hidden and the final norm's output (fp32 input below fp32), the fused loss's hidden gradient (fp32)
    and the row indices. Step 0 adds the fc input; under autocast with fp32 weights, autocast's copy of each matmul
    weight but fc's and the lm_head's (`autocast_weights`). Checked against the tensors a real TTT loss saves (fp32
    and bf16 autocast) in tests/test_plan.py.

    Returns:
        `{"activations", "loss_rows", "fc_input", "autocast_weights"}` in bytes.
    """
    h, inter, d, heads = config.hidden_size, config.intermediate_size, config.head_dim, config.num_attention_heads
    q, kv = heads * d, config.num_key_value_heads * d
    sup = tokens if supervised is None else supervised
    c = 4 if compute is None else compute.itemsize
    low = c < 4
    # sum over k of the keys/values: 2 kv at step 0, then 2k kv (+ kv for the recast k0 below fp32)
    keys = kv * (2 + sum(2 * k + low for k in range(1, steps)))
    per_token = steps * (6 * h + 2 * q + 4 * inter) * c + keys * c
    per_token += (steps * (2 * h + 2 + 2 * d) + heads * steps * (steps + 1) // 2) * (4 if low else c)
    rows = sup * steps * ((h * (c + 4) + 4 if low else 2 * h * c + 4) + 4 * h + 16)
    n_aux = len(config.aux_layer_ids or (0, 0, 0))
    weights = 0
    if low:  # not fc's: the features need no gradient, so its backward needs only its input
        weights = sum(math.prod(shape) for name, (shape, kind) in config.parameter_shapes().items()
                      if kind == "linear" and name not in ("lm_head.weight", "fc.weight")) * c
    return {"activations": per_token * tokens, "loss_rows": rows, "fc_input": n_aux * config.target_hidden_size
            * tokens * c, "autocast_weights": weights}


def step_lines(section: Any, config: Eagle3Config, target_config: Any, sizing: StepSizing) -> list[StepLine]:
    """The buffers of one EAGLE-3 training step: the target's forward (online) or a chunk of its logits from the
    stored final hidden; what the TTT rollout keeps for backward over `sizing.ttt_steps` (`ttt_saved_bytes`;
    the MLP's activations of all steps but one are recomputed under activation checkpointing); autocast's weight
    copies; the target probabilities over the draft vocabulary and one lm_head gradient buffer."""
    compute = sizing.compute_dtype
    compute_name = str(compute).removeprefix("torch.")
    tokens, steps = sizing.batch_size * sizing.max_length, sizing.ttt_steps
    lines = []
    if sizing.target_in_step:
        h, inter = target_config.hidden_size, target_config.intermediate_size
        lines.append(StepLine("target forward", tokens * (6 * h + 3 * inter) * sizing.target_dtype.itemsize
                              + sizing.logits_chunk * target_config.vocab_size * 4,
                              "one layer's activations (no grad) + a chunk of fp32 logits"))
    else:
        lines.append(StepLine("target logits chunk", sizing.logits_chunk * target_config.vocab_size * 4,
                              "fp32 lm_head logits of the stored final hidden, a chunk at a time"))
    saved = ttt_saved_bytes(config, tokens, steps, compute)
    act = saved["activations"]
    note = f"{steps} TTT steps x {tokens} tokens (batch {sizing.batch_size} x {sizing.max_length}), {compute_name}"
    if sizing.activation_checkpointing:  # the MLP's 4 [T, I] tensors are recomputed in backward, one step at a time
        act -= (steps - 1) * 4 * config.intermediate_size * tokens * compute.itemsize
        note += "; MLP activations recomputed (activation checkpointing)"
    lines.append(StepLine("TTT activations", act + saved["loss_rows"] + saved["fc_input"], note))
    copies = saved["autocast_weights"] if sizing.autocast_copies else 0
    if copies:
        lines.append(StepLine("autocast weight copies", copies,
                              f"{compute_name} copies of the drafter's fp32 matmul weights (kept for backward)"))
    vd = config.draft_vocab_size
    lines.append(StepLine("loss buffers", tokens * vd * 4 + vd * config.hidden_size * 4,
                          f"target probabilities over {vd} draft tokens + one lm_head gradient buffer (fp32)"))
    return lines
