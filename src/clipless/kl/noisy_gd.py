"""KL privacy of noisy gradient descent without clipping (Ye et al., NeurIPS 2023; spec §5).

Noisy full-batch GD on the mean loss, ``theta_{k+1} = theta_k - eta grad L(theta_k; D) + sqrt(v) xi_k``.
By the chain rule for Gaussian transitions, for one neighbour ``D'``
``KL(A(D) || A(D')) = eta^2 / (2 v) * sum_k E ||grad L(theta_k; D) - grad L(theta_k; D')||^2``,
so the KL privacy loss is measured from gradient gaps along trajectories run on ``D`` only.

The networks are bias-free fully connected ReLU networks.  Every per-example gradient of a layer
``W_l`` is an outer product ``delta_l h_{l-1}^T``, so per-example gradient norms and inner products
with the mean gradient come from one forward and one backward pass (no per-example gradient is
materialised), which is what the closed forms for the neighbour gaps need:
remove ``z_j``: ``Delta g = (g_j - gbar) / (n - 1)``; add ``z``: ``Delta g = (gbar - g_z) / (n + 1)``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.datasets import check_finite
from ..nn.functional import finite_at_least
from ..privacy.accounting import check_positive_finite
from ..privacy.certified import is_whole, whole_number
from ..privacy import secret_generator
from ..privacy.noise import gaussian
from .networks import (
    INIT_SCHEMES,
    LinearizedNetwork,
    ReLUNetwork,
    gradient_norm_at_init,
    init_variances,
    relu_network_forward,
)


def _outputs_and_jacobian_weights(model: nn.Module) -> Tuple[List[Tensor], Callable[[Tensor], Tensor]]:
    """Weights at which the parameter Jacobian is taken (current for the network, theta_0 when linearized)."""
    if isinstance(model, LinearizedNetwork):
        return list(model.reference), model
    if isinstance(model, ReLUNetwork):
        return list(model.weights), model
    raise TypeError(f"expected a ReLUNetwork or LinearizedNetwork, got {type(model).__name__}")


def _layer_factors(weights: Sequence[Tensor], x: Tensor, output_grads: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
    """Per-example layer inputs ``h_{l-1}`` and backpropagated vectors ``delta_l`` with ``grad_{W_l} = delta_l h_{l-1}^T``."""
    inputs, masks = [x], []
    h = x
    for W in weights[:-1]:
        pre = h @ W.T
        masks.append(pre > 0)
        h = torch.relu(pre)
        inputs.append(h)
    deltas = [output_grads]
    for W, mask in zip(reversed(weights[1:]), reversed(masks)):
        deltas.insert(0, (deltas[0] @ W) * mask)
    return inputs, deltas


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-example CE and ``d CE / d z = softmax(z) - onehot(y)`` (norm at most ``sqrt(2)``)."""
    grads = torch.softmax(logits, dim=1) - F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return F.cross_entropy(logits, labels, reduction="none"), grads


