"""Recipe -> the two Lightning objects of a training run, which build the run in Lightning's own hooks.

`fit` hands `trainer.fit` a `RunDataModule` and a `RecipeModule`. Lightning starts the run's processes, then calls,
on every rank: the DataModule's `setup` (the data stage: seed, load the target, prepare the data, (offline) extract
features, the draft vocabulary: a `DrafterStart`), the callbacks' `setup` (`eagle3_zoo.training.fit`: run identity
and resume check, provenance, loggers; the tau callback's tokenizer), the module's `setup` (the drafter, built from
the `DrafterStart` and the target the DataModule loaded), its `configure_model` (FSDP shards there), and then
restores a checkpoint. `build_run` runs the same two steps outside a Trainer (benchmarks, tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from eagle3_zoo.data.datamodule import FeatureDataModule
from eagle3_zoo.data.engine.stream import StreamingDataModule
from eagle3_zoo.drafters import DrafterKind, TargetLayers, get_kind
from eagle3_zoo.modeling import build_draft_vocab
from eagle3_zoo.recipe.decisions import drafter_config, run_plan
from eagle3_zoo.targets.loading import aux_layer_ids_for, load_recipe_target
from eagle3_zoo.training.module import DrafterModule, with_host_counts

if TYPE_CHECKING:
    from eagle3_zoo.recipe.decisions import RunPlan
    from eagle3_zoo.recipe.sections import DrafterConfig, Recipe

logger = logging.getLogger(__name__)


@dataclass
class DrafterStart:
    """What a run's drafter is built from, known once the data stage ran: its kind (`eagle3_zoo.drafters`), a fresh
    drafter's config, its draft vocabulary (from the data's token counts) and the target's head and final norm it
    starts from (`init_head`), or the `drafter.init_from` drafter, loaded and checked against the target; and the fc
    preconditioning scale (`optim.precondition_fc`). The run identity and provenance read it before the drafter
    exists."""

    kind: DrafterKind
    config: Any  # an instance of the kind's `config_class`
    d2t: torch.Tensor
    t2d: torch.Tensor
    target_head: tuple[torch.Tensor, torch.Tensor | None] | None = None
    target_layers: TargetLayers | None = None  # the kind's `starts_from_target_layers` only
    fc_input_scale: torch.Tensor | None = None
    init: Any = None  # the `drafter.init_from` drafter (a drafter of the kind)

    def build(self) -> Any:
        """The drafter (fresh: its random initialisation draws from the global generator, seeded by the caller)."""
        if self.init is not None:
            drafter = self.init
        else:
            extra = {} if self.target_layers is None else {"target_layers": self.target_layers}
            drafter = self.kind.build(self.config, d2t=self.d2t, t2d=self.t2d, target_head=self.target_head,
                                      **extra)
        if self.fc_input_scale is not None:
            drafter.set_fc_input_scale(self.fc_input_scale)
        return drafter

    def num_parameters(self) -> int:
        """The built drafter's parameter count (a fresh one is counted on the meta device: nothing allocated)."""
        if self.init is not None:
            return sum(p.numel() for p in self.init.parameters())
        return self.kind.num_parameters(self.config)


def drafter_start(drafter: DrafterConfig, target_name: str, precision: str, target_config: Any, counts: torch.Tensor,
                  aux_layer_ids: tuple[int, ...], target_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                  target_layers: TargetLayers | None = None) -> DrafterStart:
    """A fresh drafter sized like the target (recipe overrides applied) with the draft vocab from `counts`, or the
    `drafter.init_from` drafter, checked against the target. `drafter`: the recipe's `drafter` section; `target_name`
    and `precision`: its `target.name_or_path` and `trainer.precision` (`drafter_config`).

    `target_head` = the target's (lm_head weight, final norm weight): with `drafter.init_head = "target"` a fresh
    drafter's lm_head and norm start from them (the kind's `build`). `target_layers` = the target's decoder layers
    and final norm: a fresh drafter of a kind whose `starts_from_target_layers` says so for the recipe's `drafter`
    section starts its layers from them.

    Raises:
        ValueError: an `init_from` drafter that does not fit the target (vocab, hidden size, aux layers).
    """
    kind = get_kind(drafter.kind)
    if drafter.init_from:
        init = _load_init(drafter.init_from, target_config, aux_layer_ids, drafter, kind)
        d2t, t2d = kind.draft_vocab(init)
        return DrafterStart(kind, init.config, d2t, t2d, init=init, fc_input_scale=kind.fc_input_scale(init))
    config = drafter_config(drafter, target_name, precision, target_config, aux_layer_ids)
    d2t, t2d = build_draft_vocab(counts, config.draft_vocab_size)
    if drafter.init_head == "target" and target_head is None:
        raise ValueError("drafter.init_head = 'target' needs the target's lm_head (and final norm) weights")
    from_layers = kind.starts_from_target_layers(drafter)
    if from_layers and target_layers is None:
        raise ValueError(f"drafter.kind = {kind.name!r} starts its layers from the target's: it needs the target's "
                         "decoder layers")
    return DrafterStart(kind, config, d2t.to(torch.int64), t2d.to(torch.bool),
                        target_head=target_head if drafter.init_head == "target" else None,
                        target_layers=target_layers if from_layers else None)


