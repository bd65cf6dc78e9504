"""DFlash as a drafter kind (`drafter.kind: dflash`): a block drafter that drafts B-1 tokens in one forward pass.

Its model and config are `model.DFlashDrafter` and `config.DFlashConfig` (sized like the target; the recipe's
`drafter.dflash` section sets the draft layers, the block size and the feature layers). It reads the outputs of the
target decoder layers `target_layer_ids` (the data stage's `aux_layer_ids` = those ids + 1); training with hard
labels (`drafter.dflash.labels: hard`, the default: the next tokens themselves) reads nothing else, training with
soft labels (`soft`: the target's distribution) also reads the target's last hidden state (`training_features`), from
which the target's lm_head forms its logits. It is trained with `loss.dflash_loss` behind `DFlashObjective`: anchors
drawn afresh each batch from a generator seeded by the run's seed, the global step and the micro-batch's index within
it (a rerun draws the same anchors), D-PACE or decay position weights, the vocabulary projection in chunks,
normalised over the global batch's supervised slots under data parallelism.
It is written as the z-lab folder vLLM 0.32 loads (`DFlashDrafter.save_pretrained`) and decoded by
`eagle3_zoo.speculative.dflash_decode.DFlashGenerator` (`decoding = "block"`: its `block_proposer`, no tree
`DraftModel`).

The mask token: the `drafter.dflash.mask_token_id` of the recipe, else the target config's `mask_token_id` when it has
one, else the last id of the target's vocabulary (`vocab_size - 1`); whichever it is, config.json records it
(`dflash_config.mask_token_id`), and the drafter learns what that frozen embedding row means in a masked slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from eagle3_zoo.drafters.base import (
    BlockProposer,
    DrafterKind,
    DraftModel,
    FeatureNeeds,
    StepLine,
    StepSizing,
    TargetLayers,
    TrainingContext,
    register_kind,
)
from eagle3_zoo.drafters.dflash import sizing as dflash_sizing
from eagle3_zoo.drafters.dflash.config import DFlashConfig
from eagle3_zoo.drafters.dflash.decoding import DFlashProposer
from eagle3_zoo.drafters.dflash.loss import DFlashLossOutput, dflash_loss, select_anchors
from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.values.layout_names import DFLASH_BUILT_IN

MICRO_BATCH_STRIDE = 2_654_435_761  # seed offset per micro-batch of a step (odd: see `anchor_generator`)


@dataclass(frozen=True)
class DFlashTraining:
    """How a DFlash drafter is trained (the recipe's `drafter.dflash` section; not part of the saved config)."""

    num_anchors: int = 512  # blocks drawn per sequence each step
    weighting: str = "dpace"  # "dpace" | "decay"
    dpace_alpha: float = 0.5
    decay_gamma: float = 4.0
    labels: str = "hard"  # "hard" (the next tokens) | "soft" (the target's distribution)


def training_settings(section: Any) -> DFlashTraining:
    """`DFlashTraining` from the recipe's `drafter` section (its `dflash` subsection; defaults without one)."""
    d = getattr(section, "dflash", None)
    if d is None:
        return DFlashTraining()
    return DFlashTraining(num_anchors=d.num_anchors, weighting=d.weighting, dpace_alpha=d.dpace_alpha,
                          decay_gamma=d.decay_gamma, labels=getattr(d, "labels", "hard"))


def init_layers_from_target(drafter: DFlashDrafter, target: TargetLayers,
                            key: str = "drafter.dflash.init_layers") -> list[str]:
    """Start the draft layers as copies of the target's last `len(drafter.layers)` decoder layers (draft layer i from
    target layer N - Ld + i), parameter by parameter where the names and shapes match (`drafter.dflash.init_layers =
    target`), and the final norm from the target's. Parameters the target layer lacks or shapes differently (the
    per-head q/k norms of a Llama target) keep their initialisation. Returns the names of the draft layers'
    parameters copied (prefixed `layers.i.`).

    Raises:
        ValueError: the target has fewer decoder layers than the drafter, or its tensors are not materialised (a
            target loaded without its layers).
    """
    ld = len(drafter.layers)
    if len(target.layers) < ld:
        raise ValueError(f"{key} = target: the drafter has {ld} layers but the target only "
                         f"{len(target.layers)} decoder layers")
    copied = []
    with torch.no_grad():
        for i, (layer, source) in enumerate(zip(drafter.layers, target.layers[len(target.layers) - ld:])):
            for name, param in layer.named_parameters():
                src = source.get(name)
                if src is None or tuple(src.shape) != tuple(param.shape):
                    continue
                if src.is_meta:
                    raise ValueError(f"{key} = target: the target's decoder layers are not loaded (meta tensors)")
                param.copy_(src.detach().to(param.dtype))
                copied.append(f"layers.{i}.{name}")
        if target.norm is not None and tuple(target.norm.shape) == tuple(drafter.norm.weight.shape):
            drafter.norm.weight.copy_(target.norm.detach().to(drafter.norm.weight.dtype))
    return copied


class DFlashObjective(nn.Module):
    """The trained unit: the drafter (as `.drafter`, so FSDP2 gathers its parameters around `forward`) and the DFlash
    loss of one batch given its anchors."""

    def __init__(self, drafter: DFlashDrafter, settings: DFlashTraining, seed: int):
        super().__init__()
        self.drafter, self.settings, self.seed = drafter, settings, seed
        self._micro_step, self._micro = -1, 0  # the optimizer step of the last training micro-batch, its index

    def anchor_generator(self, step: int, training: bool, micro_batch: int = 0) -> torch.Generator:
        """The generator a batch draws its anchors from: seeded by the run's seed, the global step and, under
        gradient accumulation, the micro-batch's index within the step (validation draws from its own stream), so a
        rerun, or a resumed run, draws the same anchors at the same step and the micro-batches of one step draw
        different ones. Micro-batch 0 draws what a run without accumulation draws."""
        base = self.seed * 1_000_003 + 2 * step + (0 if training else 1)
        # an odd multiplier: the CPU generator keeps the low 32 bits of its seed, which the index must change
        return torch.Generator().manual_seed((base + micro_batch * MICRO_BATCH_STRIDE) % 2**63)

    def micro_batch(self, step: int) -> int:
        """The index of this training batch among those of optimizer step `step` (0 for the first): counted from the
        step's first batch, which a resumed run starts from (checkpoints are written between optimizer steps)."""
        self._micro = self._micro + 1 if step == self._micro_step else 0
        self._micro_step = step
        return self._micro

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                embed_weight: torch.Tensor, head_weight: torch.Tensor | None, generator: torch.Generator,
                chunk: int, position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                target_hidden: torch.Tensor | None = None) -> DFlashLossOutput:
        s = self.settings
        anchors, valid = select_anchors(loss_mask, s.num_anchors, generator, document_ids)
        return dflash_loss(self.drafter, aux_hidden.to(self.drafter.fc.weight.dtype), input_ids, loss_mask, anchors,
                           valid, embed_weight, head_weight, weighting=s.weighting, alpha=s.dpace_alpha,
                           gamma=s.decay_gamma, chunk=chunk, attention="flex" if input_ids.is_cuda else "dense",
                           position_ids=position_ids, document_ids=document_ids, labels=s.labels,
                           target_hidden=target_hidden)


