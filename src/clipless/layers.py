"""Lipschitz layers with declared, certified bounds (SPEC §2).

Each layer's :meth:`layer_bound` states the constants of the SPEC §2 table;
the dense and convolution layers compute them from the *current* weights
(exact float64 spectral norms), so a bound never rests on a projection having
converged.
"""

from __future__ import annotations

import math
import contextlib
from typing import Callable, Iterator, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .bounds import (
    _CERT_MARGIN,
    BoundedModule,
    BoundError,
    DeclaredConstants,
    CertifiedValueCache,
    LayerBound,
    certified_norm,
    certified_spectral_norm,
)

__all__ = [
    "InputNormClip",
    "LipschitzLinear",
    "LipschitzConv2d",
    "GroupSort",
    "MaxMin",
    "L2NormPool2d",
    "ScaledAvgPool2d",
    "LayerCentering",
    "Permute",
    "Residual",
    "LossGradientClip",
    "AdaptiveLossGradientClip",
    "adaptive_clips",
    "bjorck_orthonormalize",
]


def _per_example_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.flatten(1), dim=1)


def _broadcast_per_example(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
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


def _project_matrix_(matrix: torch.Tensor, projection: str, scale: float, bjorck_iters: int) -> torch.Tensor:
    """Project a matrix to spectral norm <= 1/scale ('spectral') or to orthonormal/scale ('bjorck')."""
    if projection == "bjorck":
        return bjorck_orthonormalize(matrix, bjorck_iters) / scale
    norm = certified_spectral_norm(matrix) * scale
    return matrix / norm if norm > 1.0 else matrix


def _clip_norm_(tensor: torch.Tensor, max_norm: float) -> None:
    norm = torch.linalg.vector_norm(tensor.to(torch.float64)).item()
    if norm > max_norm:
        tensor.mul_(max_norm / norm)


def _positive_finite(value: float, name: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return float(value)


def _check_projection(projection: str) -> str:
    if projection not in ("bjorck", "spectral"):
        raise ValueError(f"projection must be 'bjorck' or 'spectral', got {projection!r}")
    return projection


class InputNormClip(BoundedModule):
    """``x -> x * min(1, C/||x||)`` per example: projection on the ball, ``l = 1``, ``X -> min(X, C)``."""

    constants = ("max_norm",)

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = _positive_finite(max_norm, "max_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = _per_example_norm(x)
        factor = torch.clamp(self.max_norm / norms.clamp_min(1e-12), max=1.0)
        return x * _broadcast_per_example(factor, x)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=min(x_bound, self.max_norm))

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}"


class LipschitzLinear(BoundedModule):
    """Dense layer ``y = W x (+ b)`` with ``||W||_2 <= 1`` and ``||b|| <= bias_bound``.

    Bounds (SPEC §2): ``l = ||W||_2`` (exact), ``X -> l X + sqrt(P) ||b||``,
    weight factor ``X`` (``||d(Wx)/dW||_op = ||x||``), bias factor ``sqrt(P)``,
    where ``P`` is the number of positions the layer is applied to (1 for a
    vector input; the tokens of a ``(tokens, features)`` input, as in MLP-Mixer,
    where the per-example weight gradient ``sum_t g_t x_t^T`` still has norm
    ``<= ||G||_F ||X||_F`` by Cauchy-Schwarz).
    ``projection='bjorck'`` keeps ``W`` orthonormal (gradient-norm preserving);
    ``'spectral'`` only rescales when ``||W||_2 > 1``.
    """

    constants = ("in_features", "out_features", "projection", "bias_bound")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        bias_bound: float = 1.0,
        projection: str = "bjorck",
        bjorck_iters: int = 30,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.projection = _check_projection(projection)
        self.bjorck_iters = bjorck_iters
        self.bias_bound = float(bias_bound)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.orthogonal_(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._norm_cache = CertifiedValueCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def project_(self) -> None:
        self.weight.copy_(_project_matrix_(self.weight, self.projection, 1.0, self.bjorck_iters))
        if self.bias is not None:
            _clip_norm_(self.bias, self.bias_bound)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        lip = self._norm_cache.get(self.weight, None)
        if lip is None:
            lip = self._norm_cache.put(self.weight, None, certified_spectral_norm(self.weight))
        factors = {"weight": x_bound}
        bias_term = 0.0
        if self.bias is not None:
            root_p = math.sqrt(math.prod(in_shape[:-1]))  # the bias is broadcast over P positions
            factors["bias"] = root_p
            bias_term = root_p * certified_norm(self.bias)
        return LayerBound(lipschitz=lip, out_bound=lip * x_bound + bias_term, param_factors=factors)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, projection={self.projection}"
        )


def _pair(v: Union[int, Sequence[int]]) -> Tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    a, b = v
    return (int(a), int(b))


class LipschitzConv2d(BoundedModule):
    """2-D convolution with a certified operator-norm bound (SPEC §2, §2.1).

    With ``W_mat`` the kernel reshaped to ``(c_out, c_in k_h k_w)`` and ``s`` the
    largest number of (patch, kernel offset) pairs that read one input pixel
    (counted exactly for the input size; at most ``ceil(k_h/stride) *
    ceil(k_w/stride)`` with zero padding, more with circular padding on small
    inputs where patches wrap around): the unfold map ``U`` has
    ``U^T U = diag(counts)``, so ``||conv|| <= ||U|| ||W_mat||_2 = sqrt(s) ||W_mat||_2``,
    weight factor ``sqrt(s) X``, bias factor ``sqrt(P)`` and output bound
    ``+ sqrt(P)||b||`` for ``P`` output positions.  This reshaped-kernel bound
    is valid for every stride/padding but loose; projections keep
    ``sqrt(s) ||W_mat||_2 <= 1``.
    """

    constants = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "padding_mode", "operator_norm",
                 "projection", "bias_bound", "overlap")

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Union[int, Sequence[int]] = 3,
        stride: int = 1,
        padding: Union[int, str] = "same",
        padding_mode: str = "zeros",
        bias: bool = False,
        bias_bound: float = 1.0,
        projection: str = "spectral",
        bjorck_iters: int = 30,
        operator_norm: str = "reshaped",
    ) -> None:
        super().__init__()
        if operator_norm not in ("reshaped", "fft"):
            raise ValueError("operator_norm must be 'reshaped' or 'fft'")
        self.operator_norm = operator_norm
        kh, kw = _pair(kernel_size)
        if padding == "same":
            if stride != 1 or kh % 2 == 0 or kw % 2 == 0:
                raise ValueError("padding='same' needs stride 1 and odd kernel sizes")
            pad: Tuple[int, int] = (kh // 2, kw // 2)
        elif isinstance(padding, int):
            pad = (padding, padding)
        else:
            raise ValueError(f"padding must be an int or 'same', got {padding!r}")
        if padding_mode not in ("zeros", "circular"):
            raise ValueError("padding_mode must be 'zeros' or 'circular'")
        if stride < 1:
            raise ValueError("stride must be >= 1")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.padding_mode = (kh, kw), stride, pad, padding_mode
        self.projection = _check_projection(projection)
        self.bjorck_iters = bjorck_iters
        self.bias_bound = float(bias_bound)
        # Shape-free default used until the input size is seen (exact for zero padding on large inputs).
        self.overlap = math.ceil(kh / stride) * math.ceil(kw / stride)
        self._spatial: Optional[Tuple[int, int]] = None
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kh, kw))
        nn.init.orthogonal_(self.weight.view(out_channels, -1))
        with torch.no_grad():
            self.weight.div_(math.sqrt(self.overlap))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self._norm_cache = CertifiedValueCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._spatial = (int(x.shape[-2]), int(x.shape[-1]))
        if self.padding_mode == "circular":
            ph, pw = self.padding
            x = F.pad(x, (pw, pw, ph, ph), mode="circular")
            return F.conv2d(x, self.weight, self.bias, stride=self.stride)
        return F.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)

    def _kernel_matrix(self) -> torch.Tensor:
        return self.weight.reshape(self.out_channels, -1)

    def output_positions(self, in_shape: Tuple[int, ...]) -> int:
        """Number ``P`` of output positions for a per-example input shape ``(C, H, W)``."""
        return self.output_size(in_shape[-2], 0) * self.output_size(in_shape[-1], 1)

    def overlap_for(self, in_shape: Tuple[int, ...]) -> int:
        """Exact ``s``: max over input pixels of the number of (patch, offset) pairs reading it."""
        h, w = in_shape[-2], in_shape[-1]
        circular = self.padding_mode == "circular"
        return _max_reads(h, self.kernel_size[0], self.stride, self.padding[0], circular) * _max_reads(
            w, self.kernel_size[1], self.stride, self.padding[1], circular
        )

    def fft_operator_norm(self, in_shape: Tuple[int, ...]) -> float:
        """Certified operator norm from the exact singular values of a circular convolution (Sedghi et al.).

        Zero padding: the layer is crop o (circular conv on the padded size
        ``n + 2p``) o zero-embedding, and striding is a sub-sampling, both of
        norm <= 1.  Circular padding on the input size ``n``, times
        ``sqrt(m)`` where ``m`` counts outputs that repeat one another when
        the output is longer than the input.  Computed in float64.
        """
        h, w = in_shape[-2], in_shape[-1]
        (kh, kw), (ph, pw), st = self.kernel_size, self.padding, self.stride
        circular = self.padding_mode == "circular"
        nh, nw = (h, w) if circular else (h + 2 * ph, w + 2 * pw)
        kernel = self.weight.detach().to(torch.float64)
        full = torch.zeros(self.out_channels, self.in_channels, nh, nw, dtype=torch.float64, device=kernel.device)
        for i in range(kh):
            for j in range(kw):
                full[:, :, i % nh, j % nw] += kernel[:, :, i, j]
        spectrum = torch.fft.fft2(full).permute(2, 3, 0, 1).reshape(nh * nw, self.out_channels, self.in_channels)
        norm = torch.linalg.matrix_norm(spectrum, ord=2).max().item()
        if not math.isfinite(norm):
            raise BoundError("convolution kernel contains NaN or infinite values")
        repeats = 1
        if circular:
            repeats = _max_repeats(h, self.output_size(h, 0), st) * _max_repeats(w, self.output_size(w, 1), st)
        return norm * math.sqrt(repeats) * (1 + 1e-7)

    def output_size(self, n: int, dim: int) -> int:
        """Output length along spatial ``dim`` (0: height, 1: width) for input length ``n``."""
        return (n + 2 * self.padding[dim] - self.kernel_size[dim]) // self.stride + 1

    def certified_lipschitz(self, in_shape: Tuple[int, ...]) -> float:
        """``l``: ``sqrt(s) ||W_mat||_2`` (the reshaped-kernel bound), or with ``operator_norm='fft'`` the
        smaller of it and the FFT bound (both certified; the FFT bound ignores striding, so for strided
        convolutions the reshaped bound can be the tighter one).  Cached per exact weights."""
        key = (self.operator_norm, tuple(in_shape[-2:]))
        cached = self._norm_cache.get(self.weight, key)
        if cached is not None:
            return cached
        value = math.sqrt(self.overlap_for(in_shape)) * certified_spectral_norm(self._kernel_matrix())
        if self.operator_norm == "fft":
            value = min(value, self.fft_operator_norm(in_shape))
        return self._norm_cache.put(self.weight, key, value)

    @torch.no_grad()
    def project_(self) -> None:
        if self.operator_norm == "fft" and self._spatial is not None:
            # spectral normalisation to operator norm 1 (norm preserving, like orthogonal dense layers)
            shape = self._spatial
            norm = self.certified_lipschitz(shape)
            frobenius = torch.linalg.vector_norm(self.weight.detach().to(torch.float64)).item()
            self.weight.div_(norm)
            # The stored kernel is W/norm + E with |E| <= 2 eps |W|/norm elementwise (rounding of the
            # division, or of a reciprocal multiplication, and of norm itself), so its operator norm is
            # at most 1 + sqrt(s) ||E||_F (reshaped-kernel bound applied to the linear map of E).
            # This certifies the projected weights without a second FFT per step.
            rounding = 2 * torch.finfo(self.weight.dtype).eps * frobenius / norm
            self._norm_cache.put(self.weight, ("fft", tuple(shape)),
                                 (1.0 + math.sqrt(self.overlap_for(shape)) * rounding) * _CERT_MARGIN)
        else:
            overlap = self.overlap_for(self._spatial) if self._spatial is not None else self.overlap
            matrix = _project_matrix_(self._kernel_matrix(), self.projection, math.sqrt(overlap), self.bjorck_iters)
            self.weight.copy_(matrix.reshape(self.weight.shape))
        if self.bias is not None:
            _clip_norm_(self.bias, self.bias_bound)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        root_s = math.sqrt(self.overlap_for(in_shape))
        lip = self.certified_lipschitz(in_shape)
        factors = {"weight": root_s * x_bound}
        bias_term = 0.0
        if self.bias is not None:
            root_p = math.sqrt(self.output_positions(in_shape))
            factors["bias"] = root_p
            bias_term = root_p * certified_norm(self.bias)
        return LayerBound(lipschitz=lip, out_bound=lip * x_bound + bias_term, param_factors=factors)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, padding_mode={self.padding_mode}, bias={self.bias is not None}"
        )


