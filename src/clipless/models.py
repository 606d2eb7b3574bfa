"""Model builders made only of bounded layers, and the loss registry used by the CLI."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torch import nn

from .layers import (
    GroupSort,
    InputNormClip,
    L2NormPool2d,
    LipschitzConv2d,
    LipschitzLinear,
    MaxMin,
    ScaledAvgPool2d,
)
from .losses import (
    BinaryCrossEntropyWithTemperature,
    CrossEntropyWithTemperature,
    KCosineSimilarity,
    LipschitzLoss,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    TauCrossEntropy,
)

__all__ = ["lipschitz_mlp", "lipschitz_cnn", "build_model", "build_loss", "MODELS", "LOSSES"]


def _activation(name: str) -> nn.Module:
    if name == "maxmin":
        return MaxMin()
    if name.startswith("groupsort"):
        return GroupSort(int(name[len("groupsort") :] or 2))
    raise ValueError(f"unknown activation {name!r} (maxmin, groupsort4, ...)")


def lipschitz_mlp(
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] = (256, 256),
    input_clip: Optional[float] = None,
    activation: str = "maxmin",
    projection: str = "bjorck",
    bias: bool = False,
    input_pool: int = 1,
) -> nn.Sequential:
    """``[InputNormClip] -> [ScaledAvgPool2d] -> Flatten -> (LipschitzLinear -> MaxMin)* -> LipschitzLinear``.

    1-Lipschitz.  ``input_pool=k`` first sums disjoint ``k x k`` pixel windows
    (scaled by ``1/k``, a fixed 1-Lipschitz map): ``k^2`` times fewer weights
    in the first layer, hence less noise.
    """
    layers: list = []
    if input_clip is not None:
        layers.append(InputNormClip(input_clip))
    shape = tuple(input_shape)
    if input_pool > 1:
        if len(shape) != 3:
            raise ValueError("input_pool needs image inputs (C, H, W)")
        layers.append(ScaledAvgPool2d(input_pool))
        shape = (shape[0], shape[1] // input_pool, shape[2] // input_pool)
    layers.append(nn.Flatten())
    width = math.prod(shape)
    for h in hidden:
        layers += [LipschitzLinear(width, h, bias=bias, projection=projection), _activation(activation)]
        width = h
    layers.append(LipschitzLinear(width, num_classes, bias=bias, projection=projection))
    return nn.Sequential(*layers)


def lipschitz_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (16, 32),
    hidden: Sequence[int] = (),
    input_clip: Optional[float] = None,
    activation: str = "maxmin",
    kernel_size: int = 3,
    pool: int = 2,
    projection: str = "spectral",
    input_pool: int = 1,
    operator_norm: str = "fft",
) -> nn.Sequential:
    """``[ScaledAvgPool2d] -> (conv -> MaxMin -> L2NormPool)* -> Flatten -> dense``; every block 1-Lipschitz.

    Convolutions use the exact FFT operator-norm bound by default (``operator_norm='reshaped'``
    for the looser ``sqrt(s) ||W_mat||`` bound).
    """
    c, h, w = input_shape
    layers: list = []
    if input_clip is not None:
        layers.append(InputNormClip(input_clip))
    if input_pool > 1:
        layers.append(ScaledAvgPool2d(input_pool))
        h, w = h // input_pool, w // input_pool
    for ch in channels:
        conv = LipschitzConv2d(c, ch, kernel_size, projection=projection, operator_norm=operator_norm)
        layers += [conv, _activation(activation)]
        if pool > 1 and h >= pool and w >= pool:
            layers.append(L2NormPool2d(pool))
            h, w = h // pool, w // pool
        c = ch
    layers.append(nn.Flatten())
    width = c * h * w
    for units in hidden:
        layers += [LipschitzLinear(width, units), _activation(activation)]
        width = units
    layers.append(LipschitzLinear(width, num_classes))
    return nn.Sequential(*layers)


MODELS: Dict[str, Callable[..., nn.Module]] = {"mlp": lipschitz_mlp, "cnn": lipschitz_cnn}


def build_model(name: str, input_shape: Tuple[int, ...], num_classes: int, **kwargs: Any) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name](input_shape, num_classes, **kwargs)


LOSSES: Dict[str, Callable[..., LipschitzLoss]] = {
    "tau_ce": lambda k, **kw: TauCrossEntropy(**kw),
    "ce": lambda k, **kw: CrossEntropyWithTemperature(**kw),
    "bce": lambda k, **kw: BinaryCrossEntropyWithTemperature(**kw),
    "hinge": lambda k, **kw: MulticlassHinge(k, **kw),
    "kr": lambda k, **kw: MulticlassKR(k, **kw),
    "hkr": lambda k, **kw: MulticlassHKR(k, **kw),
    "kcosine": lambda k, **kw: KCosineSimilarity(**kw),
}


def build_loss(name: str, num_classes: int, **kwargs: Any) -> LipschitzLoss:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose from {sorted(LOSSES)}")
    return LOSSES[name](num_classes, **kwargs)
