"""`fit`: recipe -> trained drafter folder (`eagle3-zoo fit RECIPE k=v ...`, `python -m eagle3_zoo.cli fit ...`).

    fit_main("recipes/smollm2_135m.yaml", ["trainer.max_steps=30"])  # -> Path("runs/smollm2_135m/drafter")

Steps: Lightning Trainer (strategy, loggers, checkpoints every N steps with a `last.ckpt`) -> `trainer.fit`, which
starts the run's processes and then runs Lightning's hooks on every rank (`eagle3_zoo.training.build`): the
DataModule's `setup` (seed -> load the target -> prepare data (read, regenerate, split, tokenise, draft-vocab counts)
-> (offline: extract features) -> the draft vocabulary), the callbacks' `setup` (the run identity, checked against
`output_dir/checkpoints/last.ckpt` if it exists: resumed only when written by a run with the same settings,
`eagle3_zoo.training.rundir.resume`; provenance; then the loggers), the module's `setup` (the drafter) and
`configure_model` (FSDP sharding) -> resume -> train -> write `output_dir/drafter/`. A non-finite loss stops
training; the last (finite) checkpoint stays. Ctrl-C stops it too (`FitInterrupted`, exit 130), naming the
checkpoint a rerun resumes from (`eagle3_zoo.training.interrupt`).

Multi-process strategies (ddp, fsdp) relaunch the *command line* for the other ranks (Lightning's subprocess
launcher), so run them through the CLI (`eagle3-zoo fit` or `python -m eagle3_zoo.cli fit`), not from an
interactive session. Lightning starts the ranks in `trainer.fit` before the data stage, which runs in its `setup`
hook: the target sits on each rank's own GPU from the start, and regeneration and the feature job are split across
the ranks (`eagle3_zoo.data.ranks`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from eagle3_zoo.checkpoint.folder import write_drafter_folder
from eagle3_zoo.data.engine.feed import EngineFeedError
from eagle3_zoo.data.tokenize import draft_vocab_coverage
from eagle3_zoo.drafters import get_kind
from eagle3_zoo.recipe.decisions import require_accelerator, run_plan, world_size
from eagle3_zoo.recipe.sections import (
    DataConfig,
    Recipe,
    TargetConfig,
    TauEvalConfig,
    TrainerConfig,
    recipe_identity_dict,
    recipe_to_dict,
)
from eagle3_zoo.training.build import NO_VALIDATION, RecipeModule, run_datamodule
from eagle3_zoo.training.callbacks import ProgressLogCallback, StepProgressBar, TTTScheduleCallback
from eagle3_zoo.training.engine_callback import EngineFeedCallback
from eagle3_zoo.training.interrupt import InterruptWatch
from eagle3_zoo.training.lightning_private import last_global_step_saved, quiet_wandb_logger, save_last_checkpoint
from eagle3_zoo.training.module import NonFiniteError, all_finite
from eagle3_zoo.training.rundir import resume
from eagle3_zoo.training.rundir.lock import CHECKPOINT_DIR, DRAFTER_DIR
from eagle3_zoo.training.rundir.outputs import build_provenance, drafter_info, drafter_summary, full_drafter
from eagle3_zoo.training.rundir.record import TrainingRecordCallback
from eagle3_zoo.training.strategies import build_strategy
from eagle3_zoo.util.fileio import atomic_write, recover_replaced_directory
from eagle3_zoo.util.progress import use_bar
from eagle3_zoo.util.provenance import git_info

logger = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.ckpt"


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt` every N steps *and* at the end of training (ModelCheckpoint alone skips the final step when
    an earlier step was already saved in this run); the final save happens even then when this start trained, so
    that the checkpoint carries the run's final record (`eagle3_zoo.training.rundir.record`: metrics of the last
    validation, wall time)."""

    _start_step = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_step = trainer.global_step

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trained = trainer.global_step != self._start_step
        if self.save_last and (trained or last_global_step_saved(self) != trainer.global_step):
            save_last_checkpoint(self, trainer)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temp file in their own directory, fsynced, then renamed over the old one.

    Lightning's default goes through an fsspec transaction whose temp file lives in the *system* temp dir and is
    moved into place on commit: a copy, not an atomic rename, when the output dir is on another filesystem, so a
    crash mid-save could leave a truncated `last.ckpt`.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        atomic_write(Path(path), lambda tmp: torch.save(checkpoint, tmp))