def _squared(logits: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-example ``||z - onehot(y)||^2 / 2`` and its gradient ``z - onehot(y)`` (unbounded; linear in ``z``)."""
    residual = logits - F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return 0.5 * (residual * residual).sum(1), residual


#: Per-example loss and its gradient w.r.t. the logits.  With the squared loss a one-layer network
#: makes noisy GD a Gaussian chain whose KL has a closed form (used to test the estimator).
KL_LOSSES: Dict[str, Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]] = {
    "cross_entropy": _cross_entropy,
    "squared": _squared,
}


def _check_records(model: nn.Module, x: Tensor, y: Tensor, what: str) -> None:
    """Records the network can read: a shape, dtype or label it cannot would fail deep inside the closed forms."""
    check_finite(x, what)
    widths, dtype = model.widths, model.weights[0].dtype  # type: ignore[union-attr,index]
    if x.dim() != 2 or x.shape[1] != widths[0] or x.dtype != dtype:
        raise ValueError(f"{what} must be a (records, {widths[0]}) {dtype} tensor, got {tuple(x.shape)} {x.dtype}")
    if y.dim() != 1 or y.shape[0] != x.shape[0] or y.dtype != torch.int64:
        raise ValueError(f"{what} labels must be a ({x.shape[0]},) int64 tensor, got {tuple(y.shape)} {y.dtype}")
    if y.numel() and not (0 <= int(y.min()) and int(y.max()) < widths[-1]):
        raise ValueError(f"{what} labels must lie in [0, {widths[-1]}), got [{int(y.min())}, {int(y.max())}]")


def _loss_fn(loss: str) -> Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]:
    if loss not in KL_LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {sorted(KL_LOSSES)}")
    return KL_LOSSES[loss]


@dataclass
class GradientGeometry:
    """Mean training gradient and, per example, ``||g_i||^2`` and ``<g_i, gbar>`` (train and held-out)."""

    mean_grad: List[Tensor]
    train_sq_norms: Tensor
    train_dots: Tensor
    heldout_sq_norms: Tensor
    heldout_dots: Tensor
    train_loss: float

    @property
    def mean_grad_sq_norm(self) -> Tensor:
        return sum((g * g).sum() for g in self.mean_grad)  # type: ignore[return-value]


def gradient_geometry(model: nn.Module, x_train: Tensor, y_train: Tensor,
                      x_heldout: Optional[Tensor] = None, y_heldout: Optional[Tensor] = None,
                      loss: str = "cross_entropy") -> GradientGeometry:
    """One forward/backward per set: the statistics the closed-form neighbour gaps need."""
    jac_weights, forward = _outputs_and_jacobian_weights(model)
    loss_and_grads = _loss_fn(loss)
    with torch.no_grad():
        losses, a_train = loss_and_grads(forward(x_train), y_train)
        h_tr, d_tr = _layer_factors(jac_weights, x_train, a_train)
        n = x_train.shape[0]
        mean_grad = [d.T @ h / n for d, h in zip(d_tr, h_tr)]

        def stats(hs: List[Tensor], ds: List[Tensor]) -> Tuple[Tensor, Tensor]:
            sq = sum((d * d).sum(1) * (h * h).sum(1) for d, h in zip(ds, hs))
            dots = sum(((d @ G) * h).sum(1) for d, h, G in zip(ds, hs, mean_grad))
            return sq, dots  # type: ignore[return-value]

        train_sq, train_dots = stats(h_tr, d_tr)
        if x_heldout is not None and y_heldout is not None and x_heldout.shape[0] > 0:
            a_ho = loss_and_grads(forward(x_heldout), y_heldout)[1]
            held_sq, held_dots = stats(*_layer_factors(jac_weights, x_heldout, a_ho))
        else:
            held_sq = held_dots = x_train.new_zeros(0)
    return GradientGeometry(mean_grad, train_sq, train_dots, held_sq, held_dots, losses.mean().item())


def neighbour_gaps(geometry: GradientGeometry) -> Tensor:
    """``||grad L(D) - grad L(D')||^2`` for every neighbour: removals of each training record, then additions of each held-out one."""
    n = geometry.train_sq_norms.shape[0]
    if n < 2:
        raise ValueError("the KL estimator needs at least two training records")
    gbar_sq = geometry.mean_grad_sq_norm
    remove = (geometry.train_sq_norms - 2 * geometry.train_dots + gbar_sq).clamp_min(0) / (n - 1) ** 2
    add = (geometry.heldout_sq_norms - 2 * geometry.heldout_dots + gbar_sq).clamp_min(0) / (n + 1) ** 2
    return torch.cat([remove, add])


def noise_variance(eta: float, sigma: float) -> float:
    """Langevin discretisation: per-coordinate noise variance ``v = 2 eta sigma^2``."""
    return 2.0 * eta * sigma ** 2


def kl_per_unit_gap(eta: float, sigma: float) -> float:
    """``eta^2 / (2 v)`` with ``v = 2 eta sigma^2``, i.e. ``eta / (4 sigma^2)``: KL added per unit of ``||Delta g||^2``."""
    return eta ** 2 / (2.0 * noise_variance(eta, sigma))


@dataclass
class KLTrace:
    """KL accounting of several noisy-GD runs on the same data.

    ``max_gaps[r, k]`` is the largest neighbour gap at step ``k`` of run ``r`` (the paper's estimator:
    per-step max over neighbours, then mean over runs).  ``mean_gaps[k, j]`` is the mean over runs of
    neighbour ``j``'s gap at step ``k``; summing it over steps and taking the max over ``j`` gives the
    KL of the worst fixed neighbour, which the paper's estimator upper-bounds.
    """

    eta: float
    sigma: float
    max_gaps: np.ndarray
    mean_gaps: np.ndarray
    train_loss: np.ndarray
    n_train: int
    n_heldout: int
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return int(self.max_gaps.shape[1])

    def cumulative_kl(self) -> Tuple[np.ndarray, np.ndarray]:
        """Mean and std over runs of the cumulative KL estimate after each step (per-step max over neighbours)."""
        per_run = kl_per_unit_gap(self.eta, self.sigma) * np.cumsum(self.max_gaps, axis=1)
        return per_run.mean(axis=0), per_run.std(axis=0)

    def worst_neighbour_kl(self) -> np.ndarray:
        """After each step, ``max_j eta/(4 sigma^2) sum_{k'<=k} E||Delta g_{k'}(D, D_j)||^2`` (expectation over runs)."""
        cumulative = kl_per_unit_gap(self.eta, self.sigma) * np.cumsum(self.mean_gaps, axis=0)
        return cumulative.max(axis=1)

    @property
    def kl(self) -> float:
        return float(self.cumulative_kl()[0][-1])


def noisy_gradient_descent(
    model: nn.Module,
    x_train: Tensor,
    y_train: Tensor,
    x_heldout: Optional[Tensor],
    y_heldout: Optional[Tensor],
    eta: float,
    sigma: float,
    steps: int,
    generator: Optional[torch.Generator] = None,
    weight_decay: float = 0.0,
    loss: str = "cross_entropy",
) -> Tuple[Tensor, np.ndarray]:
    """Run ``steps`` of noisy GD in place on ``model`` (mean loss over ``D``).

    ``weight_decay`` adds ``(lambda/2) ||theta||^2`` to the objective; it is the same for ``D`` and ``D'``
    so it does not enter the gradient gaps.  Returns the gap matrix (steps x neighbours) and the train losses.
    Without ``generator`` the noise comes from OS entropy: the KL bound is over the noise, which an adversary
    who knows the generator's seed can subtract (the torch default generator is as public as its seed).
    """
    eta, sigma = check_positive_finite(eta, "eta"), check_positive_finite(sigma, "sigma")
    steps = whole_number(steps, "steps")
    weight_decay = finite_at_least(weight_decay, "weight_decay")
    _loss_fn(loss)
    _outputs_and_jacobian_weights(model)
    _check_records(model, x_train, y_train, "training data")
    if (x_heldout is None) != (y_heldout is None):
        # one without the other would silently drop every addition neighbour from the KL
        raise ValueError("give the held-out records and their labels together (or neither)")
    if x_heldout is not None:
        _check_records(model, x_heldout, y_heldout, "held-out data")  # type: ignore[arg-type]
    std = math.sqrt(noise_variance(eta, sigma))
    gaps, losses = [], []
    params = list(model.weights)  # type: ignore[attr-defined]
    if generator is None:
        generator = secret_generator(params[0].device)
    for k in range(steps):
        geometry = gradient_geometry(model, x_train, y_train, x_heldout, y_heldout, loss)
        gaps.append(neighbour_gaps(geometry))
        losses.append(geometry.train_loss)
        with torch.no_grad():
            for p, g in zip(params, geometry.mean_grad):
                noise = gaussian(p.shape, generator, p.device, p.dtype)  # tails not cut at 5.77 as float32 randn
                p.add_(-eta * (g + weight_decay * p) + std * noise)
        if not (torch.isfinite(gaps[-1]).all() and all(torch.isfinite(p).all() for p in params)):
            # every later gap, and so the KL, would be NaN: stop where the trajectory left the finite numbers
            raise ValueError(f"noisy GD diverged at step {k + 1} (non-finite weights or gradient gaps); "
                             f"lower eta (got {eta:g}) or weight_decay")
    return torch.stack(gaps), np.asarray(losses)


def kl_trace(
    make_model: Callable[[int], nn.Module],
    x_train: Tensor,
    y_train: Tensor,
    x_heldout: Optional[Tensor],
    y_heldout: Optional[Tensor],
    eta: float,
    sigma: float,
    steps: int,
    runs: int = 3,
    seed: Optional[int] = None,
    weight_decay: float = 0.0,
    loss: str = "cross_entropy",
) -> Tuple[KLTrace, List[nn.Module]]:
    """Run ``runs`` independent noisy-GD trajectories (model from ``make_model(run)``) and collect the KL trace.

    The noise comes from OS entropy unless ``seed`` is given: a seeded run is reproducible and its models are
    NOT private against anyone who knows ``seed`` (``trace.extra["randomness"]`` says which).  The trace itself
    is computed from the training records without noise (a measurement, not a private release)."""
    runs = whole_number(runs, "runs")
    if seed is not None and not is_whole(seed):
        raise ValueError(f"seed must be an integer or None (OS entropy), got {seed!r}")
    max_gaps, losses, models = [], [], []
    mean_gaps: Optional[Tensor] = None
    for r in range(runs):
        model = make_model(r)
        gen = secret_generator() if seed is None else torch.Generator().manual_seed(seed * 1_000_003 + r)
        gaps, run_losses = noisy_gradient_descent(model, x_train, y_train, x_heldout, y_heldout, eta, sigma, steps,
                                            generator=gen, weight_decay=weight_decay, loss=loss)
        max_gaps.append(gaps.max(dim=1).values.double().numpy())
        mean_gaps = gaps.double() / runs if mean_gaps is None else mean_gaps + gaps.double() / runs
        losses.append(run_losses)
        models.append(model)
    n_held = 0 if x_heldout is None else int(x_heldout.shape[0])
    trace = KLTrace(eta, sigma, np.stack(max_gaps), mean_gaps.numpy(), np.stack(losses),  # type: ignore[union-attr]
                    int(x_train.shape[0]), n_held,
                    extra={"randomness": "os-entropy" if seed is None else f"fixed seed {seed} (not private)"})
    return trace, models


def linearized_kl_bound(widths: Sequence[int], scheme: str, input_norm_sq: float, n_train: int,
                        eta: float, sigma: float, steps: int, loss_grad_sq: float = 2.0) -> float:
    """KL bound for the linearized network, every fixed neighbour, in expectation over the initialization.

    ``E||g_j - gbar||^2 <= 2 E||g_j||^2 + 2 E||gbar||^2 <= 4 loss_grad_sq E||J||_F^2`` with ``||dl/dz||^2 <= loss_grad_sq``
    (2 for cross-entropy), the Jacobian constant in time; divided by ``(n-1)^2`` (removal, the larger of the
    two closed forms; SPEC writes ``n^2``), times ``eta/(4 sigma^2)`` per step.
    """
    whole_number(n_train, "n_train", minimum=2)
    steps = whole_number(steps, "steps")
    eta, sigma = check_positive_finite(eta, "eta"), check_positive_finite(sigma, "sigma")
    input_norm_sq = finite_at_least(input_norm_sq, "input_norm_sq")
    loss_grad_sq = finite_at_least(loss_grad_sq, "loss_grad_sq")
    gap = 4.0 * loss_grad_sq * gradient_norm_at_init(widths, scheme, input_norm_sq) / (n_train - 1) ** 2
    return steps * kl_per_unit_gap(eta, sigma) * gap


def _measured_kl(kl: float) -> float:
    """A KL divergence is >= 0; a NaN or negative one is a failed measurement, not zero privacy loss."""
    return finite_at_least(kl, "a KL divergence") if not math.isinf(kl) or kl < 0 else math.inf


def kl_to_delta(kl: float) -> float:
    """KL privacy ``eps`` gives ``(0, min(1, sqrt(eps/2)))``-DP by Pinsker's inequality; 1 is vacuous (warned)."""
    delta = math.sqrt(_measured_kl(kl) / 2.0)
    if delta >= 1.0:
        warnings.warn(f"KL privacy {kl:.4g} >= 2 gives delta >= 1 by Pinsker's inequality: the bound is vacuous "
                      "(no guarantee)", stacklevel=2)
        return 1.0
    return delta


def membership_advantage_bound(kl: float) -> float:
    """Membership-inference advantage (TPR - FPR) bound from KL privacy: ``min(sqrt(eps/2), sqrt(1 - e^-eps))``."""
    kl = _measured_kl(kl)
    return min(math.sqrt(kl / 2.0), math.sqrt(1.0 - math.exp(-kl)), 1.0)


def example_losses(model: nn.Module, x: Tensor, y: Tensor, loss: str = "cross_entropy") -> Tensor:
    """Each example's ``loss`` (a name of :data:`KL_LOSSES`) under ``model``, without gradients."""
    with torch.no_grad():
        return _loss_fn(loss)(model(x), y)[0]


__all__ = [
    "INIT_SCHEMES",
    "GradientGeometry",
    "KLTrace",
    "KL_LOSSES",
    "LinearizedNetwork",
    "ReLUNetwork",
    "gradient_geometry",
    "gradient_norm_at_init",
    "init_variances",
    "kl_per_unit_gap",
    "kl_to_delta",
    "kl_trace",
    "linearized_kl_bound",
    "membership_advantage_bound",
    "neighbour_gaps",
    "noise_variance",
    "noisy_gradient_descent",
    "example_losses",
    "relu_network_forward",
]
