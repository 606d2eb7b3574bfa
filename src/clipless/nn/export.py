"""Export for deployment: a trained clipless model as a plain ``nn.Sequential`` of standard torch layers.

The projected weights are baked into ``nn.Linear`` / ``nn.Conv2d``; the activations and pools become standard
layers computing the same function, so the result is loadable (``torch.export``, ``state_dict``) without
clipless:

* MaxMin / GroupSort(2) on pairs ``(a, b)``: ``max = relu(a - b) + relu(b) - relu(-b)``,
  ``min = relu(a) - relu(-a) - relu(a - b)``, i.e. a fixed linear map (``nn.Linear``, or a 1x1 ``nn.Conv2d`` on
  feature maps), ``nn.ReLU`` and a second fixed linear map (equal up to float rounding);
* L2-norm pooling: ``nn.LPPool2d(2, k)`` (the training layer's ``sqrt(s + eps) - sqrt(eps)`` differs from
  ``sqrt(s)`` by at most ``sqrt(eps)`` = 1e-5 per output);
* scaled average pooling: ``nn.AvgPool2d(k, divisor_override=k)``; layer centering over the features: a fixed
  ``nn.Linear``.

``InputNormClip`` has no standard-layer equivalent: it is dropped only when the caller states that deployment
inputs are within its norm (``inputs_within_bound=True``), where it is the identity.  Residual blocks and
permutations (ResNet, MLP-Mixer) are not sequential: they are refused with the layer named.
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import torch
from torch import nn

from .clipping import AdaptiveLossGradientClip, LossGradientClip
from .conv import LipschitzConv2d, OrthogonalConv2d
from .layers import GroupSort, InputNormClip, L2NormPool2d, LayerCentering, MaxMin, ScaledAvgPool2d
from .linear import LipschitzLinear

__all__ = ["export"]


def _pair_sort(dim: int, ndim: int, channels: int, descending: bool) -> List[nn.Module]:
    """Standard layers sorting adjacent feature pairs ``(2j, 2j + 1)`` along ``dim`` of an ``ndim``-d batch."""
    pairs = channels // 2
    first = torch.zeros(5 * pairs, channels)
    second = torch.zeros(channels, 5 * pairs)
    for j in range(pairs):
        a, b, r = 2 * j, 2 * j + 1, 5 * j
        first[r, a], first[r, b] = 1.0, -1.0  # a - b
        first[r + 1, b], first[r + 2, b] = 1.0, -1.0  # b, -b
        first[r + 3, a], first[r + 4, a] = 1.0, -1.0  # a, -a
        big, small = (a, b) if descending else (b, a)
        second[big, r], second[big, r + 1], second[big, r + 2] = 1.0, 1.0, -1.0  # relu(a-b) + b
        second[small, r + 3], second[small, r + 4], second[small, r] = 1.0, -1.0, -1.0  # a - relu(a-b)
    dim = dim % ndim
    if dim == ndim - 1:
        maps = [nn.Linear(channels, 5 * pairs, bias=False), nn.Linear(5 * pairs, channels, bias=False)]
        weights = [first, second]
    elif dim == 1 and ndim == 4:
        maps = [nn.Conv2d(channels, 5 * pairs, 1, bias=False), nn.Conv2d(5 * pairs, channels, 1, bias=False)]
        weights = [first[:, :, None, None], second[:, :, None, None]]
    else:
        raise ValueError(f"no standard layer sorts pairs along dim {dim} of a {ndim}-d input")
    with torch.no_grad():
        for layer, w in zip(maps, weights):
            layer.weight.copy_(w)
    return [maps[0], nn.ReLU(), maps[1]]


def _with_parameters_of(source: nn.Module, target: nn.Module) -> List[nn.Module]:
    with torch.no_grad():
        target.weight.copy_(source.weight)
        if source.bias is not None:
            target.bias.copy_(source.bias)
    return [target]


def _convert(layer: nn.Module, shape: torch.Size, inputs_within_bound: bool) -> List[nn.Module]:
    if isinstance(layer, LipschitzLinear):
        return _with_parameters_of(layer, nn.Linear(layer.in_features, layer.out_features,
                                                    bias=layer.bias is not None))
    if isinstance(layer, LipschitzConv2d):
        return _with_parameters_of(layer, nn.Conv2d(
            layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride, padding=layer.padding,
            padding_mode=layer.padding_mode, bias=layer.bias is not None))
    if isinstance(layer, OrthogonalConv2d):
        target = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, padding=layer.kernel_size // 2,
                           padding_mode=layer.padding_mode, bias=False)
        with torch.no_grad():
            target.weight.copy_(layer.kernel())
        return [target]
    if isinstance(layer, GroupSort):  # MaxMin is a GroupSort(2) with the larger value first
        if layer.group_size != 2:
            raise ValueError(f"{layer!r}: sorting groups of {layer.group_size} has no standard-layer equivalent "
                             "(groups of 2 have); use activation maxmin or groupsort2")
        dim = layer.dim % len(shape)
        return _pair_sort(dim, len(shape), shape[dim], descending=isinstance(layer, MaxMin))
    if isinstance(layer, L2NormPool2d):
        return [nn.LPPool2d(2, layer.kernel_size)]
    if isinstance(layer, ScaledAvgPool2d):
        return [nn.AvgPool2d(layer.kernel_size, stride=layer.kernel_size, divisor_override=layer.kernel_size)]
    if isinstance(layer, LayerCentering) and layer.dims in (None, (-1,), (len(shape) - 1,)) and (
            layer.dims is not None or len(shape) == 2):
        n = shape[-1]
        centre = nn.Linear(n, n, bias=False)
        with torch.no_grad():
            centre.weight.copy_(torch.eye(n) - 1.0 / n)
        return [centre]
    if isinstance(layer, (LossGradientClip, AdaptiveLossGradientClip)):
        return []  # the identity in the forward: they act on the training backward only
    if isinstance(layer, InputNormClip):
        if inputs_within_bound:
            return []
        raise ValueError(f"{layer!r} has no standard-layer equivalent; export(..., inputs_within_bound=True) drops "
                         f"it when deployment inputs have norm <= {layer.max_norm} (there it is the identity)")
    if type(layer).__module__.startswith("torch.nn.modules") and not any(True for _ in layer.parameters()):
        return [copy.deepcopy(layer)]  # Flatten, Identity, ReLU, ...
    raise ValueError(f"{type(layer).__name__} cannot be exported to standard sequential layers (residual blocks and "
                     "permutations are not sequential); export supports the mlp, cnn and vgg builders")


@torch.no_grad()
def export(model: nn.Module, input_shape: Sequence[int], inputs_within_bound: bool = False) -> nn.Sequential:
    """``nn.Sequential`` of standard torch layers computing ``model``'s function with its current (projected)
    weights, in eval mode and without gradients; ``input_shape`` is one example's shape.  Loadable without
    clipless, e.g. ``torch.export.save(torch.export.export(export(model, shape), (x,)), "model.pt2")``."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"export needs an nn.Sequential model (the clipless builders make one), got "
                         f"{type(model).__name__}")
    first = next(model.parameters(), None)
    x = torch.zeros((1, *input_shape), dtype=first.dtype if first is not None else torch.get_default_dtype(),
                    device=first.device if first is not None else "cpu")
    layers: List[nn.Module] = []
    was_training = model.training
    model.eval()
    try:
        for layer in model:
            layers += _convert(layer, x.shape, inputs_within_bound)
            x = layer(x)
    finally:
        model.train(was_training)
    out = nn.Sequential(*layers).to(x.device).eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out
