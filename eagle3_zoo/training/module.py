"""The LightningModule: target features in, TTT loss out, logging, optimizer and LR schedule.

Online mode runs the frozen target inside the training step (`adapter.forward_features`); offline mode reads the
stored `aux_hidden`/`final_hidden` from the batch. Either way only the draft-vocabulary columns of the target
logits are kept ([B, T, Vd], computed from the frozen lm_head on the positions that are ever used as a target),
plus the "full-vocab argmax is in the draft vocab" mask, so no [B, T, V] tensor is formed for the batch.

The frozen target is deliberately *not* a registered submodule: it is never trained, never in `state_dict()`,
hence never in a Lightning checkpoint (which stays drafter + optimizer sized), never flipped to train mode by
the Trainer, and never wrapped by DDP. FSDP shards its decoder layers explicitly in `configure_model`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from eagle3_zoo.drafters import DrafterKind, get_kind, kind_of
from eagle3_zoo.drafters.eagle3.objective import NUM_TARGET_ROWS, target_rows
from eagle3_zoo.drafters.eagle3.ttt import default_step_weights
from eagle3_zoo.losses import Loss
from eagle3_zoo.losses.chunk import as_loss
from eagle3_zoo.training.callbacks import NUM_TOKENS
from eagle3_zoo.training.lightning_private import attached_trainer, should_update_logs

logger = logging.getLogger(__name__)

# what a training step leaves to read
_NONFINITE_RANKS, _NONFINITE_LOSS = "nonfinite_ranks", "nonfinite_loss"

DECAYS = ("cosine", "linear", "constant")


class FrozenTarget(NamedTuple):
    """The frozen target's parts the module uses; a plain tuple, so none becomes a registered submodule."""

    model: nn.Module | None  # None offline (features come from the batch) unless tau is measured during training
    embed_tokens: nn.Module
    lm_head: nn.Module