class DFlashKind(DrafterKind):
    name = "dflash"
    config_class = DFlashConfig
    drafter_class = DFlashDrafter
    layouts = DFLASH_BUILT_IN  # z-lab (what `save` writes; vLLM and SGLang load it) and speculators
    card_tags = ("dflash", "speculative-decoding")
    decoding = "block"
    unrolls = False  # a block is drafted in one pass: no TTT schedule
    title = "DFlash"  # the kind's name in messages

    def config_from(self, section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                    defaults: dict[str, Any], target_name: str, torch_dtype: str) -> DFlashConfig:
        # drafter.dflash (drafter.dspark for the DSpark kind built on this one)
        return dflash_sizing.config_from(section, target_config, aux_layer_ids=aux_layer_ids, defaults=defaults,
                                         target_name=target_name, torch_dtype=torch_dtype, subsection=self.name,
                                         config_class=self.config_class,
                                         extras=self.config_extras(getattr(section, self.name)))

    def config_extras(self, subsection: Any) -> dict[str, Any]:
        """Config fields of a kind built on this one, from its recipe subsection (DFlash: none)."""
        return {}

    def step_lines(self, section: Any, config: DFlashConfig, target_config: Any,
                   sizing: StepSizing) -> list[StepLine]:
        return dflash_sizing.step_lines(section, config, target_config, sizing, subsection=self.name, title=self.title)

    def features(self, config: DFlashConfig) -> FeatureNeeds:
        return FeatureNeeds(aux_layer_ids=config.aux_layer_ids, final_hidden=False)

    def training_features(self, config: DFlashConfig, section: Any = None) -> FeatureNeeds:
        """The features decoding reads (`features`), and the target's last hidden state with soft labels
        (`drafter.dflash.labels`)."""
        needs = self.features(config)
        if self.name == "dflash" and training_settings(section).labels == "soft":
            return FeatureNeeds(aux_layer_ids=needs.aux_layer_ids, final_hidden=True)
        return needs

    def build(self, config: DFlashConfig, *, d2t: torch.Tensor, t2d: torch.Tensor,
              target_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
              target_layers: TargetLayers | None = None) -> DFlashDrafter:
        if target_head is not None:
            raise ValueError("a DFlash drafter does not start from the target's head (drafter.init_head = 'target'): "
                             "a full-vocabulary one scores with the target's lm_head itself")
        drafter = self.drafter_class(config)
        if drafter.d2t is not None:
            drafter.d2t.copy_(d2t.to(torch.long))
        if target_layers is not None:
            init_layers_from_target(drafter, target_layers, f"drafter.{self.name}.init_layers")
        return drafter

    def objective(self, drafter: DFlashDrafter, loss: Any, section: Any = None) -> DFlashObjective:
        # the seed the run's generator was last seeded with (`RecipeModule.build_drafter` seeds it just before)
        return DFlashObjective(drafter, training_settings(section), torch.initial_seed())

    def training_loss(self, module: TrainingContext, batch: dict[str, torch.Tensor], steps: int, *,
                      global_norm: bool = False, read_along: bool = False,
                      with_alpha: bool = True) -> DFlashLossOutput:
        """The DFlash loss of one batch (`steps` is unused: a block is drafted in one pass, nothing is unrolled),
        averaged over its supervised slots; the step waits for the device once, to read their count (and, with
        `read_along`, what the previous step left to read).

        With `global_norm` (training under a data-parallel strategy) this rank's loss is scaled by
        `world * n(rank) / N(all ranks)` (supervised slots): the gradient averaged over the ranks is then the gradient
        of the loss averaged over the supervised slots of the *global* batch (what one process with the whole batch
        computes, given the same anchors), and the rank-mean of the returned loss is that global loss. A training
        batch draws its anchors by its optimizer step and its index among that step's micro-batches
        (`DFlashObjective.anchor_generator`)."""
        embed, lm_head = module.frozen_heads
        aux_hidden, final_hidden = module.target_features(batch)
        objective = module.objective
        soft = objective.settings.labels == "soft"
        if soft and final_hidden is None:
            raise ValueError("drafter.dflash.labels = soft needs the target's last hidden state, and the batch's "
                             "features have none")
        # the target's lm_head: the draft head of a full-vocabulary drafter, and the soft labels' target logits
        head = lm_head.weight if soft or not objective.drafter.config.reduced_vocab else None
        out = objective(aux_hidden, batch["input_ids"], batch["loss_mask"], embed.weight, head,
                        self.batch_generator(module), module.logits_chunk_size, batch.get("position_ids"),
                        batch.get("document_ids"), final_hidden if soft else None)
        return self.normalised(module, out, global_norm, read_along)

    @staticmethod
    def batch_generator(module: TrainingContext) -> torch.Generator:
        """The anchors' generator of this batch: its optimizer step and, in training, its micro-batch's index."""
        objective = module.objective
        step, training = int(getattr(module, "global_step", 0)), bool(getattr(module, "training", True))
        return objective.anchor_generator(step, training, objective.micro_batch(step) if training else 0)

    @staticmethod
    def normalised(module: TrainingContext, out: Any, global_norm: bool, read_along: bool) -> Any:
        """`out` with its loss scaled to the global batch's supervised slots under `global_norm` (see
        `training_loss`), its count queued for reading."""
        world = module.data_parallel_ranks() if global_norm else 1
        if world > 1:  # queued with the loss (no wait): the count of every rank's supervised slots
            local = out.num_supervised.reshape(1)
            total = module.sum_over_ranks(local.clone())
            out.loss = out.loss * (local.float() * world / total.float().clamp(min=1.0)).to(out.loss.dtype)[0]
        module.read_counts(out.num_supervised.reshape(1), read_along)
        return out

    def train_metrics(self, out: DFlashLossOutput,
                      with_alpha: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        metrics = {f"train/acc_{k + 1}": v for k, v in enumerate(out.position_acc)}  # slot k+1 of each block
        metrics["train/tau_est"] = out.acceptance_length.detach()  # simulated greedy acceptance per block
        metrics["train/supervised_tokens"] = out.num_supervised.float()
        return metrics, {"train/acc_1": out.position_acc[0], "train/tau_est": metrics["train/tau_est"]}

    def validation_metrics(self, steps: int) -> Metric:
        return DFlashMetrics()

    def validation_loss(self, metrics: dict[str, torch.Tensor], step_weights: list[float]) -> torch.Tensor | None:
        return metrics.get("val/weighted_ce")  # the training loss on the validation set

    def to_write(self, trained: DFlashDrafter, state: dict[str, torch.Tensor]) -> DFlashDrafter:
        drafter = self.drafter_class(trained.config)
        drafter.load_state_dict(state)
        return drafter.to(torch.float32)

    def save(self, drafter: DFlashDrafter, folder: Any) -> None:
        drafter.save_pretrained(folder)

    def load(self, folder: Any) -> DFlashDrafter:
        return self.drafter_class.from_pretrained(folder)

    def check_folder(self, folder: Any) -> list[str]:
        from safetensors import SafetensorError

        try:
            drafter = self.drafter_class.from_pretrained(folder, dtype=torch.float32)
        except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:
            return [f"{folder}: not a loadable {self.title} drafter folder: {e}"]
        bad = [k for k, v in drafter.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
        problems = [f"{folder}: non-finite weights in {', '.join(bad[:4])}"] if bad else []
        if drafter.d2t is not None:
            ids = torch.arange(drafter.config.draft_vocab_size) + drafter.d2t
            if not ((ids >= 0) & (ids < drafter.config.vocab_size)).all() or ids.unique().numel() != ids.numel():
                problems.append(f"{folder}: d2t maps draft ids outside the target vocabulary or onto one id twice")
        return problems

    def draft_model(self, drafter: nn.Module, embed_tokens: nn.Module) -> DraftModel:
        raise TypeError("a DFlash drafter is a block drafter, not a tree DraftModel: decode it with "
                        "eagle3_zoo.speculative.dflash_decode.DFlashGenerator")

    def block_proposer(self, drafter: DFlashDrafter, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor) -> BlockProposer:
        """A `DFlashProposer` (a DSpark drafter is the DSpark kind's: `eagle3_zoo.drafters.dspark.kind`). The target's
        lm_head is used only by a full-vocabulary drafter."""
        head = None if drafter.config.reduced_vocab else lm_head_weight
        return DFlashProposer(drafter, embed_weight, head)

    def target_mismatches(self, drafter: DFlashDrafter, target_config: Any) -> list[str]:
        c, tc = drafter.config, target_config
        problems = []
        if c.num_target_layers != tc.num_hidden_layers:
            problems.append(f"num_target_layers={c.num_target_layers} but the target has {tc.num_hidden_layers}")
        if c.target_hidden_size != tc.hidden_size:
            problems.append(f"target_hidden_size={c.target_hidden_size} but the target's is {tc.hidden_size}")
        if c.vocab_size != tc.vocab_size:
            problems.append(f"vocab_size={c.vocab_size} but the target's is {tc.vocab_size}")
        return problems


    def init_mismatches(self, drafter: DFlashDrafter, section: Any, aux_layer_ids: tuple[int, ...]) -> list[str]:
        c = drafter.config
        problems = []
        if tuple(c.aux_layer_ids) != tuple(aux_layer_ids):  # the data stage's ids: target_layer_id + 1
            problems.append(f"target_layer_ids {list(c.target_layer_ids)} != the run's "
                            f"{[i - 1 for i in aux_layer_ids]} (set drafter.dflash.target_layer_ids to the drafter's)")
        d = getattr(section, "dflash", None)
        if d is None:
            return problems
        # the drafter's forward pass: a recipe cannot switch it silently
        for key, ours in (("num_layers", c.num_hidden_layers), ("block_size", c.block_size)):
            if getattr(d, key) != ours:
                problems.append(f"the drafter has {key} = {ours} but drafter.dflash.{key} = {getattr(d, key)} in the "
                                "recipe (set it to the drafter's)")
        if d.mask_token_id is not None and d.mask_token_id != c.mask_token_id:
            problems.append(f"the drafter's mask_token_id is {c.mask_token_id} but drafter.dflash.mask_token_id = "
                            f"{d.mask_token_id} in the recipe (set it to the drafter's, or leave it null)")
        return problems

    def draft_vocab(self, drafter: DFlashDrafter) -> tuple[torch.Tensor, torch.Tensor]:
        c = drafter.config
        draft_ids = torch.arange(c.draft_vocab_size)
        target_ids = drafter.to_target_ids(draft_ids).cpu()
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        return (target_ids - draft_ids).to(torch.int64), t2d


class DFlashMetrics(Metric):
    """Supervised-slot-weighted means over validation batches of the loss (`weighted_ce`: the module logs it as
    `val/loss` too), the per-position accuracy and the
    simulated acceptance length (weighted by supervised slots too: an approximation of the per-block mean)."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        for name in ("loss", "tau", "weight"):
            self.add_state(name, default=torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("acc", default=torch.zeros(0), dist_reduce_fx="sum")

    def update(self, out: DFlashLossOutput) -> None:  # type: ignore[override]
        n = out.num_supervised.detach().to(self.weight)
        self.loss += out.loss.detach().to(self.loss) * n
        self.tau += out.acceptance_length.detach().to(self.tau) * n
        acc = out.position_acc.detach().to(self.loss) * n
        self.acc = acc if self.acc.numel() == 0 else self.acc + acc
        self.weight += n

    def compute(self, prefix: str = "val") -> dict[str, torch.Tensor]:  # type: ignore[override]
        if not float(self.weight) > 0:
            return {}
        out = {f"{prefix}/weighted_ce": self.loss / self.weight, f"{prefix}/tau_est": self.tau / self.weight}
        out.update({f"{prefix}/acc_{k + 1}": v / self.weight for k, v in enumerate(self.acc)})
        return out


DFLASH = register_kind(DFlashKind())
