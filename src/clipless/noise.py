"""Gaussian noise on the summed gradient, calibrated to the bound engine (SPEC §3.2).

global:    s_d += N(0, sigma^2 Delta^2),  Delta = sqrt(sum_d g_d^2)
per-layer: s_d += N(0, sigma_d^2 g_d^2)
then every gradient is divided by the *expected* batch size ``b = qN``.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence

import torch

from .accounting import effective_noise_multiplier
from .bounds import BoundReport

__all__ = [
    "STRATEGIES",
    "add_noise_",
    "layer_noise_multipliers",
    "allocate_layer_noise",
    "strategy_effective_sigma",
    "noise_energy_allocation",
]

STRATEGIES = ("global", "per_layer")


def layer_noise_multipliers(
    report: BoundReport, strategy: str, noise_multiplier: float, per_layer: Optional[Mapping[str, float]] = None
) -> Dict[str, float]:
    """The multiplier each layer's noise is drawn with (``sigma`` for all layers unless given per layer)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "global":
        return {layer.name: noise_multiplier for layer in report.layers}
    per_layer = dict(per_layer or {})
    unknown = set(per_layer) - {layer.name for layer in report.layers}
    if unknown:
        raise ValueError(f"noise multipliers given for unknown layers {sorted(unknown)}")
    return {layer.name: per_layer.get(layer.name, noise_multiplier) for layer in report.layers}


def allocate_layer_noise(sigma_eff: float, weights: Mapping[str, float]) -> Dict[str, float]:
    """``sigma_d = c w_d`` with ``c`` such that ``(sum_d sigma_d^-2)^-1/2 = sigma_eff``."""
    if any(w <= 0 for w in weights.values()):
        raise ValueError("allocation weights must be positive")
    c = sigma_eff * math.sqrt(sum(w**-2 for w in weights.values()))
    return {name: c * w for name, w in weights.items()}


def noise_energy_allocation(report: BoundReport) -> Dict[str, float]:
    """Relative ``sigma_d`` minimising the total noise energy ``sum_d p_d sigma_d^2 g_d^2`` at fixed ``sigma_eff``.

    Lagrange conditions give ``sigma_d proportional to (p_d g_d^2)^(-1/4)`` (``p_d`` = number of
    parameters of layer ``d``): big layers get less noise per coordinate, small ones more.
    Depends only on the model's bounds and sizes, never on data.
    """
    weights = {}
    for layer in report.layers:
        size = sum(p.numel() for p in layer.params)
        weights[layer.name] = (size * max(layer.bound, 1e-30) ** 2) ** -0.25
    return weights


def strategy_effective_sigma(strategy: str, sigmas: Sequence[float]) -> float:
    """Noise multiplier of the whole step as one Gaussian mechanism (SPEC §3.4)."""
    if strategy == "global":
        if len(set(sigmas)) > 1:
            raise ValueError("the global strategy uses one noise multiplier")
        return sigmas[0]
    return effective_noise_multiplier(sigmas)


@torch.no_grad()
def add_noise_(
    report: BoundReport,
    strategy: str,
    sigmas: Mapping[str, float],
    expected_batch_size: float,
    generator: torch.Generator,
) -> Dict[str, float]:
    """Replace each bounded parameter's ``.grad`` (the summed gradient) by ``(sum + noise) / b``.

    Returns the noise standard deviation used for each layer.
    """
    if expected_batch_size <= 0:
        raise ValueError("expected batch size must be positive")
    stds: Dict[str, float] = {}
    delta = report.global_sensitivity
    for layer in report.layers:
        sigma = sigmas[layer.name]
        std = sigma * (delta if strategy == "global" else layer.bound)
        stds[layer.name] = std
        add_gaussian_noise_(layer.params, std, expected_batch_size, generator)
    return stds


@torch.no_grad()
def add_gaussian_noise_(
    params: Sequence[torch.Tensor], std: float, expected_batch_size: float, generator: torch.Generator
) -> None:
    """``grad <- (grad + N(0, std^2 I)) / b`` for each parameter (a missing ``.grad`` counts as zero)."""
    if expected_batch_size <= 0:
        raise ValueError("expected batch size must be positive")
    for param in params:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype)
        param.grad = (grad + std * noise) / expected_batch_size
