"""Model builders made only of bounded layers, and the loss registry used by the CLI."""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..privacy.modules import LipschitzLoss, Residual
from .conv import LipschitzConv2d, OrthogonalConv2d
from .layers import (
    GroupSort,
    InputNormClip,
    L2NormPool2d,
    LayerCentering,
    MaxMin,
    Permute,
    ScaledAvgPool2d,
)
from .linear import LipschitzLinear
from .losses import (
    BinaryCrossEntropyWithTemperature,
    CrossEntropyWithTemperature,
    KCosineSimilarity,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    TauCrossEntropy,
)

__all__ = [
    "check_activation",
    "lipschitz_mlp",
    "lipschitz_cnn",
    "lipschitz_vgg",
    "lipschitz_resnet",
    "lipschitz_mixer",
    "build_model",
    "build_loss",
    "build_optimizer",
    "build_lr_schedule",
    "LR_SCHEDULES",
    "MODELS",
    "LOSSES",
]


def check_activation(name: Any) -> str:
    """``name`` if it names an activation of the builders: ``maxmin``, or ``groupsortK`` (groups of ``K >= 2``
    features sorted; ``groupsort`` alone is ``groupsort2``).  Checked on its own, so that a name is refused even
    where a model has no layer to put it after (a linear head)."""
    match = re.fullmatch(r"groupsort([0-9]*)", name) if isinstance(name, str) else None
    if name != "maxmin" and (match is None or (match.group(1) and int(match.group(1)) < 2)):
        raise ValueError(f"unknown activation {name!r}: maxmin, or groupsortK with K >= 2 (groupsort4 sorts groups "
                         "of 4 features)")
    return name


def _activation(name: str, width: int, dim: int = 1) -> nn.Module:
    """The activation after a layer of ``width`` features (channels, units), refused when they do not split into its
    groups: named here, where the first forward would only say how many features there were."""
    if check_activation(name) == "maxmin":
        layer: nn.Module = MaxMin(dim)
    else:
        layer = GroupSort(int(name[len("groupsort") :] or 2), dim)
    if width % layer.group_size:  # type: ignore[operator]
        raise ValueError(f"activation {name} sorts groups of {layer.group_size} features: a layer of {width} "
                         f"features (a width or channel count) does not split into them; use multiples of "
                         f"{layer.group_size}")
    return layer


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
    check_activation(activation)  # also where no hidden layer would read it
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
        layers += [LipschitzLinear(width, h, bias=bias, projection=projection), _activation(activation, h)]
        width = h
    layers.append(LipschitzLinear(width, num_classes, bias=bias, projection=projection))
    return nn.Sequential(*layers)


def _stem(input_shape: Sequence[int], input_clip: Optional[float], input_pool: int) -> Tuple[list, int, int, int]:
    c, h, w = input_shape
    layers: list = []
    if input_clip is not None:
        layers.append(InputNormClip(input_clip))
    if input_pool > 1:
        layers.append(ScaledAvgPool2d(input_pool))
        h, w = h // input_pool, w // input_pool
    return layers, c, h, w


def _dense_head(width: int, hidden: Sequence[int], num_classes: int, activation: str) -> list:
    layers: list = [nn.Flatten()]
    for units in hidden:
        layers += [LipschitzLinear(width, units), _activation(activation, units)]
        width = units
    layers.append(LipschitzLinear(width, num_classes))
    return layers


CONVS = ("lipschitz", "orthogonal", "orthogonal_fixed")


def _conv(c_in: int, c_out: int, kernel_size: int, conv: str, operator_norm: str,
          projection: str = "spectral") -> nn.Module:
    """A stride-1 'same' convolution: ``LipschitzConv2d`` (operator norm <= 1) or ``OrthogonalConv2d`` (BCOP;
    ``orthogonal_fixed``: its spatial projectors fixed, only the channel mixing trained)."""
    if conv in ("orthogonal", "orthogonal_fixed"):
        return OrthogonalConv2d(c_in, c_out, kernel_size, train_projectors=conv == "orthogonal")
    if conv != "lipschitz":
        raise ValueError(f"conv must be one of {CONVS}, got {conv!r}")
    return LipschitzConv2d(c_in, c_out, kernel_size, projection=projection, operator_norm=operator_norm)


