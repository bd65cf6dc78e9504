"""EAGLE-3's training objective as the LightningModule runs it: the target logits over the draft vocabulary (formed
from the frozen lm_head on the rows a TTT step reads), the per-rank step weights of a data-parallel step, and the
drafter with its TTT loss behind one `forward` (`DrafterObjective`, the unit FSDP2 shards). The loss itself is the
pure function `eagle3_zoo.drafters.eagle3.ttt.ttt_loss`."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from eagle3_zoo.drafters.eagle3.ttt import draft_vocab_mass, step_masks, ttt_loss
from eagle3_zoo.losses import Loss
from eagle3_zoo.losses.chunk import as_loss
from eagle3_zoo.modeling import Eagle3Drafter

# the host count of the target rows a batch carries (`eagle3_zoo.training.module.with_host_counts`)
NUM_TARGET_ROWS = "num_target_rows"


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
        num_rows: the number of rows used, `target_rows(loss_mask)`, counted on the host (`DrafterModule` counts
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


