"""Helpers of the Lipschitz layers: per-example norms, projections on the feasible sets."""

from __future__ import annotations

import math

import torch

from ..privacy.certified import (
    certified_spectral_norm,
)

__all__ = ["per_example_norm", "broadcast_per_example", "bjorck_orthonormalize", "project_matrix_", "clip_norm_", "positive_finite", "check_projection"]


def per_example_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.flatten(1), dim=1)


def broadcast_per_example(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.reshape((-1,) + (1,) * (like.dim() - 1))


@torch.no_grad()
def bjorck_orthonormalize(weight: torch.Tensor, max_iters: int = 30, tol: float = 1e-5) -> torch.Tensor:
    """Björck–Bowie iteration ``W <- 1.5 W - 0.5 (W W^T) W`` until ``max|W W^T - I| < tol``.

    Converges for singular values in ``(0, sqrt(3))``; the input is rescaled
    when its largest singular value is above 1.5.  Warm-started from the
    previous (orthonormal) weights one or two iterations suffice.  The result
    is *not* taken as certified: layers recompute its exact norm for the bounds.
    """
    w = weight
    transpose = w.shape[0] > w.shape[1]
    if transpose:
        w = w.T
    gram = w @ w.T
    top = torch.linalg.eigvalsh(gram)[-1].clamp_min(0).sqrt()
    if top > 1.5:
        w = w / top
        gram = gram / top**2
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    for _ in range(max_iters):
        if (gram - eye).abs().max() < tol:
            break
        w = 1.5 * w - 0.5 * gram @ w
        gram = w @ w.T
    if transpose:
        w = w.T
    return w.contiguous()


def project_matrix_(matrix: torch.Tensor, projection: str, scale: float, bjorck_iters: int) -> torch.Tensor:
    """Project a matrix to spectral norm <= 1/scale ('spectral') or to orthonormal/scale ('bjorck')."""
    if projection == "bjorck":
        return bjorck_orthonormalize(matrix, bjorck_iters) / scale
    norm = certified_spectral_norm(matrix) * scale
    return matrix / norm if norm > 1.0 else matrix


def clip_norm_(tensor: torch.Tensor, max_norm: float) -> None:
    norm = torch.linalg.vector_norm(tensor.to(torch.float64)).item()
    if norm > max_norm:
        tensor.mul_(max_norm / norm)


def positive_finite(value: float, name: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return float(value)


def check_projection(projection: str) -> str:
    if projection not in ("bjorck", "spectral"):
        raise ValueError(f"projection must be 'bjorck' or 'spectral', got {projection!r}")
    return projection


