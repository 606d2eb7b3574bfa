"""Helpers of the Lipschitz layers: per-example norms, projections on the feasible sets."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..privacy.certified import (
    CERT_MARGIN,
    BoundError,
    CertifiedValueCache,
    bjorck_residual,
    certified_bjorck_step,
    certified_norm,
    certified_spectral_norm,
    is_real,
)
from ..privacy.modules import LayerBound

__all__ = ["per_example_norm", "broadcast_per_example", "bjorck_orthonormalize", "project_matrix_", "clip_norm_",
           "check_projection", "max_min", "l2_norm_pool2d", "rescale_to_unit_ball_",
           "affine_layer_bound"]


def per_example_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.flatten(1), dim=1)


def affine_layer_bound(lip: float, x_bound: float, weight_factor: float, bias: Optional[torch.Tensor],
                       positions: int) -> LayerBound:
    """Bound of ``y = A(W) x + b`` with ``b`` broadcast over ``positions`` outputs.

    ``||y|| <= lip X + sqrt(P) ||b||`` and ``||dy/db||_op = sqrt(P)``, so the bias factor is ``sqrt(P)``.
    """
    factors = {"weight": weight_factor}
    bias_term = 0.0
    if bias is not None:
        root_p = math.sqrt(positions)
        factors["bias"] = root_p
        bias_term = root_p * certified_norm(bias)
    return LayerBound(lipschitz=lip, out_bound=lip * x_bound + bias_term, param_factors=factors)


def broadcast_per_example(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.reshape((-1,) + (1,) * (like.dim() - 1))


@torch.no_grad()
def bjorck_orthonormalize(weight: torch.Tensor, max_iters: int = 30, tol: float = 1e-2) -> Tuple[torch.Tensor, float]:
    """Björck–Bowie iterations ``W <- W - (W W^T - I) W / 2`` and a certified bound on the result's norm.

    Converges for singular values in ``(0, sqrt(3))``; the input is rescaled when its largest singular value
    is above 1.5.  The last iteration is ``certified_bjorck_step`` (float64 residual, ``||W'||_2 <= 1`` plus
    proven rounding terms, about 1e-5).  An iteration takes ``d = max|W W^T - I|`` to about ``0.75 d^2``:
    weights within ``tol`` of orthonormal (warm-started from the previous step) get that one iteration,
    others float32 iterations down to ``tol / 10`` first.
    """
    w = weight
    transpose = w.shape[0] > w.shape[1]
    if transpose:
        w = w.T
    residual = bjorck_residual(w)
    deviation = float(residual.abs().max())
    if not math.isfinite(deviation):
        raise BoundError("weight matrix contains NaN or infinite values")
    if deviation >= tol:  # far from orthonormal (first projection, large steps): converge in float32 first
        # max row sum of |G| >= lambda_max(G): the exact top singular value only when it might exceed 1.5
        if float(residual.abs().sum(dim=1).max()) + 1 > 2.25:
            top = math.sqrt(max(float(torch.linalg.eigvalsh(residual)[-1]) + 1, 0.0))
            if top > 1.5:
                w = w / top
        eye = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
        for _ in range(max_iters - 1):
            gap = w @ w.T - eye
            if float(gap.abs().max()) < 0.1 * tol:
                break
            w = w - 0.5 * gap @ w
        residual = bjorck_residual(w)  # of the weights the certified step takes
    w, bound = certified_bjorck_step(w, residual)
    return (w.T if transpose else w).contiguous(), bound


def project_matrix_(matrix: torch.Tensor, projection: str, scale: float, bjorck_iters: int) -> torch.Tensor:
    """Project a matrix to spectral norm <= 1/scale ('spectral') or to orthonormal/scale ('bjorck')."""
    if projection == "bjorck":
        return bjorck_orthonormalize(matrix, bjorck_iters)[0] / scale
    norm = certified_spectral_norm(matrix) * scale
    return matrix / norm if norm > 1.0 else matrix


@torch.no_grad()
def rescale_to_unit_ball_(weight: torch.Tensor, cache: CertifiedValueCache, key: object = None) -> None:
    """``W <- W / max(1, s)`` with ``s`` the certified ``||W||_2``; the stored weight's certified bound is put in
    ``cache`` so it is not recomputed: ``s`` when ``W`` is kept, else ``1 + ||E||_F`` where the division's
    rounding ``E`` has ``|E| <= 2 eps |W| / s`` elementwise (``||W / s||_2 <= 1`` exactly)."""
    norm = certified_spectral_norm(weight)
    if norm <= 1.0:
        cache.put(weight, key, norm)
        return
    frobenius = torch.linalg.vector_norm(weight.detach().to(torch.float64)).item()
    weight.div_(norm)
    rounding = 2 * torch.finfo(weight.dtype).eps * frobenius / norm
    cache.put(weight, key, (1.0 + rounding) * CERT_MARGIN)


def clip_norm_(tensor: torch.Tensor, max_norm: float) -> None:
    norm = torch.linalg.vector_norm(tensor.to(torch.float64)).item()
    if norm > max_norm:
        tensor.mul_(max_norm / norm)


def finite_at_least(value: float, name: str, minimum: float = 0.0) -> float:
    """A real constant (a margin, a weight in a loss) that must be finite and ``>= minimum``."""
    if not (is_real(value) and math.isfinite(value) and value >= minimum):
        raise ValueError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def check_bias_bound(bias_bound: float) -> float:
    """The bias projection's radius; the bounds use the bias's own certified norm, so ``inf`` (no projection) is
    sound, while a negative or NaN radius would crash or silently skip the projection."""
    if not is_real(bias_bound) or not bias_bound >= 0:
        raise ValueError(f"bias_bound must be a number >= 0 (inf: no projection of the bias), got {bias_bound!r}")
    return float(bias_bound)


def check_projection(projection: str) -> str:
    if projection not in ("bjorck", "spectral"):
        raise ValueError(f"projection must be 'bjorck' or 'spectral', got {projection!r}")
    return projection




class _MaxMin(torch.autograd.Function):
    """``(a, b) -> (max, min)`` over pairs along ``dim`` of a grouped view, written in place of a stack.

    The Jacobian is a permutation per input (ties send ``a`` to the max), so the layer is 1-Lipschitz and
    gradient-norm preserving; the backward keeps the boolean ``a >= b`` and needs three fused passes
    (``torch.where`` is several times slower on CPU).
    """

    @staticmethod
    def forward(ctx, grouped: torch.Tensor, dim: int) -> torch.Tensor:  # type: ignore[override]
        a, b = grouped.select(dim, 0), grouped.select(dim, 1)
        out = torch.empty_like(grouped)
        torch.maximum(a, b, out=out.select(dim, 0))
        torch.minimum(a, b, out=out.select(dim, 1))
        ctx.save_for_backward(a >= b)  # one byte per pair
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (keep,) = ctx.saved_tensors
        dim = ctx.dim
        g_max, g_min = grad.select(dim, 0), grad.select(dim, 1)
        if torch.is_grad_enabled():  # create_graph: differentiable ops only
            diff, keep = g_max - g_min, keep.to(grad.dtype)
            return torch.stack((g_min + keep * diff, g_max - keep * diff), dim=dim), None
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        grad_a, grad_b = out.select(dim, 0), out.select(dim, 1)
        torch.sub(g_max, g_min, out=grad_b)
        torch.addcmul(g_min, keep, grad_b, out=grad_a)  # a got the max where keep, the min elsewhere
        torch.addcmul(g_max, keep, grad_b, value=-1, out=grad_b)
        return out, None


def max_min(grouped: torch.Tensor, dim: int) -> torch.Tensor:
    """Sort each pair along ``dim`` (size 2) into ``(max, min)``: the MaxMin activation on a grouped view."""
    if grouped.shape[dim] != 2:
        raise ValueError(f"max_min needs pairs along dim {dim}, got size {grouped.shape[dim]}")
    return _MaxMin.apply(grouped, dim)


def _windows(x: torch.Tensor, k: int, rows: int, cols: int) -> torch.Tensor:
    """The ``(..., rows, k, cols * k)`` view of ``x``'s full ``k x k`` windows (a remainder is left out)."""
    return x[..., : rows * k, : cols * k].unflatten(-2, (rows, k))


