"""All parallelism in one place: the strategy builder, FSDP2 sharding and activation checkpointing.

The drafter and adapter files import nothing distributed; `Eagle3Module.configure_model` calls `shard_fsdp2`
here when the strategy is FSDP.

FSDP = FSDP2 (`torch.distributed.fsdp.fully_shard`) under Lightning's `ModelParallelStrategy` with a 1-D
data-parallel mesh (tensor_parallel_size=1). Lightning 2.6.6's ModelParallelStrategy has no CUDA-only code path:
the mesh is built on the root device's type and the process group backend follows the device (gloo on CPU), so
the same strategy runs the CPU tests and multi-GPU jobs. Checkpoints are saved consolidated
(`save_distributed_checkpoint=False`): one `last.ckpt` file that resumes under any world size.

What is sharded: every decoder layer of the frozen target (online mode; `adapter.decoder_layers`) and the
drafter's objective as one unit. The target's embedding, final norm and lm_head stay replicated: the training step
reads their weights directly (embedding of the next tokens, draft-vocab rows of the lm_head) outside any FSDP
forward, where sharded parameters would not be gathered.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

# DeepSpeed is not offered: nothing here tested it working, and FSDP2 covers what ZeRO would do for a drafter
STRATEGIES = ("auto", "ddp", "fsdp")


def _num_devices(devices: int | str, accelerator: str) -> int:
    """Devices per node as Lightning will resolve them ("auto"/-1 = all GPUs, or one CPU process)."""
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        parts = [p for p in devices.split(",") if p.strip()]
        return len(parts) if len(parts) > 1 or devices.endswith(",") else int(parts[0])
    if isinstance(devices, int) and devices > 0:
        return devices
    use_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return max(torch.cuda.device_count(), 1) if use_gpu else 1


def build_strategy(
    name: str,
    adapter: Any | None = None,
    *,
    devices: int | str = "auto",
    num_nodes: int = 1,
    accelerator: str = "auto",
) -> Strategy | str:
    """Turn a recipe's `trainer.strategy` into a Lightning strategy.

    Args:
        name: "auto", "ddp" or "fsdp".
        adapter: the target's adapter (FSDP reads its decoder layers when the module is configured).
        devices: `trainer.devices` (FSDP needs the world size for its data-parallel mesh).
        num_nodes: `trainer.num_nodes`.
        accelerator: the Trainer's accelerator.

    Raises:
        ValueError: unknown strategy name (the valid ones are listed).
    """
    if name == "auto":
        return "auto"
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        # every drafter parameter receives a gradient at every step (ttt_loss keeps them all in the graph)
        return DDPStrategy(find_unused_parameters=False)
    if name == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        world = _num_devices(devices, accelerator) * num_nodes
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                     save_distributed_checkpoint=False)
    raise ValueError(f"unknown strategy {name!r} (recipe trainer.strategy); valid: {', '.join(STRATEGIES)}")


def shard_fsdp2(target: nn.Module | None, adapter: Any, objective: nn.Module, mesh: Any) -> None:
    """Apply FSDP2 in place: each target decoder layer, then the drafter objective as one unit.

    Args:
        target: the frozen target (None in offline mode: only the drafter is sharded).
        adapter: its adapter (`decoder_layers(model)` lists the wrap units).
        objective: the module whose `forward` runs the drafter and its loss (parameters gathered around it).
        mesh: a 1-D data-parallel `DeviceMesh`.

    Mixed precision stays Lightning's (autocast from `trainer.precision`), as with the other strategies.
    """
    from torch.distributed.fsdp import fully_shard

    if target is not None:
        for layer in adapter.decoder_layers(target):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(objective, mesh=mesh)


def enable_activation_checkpointing(drafter: nn.Module) -> None:
    """Recompute the drafter MLP's activations in backward instead of keeping them for every TTT step.

    The MLP's `[T, intermediate]` gate/up activations are the largest tensors each unrolled step keeps for backward
    (K of them per batch). The forward is replaced on the instance, so parameter names (and hence checkpoints
    and `save_pretrained`) are unchanged. The target runs under no_grad and keeps no activations.
    """
    mlp = drafter.midlayer.mlp
    if getattr(mlp, "_eagle3_checkpointed", False):
        return
    mlp.forward = functools.partial(checkpoint, mlp.forward, use_reentrant=False)
    mlp._eagle3_checkpointed = True
