"""Bias-free fully connected ReLU networks with LeCun / Xavier / He / NTK initialization, and their
linearization at initialization: the models of the KL privacy study (spec §5)."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import jvp

from ..privacy.certified import whole_number

__all__ = ["INIT_SCHEMES", "init_variances", "gradient_norm_at_init", "ReLUNetwork", "relu_network_forward",
           "LinearizedNetwork"]

INIT_SCHEMES = ("lecun", "xavier", "he", "ntk")


def init_variances(widths: Sequence[int], scheme: str) -> List[float]:
    """Per-layer Gaussian weight variances ``beta_l`` for widths ``[d, m_1, ..., m_{L-1}, k]`` (spec §5).

    LeCun ``1/m_{l-1}``; He ``2/m_{l-1}``; Xavier ``2/(m_{l-1} + m_l)``; NTK ``2/m_l`` (hidden), ``1/k`` (output).
    """
    if len(widths) < 2:
        raise ValueError(f"widths must list the input, hidden and output sizes, got {list(widths)}")
    widths = [whole_number(w, f"widths[{i}]") for i, w in enumerate(widths)]  # 8.7 would build 8 and declare 8.7
    scheme = scheme.lower()
    depth = len(widths) - 1
    variances = []
    for l in range(1, depth + 1):
        fan_in, fan_out = widths[l - 1], widths[l]
        if scheme == "lecun":
            variances.append(1.0 / fan_in)
        elif scheme == "he":
            variances.append(2.0 / fan_in)
        elif scheme == "xavier":
            variances.append(2.0 / (fan_in + fan_out))
        elif scheme == "ntk":
            variances.append(1.0 / fan_out if l == depth else 2.0 / fan_out)
        else:
            raise ValueError(f"unknown initialization {scheme!r}; choose one of {INIT_SCHEMES}")
    return variances


def gradient_norm_at_init(widths: Sequence[int], scheme: str, input_norm_sq: float = 1.0) -> float:
    """``E ||grad_theta f(x)||_F^2`` at initialization for a bias-free ReLU network (spec §5).

    ``k ||x||^2 * prod_l (beta_l m_{l-1} / 2) * sum_l 2 / (d beta_l)``, ``k`` outputs, ``d`` inputs.
    """
    betas = init_variances(widths, scheme)
    d, k = widths[0], widths[-1]
    prod = math.prod(b * m / 2.0 for b, m in zip(betas, widths[:-1]))
    return k * input_norm_sq * prod * sum(2.0 / (d * b) for b in betas)


class ReLUNetwork(nn.Module):
    """Bias-free fully connected ReLU network ``f(x) = W_L relu(... relu(W_1 x))`` with a Gaussian initialization."""

    def __init__(self, widths: Sequence[int], init: str = "lecun", generator: Optional[torch.Generator] = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        betas = init_variances(widths, init)
        self.widths = [int(w) for w in widths]
        self.init = init
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(m_out, m_in, generator=generator, dtype=dtype) * math.sqrt(beta))
            for m_in, m_out, beta in zip(self.widths[:-1], self.widths[1:], betas)
        )

    def forward(self, x: Tensor) -> Tensor:
        return relu_network_forward(list(self.weights), x)


def relu_network_forward(weights: Sequence[Tensor], x: Tensor) -> Tensor:
    h = x
    for W in weights[:-1]:
        h = torch.relu(h @ W.T)
    return h @ weights[-1].T


class LinearizedNetwork(nn.Module):
    """First-order expansion at initialization, ``f_lin(theta, x) = f(theta_0, x) + J_{theta_0}(x) (theta - theta_0)``.

    Evaluated with one forward-mode ``torch.func.jvp``; its parameter gradient is ``J_{theta_0}(x)^T``, constant in time.
    """

    def __init__(self, network: ReLUNetwork) -> None:
        super().__init__()
        self.reference = [w.detach().clone() for w in network.weights]
        self.weights = nn.ParameterList(nn.Parameter(w.clone()) for w in self.reference)
        self.widths = list(network.widths)
        self.init = network.init

    def forward(self, x: Tensor) -> Tensor:
        tangents = tuple(w - w0 for w, w0 in zip(self.weights, self.reference))
        out, directional = jvp(lambda *ws: relu_network_forward(ws, x), tuple(self.reference), tangents)
        return out + directional


