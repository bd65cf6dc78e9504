"""Resuming a run safely: a checkpoint carries the identity of the run that wrote it, and a rerun resumes only when
its own identity matches.

    identity = run_identity(recipe, data_fingerprint, drafter, target_info)
    check_resume(output_dir / "checkpoints" / "last.ckpt", identity)   # before the Trainer loads it
    RunIdentityCallback(identity)                                      # writes it into every checkpoint

Without this a rerun of `fit` with another dataset or learning rate in the same `output_dir` resumes the old
run (0 steps left to train) and writes the old weights under the new recipe's provenance: a silently wrong drafter.
The identity is the resolved recipe minus the keys that may change on resume (`RESUMABLE_KEYS`), plus what the
recipe does not pin down by itself: the prepared data (its fingerprint covers file contents, tokenizer and every
token-stream setting), the draft vocabulary, the target's shape, and the global batch.

World size: `trainer.devices`, `trainer.num_nodes` and `trainer.batch_size` may change on resume as long as their
product, the global batch of one optimizer step, stays the same: the sampler cuts the same global batches for any
number of ranks (`eagle3_zoo.data.datamodule`), DDP/single-file checkpoints hold the full state, and FSDP's sharded
(DCP) checkpoints are resharded on load. A different global batch would change every later step, so it is refused.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from eagle3_zoo.training.rundir.checkpoint_io import DRAFTER_INFO_KEY, UnreadableCheckpointError, read_checkpoint_header

logger = logging.getLogger(__name__)

IDENTITY_KEY = "eagle3_zoo_run_identity"
GLOBAL_BATCH = "global batch (trainer.batch_size x devices x num_nodes)"

# Recipe keys that do not change what is trained, only how long, where from/to, or what is logged: they may differ
# between the run that wrote a checkpoint and the run that resumes it.
RESUMABLE_KEYS = (
    "output_dir", "demo", "trainer.max_steps", "trainer.max_epochs", "trainer.max_time",
    "trainer.checkpoint_every_n_steps", "trainer.val_check_interval", "trainer.log_every_n_steps", "trainer.logger",
    "trainer.tau_eval",
    "trainer.activation_checkpointing", "trainer.devices", "trainer.num_nodes", "trainer.batch_size",
    "data.num_workers", "data.cache_dir", "data.features_dir",
    "data.features_shard_size", "data.regenerate.output", "data.regenerate.batch_size",
)

# recipe keys added after identities were first saved, with the value every earlier run had: an identity without one
# compares as that value (a resume with another value is refused like any other data setting)
ADDED_KEYS = {"data.packing": repr(False), "drafter.kind": repr("eagle3"),
              **{f"drafter.dflash.{k}": repr(v) for k, v in {
                  "num_layers": 5, "block_size": 16, "num_anchors": 512, "weighting": "dpace", "dpace_alpha": 0.5,
                  "decay_gamma": 4.0, "labels": "hard", "num_target_features": 5, "target_layer_ids": None,
                  "mask_token_id": None, "init_layers": "random"}.items()},
              **{f"drafter.dspark.{k}": repr(v) for k, v in {
                  "num_layers": 5, "block_size": 16, "num_anchors": 512, "decay_gamma": 4.0,
                  "num_target_features": 5, "target_layer_ids": None, "mask_token_id": None, "init_layers": "random",
                  "markov_rank": 256, "enable_confidence_head": True, "ce_weight": 0.1, "tv_weight": 0.9,
                  "bce_weight": 1.0}.items()}}


def _before_loss_params(saved: dict[str, str]) -> dict[str, str]:
    """An identity saved before `loss.params` as today's: its `loss.lk_eta` (every run had one, 3.0 unless set) was
    lk_hybrid's eta, now `loss.params.eta`, and meant nothing to the other losses; a loaded recipe's lk_eta is null."""
    eta = saved.get("loss.lk_eta")
    if eta in (None, repr(None)) or any(k.startswith("loss.params.") for k in saved):
        return saved
    return {**saved, "loss.lk_eta": repr(None),
            **({"loss.params.eta": eta} if saved.get("loss.name") == repr("lk_hybrid") else {})}


# temporaries of an atomic write killed before its rename (AtomicCheckpointIO, atomic_write): `.last.ckpt.*.tmp`
_STALE_TEMP_GLOB = ".*.tmp"
_STALE_AFTER_S = 60.0  # a temporary younger than this may belong to a rank of this very run that is still writing


class ResumeError(ValueError):
    """The checkpoint in `output_dir` cannot be resumed by this run (corrupt, foreign, or other settings)."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 (16 hex digits) of the tensors' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def run_identity(recipe_dict: dict[str, Any], *, data_fingerprint: str, d2t: torch.Tensor,
                 target: dict[str, Any], world_size: int) -> dict[str, str]:
    """The settings that define a run, flattened to `{"optim.lr": "0.001", ..., "data fingerprint": ...}`.

    `world_size`: the processes the trainer settings resolve to (with `trainer.batch_size`, the global batch).
    Values are strings so that the identity survives `torch.load(weights_only=True)` and compares exactly.
    """
    identity = {k: repr(v) for k, v in sorted(_flatten(recipe_dict).items()) if not _resumable(k)}
    batch = recipe_dict.get("trainer", {}).get("batch_size", 1)
    identity[GLOBAL_BATCH] = repr(batch * world_size)
    identity["prepared data (fingerprint of files, tokenizer and token settings)"] = data_fingerprint
    identity["draft vocabulary (d2t digest)"] = tensor_digest(d2t)
    for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
        identity[f"target {key}"] = repr(target.get(key))
    return identity


