"""Rounding-safe arithmetic of the privacy analysis: every norm the bounds use is an upper bound.

"Certified" means: computed in float64 from the (float32) weights and inflated by ``CERT_MARGIN``, which
covers float64 rounding of the norm itself (spec §2).  Robustness certificates of a trained model live
in :mod:`clipless.diagnostics.robustness`.
"""

from __future__ import annotations

import copy
import math
import numbers
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["CERT_MARGIN", "UNDERFLOW_MARGIN", "BoundError", "certified_spectral_norm", "certified_norm",
           "bjorck_residual", "certified_bjorck_step", "CertifiedValueCache", "Measure", "measured_matrix_norm",
           "start_probe", "power_step", "ieee_matmul", "ieee_convolutions",
           "is_real", "is_whole", "whole_number", "check_flag"]

# Relative safety margin applied to norms computed in float64 from float32
# weights: float64 SVD is backward-stable to ~1e-15 relative, so 1e-9 is a
# generous certified margin that never matters for utility.
CERT_MARGIN = 1.0 + 1e-9

# Absolute margin added to every per-example bound and clip norm that sets a sensitivity.  Below float32's normal
# range (2^-126) rounding is absolute, up to 2^-150 per product (gradual underflow), not relative: at a loss-gradient
# clip of 1e-44 the per-example gradients came out 1.1-3.2x their bounds, at a Naive-DP clip of 1e-44 the clipped
# gradient 1.2x its norm.  2^40 such errors per example, each amplified 2^45-fold by the layers' constants, stay below
# 2^-65; in the normal range the term is below float64's resolution of any bound above 1e-3.
UNDERFLOW_MARGIN = 2.0 ** -64