def _max_reads(n: int, k: int, stride: int, pad: int, circular: bool) -> int:
    """1-D: the most times one of ``n`` input positions is read by ``k``-wide patches (zero or circular padding)."""
    n_out = (n + 2 * pad - k) // stride + 1
    counts = [0] * n
    for p in range(max(n_out, 0)):
        for o in range(k):
            j = p * stride + o - pad
            if circular:
                counts[j % n] += 1
            elif 0 <= j < n:
                counts[j] += 1
    return max(max(counts), 1)


def _max_repeats(n: int, n_out: int, stride: int) -> int:
    """Circular padding: the most outputs (of ``n_out``) that start at the same input position mod ``n``."""
    counts: dict = {}
    for i in range(n_out):
        counts[(i * stride) % n] = counts.get((i * stride) % n, 0) + 1
    return max(counts.values(), default=1)


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
        if group_size < 2:
            raise ValueError("group_size must be >= 2")
        if dim == 0:
            raise ValueError("dim 0 is the batch axis")
        self.group_size, self.dim = group_size, dim

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
        g = self._grouped(x)
        a, b = g.select(dim + 1, 0), g.select(dim + 1, 1)
        return torch.stack((torch.maximum(a, b), torch.minimum(a, b)), dim=dim + 1).reshape(x.shape)


