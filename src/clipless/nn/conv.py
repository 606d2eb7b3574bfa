"""``LipschitzConv2d``: a convolution with a certified operator norm (reshaped-kernel or FFT bound, spec §2)."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..privacy.certified import (
    CERT_MARGIN,
    BoundError,
    CertifiedValueCache,
    certified_spectral_norm,
    power_step,
    start_probe,
    whole_number,
)
from ..privacy.modules import BoundedModule, LayerBound
from .functional import (affine_layer_bound, bjorck_orthonormalize, check_bias_bound, check_projection, clip_norm_,
                         project_matrix_)

__all__ = ["LipschitzConv2d", "OrthogonalConv2d", "fft_operator_norm"]


def _pair(v: Union[int, Sequence[int]], name: str) -> Tuple[int, int]:
    if isinstance(v, (tuple, list)) and len(v) == 2:
        return whole_number(v[0], name), whole_number(v[1], name)
    return whole_number(v, name), whole_number(v, name)


class LipschitzConv2d(BoundedModule):
    """2-D convolution with a certified operator-norm bound (spec §2, §2.1).

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

    runs_convolutions = True  # the input guard checks that float32 convolutions are IEEE (not TF32)

    constants = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "padding_mode", "operator_norm",
                 "projection", "bias_bound", "overlap", "_norm_cache")

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
        kh, kw = _pair(kernel_size, "kernel_size")
        stride = whole_number(stride, "stride")
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
        self.in_channels = whole_number(in_channels, "in_channels")
        self.out_channels = whole_number(out_channels, "out_channels")
        self.kernel_size, self.stride, self.padding, self.padding_mode = (kh, kw), stride, pad, padding_mode
        self.projection = check_projection(projection)
        self.bjorck_iters = whole_number(bjorck_iters, "bjorck_iters")
        self.bias_bound = check_bias_bound(bias_bound)
        # Shape-free default used until the input size is seen (exact for zero padding on large inputs).
        self.overlap = math.ceil(kh / stride) * math.ceil(kw / stride)
        self._spatial: Optional[Tuple[int, int]] = None
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kh, kw))
        nn.init.orthogonal_(self.weight.view(out_channels, -1))
        with torch.no_grad():
            self.weight.div_(math.sqrt(self.overlap))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        # each certificate is checked from below by this very convolution (a plain function of the settings: the cache
        # must not hold the layer); "_norm_cache" is a declared constant, so no cache without it can replace this one
        self._norm_cache = CertifiedValueCache(functools.partial(
            _measured_operator_norm, stride=stride, padding=pad, circular=padding_mode == "circular"))

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
        return _overlap(in_shape, self.kernel_size, self.stride, self.padding, self.padding_mode == "circular")

    def fft_operator_norm(self, in_shape: Tuple[int, ...]) -> float:
        """Certified operator norm of this layer from the exact singular values of a circular convolution
        (:func:`fft_operator_norm`)."""
        return fft_operator_norm(self.weight, in_shape, self.padding, self.stride, self.padding_mode == "circular")

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
        return self._norm_cache.put(self.weight, key, self._fresh_lipschitz(key))

    def _fresh_lipschitz(self, key: Tuple[str, Tuple[int, int]]) -> float:
        operator_norm, in_shape = key
        value = math.sqrt(self.overlap_for(in_shape)) * certified_spectral_norm(self._kernel_matrix())
        if operator_norm == "fft":
            value = min(value, self.fft_operator_norm(in_shape))
        return value

    def get_extra_state(self) -> dict:
        return {"weight_bound": self._norm_cache.state(self.weight)}

    def set_extra_state(self, state: dict) -> None:
        self._norm_cache.restore(self.weight, state.get("weight_bound", {}), self._fresh_lipschitz)

    @torch.no_grad()
    def project_(self) -> None:
        if self.operator_norm == "fft" and self._spatial is not None:
            # spectral normalisation to operator norm 1 (norm preserving, like orthogonal dense layers)
            shape = self._spatial
            key = ("fft", tuple(shape))
            norm = self._norm_cache.get(self.weight, key)
            if norm is None:  # not cached (nor checked from below): the weights change right below
                norm = self._fresh_lipschitz(key)
            frobenius = torch.linalg.vector_norm(self.weight.detach().to(torch.float64)).item()
            self.weight.div_(norm)
            # The stored kernel is W/norm + E with |E| <= 2 eps |W|/norm elementwise (rounding of the
            # division, or of a reciprocal multiplication, and of norm itself), so its operator norm is
            # at most 1 + sqrt(s) ||E||_F (reshaped-kernel bound applied to the linear map of E).
            # This certifies the projected weights without a second FFT per step.
            rounding = 2 * torch.finfo(self.weight.dtype).eps * frobenius / norm
            self._norm_cache.put(self.weight, key, (1.0 + math.sqrt(self.overlap_for(shape)) * rounding) * CERT_MARGIN)
        else:
            overlap = self.overlap_for(self._spatial) if self._spatial is not None else self.overlap
            matrix = project_matrix_(self._kernel_matrix(), self.projection, math.sqrt(overlap), self.bjorck_iters)
            self.weight.copy_(matrix.reshape(self.weight.shape))
        if self.bias is not None:
            clip_norm_(self.bias, self.bias_bound)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        root_s = math.sqrt(self.overlap_for(in_shape))
        lip = self.certified_lipschitz(in_shape)
        return affine_layer_bound(lip, x_bound, root_s * x_bound, self.bias, self.output_positions(in_shape))

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, padding_mode={self.padding_mode}, bias={self.bias is not None}"
        )


