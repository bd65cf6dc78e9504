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

from eagle3_zoo.losses import Loss
from eagle3_zoo.losses.chunk import as_loss
from eagle3_zoo.modeling import Eagle3Drafter
from eagle3_zoo.training.callbacks import NUM_TOKENS
from eagle3_zoo.training.lightning_private import attached_trainer, should_update_logs
from eagle3_zoo.training.loss import TTTLossOutput, default_step_weights, draft_vocab_mass, step_masks, ttt_loss
from eagle3_zoo.training.metrics import StepMetrics, acceptance_length_tensor

logger = logging.getLogger(__name__)

# a host count `with_host_counts` adds to a batch; and what a training step leaves to read
NUM_TARGET_ROWS = "num_target_rows"
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


class DrafterObjective(nn.Module):
    """The drafter and its TTT loss behind one `forward`, so FSDP2 gathers the drafter's parameters around it.

    (`ttt_loss` reads `drafter.lm_head.weight` directly and unrolls through a generator: outside a forward, an
    FSDP2-sharded drafter would expose shards.) Returns plain tensors so FSDP2 can hook backward on the loss.
    """

    def __init__(self, drafter: Eagle3Drafter, loss: Loss | str = "soft_ce"):
        super().__init__()
        self.drafter = drafter
        self.loss = as_loss(loss)

    @override
    def forward(self, embed_tokens: nn.Module, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
                target_logits: torch.Tensor, loss_mask: torch.Tensor, target_valid: torch.Tensor, steps: int,
                step_weights: list[float] | torch.Tensor, target_mass: torch.Tensor | None = None,
                counts: list[int] | None = None, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, with_alpha: bool = True) -> tuple[torch.Tensor, ...]:
        out = ttt_loss(self.drafter, embed_tokens, input_ids, aux_hidden, target_logits, loss_mask, steps=steps,
                       step_weights=step_weights, target_valid=target_valid, objective=self.loss,
                       target_mass=target_mass, counts=counts, position_ids=position_ids,
                       document_ids=document_ids, with_alpha=with_alpha)
        return out.loss, out.step_losses, out.step_acc, out.num_supervised, out.step_alpha


