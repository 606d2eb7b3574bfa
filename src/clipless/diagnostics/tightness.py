"""Empirical per-example gradient norms against the engine's bounds (spec §3.5, bound tightness).

Computes true per-example gradients with autograd, one example at a time
(slow by design: it is the independent check of the bound engine, used by the
tests and by audits, never by the training step).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
from torch import nn

from ..privacy.bounds import BoundReport
from ..privacy.certified import BoundError, is_real, whole_number
from ..privacy.input_guard import paused_guards
from ..privacy.modules import LipschitzLoss

__all__ = ["per_example_gradient_norms", "tightness", "TightnessMonitor"]


def per_example_gradient_norms(
    model: nn.Module, loss: LipschitzLoss, x: torch.Tensor, y: torch.Tensor, report: BoundReport
) -> Dict[str, torch.Tensor]:
    """``{layer name: tensor of shape (batch,)}``: norm of each example's gradient for each bounded layer."""
    norms: Dict[str, List[float]] = {layer.name: [] for layer in report.layers}
    for i in range(x.shape[0]):
        value = loss.per_example(model(x[i : i + 1]), y[i : i + 1]).sum()
        for layer in report.layers:
            grads = torch.autograd.grad(value, layer.params, retain_graph=True, allow_unused=True)
            sq = sum(float((g.double() ** 2).sum()) for g in grads if g is not None)
            norms[layer.name].append(sq**0.5)
    return {name: torch.tensor(v, dtype=torch.float64) for name, v in norms.items()}


def tightness(
    model: nn.Module, loss: LipschitzLoss, x: torch.Tensor, y: torch.Tensor, report: BoundReport
) -> Dict[str, float]:
    """Per layer, ``max_i ||grad_i|| / g_d`` over the sample; a value above 1 means a broken bound.  An empty
    sample (an empty Poisson batch) has no gradient to compare: its ratios are 0."""
    norms = per_example_gradient_norms(model, loss, x, y, report)
    out = {}
    for layer in report.layers:
        worst = float(norms[layer.name].max()) if norms[layer.name].numel() else 0.0
        out[layer.name] = worst / layer.bound if layer.bound > 0 else 0.0
    return out


class TightnessMonitor:
    """Checks during training that true per-example gradients stay within the engine's bounds (spec §3.5).

    Every ``every`` steps, ``sample`` examples of the current batch get their
    per-layer gradient norms from autograd (one example at a time) and are
    compared with the bound report of that step.  A ratio above ``1 + tol``
    means the released noise was calibrated to a wrong sensitivity: the
    monitor raises :class:`BoundError` before the optimizer releases the step.
    ``tol`` covers float32 rounding of the forward/backward only.

    The recorded ratios are computed from training examples without noise:
    they are a diagnostic for the developer, not covered by the privacy
    guarantee, and should not be published.
    """

    def __init__(self, every: int = 50, sample: int = 8, tol: float = 1e-4) -> None:
        self.every, self.sample = whole_number(every, "every"), whole_number(sample, "sample")
        # a NaN tolerance would pass every ratio (no comparison with NaN is true): the check would be off silently
        if not is_real(tol) or not 0 <= tol < math.inf:
            raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
        self.tol = float(tol)
        self.worst: Dict[str, float] = {}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def check(
        self, model: nn.Module, loss: LipschitzLoss, x: torch.Tensor, y: torch.Tensor, report: BoundReport, step: int
    ) -> Dict[str, float]:
        """Ratios of this check; raises :class:`BoundError` if any exceeds ``1 + tol``."""
        with paused_guards(model):  # diagnostic passes, not part of the step: no guard, no per-step count
            ratios = tightness(model, loss, x[: self.sample], y[: self.sample], report)
        for name, ratio in ratios.items():
            self.worst[name] = max(self.worst.get(name, 0.0), ratio)
        broken = {name: r for name, r in ratios.items() if r > 1 + self.tol}
        if broken:
            detail = ", ".join(f"layer '{n}'" for n in broken)  # not the ratio: a statistic of training examples
            raise BoundError(
                f"bound violated at step {step}: a per-example gradient exceeds its certified bound ({detail}); "
                "training stopped before releasing the step, since its noise would not give the stated epsilon"
            )
        return ratios
