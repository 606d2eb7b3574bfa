"""Parameter-free Lipschitz layers (input clip, GroupSort/MaxMin, pooling, permutation, centering), spec §2."""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..privacy.modules import BoundedModule, InputClip, LayerBound
from ..privacy.accounting import check_positive_finite
from ..privacy.certified import is_whole, whole_number
from .functional import broadcast_per_example, l2_norm_pool2d, max_min, per_example_norm

__all__ = ["InputNormClip", "GroupSort", "MaxMin", "L2NormPool2d", "ScaledAvgPool2d", "Permute", "LayerCentering"]


class InputNormClip(InputClip):
    """``x -> x * min(1, C/||x||)`` per example: projection on the ball, ``l = 1``, ``X -> min(X, C)``."""

    constants = ("max_norm",)

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = check_positive_finite(max_norm, "max_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = per_example_norm(x)
        factor = torch.clamp(self.max_norm / norms.clamp_min(1e-12), max=1.0)
        return x * broadcast_per_example(factor, x)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=min(x_bound, self.max_norm))

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}"


def _check_per_example_dims(dims: Sequence[int], ndim: int, layer: str) -> None:
    """Refuse axes outside the tensor or resolving to the batch axis 0 (negative ones included)."""
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"{layer}: axis {d} does not exist for {ndim}-d inputs")
        if d % ndim == 0:
            raise ValueError(f"{layer}: axis {d} is the batch axis of {ndim}-d inputs; acting on it couples examples")


class GroupSort(BoundedModule):
    """Sort features in groups of ``group_size`` along ``dim`` (a permutation per input: ``l = 1``, ``X -> X``)."""

    constants = ("group_size", "dim")

    def __init__(self, group_size: int = 2, dim: int = 1) -> None:
        super().__init__()
        group_size = whole_number(group_size, "group_size", 2)
        if not is_whole(dim):
            raise ValueError(f"dim must be an integer axis, got {dim!r}")
        if dim == 0:
            raise ValueError("dim 0 is the batch axis")
        self.group_size, self.dim = group_size, int(dim)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        _check_per_example_dims((self.dim,), x.dim(), type(self).__name__)
        dim = self.dim % x.dim()
        n = x.shape[dim]
        if n % self.group_size:
            raise ValueError(f"{n} features are not divisible into groups of {self.group_size}")
        return x.reshape(x.shape[:dim] + (n // self.group_size, self.group_size) + x.shape[dim + 1 :])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.dim % x.dim()
        return self._grouped(x).sort(dim=dim + 1).values.reshape(x.shape)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, dim={self.dim}"


class MaxMin(GroupSort):
    """GroupSort with groups of two: ``(a, b) -> (max, min)``."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__(2, dim)

    layer_bound = GroupSort.layer_bound  # the same map as GroupSort(2), computed faster

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.dim % x.dim()
        return max_min(self._grouped(x), dim + 1).reshape(x.shape)


class L2NormPool2d(BoundedModule):
    """Per-channel L2 norm over disjoint ``k x k`` windows: ``l = 1``, ``X -> X``.

    Computed as ``sqrt(||w||^2 + eps) - sqrt(eps) <= ||w||`` so that it stays
    differentiable at 0 without raising the output bound.
    """

    constants = ("kernel_size", "eps")

    def __init__(self, kernel_size: int, eps: float = 1e-10) -> None:
        super().__init__()
        self.kernel_size, self.eps = whole_number(kernel_size, "kernel_size"), check_positive_finite(eps, "eps")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_norm_pool2d(x, self.kernel_size, self.eps)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"


class ScaledAvgPool2d(BoundedModule):
    """``k * avg_pool(k, stride=k)``: ``|sum w| / k <= ||w||`` per window, so ``l = 1``, ``X -> X``."""

    constants = ("kernel_size",)

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = whole_number(kernel_size, "kernel_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        return F.avg_pool2d(x, k, stride=k) * k

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)


class Permute(BoundedModule):
    """Reorder the per-example axes (``dims`` excludes the batch axis, numbered from 1): ``l = 1``, ``X -> X``."""

    constants = ("dims",)

    def __init__(self, *dims: int) -> None:
        super().__init__()
        if sorted(dims) != list(range(1, len(dims) + 1)):
            raise ValueError(f"dims must be a permutation of 1..{len(dims)} (the batch axis 0 stays first), got {dims}")
        self.dims = tuple(int(d) for d in dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != len(self.dims) + 1:
            # per-example shape only: a Poisson batch's size is secret
            raise ValueError(f"Permute{self.dims} expects {len(self.dims) + 1}-d inputs, got per-example shape "
                             f"{tuple(x.shape[1:])}")
        return x.permute(0, *self.dims)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)

    def extra_repr(self) -> str:
        return f"dims={self.dims}"


class LayerCentering(BoundedModule):
    """Per-example centering ``x - mean(x)`` over ``dims`` (never the batch axis).

    An orthogonal projection: ``l = 1``, ``X -> X``.  Averaging over the batch
    axis would couple examples (spec §6), hence ``dims`` may not contain 0.
    """

    constants = ("dims",)

    def __init__(self, dims: Union[int, Sequence[int], None] = None) -> None:
        super().__init__()
        if dims is not None:
            dims = tuple(dims) if isinstance(dims, Sequence) else (dims,)
            if not dims:
                raise ValueError("LayerCentering(dims=()) would average over every axis, the batch axis included; "
                                 "name the per-example axes (or leave dims=None for all of them)")
            if not all(is_whole(d) for d in dims) or len(set(dims)) != len(dims):
                raise ValueError(f"LayerCentering dims must be distinct integers, got {dims}")
            if any(d == 0 for d in dims):
                raise ValueError("centering over the batch axis (dim 0) couples examples")
            dims = tuple(int(d) for d in dims)  # numpy's integers too
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.dims if self.dims is not None else tuple(range(1, x.dim()))
        _check_per_example_dims(dims, x.dim(), "LayerCentering")
        return x - x.mean(dim=dims, keepdim=True)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)


