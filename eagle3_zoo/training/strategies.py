"""All parallelism in one place: the strategy builder, FSDP2 sharding and activation checkpointing.

The drafter and adapter files import nothing distributed; `DrafterModule.configure_model` calls `shard_fsdp2`
here when the strategy is FSDP.

FSDP = FSDP2 (`torch.distributed.fsdp.fully_shard`) under Lightning's `ModelParallelStrategy`
(tensor_parallel_size=1). Lightning 2.6's ModelParallelStrategy has no CUDA-only code path: the mesh is built on
the root device's type and the process group backend follows the device (gloo on CPU), so the same strategy runs
the CPU tests and multi-GPU jobs. The sharding mesh is flat on one node and 2-D across nodes (HSDP: replicate
across nodes, shard within a node; `fsdp_mesh`). Under `trainer.precision: bf16-mixed` the drafter computes with
bf16 parameters and reduces gradients in fp32 (`MixedPrecisionPolicy`); the frozen target stays in its own dtype.

Checkpoints are sharded (torch.distributed.checkpoint, DCP): `last.ckpt` is a directory in which every rank writes
its own shards (`ShardedCheckpointStrategy`, staged and renamed into place); DCP reshards on load, so it resumes
under another world size. `eagle3_zoo.training.rundir.outputs.consolidate_checkpoint` turns one into a drafter folder.

A target loaded as a skeleton (`eagle3_zoo.adapters.loading.load_target_skeleton`: decoder layers on the meta
device) is filled after sharding by `load_target_shards`: each rank reads only the slices it owns from the
safetensors files, so no process ever holds the whole target.

What is sharded: every decoder layer of the frozen target (online mode; `adapter.decoder_layers`) and the
drafter's objective as one unit. The target's embedding, final norm and lm_head stay replicated: the training step
reads their weights directly (embedding of the next tokens, draft-vocab rows of the lm_head) outside any FSDP
forward, where sharded parameters would not be gathered. The target's base model (the module whose forward runs
the layers) is the one FSDP root of the target, its own parameters ignored: a root waits for the compute stream
before its all-gathers, so with every layer a root of its own no layer's all-gather could overlap the previous
layer's compute. Each layer also prefetches the next one's all-gather explicitly (issued before its own compute,
which keeps the target's step and tau evaluation's small decode forwards from waiting on communication).
"""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3_zoo.recipe.decisions import (  # noqa: F401
    fsdp_drafter_dtypes,
    fsdp_shard_size,
    target_skeleton_reason,
    world_size,
)
from eagle3_zoo.util.fileio import replace_directory

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

logger = logging.getLogger(__name__)

# DeepSpeed is not offered: nothing here tested it working, and FSDP2 covers what ZeRO would do for a drafter
STRATEGIES = ("auto", "ddp", "fsdp")


