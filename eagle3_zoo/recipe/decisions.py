"""The decisions a training run takes once, from the recipe alone: the number of processes, what of the target each
trainer rank loads, how FSDP lays out its shards, the dtypes, and where each phase runs (in this process or in the
recipe's engine).

    rp = run_plan(load_recipe("recipes/llama3_70b.yaml"))
    rp.world_size, rp.target_load, rp.regeneration, rp.hidden_states   # 8, "fsdp shard", "server", "engine"

`eagle3-zoo plan` prints these decisions with their memory, `RunDataModule.prepare_run` loads the target as
`target_load` says and the strategy builder sizes its mesh with `world_size` / `fsdp_shard_size`: each decision is
one function here, so what `plan` reports is what the run does. Pure Python on the recipe (torch only for dtypes,
imported where they are made: counting the devices a recipe declares does not wait for it); nothing is loaded.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from eagle3_zoo.recipe.sections import (
    features_from_engine,
    streams_features,
    target_in_training_step,
    target_sharded_in_trainer,
)
from eagle3_zoo.values.dtypes import torch_dtype

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.recipe.sections import DataConfig, DrafterConfig, Recipe, TrainerConfig


TargetLoad = Literal["whole", "fsdp shard", "heads only"]
Site = Literal["off", "in process", "vllm server", "server", "engine", "training step", "feature job"]


# device files of a GPU driver torch can use: NVIDIA (Linux), WSL2's GPU paravirtualisation, AMD ROCm (HIP)
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def gpu_driver_present() -> bool:
    """Whether this machine shows the device files of a GPU driver (and CUDA_VISIBLE_DEVICES does not hide every
    GPU): without them torch sees no GPU, which is then known without importing it (seconds to a minute on a loaded
    machine)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1") and any(glob.glob(f) for f in _GPU_DEVICE_FILES)


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def devices_per_node(devices: int | str, accelerator: str) -> int:
    """Devices per node as Lightning resolves `trainer.devices` ("0,1" = 2, "3" = 3, "auto"/-1 = all GPUs, else
    one CPU process)."""
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        parts = [p for p in devices.split(",") if p.strip()]
        return len(parts) if len(parts) > 1 or devices.endswith(",") else int(parts[0])
    if isinstance(devices, int) and devices > 0:
        return devices
    return max(_cuda_device_count(), 1) if accelerator in ("gpu", "cuda", "auto") else 1


def require_accelerator(trainer: TrainerConfig, source: str = "recipe") -> None:
    """Stop at once when the recipe declares GPUs (`trainer.accelerator: gpu`) and this machine has none, before
    minutes of loading a target that could not be trained here anyway (and, on a machine with no GPU driver, before
    torch is imported).

    Raises:
        ValueError: no CUDA device, or fewer than `trainer.devices`.
    """
    t = trainer
    if t.accelerator != "gpu":
        return
    have = _cuda_device_count() if gpu_driver_present() else 0
    # "0,1" wants two, as the strategy will start; with none here any number is too many ("auto" counts with torch)
    want = devices_per_node(t.devices, t.accelerator) if have else 1
    if have < want:
        found = f"only {have} CUDA device(s)" if have else "no CUDA GPU"
        raise ValueError(f"{source}: trainer.accelerator = 'gpu' with trainer.devices = {t.devices}, but this machine "
                         f"has {found}. Run it on a machine with the GPUs it declares, or override "
                         "trainer.accelerator=cpu trainer.devices=1 to try it here (a CPU cannot train this target "
                         "in useful time)")


def trainer_device(accelerator: str) -> str:
    """What one trainer rank runs on, in words: "GPU", or "CPU process" (`trainer.accelerator` cpu, or auto on a
    machine without a CUDA GPU, where Lightning picks the CPU)."""
    if accelerator == "cpu" or (accelerator == "auto" and not (gpu_driver_present() and _cuda_device_count())):
        return "CPU process"
    return "GPU"


