"""Baselines beside clipless DP-SGD: clipped DP-SGD through Opacus, and non-private training.

Both use ordinary (unconstrained) counterparts of the clipless builders, with the same layer widths,
``nn.Linear``/``nn.Conv2d`` and ReLU, so that Opacus can compute per-example gradients.  DP-SGD uses
Poisson sampling and the same accountant as clipless (dp-accounting, PLD or RDP): sigma is calibrated
for the sampling rate and number of steps Opacus will actually run; Opacus' own RDP epsilon is
reported beside it as a cross-check.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ..data.datasets import check_held_out
from ..nn.models import build_lr_schedule, build_optimizer
from ..privacy.accounting import PrivacyAccountant, check_delta
from ..privacy.calibration import plan_noise, planned_steps
from ..privacy.certified import UNDERFLOW_MARGIN
from ..privacy.noise import check_secure_flag, gaussian
from ..privacy.randomness import make_generator, randomness_label
from ..privacy.sampling import (check_physical_batch_size, loader_parts, physical_batches, poisson_data_loader,
                                step_progress)
from .evaluation import collect_outputs, predictions

__all__ = ["BaselineResult", "standard_mlp", "standard_cnn", "dpsgd_noise_std", "draw_noise_unbounded", "train_dpsgd",
           "train_nonprivate", "predict_scores"]


def standard_mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256)) -> nn.Sequential:
    """``Flatten -> (Linear -> ReLU)* -> Linear``: the unconstrained counterpart of :func:`~clipless.lipschitz_mlp`."""
    layers: List[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def standard_cnn(input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (16, 32),
                 hidden: Sequence[int] = (), kernel_size: int = 3, pool: int = 2) -> nn.Sequential:
    """``(Conv -> ReLU -> AvgPool)* -> Flatten -> Linear``: the counterpart of :func:`~clipless.lipschitz_cnn`."""
    if len(channels) == 0:
        raise ValueError("channels: the cnn needs at least one convolution width, got none")
    c, h, w = input_shape
    layers: List[nn.Module] = []
    for ch in channels:
        layers += [nn.Conv2d(c, ch, kernel_size, padding=kernel_size // 2), nn.ReLU()]
        if pool > 1 and h >= pool and w >= pool:
            layers.append(nn.AvgPool2d(pool))
            h, w = h // pool, w // pool
        c = ch
    layers.append(nn.Flatten())
    width = c * h * w
    for units in hidden:
        layers += [nn.Linear(width, units), nn.ReLU()]
        width = units
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


@dataclass
class BaselineResult:
    method: str
    test_accuracy: Optional[float]
    test_auroc: Optional[float]
    epsilon: Optional[float]
    delta: Optional[float]
    noise_multiplier: Optional[float]
    max_grad_norm: Optional[float]
    steps: int
    epochs: int
    expected_batch_size: float
    sample_rate: Optional[float]
    sampling: str
    accountant: Optional[str]
    seed: Optional[int]
    private: bool
    randomness: str
    privacy_note: str
    nonprivate_wall_time_s: Optional[float]  # DP-SGD: only with log_train_stats (it grows with the batch sizes)
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def predict_scores(model: nn.Module, data: Dataset, batch_size: int = 4096) -> Dict[str, Optional[float]]:
    """Accuracy, and AUROC of the score ``z_1 - z_0`` when there are two classes (no privacy cost: held-out data)."""
    from sklearn.metrics import roc_auc_score

    z, y = collect_outputs(model, data, batch_size)
    out: Dict[str, Optional[float]] = {"accuracy": float((predictions(z) == y).double().mean()), "auroc": None}
    if z.shape[1] == 2 and 0 < int(y.sum()) < len(y):
        out["auroc"] = float(roc_auc_score(y.numpy(), (z[:, 1] - z[:, 0]).numpy()))
    return out


def dpsgd_noise_std(noise_multiplier: float, max_grad_norm: float) -> float:
    """``sigma (C + 2^-64)``: the clipped sum's add/remove sensitivity is ``C`` in exact arithmetic; Opacus clips in
    float32, where below the normal range rounding is absolute (a clip of 1e-44 gave clipped gradients of 1.2 C), and
    the term covers it (:data:`~clipless.privacy.certified.UNDERFLOW_MARGIN`)."""
    return noise_multiplier * (max_grad_norm + UNDERFLOW_MARGIN)


def draw_noise_unbounded(optimizer: Any, secure: bool = False) -> Any:
    """Make an Opacus ``DPOptimizer`` draw its noise from :func:`~clipless.privacy.noise.gaussian` (Gaussian tails
    without a bound; ``secure``: its sum of 4 draws), with its own generator and scale :func:`dpsgd_noise_std`.

    Opacus draws ``torch.normal``, whose float32 CPU draws never exceed 5.77 standard deviations: a coordinate past
    that from one neighbour's clipped sum proves the other, outside the epsilon the baseline reports.  Opacus still
    sums, clips and marks the gradients (it runs with noise 0, then the draw is added), and its accountant hook reads
    the restored multiplier.
    """
    from opacus.optimizers import DPOptimizer

    if not isinstance(optimizer, DPOptimizer) or getattr(optimizer, "secure_mode", False):
        raise TypeError(f"expected an Opacus DPOptimizer without secure_mode, got {type(optimizer).__name__}")
    secure = check_secure_flag(secure)
    opacus_add_noise = optimizer.add_noise

    def add_noise() -> None:
        sigma = optimizer.noise_multiplier
        optimizer.noise_multiplier = 0.0  # Opacus' clipped sum only (its _generate_noise returns zeros at std 0)
        try:
            opacus_add_noise()
        finally:
            optimizer.noise_multiplier = sigma
        std = dpsgd_noise_std(sigma, optimizer.max_grad_norm)
        for p in optimizer.params:
            p.grad.add_(gaussian(p.grad.shape, optimizer.generator, p.grad.device, p.grad.dtype, secure), alpha=std)

    optimizer.add_noise = add_noise
    return optimizer


def train_dpsgd(
    model: nn.Module,
    train_data: Union[Dataset, DataLoader],
    *,
    batch_size: int,
    epochs: int,
    delta: float,
    max_grad_norm: float,
    target_epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    lr: float = 1e-3,
    optimizer: str = "adam",
    accountant: str = "pld",
    seed: Optional[int] = None,
    noise_seed: Optional[int] = None,
    test_data: Optional[Dataset] = None,
    progress: bool = True,
    log_train_stats: bool = False,
    lr_schedule: str = "constant",
    secure_noise: bool = False,
    max_physical_batch_size: Optional[int] = None,
) -> BaselineResult:
    """Clipped DP-SGD (Abadi et al.) through Opacus: per-example gradients clipped to ``max_grad_norm``,
    noise ``N(0, sigma^2 C^2)`` on the sum, division by the expected batch size, Poisson sampling.

    ``seed`` (public) fixes the initialization; the noise and the batches come from OS entropy unless
    ``noise_seed`` fixes them (then the result says the run is not private).  Sigma comes from the same
    noise plan as clipless (:func:`~clipless.privacy.calibration.plan_noise`, one Gaussian mechanism): give
    ``target_epsilon`` (sigma is calibrated for ``epochs``), ``noise_multiplier``, or both (the run stops where
    the next step would pass the target; ``extra["stopped_by_budget"]`` says whether it did).
    ``log_train_stats`` adds ``nonprivate_wall_time_s``: it grows with the realised (secret) batch sizes.
    ``lr_schedule``: ``constant`` or ``cosine`` over the epochs, stepped per epoch (``build_lr_schedule``).
    The noise is the library's (:func:`draw_noise_unbounded`); ``secure_noise``: each value a sum of 4 draws.
    ``max_physical_batch_size``: each Poisson batch in parts of at most that many examples, whose clipped
    per-example gradients Opacus sums before its one noisy step (as its ``BatchMemoryManager`` does).
    """
    schedule = build_lr_schedule(lr_schedule, epochs)  # checked before anything runs
    check_secure_flag(secure_noise)
    max_physical_batch_size = check_physical_batch_size(max_physical_batch_size)
    train_data, loader_options = loader_parts(train_data)  # Poisson batches over a loader's dataset, its workers kept
    test_data, _ = loader_parts(test_data, training=False)
    check_held_out(train_data, test_data)
    try:
        from ..extras import require

        OpacusEngine = require("opacus", "opacus").PrivacyEngine
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ImportError("the DP-SGD baseline needs Opacus: pip install 'clipless[opacus]'") from err
    n = len(train_data)  # type: ignore[arg-type]
    check_delta(delta, n)
    if target_epsilon is None and noise_multiplier is None:
        raise ValueError("give target_epsilon, noise_multiplier, or both (the steps then stop at the target)")
    if not 0 < max_grad_norm < math.inf:  # NaN passed a "<= 0" test into Opacus' clipping
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
    if seed is not None:
        torch.manual_seed(seed)
    loader = DataLoader(train_data, batch_size=batch_size)
    # Opacus' Poisson loader samples at rate 1/len(loader) and runs len(loader) steps per epoch.
    sample_rate = 1.0 / len(loader)
    steps = planned_steps(epochs, len(loader))
    ours = PrivacyAccountant(accountant)
    plan = plan_noise(None, sample_rate=sample_rate, accountant=ours.mechanism,
                      noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, delta=delta, steps=steps)
    noise_multiplier, steps = plan.gradient_sigma, plan.max_steps
    opt = build_optimizer(model.parameters(), optimizer, lr)
    with warnings.catch_warnings():  # the noise comes from our generator (OS entropy unless noise_seed is given)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = OpacusEngine(accountant="rdp")
        model, opt, dp_loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, poisson_sampling=True, noise_generator=make_generator(noise_seed, stream=2),
        )
    assert abs(dp_loader.sample_rate - sample_rate) < 1e-12
    draw_noise_unbounded(opt, secure_noise)
    scheduler = schedule(opt) if schedule is not None else None  # on Opacus' optimizer: its groups are the inner's
    # The same Poisson sampling as Opacus' loader (rate q, len(loader) steps per epoch), through the
    # library's batched gather: Opacus' loader fetches records one by one, which dominates small models.
    batches = poisson_data_loader(train_data, sample_rate, make_generator(noise_seed, stream=1),
                                  steps_per_epoch=len(loader), worker_options=loader_options)
    taken = 0
    start = time.perf_counter()
    for _ in step_progress(range(epochs), desc="dp-sgd (opacus)", timing=log_train_stats, disable=not progress):
        for x, y in batches:
            if taken >= steps:  # a budget-capped plan (fixed sigma and a target) may stop mid-epoch
                break
            taken += 1
            parts = physical_batches(x, y, max_physical_batch_size)
            for i, (xs, ys) in enumerate(parts):
                opt.zero_grad()  # after a skipped step Opacus keeps the clipped sum and clears only the part's
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Full backward hook")
                    # the mean over the part: Opacus' per-example gradients are those of the part's mean loss
                    # times its size
                    loss = F.cross_entropy(model(xs), ys)
                    loss.backward()
                opt.signal_skip_step(do_skip=i < len(parts) - 1)  # clip and sum the part; noise after the last
                opt.step()  # empty Poisson batches are steps too (Opacus still adds noise)
            ours.step(noise_multiplier, sample_rate)
        if scheduler is not None:
            scheduler.step()
    wall = time.perf_counter() - start
    scores = predict_scores(model, test_data) if test_data is not None else {"accuracy": None, "auroc": None}
    return BaselineResult(
        method="dpsgd", test_accuracy=scores["accuracy"], test_auroc=scores["auroc"],
        epsilon=ours.get_epsilon(delta), delta=delta, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, steps=taken, epochs=epochs, expected_batch_size=sample_rate * n,
        sample_rate=sample_rate, sampling="poisson", accountant=accountant, seed=seed,
        **randomness_label(noise_seed), nonprivate_wall_time_s=wall if log_train_stats else None,
        extra={"opacus_rdp_epsilon": float(engine.get_epsilon(delta)),
               "stopped_by_budget": bool(plan.budget_limited and taken >= steps), "secure_noise": secure_noise},
    )


def train_nonprivate(
    model: nn.Module,
    train_data: Dataset,
    *,
    batch_size: int,
    epochs: int,
    lr: float = 1e-3,
    optimizer: str = "adam",
    seed: Optional[int] = None,
    test_data: Optional[Dataset] = None,
    progress: bool = True,
    lr_schedule: str = "constant",
    max_physical_batch_size: Optional[int] = None,
) -> BaselineResult:
    """Ordinary training (shuffled mini-batches, mean cross-entropy): the utility ceiling, no privacy.
    ``lr_schedule`` and ``max_physical_batch_size`` as for :func:`train_dpsgd`."""
    schedule = build_lr_schedule(lr_schedule, epochs)
    max_physical_batch_size = check_physical_batch_size(max_physical_batch_size)
    if seed is not None:
        torch.manual_seed(seed)
    loader = DataLoader(train_data, batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed) if seed is not None else None)
    opt = build_optimizer(model.parameters(), optimizer, lr)
    scheduler = schedule(opt) if schedule is not None else None
    start = time.perf_counter()
    for _ in tqdm(range(epochs), desc="non-private", disable=not progress):
        for x, y in loader:
            opt.zero_grad()
            for xs, ys in physical_batches(x, y, max_physical_batch_size):  # each part's share of the batch mean
                (F.cross_entropy(model(xs), ys) * (ys.shape[0] / y.shape[0])).backward()
            opt.step()
        if scheduler is not None:
            scheduler.step()
    wall = time.perf_counter() - start
    scores = predict_scores(model, test_data) if test_data is not None else {"accuracy": None, "auroc": None}
    return BaselineResult(
        method="nonprivate", test_accuracy=scores["accuracy"], test_auroc=scores["auroc"], epsilon=None, delta=None,
        noise_multiplier=None, max_grad_norm=None, steps=epochs * len(loader), epochs=epochs,
        expected_batch_size=float(batch_size), sample_rate=None, sampling="shuffled", accountant=None, seed=seed,
        private=False, randomness="n/a", privacy_note="non-private baseline: no guarantee",
        nonprivate_wall_time_s=wall,
    )
