"""Random image augmentations for augmentation multiplicity (the private step's ``K`` rows per example).

Each augmented row must stay within the input bound the private step checks: a zero-filled translation drops
pixels and a horizontal flip permutes them, so neither increases an image's Euclidean norm.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..privacy.certified import whole_number

__all__ = ["ImageAugmentation"]


class ImageAugmentation:
    """Per-example random translation by up to ``shift`` pixels (zero fill) and, with ``flip``, a random
    horizontal flip, of a batch ``(B, C, H, W)``.  Never increases an example's norm."""

    def __init__(self, shift: int = 2, flip: bool = False) -> None:
        self.shift, self.flip = whole_number(shift, "shift", 0), bool(flip)

    def __call__(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"image augmentation needs a batch of shape (B, C, H, W), got {tuple(x.shape)}")
        b, _, h, w = x.shape
        device = generator.device if generator is not None else torch.device("cpu")
        if self.shift > 0:
            s = self.shift
            dy = torch.randint(0, 2 * s + 1, (b,), generator=generator, device=device).to(x.device)
            dx = torch.randint(0, 2 * s + 1, (b,), generator=generator, device=device).to(x.device)
            padded = F.pad(x, (s, s, s, s))
            rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (B, H, 1)
            cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (B, 1, W)
            index = torch.arange(b, device=x.device)[:, None, None]
            x = padded.permute(0, 2, 3, 1)[index, rows, cols].permute(0, 3, 1, 2)  # (B, C, H, W) crops
        if self.flip:
            flip = torch.rand(b, generator=generator, device=device).to(x.device) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return x.contiguous()

    def __repr__(self) -> str:
        return f"ImageAugmentation(shift={self.shift}, flip={self.flip})"