class L2NormPool2d(BoundedModule):
    """Per-channel L2 norm over disjoint ``k x k`` windows: ``l = 1``, ``X -> X``.

    Computed as ``sqrt(||w||^2 + eps) - sqrt(eps) <= ||w||`` so that it stays
    differentiable at 0 without raising the output bound.
    """

    constants = ("kernel_size", "eps")

    def __init__(self, kernel_size: int, eps: float = 1e-10) -> None:
        super().__init__()
        self.kernel_size, self.eps = int(kernel_size), float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        sq = F.avg_pool2d(x * x, k, stride=k) * (k * k)
        return torch.sqrt(sq + self.eps) - math.sqrt(self.eps)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"


class ScaledAvgPool2d(BoundedModule):
    """``k * avg_pool(k, stride=k)``: ``|sum w| / k <= ||w||`` per window, so ``l = 1``, ``X -> X``."""

    constants = ("kernel_size",)

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = int(kernel_size)

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
            raise ValueError(f"Permute{self.dims} expects {len(self.dims) + 1}-d inputs, got shape {tuple(x.shape)}")
        return x.permute(0, *self.dims)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)

    def extra_repr(self) -> str:
        return f"dims={self.dims}"


class LayerCentering(BoundedModule):
    """Per-example centering ``x - mean(x)`` over ``dims`` (never the batch axis).

    An orthogonal projection: ``l = 1``, ``X -> X``.  Averaging over the batch
    axis would couple examples (SPEC §6), hence ``dims`` may not contain 0.
    """

    constants = ("dims",)

    def __init__(self, dims: Union[int, Sequence[int], None] = None) -> None:
        super().__init__()
        if dims is not None:
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            if not dims:
                raise ValueError("LayerCentering(dims=()) would average over every axis, the batch axis included; "
                                 "name the per-example axes (or leave dims=None for all of them)")
            if any(isinstance(d, bool) or not isinstance(d, int) for d in dims) or len(set(dims)) != len(dims):
                raise ValueError(f"LayerCentering dims must be distinct integers, got {dims}")
            if any(d == 0 for d in dims):
                raise ValueError("centering over the batch axis (dim 0) couples examples")
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.dims if self.dims is not None else tuple(range(1, x.dim()))
        _check_per_example_dims(dims, x.dim(), "LayerCentering")
        return x - x.mean(dim=dims, keepdim=True)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)


