"""Gaussian noise on the summed gradient, calibrated to the bound engine (spec §3.2).

global:    s_d += N(0, sigma^2 Delta^2),  Delta = sqrt(sum_d g_d^2)
per-layer: s_d += N(0, sigma_d^2 g_d^2)
then every gradient is divided by the *expected* batch size ``b = qN``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from .bounds import BoundReport
from .certified import check_flag
from .randomness import is_secret_generator, mechanism_words, secret_generator

__all__ = [
    "STRATEGIES",
    "SECURE_DRAWS",
    "gaussian",
    "check_secure_flag",
    "add_noise_",
    "add_gaussian_noise_",
    "allocate_layer_noise",
    "noise_energy_allocation",
    "noisy_count",
]

STRATEGIES = ("global", "per_layer")

# Standard normals summed per secure sample: their sum over sqrt(SECURE_DRAWS) (= 2) is N(0, 1) again.
SECURE_DRAWS = 4


def check_secure_flag(secure: Any) -> bool:
    """``secure_noise`` as given, refused unless a bool ("no" or 0.5 would read as a choice)."""
    return bool(check_flag(secure, "secure_noise"))


# Box-Muller's squared radius over 2 is Exp(1), -ln(1 - u); past this level a draw is redrawn (memoryless), so the
# uniforms' resolution sets no bound on the radius.
_TAIL_LEVEL = 20 * math.log(2.0)
# Of one 63-bit draw per pair of normals: the radius's uniform takes 39 bits, the angle's the other 24.
_RADIUS_BITS, _ANGLE_BITS = 39, 24


def _redraw_tail_(total: torch.Tensor, generator: Optional[torch.Generator], device: Any) -> torch.Tensor:
    """Every Exp(1) draw of ``total`` above ``20 ln 2`` replaced by ``20 ln 2`` plus a fresh draw, its conditional
    law (and so on), so that the uniforms' resolution bounds no draw (39 bits alone would stop at ``39 ln 2``, a
    radius of 7.35; 53 bits at 8.57)."""
    if total.numel() == 0 or float(total.max()) <= _TAIL_LEVEL:  # the usual case: one pass, no index
        return total
    deep, base = (total > _TAIL_LEVEL).nonzero().flatten(), _TAIL_LEVEL
    while deep.numel():  # rare (2^-20 a draw), and a function of the draws alone, never of the data
        fresh = _exponential_draws(deep.numel(), generator, device)
        total[deep] = fresh + base
        deep, base = deep[fresh > _TAIL_LEVEL], base + _TAIL_LEVEL
    return total


def _exponential_draws(n: int, generator: Optional[torch.Generator], device: Any) -> torch.Tensor:
    """``-ln(1 - u)`` for ``n`` 53-bit uniforms ``u``, in float64."""
    if is_secret_generator(generator):
        uniform = (mechanism_words(generator, n, device) >> 10).to(torch.float64).mul_(2.0 ** -53)
    else:
        uniform = torch.rand(n, generator=generator, device=device, dtype=torch.float64)
    return uniform.neg_().add_(1).log_().neg_()


def _box_muller(shape: Any, generator: Optional[torch.Generator], device: Any, dtype: torch.dtype) -> torch.Tensor:
    """Standard normals ``sqrt(2 E) (cos, sin)(2 pi v)``, ``E = -ln(1 - u)`` Exp(1) without a bound (``u`` on 39
    bits, redrawn past ``20 ln 2``: :func:`_redraw_tail_`), ``v`` on 24 bits, both from one 63-bit draw per pair.
    Torch's float32 ``randn`` on the CPU takes ``u`` from 24 bits and never exceeds ``sqrt(2 ln 2^24) = 5.77``: a
    noise coordinate more than 5.77 std from one neighbour's sum then proves the other, a chance per step of
    ``P(Z > 5.77 - shift / std)`` (1e-5 for a shift of 1.5 std), outside any accountant."""
    shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    n = shape.numel()
    half = (n + 1) // 2
    bits = mechanism_words(generator, half, device)
    # 1 - u in (0, 1], exact in float64
    exponential = (bits >> _ANGLE_BITS).to(torch.float64).mul_(-(2.0 ** -_RADIUS_BITS)).add_(1).log_().neg_()
    radius = _redraw_tail_(exponential, generator, device).mul_(2).sqrt_().to(dtype)
    angle = (bits & (2 ** _ANGLE_BITS - 1)).to(dtype).mul_(2 * math.pi * 2.0 ** -_ANGLE_BITS)
    out = torch.empty(2, half, device=device, dtype=dtype)
    torch.cos(angle, out=out[0])
    torch.sin(angle, out=out[1])
    return out.mul_(radius).view(-1)[:n].reshape(shape)


def gaussian(shape: Any, generator: Optional[torch.Generator], device: Any = "cpu", dtype: torch.dtype = torch.float32,
             secure: bool = False) -> torch.Tensor:
    """Standard normal samples (:func:`_box_muller`: tails without torch's float32 bound of 5.77); ``generator`` None:
    OS entropy, never torch's global generator.  ``secure``: the sum
    of ``SECURE_DRAWS = 4`` draws divided by 2, still exactly ``N(0, 1)``: a floating-point sample is not a real
    Gaussian, and the gaps between the values one draw can take let an observer of ``x + noise`` tell some ``x``
    apart (Mironov, CCS 2012; Jin et al., S&P 2022); the sum fills those gaps (Holohan and Braghin, 2021), as
    Opacus' ``secure_mode`` does.  It costs 4 draws instead of 1.  The bits of a secret generator come from its AES
    key stream (:func:`~clipless.privacy.randomness.mechanism_words`), secure or not; a seeded generator (an
    experiment, not private) keeps its reproducible draws."""
    if generator is None:  # torch's global generator is as public as its seed (torch.manual_seed)
        generator = secret_generator(device)
    total = _box_muller(shape, generator, device, dtype)
    if not secure:
        return total
    for _ in range(SECURE_DRAWS - 1):
        total.add_(_box_muller(shape, generator, device, dtype))
    return total.div_(math.sqrt(SECURE_DRAWS))


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


@torch.no_grad()
def add_noise_(
    report: BoundReport,
    strategy: str,
    sigmas: Mapping[str, float],
    expected_batch_size: float,
    generator: torch.Generator,
    draw: bool = True,
    secure: bool = False,
) -> Dict[str, float]:
    """Replace each bounded parameter's ``.grad`` (the summed gradient) by ``(sum + noise) / b``.

    Returns the noise standard deviation used for each layer.  ``draw=False`` adds nothing (the ranks
    other than 0 of a distributed step: the noise is drawn once, :mod:`clipless.privacy.distributed`).
    ``secure``: each noise value from :func:`gaussian`'s sum of draws.
    """
    if expected_batch_size <= 0:
        raise ValueError("expected batch size must be positive")
    stds: Dict[str, float] = {}
    delta = report.global_sensitivity
    for layer in report.layers:
        sigma = sigmas[layer.name]
        std = sigma * (delta if strategy == "global" else layer.bound)
        stds[layer.name] = std
        add_gaussian_noise_(layer.params, std if draw else 0.0, expected_batch_size, generator, secure)
    return stds


@torch.no_grad()
def add_gaussian_noise_(
    params: Sequence[torch.Tensor], std: float, expected_batch_size: float, generator: Optional[torch.Generator],
    secure: bool = False,
) -> None:
    """``grad <- (grad + N(0, std^2 I)) / b`` for each parameter (a missing ``.grad`` counts as zero);
    ``std = 0`` draws nothing; ``generator`` None: OS entropy, never torch's global generator; ``secure``: see
    :func:`gaussian`."""
    if expected_batch_size <= 0:
        raise ValueError("expected batch size must be positive")
    if generator is None and std != 0 and params:
        generator = secret_generator(params[0].device)
    for param in params:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if std == 0:
            param.grad = grad / expected_batch_size
            continue
        noise = gaussian(param.shape, generator, param.device, param.dtype, secure)
        param.grad = noise.mul_(std).add_(grad).div_(expected_batch_size)  # (grad + std noise) / b, in place


def noisy_count(count: float, std: float, generator: Optional[torch.Generator], device: Any = "cpu",
                distributed: bool = False, secure: bool = False) -> float:
    """``count + N(0, std^2)`` in float64: the release of a per-step count of add/remove sensitivity 1
    (``secure``: the noise from :func:`gaussian`'s sum of draws).

    ``distributed``: the local counts are summed over the ranks, rank 0 draws the one noise and every rank
    receives the same noisy total (:mod:`clipless.privacy.distributed`).  Without ``generator`` the noise comes
    from OS entropy (torch's global generator is as public as its seed).
    """
    if generator is None:
        generator = secret_generator(device)
    if not distributed:
        return count + std * float(gaussian((), generator, device, torch.float64, secure))
    from .distributed import all_reduce_sum_, broadcast_value, world

    rank, _ = world()
    total = torch.tensor([float(count)], dtype=torch.float64, device=device)
    all_reduce_sum_([total])
    noisy = float(total.item())
    if rank == 0:
        noisy += std * float(gaussian((), generator, device, torch.float64, secure))
    return broadcast_value(noisy, device)
