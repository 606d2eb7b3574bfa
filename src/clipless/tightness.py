"""Empirical per-example gradient norms against the engine's bounds (SPEC §3.5, bound tightness).

Computes true per-example gradients with autograd, one example at a time
(slow by design: it is the independent check of the bound engine, used by the
tests and by audits, never by the training step).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from .bounds import BoundReport
from .losses import LipschitzLoss

__all__ = ["per_example_gradient_norms", "tightness"]


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
    """Per layer, ``max_i ||grad_i|| / g_d`` over the sample; a value above 1 means a broken bound."""
    norms = per_example_gradient_norms(model, loss, x, y, report)
    out = {}
    for layer in report.layers:
        out[layer.name] = float(norms[layer.name].max()) / layer.bound if layer.bound > 0 else 0.0
    return out