class Residual(DeclaredConstants, nn.Module):
    """``y = a x + b h(x)`` (default ``(x + h(x))/2``); the bound engine treats it as split + merge.

    ``l <= a + b l_h``, ``X -> a X + b out_h(X)``, and parameters inside ``h``
    see the gradient bound ``b G``.
    """

    constants = ("skip_weight", "branch_weight")

    def __init__(self, branch: nn.Module, skip_weight: float = 0.5, branch_weight: float = 0.5) -> None:
        super().__init__()
        if skip_weight < 0 or branch_weight < 0:
            raise ValueError("residual weights must be non-negative")
        self.branch = branch
        self.skip_weight, self.branch_weight = float(skip_weight), float(branch_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip_weight * x + self.branch_weight * self.branch(x)


class _ClipGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, max_norm: float, record: Optional[Callable[[torch.Tensor], None]] = None):  # type: ignore[override]
        ctx.max_norm, ctx.record = max_norm, record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        norms = _per_example_norm(grad)
        if ctx.record is not None:
            ctx.record(norms)
        factor = torch.clamp(ctx.max_norm / norms.clamp_min(1e-30), max=1.0)
        return grad * _broadcast_per_example(factor, grad), None, None


class LossGradientClip(BoundedModule):
    """Identity forward; backward clips each example's gradient to norm ``C`` (SPEC §3.3).

    Placed after the logits it turns the loss bound ``L`` into ``min(L, C)``.
    """

    constants = ("max_norm",)

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = _positive_finite(max_norm, "max_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ClipGrad.apply(x, self.max_norm)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound, grad_cap=self.max_norm)

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}"


