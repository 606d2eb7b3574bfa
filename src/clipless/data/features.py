"""Data-independent feature maps applied to each example before private training.

A fixed map ``phi`` of one example (no parameter learned, no statistic of the
dataset) is pre-processing: training on ``phi(x_i)`` is as private as
training on ``x_i``, and the input bound of the private model is the bound
``phi`` guarantees.  :class:`ScatteringFeatures` is the wavelet scattering
transform (Mallat; Oyallon & Mallat) followed by a per-example group
normalization and a projection on the sphere of radius ``radius``, the
front-end that Tramer & Boneh (2021) found to give strong private linear
models on MNIST-like data.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .datasets import ArrayDataset, DataSplit

__all__ = ["ScatteringFeatures", "scattering_split"]


class ScatteringFeatures(nn.Module):
    """``x -> radius * u / ||u||`` with ``u`` = per-example group-normalized scattering coefficients.

    Scattering: order-2 Morlet scattering with ``J`` scales and ``L`` angles
    (``kymatio``), giving ``C (1 + J L + L^2 J (J - 1) / 2)`` channels at
    resolution ``H / 2^J``.  Group normalization standardizes each group of
    channels within one example (never across examples, spec §6).  Every
    output has norm exactly ``radius`` (0 only for a constant image), so
    ``radius`` is the input bound of the private model.
    """

    def __init__(self, image_shape: tuple, J: int = 2, L: int = 8, groups: int = 27, radius: float = 1.0) -> None:
        super().__init__()
        # kymatio.torch also imports the 3-D frontend, which needs a scipy.special function newer scipy lacks;
        # the 2-D frontend alone is all we use.
        from ..extras import require

        ScatteringTorch2D = require("kymatio.scattering2d.frontend.torch_frontend", "scattering").ScatteringTorch2D

        c, h, w = image_shape
        self.scattering = ScatteringTorch2D(J=J, shape=(h, w), L=L)
        self.channels = c * (1 + J * L + L * L * J * (J - 1) // 2)
        if self.channels % groups:
            raise ValueError(f"{self.channels} scattering channels do not split into {groups} groups")
        self.groups, self.radius = int(groups), float(radius)
        self.out_shape = (self.channels * (h // 2**J) * (w // 2**J),)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        s = self.scattering(x.float().contiguous()).reshape(n, self.groups, -1)
        s = (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-5)
        u = s.reshape(n, -1)
        return self.radius * u / torch.linalg.vector_norm(u, dim=1, keepdim=True).clamp_min(1e-12)


def scattering_split(
    split: DataSplit, radius: float = 1.0, chunk: int = 2000, progress: bool = False, **kwargs: int
) -> DataSplit:
    """The same split with every image replaced by its :class:`ScatteringFeatures` (computed once, in chunks)."""
    train = split.train
    if not isinstance(train, ArrayDataset) or len(train.input_shape) != 3:
        raise ValueError("scattering features need an in-memory image dataset (C, H, W)")
    phi = ScatteringFeatures(train.input_shape, radius=radius, **kwargs)

    def transform(ds: ArrayDataset) -> ArrayDataset:
        starts: Iterable[int] = range(0, len(ds), chunk)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="scattering", leave=False)
        feats = torch.cat([phi(ds.features[i : i + chunk]) for i in starts])
        return ArrayDataset(feats, ds.labels)

    # the same records and classes; the input bound is now ``radius``, not the pixels' coordinate bound
    return DataSplit(name=f"{split.name}+scattering", train=transform(train), test=transform(split.test),
                     num_classes=split.num_classes)
