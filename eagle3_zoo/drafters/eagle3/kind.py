"""EAGLE-3 as a drafter kind (`drafter.kind: eagle3`, the default), with its EAGLE-3.1 options (`drafter.fc_norm`,
`drafter.norm_output`: two config flags of the same model).

Its model and config are `eagle3_zoo.modeling` (`Eagle3Drafter`, `Eagle3Config`); it reads three (or one) aux hidden
states and the target's last hidden state (the target's logits over the draft vocabulary are its soft labels); it is
trained with the TTT rollout (`ttt.ttt_loss`, behind `objective.DrafterObjective`), logs the per-step losses,
accuracies and acceptance (`metrics`), decodes through `decode.Eagle3DraftModel`, and is written in the canonical
(SGLang), official EAGLE and speculators layouts (`eagle3_zoo.checkpoint.layouts`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eagle3_zoo.drafters.base import (
    DrafterKind,
    DraftModel,
    FeatureNeeds,
    StepLine,
    StepSizing,
    TrainingContext,
    register_kind,
)
from eagle3_zoo.drafters.eagle3 import sizing as eagle3_sizing
from eagle3_zoo.drafters.eagle3.decode import Eagle3DraftModel
from eagle3_zoo.drafters.eagle3.metrics import StepMetrics, acceptance_length_tensor
from eagle3_zoo.drafters.eagle3.objective import (
    NUM_TARGET_ROWS,
    DrafterObjective,
    draft_target_logits,
    rank_step_weights,
    supervised_positions,
)
from eagle3_zoo.drafters.eagle3.ttt import TTTLossOutput
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter
from eagle3_zoo.values.layout_names import BUILT_IN


class Eagle3Kind(DrafterKind):
    name = "eagle3"
    config_class = Eagle3Config
    drafter_class = Eagle3Drafter
    layouts = BUILT_IN
    card_tags = ("eagle3", "speculative-decoding")

    def config_from(self, section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                    defaults: dict[str, Any], target_name: str, torch_dtype: str) -> Eagle3Config:
        return eagle3_sizing.config_from(section, target_config, aux_layer_ids=aux_layer_ids, defaults=defaults,
                                         target_name=target_name, torch_dtype=torch_dtype)

    def step_lines(self, section: Any, config: Eagle3Config, target_config: Any,
                   sizing: StepSizing) -> list[StepLine]:
        return eagle3_sizing.step_lines(section, config, target_config, sizing)

    def features(self, config: Eagle3Config) -> FeatureNeeds:
        return FeatureNeeds(aux_layer_ids=tuple(config.aux_layer_ids), final_hidden=True)

    def build(self, config: Eagle3Config, *, d2t: torch.Tensor, t2d: torch.Tensor,
              target_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
              target_layers: Any = None) -> Eagle3Drafter:
        if target_layers is not None:
            raise ValueError("an EAGLE-3 drafter does not start its layer from the target's decoder layers")
        drafter = Eagle3Drafter(config)
        drafter.set_vocab(d2t, t2d)
        if target_head is not None:
            drafter.init_head_from_target(*target_head)
        return drafter

    def objective(self, drafter: Eagle3Drafter, loss: Any, section: Any = None) -> DrafterObjective:
        return DrafterObjective(drafter, loss)

    def training_loss(self, module: TrainingContext, batch: dict[str, torch.Tensor], steps: int, *,
                      global_norm: bool = False, read_along: bool = False, with_alpha: bool = True) -> TTTLossOutput:
        """TTT loss of one right-padded batch (or of packed rows: `position_ids` and `document_ids` in the batch)
        with `steps` unrolled steps.

        The loss waits for the device once, to read the supervised-row counts of its steps; with `read_along` (the
        training step) that read also brings what earlier steps left to read (`TrainingContext.read_counts`).

        With `global_norm` (training under a data-parallel strategy), step k's weight on this rank is scaled by
        `world * n_k(rank) / N_k(all ranks)`: the gradient averaged over ranks is then exactly the gradient of the
        loss normalised by the supervised positions of the *global* batch (what one process with the whole batch
        computes), and the rank-mean of the returned loss is that global loss. `with_alpha=False` leaves out the
        per-step acceptance (`step_alpha` None) and the target's draft-vocabulary mass it needs.
        """
        drafter = module.drafter
        embed_tokens, lm_head = module.frozen_heads
        aux_hidden, final_hidden = module.target_features(batch)
        documents = batch.get("document_ids")  # packed rows (`data.packing`)
        logits, valid, *mass = draft_target_logits(lm_head, final_hidden, drafter.t2d, batch["loss_mask"],
                                                   module.logits_chunk_size, drafter.config.draft_vocab_size,
                                                   with_mass=with_alpha, num_rows=batch.get(NUM_TARGET_ROWS),
                                                   document_ids=documents)
        weights = module.step_weights[:steps]
        local = supervised_positions(batch["loss_mask"], valid, steps, documents)
        world = module.data_parallel_ranks() if global_norm else 1
        if world > 1:
            total = module.sum_over_ranks(local.clone())
            weights = rank_step_weights(weights, local, total, world)
        loss, step_losses, step_acc, counts, step_alpha = module.objective(
            embed_tokens, batch["input_ids"], aux_hidden, logits, batch["loss_mask"], valid, steps,
            weights, mass[0] if mass else None, module.read_counts(local, read_along), batch.get("position_ids"),
            documents, with_alpha)
        return TTTLossOutput(loss=loss, step_losses=step_losses, step_acc=step_acc, num_supervised=counts,
                             step_alpha=step_alpha)

    def train_metrics(self, out: TTTLossOutput,
                      with_alpha: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        metrics = {f"train/loss_{k}": v for k, v in enumerate(out.step_losses)}
        metrics.update({f"train/acc_{k}": v.float() for k, v in enumerate(out.step_acc) if k > 0})
        # the expected acceptance of a drafted token at each step (what tau is made of), beside top-1 agreement
        if with_alpha:
            metrics.update({f"train/alpha_{k}": v for k, v in enumerate(out.step_alpha)})
        metrics["train/tau_est"] = acceptance_length_tensor(out.step_acc.detach())  # on the device: no wait
        metrics["train/supervised_tokens"] = out.num_supervised[0].float()
        metrics["train/acc_0"] = out.step_acc[0].float()
        return metrics, {"train/acc_0": out.step_acc[0]}

    def validation_metrics(self, steps: int) -> StepMetrics:
        return _ValidationMetrics(steps)

    def validation_loss(self, metrics: dict[str, torch.Tensor], step_weights: list[float]) -> torch.Tensor | None:
        losses = [metrics[f"val/loss_{k}"] for k in range(len(step_weights)) if f"val/loss_{k}" in metrics]
        return sum(w * v for w, v in zip(step_weights, losses)) if losses else None

    def to_write(self, trained: Eagle3Drafter, state: dict[str, torch.Tensor]) -> Eagle3Drafter:
        return drafter_from_state(trained.config, state, trained.fc_input_scale if trained._fc_scaled else None)

    def from_checkpoint(self, config: Eagle3Config, state: dict[str, torch.Tensor],
                        recorded: dict[str, Any]) -> Eagle3Drafter:
        """The run's fc preconditioning scale (recorded beside the weights) is folded into fc.weight."""
        return drafter_from_state(config, state, recorded.get("fc_input_scale"))

    def save(self, drafter: Eagle3Drafter, folder: Any) -> None:
        drafter.save_pretrained(folder)

    def load(self, folder: Any) -> Eagle3Drafter:
        return Eagle3Drafter.from_pretrained(folder)

    def draft_model(self, drafter: Eagle3Drafter, embed_tokens: nn.Module) -> DraftModel:
        return Eagle3DraftModel(drafter, embed_tokens)

    def target_mismatches(self, drafter: Eagle3Drafter, target_config: Any) -> list[str]:
        return drafter.config.target_mismatches(target_config)

    def init_mismatches(self, drafter: Eagle3Drafter, section: Any, aux_layer_ids: tuple[int, ...]) -> list[str]:
        problems = super().init_mismatches(drafter, section, aux_layer_ids)
        cfg = drafter.config
        for flag in ("fc_norm", "norm_output"):  # the forward pass is the drafter's: a recipe cannot switch it silently
            if section is not None and bool(getattr(section, flag)) != getattr(cfg, flag):
                problems.append(f"{flag} is {getattr(cfg, flag)} in the drafter but drafter.{flag} = "
                                f"{getattr(section, flag)} in the recipe (set it to the drafter's)")
        return problems

    def fc_input_scale(self, drafter: Eagle3Drafter) -> torch.Tensor | None:
        return drafter.fc_input_scale if drafter._fc_scaled else None


def drafter_from_state(config: Eagle3Config, state: dict[str, torch.Tensor],
                       fc_input_scale: torch.Tensor | None = None) -> Eagle3Drafter:
    """The drafter to write (fp32, CPU) from a full state dict of its weights; a training-time fc preconditioning
    scale is folded into fc.weight."""
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(state)
    drafter = drafter.to(torch.float32)
    if fc_input_scale is not None:
        drafter.set_fc_input_scale(fc_input_scale.detach().cpu().float())
        drafter.fold_fc_input_scale()
    return drafter


class _ValidationMetrics(StepMetrics):
    """`StepMetrics` updated with a `TTTLossOutput`."""

    def update(self, out: TTTLossOutput) -> None:  # type: ignore[override]
        super().update(out.step_losses, out.step_acc, out.num_supervised, out.step_alpha)


EAGLE3 = register_kind(Eagle3Kind())
