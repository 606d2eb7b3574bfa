"""Robustness certificates of Lipschitz classifiers (spec §3.5): certified accuracy at L2 radii.

If the logits ``f`` are ``L``-Lipschitz in L2, every difference ``z_c - z_j`` is ``sqrt(2) L``-Lipschitz,
so the prediction cannot change within radius ``(z_c - max_{j != c} z_j) / (sqrt(2) L)``; a single-logit
(sign) classifier is certified within ``|z| / L``.  ``L`` is the certified constant of the bound engine.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset

from ..train.evaluation import collect_outputs, predictions

__all__ = ["certified_radii", "certified_accuracy"]


def certified_radii(logits: torch.Tensor, lipschitz: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Predictions and the L2 radius within which each is certified not to change."""
    if not (lipschitz > 0 and math.isfinite(lipschitz)):
        raise ValueError(f"the Lipschitz constant must be positive and finite, got {lipschitz}")
    preds = predictions(logits)
    if logits.dim() == 1 or logits.shape[1] == 1:
        return preds, logits.reshape(-1).abs() / lipschitz
    top2 = logits.topk(2, dim=1).values
    return preds, (top2[:, 0] - top2[:, 1]) / (math.sqrt(2.0) * lipschitz)


@torch.no_grad()
def certified_accuracy(
    model: nn.Module,
    data: Dataset,
    radii: Sequence[float],
    lipschitz: float,
    batch_size: int = 2048,
) -> Dict[float, float]:
    """Fraction of ``data`` classified correctly *and* certified at each radius (radius 0 = accuracy)."""
    logits, y = collect_outputs(model, data, batch_size)
    preds, r = certified_radii(logits, lipschitz)
    rad = torch.where(preds == y, r, torch.full_like(r, -1.0))  # misclassified: certified at no radius
    return {float(eps): float((rad >= eps).double().mean()) for eps in radii}


def attack_radius_check(model: nn.Module, x: torch.Tensor, radius: torch.Tensor, steps: int = 50,
                        generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Projected-gradient attack within each example's ``radius``: ``True`` where the prediction changed.

    An independent (empirical) check of :func:`certified_radii`, used by the tests.
    """
    was = model.training
    model.eval()
    with torch.no_grad():
        base = predictions(model(x))
    delta = torch.randn(x.shape, generator=generator) * 1e-3
    shape = (-1,) + (1,) * (x.dim() - 1)
    changed = torch.zeros(x.shape[0], dtype=torch.bool)
    step = (radius / 10).reshape(shape)
    for _ in range(steps):
        delta.requires_grad_(True)
        z = model(x + delta)
        if z.dim() == 1 or z.shape[1] == 1:
            margin = z.reshape(-1) * torch.where(base == 1, 1.0, -1.0)
        else:
            others = z.clone()
            others[torch.arange(len(base)), base] = -float("inf")
            margin = z[torch.arange(len(base)), base] - others.max(1).values
        (grad,) = torch.autograd.grad(margin.sum(), delta)
        with torch.no_grad():
            g = grad / grad.flatten(1).norm(dim=1).clamp_min(1e-12).reshape(shape)
            delta = delta - step * g
            norms = delta.flatten(1).norm(dim=1).clamp_min(1e-12)
            delta = delta * torch.clamp(radius / norms, max=1.0).reshape(shape)
            changed |= predictions(model(x + delta)) != base
    model.train(was)
    return changed