def _load_init(path: str, target_config: Any, aux_layer_ids: tuple[int, ...], wanted: DrafterConfig | None = None,
               kind: DrafterKind | None = None) -> Any:
    """The `drafter.init_from` drafter (any layout of its kind), checked: of the run's `kind` (None: any), fitting the
    target (`DrafterKind.target_mismatches`) and the run (`DrafterKind.init_mismatches`: the features it reads and
    the recipe settings of `wanted`, the recipe's `drafter` section, that its forward pass fixes).

    Raises:
        ValueError: a drafter of another kind, or one that does not fit (every problem named at once).
    """
    from eagle3_zoo.drafters import kind_of
    from eagle3_zoo.hub.download import load_any_drafter

    drafter = load_any_drafter(path)
    owner = kind_of(drafter)
    if kind is not None and owner is not kind:
        raise ValueError(f"drafter.init_from = {path!r} is a {type(drafter).__name__} (drafter kind {owner.name!r}), "
                         f"not a drafter of drafter.kind = {kind.name!r}; start from a {kind.name} drafter or set "
                         f"drafter.kind = {owner.name}")
    drafter = drafter.float()  # trained in fp32 master weights; saved back in its config dtype
    cfg = drafter.config
    problems = owner.target_mismatches(drafter, target_config) + owner.init_mismatches(drafter, wanted, aux_layer_ids)
    if problems:
        raise ValueError(f"drafter.init_from = {path!r} does not fit the target: " + "; ".join(problems))
    logger.info("initialised the drafter from %s (its draft vocabulary of %d tokens is kept)", path,
                cfg.draft_vocab_size)
    return drafter


@dataclass
class TrainingRun:
    """A run built outside a Trainer (`build_run`): its two Lightning objects and what the data stage loaded."""

    recipe: Recipe
    target: Any
    tokenizer: Any
    adapter: Any
    data: Any  # eagle3_zoo.data.prepare.PreparedData
    module: Any  # RecipeModule
    datamodule: Any  # RunDataModule
    features: dict[str, Any] = field(default_factory=dict)  # offline: store directory, bytes per token, dtype


NO_VALIDATION = {"limit_val_batches": 0, "val_check_interval": None, "check_val_every_n_epoch": 1}


def without_validation(trainer: L.Trainer) -> None:
    """Give a Trainer the validation settings of `build_trainer(has_val=False)` (what Lightning makes of
    `NO_VALIDATION`): `fit` builds its Trainer before the data stage shows whether there is a validation split, and
    `RunDataModule.setup` calls this, before the fit loop reads them. No validation runs, and `last.ckpt` is saved
    at the end of every epoch as well."""
    trainer.limit_val_batches, trainer.val_check_interval, trainer.check_val_every_n_epoch = 0, 1.0, 1