class OrthogonalConv2d(BoundedModule):
    """Orthogonal ``k x k`` convolution, block-convolution orthogonal parametrization (BCOP, Li et al. 2019).

    The kernel is the composition ``K = H * R_1 * ... * R_{k-1} * C_1 * ... * C_{k-1}`` of a ``1 x 1`` kernel
    ``H`` (an orthogonal ``c x c`` matrix) and two-tap kernels ``[P_i, I - P_i]`` along the height (``R_i``) and
    the width (``C_i``), with ``P_i = Q_i^T Q_i`` (``Q_i``: ``m x c``, orthonormal rows, ``m = max(1, c // 2)``).
    Each factor's frequency response is unitary (``P + (I - P) e^{iw}`` for a projector ``P``), so ``K`` is
    orthogonal on the torus: with ``padding_mode='circular'`` the layer preserves norms (gradient-norm
    preserving), with zero padding its operator norm is <= 1.  ``c = max(in, out)``; the kernel is cut to
    ``(out, in)`` (an isometric embedding when ``in < out``, a projection when ``in > out``).

    Bounds (spec §2): ``l`` is the FFT operator norm of the built kernel (:func:`fft_operator_norm`, certified,
    not taken from the algebra).  For the parameters, ``||grad_K||_F <= sqrt(s) X G`` as for any stride-1
    convolution, and by Parseval ``||kernel(A * D * B)||_F <= ||A||_inf ||kernel(D)||_F ||B||_inf`` with
    ``||F||_inf = sup_w ||F(w)||_2``; a two-tap factor has ``||F||_inf <= max(1, 2 ||Q||_2^2 - 1)`` and
    ``||dP||_F <= 2 ||Q||_2 ||dQ||_F``.  Hence the factors ``sqrt(s) X prod_j l_j`` for ``H`` and
    ``2 sqrt(2) ||Q_i||_2 ||H||_2 prod_{j != i} l_j sqrt(s) X`` for ``Q_i``, from certified norms of the
    stored (not necessarily projected) parameters.  ``project_`` orthonormalizes ``H`` and every ``Q_i`` (Björck).
    ``train_projectors=False`` keeps the ``Q_i`` fixed (buffers): the noise then goes to ``H`` alone, whose bound is
    much closer to its gradients than the ``Q_i``'s (docs/results.md).
    """

    runs_convolutions = True  # the input guard checks that float32 convolutions are IEEE (not TF32)

    constants = ("in_channels", "out_channels", "kernel_size", "padding_mode")

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, padding_mode: str = "zeros",
                 bjorck_iters: int = 30, train_projectors: bool = True) -> None:
        super().__init__()
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd positive integer (stride 1, 'same' padding), "
                             f"got {kernel_size!r}")
        if padding_mode not in ("zeros", "circular"):
            raise ValueError("padding_mode must be 'zeros' or 'circular'")
        self.in_channels = whole_number(in_channels, "in_channels")
        self.out_channels = whole_number(out_channels, "out_channels")
        self.kernel_size, self.padding_mode = kernel_size, padding_mode
        self.bjorck_iters = whole_number(bjorck_iters, "bjorck_iters")
        c = max(self.in_channels, self.out_channels)
        rank = max(1, c // 2)
        self.mix = nn.Parameter(nn.init.orthogonal_(torch.empty(c, c)))
        self._blocks = [f"{axis}{i}" for axis in ("row", "col") for i in range(kernel_size - 1)]
        for name in self._blocks:
            q = nn.init.orthogonal_(torch.empty(rank, c))
            if train_projectors:
                self.register_parameter(name, nn.Parameter(q))
            else:  # fixed random spatial mixing: only H learns, and no noise is spent on the Q_i
                self.register_buffer(name, q)

    def kernel(self) -> torch.Tensor:
        """The ``(out, in, k, k)`` kernel built from the factors (differentiable)."""
        c = self.mix.shape[0]
        eye = torch.eye(c, dtype=self.mix.dtype, device=self.mix.device)
        kernel = self.mix.reshape(c, c, 1, 1)
        for name in self._blocks:
            q = getattr(self, name)
            projector = q.T @ q
            taps = torch.stack([projector, eye - projector], dim=2)  # (c, c, 2)
            kernel = _compose(kernel, taps.unsqueeze(3) if name.startswith("row") else taps.unsqueeze(2))
        return kernel[: self.out_channels, : self.in_channels]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.kernel_size // 2
        if self.padding_mode == "circular":
            return F.conv2d(F.pad(x, (pad, pad, pad, pad), mode="circular"), self.kernel())
        return F.conv2d(x, self.kernel(), padding=pad)

    def certified_lipschitz(self, in_shape: Tuple[int, ...]) -> float:
        """``l``: the FFT operator norm of the built kernel (float64, certified)."""
        pad = self.kernel_size // 2
        with torch.no_grad():
            kernel = self.kernel()
        return fft_operator_norm(kernel, in_shape, (pad, pad), 1, self.padding_mode == "circular")

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        lip = self.certified_lipschitz(in_shape)
        k, pad = self.kernel_size, self.kernel_size // 2
        root = math.sqrt(_overlap(in_shape, (k, k), 1, (pad, pad), self.padding_mode == "circular")) * x_bound
        mix_norm = certified_spectral_norm(self.mix)
        norms = [certified_spectral_norm(getattr(self, name)) for name in self._blocks]
        tap_bounds = [max(1.0, 2.0 * n * n - 1.0) * CERT_MARGIN for n in norms]
        factors = {"mix": math.prod(tap_bounds) * root}
        trained = {name for name, _ in self.named_parameters(recurse=False)}
        for i, name in enumerate(self._blocks):
            if name not in trained:
                continue
            others = math.prod(tap_bounds[:i] + tap_bounds[i + 1:])
            factors[name] = 2.0 * math.sqrt(2.0) * norms[i] * mix_norm * others * root * CERT_MARGIN
        return LayerBound(lipschitz=lip, out_bound=lip * x_bound, param_factors=factors)

    @torch.no_grad()
    def project_(self) -> None:
        for _, param in self.named_parameters(recurse=False):
            param.copy_(bjorck_orthonormalize(param, self.bjorck_iters)[0])

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"padding_mode={self.padding_mode}")


