"""Loss-gradient clipping layers: fixed (``LossGradientClip``) and adaptive (a per-step mechanism), spec §3.3."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Collection, Dict, Iterator, Optional, Tuple

import torch

from ..privacy.input_guard import backward_pass_id
from ..privacy.modules import BoundedModule, LayerBound, PerStepMechanism
from ..privacy.noise import noisy_count
from ..privacy.accounting import check_positive_finite
from .functional import broadcast_per_example, per_example_norm

__all__ = ["LossGradientClip", "AdaptiveLossGradientClip"]


class _ClipGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, max_norm: float, record: Optional[Callable[[torch.Tensor], None]] = None):  # type: ignore[override]
        ctx.max_norm, ctx.record = max_norm, record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        norms = per_example_norm(grad)
        if ctx.record is not None:
            ctx.record(norms)
        factor = torch.clamp(ctx.max_norm / norms.clamp_min(1e-30), max=1.0)
        return grad * broadcast_per_example(factor, grad), None, None


class LossGradientClip(BoundedModule):
    """Identity forward; backward clips each example's gradient to norm ``C`` (spec §3.3).

    Placed after the logits it turns the loss bound ``L`` into ``min(L, C)``.
    """

    constants = ("max_norm",)

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = check_positive_finite(max_norm, "max_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ClipGrad.apply(x, self.max_norm)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound, grad_cap=self.max_norm)

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}"


class AdaptiveLossGradientClip(PerStepMechanism):
    """Loss-gradient clipping whose norm ``C`` tracks a private quantile (Andrew et al., 2021).

    Backward clips each example's logit gradient to ``C`` (so ``L <- min(L, C)``,
    as :class:`LossGradientClip`) and counts the examples with
    ``||grad_z l|| <= C``, per backward pass.  After each private step,
    :meth:`update_` releases the count of the step's released passes
    (:meth:`keep_only_`) with Gaussian noise of std ``count_noise_multiplier``
    (the count has add/remove sensitivity 1) and moves ``C`` geometrically towards the
    ``target_quantile``: ``C <- C exp(-lr (noisy_count / b - target_quantile))``
    with ``b`` the expected batch size.  The count is a second Gaussian
    mechanism on the same Poisson batch: the private optimizer composes it into
    ``sigma_eff = (sigma^-2 + count_noise_multiplier^-2)^(-1/2)`` at every step
    (spec §3.3-3.4).  ``C`` is a buffer, so checkpoints keep it.
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
        check_positive_finite(initial_norm, "initial_norm")
        self.count_noise_multiplier = check_positive_finite(count_noise_multiplier, "count_noise_multiplier")
        if not 0.0 < target_quantile < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {target_quantile}")
        self.target_quantile = float(target_quantile)
        self.learning_rate = check_positive_finite(learning_rate, "learning_rate")
        self.register_buffer("clip_norm", torch.tensor(float(initial_norm), dtype=torch.float64))
        # examples with ||grad_z l|| <= C, per backward pass since the last release
        self._below_by_pass: Dict[int, int] = {}
        self._recording = True

    @property
    def max_norm(self) -> float:
        return float(self.clip_norm)

    @property
    def _below(self) -> int:
        return sum(self._below_by_pass.values())

    def _record(self, norms: torch.Tensor) -> None:
        if self._recording:
            key = backward_pass_id()
            self._below_by_pass[key] = self._below_by_pass.get(key, 0) + int((norms <= self.max_norm).sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ClipGrad.apply(x, self.max_norm, self._record)

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        return LayerBound(lipschitz=1.0, out_bound=x_bound, grad_cap=self.max_norm)

    @torch.no_grad()
    def update_(self, expected_batch_size: float, generator: Optional[torch.Generator] = None,
                distributed: bool = False, secure: bool = False) -> float:
        """Release the noisy count of this step, update ``C``, reset the count; returns the noisy fraction."""
        fraction = noisy_count(self._below, self.count_noise_multiplier, generator, self.clip_norm.device,
                               distributed=distributed, secure=secure)
        fraction /= expected_batch_size
        self.clip_norm.mul_(math.exp(-self.learning_rate * (fraction - self.target_quantile)))
        self._below_by_pass = {}
        return fraction

    def keep_only_(self, backward_passes: Collection[int]) -> None:
        kept = set(backward_passes)
        self._below_by_pass = {k: n for k, n in self._below_by_pass.items() if k in kept}

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


