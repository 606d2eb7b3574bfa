"""``LipschitzLinear``: a dense layer whose spectral norm is certified at every use (spec §2)."""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..privacy.certified import (
    CertifiedValueCache,
    certified_spectral_norm,
    whole_number,
)
from ..privacy.modules import BoundedModule, LayerBound
from .functional import (affine_layer_bound, bjorck_orthonormalize, check_bias_bound, check_projection, clip_norm_,
                         rescale_to_unit_ball_)

__all__ = ["LipschitzLinear"]


class LipschitzLinear(BoundedModule):
    """Dense layer ``y = W x (+ b)`` with ``||W||_2 <= 1`` and ``||b|| <= bias_bound``.

    Bounds (spec §2): ``l = ||W||_2`` (exact), ``X -> l X + sqrt(P) ||b||``,
    weight factor ``X`` (``||d(Wx)/dW||_op = ||x||``), bias factor ``sqrt(P)``,
    where ``P`` is the number of positions the layer is applied to (1 for a
    vector input; the tokens of a ``(tokens, features)`` input, as in MLP-Mixer,
    where the per-example weight gradient ``sum_t g_t x_t^T`` still has norm
    ``<= ||G||_F ||X||_F`` by Cauchy-Schwarz).
    ``projection='bjorck'`` keeps ``W`` orthonormal (gradient-norm preserving);
    ``'spectral'`` rescales by the certified norm when ``||W||_2 > 1`` and keeps the stored weight's bound,
    so a step certifies each weight once.
    """

    constants = ("in_features", "out_features", "projection", "bias_bound", "_norm_cache")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        bias_bound: float = 1.0,
        projection: str = "bjorck",
        bjorck_iters: int = 30,
    ) -> None:
        super().__init__()
        self.in_features = whole_number(in_features, "in_features")
        self.out_features = whole_number(out_features, "out_features")
        self.projection = check_projection(projection)
        self.bjorck_iters = whole_number(bjorck_iters, "bjorck_iters")
        self.bias_bound = check_bias_bound(bias_bound)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.orthogonal_(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._norm_cache = CertifiedValueCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def project_(self) -> None:
        if self.projection == "bjorck":
            weight, bound = bjorck_orthonormalize(self.weight, self.bjorck_iters)
            self.weight.copy_(weight)
            self._norm_cache.put(self.weight, None, bound)
        else:
            rescale_to_unit_ball_(self.weight, self._norm_cache)
        if self.bias is not None:
            clip_norm_(self.bias, self.bias_bound)

    def get_extra_state(self) -> dict:
        return {"weight_bound": self._norm_cache.state(self.weight)}

    def set_extra_state(self, state: dict) -> None:
        self._norm_cache.restore(self.weight, state.get("weight_bound", {}),
                                 lambda key: certified_spectral_norm(self.weight, shortcut=False))

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        lip = self._norm_cache.get(self.weight, None)
        if lip is None:
            lip = self._norm_cache.put(self.weight, None, certified_spectral_norm(self.weight))
        return affine_layer_bound(lip, x_bound, x_bound, self.bias, math.prod(in_shape[:-1]))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, projection={self.projection}"
        )


