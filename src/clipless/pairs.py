"""Positive pairs for contrastive pre-training: two augmentations of one image, or given pairs.

One pair is one record of the privacy analysis (SPEC §1): the Poisson loader samples pairs, and both
views of a pair come from the same source record.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.utils.data import Dataset

from .data import check_finite

__all__ = ["random_crop_flip", "AugmentedPairs", "GivenPairs"]


def random_crop_flip(
    images: torch.Tensor, padding: int = 2, flip: bool = True, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Per image: zero-pad by ``padding``, crop back to the original size at a uniform offset, and mirror
    left-right with probability 1/2.  ``images`` is ``(n, C, H, W)``."""
    if images.dim() != 4:
        raise ValueError(f"images must be (n, C, H, W), got shape {tuple(images.shape)}")
    if padding < 0:
        raise ValueError("padding must be >= 0")
    n, c, h, w = images.shape
    out = images
    if padding > 0 and n > 0:
        padded = torch.nn.functional.pad(images, (padding,) * 4)
        dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
        dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
        rows = (dy[:, None] + torch.arange(h))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w))[:, None, None, :]
        out = padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    if flip and n > 0:
        mirror = (torch.rand(n, generator=generator) < 0.5)[:, None, None, None]
        out = torch.where(mirror, out.flip(-1), out)
    return out


class AugmentedPairs(Dataset):
    """``(aug(x), aug(x))`` for every image ``x``, with fresh random crops and flips at each access."""

    def __init__(self, images: torch.Tensor, padding: int = 2, flip: bool = True,
                 generator: Optional[torch.Generator] = None) -> None:
        if images.dim() != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
        check_finite(images, "images")
        self.images, self.padding, self.flip = images, int(padding), bool(flip)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        a, b = self.gather([index])
        return a[0], b[0]

    def gather(self, indices: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        x = self.images[torch.as_tensor(indices, dtype=torch.long)]
        return (random_crop_flip(x, self.padding, self.flip, self.generator),
                random_crop_flip(x, self.padding, self.flip, self.generator))


class GivenPairs(Dataset):
    """Pairs ``(xa[i], xb[i])`` supplied by the user (e.g. two modalities of one record)."""

    def __init__(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        if xa.shape != xb.shape:
            raise ValueError(f"pair sides differ in shape: {tuple(xa.shape)} vs {tuple(xb.shape)}")
        check_finite(xa, "first views")
        check_finite(xb, "second views")
        self.xa, self.xb = xa, xb

    def __len__(self) -> int:
        return int(self.xa.shape[0])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.xa[index], self.xb[index]

    def gather(self, indices: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.xa[idx], self.xb[idx]
