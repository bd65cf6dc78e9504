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
from torchmetrics import Metric


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


class StepMetrics(Metric):
    """Supervised-position-weighted means of each TTT step's loss, accuracy and expected acceptance (alpha) over an
    epoch (val) or window.

    Weighting by the number of supervised positions makes the epoch value equal to the loss over all positions,
    whatever the batch composition. The sums stay on the device: `update` reads nothing on the host (a wait for the
    device per value, 40-60 per validation batch with one `MeanMetric` per step and value); `compute` reads them
    once. torchmetrics sums the states across ranks at `compute()`.
    """

    full_state_update = False

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps
        # float32 sums, as torchmetrics' MeanMetric keeps them: the same values in the same order of additions
        for name in ("loss", "acc", "weight", "alpha", "alpha_weight"):
            self.add_state(name, default=torch.zeros(steps), dist_reduce_fx="sum")

    def update(self, step_losses: torch.Tensor, step_acc: torch.Tensor, num_supervised: torch.Tensor,
               step_alpha: torch.Tensor | None = None) -> None:
        """Add one batch; steps beyond the ones that ran (or with no supervised position) are left out."""
        k = min(self.steps, step_losses.numel())
        n = num_supervised[:k].detach().to(self.weight)
        self.loss[:k] += step_losses[:k].detach().to(self.loss) * n
        self.acc[:k] += step_acc[:k].detach().to(self.acc) * n
        self.weight[:k] += n
        if step_alpha is not None:
            self.alpha[:k] += step_alpha[:k].detach().to(self.alpha) * n
            self.alpha_weight[:k] += n

    def compute(self, prefix: str) -> dict[str, torch.Tensor]:
        """`{prefix}/loss_k`, `{prefix}/acc_k` (and `{prefix}/alpha_k`) for the steps that saw data, and
        `{prefix}/tau_est`."""
        loss, acc, alpha = self.loss / self.weight, self.acc / self.weight, self.alpha / self.alpha_weight
        # one read of what saw data, and of the accuracies for the estimate
        weight, alpha_weight, accs = torch.stack([self.weight, self.alpha_weight, acc]).tolist()
        out: dict[str, torch.Tensor] = {}
        seen = []
        for k in range(self.steps):
            if not weight[k] > 0:
                break  # later steps cannot have data when this one has none (same positions, shorter window)
            out[f"{prefix}/loss_{k}"], out[f"{prefix}/acc_{k}"] = loss[k], acc[k]
            if alpha_weight[k] > 0:
                out[f"{prefix}/alpha_{k}"] = alpha[k]
            seen.append(accs[k])
        if seen:
            out[f"{prefix}/tau_est"] = torch.tensor(acceptance_length_estimate(seen))
        return out
