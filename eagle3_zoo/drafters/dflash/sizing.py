"""The config of a fresh DFlash drafter from the recipe's `drafter` section and the target's config
(`DFlashKind.config_from`), and the buffers of its training step (`DFlashKind.step_lines`: what `dflash_loss` saves,
`dflash_saved_bytes`). Imports no torch: `plan` builds and sizes it without the kind's model code (`config_from` and
`step_lines` of `eagle3_zoo.drafters`).

The mask token: the `drafter.dflash.mask_token_id` of the recipe, else the target config's `mask_token_id` when it has
one, else the last id of the target's vocabulary (`vocab_size - 1`).
"""

from __future__ import annotations

import math
from typing import Any

from eagle3_zoo.drafters.base import StepLine, StepSizing
from eagle3_zoo.drafters.dflash.config import DFlashConfig

# the recipe's `drafter` shape fields a DFlash drafter takes as overrides of the target's (hidden_size must equal it)
SHAPE_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def mask_token_for(target_config: Any, wanted: int | None) -> int:
    """The mask token id (see the module docstring): `wanted`, else the target config's `mask_token_id`, else
    `vocab_size - 1`."""
    if wanted is not None:
        return int(wanted)
    own = getattr(target_config, "mask_token_id", None)
    return int(own) if isinstance(own, int) and not isinstance(own, bool) else int(target_config.vocab_size) - 1


def config_from(section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                defaults: dict[str, Any], target_name: str, torch_dtype: str, subsection: str = "dflash",
                config_class: Any = DFlashConfig, extras: dict[str, Any] | None = None) -> DFlashConfig:
    """A `DFlashConfig` (or `config_class`, a kind built on DFlash's config) sized like the target, with the section's
    `subsection` (`dflash`; DSpark's `dspark`: draft layers, block size, feature layers, mask token), the shape
    overrides and `extras` (config fields of a kind built on DFlash); `aux_layer_ids` (the data stage's convention,
    target_layer_id + 1) win over the subsection's `target_layer_ids`."""
    d = getattr(section, subsection)
    overrides = {k: getattr(section, k) for k in SHAPE_FIELDS if getattr(section, k, None) is not None}
    if aux_layer_ids is not None:  # the data stage's convention: target_layer_id + 1
        ids: Any = tuple(i - 1 for i in aux_layer_ids)
    else:
        ids = tuple(d.target_layer_ids) if d.target_layer_ids is not None else None
    vocab = int(target_config.vocab_size)
    return config_class.from_target_config(
        target_config, mask_token_id=mask_token_for(target_config, d.mask_token_id),
        num_hidden_layers=d.num_layers, num_features=d.num_target_features, target_layer_ids=ids,
        block_size=d.block_size, draft_vocab_size=min(section.draft_vocab_size, vocab),
        target_name_or_path=target_name, torch_dtype=torch_dtype, **overrides, **(extras or {}))


def dflash_saved_bytes(config: Any, batch: int, max_length: int, num_anchors: int,
                       compute: Any = None, attention: str = "dense",
                       supervised: float | None = None) -> dict[str, float]:
    """Bytes a DFlash training step (`dflash_loss`, all blocks in one forward) keeps for backward, from the drafter's
    shapes (`DFlashConfig`), per dtype.

    T = batch x max_length context positions, Q = batch x min(num_anchors, max_length) x block_size query slots.
    `compute` is the matmuls' dtype (a torch dtype: autocast's under `*-mixed`; the parts called fp32 below are the
    stored dtype under `*-true`; None: float32). Context: fc's input (cast), the hidden norm's fp32 input, normalised
    output (cast) and scale, its output as k_proj's and v_proj's input (cast again by every layer's two projections
    under autocast, one fp32 tensor otherwise), the context RoPE cos/sin (fp32), and per layer the context keys
    before and after k_norm (fp32, cast) and their scales. Query slots, per layer: the residual and normalised states
    of both norms (fp32; layer 0's input needs no gradient) and their outputs (fp32, or the q/k/v and gate/up casts
    under autocast); q before and after q_norm, after RoPE (cast for the kernel) and the attention output (o_proj's
    input); the block's keys before and after k_norm; the keys and values the attention reads (context + block, T + Q
    rows); the norms' scales and the attention's log-sum-exp; the MLP's gate, activation, up and product (4I); on the
    dense path (`attention="dense"`, CPU) the `[Q, max_length + block]` mask converted to an additive mask in
    `compute` (FlexAttention saves none). The final norm's input and normalised output. Loss rows (at most
    `supervised` = batch x min(num_anchors, max_length) x (block_size - 1)): the gathered hidden rows the
    checkpointed chunks read, their row indices, labels, weights and mask; the `[chunk, V]` logits are recomputed in
    backward, not saved. Under autocast with fp32 weights, autocast's copy of each matmul weight but fc's (its input
    needs no gradient) and the lm_head's (the chunks recompute it). Checked against the tensors a real `dflash_loss`
    saves (fp32 and bf16 autocast, dense mask) in tests/test_plan.py.

    Returns:
        `{"context", "blocks", "mask", "loss_rows", "autocast_weights"}` in bytes.
    """
    if attention not in ("dense", "flex"):
        raise ValueError(f"attention={attention!r}; expected 'dense' or 'flex'")
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kvh, n_layers, bsz = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers, \
        config.block_size
    qw, kw = heads * d, kvh * d
    c = 4 if compute is None else compute.itemsize
    low = c < 4
    f = 4 if low else c  # the fp32 parts (the residual stream, the norms' statistics, RoPE)
    blocks = min(num_anchors, max_length)
    t, q = batch * max_length, batch * blocks * bsz
    fc_in = config.num_features * config.target_hidden_size
    context = t * fc_in * c + t * h * (f + c + (2 * n_layers if low else 1) * c) + t * f + 2 * t * d * f
    context += n_layers * (t * kw * (f + c) + t * kvh * f)
    states = (4 * n_layers + 1) * f + (5 * n_layers * c if low else 2 * n_layers * f)
    per_layer = (qw * (f + 3 * c) + 2 * heads * f + kw * (f + c) + kvh * f + 4 * inter * c) * q
    per_layer += 2 * (t + q) * kw * c
    block = q * h * states + 2 * n_layers * q * f + 2 * q * d * f + n_layers * per_layer
    mask = n_layers * q * (max_length + blocks * bsz) * c if attention == "dense" else 0
    sup = batch * blocks * (bsz - 1) if supervised is None else supervised
    rows = sup * (h * f + 3 * 8 + 8 + 4 + 1) + 8
    weights = 0
    if low:
        weights = sum(math.prod(shape) for name, (shape, kind) in config.parameter_shapes().items()
                      if kind == "linear" and name not in ("lm_head.weight", "fc.weight")) * c
    return {"context": context, "blocks": block, "mask": mask, "loss_rows": rows, "autocast_weights": weights}


