"""Per-TTT-step training metrics and the acceptance-length estimate derived from them.

`acceptance_length_estimate` turns per-step top-1 accuracies into an estimate of the mean accepted length tau
of chain drafting at T=0: step k's prediction can only be accepted if steps 0..k-1 were, so (treating the steps as
independent, which they are not) P(k+1 drafted tokens accepted) ~ prod_{j<=k} acc_j and

    tau_est = 1 + sum_k prod_{j<=k} acc_j        (the 1 is the target's own bonus token per verification)

It is an *estimate*: it ignores the correlation between steps (errors cluster on hard positions), uses teacher-
forced inputs at every step, and measures argmax agreement on training-distribution text. Real tau comes from
speculative decoding (`eagle3_zoo.speculative`, the `TauEvalCallback`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchmetrics import MeanMetric


def acceptance_length_estimate(step_acc: Sequence[float] | torch.Tensor) -> float:
    """tau_est = 1 + sum_k prod_{j<=k} acc_j (chain drafting, T=0; an estimate, see the module docstring).

    Args:
        step_acc: per-step top-1 accuracies `acc_0..acc_{K-1}` in [0, 1].

    Returns:
        The estimate, between 1 and K + 1.
    """
    acc = torch.as_tensor(step_acc, dtype=torch.float64).reshape(-1)
    if acc.numel() and ((acc < 0).any() or (acc > 1).any()):
        raise ValueError(f"accuracies must lie in [0, 1], got {acc.tolist()}")
    return float(acceptance_length_tensor(acc))


def acceptance_length_tensor(step_acc: torch.Tensor) -> torch.Tensor:
    """`acceptance_length_estimate` as a 0-d tensor on the accuracies' device, unchecked: a training step logs it
    without waiting for the device."""
    acc = step_acc.reshape(-1)
    return 1.0 + torch.cumprod(acc if acc.is_floating_point() else acc.float(), dim=0).sum()


class StepMetrics(nn.Module):
    """Supervised-position-weighted means of each TTT step's loss, accuracy and expected acceptance (alpha) over an
    epoch (val) or window.

    Weighting by the number of supervised positions makes the epoch value equal to the loss over all positions,
    whatever the batch composition. torchmetrics syncs the states across ranks at `compute()`.
    """

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps
        self.loss = nn.ModuleList(MeanMetric() for _ in range(steps))
        self.acc = nn.ModuleList(MeanMetric() for _ in range(steps))
        self.alpha = nn.ModuleList(MeanMetric() for _ in range(steps))  # expected acceptance of a drafted token

    def update(self, step_losses: torch.Tensor, step_acc: torch.Tensor, num_supervised: torch.Tensor,
               step_alpha: torch.Tensor | None = None) -> None:
        """Add one batch; steps beyond the ones that ran (or with no supervised position) are left out."""
        for k in range(min(self.steps, step_losses.numel())):
            n = float(num_supervised[k])
            if n > 0:
                self.loss[k].update(step_losses[k].detach().float(), weight=n)
                self.acc[k].update(step_acc[k].detach().float(), weight=n)
                if step_alpha is not None:
                    self.alpha[k].update(step_alpha[k].detach().float(), weight=n)

    def compute(self, prefix: str) -> dict[str, torch.Tensor]:
        """`{prefix}/loss_k`, `{prefix}/acc_k` (and `{prefix}/alpha_k`) for the steps that saw data, and
        `{prefix}/tau_est`."""
        out: dict[str, torch.Tensor] = {}
        accs = []
        for k in range(self.steps):
            if not self.acc[k].update_called:
                break  # later steps cannot have data when this one has none (same positions, shorter window)
            out[f"{prefix}/loss_{k}"] = self.loss[k].compute()
            acc = self.acc[k].compute()
            out[f"{prefix}/acc_{k}"] = acc
            if self.alpha[k].update_called:
                out[f"{prefix}/alpha_{k}"] = self.alpha[k].compute()
            accs.append(float(acc))
        if accs:
            out[f"{prefix}/tau_est"] = torch.tensor(acceptance_length_estimate(accs))
        return out

    def reset(self) -> None:
        for metric in (*self.loss, *self.acc, *self.alpha):
            metric.reset()