def _loggers(trainer: TrainerConfig, output_dir: Path) -> list[Any]:
    # A fresh version directory per (re)start: Lightning's CSV writer cannot append to a file whose header lists
    # metrics this process has not logged yet.
    root = output_dir / "logs"
    version = f"version_{len(list(root.glob('version_*'))) if root.is_dir() else 0}"
    out = []
    for name in trainer.logger:
        if name == "csv":
            out.append(CSVLogger(output_dir, name="logs", version=version,
                                 flush_logs_every_n_steps=trainer.log_every_n_steps))
        elif name == "tensorboard":
            out.append(TensorBoardLogger(output_dir, name="logs", version=version, sub_dir="tensorboard",
                                         default_hp_metric=False))
        elif name == "wandb":
            out.append(_wandb_logger(output_dir, version))
    return out


WANDB_MISSING = ("trainer.logger lists 'wandb' but the wandb package is not installed: pip install "
                 "'eagle3-zoo[wandb]' (or remove wandb from trainer.logger)")


def _wandb_logger(output_dir: Path, version: str) -> Any:
    """Weights & Biases: the metrics the CSV and TensorBoard loggers get, under the same names, and the resolved,
    redacted recipe as the run's config (`log_hyperparams`). Where and how is wandb's own environment
    (`WANDB_MODE=offline`, `WANDB_PROJECT`, `WANDB_ENTITY`, `WANDB_DIR`; default directory `output_dir/logs`). Its
    system metadata (which records the command line, secrets included) and console capture are off: the command
    line is not redacted there, and the log lines are in the run's own log."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ImportError(WANDB_MISSING)
    import os

    import wandb
    from lightning.pytorch.loggers import WandbLogger

    save_dir = Path(os.environ.get("WANDB_DIR") or output_dir / "logs")
    save_dir.mkdir(parents=True, exist_ok=True)  # wandb writes under it and falls back to /tmp when it is missing
    return quiet_wandb_logger(WandbLogger(
        name=f"{output_dir.name} {version}", save_dir=str(save_dir),
        project=os.environ.get("WANDB_PROJECT") or "eagle3-zoo", log_model=False,
        settings=wandb.Settings(console="off", x_disable_meta=True, save_code=False, disable_git=True)))


def _finish_wandb(failed: bool) -> None:
    """End the run's wandb run (Lightning leaves it open: a second `fit` in the same process would log into it)."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


def _tau_eval_callbacks(tau_eval: TauEvalConfig, data: DataConfig, tokenizer: Any = None) -> list[L.Callback]:
    """Measured tau during training (`eagle3_zoo.speculative.TauEvalCallback`) on MT-bench first turns, rendered
    with `data.chat_template_kwargs`; without a `tokenizer` the callback takes the run DataModule's in its `setup`."""
    cfg = tau_eval
    if not cfg.every_n_steps:
        return []
    from eagle3_zoo.speculative import TauEvalCallback, load_benchmark

    try:
        prompts = [p.turns[0] for p in load_benchmark("mtbench", limit=cfg.num_prompts).prompts]
    except FileNotFoundError as e:
        logger.warning("trainer.tau_eval is set but the MT-bench prompts are not installed (%s): tau is not "
                       "measured during training", e)
        return []
    return [TauEvalCallback(prompts, every_n_steps=cfg.every_n_steps, max_new_tokens=cfg.max_new_tokens,
                            tokenizer=tokenizer, chat_template_kwargs=data.chat_template_kwargs)]


def build_trainer(recipe: Recipe, callbacks: Sequence[L.Callback] = (), has_val: bool = True,
                  **overrides: Any) -> L.Trainer:
    """The Lightning Trainer of a recipe (strategy, precision, loggers, checkpoints, the TTT schedule of a kind that
    unrolls). `has_val=False`: no validation (`eagle3_zoo.training.build.without_validation` gives a Trainer built with
    validation the same settings)."""
    t, output_dir = recipe.trainer, Path(recipe.output_dir)
    checkpoint = LastCheckpoint(dirpath=output_dir / CHECKPOINT_DIR, every_n_train_steps=t.checkpoint_every_n_steps,
                                save_last=True, save_top_k=0, enable_version_counter=False)
    # the unrolled steps' schedule, for a kind that unrolls (its `train/ttt_steps` is logged and shown)
    schedule = [TTTScheduleCallback(recipe.ttt.steps, recipe.ttt.schedule, recipe.ttt.ramp_fraction)] if get_kind(
        recipe.drafter.kind).unrolls else []
    bar = use_bar()
    progress = ProgressLogCallback(bar=bar)
    kwargs: dict[str, Any] = dict(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
        strategy=build_strategy(t.strategy, devices=t.devices, num_nodes=t.num_nodes, accelerator=t.accelerator),
        precision=t.precision, max_steps=t.max_steps if t.max_steps is not None else -1, max_epochs=t.max_epochs,
        max_time=None if t.max_time is None else timedelta(seconds=t.max_time),
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=recipe.optim.grad_clip,
        gradient_clip_algorithm="norm", val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None if t.val_check_interval else 1, log_every_n_steps=t.log_every_n_steps,
        logger=_loggers(t, output_dir) or False, callbacks=[*schedule, checkpoint, progress, *callbacks],
        default_root_dir=output_dir, use_distributed_sampler=False,  # the batch sampler shards by rank itself
        num_sanity_val_steps=0, plugins=[AtomicCheckpointIO()],
        # a live bar on a terminal; in a log file (CI, batch jobs) the progress callback's lines say the same, and
        # say what is trained instead of the model summary table
        enable_progress_bar=bar, enable_model_summary=False,
    )
    if kwargs["enable_progress_bar"]:
        kwargs["callbacks"].append(StepProgressBar())
    if not has_val:  # no validation split (data.val_fraction = 0 and no val source)
        kwargs.update(NO_VALIDATION)
    return L.Trainer(**{**kwargs, **overrides})


