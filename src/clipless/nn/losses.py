"""Losses with a declared Lipschitz constant ``L`` w.r.t. the logits (spec §3.1).

Every loss is defined *per example* (no batch statistics), so the gradient of
each example's loss w.r.t. its own logits has norm ``<= lipschitz``.  The
trainer sums :meth:`LipschitzLoss.per_example` over the batch; ``forward``
applies ``reduction`` for reporting.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F

from ..privacy.certified import BoundError, whole_number
from ..privacy.modules import LipschitzLoss
from ..privacy.accounting import check_positive_finite
from .functional import finite_at_least

__all__ = [
    "TauCrossEntropy",
    "CrossEntropyWithTemperature",
    "BinaryCrossEntropyWithTemperature",
    "MulticlassHinge",
    "MulticlassKR",
    "MulticlassHKR",
    "KCosineSimilarity",
]


def _labels_seen(logits: torch.Tensor, target: torch.Tensor) -> str:
    """What the labels are, for an error, without the batch size (a Poisson batch's size is secret)."""
    if target.dim() and logits.dim() and target.shape[0] == logits.shape[0]:
        return f"labels of per-example shape {tuple(target.shape[1:])}"
    return "a number of labels other than of logits" if target.dim() else "a single label"


def _check_multiclass(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"expected logits of shape (batch, classes), got per-example shape {tuple(logits.shape[1:])}")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"expected one integer label per example, shape (batch,), got {_labels_seen(logits, target)}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"expected integer class labels, got {target.dtype} labels: give class indices 0..K-1 "
                         "(torch.long), not one-hot, scores or booleans")
    # before the loss indexes with them: torch's error names only one value, and on CUDA it is a device assert
    if target.numel() and not bool(((target >= 0) & (target < logits.shape[1])).all()):
        # the labels themselves are not shown: error messages reach logs, and they are values of records
        raise ValueError(f"labels must be class indices in [0, {logits.shape[1]}) for a model with "
                         f"{logits.shape[1]} outputs; a label is outside that range")