def step_lines(section: Any, config: DFlashConfig, target_config: Any, sizing: StepSizing,
               subsection: str = "dflash", title: str = "DFlash") -> list[StepLine]:
    """The buffers of one DFlash training step (`DFlashKind.training_loss`): the target's forward to the feature
    layers when the step runs it, the features (`sizing.feature_dtype`, and the drafter's stored dtype they are cast
    to), what `dflash_loss` keeps for backward (`dflash_saved_bytes`: FlexAttention on a GPU, the dense mask on a CPU,
    as `DFlashObjective` picks), one checkpointed `[chunk, V]` logits chunk (forward, then its recomputation in
    backward with the logits' gradient; with soft labels (`labels: soft`, when the kind's `training_features` asks
    for the target's last hidden state) also that state, the target's fp32 `[chunk, V]` logits and their softmax over
    the draft vocabulary, and the gathered `[rows, H]` target states) and, under `*-mixed` outside FSDP's bf16
    policy, autocast's weight copies. `section`: the recipe's `drafter` section; `subsection` and `title`: its
    subsection and the name on the lines of a kind built on DFlash (DSpark)."""
    d = getattr(section, subsection)
    final = getattr(d, "labels", "hard") == "soft"  # DFlashKind.training_features: the last hidden state for soft
    compute, sbytes = sizing.compute_dtype, sizing.drafter_dtype.itemsize
    tbytes, compute_name = sizing.target_dtype.itemsize, str(compute).removeprefix("torch.")
    batch, length = sizing.batch_size, sizing.max_length
    tokens, blocks = batch * length, min(d.num_anchors, length)
    attention = "flex" if sizing.on_gpu else "dense"
    saved = dflash_saved_bytes(config, batch, length, d.num_anchors, compute, attention)
    lines = []
    if sizing.target_in_step:
        h, inter = target_config.hidden_size, target_config.intermediate_size
        lines.append(StepLine("target forward", tokens * (6 * h + 3 * inter) * tbytes,
                              "one layer's activations (no grad), up to "
                              + ("the final norm" if final else "the last feature layer")))
    fc_in = config.num_features * config.target_hidden_size
    fdt = sizing.feature_dtype
    fbytes = fdt.itemsize
    feats = tokens * fc_in * (fbytes + (sbytes if sbytes != fbytes else 0))
    feats += tokens * config.target_hidden_size * fbytes if final else 0
    lines.append(StepLine("target features", feats,
                          f"{config.num_features} layers x {config.target_hidden_size} over {tokens} tokens, "
                          f"{str(fdt).removeprefix('torch.')}"
                          + (f" and cast to the drafter's {str(sizing.drafter_dtype).removeprefix('torch.')}"
                             if sbytes != fbytes else "")
                          + ("; the target's last hidden state (soft labels)" if final else "")))
    mask = "dense [Q, context+Q] mask (CPU)" if attention == "dense" else "FlexAttention (no score matrix)"
    lines.append(StepLine(f"{title} block activations", saved["context"] + saved["blocks"] + saved["mask"],
                          f"{tokens} context tokens (batch {batch} x {length}) -> K/V in {config.num_hidden_layers} "
                          f"layers; {batch * blocks * config.block_size} query slots ({blocks} blocks x "
                          f"{config.block_size} per row) through every layer, {compute_name}; {mask}"))
    chunk, vd = sizing.logits_chunk, config.draft_vocab_size
    c = compute.itemsize
    own_head = vd * config.hidden_size * c if config.reduced_vocab and sizing.mixed else 0
    soft = 0
    if final:  # the rows' gathered target states instead of their labels, a chunk of the target's fp32 logits and
        # their softmax
        rows = batch * blocks * (config.block_size - 1)
        soft = rows * (config.target_hidden_size * fbytes - 8) + chunk * (config.vocab_size + vd) * 4
    lines.append(StepLine("loss chunk", saved["loss_rows"] + chunk * vd * (2 * c + 12) + own_head + soft,
                          f"{batch * blocks * (config.block_size - 1)} supervised rows at most (hidden, indices, "
                          f"labels, weights) + one checkpointed [{chunk}, {vd}] logits chunk ({compute_name} logits, "
                          "their fp32 copy, log-softmax and gradient)"
                          + (f"; soft labels: the rows' target states and the target's [{chunk}, "
                             f"{config.vocab_size}] fp32 logits with their softmax" if final else "")))
    copies = saved["autocast_weights"] if sizing.autocast_copies else 0
    if copies:
        lines.append(StepLine("autocast weight copies", copies,
                              f"{compute_name} copies of the drafter's fp32 matmul weights (kept for backward)"))
    return lines