def _short(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def identity_differences(saved: dict[str, str], current: dict[str, str]) -> list[str]:
    """`key: saved -> current` for every setting that differs (missing on one side shown as `<unset>`).

    An identity saved before devices, num_nodes and batch_size became resumable holds those keys instead of the
    global batch: it is compared by the global batch they give (unknown for devices "auto"/-1: then it differs)."""
    if GLOBAL_BATCH not in saved:
        try:
            sizes = [int(saved[f"trainer.{k}"]) for k in ("batch_size", "devices", "num_nodes")]
        except (KeyError, ValueError):
            sizes = []
        if sizes and min(sizes) > 0:
            saved = {**saved, GLOBAL_BATCH: repr(sizes[0] * sizes[1] * sizes[2])}
    saved = {**{k: v for k, v in ADDED_KEYS.items() if k in current}, **_before_loss_params(saved)}
    saved = {k: v for k, v in saved.items() if not _resumable(k)}
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if a != b:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def _fresh_hint(checkpoint: Path) -> str:
    return (f"To start a fresh run, set another output_dir (or delete {checkpoint.parent}); to continue this run, "
            "rerun it with its own recipe (saved in the run's drafter/recipe.yaml once it finished). On resume only "
            "these keys may change: " + ", ".join(RESUMABLE_KEYS))


def read_checkpoint_identity(checkpoint: Path) -> dict[str, str]:
    """The run identity stored in a Lightning checkpoint of `fit` (a file, or a sharded checkpoint's directory,
    whose `meta.pt` holds everything but the weights and optimizer states).

    Raises:
        ResumeError: the file is not a readable checkpoint, or was not written by an eagle3-zoo `fit`.
    """
    try:
        _, identity = read_checkpoint_header(checkpoint, IDENTITY_KEY)
    except UnreadableCheckpointError as e:
        raise ResumeError(f"{checkpoint} is not a readable checkpoint of this run ({e.error_type}: "
                          f"{_short(e.first_line, 160)}). {_fresh_hint(checkpoint)}") from None
    if identity is None:
        raise ResumeError(f"{checkpoint} was not written by an eagle3-zoo fit (it has no run identity). "
                          f"{_fresh_hint(checkpoint)}")
    return identity


def refuse_unreadable(checkpoint: Path, read: Any) -> None:
    """Call `read(checkpoint)`; an `UnreadableCheckpointError` becomes the `ResumeError` of an unreadable checkpoint.

    Raises:
        ResumeError: `read` found the checkpoint unreadable (the message names the file and how to start fresh).
    """
    try:
        read(checkpoint)
    except UnreadableCheckpointError as e:
        raise ResumeError(f"{e}. {_fresh_hint(checkpoint)}") from None


def check_resume(checkpoint: Path, identity: dict[str, str]) -> None:
    """Refuse to resume `checkpoint` unless it was written by a run with the same `identity`.

    Raises:
        ResumeError: unreadable or foreign checkpoint, or settings that differ (all listed).
    """
    diffs = identity_differences(read_checkpoint_identity(checkpoint), identity)
    if diffs:
        raise ResumeError(f"{checkpoint} belongs to a run with other settings, so resuming it would train (and write) "
                          f"that run's drafter under this recipe's name. Differences (checkpoint -> this run): "
                          f"{'; '.join(diffs)}. {_fresh_hint(checkpoint)}")


def remove_stale_temporaries(directory: Path, older_than_s: float = _STALE_AFTER_S) -> int:
    """Delete temporaries that a killed atomic write left in `directory` (e.g. `.last.ckpt.x1y2.tmp`); returns how
    many. Only files older than `older_than_s` go, so a save in progress elsewhere is never touched."""
    if not directory.is_dir():
        return 0
    now, removed = time.time(), 0
    for path in directory.glob(_STALE_TEMP_GLOB):
        try:
            if path.is_file() and now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # another rank removed it first
            continue
    if removed:
        logger.info("removed %d stale temporary file(s) of an interrupted checkpoint save in %s", removed, directory)
    return removed


class RunIdentityCallback(L.Callback):
    """Writes the run identity (and `info`: `outputs.drafter_info`, for `consolidate_checkpoint`) into every
    checkpoint, and refuses to save one whose drafter weights are not finite (so `last.ckpt` always holds the last
    finite state of a run that diverged)."""

    def __init__(self, identity: dict[str, str], info: dict[str, Any] | None = None):
        self.identity, self.info = identity, info

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        from eagle3_zoo.training.module import NonFiniteError, all_finite

        bad = [n for n, p in pl_module.named_parameters() if p.requires_grad and not all_finite(p)]
        flag = torch.tensor(float(bool(bad)), device=pl_module.device)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="sum")
        if flag.item() > 0:
            raise NonFiniteError(f"step {trainer.global_step}: the drafter's weights are not finite "
                                 f"({', '.join(bad[:4]) or 'on another rank'}); no checkpoint was written, the last "
                                 "finite one is kept. Lower optim.lr, keep optim.grad_clip set, or train in fp32")
        checkpoint[IDENTITY_KEY] = dict(self.identity)
        if self.info is not None:
            checkpoint[DRAFTER_INFO_KEY] = dict(self.info)
