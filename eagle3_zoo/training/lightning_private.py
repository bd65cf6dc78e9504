"""Every private Lightning and torch name the package uses, here and nowhere else.

A private name (leading underscore) can change or disappear in any release. Each one is reached only through a
function of this module, and `PRIVATE_NAMES` lists them all: `tests/test_lightning_private.py` checks that every
one still exists on the installed versions (so an upgrade fails in a test, not hours into a run) and that no other
module of the package imports a private Lightning or torch name.

Checked on lightning 2.6.6 with torch 2.13.0 (the CPU stack of `scripts/setup.sh`) and, for the Lightning names,
on lightning 2.6.0 (the low stack of `scripts/test_low_stack.sh`, which runs the test above on torch 2.11.0 too).
`pyproject.toml` accepts lightning 2.6.x only.

- `ModelCheckpoint._save_last_checkpoint(trainer, monitor_candidates)` and `ModelCheckpoint._monitor_candidates
  (trainer)`: `eagle3_zoo.training.fit.LastCheckpoint` saves `last.ckpt` at the end of training even when the
  stock callback would skip it. The public `trainer.save_checkpoint` writes a file, but not as the callback does:
  the file name from the callback's template, `last_model_path` (part of the callback's checkpointed state), the
  link mode, the removal of the previous `last` and the loggers' `after_save_checkpoint` all live in these two.
- `ModelCheckpoint._last_global_step_saved`: the step the callback last saved at (no public counterpart); the
  end-of-training save is skipped when it already saved this step and this start trained nothing.
- `LightningModule._trainer`: the Trainer a module is attached to, or None. The public `trainer` property raises
  when there is none; `DrafterModule` runs outside a Trainer too (tests, evaluation), where its steps skip the
  cross-rank reductions.
- `Trainer._logger_connector.should_update_logs`: whether the loggers record the metrics of the training step about
  to run (every `log_every_n_steps`-th batch, and the last); `DrafterModule.training_step` computes its metric-only
  per-step acceptance (alpha) on those steps only. No public property says it, and a copy of the rule would drift
  from Lightning's own count of batches.
- `torch.distributed.tensor._utils.compute_local_shape_and_global_offset(shape, mesh, placements)`: the rows of a
  sharded (DTensor) parameter this rank owns, so `eagle3_zoo.training.strategies.load_target_shards` reads only
  those from the safetensors files. torch has no public function for it (`DTensor.to_local()` gives the local
  shape, not its offset in the global tensor).
- `WandbLogger()._wandb_init`: the arguments the logger gives `wandb.init`. Lightning always passes `anonymous`
  (None when not asked for), which wandb 0.2x+ answers with a warning at every start that a user cannot act on
  ("The anonymous setting has no effect"); `quiet_wandb_logger` drops it.
"""

from __future__ import annotations

import importlib
from typing import Any

# (module, attribute path inside it): each must exist on the supported versions
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.callbacks", "ModelCheckpoint._save_last_checkpoint"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint._monitor_candidates"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint()._last_global_step_saved"),  # set by __init__: on an instance
    ("lightning.pytorch", "LightningModule()._trainer"),
    ("lightning.pytorch", "Trainer()._logger_connector.should_update_logs"),  # set by __init__: on an instance
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("lightning.pytorch.loggers", "WandbLogger()._wandb_init"),  # needs wandb (the dev extra installs it)
)


def resolve(module: str, path: str) -> Any:
    """The object `path` names in `module` (`Class()` in the path: an instance made without arguments).

    Raises:
        AttributeError, ImportError: the name is gone.
    """
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        if part.endswith("()"):
            obj = getattr(obj, part[:-2])()
        else:
            obj = getattr(obj, part)
    return obj


def last_global_step_saved(checkpoint_callback: Any) -> int:
    """The global step a `ModelCheckpoint` last saved at (0 before its first save)."""
    return checkpoint_callback._last_global_step_saved


def save_last_checkpoint(checkpoint_callback: Any, trainer: Any) -> None:
    """Save the callback's `last` checkpoint now, as it does itself (name, state, link mode, loggers notified)."""
    checkpoint_callback._save_last_checkpoint(trainer, checkpoint_callback._monitor_candidates(trainer))


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (outside `trainer.fit`/`validate`)."""
    return module._trainer


def should_update_logs(trainer: Any) -> bool:
    """Whether the loggers record the metrics logged in the current (or next) training step."""
    return trainer._logger_connector.should_update_logs


def local_shape_and_global_offset(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape of a DTensor and the offset of its first element in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def quiet_wandb_logger(logger: Any) -> Any:
    """A `WandbLogger` without the `anonymous=None` argument wandb warns about (see the module docstring)."""
    if logger._wandb_init.get("anonymous", "") is None:
        del logger._wandb_init["anonymous"]
    return logger
