"""``DPOptimizer``: wraps any ``torch.optim`` optimizer into a clipless private step (SPEC §3.2).

``step()`` = bound engine -> Gaussian noise on the summed gradient -> divide by
the expected batch size -> inner step -> projection -> accountant step.
The gradients it receives must be the gradient of the **sum** of per-example
losses of one Poisson batch (``LipschitzLoss.per_example(...).sum()``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from .accounting import PrivacyAccountant, effective_noise_multiplier
from .bounds import BoundEngine, BoundError, BoundReport
from .layers import adaptive_clips
from .noise import add_noise_, layer_noise_multipliers, strategy_effective_sigma

__all__ = ["DPOptimizer", "InputGuard"]


def _largest_norm(x: torch.Tensor, bound: float) -> float:
    """Largest per-example L2 norm, exact enough to compare with ``bound``.

    Computed in the input's dtype first: a float32 norm of ``n`` entries has relative error below
    ``gamma_n = n u / (1 - n u)`` (``u = 2^-24``, Higham's bound for the sum of squares, halved by the root
    and doubled for safety), so if even ``norm (1 + gamma_n)`` is below the bound, no example exceeds it.
    Otherwise (or for long rows) it is recomputed in float64.
    """
    flat = x.flatten(1)
    if flat.dtype == torch.float32:
        nu = flat.shape[1] * 2.0**-24
        if nu < 0.01:
            approx = torch.linalg.vector_norm(flat, dim=1).max().item()
            if approx * (1 + 2 * nu / (1 - nu)) <= bound:
                return approx
    return torch.linalg.vector_norm(flat.double(), dim=1).max().item()


class InputGuard:
    """Forward pre-hook that refuses inputs the privacy analysis does not cover.

    Wrong per-example shape or NaN/inf values always raise; a norm above the
    declared data bound raises while the model is in training mode.
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int], data_bound: Optional[float]) -> None:
        self.input_shape = tuple(input_shape)
        self.data_bound = data_bound
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            raise BoundError("the private model takes one tensor input")
        x = args[0]
        if tuple(x.shape[1:]) != self.input_shape:
            raise BoundError(f"input of per-example shape {tuple(x.shape[1:])}, expected {self.input_shape}")
        # A finite sum implies finite entries (NaN and inf propagate); only a non-finite sum needs the full check.
        if x.is_floating_point() and not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
            raise BoundError("input contains NaN or infinite values")
        if module.training and self.data_bound is not None and x.shape[0] > 0:
            largest = _largest_norm(x, self.data_bound)
            if largest > self.data_bound * (1 + 1e-6):
                raise BoundError(
                    f"an input has norm {largest:.6g} > declared input_bound {self.data_bound:.6g}: the "
                    "sensitivity would be wrong; clip the data (InputNormClip) or raise input_bound"
                )

    def remove(self) -> None:
        self.handle.remove()


class DPOptimizer:
    """A private optimizer step around ``optimizer`` for the model covered by ``bound_engine``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        bound_engine: BoundEngine,
        noise_multiplier: float,
        expected_batch_size: float,
        sample_rate: float,
        accountant: PrivacyAccountant,
        strategy: str = "global",
        layer_noise: Optional[Mapping[str, float]] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.original_optimizer = optimizer
        self.bound_engine = bound_engine
        self.expected_batch_size = float(expected_batch_size)
        self.sample_rate = float(sample_rate)
        self.accountant = accountant
        self.strategy = strategy
        self.noise_multiplier = float(noise_multiplier)
        report = bound_engine.compute()
        self.layer_sigmas: Dict[str, float] = layer_noise_multipliers(report, strategy, noise_multiplier, layer_noise)
        # Adaptive clipping releases a noisy count per step on the same batch: one more Gaussian mechanism.
        self.adaptive_clips = adaptive_clips(bound_engine.model)
        self.effective_noise_multiplier = self._step_sigma(list(self.layer_sigmas.values()))
        bounded = {id(p) for layer in report.layers for p in layer.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in bounded:
                    raise BoundError("the optimizer holds a parameter that the bound engine does not cover")
        if generator is None:
            device = next(bound_engine.model.parameters()).device
            generator = torch.Generator(device=device)
            generator.seed()
        self.generator = generator
        self.last_report: Optional[BoundReport] = report
        self.last_noise_std: Dict[str, float] = {}
        bound_engine.project_()  # start from feasible weights

    def set_layer_noise(self, layer_sigmas: Mapping[str, float]) -> None:
        """Replace the per-layer multipliers (per-layer strategy) and the accounted ``sigma_eff``."""
        if set(layer_sigmas) != set(self.layer_sigmas):
            raise ValueError("layer noise multipliers must name exactly the bounded layers")
        sigmas = {k: float(v) for k, v in layer_sigmas.items()}
        self.effective_noise_multiplier = self._step_sigma(list(sigmas.values()))
        self.layer_sigmas = sigmas

    def _step_sigma(self, layer_sigmas: List[float]) -> float:
        """``sigma_eff`` of one step: the gradient noise and every adaptive-clipping count (SPEC §3.3-3.4)."""
        gradient = strategy_effective_sigma(self.strategy, layer_sigmas)
        counts = [clip.count_noise_multiplier for clip in self.adaptive_clips]
        return effective_noise_multiplier([gradient, *counts]) if counts else gradient

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.original_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        report = self.bound_engine.compute()
        self.last_report = report
        self.last_noise_std = add_noise_(
            report, self.strategy, self.layer_sigmas, self.expected_batch_size, self.generator
        )
        self.original_optimizer.step()
        self.bound_engine.project_()
        for clip in self.adaptive_clips:  # after the step: its noise used the C of this batch's backward
            clip.update_(self.expected_batch_size, self.generator)
        self.accountant.step(self.effective_noise_multiplier, self.sample_rate)
        return loss

    def state_dict(self) -> Dict[str, Any]:
        return {
            "optimizer": self.original_optimizer.state_dict(),
            "noise_generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["noise_generator"])

    def __repr__(self) -> str:
        return (
            f"DPOptimizer(strategy={self.strategy}, sigma_eff={self.effective_noise_multiplier:.4g}, "
            f"expected_batch_size={self.expected_batch_size:g}, inner={type(self.original_optimizer).__name__})"
        )

