"""Recipe -> the pieces of a training run: target, aux layers, drafter (fresh or `drafter.init_from`), data,
LightningModule and DataModule (`build_run`), built by `fit` in Lightning's `setup` hook once the run's processes
run (`RecipeDataModule`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from eagle3_zoo.modeling import Eagle3Drafter, build_draft_vocab
from eagle3_zoo.targets.loading import aux_layer_ids_for, load_recipe_target
from eagle3_zoo.training.run_plan import drafter_config

logger = logging.getLogger(__name__)

def build_drafter(recipe: Any, target_config: Any, counts: torch.Tensor, aux_layer_ids: tuple[int, ...],
                  target_head: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> Eagle3Drafter:
    """A fresh drafter sized like the target (recipe overrides applied) with the draft vocab from `counts`,
    or the `drafter.init_from` drafter, checked against the target.

    `target_head` = the target's (lm_head weight, final norm weight): with `drafter.init_head = "target"` a fresh
    drafter's lm_head and norm start from them (`Eagle3Drafter.init_head_from_target`).

    Raises:
        ValueError: an `init_from` drafter that does not fit the target (vocab, hidden size, aux layers).
    """
    if recipe.drafter.init_from:
        return _load_init(recipe.drafter.init_from, target_config, aux_layer_ids, recipe.drafter)
    config = drafter_config(recipe, target_config, aux_layer_ids)
    drafter = Eagle3Drafter(config)
    drafter.set_vocab(*build_draft_vocab(counts, config.draft_vocab_size))
    if recipe.drafter.init_head == "target":
        if target_head is None:
            raise ValueError("drafter.init_head = 'target' needs the target's lm_head (and final norm) weights")
        drafter.init_head_from_target(*target_head)
    return drafter


def _load_init(path: str, target_config: Any, aux_layer_ids: tuple[int, ...], wanted: Any = None) -> Eagle3Drafter:
    from eagle3_zoo.hub.download import load_any_drafter

    drafter = load_any_drafter(path)
    drafter = drafter.float()  # trained in fp32 master weights; saved back in its config dtype
    cfg = drafter.config
    problems = cfg.target_mismatches(target_config)
    if cfg.aux_layer_ids is not None and tuple(cfg.aux_layer_ids) != tuple(aux_layer_ids):
        problems.append(f"aux_layer_ids {list(cfg.aux_layer_ids)} != the run's {list(aux_layer_ids)} (set "
                        "drafter.aux_layer_ids to the drafter's)")
    for flag in ("fc_norm", "norm_output"):  # the forward pass is the drafter's: a recipe cannot switch it silently
        if wanted is not None and bool(getattr(wanted, flag)) != getattr(cfg, flag):
            problems.append(f"{flag} is {getattr(cfg, flag)} in the drafter but drafter.{flag} = "
                            f"{getattr(wanted, flag)} in the recipe (set it to the drafter's)")
    if problems:
        raise ValueError(f"drafter.init_from = {path!r} does not fit the target: " + "; ".join(problems))
    logger.info("initialised the drafter from %s (its draft vocabulary of %d tokens is kept)", path,
                cfg.draft_vocab_size)
    return drafter


@dataclass
class TrainingRun:
    """Everything `fit` hands to the Trainer, built from a recipe."""

    recipe: Any
    target: Any
    tokenizer: Any
    adapter: Any
    data: Any  # eagle3_zoo.data.prepare.PreparedData
    module: Any  # Eagle3Module
    datamodule: Any  # Eagle3DataModule
    features: dict[str, Any] = field(default_factory=dict)  # offline: store directory, bytes per token, dtype


def build_run(recipe: Any, source: str = "recipe", device: Any = None, module: Any = None) -> TrainingRun:
    """Seed, load the target, prepare the data, build the drafter, (offline) extract features, build the module and
    the DataModule. `module`: an `Eagle3Module.deferred()` to assemble (`fit`'s, handed to the Trainer before any of
    this ran), else a new one.

    The target is loaded on `device` (default `target_device(recipe)`: this rank's GPU, else the CPU) and does all
    its work there. Offline without tau eval (and without in-process regeneration or a LoRA) only its embedding,
    final norm and lm_head are read (`load_recipe_target(heads_only=True)`); the feature job loads the whole target
    only if features are missing. Under torch.distributed the data stage is split across the ranks that share the
    cache (`eagle3_zoo.data.ranks`), and every rank waits for all of them before returning (no rank starts training
    collectives while another still prepares data).
    """
    from eagle3_zoo.data.datamodule import Eagle3DataModule
    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.data.ranks import data_barrier
    from eagle3_zoo.training.module import Eagle3Module
    from eagle3_zoo.training.run_plan import run_plan
    from eagle3_zoo.training.strategies import enable_activation_checkpointing

    L.seed_everything(recipe.trainer.seed, workers=True, verbose=False)
    plan = run_plan(recipe)  # what of the target this rank loads: the decision `eagle3-zoo plan` prints
    in_step, keep_target = plan.target_in_step, plan.target_kept
    if plan.target_load == "whole" and plan.strategy == "fsdp":
        logger.info("every rank loads the whole target: %s", plan.target_load_reason)
    target, tokenizer, adapter = load_recipe_target(recipe, source, device=device,
                                                    heads_only=plan.target_load == "heads only",
                                                    skeleton=plan.target_load == "fsdp shard")
    data = prepare_data(recipe, tokenizer, adapter, target=target, target_id=recipe.target.name_or_path,
                        vocab_size=target.config.vocab_size)
    aux_ids = aux_layer_ids_for(recipe, target, adapter)
    L.seed_everything(recipe.trainer.seed, workers=True, verbose=False)  # init independent of data-stage randomness
    norm = adapter.final_norm(target)
    drafter = build_drafter(recipe, target.config, data.counts, aux_ids,
                            target_head=(adapter.lm_head(target).weight, getattr(norm, "weight", None)))
    if recipe.trainer.activation_checkpointing:
        enable_activation_checkpointing(drafter)
    loader_kw = dict(batch_size=recipe.trainer.batch_size, seed=recipe.data.seed, num_workers=recipe.data.num_workers,
                     pad_id=tokenizer.pad_token_id or 0)
    if plan.streams:  # hidden states streamed from the engine (online, or hybrid's first pass)
        from eagle3_zoo.data.engine_stream import streaming_datamodule

        datamodule, features = streaming_datamodule(recipe, data, target, adapter, aux_ids, **loader_kw)
        train_set = datamodule.train_set
    else:
        train_set, val_set, features = _datasets(recipe, data, target, tokenizer, adapter, aux_ids)
        datamodule = Eagle3DataModule(train_set, val_set, **loader_kw,
                                      pack_length=recipe.data.max_length if recipe.data.packing else None)
    if recipe.optim.precondition_fc and not recipe.drafter.init_from:
        if plan.streams:
            datamodule.feed.start()  # the statistics read the first samples' states now, before training
        drafter.set_fc_input_scale(fc_input_scale(train_set, target, adapter, aux_ids))
    t, o = recipe.ttt, recipe.optim
    module = (Eagle3Module.deferred() if module is None else module).assemble(
        drafter, adapter, target if keep_target else None, embed_tokens=adapter.embed_tokens(target),
        lm_head=adapter.lm_head(target), mode="online" if in_step else "offline", ttt_steps=t.steps,
        step_weights=t.step_weights or [t.step_weight_decay**k for k in range(t.steps)], lr=o.lr,
        betas=tuple(o.betas), weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, decay=o.decay,
        min_lr_ratio=o.min_lr_ratio, loss=recipe.loss.build(),
        shard_target=plan.target_sharded)
    data_barrier()
    return TrainingRun(recipe, target, tokenizer, adapter, data, module, datamodule, features)


@torch.no_grad()
def fc_input_scale(train_set: Any, target: Any, adapter: Any, aux_ids: tuple[int, ...],
                   num_samples: int = 64) -> torch.Tensor:
    """1 / per-dimension RMS of the target features over the first `num_samples` training samples (stored features
    offline, a target forward online), position 0 excluded: the first token is the target's attention sink, with
    activations hundreds of times larger than any other position's."""
    sums, rows = None, 0
    for i in range(min(num_samples, len(train_set))):
        sample = train_set[i]
        if "aux_hidden" in sample:
            aux = sample["aux_hidden"].float()
        else:
            ids = sample["input_ids"].unsqueeze(0).to(adapter.embed_tokens(target).weight.device)
            aux = adapter.forward_features(target, ids, layer_ids=aux_ids)[0][0].float().cpu()
        aux = aux[1:]
        sq = aux.pow(2).sum(0)
        sums = sq if sums is None else sums + sq
        rows += aux.shape[0]
    if not rows:
        raise ValueError("optim.precondition_fc: the first training samples hold no position after the first token")
    return (sums / rows).sqrt().clamp_min(1e-6).reciprocal()


def _datasets(recipe: Any, data: Any, target: Any, tokenizer: Any, adapter: Any,
              aux_ids: tuple[int, ...]) -> tuple[Any, Any, dict[str, Any]]:
    from eagle3_zoo.data.datamodule import ExampleDataset, FeatureDataset

    if recipe.data.mode == "online":
        return ExampleDataset(data.train), ExampleDataset(data.val), {}
    from eagle3_zoo.data.feature_job import extract_features
    from eagle3_zoo.data.features import FeatureReader

    store = extract_features(recipe, target=target, tokenizer=tokenizer, adapter=adapter, data=data)
    reader = FeatureReader(store)
    verify_feature_hashes(reader, store)
    if tuple(reader.aux_layer_ids or ()) != tuple(aux_ids):
        raise ValueError(f"feature store {store} holds aux layers {reader.aux_layer_ids}, the drafter needs "
                         f"{list(aux_ids)}: point data.features_dir elsewhere or match drafter.aux_layer_ids")
    info = {"features_dir": str(store), "bytes_per_token": reader.bytes_per_token, "dtype": reader.dtype}
    return (FeatureDataset(reader, [e["id"] for e in data.train]), FeatureDataset(reader, [e["id"] for e in data.val]),
            info)


def verify_feature_hashes(reader: Any, store: Any) -> None:
    """Check every shard of the store against the sha256 its manifest records, once per run, before training reads
    any (each rank hashes its share of the ranks that see the store; all of them learn of a corrupt shard), and log
    what it cost.

    Raises:
        FeatureStoreError: corrupt shards (named), to be extracted again by `eagle3-zoo prepare`.
    """
    import time

    from eagle3_zoo.data.features import REDO_HINT, FeatureStoreError
    from eagle3_zoo.data.ranks import gather_lists, split_for

    split = split_for(store)
    start = time.perf_counter()
    problems, shards, size = reader.hash_problems(split.rank, split.world_size)
    seconds = time.perf_counter() - start
    problems = gather_lists(problems)
    if problems:
        raise FeatureStoreError(f"{len(problems)} feature shard(s) do not match their recorded sha256: "
                                f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}; {REDO_HINT}")
    logger.info("%s: verified the sha256 of %d feature shard(s) (%.1f MB) against the manifest in %.2f s "
                "(%.0f MB/s%s) before training", store, shards, size / 1e6, seconds,
                size / 1e6 / max(seconds, 1e-9), f", this rank's share of {split.world_size}"
                if split.world_size > 1 else "")


class RecipeDataModule(L.LightningDataModule):
    """A recipe's training run built in Lightning's `setup` hook: `fit` hands this and an `Eagle3Module.deferred()`
    to `trainer.fit`, which starts the run's processes and its process group (Lightning's own launcher, or the
    processes torchrun or SLURM started) and then calls `setup` on every rank. There, before anything is placed on a
    device, this rank's target device is made current (`use_device`: else every rank's data stage, regeneration
    included, would allocate on GPU 0), the data stage's process group is created (`eagle3_zoo.data.ranks`), and
    `build_run` loads the target, runs the data stage split across the ranks (regeneration, feature job), builds the
    drafter and assembles the module; then `on_built(run)` (what `fit` derives from the run: identity, resume check,
    provenance). Lightning calls this before the module's `setup` and `configure_model` (FSDP shards there) and
    before it restores a checkpoint.

    The loaders and the hooks (`setup`, `teardown`, `on_exception`, `state_dict`) are the built run's DataModule's
    (`Eagle3DataModule`, or the engine's `StreamingDataModule`), as are `train_set`, `val_set` and `feed`.

    Args:
        recipe: a loaded `Recipe`.
        source: where the recipe came from (error messages).
        module: the `Eagle3Module` to assemble (`Eagle3Module.deferred()`).
        on_built: called with the `TrainingRun` once it is built, on every rank.
    """

    def __init__(self, recipe: Any, source: str, module: Any, on_built: Any = None):
        super().__init__()
        self.recipe, self.source, self.module, self.on_built = recipe, source, module, on_built
        self.run: TrainingRun | None = None

    @property
    def built(self) -> Any:
        """The built run's DataModule."""
        if self.run is None:
            raise RuntimeError("RecipeDataModule: the run is built in setup(), which Lightning has not called yet")
        return self.run.datamodule

    @property
    def train_set(self) -> Any:
        return self.built.train_set

    @property
    def val_set(self) -> Any:
        return self.built.val_set

    @property
    def feed(self) -> Any:
        """The engine feed of a run that streams hidden states (None otherwise, or before `setup`)."""
        return getattr(self.run.datamodule, "feed", None) if self.run is not None else None

    @override
    def setup(self, stage: str) -> None:
        if self.run is None:
            from eagle3_zoo.data.ranks import start_coordination
            from eagle3_zoo.targets.loading import target_device, use_device

            device = use_device(target_device(self.recipe, self.trainer.local_rank))
            start_coordination()  # at the same point on every rank, before the data stage needs it
            self.run = build_run(self.recipe, self.source, device=device, module=self.module)
            self.run.datamodule.trainer = self.trainer
            if self.on_built is not None:
                self.on_built(self.run)
        self.built.setup(stage)

    @override
    def teardown(self, stage: str) -> None:
        if self.run is not None:
            self.built.teardown(stage)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.run is not None:
            self.built.on_exception(exception)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        from eagle3_zoo.training.module import with_host_counts

        return with_host_counts(batch)  # counts taken on the host, so no step reads them back from the device

    @override
    def train_dataloader(self) -> Any:
        return self.built.train_dataloader()

    @override
    def val_dataloader(self) -> Any:
        return self.built.val_dataloader()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.built.state_dict() if self.run is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.built.load_state_dict(state_dict)