def build_strategy(
    name: str,
    *,
    devices: int | str = "auto",
    num_nodes: int = 1,
    accelerator: str = "auto",
) -> Strategy | str:
    """Turn a recipe's `trainer.strategy` into a Lightning strategy.

    Args:
        name: "auto", "ddp" or "fsdp".
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
        world = world_size(devices, num_nodes, accelerator)
        return _sharded_checkpoint_strategy()(data_parallel_size=world, tensor_parallel_size=1)
    raise ValueError(f"unknown strategy {name!r} (recipe trainer.strategy); valid: {', '.join(STRATEGIES)}")


def _sharded_checkpoint_strategy() -> type:
    from lightning.pytorch.strategies import ModelParallelStrategy

    class ShardedCheckpointStrategy(ModelParallelStrategy):
        """`ModelParallelStrategy` whose DCP checkpoint directory is written next to its destination and renamed
        into place once every rank has written its shards, so a crash mid-save leaves the previous checkpoint."""

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            path = Path(self.broadcast(filepath))
            staged = path.with_name(f".{path.name}.staged")
            if self.global_rank == 0:
                shutil.rmtree(staged, ignore_errors=True)  # left by a save that was killed
            self.barrier("dcp-staged-clean")
            super().save_checkpoint(checkpoint, staged, storage_options)
            self.barrier("dcp-staged-written")
            if self.global_rank == 0:
                replace_directory(staged, path)
            self.barrier("dcp-renamed")

    return ShardedCheckpointStrategy


def fsdp_mesh(mesh: Any, num_nodes: int) -> Any:
    """The FSDP sharding mesh from the strategy's mesh: flat (`data_parallel`) on one node; 2-D across nodes
    (`("replicate", "shard")`, HSDP: parameters sharded within a node, replicated across nodes, so the slow
    inter-node links carry one gradient all-reduce instead of every all-gather)."""
    world = mesh.size()
    shard = fsdp_shard_size(world, num_nodes)  # the shard group `plan` reports (eagle3_zoo.recipe.decisions)
    if shard == world:
        return mesh["data_parallel"]
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(mesh.device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def drafter_mixed_precision(precision: str) -> Any:
    """FSDP2's mixed-precision policy of the drafter: bf16 parameters in forward/backward and fp32 gradient
    reduction under `bf16-mixed`; None otherwise (fp32 throughout, or Lightning's fp16 autocast). Inputs are not
    cast: the target's features and logits keep their precision, autocast handles the drafter's matmuls."""
    dtypes = fsdp_drafter_dtypes(precision)  # the decision `plan` sizes with
    if dtypes is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1], cast_forward_inputs=False)


def shard_fsdp2(target: nn.Module | None, adapter: Any, objective: nn.Module, mesh: Any,
                precision: str = "32-true", device: torch.device | str = "cpu") -> dict[str, int]:
    """Apply FSDP2 in place: each target decoder layer, the target's base model as their one root (its embedding
    and final norm ignored, i.e. replicated), then the drafter objective as one unit. A skeleton target
    (`load_target_skeleton`) is then filled with this rank's slices (`load_target_shards`).

    Args:
        target: the frozen target (None in offline mode: only the drafter is sharded).
        adapter: its adapter (`decoder_layers(model)` lists the wrap units).
        objective: the module whose `forward` runs the drafter and its loss (parameters gathered around it).
        mesh: the sharding `DeviceMesh` (`fsdp_mesh`).
        precision: `trainer.precision` (bf16-mixed gives the drafter `drafter_mixed_precision`).
        device: where a skeleton target's shards are placed.

    Returns:
        What `load_target_shards` read (empty for a target that was already loaded).
    """
    from torch.distributed.fsdp import fully_shard

    stats: dict[str, int] = {}
    if target is not None:
        layers = list(adapter.decoder_layers(target))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)  # the target keeps its dtype: no policy
        for layer, after in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([after])
        shard_target_root(adapter.base_model(target), mesh)
        if getattr(target, "eagle3_weight_files", None) is not None:
            stats = load_target_shards(target, adapter, device)
    policy = drafter_mixed_precision(precision)
    fully_shard(objective, mesh=mesh, **({"mp_policy": policy} if policy is not None else {}))
    return stats


def shard_target_root(base: nn.Module, mesh: Any) -> None:
    """Make the target's base model the one FSDP root over its (already sharded) decoder layers, managing none of
    its own parameters: the embedding and the final norm stay plain tensors that the step reads directly."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    own = {p for p in base.parameters() if not isinstance(p, DTensor)}
    fully_shard(base, mesh=mesh, reshard_after_forward=True, ignored_params=own)


@torch.no_grad()
def load_target_shards(target: nn.Module, adapter: Any, device: torch.device | str) -> dict[str, int]:
    """Fill the sharded (DTensor) meta parameters of a skeleton target's decoder layers with this rank's slices,
    read from the safetensors files (`safe_open(...).get_slice`): each rank reads only the rows it owns.

    Returns:
        `{"tensors": slices read, "bytes": bytes read}` for this rank (the decoder layers' share).
    """
    from contextlib import ExitStack

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from eagle3_zoo.training.lightning_private import local_shape_and_global_offset

    files: dict[str, Path] = target.eagle3_weight_files
    layers = adapter.decoder_layers(target)
    prefix = next(n for n, m in target.named_modules() if m is layers) + "."
    read = {"tensors": 0, "bytes": 0}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def slice_of(key: str, index: tuple[slice, ...]) -> torch.Tensor:
            if files[key] not in handles:
                handles[files[key]] = stack.enter_context(safe_open(files[key], "pt"))
            value = handles[files[key]].get_slice(key)[index]
            read["tensors"] += 1
            read["bytes"] += value.numel() * value.element_size()
            return value

        for i, layer in enumerate(layers):
            buffers = {n: b.clone() for n, b in layer.named_buffers() if not b.is_meta}
            layer.to_empty(device=device)
            for name, buf in layer.named_buffers():  # to_empty leaves real buffers uninitialised: put them back
                if name in buffers:
                    buf.copy_(buffers[name])
            for name, param in layer.named_parameters():
                key = f"{prefix}{i}.{name}"
                if isinstance(param, DTensor):
                    shape, offset = local_shape_and_global_offset(param)
                    local = param.to_local()
                else:
                    shape, offset, local = tuple(param.shape), (0,) * param.dim(), param
                if 0 in shape:
                    continue  # this rank owns no rows of it
                local.copy_(slice_of(key, tuple(slice(o, o + n) for o, n in zip(offset, shape))))
    target.eagle3_weight_files = None
    return read


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