def _check_channels(channels: Sequence[int], model: str) -> None:
    if len(channels) == 0:
        raise ValueError(f"channels: the {model} needs at least one convolution width, got none")


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
    conv: str = "lipschitz",
) -> nn.Sequential:
    """``[ScaledAvgPool2d] -> (conv -> MaxMin -> L2NormPool)* -> Flatten -> dense``; every block 1-Lipschitz.

    Convolutions use the exact FFT operator-norm bound by default (``operator_norm='reshaped'``
    for the looser ``sqrt(s) ||W_mat||`` bound); ``conv='orthogonal'`` makes them orthogonal (BCOP).
    """
    _check_channels(channels, "cnn")
    layers, c, h, w = _stem(input_shape, input_clip, input_pool)
    for ch in channels:
        layers += [_conv(c, ch, kernel_size, conv, operator_norm, projection), _activation(activation, ch)]
        if pool > 1 and h >= pool and w >= pool:
            layers.append(L2NormPool2d(pool))
            h, w = h // pool, w // pool
        c = ch
    return nn.Sequential(*layers, *_dense_head(c * h * w, hidden, num_classes, activation))


def lipschitz_vgg(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (16, 32),
    convs_per_stage: int = 2,
    hidden: Sequence[int] = (),
    input_clip: Optional[float] = None,
    activation: str = "groupsort2",
    kernel_size: int = 3,
    input_pool: int = 1,
    operator_norm: str = "fft",
    conv: str = "lipschitz",
) -> nn.Sequential:
    """VGG-style: stages of ``convs_per_stage x (conv -> GroupSort)`` then ``L2NormPool2d(2)``; dense head.

    Every conv has operator norm <= 1 (certified, FFT bound by default), GroupSort
    and L2-norm pooling are 1-Lipschitz, so the product rule gives ``l <= 1``.
    """
    _check_channels(channels, "vgg")
    layers, c, h, w = _stem(input_shape, input_clip, input_pool)
    for ch in channels:
        for _ in range(convs_per_stage):
            layers += [_conv(c, ch, kernel_size, conv, operator_norm), _activation(activation, ch)]
            c = ch
        if h >= 2 and w >= 2:
            layers.append(L2NormPool2d(2))
            h, w = h // 2, w // 2
    return nn.Sequential(*layers, *_dense_head(c * h * w, hidden, num_classes, activation))


def lipschitz_resnet(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (16, 32),
    blocks_per_stage: int = 1,
    hidden: Sequence[int] = (),
    input_clip: Optional[float] = None,
    activation: str = "maxmin",
    kernel_size: int = 3,
    input_pool: int = 1,
    operator_norm: str = "fft",
    conv: str = "lipschitz",
) -> nn.Sequential:
    """ResNet-style: per stage a conv to the new width, ``blocks_per_stage`` residual blocks
    ``y = (x + h(x))/2`` with ``h = conv -> act -> conv``, then ``L2NormPool2d(2)``.

    The bound engine treats each block as split + merge: ``l <= 1/2 + l_h/2 <= 1``
    and parameters inside ``h`` see the gradient bound ``G/2`` (spec §2).
    """
    _check_channels(channels, "resnet")
    layers, c, h, w = _stem(input_shape, input_clip, input_pool)
    for ch in channels:
        layers += [_conv(c, ch, kernel_size, conv, operator_norm), _activation(activation, ch)]
        c = ch
        for _ in range(blocks_per_stage):
            branch = nn.Sequential(
                _conv(c, c, kernel_size, conv, operator_norm),
                _activation(activation, c),
                _conv(c, c, kernel_size, conv, operator_norm),
            )
            layers.append(Residual(branch))
        if h >= 2 and w >= 2:
            layers.append(L2NormPool2d(2))
            h, w = h // 2, w // 2
    return nn.Sequential(*layers, *_dense_head(c * h * w, hidden, num_classes, activation))


