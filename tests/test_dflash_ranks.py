"""The DFlash loss under data parallelism and gradient accumulation (`DFlashKind.training_loss`): each rank's loss is
scaled so that the gradient averaged over the ranks is the gradient of the loss over the global batch (as EAGLE-3's
TTT loss is), checked with two ranks simulated in one process and with two gloo processes; the micro-batches of one
optimizer step draw different anchors, and a rerun draws the same ones."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from eagle3_zoo.drafters import get_kind
from eagle3_zoo.drafters.dflash.config import DFlashConfig
from eagle3_zoo.drafters.dflash.kind import DFlashTraining
from eagle3_zoo.drafters.dflash.model import DFlashDrafter

VOCAB, HIDDEN, LENGTH = 100, 64, 16


def _drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
                          vocab_size=VOCAB, num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99,
                          num_hidden_layers=1, block_size=4)
    return DFlashDrafter(config)


def _batch() -> dict[str, torch.Tensor]:
    """Two rows with unequal supervision (row 0: 13 tokens, row 1: 5), so a mean of the rows' means is not the mean
    over both rows' slots."""
    g = torch.Generator().manual_seed(3)
    loss_mask = torch.zeros(2, LENGTH, dtype=torch.long)
    loss_mask[0, 3:], loss_mask[1, 9:14] = 1, 1
    return {"input_ids": torch.randint(VOCAB - 1, (2, LENGTH), generator=g), "loss_mask": loss_mask,
            "aux_hidden": torch.randn(2, LENGTH, 3 * HIDDEN, generator=g)}


class _Context:
    """The `TrainingContext` a `DFlashKind.training_loss` asks, outside a Trainer: `world` ranks whose supervised-slot
    counts are summed by `sum_over_ranks` (given, or over a gloo group)."""

    def __init__(self, drafter: DFlashDrafter, heads: tuple[nn.Module, nn.Module], world: int = 1,
                 total: int | None = None, step: int = 0):
        # every eligible position is an anchor (num_anchors >= the row length): the draw does not matter
        self.objective = get_kind("dflash").objective(drafter, None)
        self.objective.settings = DFlashTraining(num_anchors=LENGTH)
        self.drafter, self.frozen_heads, self.world, self.total = drafter, heads, world, total
        self.logits_chunk_size, self.global_step, self.training = 7, step, True

    def target_features(self, batch):
        return batch["aux_hidden"], None

    def data_parallel_ranks(self) -> int:
        return self.world

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.total is None:
            dist.all_reduce(tensor)
            return tensor
        return torch.full_like(tensor, self.total)

    def read_counts(self, counts: torch.Tensor, read_along: bool) -> list[int]:
        return [int(c) for c in counts.tolist()]


def _heads() -> tuple[nn.Module, nn.Module]:
    g = torch.Generator().manual_seed(5)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.1)
    return embed.requires_grad_(False), head.requires_grad_(False)


def _grads(drafter: DFlashDrafter, context: _Context, batch: dict[str, torch.Tensor],
           global_norm: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    drafter.zero_grad(set_to_none=True)
    out = get_kind("dflash").training_loss(context, batch, 1, global_norm=global_norm)
    out.loss.backward()
    return float(out.loss.detach()), {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}, \
        int(out.num_supervised)


def _rows(batch, i):
    return {k: v[i:i + 1] for k, v in batch.items()}


def test_two_ranks_average_to_the_global_batch_gradient():
    """Rank r holds row r; with `global_norm` the mean of the ranks' gradients (what DDP applies) equals the gradient
    of one process over both rows, and the mean of their losses equals its loss."""
    drafter, heads, batch = _drafter(), _heads(), _batch()
    whole_loss, whole, _ = _grads(drafter, _Context(drafter, heads), batch, global_norm=False)
    counts = [_grads(drafter, _Context(drafter, heads), _rows(batch, r), global_norm=False)[2] for r in (0, 1)]
    assert counts[0] != counts[1]  # else a mean of means is the global mean and nothing is tested
    ranks = [_grads(drafter, _Context(drafter, heads, world=2, total=sum(counts)), _rows(batch, r), True)
             for r in (0, 1)]
    assert (ranks[0][0] + ranks[1][0]) / 2 == pytest.approx(whole_loss, rel=1e-5)
    assert whole.keys() == ranks[0][1].keys()
    for k in whole:
        torch.testing.assert_close((ranks[0][1][k] + ranks[1][1][k]) / 2, whole[k], atol=1e-6, rtol=1e-4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        drafter, heads = _drafter(), _heads()
        loss, grads, _ = _grads(drafter, _Context(drafter, heads, world=world), _rows(_batch(), rank), True)
        flat = torch.cat([g.flatten() for _, g in sorted(grads.items())] + [torch.tensor([loss])])
        dist.all_reduce(flat)  # what DDP does with the gradients (then divides by the world size)
        if rank == 0:
            torch.save(flat / world, out)
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_train_on_the_global_batch(tmp_path):
    """The same with two gloo processes, the counts summed by a real all_reduce."""
    out = tmp_path / "mean.pt"
    mp.spawn(_rank_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    drafter = _drafter()
    loss, grads, _ = _grads(drafter, _Context(drafter, _heads()), _batch(), global_norm=False)
    expected = torch.cat([g.flatten() for _, g in sorted(grads.items())] + [torch.tensor([loss])])
    torch.testing.assert_close(torch.load(out), expected, atol=1e-6, rtol=1e-4)


def test_micro_batches_of_one_step_draw_their_own_anchors():
    """Under gradient accumulation the micro-batches of an optimizer step draw different anchors (a draw seeded by the
    step alone repeats them); the first micro-batch draws what a run without accumulation draws, and a rerun (a
    fresh objective, or the same one back at that step) draws the same sequence."""
    drafter, heads = _drafter(), _heads()
    context = _Context(drafter, heads, step=4)
    context.objective.settings = DFlashTraining(num_anchors=3)  # 3 of the row's eligible anchors: the draw matters
    batch = _batch()
    kind = get_kind("dflash")

    def losses(ctx, steps):
        out = []
        for step in steps:
            ctx.global_step = step
            out.append(float(kind.training_loss(ctx, batch, 1).loss.detach()))
        return out

    first = losses(context, [4, 4, 4, 5])
    assert len(set(first[:3])) == 3  # the same batch, three micro-batches of step 4: three draws
    again = _Context(drafter, heads)
    again.objective.settings = context.objective.settings
    assert losses(again, [4, 4, 4, 5]) == first
    assert losses(context, [6, 6]) == losses(again, [6, 6])
    # micro-batch 0 is the draw of a step without accumulation (as seeded before micro-batches had an index)
    g = context.objective.anchor_generator(4, True, 0)
    legacy = torch.Generator().manual_seed((context.objective.seed * 1_000_003 + 2 * 4) % 2**63)
    assert torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=legacy))
