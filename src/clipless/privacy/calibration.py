"""The one noise plan every entry point calibrates through (spec §3.2-3.4, §6).

A private step releases, on one Poisson batch, the noisy gradient (one Gaussian per layer, multipliers
``sigma_d``) and the noisy outputs of any other per-step mechanism (the adaptive clip's count).  Their
composition is one Gaussian mechanism with ``sigma_step = (sum_d sigma_d^-2 + sum_k s_k^-2)^-1/2``, which
the accountant composes over steps as a Poisson-subsampled Gaussian.

Meanings, the same everywhere:

* ``noise_multiplier`` is the **gradient's** effective multiplier ``sigma_grad = (sum_d sigma_d^-2)^-1/2``
  (the global strategy draws every layer at it, scaled to ``Delta``);
* ``layer_noise_multipliers`` are **relative weights** ``w_d`` (or ``"energy"``): ``sigma_d = c w_d`` with
  ``c`` such that the layers compose to ``sigma_grad`` (a layer the mapping leaves out weighs 1);
* with ``target_epsilon``, the plan either calibrates ``sigma_step`` for the planned steps, or (with a
  fixed ``noise_multiplier``) caps the number of steps; it never returns a plan above the target.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .accounting import (
    calibrate_noise_multiplier,
    calibrate_steps,
    check_positive_finite,
    compute_epsilon,
    effective_noise_multiplier,
    extended_history,
    gradient_noise_multiplier,
)
from .bounds import BoundReport
from .certified import is_real, is_whole
from .noise import STRATEGIES, allocate_layer_noise, noise_energy_allocation

__all__ = ["NoisePlan", "plan_noise", "planned_steps", "BudgetExhaustedError"]

LayerWeights = Union[Mapping[str, float], str, None]


class BudgetExhaustedError(RuntimeError):
    """A step would take epsilon past the target the run was planned for."""


@dataclass(frozen=True)
class NoisePlan:
    """What a private run draws and accounts per step, and how many steps its budget allows."""

    strategy: str
    layer_sigmas: Mapping[str, float]
    gradient_sigma: float
    mechanism_sigmas: Tuple[float, ...]
    step_sigma: float
    sample_rate: float
    accountant: str
    max_steps: Optional[int] = None
    target_epsilon: Optional[float] = None
    delta: Optional[float] = None
    budget_limited: bool = False

    def __post_init__(self) -> None:
        # Read-only: a per-layer multiplier edited in place would change the noise drawn but not the step_sigma
        # the accountant composes.
        object.__setattr__(self, "layer_sigmas", types.MappingProxyType(dict(self.layer_sigmas)))

    def __reduce__(self):  # a mappingproxy does not pickle; the plan does (checkpoints, deepcopy)
        values = (getattr(self, f.name) for f in fields(self))
        return (NoisePlan, tuple(dict(v) if isinstance(v, types.MappingProxyType) else v for v in values))

    def values(self) -> Tuple[Any, ...]:
        """Every field's value (the per-layer multipliers as sorted pairs): what a run checks at each step, so that
        a field written in place past the frozen dataclass (``object.__setattr__``) is seen too."""
        return tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v
                     for v in (getattr(self, f.name) for f in fields(self)))

    def check_budget(self, steps_taken: int) -> None:
        """Refuse a step past the budget (every private step of the library calls this before releasing noise)."""
        if self.max_steps is not None and steps_taken >= self.max_steps:
            if self.target_epsilon is None:  # a given noise multiplier: the steps planned are the budget
                raise BudgetExhaustedError(
                    f"this run planned {self.max_steps} steps at the given noise multiplier (its epochs) and all were "
                    "taken; no further step is released: plan more epochs for more steps")
            raise BudgetExhaustedError(
                f"the privacy budget (epsilon {self.target_epsilon}, delta {self.delta}) allows {self.max_steps} "
                "steps and all were taken; no further step is released")

    def account_step(self, accountant: Any, accounted: Optional[Sequence[tuple]] = None) -> List[tuple]:
        """Record one released step of this plan's mechanism at its sample rate.  Returns the history the accountant
        must hold now: ``accounted`` (its history before, by default as it reads now) extended by this step, which
        the caller keeps and checks (:func:`~clipless.privacy.accounting.check_composed_`)."""
        expected = extended_history(accountant.history if accounted is None else accounted, self.step_sigma,
                                    self.sample_rate)
        accountant.step(self.step_sigma, self.sample_rate)
        return expected


MAX_STEPS = 10 ** 9


def planned_steps(epochs: object, steps_per_epoch: int) -> int:
    """``epochs * steps_per_epoch`` for a whole, positive number of epochs (a fraction would be rounded: refused)."""
    if not is_whole(epochs):
        if isinstance(epochs, float) and epochs.is_integer():
            epochs = int(epochs)
        else:
            raise ValueError(f"epochs must be a whole number, got {epochs!r}: the step budget is planned per epoch")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    steps = int(epochs) * int(steps_per_epoch)
    if steps > MAX_STEPS:  # dp-accounting's PLD overflows or runs for hours past this
        raise ValueError(f"{epochs} epochs of {steps_per_epoch} steps are {steps} steps, more than the accountants "
                         f"compose ({MAX_STEPS:.0e}): plan fewer epochs")
    return steps


def _positive(value: Optional[float], name: str) -> Optional[float]:
    return None if value is None else check_positive_finite(value, name)


def _relative_weights(report: Optional[BoundReport], strategy: str, weights: LayerWeights) -> Dict[str, float]:
    names = [layer.name for layer in report.layers] if report is not None else []
    if strategy == "global":
        if weights is not None:
            raise ValueError("layer_noise_multipliers need strategy='per_layer'")
        return {name: 1.0 for name in names}
    if weights is None:
        return {name: 1.0 for name in names}
    if isinstance(weights, str) and weights == "energy":
        return noise_energy_allocation(report)
    if not isinstance(weights, Mapping):
        raise ValueError(f"layer_noise_multipliers must be a mapping of relative weights or 'energy', got {weights!r}")
    unknown = set(weights) - set(names)
    if unknown:
        raise ValueError(f"layer_noise_multipliers name unknown layers {sorted(unknown)}; layers are {names}")
    # a weight is a number: float() would read "2" and True as weights
    bad = {k: v for k, v in weights.items() if not is_real(v) or not 0 < v < math.inf}
    if bad:
        raise ValueError(f"layer_noise_multipliers must be positive finite relative weights, got {bad}")
    return {name: float(weights.get(name, 1.0)) for name in names}


def plan_noise(
    report: Optional[BoundReport],
    *,
    sample_rate: float,
    accountant: str,
    strategy: str = "global",
    layer_noise_multipliers: LayerWeights = None,
    noise_multiplier: Optional[float] = None,
    target_epsilon: Optional[float] = None,
    delta: Optional[float] = None,
    steps: Optional[int] = None,
    mechanism_sigmas: Sequence[float] = (),
) -> NoisePlan:
    """Per-layer multipliers, the accounted ``sigma_step`` and the step budget of a private run.

    ``report`` names the layers (per-layer allocation); ``None`` plans one Gaussian mechanism for the whole
    released gradient (clipped DP-SGD, Logit-DP).  Give ``noise_multiplier`` (the gradient's ``sigma_grad``), or ``target_epsilon`` with ``delta`` and
    ``steps`` (``sigma_step`` is calibrated so that ``steps`` steps stay within the target, and the other
    mechanisms' share is taken out of it), or both (the steps are capped by the budget).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    noise_multiplier = _positive(noise_multiplier, "noise_multiplier")
    target_epsilon = _positive(target_epsilon, "target_epsilon")
    others = tuple(_positive(s, "a per-step mechanism's noise multiplier") for s in mechanism_sigmas)  # type: ignore[misc]
    if steps is not None and (not is_whole(steps) or steps < 1):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if target_epsilon is not None and delta is None:
        raise ValueError("a target epsilon needs delta")
    if noise_multiplier is None:
        if target_epsilon is None or steps is None:
            raise ValueError("give noise_multiplier, or target_epsilon with a number of steps (epochs)")
        step_sigma = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant)  # type: ignore[arg-type]
        gradient_sigma = gradient_noise_multiplier(step_sigma, others) if others else step_sigma
    else:
        gradient_sigma = noise_multiplier
    weights = _relative_weights(report, strategy, layer_noise_multipliers)
    if strategy == "global":
        layer_sigmas = {name: gradient_sigma for name in weights}
    else:
        layer_sigmas = allocate_layer_noise(gradient_sigma, weights) if weights else {}
    # The accounted multiplier is recomputed from what is drawn, never taken from the calibration.
    drawn = [gradient_sigma] if strategy == "global" or not layer_sigmas else list(layer_sigmas.values())
    mechanisms = drawn + list(others)
    step_sigma = mechanisms[0] if len(mechanisms) == 1 else effective_noise_multiplier(mechanisms)
    max_steps, limited = steps, False
    if target_epsilon is not None:
        within = steps is not None and compute_epsilon(
            step_sigma, sample_rate, steps, delta, accountant) <= target_epsilon  # type: ignore[arg-type]
        if not within:  # the budget, not the planned steps, decides when to stop
            max_steps, limited = calibrate_steps(target_epsilon, delta, sample_rate, step_sigma, accountant), True  # type: ignore[arg-type]
            if max_steps == 0:
                raise ValueError(f"a single step at sigma_eff={step_sigma:.4g} already exceeds epsilon="
                                 f"{target_epsilon}: raise noise_multiplier or the target")
    return NoisePlan(
        strategy=strategy, layer_sigmas=layer_sigmas, gradient_sigma=gradient_sigma, mechanism_sigmas=others,
        step_sigma=step_sigma, sample_rate=float(sample_rate), accountant=accountant, max_steps=max_steps,
        target_epsilon=target_epsilon, delta=delta, budget_limited=limited,
    )