class TauCrossEntropy(LipschitzLoss):
    """``CE(softmax(tau z), y) / tau``; gradient ``softmax(tau z) - e_y`` has norm ``< sqrt(2)`` (any width)."""

    constants = LipschitzLoss.constants + ("tau",)

    def __init__(self, tau: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.tau = check_positive_finite(tau, "tau")
        self.lipschitz = math.sqrt(2.0)

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_multiclass(logits, target)
        return F.cross_entropy(self.tau * logits, target, reduction="none") / self.tau

    def extra_repr(self) -> str:
        return f"tau={self.tau}"


class CrossEntropyWithTemperature(LipschitzLoss):
    """``CE(softmax(z / T), y)``; gradient ``(softmax(z/T) - e_y)/T``, ``L = sqrt(2)/T``."""

    constants = LipschitzLoss.constants + ("temperature",)

    def __init__(self, temperature: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.temperature = check_positive_finite(temperature, "temperature")
        self.lipschitz = math.sqrt(2.0) / self.temperature

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_multiclass(logits, target)
        return F.cross_entropy(logits / self.temperature, target, reduction="none")


class BinaryCrossEntropyWithTemperature(LipschitzLoss):
    """``-log sigmoid(s z / T)`` with ``s = +-1``; ``|d/dz| = sigmoid(-s z/T)/T < 1/T``.

    Logits of shape ``(batch,)`` or ``(batch, 1)``; labels in ``{0, 1}`` or ``{-1, 1}``.
    """

    constants = LipschitzLoss.constants + ("temperature",)

    def check_output_shape(self, shape: Tuple[int, ...]) -> None:
        if tuple(shape) not in ((), (1,)):
            raise BoundError(f"BinaryCrossEntropyWithTemperature needs one logit per example; the model outputs "
                             f"per-example shape {tuple(shape)}")

    def __init__(self, temperature: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.temperature = check_positive_finite(temperature, "temperature")
        self.lipschitz = 1.0 / self.temperature

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and logits.shape[1] == 1:
            logits = logits[:, 0]
        if logits.dim() != 1 or target.shape != logits.shape:
            raise ValueError("expected logits (batch,) or (batch, 1) and labels (batch,), got logits of per-example "
                             f"shape {tuple(logits.shape[1:])} and {_labels_seen(logits, target)}")
        if target.numel() and not bool(((target == 1) | (target == 0) | (target == -1)).all()):
            raise ValueError("binary labels must be 0 or 1 (or -1 or 1): any other value was read as its sign")
        sign = torch.where(target > 0, 1.0, -1.0).to(logits.dtype)
        return F.softplus(-sign * logits / self.temperature)


class _FixedWidthLoss(LipschitzLoss):
    """A loss whose constant depends on the number of classes ``K``: refuses logits of another width."""

    num_classes: int

    def check_output_shape(self, shape: Tuple[int, ...]) -> None:
        if tuple(shape) != (self.num_classes,):
            raise BoundError(f"{type(self).__name__} was declared for {self.num_classes} classes (L = "
                             f"{self.lipschitz:.4g} holds for that width only); the model outputs per-example shape "
                             f"{tuple(shape)}: build the loss with num_classes={shape[0] if len(shape) == 1 else '?'}")

    def _check_width(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        _check_multiclass(logits, target)
        if logits.shape[1] != self.num_classes:
            raise BoundError(f"{type(self).__name__} was declared for {self.num_classes} classes, got logits of "
                             f"width {logits.shape[1]}")


def _one_vs_all_signs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 2.0 * F.one_hot(target, logits.shape[1]).to(logits.dtype) - 1.0


class MulticlassHinge(_FixedWidthLoss):
    """One-vs-all hinge (deel-lip weighting): ``[(K-1) h_y + sum_{j!=y} h_j] / (K-1)``, ``h_j = relu(m/2 - s_j z_j)``.

    Gradient: ``-1`` on the true class, ``1/(K-1)`` on each active other class,
    so ``L = sqrt(1 + 1/(K-1)) = sqrt(K/(K-1))``.
    """

    constants = LipschitzLoss.constants + ("num_classes", "margin")

    def __init__(self, num_classes: int, margin: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.num_classes = whole_number(num_classes, "num_classes", 2)
        self.margin = finite_at_least(margin, "margin")
        self.lipschitz = math.sqrt(self.num_classes / (self.num_classes - 1.0))

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._check_width(logits, target)
        signs = _one_vs_all_signs(logits, target)
        hinge = F.relu(self.margin / 2 - signs * logits)
        k1 = self.num_classes - 1.0
        weights = torch.where(signs > 0, k1, 1.0).to(logits.dtype)
        return (hinge * weights).sum(dim=1) / k1


class MulticlassKR(_FixedWidthLoss):
    """Per-example one-vs-all Kantorovich–Rubinstein loss ``-(z_y - mean_{j!=y} z_j)``.

    Per-example (spec §6: batch class-count normalisation breaks the bound);
    gradient ``(-1, 1/(K-1), ...)``, ``L = sqrt(K/(K-1))``.
    """

    constants = LipschitzLoss.constants + ("num_classes",)

    def __init__(self, num_classes: int, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.num_classes = whole_number(num_classes, "num_classes", 2)
        self.lipschitz = math.sqrt(self.num_classes / (self.num_classes - 1.0))

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._check_width(logits, target)
        signs = _one_vs_all_signs(logits, target)
        one = torch.ones((), dtype=logits.dtype, device=logits.device)
        weights = torch.where(signs > 0, one, one / (self.num_classes - 1.0))
        return -(signs * weights * logits).sum(dim=1)


class MulticlassHKR(_FixedWidthLoss):
    """``alpha * hinge + KR`` per example; both gradients share a sign pattern, so ``L = (1 + alpha) sqrt(K/(K-1))``."""

    constants = LipschitzLoss.constants + ("num_classes", "alpha")

    def __init__(self, num_classes: int, alpha: float = 10.0, margin: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.alpha = finite_at_least(alpha, "alpha")
        self.hinge = MulticlassHinge(num_classes, margin, reduction="none")
        self.kr = MulticlassKR(num_classes, reduction="none")
        self.num_classes = self.kr.num_classes
        self.lipschitz = (1.0 + self.alpha) * math.sqrt(self.num_classes / (self.num_classes - 1.0))

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._check_width(logits, target)
        return self.alpha * self.hinge.per_example(logits, target) + self.kr.per_example(logits, target)


class KCosineSimilarity(LipschitzLoss):
    """``-z_y / max(K X_min, ||z||)``; ``L = 1 / (K X_min)``."""

    constants = LipschitzLoss.constants + ("floor",)

    def __init__(self, k_coef: float = 1.0, x_min: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.floor = check_positive_finite(k_coef, "k_coef") * check_positive_finite(x_min, "x_min")
        self.lipschitz = 1.0 / self.floor

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_multiclass(logits, target)
        norms = torch.linalg.vector_norm(logits, dim=1).clamp_min(self.floor)
        return -logits.gather(1, target[:, None])[:, 0] / norms
