"""``PrivacyEngine.make_private``: the Opacus-style entry point of clipless DP-SGD."""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .accounting import PrivacyAccountant, calibrate_noise_multiplier, check_delta
from .bounds import BoundEngine, BoundError
from .layers import InputNormClip
from .losses import LipschitzLoss
from .optimizer import DPOptimizer, InputGuard
from .sampling import poisson_data_loader

__all__ = ["PrivacyEngine", "resolve_input_bound", "first_leaf"]


def first_leaf(model: nn.Module) -> nn.Module:
    """The first layer data goes through (descending into ``nn.Sequential``)."""
    while isinstance(model, nn.Sequential) and len(model) > 0:
        model = model[0]
    return model


def resolve_input_bound(model: nn.Module, input_bound: Optional[float]) -> Tuple[float, Optional[float]]:
    """``(X_0 for the engine, bound the raw data must satisfy or None)``.

    ``X_0`` comes from a leading :class:`InputNormClip` or from a declared
    ``input_bound`` that every input is then checked against — never from the
    data itself.
    """
    head = first_leaf(model)
    if isinstance(head, InputNormClip):
        x0 = head.max_norm if input_bound is None else min(head.max_norm, float(input_bound))
        return x0, (float(input_bound) if input_bound is not None else None)
    if input_bound is None:
        raise BoundError(
            "no input bound: start the model with InputNormClip(C) or pass input_bound= (a bound fixed "
            "without looking at the data; inputs above it are refused)"
        )
    return float(input_bound), float(input_bound)


def _dataset_of(data: Union[Dataset, DataLoader], batch_size: Optional[float]) -> Tuple[Dataset, float]:
    if isinstance(data, DataLoader):
        if batch_size is None:
            if data.batch_size is None:
                raise ValueError("give batch_size: the data loader has no fixed batch size")
            batch_size = data.batch_size
        data = data.dataset
    if batch_size is None:
        raise ValueError("give the expected batch size (batch_size)")
    return data, float(batch_size)


class PrivacyEngine:
    """Holds the accountant; turns (model, optimizer, data) into a clipless private training setup."""

    def __init__(self, accountant: str = "pld") -> None:
        self.accountant = PrivacyAccountant(accountant)

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Union[Dataset, DataLoader],
        loss: LipschitzLoss,
        noise_multiplier: float,
        input_shape: Sequence[int],
        batch_size: Optional[float] = None,
        input_bound: Optional[float] = None,
        strategy: str = "global",
        layer_noise_multipliers: Optional[Mapping[str, float]] = None,
        noise_generator: Optional[torch.Generator] = None,
        sampling_generator: Optional[torch.Generator] = None,
    ) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
        """Returns ``(module, dp_optimizer, poisson_loader)``.

        ``batch_size`` is the *expected* Poisson batch size ``b = qN``.  In the
        loop, backpropagate ``loss.per_example(module(x), y).sum()`` and call
        ``dp_optimizer.step()`` once per batch, empty batches included.
        """
        if not isinstance(loss, LipschitzLoss):
            raise BoundError(f"{type(loss).__name__} declares no Lipschitz constant; use a clipless loss")
        dataset, b = _dataset_of(data, batch_size)
        n = len(dataset)  # type: ignore[arg-type]
        if not (0 < b <= n):
            raise ValueError(f"expected batch size {b} must be in (0, N={n}]")
        sample_rate = b / n
        x0, data_bound = resolve_input_bound(module, input_bound)
        engine = BoundEngine(module, input_shape, x0, loss.lipschitz)
        dp_optimizer = DPOptimizer(
            optimizer,
            engine,
            noise_multiplier,
            expected_batch_size=b,
            sample_rate=sample_rate,
            accountant=self.accountant,
            strategy=strategy,
            layer_noise=layer_noise_multipliers,
            generator=noise_generator,
        )
        self.guard = InputGuard(module, input_shape, data_bound)
        loader = poisson_data_loader(dataset, sample_rate, generator=sampling_generator)
        return module, dp_optimizer, loader

    def make_private_with_epsilon(
        self,
        *,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Union[Dataset, DataLoader],
        loss: LipschitzLoss,
        input_shape: Sequence[int],
        batch_size: Optional[float] = None,
        **kwargs,
    ) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
        """As :meth:`make_private`, with ``sigma`` calibrated so ``epochs`` epochs stay within ``target_epsilon``."""
        dataset, b = _dataset_of(data, batch_size)
        n = len(dataset)  # type: ignore[arg-type]
        check_delta(target_delta, n)
        sample_rate = b / n
        steps = epochs * max(1, round(1.0 / sample_rate))
        sigma = calibrate_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, self.accountant.mechanism)
        if kwargs.get("strategy", "global") == "per_layer" and not kwargs.get("layer_noise_multipliers"):
            # D equal multipliers compose to sigma / sqrt(D) (SPEC §3.4).
            probe = BoundEngine(module, input_shape, resolve_input_bound(module, kwargs.get("input_bound"))[0], 1.0)
            sigma *= math.sqrt(len(probe.compute().layers))
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data=dataset,
            loss=loss,
            noise_multiplier=sigma,
            input_shape=input_shape,
            batch_size=b,
            **kwargs,
        )

    def get_epsilon(self, delta: float) -> float:
        return self.accountant.get_epsilon(delta)