def counted_devices(devices: int | str, accelerator: str) -> tuple[str, bool]:
    """How `devices_per_node` counted `trainer.devices` "auto" or -1 on this machine, in words ("" for a count or a
    list given), and whether the count is an assumption: with no CUDA GPU visible here (planning a GPU run on a
    laptop), one device is counted, while the run takes every GPU of its node."""
    if devices not in ("auto", "-1", -1):
        return "", False
    key = f"trainer.devices = {devices}"
    if accelerator == "cpu":
        return f"{key} on the CPU: one process", False
    visible = _cuda_device_count() if accelerator in ("gpu", "cuda", "auto") else 0
    if visible:
        return f"{key}: the {visible} CUDA GPU(s) visible here", False
    return (f"{key}, but no CUDA GPU is visible here: counted as 1 device, while the run takes every GPU of its "
            "node; pass trainer.devices=N to plan for N GPUs per node"), True


def world_size(devices: int | str, num_nodes: int, accelerator: str) -> int:
    """The number of trainer processes (`devices_per_node` x `num_nodes`)."""
    return devices_per_node(devices, accelerator) * num_nodes


def fsdp_shard_size(world: int, num_nodes: int) -> int:
    """Ranks one FSDP shard group spans: all of them on one node; across nodes the ranks of a node (HSDP: sharded
    within a node, replicated across nodes), unless each node has a single rank."""
    if num_nodes <= 1 or world % num_nodes or world == num_nodes:
        return world
    return world // num_nodes


def target_skeleton_reason(recipe: Recipe) -> str | None:
    """Why the recipe's target must be loaded whole before training (None: FSDP can load it shard by shard).

    Only FSDP in online mode shards the target; the data stage must not run the target before it is sharded
    (in-process regeneration, `optim.precondition_fc`'s feature statistics), and a LoRA is merged into full weights.
    """
    if not target_sharded_in_trainer(recipe.data, recipe.trainer):
        return "only FSDP with the target in the training step (or, features from the engine, for tau evaluation) " \
               "shards the target"
    if recipe.target.lora_path:
        return "target.lora_path is merged into the full weights"
    if regeneration_site(recipe.data) == "in process":
        return "data.regenerate runs the target in this process (backend hf) before training"
    if recipe.optim.precondition_fc and not recipe.drafter.init_from:
        return "optim.precondition_fc runs the target on training samples before training"
    if _drafter_starts_from_target_layers(recipe.drafter):
        return "the drafter's layers are copied from the target's decoder layers before training"
    return None


def regeneration_site(data: DataConfig) -> Site:
    """Where `data.regenerate` runs: off, in process (hf `generate` on every trainer rank), a vLLM server started
    here for the target (backend vllm: one server, no parallelism), a server started outside (backend openai) or the
    recipe's engine deployment (backend engine)."""
    r = data.regenerate
    if not r.enabled:
        return "off"
    return {"hf": "in process", "vllm": "vllm server", "openai": "server", "engine": "engine"}[r.backend]


def hidden_states_site(data: DataConfig) -> Site:
    """Where the target's hidden states are computed: in the training step (online, hf), by the recipe's engine
    (`data.features_backend: vllm`) or by the feature job in process (offline, hf)."""
    if features_from_engine(data):
        return "engine"
    return "training step" if target_in_training_step(data) else "feature job"


def target_load(recipe: Recipe) -> tuple[TargetLoad, str]:
    """What of the target each trainer rank loads, and why: the whole model, its FSDP shard (decoder layers read
    slice by slice after sharding) or only its embedding, final norm and lm_head (features from a store or the
    engine, no tau evaluation, nothing else running the target in this process)."""
    d, tau = recipe.data, bool(recipe.trainer.tau_eval.every_n_steps)
    layers = _drafter_starts_from_target_layers(recipe.drafter)
    if not (target_in_training_step(d) or tau or recipe.target.lora_path or layers
            or regeneration_site(d) == "in process"):
        return "heads only", "features come from " + ("the engine" if features_from_engine(d) else "the store")
    reason = target_skeleton_reason(recipe)
    if reason is None:
        return "fsdp shard", "online features" if target_in_training_step(d) else "tau evaluation during training"
    if target_sharded_in_trainer(d, recipe.trainer):
        return "whole", reason  # loaded whole on every rank, then sharded
    why = [w for w, on in (("online features", target_in_training_step(d)), ("tau evaluation during training",
           tau), ("data.regenerate in process", regeneration_site(d) == "in process"),
           ("target.lora_path merged", bool(recipe.target.lora_path)),
           ("the drafter's layers start from the target's", layers)) if on]
    return "whole", ", ".join(why)


def _drafter_starts_from_target_layers(drafter: DrafterConfig) -> bool:
    from eagle3_zoo.drafters.base import starts_from_target_layers  # torch-free: the kind's module is not imported

    return not drafter.init_from and starts_from_target_layers(drafter, drafter.kind)


