"""A drafter (or target) sharded by FSDP2, run outside the FSDP forward: whether a module is sharded, putting its
units back to their shards, and a plain gathered copy of a sharded drafter (tau evaluation decodes with it). The
training strategies shard; decoding only needs these three, so they sit here, below `training/`."""

from __future__ import annotations

import torch
from torch import nn


def is_sharded(module: nn.Module | None) -> bool:
    """Whether `module` holds FSDP2-sharded (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    return module is not None and any(isinstance(p, DTensor) for p in module.parameters())


def reshard(module: nn.Module) -> None:
    """Put every FSDP2 unit in `module` back to its sharded parameters (no collective). The root unit keeps its
    gathered parameters, in the `MixedPrecisionPolicy`'s compute dtype, after a forward without backward."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def unsharded_drafter(drafter: nn.Module) -> nn.Module:
    """A plain copy of an FSDP2-sharded drafter, for running it outside the FSDP forward (tau evaluation decodes
    with it). Every parameter is gathered whole with `DTensor.full_tensor`, a collective: every rank must call this
    at the same point. The copy is on every rank, on this rank's device, in the stored dtype of the parameters (the
    fp32 master weights under bf16-mixed, not the policy's bf16 compute copy), so it computes exactly what the
    unsharded drafter computes; buffers (FSDP2 does not shard them) and the fc preconditioning are shared."""
    from torch.distributed.tensor import DTensor

    with torch.device("meta"):
        copy = type(drafter)(drafter.config)
    copy._fc_scaled = drafter._fc_scaled
    for name, param in drafter.named_parameters():
        owner, _, leaf = name.rpartition(".")
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        setattr(copy.get_submodule(owner), leaf, nn.Parameter(full, requires_grad=False))
    for name, buf in drafter.named_buffers():
        owner, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(owner), leaf, buf)
    return copy.train(drafter.training)