def lipschitz_mixer(
    input_shape: Sequence[int],
    num_classes: int,
    patch_size: int = 7,
    channels: int = 64,
    blocks: int = 2,
    token_hidden: int = 32,
    channel_hidden: int = 128,
    hidden: Sequence[int] = (),
    input_clip: Optional[float] = None,
    activation: str = "maxmin",
    input_pool: int = 1,
) -> nn.Sequential:
    """MLP-Mixer: patch embedding, then blocks of token mixing and channel mixing, each a residual
    ``y = (x + h(x))/2`` whose branch centers every token over its channels (per example) and applies a
    1-Lipschitz MLP along one axis.

    Patch embedding is a conv with kernel = stride = patch (disjoint patches: ``s = 1``). Token and
    channel mixing are dense maps on disjoint slices of the ``(tokens, channels)`` array: ``l = ||W||``,
    weight factor ``X`` (spec §2), the same constants as a dense layer.
    """
    layers, c, h, w = _stem(input_shape, input_clip, input_pool)
    if h % patch_size or w % patch_size:
        raise ValueError(f"image {h}x{w} is not divisible into {patch_size}x{patch_size} patches")
    tokens = (h // patch_size) * (w // patch_size)
    layers += [
        LipschitzConv2d(c, channels, patch_size, stride=patch_size, padding=0),
        nn.Flatten(2),  # (channels, tokens)
        Permute(2, 1),  # (tokens, channels)
    ]

    def mlp(width: int, inner: int) -> list:
        return [LipschitzLinear(width, inner), _activation_last(activation, inner), LipschitzLinear(inner, width)]

    for _ in range(blocks):
        token_mixing = nn.Sequential(LayerCentering(dims=-1), Permute(2, 1), *mlp(tokens, token_hidden), Permute(2, 1))
        channel_mixing = nn.Sequential(LayerCentering(dims=-1), *mlp(channels, channel_hidden))
        layers += [Residual(token_mixing), Residual(channel_mixing)]
    return nn.Sequential(*layers, *_dense_head(tokens * channels, hidden, num_classes, activation))


def _activation_last(name: str, width: int) -> nn.Module:
    """The activation grouping features along the last axis (dense maps on ``(tokens, channels)`` arrays)."""
    return _activation(name, width, dim=-1)


MODELS: Dict[str, Callable[..., nn.Module]] = {
    "mlp": lipschitz_mlp,
    "cnn": lipschitz_cnn,
    "vgg": lipschitz_vgg,
    "resnet": lipschitz_resnet,
    "mixer": lipschitz_mixer,
}


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


def build_optimizer(params: Iterable[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """``adam``, or ``sgd`` with momentum 0.9: the same choice for clipless, DP-SGD and non-private runs."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r} (adam, sgd)")


LR_SCHEDULES = ("constant", "cosine")


def build_lr_schedule(name: str, epochs: int) -> Optional[Callable[[torch.optim.Optimizer], Any]]:
    """``constant`` (None: no scheduler) or ``cosine`` (``CosineAnnealingLR`` over ``epochs``, stepped per epoch):
    the same choice for clipless, DP-SGD and non-private runs; a function of the epoch count only."""
    if name == "constant":
        return None
    if name == "cosine":
        return lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    raise ValueError(f"unknown learning-rate schedule {name!r} {LR_SCHEDULES}")


def build_loss(name: str, num_classes: int, **kwargs: Any) -> LipschitzLoss:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose from {sorted(LOSSES)}")
    return LOSSES[name](num_classes, **kwargs)