@torch.no_grad()
def draft_target_logits(lm_head: nn.Module, final_hidden: torch.Tensor, t2d: torch.Tensor, loss_mask: torch.Tensor,
                        chunk_size: int = 1024, draft_vocab_size: int | None = None,
                        with_mass: bool = False, num_rows: int | None = None,
                        document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Target logits restricted to the draft vocabulary, and where the full-vocab argmax lies in it.

    Only positions j whose next token j+1 is supervised are ever a TTT target (see `ttt_loss`); the full-vocab
    product is formed for those rows only, `chunk_size` rows at a time ([chunk, V] at most). Finding those rows
    waits for the device unless `num_rows` says how many there are.

    Args:
        lm_head: the frozen target lm_head.
        final_hidden: `[B, T, H]` post-norm final hidden states.
        t2d: `[V]` bool draft-vocab membership.
        loss_mask: `[B, T]` supervision mask.
        draft_vocab_size: the number of ids `t2d` marks (default: counted, a second wait).
        num_rows: the number of rows used, `target_rows(loss_mask)`, counted on the host (`Eagle3Module` counts
            them before the batch moves to the device); default: found on the device, a wait.
        with_mass: also return the `[B, T]` fp32 probability the full target distribution puts on the draft
            vocabulary (0 on unused rows), which bounds the acceptance of any draft (`eagle3_zoo.losses.chunk`).
        document_ids: `[B, T]` packed rows: a row is needed only where it, its successor and its predecessor lie in
            one document (the first position of a document is never a target, as position 0 of a row).

    Returns:
        `[B, T, Vd]` logits (0 on unused rows) and `[B, T]` bool valid mask (False on unused rows) (and the mass).
    """
    b, t, _ = final_hidden.shape
    needed = target_rows(loss_mask, document_ids).to(final_hidden.device)
    if num_rows is None:
        rows_b, rows_t = needed.nonzero(as_tuple=True)
    else:  # the same rows in the same order, sized on the host: no wait
        rows_b, rows_t = torch.nonzero_static(needed, size=num_rows).unbind(1)
    t2d = t2d.to(final_hidden.device)
    draft_vocab = int(t2d.sum()) if draft_vocab_size is None else draft_vocab_size
    draft_ids = torch.nonzero_static(t2d, size=draft_vocab).squeeze(-1)
    logits = final_hidden.new_zeros(b, t, draft_ids.numel())
    valid = torch.zeros(b, t, dtype=torch.bool, device=final_hidden.device)
    mass = torch.zeros(b, t, dtype=torch.float32, device=final_hidden.device) if with_mass else None
    for i in range(0, rows_b.numel(), chunk_size):
        rb, rt = rows_b[i : i + chunk_size], rows_t[i : i + chunk_size]
        full = lm_head(final_hidden[rb, rt].to(lm_head.weight.dtype))  # stored features may be bf16
        valid[rb, rt] = t2d[full.argmax(-1)]
        logits[rb, rt] = full.index_select(-1, draft_ids).to(logits.dtype)
        if mass is not None:
            mass[rb, rt] = draft_vocab_mass(full, draft_ids)
    return (logits, valid) if mass is None else (logits, valid, mass)


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


def target_rows(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, T]` bool: the positions j whose target logits a TTT step reads (the next token j+1 is supervised; j >= 1:
    position 0 is never a target, it would predict x_1). Packed rows (`document_ids`): only where j, its successor
    and its predecessor lie in one document (a document's first position is never a target, as position 0)."""
    needed = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    needed[:, 1:-1] = loss_mask[:, 2:].bool()
    if document_ids is not None:
        doc = document_ids.to(loss_mask.device)
        needed[:, 1:-1] &= (doc[:, :-2] == doc[:, 1:-1]) & (doc[:, 1:-1] == doc[:, 2:])
    return needed


def supervised_positions(loss_mask: torch.Tensor, valid: torch.Tensor, steps: int,
                         document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`[steps]` number of positions each TTT step is trained on (the same masks as `ttt_loss`)."""
    return step_masks(loss_mask, valid, steps, document_ids).sum((1, 2))


def rank_step_weights(weights: list[float], local: torch.Tensor, total: torch.Tensor,
                      world_size: int) -> torch.Tensor:
    """Per-rank step weights `w_k * world * n_k / N_k` that make the rank-averaged gradient equal the gradient of
    the loss normalised over the global batch (`n_k` this rank's, `N_k` all ranks' supervised positions): a
    tensor on the counts' device, computed there (no wait for the device)."""
    w = torch.tensor(weights[: local.numel()], dtype=torch.float32).to(local.device, non_blocking=True)
    return w * local.float() * world_size / total.float().clamp(min=1.0)


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


class Eagle3Module(L.LightningModule):
    """Trains an EAGLE-3 drafter with the TTT loss against a frozen target (online) or stored features (offline).

    Args:
        drafter: the drafter (vocabulary mapping already set); None: the drafter, adapter and target come later,
            from `set_parts` (the module `fit` trains builds its drafter in its `setup` hook,
            `eagle3_zoo.training.build.RecipeModule`).
        adapter: the target's adapter.
        target: the frozen target model; in offline mode it may be None when `embed_tokens` and `lm_head` are given.
        embed_tokens: the target's input embedding (default: from `target`).
        lm_head: the target's lm_head (default: from `target`).
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
    """

    def __init__(self, drafter: Eagle3Drafter | None, adapter: Any = None, target: nn.Module | None = None, *,
                 embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None, mode: str = "online",
                 ttt_steps: int = 7, step_weights: list[float] | None = None, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0, warmup_steps: int = 0,
                 decay: str = "cosine", min_lr_ratio: float = 0.0, logits_chunk_size: int = 1024,
                 loss: Loss | str = "soft_ce", shard_target: bool | None = None):
        super().__init__()
        if mode not in ("online", "offline"):
            raise ValueError(f"unknown data mode {mode!r}; valid: online, offline")
        self.mode, self.position_loss = mode, as_loss(loss)  # a name resolved (validated) now
        self.ttt_steps = ttt_steps
        self.step_weights = list(step_weights) if step_weights is not None else default_step_weights(ttt_steps)
        self.active_ttt_steps = ttt_steps
        self.optim_args = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.schedule_args = dict(warmup_steps=warmup_steps, decay=decay, min_lr_ratio=min_lr_ratio)
        self.logits_chunk_size = logits_chunk_size
        self.val_metrics = StepMetrics(ttt_steps)
        # device values read with the next step's counts (`_read_counts`): the non-finite check, the bar's metrics
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

    def set_parts(self, drafter: Eagle3Drafter, adapter: Any, target: nn.Module | None = None, *,
                  embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None) -> None:
        """Give the module its drafter and frozen target (the arguments of the class of the same names); once. A
        module constructed without a drafter gets them here, from a Lightning hook that runs before
        `configure_model` (`eagle3_zoo.training.build.RecipeModule.setup`)."""
        if self.has_parts:
            raise RuntimeError("Eagle3Module.set_parts: the module already has its drafter")
        if self.mode == "online" and target is None:
            raise ValueError("online mode needs the target model")
        if target is None and (embed_tokens is None or lm_head is None):
            raise ValueError("without a target model, pass its embed_tokens and lm_head")
        self.objective = DrafterObjective(drafter, self.position_loss)
        self.adapter = adapter
        # a tuple keeps the frozen modules out of the module tree (see the module docstring)
        self._frozen = FrozenTarget(target, adapter.embed_tokens(target) if embed_tokens is None else embed_tokens,
                                    adapter.lm_head(target) if lm_head is None else lm_head)

    @property
    def drafter(self) -> Eagle3Drafter:
        return self.objective.drafter

    @property
    def target(self) -> nn.Module | None:
        return self._frozen.model

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
    def _features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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
        with torch.no_grad(), (contextlib.nullcontext() if packed else one_sequence_per_row()):
            aux_hidden, final_hidden, _ = self.adapter.forward_features(
                self.target, batch["input_ids"], attention_mask=None, layer_ids=self.drafter.config.aux_layer_ids,
                use_cache=False, **({"position_ids": batch["position_ids"]} if packed else {}))
        return aux_hidden, final_hidden

    def loss(self, batch: dict[str, torch.Tensor], steps: int, global_norm: bool = False,
             read_along: bool = False, with_alpha: bool = True) -> TTTLossOutput:
        """TTT loss of one right-padded batch (or of packed rows: `position_ids` and `document_ids` in the batch)
        with `steps` unrolled steps.

        The loss waits for the device once, to read the supervised-row counts of its steps; with `read_along` (the
        training step) that read also brings what earlier steps left to read (`_read_counts`).

        With `global_norm` (training under a data-parallel strategy), step k's weight on this rank is scaled by
        `world * n_k(rank) / N_k(all ranks)`: the gradient averaged over ranks is then exactly the gradient of the
        loss normalised by the supervised positions of the *global* batch (what one process with the whole batch
        computes), and the rank-mean of the returned loss is that global loss. `with_alpha=False` leaves out the
        per-step acceptance (`step_alpha` None) and the target's draft-vocabulary mass it needs.
        """
        aux_hidden, final_hidden = self._features(batch)
        documents = batch.get("document_ids")  # packed rows (`data.packing`)
        logits, valid, *mass = draft_target_logits(self._frozen.lm_head, final_hidden, self.drafter.t2d,
                                                   batch["loss_mask"], self.logits_chunk_size,
                                                   self.drafter.config.draft_vocab_size, with_mass=with_alpha,
                                                   num_rows=batch.get(NUM_TARGET_ROWS), document_ids=documents)
        weights = self.step_weights[:steps]
        local = supervised_positions(batch["loss_mask"], valid, steps, documents)
        if global_norm and attached_trainer(self) is not None and self.trainer.world_size > 1:
            total = all_reduce_sum(local.clone())
            weights = rank_step_weights(weights, local, total, self.trainer.world_size)
        loss, step_losses, step_acc, counts, step_alpha = self.objective(
            self._frozen.embed_tokens, batch["input_ids"], aux_hidden, logits, batch["loss_mask"], valid, steps,
            weights, mass[0] if mass else None, self._read_counts(local, read_along), batch.get("position_ids"),
            documents, with_alpha)
        return TTTLossOutput(loss=loss, step_losses=step_losses, step_acc=step_acc, num_supervised=counts,
                             step_alpha=step_alpha)

    def _read_counts(self, local: torch.Tensor, read_along: bool) -> list[int]:
        """The supervised-row counts of each TTT step on the host (they size the loss's gathers): the step's one
        wait for the device. With `read_along`, the same transfer brings what the previous training step left to
        read: its non-finite flag (raised here, before this step's backward) and the metrics a live bar shows."""
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
        metrics = {f"train/loss_{k}": v for k, v in enumerate(out.step_losses)}
        metrics.update({f"train/acc_{k}": v.float() for k, v in enumerate(out.step_acc) if k > 0})
        # the expected acceptance of a drafted token at each step (what tau is made of), beside top-1 agreement
        if with_alpha:
            metrics.update({f"train/alpha_{k}": v for k, v in enumerate(out.step_alpha)})
        metrics["train/tau_est"] = acceptance_length_tensor(out.step_acc.detach())  # on the device: no wait
        metrics["train/supervised_tokens"] = out.num_supervised[0].float()
        self.log_dict(metrics, batch_size=b)
        self.log("train/acc_0", out.step_acc[0].float(), batch_size=b)
        # what a live bar shows, read with the next step's counts instead of by the bar (`StepProgressBar`)
        self._read_later.update({"train/loss": mean_loss, "train/acc_0": out.step_acc[0]})
        if trainer is not None and trainer.lr_scheduler_configs:
            lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
            # a tensor filled on the device: Lightning turns a float into a tensor by a blocking host-to-device copy
            self.log("train/lr", torch.full((), lr, device=out.loss.device), batch_size=b)
        return out.loss

    def _check_later(self, loss: torch.Tensor) -> torch.Tensor:
        """Whether the loss is finite on every rank, as a flag on the device that the next training step reads with
        its counts (`_read_counts`; `on_train_end` reads the last one), so the check adds no wait of its own. A
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
        self.val_metrics.update(out.step_losses, out.step_acc, out.num_supervised, out.step_alpha)

    @override
    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics.compute("val") if self.val_metrics.update_called else {}
        losses = [metrics[f"val/loss_{k}"] for k in range(self.ttt_steps) if f"val/loss_{k}" in metrics]
        if losses:
            self.log_dict(metrics, prog_bar=False)
            self.log("val/loss", sum(w * v for w, v in zip(self.step_weights, losses)), prog_bar=True)
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