def stored_dtype(precision: str) -> torch.dtype:
    """The dtype of the drafter's stored parameters under a `trainer.precision` (Lightning converts the module
    under the `*-true` precisions; the mixed precisions keep fp32 weights)."""
    import torch

    return {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision,
                                                                                                torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the drafter's matmuls under a `trainer.precision` (autocast's under `*-mixed`)."""
    import torch

    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, stored_dtype(precision))


def fsdp_drafter_dtypes(precision: str) -> tuple[torch.dtype, torch.dtype] | None:
    """The (parameter, gradient reduction) dtypes of FSDP2's mixed-precision policy for the drafter
    (`strategies.drafter_mixed_precision`): bf16 / fp32 under `bf16-mixed`, else None (no policy)."""
    import torch

    return (torch.bfloat16, torch.float32) if precision == "bf16-mixed" else None


def drafter_dtype_name(precision: str) -> str:
    """The dtype the drafter checkpoint is saved in: the training precision's half type, else float32."""
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    return "float32"


def drafter_config(drafter: DrafterConfig, target_name: str, precision: str, target_config: Any,
                   aux_layer_ids: tuple[int, ...] | None) -> Any:
    """The config of a fresh drafter of the recipe's `drafter.kind` (`DrafterKind.config_from`): sized like the target,
    with the family's published-drafter shape (`TargetAdapter.drafter_defaults`) and the recipe's overrides on top.
    `drafter`: the recipe's `drafter` section; `target_name`: its `target.name_or_path`; `precision`: its
    `trainer.precision` (the config's dtype).
    A built-in kind that builds its config without torch is not imported (`eagle3_zoo.drafters.config_from`): `plan`
    imports no model code."""
    from eagle3_zoo.adapters import adapter_for
    from eagle3_zoo.drafters import config_from

    defaults, dtype = adapter_for(target_config).drafter_defaults, drafter_dtype_name(precision)
    return config_from(drafter.kind, drafter, target_config, aux_layer_ids=aux_layer_ids,
                       defaults=defaults, target_name=target_name, torch_dtype=dtype)


@dataclass(frozen=True)
class RunPlan:
    """A recipe's run decisions (see the module docstring); `run_plan` builds it."""

    world_size: int
    num_nodes: int
    strategy: str
    shard: int  # ranks an FSDP shard group spans (1: nothing sharded)
    target_load: TargetLoad
    target_load_reason: str
    target_in_step: bool  # the target runs in the training step (online, in process)
    target_kept: bool  # the trainer keeps the target after the data stage (training step or tau evaluation)
    target_sharded: bool  # FSDP shards the kept target over the trainer's ranks
    tau: bool
    regeneration: Site
    hidden_states: Site
    streams: bool  # hidden states streamed from the engine into training (online / hybrid)
    target_dtype: torch.dtype
    drafter_dtype: torch.dtype  # stored (weights, grads, AdamW)
    compute_dtype: torch.dtype

    @property
    def replicas(self) -> int:
        """Copies of each FSDP shard (nodes under HSDP; 1 on one node)."""
        return self.world_size // self.shard if self.strategy == "fsdp" else self.world_size


def run_plan(recipe: Recipe) -> RunPlan:
    """The decisions of `recipe`'s run (nothing loaded, nothing allocated)."""
    tr, d = recipe.trainer, recipe.data
    world = world_size(tr.devices, tr.num_nodes, tr.accelerator)
    load, why = target_load(recipe)
    tau = bool(tr.tau_eval.every_n_steps)
    in_step = target_in_training_step(d)
    return RunPlan(
        world_size=world, num_nodes=tr.num_nodes, strategy=tr.strategy,
        shard=fsdp_shard_size(world, tr.num_nodes) if tr.strategy == "fsdp" else 1,
        target_load=load, target_load_reason=why, target_in_step=in_step, target_kept=in_step or tau,
        target_sharded=target_sharded_in_trainer(d, tr), tau=tau, regeneration=regeneration_site(d),
        hidden_states=hidden_states_site(d), streams=streams_features(d),
        target_dtype=torch_dtype(recipe.target.dtype), drafter_dtype=stored_dtype(tr.precision),
        compute_dtype=compute_dtype(tr.precision))