def is_real(value: Any) -> bool:
    """A real number that is not a bool: ``True`` would read as 1 wherever a constant, a rate or a size is given."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_whole(value: Any) -> bool:
    """An integer that is not a bool (``True`` would read as 1 step, class or width)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole_number(value: int, name: str, minimum: int = 1) -> int:
    """An integer constant (a width, a kernel size, a class count) ``>= minimum``: ``2.5`` classes would have
    declared ``sqrt(2.5/1.5)`` for a loss computed with 2, ``True`` would read as 1."""
    if not is_whole(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_flag(value: Any, name: str, optional: bool = False) -> Optional[bool]:
    """A switch as given (``None`` too where ``optional``: the default decides), refused unless a bool: ``"no"`` or
    ``0.5`` would read as a choice, and ``log_train_stats="no"`` as the opt-in to release statistics without noise."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise ValueError(f"{name} must be True or False{' (or None)' if optional else ''}, got {value!r}")
    return value


class BoundError(ValueError):
    """A model, loss or input for which no sound privacy bound can be given."""


class DeclaredConstants:
    """Attributes listed in ``constants`` are set once, in ``__init__``, then read-only.

    The bounds trust them (an input clip's radius, a loss's temperature, a count's noise multiplier):
    changing one after the bounds or the noise plan were computed would silently void them.
    """

    constants: Tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).constants and name in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__}.{name} is a declared constant of the privacy analysis; "
                f"build a new {type(self).__name__} instead of changing it")
        super().__setattr__(name, value)

    def declared_values(self) -> Tuple[Tuple[str, Any], ...]:
        """``(name, value)`` of every declared constant, as read now: a value written into the instance's
        ``__dict__`` passes the read-only guard, so whoever relies on them compares this with a snapshot."""
        return tuple((name, getattr(self, name, None)) for name in type(self).constants)

    def record_declared(self) -> None:
        """Remember the declared constants' values now (the end of ``__init__``), for :meth:`declared_changes`."""
        self._recorded_values = self.declared_values()

    def declared_changes(self) -> List[str]:
        """The declared constants whose value is no longer the one :meth:`record_declared` saw."""
        return [name for (name, now), (_, then) in zip(self.declared_values(), self._recorded_values)
                if now is not then and now != then]

    def check_declared(self, owner: str, consequence: str) -> None:
        """Refuse, naming them, declared constants changed since :meth:`record_declared` (``owner``: who holds them,
        ``consequence``: what would be wrong)."""
        changed = self.declared_changes()
        if changed:
            raise BoundError(f"{owner}'s {', '.join(changed)} changed after it was built (written past its read-only "
                             f"guard): {consequence}")


def certified_spectral_norm(matrix: torch.Tensor, shortcut: bool = True) -> float:
    """Certified upper bound on ``||matrix||_2`` (largest singular value).

    ``sqrt(lambda_max(A A^T))`` with the Gram matrix of the smaller side and a
    symmetric eigensolver, both in float64, plus a 1e-9 relative margin: exact
    up to float64 rounding, never a power-iteration estimate (which converges
    from below).  ``shortcut=False`` always runs the eigensolver (the tightest value, to check a claimed bound).
    """
    if matrix.dim() != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(matrix.shape)}")
    a = matrix.detach().to(torch.float64)
    gram = a @ a.T if a.shape[0] <= a.shape[1] else a.T @ a
    # Near-orthonormal weights (what the Björck projection keeps): lambda_max(G) <= 1 + ||G - I||_2
    # <= 1 + ||G - I||_F, which skips the eigensolver.  The float64 Gram of float32 entries has exact
    # products and summation error <= (k + 2) u ||A||_F^2 in Frobenius norm (k = the summed length).
    residual = gram.clone()
    residual.diagonal().sub_(1.0)
    frobenius = torch.linalg.vector_norm(residual).item()
    if not math.isfinite(frobenius):  # a NaN or infinite weight reaches every Gram entry of its row
        raise BoundError("weight matrix contains NaN or infinite values")
    rounding = (max(a.shape) + 2) * torch.finfo(torch.float64).eps * float((a * a).sum()) * 1.01
    if shortcut and frobenius < 1e-2:
        return math.sqrt(1.0 + frobenius + rounding) * CERT_MARGIN
    # The Gram's rounding is added here too: relative to lambda_max it can reach about k u rank(A) (u = eps / 2)
    # when the singular values are all alike, 3.7e-9 for a 4096 x 8192 weight, more than the margin covers.
    value = math.sqrt(max(torch.linalg.eigvalsh(gram)[-1].item() + rounding, 0.0))
    return value * CERT_MARGIN


def certified_norm(tensor: torch.Tensor) -> float:
    """Certified upper bound on the Euclidean norm of a tensor (float64 + margin)."""
    value = torch.linalg.vector_norm(tensor.detach().to(torch.float64)).item()
    if not math.isfinite(value):
        raise BoundError("tensor contains NaN or infinite values")
    return value * CERT_MARGIN


def _gamma(k: int, unit_roundoff: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative error bound of a length-``k`` dot product in any order."""
    ku = k * unit_roundoff
    if ku >= 0.5:
        raise BoundError(f"a dot product of length {k} is too long for a rounding bound at u = {unit_roundoff}")
    return ku / (1.0 - ku)


def _fp32_precision(*backends: Any) -> str:
    """The first ``fp32_precision`` set along a backend's chain (operator, backend, ``torch.backends``): ``"none"``
    on a level means "as the level above"; ``"none"`` at every level (or no such attribute) is returned as is."""
    for backend in backends:
        value = getattr(backend, "fp32_precision", "none") if backend is not None else "none"
        if value != "none":
            return value
    return "none"


def _reduced(read: Callable[[], Any]) -> bool:
    """A legacy precision setting's answer ("reduced precision?"); torch refuses to read one once the new API has set
    mixed values, which is read as reduced."""
    try:
        return bool(read())
    except RuntimeError:
        return True


def _mkldnn_ieee(operator: str) -> bool:
    mkldnn = torch.backends.mkldnn
    return _fp32_precision(getattr(mkldnn, operator, None), mkldnn, torch.backends) in ("none", "ieee")


def ieee_matmul(device: torch.device) -> bool:
    """Whether float32 matrix products on ``device`` are IEEE float32 (no TF32 or bfloat16 internals)."""
    if _reduced(lambda: torch.get_float32_matmul_precision() != "highest"):
        return False
    if device.type == "cuda":
        backend = torch.backends.cuda.matmul
        if _reduced(lambda: getattr(backend, "allow_tf32", False)):
            return False
        return _fp32_precision(backend, torch.backends) in ("none", "ieee")
    return device.type == "cpu" and _mkldnn_ieee("matmul")


def ieee_convolutions(device: torch.device) -> bool:
    """Whether float32 convolutions on ``device`` are IEEE float32.  On CUDA, cuDNN runs them in TF32 (10-bit
    mantissa) unless told otherwise: ``torch.backends.cudnn.conv.fp32_precision = "ieee"`` (or, before torch 2.9,
    ``torch.backends.cudnn.allow_tf32 = False``)."""
    if device.type == "cuda":
        cudnn = torch.backends.cudnn
        conv = getattr(cudnn, "conv", None)
        if conv is not None and hasattr(conv, "fp32_precision"):
            return _fp32_precision(conv, cudnn, torch.backends) == "ieee"
        return not _reduced(lambda: cudnn.allow_tf32)
    return device.type == "cpu" and _mkldnn_ieee("conv")


@torch.no_grad()
def bjorck_residual(matrix: torch.Tensor) -> torch.Tensor:
    """``W W^T - I`` in float64 (exact products for float32 weights), the input of ``certified_bjorck_step``."""
    if matrix.dim() != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(matrix.shape)}")
    a = matrix.detach().to(torch.float64)
    residual = a @ a.T
    residual.diagonal().sub_(1.0)
    return residual


@torch.no_grad()
def certified_bjorck_step(matrix: torch.Tensor, residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, float]:
    """One Björck step ``W' = W - (W W^T - I) W / 2`` and a certified upper bound on ``||W'||_2``.

    In exact arithmetic the singular values of ``W'`` are ``f(s) = 1.5 s - 0.5 s^3`` of those of ``W``, and
    ``|f(s)| <= 1`` for ``0 <= s <= 2``.  ``W W^T - I`` is formed in float64 (float32 products are exact
    there), so the bound is ``1`` plus Higham's worst-case rounding terms, each a Frobenius norm:
    ``||W'||_2 <= 1 + ||dR||_F ||W||_2 / 2 + gamma_n ||R||_F ||W||_F / 2 + gamma_2 (||W||_F + ||T||_F / 2)``
    (``dR`` the error of the residual used, ``T = R W``), plus an absolute term for underflow.  This costs
    ``O(nm)`` beyond the step; where the premise ``||W||_2 <= 2`` cannot be shown, or the matrix product is
    not IEEE (TF32, bfloat16 internals, other dtypes), the bound is ``certified_spectral_norm(W')``.
    Rows of ``matrix`` are orthonormalized: pass the wide orientation (rows <= columns) for the small Gram.
    ``residual``: ``bjorck_residual(matrix)`` of this very matrix, where the caller has computed it already.
    """
    if residual is None:
        residual = bjorck_residual(matrix)
    w = matrix.detach()
    n, m = w.shape
    if residual.shape != (n, n) or residual.dtype != torch.float64:
        raise ValueError("residual must be bjorck_residual(matrix)")
    r_norm = torch.linalg.vector_norm(residual).item()
    if not math.isfinite(r_norm):  # a NaN or infinite weight reaches every residual entry of its row
        raise BoundError("weight matrix contains NaN or infinite values")
    t = residual.to(w.dtype) @ w
    result = torch.add(w, t, alpha=-0.5)
    if w.dtype not in (torch.float32, torch.float64) or not ieee_matmul(w.device):
        return result, certified_spectral_norm(result)
    u64 = torch.finfo(torch.float64).eps / 2
    u = torch.finfo(w.dtype).eps / 2
    # ||W||_F^2 = trace(W W^T) = trace(R) + n, up to the Gram's relative rounding and that of subtracting and
    # adding back the n ones (absolute, <= gamma * 2n): no second pass over W
    g = _gamma(m + n + 2, u64)
    w_norm = math.sqrt(max(float(residual.diagonal().sum()) + n, 0.0) * (1 + g) + 2 * n * g)
    tiny = 2.0 ** -120 * (1.0 + w_norm) * (n + m) * math.sqrt(n * m)  # underflow (subnormals or flush-to-zero)
    gram_error = _gamma(m + 1, u64) * w_norm**2  # |G~ - W W^T| <= gamma |W||W^T| entrywise
    # the residual used: float64 subtraction of I, then rounding to the weight's dtype
    residual_error = gram_error + (u64 + u) * r_norm + tiny
    squared_top = 1.0 + r_norm + gram_error + u64 * r_norm + tiny  # lambda_max(W W^T) <= 1 + ||R||_2
    if squared_top > 4.0 * (1 - 1e-6):
        return result, certified_spectral_norm(result)
    used_norm = (1.0 + u) * r_norm + tiny  # ||R used||_F: R64 rounded to the weight's dtype
    product_error = _gamma(n, u) * used_norm * w_norm + tiny  # |fl(R W) - R W| <= gamma_n |R||W|
    t_norm = used_norm * math.sqrt(squared_top) + product_error  # ||fl(R W)||_F
    add_error = _gamma(2, u) * (w_norm + 0.5 * t_norm) + tiny  # the one rounding of W - T / 2
    slack = 0.5 * residual_error * math.sqrt(squared_top) + 0.5 * product_error + add_error
    return result, (1.0 + slack) * CERT_MARGIN


# ``measure(tensor, key, probe) -> (lower, next_probe)``: a lower bound on the operator norm that a value put for
# ``tensor`` and ``key`` certifies, from one step of power iteration on ``probe`` (``None``: start afresh).
Measure = Callable[[torch.Tensor, Any, Optional[torch.Tensor]], Tuple[float, Optional[torch.Tensor]]]


class _Entry:
    """What a cache holds (kept in :data:`_HELD`, not on the cache): the tensor's copy, the key, the value, how a
    value is checked from below, and that check's probe."""

    __slots__ = ("tensor", "key", "value", "measure", "probe")

    def __init__(self) -> None:
        self.tensor: Optional[torch.Tensor] = None
        self.key: Any = None
        self.value = 0.0
        self.measure: Optional[Measure] = None
        self.probe: Optional[torch.Tensor] = None


# The caches' entries, by cache.  Held here rather than as attributes of the cache, which is an attribute of a
# layer: a write to ``layer._norm_cache._value`` would otherwise pass a smaller certificate for the same weights.
_HELD: "weakref.WeakKeyDictionary[CertifiedValueCache, _Entry]" = weakref.WeakKeyDictionary()

# How far below a matrix's measured norm (||W^T u|| / ||u|| <= ||W||_2, in float64: rounding below 1e-12 of it for
# any weight of up to 10^6 rows) a value may be and still be taken for a certificate of it; far above the rounding,
# far below a smaller claim of any consequence.
_BELOW_MEASURED = 1e-6


def start_probe(shape: Tuple[int, ...], probe: Optional[torch.Tensor], device: Any) -> torch.Tensor:
    """``probe`` where it has ``shape`` (float64, on ``device``), else a fixed Gaussian start."""
    if probe is not None and tuple(probe.shape) == tuple(shape) and probe.device == torch.device(device):
        return probe
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)


def power_step(measured: float, back: torch.Tensor) -> Tuple[float, Optional[torch.Tensor]]:
    """``measured`` (0 where not finite) and the next probe, ``back`` (``A^T A x``) normalized."""
    norm = float(torch.linalg.vector_norm(back))
    nxt = back / norm if math.isfinite(norm) and norm > 0 else None
    return (measured if math.isfinite(measured) else 0.0), nxt


def measured_matrix_norm(matrix: torch.Tensor, key: Any, probe: Optional[torch.Tensor]
                         ) -> Tuple[float, Optional[torch.Tensor]]:
    """A lower bound on ``||matrix||_2`` (:data:`Measure`): ``||W^T u|| / ||u||`` for the probe ``u`` on the smaller
    side, in float64; the next probe is ``W W^T u``, so it tracks the top singular vector as the weights move.  For
    orthonormal rows (Björck), any ``u`` gives the norm itself."""
    w = matrix.detach().to(torch.float64)
    if w.shape[0] > w.shape[1]:
        w = w.T
    u = start_probe((w.shape[0],), probe, w.device)
    v = w.T @ u
    u_norm = float(torch.linalg.vector_norm(u))
    return power_step(float(torch.linalg.vector_norm(v)) / u_norm if u_norm > 0 else 0.0, w @ v)


class CertifiedValueCache:
    """A certified value remembered for one exact tensor and key.

    Any change of the tensor (compared element by element, so in-place updates through ``.data``
    are seen too) or of the key invalidates it: a cached bound is never used for other weights.  A value is checked
    from below when it is put, by ``measure`` (given by the layer at construction; for a matrix by default
    :func:`measured_matrix_norm`): one below the operator's measured norm is no certificate of it, and is refused.
    """

    def __init__(self, measure: Optional[Measure] = None) -> None:
        self._entry().measure = measure

    def _entry(self) -> _Entry:
        entry = _HELD.get(self)
        if entry is None:
            entry = _HELD[self] = _Entry()
        return entry

    def __deepcopy__(self, memo: Dict[int, Any]) -> "CertifiedValueCache":  # a copied layer copies its certificate
        entry = self._entry()
        copied = CertifiedValueCache(entry.measure)
        new = copied._entry()
        new.tensor = None if entry.tensor is None else entry.tensor.clone()
        new.key, new.value = copy.deepcopy(entry.key, memo), entry.value
        return copied

    def __getstate__(self) -> Dict[str, Any]:  # pickled with its layer (torch.save of a whole model)
        entry = self._entry()
        return {"tensor": entry.tensor, "key": entry.key, "value": entry.value, "measure": entry.measure}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._entry().measure = state.get("measure")
        tensor, key, value = state.get("tensor"), state.get("key"), state.get("value", 0.0)
        if isinstance(tensor, torch.Tensor) and is_real(value):
            self.put(tensor, key, float(value))  # checked as any other value put

    def get(self, tensor: torch.Tensor, key: Any) -> Optional[float]:
        entry = self._entry()
        t = entry.tensor
        if t is None or key != entry.key or t.shape != tensor.shape or not torch.equal(t, tensor.detach()):
            return None
        return entry.value

    def put(self, tensor: torch.Tensor, key: Any, value: float) -> float:
        entry = self._entry()
        value = float(value)
        measure = entry.measure or (measured_matrix_norm if tensor.dim() == 2 else None)
        if measure is not None and tensor.is_floating_point() and tensor.numel():
            measured, entry.probe = measure(tensor, key, entry.probe)
            if not value >= measured * (1 - _BELOW_MEASURED):  # "not >=": a NaN value is refused too
                raise BoundError(f"a certificate {value:.6g} was put for a weight whose operator norm is at least "
                                 f"{measured:.6g}: it is not an upper bound (a cached certificate set by hand?); the "
                                 "layers' certificates come from their own projection and bound computations only")
        entry.tensor, entry.key, entry.value = tensor.detach().clone(), key, value
        return entry.value

    def state(self, tensor: torch.Tensor) -> Dict[str, Any]:
        """The certificate held for ``tensor`` as it is now, for a checkpoint (``{}`` when none is held)."""
        entry = self._entry()
        if self.get(tensor, entry.key) is None:
            return {}
        return {"key": entry.key, "value": entry.value}

    def restore(self, tensor: torch.Tensor, state: Dict[str, Any], certify: Callable[[Any], float]) -> None:
        """Put back a checkpoint's certificate, never below ``certify(key)`` (recomputed from ``tensor`` alone).

        A stored value is an untrusted claim: one below the fresh certificate (tampered, or from other
        weights) is replaced by it; a genuine one (at least as large, e.g. the Björck step's certificate) is
        kept exactly, so a resumed run adds the same noise as the uninterrupted run, bit for bit.
        """
        if not state:
            return
        key, value = state["key"], float(state["value"])
        fresh = certify(key)
        self.put(tensor, key, value if value >= fresh else fresh)  # ">=": a NaN claim is replaced too
