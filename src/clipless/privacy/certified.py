"""Rounding-safe arithmetic of the privacy analysis: every norm the bounds use is an upper bound.

"Certified" means: computed in float64 from the (float32) weights and inflated by ``CERT_MARGIN``, which
covers float64 rounding of the norm itself (spec §2).  Robustness certificates of a trained model live
in :mod:`clipless.diagnostics.robustness`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["CERT_MARGIN", "BoundError", "certified_spectral_norm", "certified_norm", "CertifiedValueCache"]

# Relative safety margin applied to norms computed in float64 from float32
# weights: float64 SVD is backward-stable to ~1e-15 relative, so 1e-9 is a
# generous certified margin that never matters for utility.
CERT_MARGIN = 1.0 + 1e-9


class BoundError(ValueError):
    """A model, loss or input for which no sound privacy bound can be given."""


def certified_spectral_norm(matrix: torch.Tensor) -> float:
    """Certified upper bound on ``||matrix||_2`` (largest singular value).

    ``sqrt(lambda_max(A A^T))`` with the Gram matrix of the smaller side and a
    symmetric eigensolver, both in float64, plus a 1e-9 relative margin: exact
    up to float64 rounding, never a power-iteration estimate (which converges
    from below).
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
    if frobenius < 1e-2:
        rounding = (max(a.shape) + 2) * torch.finfo(torch.float64).eps * float((a * a).sum()) * 1.01
        return math.sqrt(1.0 + frobenius + rounding) * CERT_MARGIN
    value = math.sqrt(max(torch.linalg.eigvalsh(gram)[-1].item(), 0.0))
    return value * CERT_MARGIN


def certified_norm(tensor: torch.Tensor) -> float:
    """Certified upper bound on the Euclidean norm of a tensor (float64 + margin)."""
    value = torch.linalg.vector_norm(tensor.detach().to(torch.float64)).item()
    if not math.isfinite(value):
        raise BoundError("tensor contains NaN or infinite values")
    return value * CERT_MARGIN


class CertifiedValueCache:
    """A certified value remembered for one exact tensor and key.

    Any change of the tensor (compared element by element, so in-place updates through ``.data``
    are seen too) or of the key invalidates it: a cached bound is never used for other weights.
    """

    def __init__(self) -> None:
        self._tensor: Optional[torch.Tensor] = None
        self._key: Any = None
        self._value = 0.0

    def get(self, tensor: torch.Tensor, key: Any) -> Optional[float]:
        t = self._tensor
        if t is None or key != self._key or t.shape != tensor.shape or not torch.equal(t, tensor.detach()):
            return None
        return self._value

    def put(self, tensor: torch.Tensor, key: Any, value: float) -> float:
        self._tensor, self._key, self._value = tensor.detach().clone(), key, float(value)
        return self._value