class AdaptiveLossGradientClip(BoundedModule):
    """Loss-gradient clipping whose norm ``C`` tracks a private quantile (Andrew et al., 2021).

    Backward clips each example's logit gradient to ``C`` (so ``L <- min(L, C)``,
    as :class:`LossGradientClip`) and counts the examples with
    ``||grad_z l|| <= C``.  After each private step, :meth:`update_` releases
    that count with Gaussian noise of std ``count_noise_multiplier`` (the count
    has add/remove sensitivity 1) and moves ``C`` geometrically towards the
    ``target_quantile``: ``C <- C exp(-lr (noisy_count / b - target_quantile))``
    with ``b`` the expected batch size.  The count is a second Gaussian
    mechanism on the same Poisson batch: the private optimizer composes it into
    ``sigma_eff = (sigma^-2 + count_noise_multiplier^-2)^(-1/2)`` at every step
    (SPEC §3.3-3.4).  ``C`` is a buffer, so checkpoints keep it.
    """

    constants = ("count_noise_multiplier", "target_quantile", "learning_rate")

    def __init__(
        self,
        initial_norm: float,
        count_noise_multiplier: float,
        target_quantile: float = 0.5,
        learning_rate: float = 0.2,
    ) -> None:
        super().__init__()
        _positive_finite(initial_norm, "initial_norm")
        self.count_noise_multiplier = _positive_finite(count_noise_multiplier, "count_noise_multiplier")
        if not 0.0 < target_quantile < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {target_quantile}")
        self.target_quantile = float(target_quantile)
        self.learning_rate = _positive_finite(learning_rate, "learning_rate")
        self.register_buffer("clip_norm", torch.tensor(float(initial_norm), dtype=torch.float64))
        self._below = 0  # examples of the current step with ||grad_z l|| <= C
        self._recording = True

    @property
    def max_norm(self) -> float:
        return float(self.clip_norm)

    def _record(self, norms: torch.Tensor) -> None:
        if self._recording:
            self._below += int((norms <= self.max_norm).sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ClipGrad.apply(x, self.max_norm, self._record)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound, grad_cap=self.max_norm)

    @torch.no_grad()
    def update_(self, expected_batch_size: float, generator: Optional[torch.Generator] = None) -> float:
        """Release the noisy count of this step, update ``C``, reset the count; returns the noisy fraction."""
        noise = torch.randn((), generator=generator, dtype=torch.float64, device=self.clip_norm.device)
        fraction = (self._below + self.count_noise_multiplier * float(noise)) / expected_batch_size
        self.clip_norm.mul_(math.exp(-self.learning_rate * (fraction - self.target_quantile)))
        self._below = 0
        return fraction

    @contextlib.contextmanager
    def counting_paused(self) -> Iterator[None]:
        """Backward passes inside do not enter the count (diagnostics such as the tightness monitor)."""
        previous, self._recording = self._recording, False
        try:
            yield
        finally:
            self._recording = previous

    def extra_repr(self) -> str:
        return (
            f"clip_norm={self.max_norm:.4g}, target_quantile={self.target_quantile}, "
            f"count_noise_multiplier={self.count_noise_multiplier}, learning_rate={self.learning_rate}"
        )


def adaptive_clips(model: nn.Module) -> list:
    """The :class:`AdaptiveLossGradientClip` layers of ``model`` (each adds a count mechanism to every step)."""
    return [m for m in model.modules() if isinstance(m, AdaptiveLossGradientClip)]