def _compose(outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """The kernel of ``outer`` applied after ``inner`` (cross-correlations): ``K[v] = sum_{t+u=v} A[t] B[u]``."""
    oh, ow = outer.shape[-2:]
    ih, iw = inner.shape[-2:]
    out = outer.new_zeros(outer.shape[0], inner.shape[1], oh + ih - 1, ow + iw - 1)
    for i in range(ih):
        for j in range(iw):
            out[:, :, i:i + oh, j:j + ow] = out[:, :, i:i + oh, j:j + ow] + torch.einsum(
                "omhw,mi->oihw", outer, inner[:, :, i, j])
    return out


def fft_operator_norm(kernel: torch.Tensor, in_shape: Tuple[int, ...], padding: Tuple[int, int], stride: int,
                      circular: bool) -> float:
    """Certified operator norm of a convolution from the exact singular values of a circular one (Sedghi et al.).

    Zero padding: the layer is crop o (circular conv on the padded size ``n + 2p``) o zero-embedding, and
    striding is a sub-sampling, both of norm <= 1.  Circular padding on the input size ``n``, times
    ``sqrt(m)`` where ``m`` counts outputs that repeat one another when the output is longer than the input.
    Computed in float64.
    """
    h, w = in_shape[-2], in_shape[-1]
    c_out, c_in, kh, kw = kernel.shape
    (ph, pw), st = padding, stride
    nh, nw = (h, w) if circular else (h + 2 * ph, w + 2 * pw)
    kernel = kernel.detach().to(torch.float64)
    if kh > nh or kw > nw:  # the kernel wraps around the circle: fold it first
        full = torch.zeros(c_out, c_in, nh, nw, dtype=torch.float64, device=kernel.device)
        for i in range(kh):
            for j in range(kw):
                full[:, :, i % nh, j % nw] += kernel[:, :, i, j]
        kernel = full
    # A real kernel's spectrum is conjugate-symmetric (A(-f) = conj A(f), same singular values): the
    # half spectrum of rfft2 holds every singular value.  Per frequency, the top eigenvalue of the
    # smaller Gram matrix is the squared spectral norm.
    # contiguous: a batched product over the permuted view runs 9x slower (no BLAS batch layout)
    spectrum = torch.fft.rfft2(kernel, s=(nh, nw)).permute(2, 3, 0, 1).reshape(-1, c_out, c_in).contiguous()
    gram = spectrum.mH @ spectrum if c_in <= c_out else spectrum @ spectrum.mH
    top = torch.linalg.eigvalsh(gram)[..., -1].max().item()
    norm = math.sqrt(max(top, 0.0)) if math.isfinite(top) else math.nan
    if not math.isfinite(norm):
        raise BoundError("convolution kernel contains NaN or infinite values")
    repeats = 1
    if circular:
        out_h, out_w = (h + 2 * ph - kh) // st + 1, (w + 2 * pw - kw) // st + 1
        repeats = _max_repeats(h, out_h, st) * _max_repeats(w, out_w, st)
    return norm * math.sqrt(repeats) * (1 + 1e-7)


def _measured_operator_norm(kernel: torch.Tensor, key: Any, probe: Optional[torch.Tensor], stride: int,
                            padding: Tuple[int, int], circular: bool) -> Tuple[float, Optional[torch.Tensor]]:
    """A lower bound on the operator norm of the convolution by ``kernel`` on inputs of ``key``'s spatial shape
    (:data:`~clipless.privacy.certified.Measure`; key ``(mode, (H, W))``): ``||A x|| / ||x||`` in float64, for the
    probe ``x`` that one power-iteration step per call (``x <- A^T A x``) moves to the top direction."""
    shape = key[1] if isinstance(key, tuple) and len(key) == 2 else None
    if not (isinstance(shape, tuple) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        return 0.0, None  # a key no bound reads: nothing to check
    k = kernel.detach().to(torch.float64)
    x = start_probe((1, k.shape[1]) + shape, probe, k.device).detach().requires_grad_(True)
    ph, pw = padding
    with torch.enable_grad():
        y = (F.conv2d(F.pad(x, (pw, pw, ph, ph), mode="circular"), k, stride=stride) if circular
             else F.conv2d(x, k, stride=stride, padding=padding))
        (back,) = torch.autograd.grad(y, x, y)
    x_norm = float(torch.linalg.vector_norm(x.detach()))
    return power_step(float(torch.linalg.vector_norm(y.detach())) / x_norm if x_norm > 0 else 0.0, back)


def _overlap(in_shape: Tuple[int, ...], kernel_size: Tuple[int, int], stride: int, padding: Tuple[int, int],
             circular: bool) -> int:
    """Exact ``s`` of a 2-D convolution: the product of the 1-D maxima of :func:`_max_reads`."""
    return (_max_reads(in_shape[-2], kernel_size[0], stride, padding[0], circular)
            * _max_reads(in_shape[-1], kernel_size[1], stride, padding[1], circular))


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