class _L2NormPool2d(torch.autograd.Function):
    """``sqrt(sum_window x^2 + eps) - sqrt(eps)`` over disjoint ``k x k`` windows; the backward is
    ``x * broadcast(g / r)`` with ``r = out + sqrt(eps)``.

    Both passes add or multiply strided views of the windows' rows and columns: CPU ``avg_pool2d`` and a
    product broadcast over a ``k``-wide inner axis are each 3-5x slower than these few flat passes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int, eps: float) -> torch.Tensor:  # type: ignore[override]
        rows, cols = x.shape[-2] // k, x.shape[-1] // k
        windows = _windows(x, k, rows, cols)
        squares = windows.select(-2, 0).square()  # (..., rows, cols * k): the window rows' squares summed
        for i in range(1, k):
            squares.addcmul_(windows.select(-2, i), windows.select(-2, i))
        squares = squares.unflatten(-1, (cols, k))
        out = squares[..., 0].clone()
        for j in range(1, k):
            out.add_(squares[..., j])
        out.add_(eps).sqrt_().sub_(math.sqrt(eps))
        ctx.save_for_backward(x, out)
        ctx.k, ctx.eps = k, eps
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, out = ctx.saved_tensors
        k = ctx.k
        scale = grad / (out + math.sqrt(ctx.eps))
        rows, cols = scale.shape[-2:]
        full = (rows * k, cols * k) == tuple(x.shape[-2:])
        if torch.is_grad_enabled():  # create_graph: differentiable ops only
            windows = _windows(x, k, rows, cols).unflatten(-1, (cols, k))
            inner = (windows * scale[..., :, None, :, None]).reshape(x.shape[:-2] + (rows * k, cols * k))
            if not full:  # rows/columns past the last full window get no gradient
                inner = F.pad(inner, (0, x.shape[-1] - cols * k, 0, x.shape[-2] - rows * k))
            return inner, None, None
        wide = torch.empty(scale.shape + (k,), dtype=scale.dtype, device=scale.device)
        for j in range(k):  # each window's scale repeated along its columns
            wide[..., j] = scale
        wide = wide.flatten(-2)
        # rows/columns past the last full window get no gradient
        result = torch.empty_like(x) if full else torch.zeros_like(x)
        x_windows, result_windows = _windows(x, k, rows, cols), _windows(result, k, rows, cols)
        for i in range(k):
            torch.mul(x_windows.select(-2, i), wide, out=result_windows.select(-2, i))
        return result, None, None


def l2_norm_pool2d(x: torch.Tensor, kernel_size: int, eps: float) -> torch.Tensor:
    """Per-channel L2 norm over disjoint ``kernel_size`` windows, minus ``sqrt(eps)`` (0 at 0, differentiable)."""
    return _L2NormPool2d.apply(x, int(kernel_size), float(eps))