class RunDataModule(FeatureDataModule):
    """A recipe's data, prepared in Lightning's `setup` hook: `fit` hands this to `trainer.fit`, which starts the
    run's processes and its process group (Lightning's own launcher, or the processes torchrun or SLURM started) and
    then calls `setup` on every rank. There, before anything is placed on a device, this rank's target device is made
    current (`use_device`: else every rank's data stage, regeneration included, would allocate on GPU 0), the data
    stage's process group is created (`eagle3_zoo.data.ranks`), and `prepare_run` runs the data stage. Lightning
    calls it before the callbacks' and the module's `setup`, which read what it holds: `target`, `tokenizer`,
    `adapter`, `data`, `aux_layer_ids`, `features`, `drafter_start`. `run_datamodule` picks the class.

    Args:
        recipe: a loaded `Recipe` (its data stage, the regeneration and the engine deployment read it).
        plan: the recipe's `RunPlan` (`run_plan(recipe)`: what of the target this rank loads, whether it streams).
        source: where the recipe came from (error messages).
    """

    feed: Any = None  # the engine feed of a run that streams hidden states (`StreamingRunDataModule`)

    def __init__(self, recipe: Recipe, plan: RunPlan, source: str = "recipe"):
        super().__init__(None, None, batch_size=recipe.trainer.batch_size, seed=recipe.data.seed,
                         num_workers=recipe.data.num_workers)
        self.recipe, self.source, self.plan = recipe, source, plan
        self.target: Any = None
        self.tokenizer: Any = None
        self.adapter: Any = None
        self.data: Any = None  # eagle3_zoo.data.prepare.PreparedData
        self.aux_layer_ids: tuple[int, ...] = ()
        self.features: dict[str, Any] = {}  # offline: store directory, bytes per token, dtype
        self.drafter_start: DrafterStart | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.drafter_start is None:
            from eagle3_zoo.data.ranks import start_coordination
            from eagle3_zoo.targets.loading import target_device, use_device

            device = use_device(target_device(self.recipe.trainer, self.trainer.local_rank))
            start_coordination()  # at the same point on every rank, before the data stage needs it
            self.prepare_run(device)
            if not self.data.val:  # no validation split (data.val_fraction = 0 and no val source)
                without_validation(self.trainer)
        super().setup(stage)

    def prepare_run(self, device: Any = None) -> None:
        """Seed, load the target, prepare the data, (offline) extract features, and find what the drafter starts
        from (`DrafterStart`).

        The target is loaded on `device` (default `target_device(recipe.trainer)`: this rank's GPU, else the CPU) and
        does all its work there. Offline without tau eval (and without in-process regeneration or a LoRA) only its
        embedding, final norm and lm_head are read (`load_recipe_target(heads_only=True)`); the feature job loads the
        whole target only if features are missing. Under torch.distributed the data stage is split across the ranks
        that share the cache (`eagle3_zoo.data.ranks`), and every rank waits for all of them before returning (no
        rank starts training collectives while another still prepares data).
        """
        from eagle3_zoo.data.prepare import prepare_data
        from eagle3_zoo.data.ranks import data_barrier

        recipe, plan = self.recipe, self.plan  # what of the target this rank loads: what `eagle3-zoo plan` prints
        L.seed_everything(recipe.trainer.seed, workers=True, verbose=False)
        if plan.target_load == "whole" and plan.strategy == "fsdp":
            logger.info("every rank loads the whole target: %s", plan.target_load_reason)
        target, tokenizer, adapter = load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, self.source,
                                                        device=device, heads_only=plan.target_load == "heads only",
                                                        skeleton=plan.target_load == "fsdp shard")
        self.target, self.tokenizer, self.adapter = target, tokenizer, adapter
        data = self.data = prepare_data(recipe, tokenizer, adapter, target=target,
                                        target_id=recipe.target.name_or_path, vocab_size=target.config.vocab_size)
        aux_ids = self.aux_layer_ids = aux_layer_ids_for(recipe.drafter, recipe.target.name_or_path, target, adapter)
        norm = adapter.final_norm(target)
        layers = TargetLayers(tuple(dict(layer.named_parameters()) for layer in adapter.decoder_layers(target)),
                              getattr(norm, "weight", None))  # references: a kind that starts from them copies
        start = drafter_start(recipe.drafter, recipe.target.name_or_path, recipe.trainer.precision, target.config,
                              data.counts, aux_ids,
                              target_head=(adapter.lm_head(target).weight, getattr(norm, "weight", None)),
                              target_layers=layers)
        self.pad_id = tokenizer.pad_token_id or 0
        if plan.streams:  # hidden states streamed from the engine (online, or hybrid's first pass)
            from eagle3_zoo.data.engine.stream import streamed_datasets

            if self.num_workers:  # the stream's futures and threads live in this process
                logger.info("data.num_workers = %d ignored: states streamed from the engine are fetched ahead by "
                            "threads of the training process", self.num_workers)
                self.num_workers = 0
            train_set, val_set, self.feed, self.features = streamed_datasets(recipe, data, target, adapter, aux_ids)
            self.use_datasets(train_set, val_set)
        else:
            train_set, val_set, self.features = _datasets(recipe, data, target, tokenizer, adapter, aux_ids)
            self.use_datasets(train_set, val_set, pack_length=recipe.data.max_length if recipe.data.packing else None)
        if recipe.optim.precondition_fc and not recipe.drafter.init_from:
            if self.feed is not None:
                self.feed.start()  # the statistics read the first samples' states now, before training
            start.fc_input_scale = fc_input_scale(train_set, target, adapter, aux_ids)
        self.drafter_start = start
        data_barrier()

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return with_host_counts(batch)  # counts taken on the host, so no step reads them back from the device


