"""A model of standard torch layers rebuilt from clipless layers, as Opacus' ``ModuleValidator.fix`` rebuilds a model
for DP-SGD: the other direction of :func:`~clipless.nn.export.export`.

* ``nn.Linear`` -> :class:`LipschitzLinear`, ``nn.Conv2d`` -> :class:`LipschitzConv2d` (same shapes, the weights
  copied, then projected to the layers' constraint: ``||W||_2 <= 1``, ``||b|| <= bias_bound``);
* ``nn.MaxPool2d(k)`` -> :class:`L2NormPool2d` ``(k)`` and ``nn.AvgPool2d(k)`` -> :class:`ScaledAvgPool2d` ``(k)``,
  for disjoint ``k x k`` windows (both 1-Lipschitz with ``||f(x)|| <= ||x||``);
* activations with a certified constant (``ReLU``, ``Tanh``, ``GELU``, ...) stay, or become :class:`MaxMin`
  (``activation="maxmin"``: gradient-norm preserving, the Lipschitz networks' usual choice);
* normalization and dropout have no per-example constant (batch statistics mix the examples; a division by a
  per-example deviation is unbounded; dropout rescales by ``1/(1-p)``): refused, or replaced by ``nn.Identity``
  with a warning when ``drop_unbounded=True``.

Anything else is left as it is; :class:`~clipless.privacy.bounds.BoundEngine` (``make_private``) then names every
layer that declares no bounds.  The weights are only the starting point of training: projecting a trained weight
onto the constraint changes the function it computes.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..privacy.bounds import torch_layer_bound
from ..privacy.modules import project_all_
from .conv import LipschitzConv2d
from .layers import L2NormPool2d, MaxMin, ScaledAvgPool2d
from .linear import LipschitzLinear

__all__ = ["to_lipschitz", "ACTIVATIONS"]

ACTIVATIONS = ("keep", "maxmin")

_UNBOUNDED: Tuple[type, ...] = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                                nn.modules.instancenorm._InstanceNorm, nn.modules.dropout._DropoutNd,
                                nn.AlphaDropout, nn.FeatureAlphaDropout)


def _certified_activation(m: nn.Module) -> bool:
    """A torch activation whose constant the bound engine certifies (the engine's own list, not a copy of it)."""
    return type(m).__module__ == nn.ReLU.__module__ and torch_layer_bound(m, 1.0, (1,)) is not None


def _with_weights_of(layer: nn.Module, m: nn.Module) -> nn.Module:
    """``layer`` holding ``m``'s weight and bias (projected later, with the whole model)."""
    with torch.no_grad():
        layer.weight.copy_(m.weight)
        if m.bias is not None:
            layer.bias.copy_(m.bias)  # type: ignore[union-attr]
    return layer


def _linear(m: nn.Linear) -> nn.Module:
    return _with_weights_of(LipschitzLinear(m.in_features, m.out_features, bias=m.bias is not None), m)


def _square(value: object, name: str) -> int:
    pair = value if isinstance(value, tuple) else (value, value)
    if len(pair) != 2 or pair[0] != pair[1]:
        raise _Unconvertible(f"{name} {value} differs between height and width")
    return int(pair[0])  # type: ignore[arg-type]


class _Unconvertible(ValueError):
    """A standard layer whose settings no clipless layer has."""


def _conv(m: nn.Conv2d) -> nn.Module:
    if m.groups != 1 or _square(m.dilation, "dilation") != 1:
        raise _Unconvertible("grouped or dilated convolutions have no clipless counterpart")
    if m.padding_mode not in ("zeros", "circular"):
        raise _Unconvertible(f"padding_mode {m.padding_mode!r} (LipschitzConv2d pads with zeros or circularly)")
    padding = m.padding if m.padding == "same" else _square(m.padding, "padding")
    if padding == "valid":
        padding = 0
    try:  # the builders' certificate: the smaller of the FFT and reshaped-kernel bounds
        layer = LipschitzConv2d(m.in_channels, m.out_channels, tuple(m.kernel_size), stride=_square(m.stride, "stride"),
                                padding=padding, padding_mode=m.padding_mode, bias=m.bias is not None,
                                operator_norm="fft")
    except ValueError as why:  # padding="same" with a stride or an even kernel
        raise _Unconvertible(str(why)) from None
    return _with_weights_of(layer, m)


def _pool(m: nn.Module) -> nn.Module:
    k = _square(m.kernel_size, "kernel_size")  # type: ignore[arg-type]
    stride = k if m.stride in (None, ()) else _square(m.stride, "stride")  # type: ignore[arg-type]
    if stride != k or _square(m.padding, "padding") != 0 or getattr(m, "ceil_mode", False):  # type: ignore[arg-type]
        raise _Unconvertible("only disjoint k x k windows (stride k, no padding, floor mode) are 1-Lipschitz here")
    if isinstance(m, nn.MaxPool2d):
        if _square(m.dilation, "dilation") != 1 or m.return_indices:
            raise _Unconvertible("dilated max pooling, or one returning indices")
        return L2NormPool2d(k)
    if getattr(m, "divisor_override", None) is not None:
        raise _Unconvertible("average pooling with a divisor_override")
    return ScaledAvgPool2d(k)


def to_lipschitz(module: nn.Module, activation: str = "keep", drop_unbounded: bool = False) -> nn.Module:
    """A copy of ``module`` with its standard layers replaced by their clipless counterparts (module docstring);
    ``module`` itself is left unchanged.  Raises ``ValueError`` naming every layer it cannot convert (at most
    eight) and why, unless the only ones are normalization or dropout and ``drop_unbounded`` is set."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(drop_unbounded, bool):
        raise TypeError(f"drop_unbounded must be True or False, got {drop_unbounded!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_lipschitz takes an nn.Module, got {type(module).__name__}")
    converted = copy.deepcopy(module)
    refused: List[str] = []
    dropped: List[str] = []
    rules: Dict[type, Callable[[nn.Module], nn.Module]] = {nn.Linear: _linear, nn.Conv2d: _conv,  # type: ignore
                                                           nn.MaxPool2d: _pool, nn.AvgPool2d: _pool}

    def replacement(name: str, child: nn.Module) -> Optional[nn.Module]:
        rule = rules.get(type(child))  # exact types: a subclass may compute something else
        if rule is not None:
            try:
                return rule(child)
            except _Unconvertible as why:
                refused.append(f"'{name}' ({type(child).__name__}: {why})")
                return None
        if activation == "maxmin" and _certified_activation(child):
            return MaxMin()
        if isinstance(child, _UNBOUNDED):
            if drop_unbounded:
                dropped.append(f"'{name}' ({type(child).__name__})")
                return nn.Identity()
            refused.append(f"'{name}' ({type(child).__name__}: no per-example constant; drop_unbounded=True "
                           "replaces it by nn.Identity)")
        return None

    done: Dict[int, Optional[nn.Module]] = {}  # a module used in several places is converted once, kept shared

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):  # every place, the second use of a shared module too
            if child is None:
                continue
            full = f"{prefix}{name}"
            if id(child) not in done:
                done[id(child)] = replacement(full, child)
                if done[id(child)] is None:
                    visit(child, f"{full}.")
            if done[id(child)] is not None:
                setattr(parent, name, done[id(child)])

    new_root = replacement("(the model)", converted)  # a model that is itself one layer
    if new_root is not None:
        converted = new_root
    else:
        visit(converted, "")
    if refused:
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise ValueError(f"to_lipschitz: {len(refused)} layer(s) have no clipless counterpart: "
                         f"{', '.join(refused[:8])}{more}")
    if dropped:
        warnings.warn(f"to_lipschitz replaced {', '.join(dropped)} by nn.Identity: the model computes another "
                      "function than before", UserWarning, stacklevel=2)
    return project_all_(converted)
