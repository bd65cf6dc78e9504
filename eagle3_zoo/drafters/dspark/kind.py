"""DSpark as a drafter kind (`drafter.kind: dspark`): the DFlash backbone whose every slot drafts a token, with a
low-rank Markov head and a confidence head.

It is DFlash's kind (`eagle3_zoo.drafters.dflash.kind.DFlashKind`) with DSpark's model and config
(`model.DSparkDrafter`, `config.DSparkConfig`, sized like the target; the recipe's `drafter.dspark` section sets the
backbone as `drafter.dflash` does, plus `markov_rank`, `enable_confidence_head` and the loss weights). Unlike DFlash it
reads the target's last (post-norm) hidden state besides the outputs of the decoder layers `target_layer_ids`: its
loss is against the target's distribution there (`loss.dspark_loss`: `ce_weight` CE to the target's greedy token +
`tv_weight` TV + `bce_weight` BCE of the confidence head, position decay exp(-k / `decay_gamma`)). Anchors are drawn
as DFlash draws them (seeded by the run's seed, the global step and the micro-batch's index), and the loss is
normalised over the global batch's supervised slots as DFlash's.
It is written as the folder vLLM 0.32's `qwen3_dspark.py` loads (`DSparkDrafter.save_pretrained`: the z-lab DFlash
layout with `architectures: ["Qwen3DSparkModel"]` and the heads' keys; layout `dspark`,
`eagle3_zoo.checkpoint.dflash_layouts`) and decoded by `eagle3_zoo.speculative.dflash_decode.DFlashGenerator` with a
`DSparkProposer` (`decoding = "block"`: a block drafts `block_size` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from eagle3_zoo.drafters.base import BlockProposer, TrainingContext, register_kind
from eagle3_zoo.drafters.dflash.kind import DFlashKind, DFlashObjective, DFlashTraining
from eagle3_zoo.drafters.dflash.loss import select_anchors
from eagle3_zoo.drafters.dspark.config import DSparkConfig
from eagle3_zoo.drafters.dspark.decoding import DSparkProposer
from eagle3_zoo.drafters.dspark.loss import CE_WEIGHT, CONFIDENCE_WEIGHT, TV_WEIGHT, DSparkLossOutput, dspark_loss
from eagle3_zoo.drafters.dspark.model import DSparkDrafter
from eagle3_zoo.values.layout_names import DSPARK_BUILT_IN


@dataclass(frozen=True)
class DSparkTraining:
    """How a DSpark drafter is trained (the recipe's `drafter.dspark` section; not part of the saved config)."""

    num_anchors: int = 512  # blocks drawn per sequence each step
    decay_gamma: float = 4.0
    ce_weight: float = CE_WEIGHT
    tv_weight: float = TV_WEIGHT
    bce_weight: float = CONFIDENCE_WEIGHT


def training_settings(section: Any) -> DSparkTraining:
    """`DSparkTraining` from the recipe's `drafter` section (its `dspark` subsection; defaults without one)."""
    d = getattr(section, "dspark", None)
    if d is None:
        return DSparkTraining()
    return DSparkTraining(num_anchors=d.num_anchors, decay_gamma=d.decay_gamma, ce_weight=d.ce_weight,
                          tv_weight=d.tv_weight, bce_weight=d.bce_weight)


class DSparkObjective(DFlashObjective):
    """The trained unit: the drafter (as `.drafter`) and the DSpark loss of one batch given its anchors (drawn as
    `DFlashObjective` draws them)."""

    def __init__(self, drafter: DSparkDrafter, settings: DSparkTraining, seed: int):
        super().__init__(drafter, DFlashTraining(num_anchors=settings.num_anchors), seed)
        self.dspark = settings

    def forward(self, aux_hidden: torch.Tensor,  # type: ignore[override]
                input_ids: torch.Tensor, loss_mask: torch.Tensor, embed_weight: torch.Tensor,
                final_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                generator: torch.Generator, chunk: int, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> DSparkLossOutput:
        s = self.dspark
        anchors, valid = select_anchors(loss_mask, s.num_anchors, generator, document_ids)
        return dspark_loss(self.drafter, aux_hidden.to(self.drafter.fc.weight.dtype), input_ids, loss_mask, anchors,
                           valid, embed_weight, final_hidden, lm_head_weight, ce_weight=s.ce_weight,
                           tv_weight=s.tv_weight, confidence_weight=s.bce_weight, gamma=s.decay_gamma, chunk=chunk,
                           attention="flex" if input_ids.is_cuda else "dense", position_ids=position_ids,
                           document_ids=document_ids)


class DSparkKind(DFlashKind):
    name = "dspark"
    config_class = DSparkConfig
    drafter_class = DSparkDrafter
    layouts = DSPARK_BUILT_IN  # the folder vLLM 0.32's qwen3_dspark.py loads (what `save` writes)
    card_tags = ("dspark", "speculative-decoding")
    decoding = "block"
    title = "DSpark"

    def config_extras(self, subsection: Any) -> dict[str, Any]:
        return {"markov_rank": subsection.markov_rank, "enable_confidence_head": subsection.enable_confidence_head}

    def step_lines(self, section: Any, config: DSparkConfig, target_config: Any, sizing: Any) -> list[Any]:
        from eagle3_zoo.drafters.dspark.sizing import step_lines

        return step_lines(section, config, target_config, sizing)

    def features(self, config: DSparkConfig) -> Any:
        """DFlash's feature layers and the target's last hidden state (the loss's target distribution)."""
        from eagle3_zoo.drafters.base import FeatureNeeds

        return FeatureNeeds(aux_layer_ids=config.aux_layer_ids, final_hidden=True)

    def objective(self, drafter: DSparkDrafter, loss: Any, section: Any = None) -> DSparkObjective:
        # the seed the run's generator was last seeded with (`RecipeModule.build_drafter` seeds it just before)
        return DSparkObjective(drafter, training_settings(section), torch.initial_seed())

    def training_loss(self, module: TrainingContext, batch: dict[str, torch.Tensor], steps: int, *,
                      global_norm: bool = False, read_along: bool = False,
                      with_alpha: bool = True) -> DSparkLossOutput:
        """The DSpark loss of one batch (`steps` is unused: a block is drafted in one pass), anchors and the
        normalisation over the global batch as DFlash's (`DFlashKind.training_loss`)."""
        embed, lm_head = module.frozen_heads
        aux_hidden, final_hidden = module.target_features(batch)
        if final_hidden is None:
            raise ValueError("a DSpark drafter is trained against the target's last hidden state, which the batch "
                             "does not hold (the kind's features ask for it: FeatureNeeds.final_hidden)")
        out = module.objective(aux_hidden, batch["input_ids"], batch["loss_mask"], embed.weight, final_hidden,
                               lm_head.weight, self.batch_generator(module), module.logits_chunk_size,
                               batch.get("position_ids"), batch.get("document_ids"))
        return self.normalised(module, out, global_norm, read_along)

    def train_metrics(self, out: DSparkLossOutput,
                      with_alpha: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per drafted token j (slot j-1 of each block): greedy agreement `acc_j` and, `with_alpha`, the acceptance
        `alpha_j` of sampling the draft against the target; the simulated greedy acceptance length (`tau_est`), the
        expected one (`expected_len`), and the three loss terms."""
        metrics = {f"train/acc_{k + 1}": v for k, v in enumerate(out.position_acc)}
        if with_alpha:
            metrics.update({f"train/alpha_{k + 1}": v for k, v in enumerate(out.accept_rate)})
        metrics.update({"train/tau_est": out.acceptance_length.detach(), "train/expected_len": out.expected_length,
                        "train/ce": out.ce, "train/tv": out.tv, "train/bce": out.bce,
                        "train/supervised_tokens": out.num_supervised.float()})
        return metrics, {"train/acc_1": out.position_acc[0], "train/tau_est": metrics["train/tau_est"]}

    def validation_metrics(self, steps: int) -> Metric:
        return DSparkMetrics()

    def validation_loss(self, metrics: dict[str, torch.Tensor], step_weights: list[float]) -> torch.Tensor | None:
        return metrics.get("val/weighted_loss")  # the training loss on the validation set

    def block_proposer(self, drafter: DSparkDrafter, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor) -> BlockProposer:
        """A `DSparkProposer` (`block_size` drafts per block). The target's lm_head is used only by a full-vocabulary
        drafter."""
        return DSparkProposer(drafter, embed_weight, None if drafter.config.reduced_vocab else lm_head_weight)

    def draft_model(self, drafter: nn.Module, embed_tokens: nn.Module) -> Any:
        raise TypeError("a DSpark drafter is a block drafter, not a tree DraftModel: decode it with "
                        "eagle3_zoo.speculative.dspark_decode.DSparkGenerator")


class DSparkMetrics(Metric):
    """Supervised-slot-weighted means over validation batches of the loss (`weighted_loss`: the module logs it as
    `val/loss` too), its TV term, the per-position greedy accuracy and acceptance, and the simulated and expected
    acceptance lengths (weighted by supervised slots too: an approximation of the per-block means)."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        for name in ("loss", "tv", "tau", "expected", "weight"):
            self.add_state(name, default=torch.zeros(()), dist_reduce_fx="sum")
        for name in ("acc", "alpha"):
            self.add_state(name, default=torch.zeros(0), dist_reduce_fx="sum")

    def update(self, out: DSparkLossOutput) -> None:  # type: ignore[override]
        n = out.num_supervised.detach().to(self.weight)
        self.loss += out.loss.detach().to(self.loss) * n
        self.tv += out.tv.detach().to(self.tv) * n
        self.tau += out.acceptance_length.detach().to(self.tau) * n
        self.expected += out.expected_length.detach().to(self.expected) * n
        acc, alpha = out.position_acc.detach().to(self.loss) * n, out.accept_rate.detach().to(self.loss) * n
        self.acc = acc if self.acc.numel() == 0 else self.acc + acc
        self.alpha = alpha if self.alpha.numel() == 0 else self.alpha + alpha
        self.weight += n

    def compute(self, prefix: str = "val") -> dict[str, torch.Tensor]:  # type: ignore[override]
        if not float(self.weight) > 0:
            return {}
        w = self.weight
        out = {f"{prefix}/weighted_loss": self.loss / w, f"{prefix}/tv": self.tv / w,
               f"{prefix}/tau_est": self.tau / w, f"{prefix}/expected_len": self.expected / w}
        out.update({f"{prefix}/acc_{k + 1}": v / w for k, v in enumerate(self.acc)})
        out.update({f"{prefix}/alpha_{k + 1}": v / w for k, v in enumerate(self.alpha)})
        return out


DSPARK = register_kind(DSparkKind())