class RecipeIdentityCallback(resume.RunIdentityCallback):
    """The identity of a recipe's run and what `eagle3-zoo consolidate` needs (`drafter_info`), worked out in the
    callback's `setup` from what the run's DataModule prepared (`RunDataModule`: the data, the target, the
    `DrafterStart`); a `last.ckpt` written by a run with other settings is refused there, before anything is written
    and before Lightning restores it. `target_info` and `data_summary` are the run's provenance entries.

    Args:
        identity: the recipe's identity entries (`recipe_identity_dict`); recipe_dict: the resolved recipe
            (`recipe_to_dict`).
        target, trainer: the recipe's `target` and `trainer` sections; mode: its `data.mode`.
        last: the run's `last.ckpt`; git: the code the process runs (`git_info`).
    """

    def __init__(self, identity: dict[str, Any], recipe_dict: dict[str, Any], target: TargetConfig,
                 trainer: TrainerConfig, mode: str, last: Path, git: dict[str, Any]):
        super().__init__({}, None)
        self.recipe_identity, self.recipe_dict, self.last, self.git = identity, recipe_dict, last, git
        self.target_section, self.trainer_section, self.mode = target, trainer, mode
        self.target_info: dict[str, Any] = {}
        self.data_summary: dict[str, Any] = {}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm, t, target = trainer.datamodule, self.trainer_section, self.target_section
        start, cfg = dm.drafter_start, dm.target.config
        self.target_info = {"name_or_path": target.name_or_path, "model_type": dm.adapter.model_type,
                            "dtype": target.dtype, "lora_path": target.lora_path,
                            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                            "vocab_size": cfg.vocab_size}
        self.identity = resume.run_identity(self.recipe_identity, data_fingerprint=dm.data.fingerprint,
                                            d2t=start.d2t, target=self.target_info,
                                            world_size=world_size(t.devices, t.num_nodes, t.accelerator))
        if self.last.exists():
            resume.check_resume(self.last, self.identity)
            logger.info("resuming from %s (same run settings)", self.last)
        self.data_summary = {**dm.data.summary(), "draft_vocab_coverage": draft_vocab_coverage(dm.data.counts,
                                                                                               start.t2d),
                             "mode": self.mode, "features": dm.features}
        drafter = drafter_summary(start.config, start.num_parameters())
        self.info = drafter_info(start.config, start.fc_input_scale, self.recipe_dict, build_provenance(
            recipe_dict=self.recipe_dict, target=self.target_info, data=self.data_summary, drafter=drafter,
            training={"strategy": t.strategy, "precision": t.precision}, git=self.git))


class RunLoggers(L.Callback):
    """The run's loggers (`trainer.logger`), given to the Trainer in the callback's `setup`, after the run identity:
    a run refused by its data stage, its target or its resume check writes nothing. The resolved recipe is the
    loggers' hyperparameters (hparams.yaml, TensorBoard): `recipe_dict` (`recipe_to_dict`), with the recipe's
    `trainer` section and `output_dir`."""

    def __init__(self, trainer: TrainerConfig, output_dir: Path, recipe_dict: dict[str, Any]):
        self.trainer_section, self.output_dir, self.recipe_dict = trainer, output_dir, recipe_dict

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        trainer.loggers = _loggers(self.trainer_section, self.output_dir)
        for lg in trainer.loggers:
            lg.log_hyperparams(self.recipe_dict)


def fit(recipe: Recipe, source: str = "recipe") -> Path:
    """Train a drafter as `recipe` says; resumes from `output_dir/checkpoints/last.ckpt` when it exists.

    The run holds `output_dir` for its whole lifetime (`eagle3_zoo.training.rundir.lock`): a second run on it refuses at
    once, naming this one.

    Args:
        recipe: a loaded `eagle3_zoo.recipe.sections.Recipe`.
        source: where the recipe came from (used in error messages).

    Returns:
        The canonical drafter folder `output_dir/drafter`.

    Raises:
        RunDirectoryInUseError: another run holds `output_dir`.
    """
    from eagle3_zoo.training.rundir.lock import hold_run_directory

    with hold_run_directory(recipe.output_dir):  # leftovers of killed runs are removed once it is held
        return _fit(recipe, source)