class StreamingRunDataModule(RunDataModule, StreamingDataModule):
    """`RunDataModule` of a run whose hidden states are streamed from the engine: the loaders and the feed's start and
    stop are `StreamingDataModule`'s."""


def run_datamodule(recipe: Recipe, plan: RunPlan, source: str = "recipe") -> RunDataModule:
    """The DataModule of a recipe's run (`StreamingRunDataModule` when its run plan, `plan`, streams hidden
    states)."""
    return (StreamingRunDataModule if plan.streams else RunDataModule)(recipe, plan, source)


class RecipeModule(DrafterModule):
    """The `DrafterModule` of a recipe's run (a drafter of the recipe's `drafter.kind`): its settings from the recipe,
    its drafter built in Lightning's `setup` hook from what the run's DataModule prepared (`RunDataModule`: the
    `DrafterStart` and the target), after the global generator is seeded again (the initialisation does not depend on
    the data stage's randomness). Lightning calls `setup` before `configure_model` (where FSDP shards the drafter) and
    before it restores a checkpoint. The drafter is built in `setup`, not in `configure_model`: Lightning runs that one
    inside the strategy's tensor init context (the root device, the precision's dtype), which would change where a fresh
    drafter's random initialisation is drawn; it is drawn on the host in fp32, as `build_run` draws it. `plan`: the
    recipe's `RunPlan`; of the `trainer` section the module keeps the seed and `activation_checkpointing`, which
    `build_drafter` reads."""

    def __init__(self, recipe: Recipe, plan: RunPlan):
        t, o = recipe.ttt, recipe.optim
        super().__init__(
            None, kind=recipe.drafter.kind, mode="online" if plan.target_in_step else "offline", ttt_steps=t.steps,
            step_weights=t.step_weights or [t.step_weight_decay**k for k in range(t.steps)], lr=o.lr,
            betas=tuple(o.betas), weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, decay=o.decay,
            min_lr_ratio=o.min_lr_ratio, loss=recipe.loss.build(),
            shard_target=plan.target_sharded, drafter_section=recipe.drafter)
        self.seed, self.activation_checkpointing = recipe.trainer.seed, recipe.trainer.activation_checkpointing
        self.plan = plan

    @override
    def setup(self, stage: str) -> None:
        if not self.has_parts:
            self.build_drafter(self.trainer.datamodule)

    def build_drafter(self, datamodule: RunDataModule) -> None:
        """Seed, build the drafter from `datamodule.drafter_start`, and take it with the target `datamodule` loaded
        (kept whole when the step runs it or tau is measured, else only its embedding and lm_head)."""
        from eagle3_zoo.training.strategies import enable_activation_checkpointing

        if datamodule.drafter_start is None:
            raise RuntimeError("RecipeModule: the DataModule has not prepared the run (its setup did not run)")
        L.seed_everything(self.seed, workers=True, verbose=False)
        drafter = datamodule.drafter_start.build()
        if self.activation_checkpointing:
            enable_activation_checkpointing(drafter)
        target, adapter = datamodule.target, datamodule.adapter
        self.set_parts(drafter, adapter, target if self.plan.target_kept else None,
                       embed_tokens=adapter.embed_tokens(target), lm_head=adapter.lm_head(target))


def build_run(recipe: Recipe, source: str = "recipe", device: Any = None) -> TrainingRun:
    """The run `fit` trains, built outside a Trainer: the DataModule's data stage (`RunDataModule.prepare_run`,
    the target loaded on `device`), then the module's drafter (`RecipeModule.build_drafter`), as Lightning's hooks
    build them in `fit`."""
    plan = run_plan(recipe)
    datamodule = run_datamodule(recipe, plan, source)
    datamodule.prepare_run(device)
    module = RecipeModule(recipe, plan)
    module.build_drafter(datamodule)
    return TrainingRun(recipe, datamodule.target, datamodule.tokenizer, datamodule.adapter, datamodule.data, module,
                       datamodule, datamodule.features)


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


def _datasets(recipe: Recipe, data: Any, target: Any, tokenizer: Any, adapter: Any,
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