class NonFiniteError(RuntimeError):
    """Training diverged (a NaN/Inf loss or weights): stopped before anything non-finite is saved."""


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` (this rank's shard of a DTensor) is finite."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return bool(torch.isfinite(local.detach()).all())


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """While it is held, transformers does not look for packed sequences in the position ids of a forward without
    an attention mask (`masking_utils.find_packed_sequence_indices`: it reads its answer on the host, a wait for the
    device). Only for batches of one sequence per row at positions 0..T-1 (right-padded), where it finds none."""
    from transformers import masking_utils

    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None:  # a transformers without the check
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def with_host_counts(batch: Any) -> Any:
    """`batch` with what a step needs to know as a number counted on the host, while the batch is still there (a
    `LightningDataModule.on_before_batch_transfer`): its tokens (the progress lines and bar) and the rows of target
    logits the loss reads (`draft_target_logits`). Read from the device, each would be a wait for it."""
    if isinstance(batch, dict) and "loss_mask" in batch and batch["loss_mask"].device.type == "cpu":
        tokens = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
        rows = target_rows(batch["loss_mask"], batch.get("document_ids"))
        batch = {**batch, NUM_TOKENS: int(tokens), NUM_TARGET_ROWS: int(rows.sum())}
    return batch


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over all ranks, in place. Lightning's `strategy.reduce` (and `log(sync_dist=True)`) put a
    barrier before every all_reduce (`_sync_ddp`), which blocks the host until every rank gets there; on GPUs the
    all_reduce alone is queued on the device like a kernel, and the host goes on."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def lr_lambda(step: int, warmup_steps: int, total_steps: int, decay: str = "cosine",
              min_lr_ratio: float = 0.0) -> float:
    """Learning-rate multiplier: linear warmup to 1 over `warmup_steps`, then cosine/linear decay to `min_lr_ratio`."""
    if decay not in DECAYS:
        raise ValueError(f"unknown LR decay {decay!r}; valid: {', '.join(DECAYS)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - min_lr_ratio) * progress


class DrafterModule(L.LightningModule):
    """Trains a drafter of any registered kind (`eagle3_zoo.drafters`) against a frozen target (online) or stored
    features (offline): the kind builds the trained unit (`DrafterKind.objective`) and computes the loss and its
    metrics (`training_loss`, `train_metrics`, `validation_metrics`); this module runs the target, the logging, the
    non-finite check, the optimizer and the LR schedule. (EAGLE-3's TTT loss: `eagle3_zoo.drafters.eagle3`.)

    Args:
        drafter: the drafter (vocabulary mapping already set); None: the drafter, adapter and target come later,
            from `set_parts` (the module `fit` trains builds its drafter in its `setup` hook,
            `eagle3_zoo.training.build.RecipeModule`).
        adapter: the target's adapter.
        target: the frozen target model; in offline mode it may be None when `embed_tokens` and `lm_head` are given.
        embed_tokens: the target's input embedding (default: from `target`).
        lm_head: the target's lm_head (default: from `target`).
        kind: the drafter's kind, or its registered name (default: the kind whose drafter `drafter` is).
        mode: "online" (run the target in the step) or "offline" (features in the batch).
        ttt_steps: full unroll length K (validation always uses K; training uses `active_ttt_steps`).
        step_weights: per-step weights w_k (default 0.8**k).
        lr, betas, weight_decay: AdamW settings; norms and other 1-D parameters get no weight decay.
        warmup_steps, decay, min_lr_ratio: the LR schedule (stepped every optimizer step).
        logits_chunk_size: rows per chunk of the frozen lm_head product.
        loss: the per-position objective, a `Loss` with its parameters (`eagle3_zoo.losses`; a name: its default
            parameters; default EAGLE-3's soft cross-entropy).
        shard_target: FSDP shards the target too (default: in online mode; features streamed from an engine: for
            tau evaluation).
        drafter_section: the recipe's `drafter` section, handed to the kind's `objective` (its training settings:
            DFlash's anchors and position weights); None: the kind's defaults.
    """

    def __init__(self, drafter: nn.Module | None, adapter: Any = None, target: nn.Module | None = None, *,
                 embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None,
                 kind: DrafterKind | str | None = None, mode: str = "online",
                 ttt_steps: int = 7, step_weights: list[float] | None = None, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0, warmup_steps: int = 0,
                 decay: str = "cosine", min_lr_ratio: float = 0.0, logits_chunk_size: int = 1024,
                 loss: Loss | str = "soft_ce", shard_target: bool | None = None, drafter_section: Any = None):
        super().__init__()
        if mode not in ("online", "offline"):
            raise ValueError(f"unknown data mode {mode!r}; valid: online, offline")
        self.mode, self.position_loss = mode, as_loss(loss)  # a name resolved (validated) now
        self.kind: DrafterKind | None = get_kind(kind) if isinstance(kind, str) else kind
        self.ttt_steps = ttt_steps
        self.step_weights = list(step_weights) if step_weights is not None else default_step_weights(ttt_steps)
        self.active_ttt_steps = ttt_steps
        self.optim_args = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.schedule_args = dict(warmup_steps=warmup_steps, decay=decay, min_lr_ratio=min_lr_ratio)
        self.logits_chunk_size = logits_chunk_size
        self.drafter_section = drafter_section
        self.val_metrics = self.kind.validation_metrics(ttt_steps) if self.kind is not None else None
        # device values read with the next step's counts (`read_counts`): the non-finite check, the bar's metrics
        self._read_later: dict[str, torch.Tensor] = {}
        self._nonfinite_step = 0
        self.shown_metrics: dict[str, float] = {}  # the bar's training metrics, as of the previous step
        self._sharded = False
        self.shard_target = mode == "online" if shard_target is None else shard_target
        if drafter is not None:
            self.set_parts(drafter, adapter, target, embed_tokens=embed_tokens, lm_head=lm_head)

    @property
    def has_parts(self) -> bool:
        """Whether the module has its drafter and target (`set_parts` ran)."""
        return "objective" in self._modules

    def set_parts(self, drafter: nn.Module, adapter: Any, target: nn.Module | None = None, *,
                  embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None) -> None:
        """Give the module its drafter and frozen target (the arguments of the class of the same names); once. A
        module constructed without a drafter gets them here, from a Lightning hook that runs before
        `configure_model` (`eagle3_zoo.training.build.RecipeModule.setup`)."""
        if self.has_parts:
            raise RuntimeError("DrafterModule.set_parts: the module already has its drafter")
        if self.mode == "online" and target is None:
            raise ValueError("online mode needs the target model")
        if target is None and (embed_tokens is None or lm_head is None):
            raise ValueError("without a target model, pass its embed_tokens and lm_head")
        if self.kind is None:
            self.kind = kind_of(drafter)
            self.val_metrics = self.kind.validation_metrics(self.ttt_steps)
        elif not self.kind.owns(drafter):
            raise TypeError(f"a {type(drafter).__name__} is not a drafter of the kind {self.kind.name!r}")
        self.objective = self.kind.objective(drafter, self.position_loss, self.drafter_section)
        self.adapter = adapter
        # a tuple keeps the frozen modules out of the module tree (see the module docstring)
        self._frozen = FrozenTarget(target, adapter.embed_tokens(target) if embed_tokens is None else embed_tokens,
                                    adapter.lm_head(target) if lm_head is None else lm_head)

    @property
    def drafter(self) -> nn.Module:
        return self.objective.drafter

    @property
    def target(self) -> nn.Module | None:
        return self._frozen.model

    @property
    def frozen_heads(self) -> tuple[nn.Module, nn.Module]:
        """The frozen target's (input embedding, lm_head)."""
        return self._frozen.embed_tokens, self._frozen.lm_head

    # ------------------------------------------------------------------------------------------ setup
    @override
    def configure_model(self) -> None:
        if self.device_mesh is None or self._sharded:
            return
        from eagle3_zoo.training.strategies import fsdp_mesh, shard_fsdp2

        read = shard_fsdp2(self.target if self.shard_target else None, self.adapter, self.objective,
                           fsdp_mesh(self.device_mesh, self.trainer.num_nodes), precision=str(self.trainer.precision),
                           device=self.trainer.strategy.root_device)
        if read:
            logger.info("rank %d read its target shards: %d slices, %.1f MB", self.global_rank, read["tensors"],
                        read["bytes"] / 2**20)
        self._sharded = True

    @override
    def on_fit_start(self) -> None:
        self._place_frozen()

    @override
    def on_validation_start(self) -> None:
        self._place_frozen()

    def _place_frozen(self) -> None:
        for module in self._frozen:
            if module is not None:
                module.to(self.device)

    # ------------------------------------------------------------------------------------------- step
    def target_features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`aux_hidden`, `final_hidden`) of the batch at the layers the drafter's kind reads (`features`)."""
        if self.mode == "offline":
            return batch["aux_hidden"], batch["final_hidden"]
        # no attention mask: batches are right-padded (`collate_right_padded`), and causal attention never lets a
        # real position see a later pad, so every position the loss reads is unchanged; transformers would instead
        # read the mask on the host (two waits for the GPU) to find out whether SDPA's causal kernel may run; nor
        # does it look for packed sequences. Packed rows pass their per-document positions instead: with no attention
        # mask and no cache, transformers reads a position that restarts as a new sequence
        # (`masking_utils.find_packed_sequence_indices`, one host read per mask) and keeps attention inside it, for
        # every attention implementation, sliding windows too
        packed = "document_ids" in batch
        needs = self.kind.training_features(self.drafter.config, self.drafter_section)
        with torch.no_grad(), (contextlib.nullcontext() if packed else one_sequence_per_row()):
            aux_hidden, final_hidden, _ = self.adapter.forward_features(
                self.target, batch["input_ids"], attention_mask=None, layer_ids=needs.aux_layer_ids,
                use_cache=False, **({"position_ids": batch["position_ids"]} if packed else {}))
        return aux_hidden, (final_hidden if needs.final_hidden else None)

    def data_parallel_ranks(self) -> int:
        """The ranks a training step's gradients are averaged over (1 outside a Trainer)."""
        return self.trainer.world_size if attached_trainer(self) is not None else 1

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(tensor)

    def loss(self, batch: dict[str, torch.Tensor], steps: int, global_norm: bool = False,
             read_along: bool = False, with_alpha: bool = True) -> Any:
        """The kind's loss of one batch (`DrafterKind.training_loss`; EAGLE-3's: the TTT loss with `steps` unrolled
        steps, `eagle3_zoo.drafters.eagle3.ttt`)."""
        return self.kind.training_loss(self, batch, steps, global_norm=global_norm, read_along=read_along,
                                       with_alpha=with_alpha)

    def read_counts(self, local: torch.Tensor, read_along: bool) -> list[int]:
        """The counts `local` (the supervised-row counts of each TTT step, which size the loss's gathers) on the
        host: the step's one wait for the device. With `read_along`, the same transfer brings what the previous
        training step left to read: its non-finite flag (raised here, before this step's backward) and the metrics
        a live bar shows."""
        pending = self._read_later if read_along else {}
        dtype = torch.float32 if local.device.type == "mps" else torch.float64  # counts above 2**24 stay exact
        values = torch.cat([local.to(dtype), *(v.detach().to(dtype).reshape(1) for v in pending.values())]).tolist()
        n = local.numel()
        if read_along:
            back, self._read_later = dict(zip(pending, values[n:])), {}
            self._raise_if_nonfinite(back.pop(_NONFINITE_RANKS, 0), back.pop(_NONFINITE_LOSS, None))
            self.shown_metrics = back
        return [int(v) for v in values[:n]]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        trainer = attached_trainer(self)
        # alpha is a metric only (no gradient depends on it): formed on the steps whose metrics a logger records
        with_alpha = trainer is None or should_update_logs(trainer)
        out = self.loss(batch, self.active_ttt_steps, global_norm=True, read_along=True, with_alpha=with_alpha)
        mean_loss = self._check_later(out.loss)
        b = batch["input_ids"].shape[0]
        # not `prog_bar`: Lightning turns each progress-bar metric into a Python number at every batch's end (a wait
        # for the device each); the live bar reads them from `shown_metrics`, brought by the next step's counts
        self.log("train/loss", mean_loss, batch_size=b)  # reduced over the ranks already
        metrics, shown = self.kind.train_metrics(out, with_alpha)
        self.log_dict(metrics, batch_size=b)
        # what a live bar shows, read with the next step's counts instead of by the bar (`StepProgressBar`)
        self._read_later.update({"train/loss": mean_loss, **shown})
        if trainer is not None and trainer.lr_scheduler_configs:
            lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
            # a tensor filled on the device: Lightning turns a float into a tensor by a blocking host-to-device copy
            self.log("train/lr", torch.full((), lr, device=out.loss.device), batch_size=b)
        return out.loss

    def _check_later(self, loss: torch.Tensor) -> torch.Tensor:
        """Whether the loss is finite on every rank, as a flag on the device that the next training step reads with
        its counts (`read_counts`; `on_train_end` reads the last one), so the check adds no wait of its own. A
        diverged step's update reaches the weights, but nothing keeps them: a checkpoint refuses non-finite weights
        (`resume.RunIdentityCallback`), and so does the drafter folder. Every rank takes part in the reduction, so
        all of them stop on the same step and none is left waiting in a collective.

        Returns the loss averaged over the ranks (what `train/loss` shows), reduced with the flag in one all_reduce.
        """
        loss = loss.detach()
        bad = (~torch.isfinite(loss)).to(loss.dtype)
        if attached_trainer(self) is not None and self.trainer.world_size > 1:
            bad, total = all_reduce_sum(torch.stack([bad, loss]))
            mean = total / self.trainer.world_size
        else:
            mean = loss
        self._read_later.update({_NONFINITE_RANKS: bad, _NONFINITE_LOSS: loss})
        self._nonfinite_step = self.global_step
        return mean

    def _raise_if_nonfinite(self, ranks: float, loss: float | None) -> None:
        if ranks > 0:
            raise NonFiniteError(
                f"step {self._nonfinite_step}: the training loss is {loss} (not finite) on {int(ranks)} rank(s); "
                "training stopped and the last checkpoint (all finite) is kept. Lower optim.lr, add "
                "optim.warmup_steps, keep optim.grad_clip set, or train with trainer.precision=32-true")

    @override
    def on_train_end(self) -> None:
        pending, self._read_later = self._read_later, {}
        if _NONFINITE_RANKS in pending:  # the last step's flag: no next step reads it
            self._raise_if_nonfinite(float(pending[_NONFINITE_RANKS]), float(pending[_NONFINITE_LOSS]))

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.loss(batch, self.ttt_steps)  # always the full unroll, whatever the training schedule
        self.val_metrics.update(out)

    @override
    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics.compute("val") if self.val_metrics.update_called else {}
        loss = self.kind.validation_loss(metrics, self.step_weights[: self.ttt_steps])
        if loss is not None:
            self.log_dict(metrics, prog_bar=False)
            self.log("val/loss", loss, prog_bar=True)
        self.val_metrics.reset()


    # ------------------------------------------------------------------------------------------ optim
    def _total_steps(self) -> float:
        """The run's optimizer steps, as `trainer.estimated_stepping_batches` counts them, but for an epoch-based run
        counted on the datamodule's own training loader: Lightning's estimate loads the fit loop's loader now, before
        a checkpoint is restored, and a loader loaded then never receives its saved position (Lightning applies
        loader states only to a loader it loads while restarting): a resumed run would start its epoch over."""
        t = self.trainer
        if t.max_epochs in (None, -1) or t.datamodule is None or t.limit_train_batches != 1.0:
            return t.estimated_stepping_batches
        batches = len(t.datamodule.train_dataloader())
        steps = math.ceil(batches / t.accumulate_grad_batches) * max(t.max_epochs, 1)
        return min(steps, t.max_steps) if t.max_steps != -1 else steps

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for param in self.objective.parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)  # norms (1-D) are not decayed
        groups = [{"params": decay, "weight_decay": self.optim_args["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.optim_args["lr"], betas=self.optim_args["betas"])
        total = self._total_steps()
        total = int(total) if math.isfinite(total) else self.schedule_args["warmup_steps"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, total_steps=total, **self.schedule_args))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