def _fit(recipe: Recipe, source: str) -> Path:
    require_accelerator(recipe.trainer, source)
    start = time.time()
    git = git_info()  # the code this process runs: commits made while it trains must not be credited to it
    output_dir = Path(recipe.output_dir)
    last = output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT
    recover_replaced_directory(last)  # a sharded checkpoint whose replacement was cut short
    if last.exists():  # a corrupt or foreign checkpoint fails here, before the target and the data are loaded
        resume.read_checkpoint_identity(last)
        if last.is_dir():  # DCP unpickles .metadata with the plain unpickler when it loads: check it safely first
            from eagle3_zoo.training.rundir.checkpoint_io import read_sharded_metadata

            resume.refuse_unreadable(last, read_sharded_metadata)
    t, plan, recipe_dict = recipe.trainer, run_plan(recipe), recipe_to_dict(recipe)
    record = TrainingRecordCallback(start, static={"strategy": t.strategy, "precision": t.precision})
    identity = RecipeIdentityCallback(recipe_identity_dict(recipe), recipe_dict, recipe.target, t, recipe.data.mode,
                                      last, git)
    tau = _tau_eval_callbacks(t.tau_eval, recipe.data)  # the tokenizer: the DataModule's, in the callback's setup
    engine = [EngineFeedCallback()] if plan.streams else []  # hidden states streamed from the engine
    interrupt = InterruptWatch()  # Ctrl-C: exit 130 naming the checkpoint kept, not Lightning's sys.exit(1)
    # the loggers are given in RunLoggers' setup, after the identity's: a refused run writes nothing
    loggers = RunLoggers(t, output_dir, recipe_dict)
    trainer = build_trainer(recipe, [identity, loggers, record, *engine, *tau, interrupt], logger=False)
    module, datamodule = RecipeModule(recipe, plan), run_datamodule(recipe, plan, source)
    record.hardware, record.static["world_size"] = _hardware(trainer), trainer.world_size
    failed = True
    try:
        with interrupt.reported(trainer, last, t.checkpoint_every_n_steps):
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if last.exists() else None)
        failed = False
    except EngineFeedError as e:  # one error that says what the run keeps
        raise EngineFeedError(f"{e}; {engine[0].kept}" if engine and engine[0].kept else str(e)) from None
    finally:
        if datamodule.feed is not None:
            datamodule.feed.close()  # servers launched for the run stop, whatever happened
        if "wandb" in t.logger:
            _finish_wandb(failed)
    target_info, data_summary = identity.target_info, identity.data_summary
    trained = full_drafter(module)  # collective under FSDP: every rank takes part, rank 0 gets the weights
    bad = [] if trained is None else [k for k, v in trained.state_dict().items()
                                      if v.is_floating_point() and not all_finite(v)]
    if trainer.strategy.broadcast(bool(bad)):
        raise NonFiniteError(f"the trained drafter has non-finite weights ({', '.join(bad[:4]) or 'see rank 0'}); "
                             "nothing written")
    out = output_dir / DRAFTER_DIR
    if trainer.is_global_zero:
        # the whole run's record (all starts of fit); a rerun that trained nothing keeps it as it was
        training = record.final if record.final is not None else record.record(trainer)
        provenance = build_provenance(recipe_dict=recipe_dict, target=target_info, data=data_summary,
                                      training=training, git=git, drafter=drafter_summary(
                                          trained.config, sum(p.numel() for p in trained.parameters())))
        write_drafter_folder(trained, out, recipe, provenance, kind=module.kind)
        logger.info("drafter written to %s (step %d, %.0f s)", out, trainer.global_step, time.time() - start)
    trainer.strategy.barrier("drafter-written")
    return out


def _hardware(trainer: L.Trainer) -> str:
    """"2 x NVIDIA H100 80GB HBM3" or "Intel(R) Xeon(R) Processor, 2 cores, 2 threads" (for provenance/cards)."""
    from eagle3_zoo.util.provenance import machine_info

    root = trainer.strategy.root_device
    info = machine_info(root)
    if "gpu" in info:
        return f"{trainer.world_size} x {info['gpu']}"
    return f"{info['processor']}, {info['cpu_count']} cores, {info['torch_threads']} threads"


def fit_main(recipe_path: str | Path, overrides: Sequence[str] = ()) -> Path:
    """Load a recipe with dotlist overrides and `fit` it; returns the drafter folder."""
    from eagle3_zoo.recipe.sections import load_recipe

    return fit(load_recipe(recipe_path, list(overrides)), source=str(recipe_path))
