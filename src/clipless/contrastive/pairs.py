"""Positive pairs for contrastive pre-training: two augmentations of one image, or given pairs.

One pair is one record of the privacy analysis (spec §1): the Poisson loader samples pairs, and both
views of a pair come from the same source record.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils.data import Dataset

from ..data.datasets import check_finite, tensors_fingerprint
from ..privacy.certified import is_whole
from ..privacy.input_guard import row_digests

__all__ = ["crop_flip", "random_crop_flip", "gaussian_blur", "AugmentedPairs", "GivenPairs"]


def crop_flip(images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, mirror: torch.Tensor,
              padding: int) -> torch.Tensor:
    """Per image ``k``: zero-pad by ``padding``, crop back to the original size at offset ``(dy[k], dx[k])``
    (each in ``[0, 2 padding]``), and mirror left-right where ``mirror[k]``.  ``images`` is ``(n, C, H, W)``."""
    if images.dim() != 4:
        raise ValueError(f"images must be (n, C, H, W), got {images.dim()}-d images")  # no batch size: it is secret
    if padding < 0:
        raise ValueError("padding must be >= 0")
    n, c, h, w = images.shape
    out = images
    if padding > 0 and n > 0:
        padded = torch.nn.functional.pad(images, (padding,) * 4)
        rows = (dy[:, None] + torch.arange(h))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w))[:, None, None, :]
        out = padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    if n > 0:
        out = torch.where(mirror.bool()[:, None, None, None], out.flip(-1), out)
    return out


def random_crop_flip(
    images: torch.Tensor, padding: int = 2, flip: bool = True, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """:func:`crop_flip` at uniform offsets, mirrored with probability 1/2 (if ``flip``), drawn from ``generator``."""
    n = images.shape[0] if images.dim() == 4 else 0
    dy = torch.randint(0, 2 * max(padding, 0) + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * max(padding, 0) + 1, (n,), generator=generator)
    mirror = (torch.rand(n, generator=generator) < 0.5) if flip else torch.zeros(n, dtype=torch.bool)
    return crop_flip(images, dy, dx, mirror, padding)


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor, radius: int = 2) -> torch.Tensor:
    """Blur image ``k`` with a normalized Gaussian kernel of width ``sigma[k]`` (``sigma[k] = 0``: unchanged),
    ``(2 radius + 1)^2`` taps, reflected borders.  ``images`` is ``(n, C, H, W)``."""
    if images.dim() != 4:
        raise ValueError(f"images must be (n, C, H, W), got {images.dim()}-d images")  # no batch size: it is secret
    n, c, h, w = images.shape
    if n == 0:
        return images
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype)
    s = sigma.to(images.dtype).clamp_min(1e-6)[:, None]
    taps = torch.exp(-0.5 * (offsets[None, :] / s) ** 2)
    taps = taps / taps.sum(1, keepdim=True)  # (n, 2r + 1); sigma -> 0 gives the identity tap
    kernel = (taps[:, :, None] * taps[:, None, :]).repeat_interleave(c, 0)[:, None]  # (n C, 1, k, k)
    mode = "reflect" if min(h, w) > radius else "replicate"
    padded = torch.nn.functional.pad(images.reshape(1, n * c, h, w), (radius,) * 4, mode=mode)
    return torch.nn.functional.conv2d(padded, kernel, groups=n * c).reshape(n, c, h, w)


class AugmentedPairs(Dataset):
    """``(aug(x), aug(x))`` for every image ``x``, with fresh random crops and flips at each access, and
    optionally (SimCLR-style) a Gaussian blur with probability 1/2 (``blur``: width uniform in
    ``[0.1, blur]`` pixels) and additive Gaussian pixel noise (standard deviation ``pixel_noise``).

    The augmentations of a record depend only on a secret key, the record's own content and how many
    times it was drawn, never on which other records are present or on batch order (spec §1, §7): with
    ``seed=None`` the key comes from OS entropy; an integer ``seed`` makes them reproducible (experiments).
    Each draw is keyed BLAKE2b of (record digest, draw count): 16 bytes for two crops, two flips and two
    blurs; the pixel noise of a draw comes from a generator seeded by a second keyed digest.
    """

    def __init__(self, images: torch.Tensor, padding: int = 2, flip: bool = True, seed: Optional[int] = None,
                 blur: float = 0.0, pixel_noise: float = 0.0) -> None:
        if images.dim() != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
        side = min(images.shape[-2:])
        if not is_whole(padding) or not 0 <= padding < side:
            # a shift of a whole side or more crops views that are mostly or wholly the zero padding
            raise ValueError(f"padding (the random-crop shift) must be an integer in [0, {side}) for "
                             f"{tuple(images.shape[-2:])} images, got {padding!r}")
        self.check_settings(blur, pixel_noise)
        check_finite(images, "images")
        self.images, self.padding, self.flip = images, int(padding), bool(flip)
        self.blur, self.pixel_noise = float(blur), float(pixel_noise)
        self.key = os.urandom(32) if seed is None else hashlib.sha256(f"clipless-pairs:{int(seed)}".encode()).digest()
        contiguous = images.detach().cpu().contiguous()
        self._digests = [hashlib.blake2b(contiguous[i].numpy().tobytes(), digest_size=16).digest()
                         for i in range(contiguous.shape[0])]
        self.draws = torch.zeros(len(self._digests), dtype=torch.int64)

    @staticmethod
    def check_settings(blur: float, pixel_noise: float) -> None:
        """Refuse a blur width outside ``{0} u [0.1, 10]`` pixels and a negative or non-finite noise level."""
        if not (blur == 0.0 or 0.1 <= blur <= 10.0):
            raise ValueError(f"blur is the largest blur width in pixels: 0 (off) or in [0.1, 10], got {blur}")
        if not (0.0 <= pixel_noise < float("inf")):
            raise ValueError(f"pixel_noise must be finite and >= 0, got {pixel_noise}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        a, b = self.gather([index])
        return a[0], b[0]

    def _draw(self, indices: List[int]) -> Tuple[torch.Tensor, List[int]]:
        """``(n, 8)`` per-record draws from the 16-bit words of the record's keyed digest (dy, dx, mirror for
        each view, then one blur word per view), and per record a 64-bit seed for its pixel noise."""
        buffer, noise_seeds = bytearray(), []
        for i in indices:
            count = int(self.draws[i])
            self.draws[i] = count + 1
            message = self._digests[i] + count.to_bytes(8, "little")
            buffer += hashlib.blake2b(message, key=self.key, digest_size=16).digest()
            if self.pixel_noise > 0:
                seed = hashlib.blake2b(message + b"noise", key=self.key, digest_size=8).digest()
                noise_seeds.append(int.from_bytes(seed, "little") >> 1)
        words = torch.frombuffer(buffer, dtype=torch.int16).to(torch.int64).reshape(len(indices), 8) & 0xFFFF
        span = torch.tensor([2 * self.padding + 1, 2 * self.padding + 1, 2] * 2 + [1 << 16] * 2)
        draws = words % span
        if not self.flip:
            draws[:, [2, 5]] = 0
        return draws, noise_seeds

    def _view(self, x: torch.Tensor, d: torch.Tensor, blur_words: torch.Tensor) -> torch.Tensor:
        out = crop_flip(x, d[:, 0], d[:, 1], d[:, 2], self.padding)
        if self.blur > 0:
            # Lowest bit: blur or not (probability 1/2); the other 15 bits: the width, uniform in [0.1, blur].
            width = 0.1 + (self.blur - 0.1) * (blur_words >> 1).to(torch.float64) / float((1 << 15) - 1)
            out = gaussian_blur(out, torch.where(blur_words & 1 == 1, width, torch.zeros_like(width)))
        return out

    def gather(self, indices: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        x = self.images[torch.as_tensor(indices, dtype=torch.long)]
        d, noise_seeds = self._draw(list(indices))
        a, b = self._view(x, d[:, 0:3], d[:, 6]), self._view(x, d[:, 3:6], d[:, 7])
        if self.pixel_noise > 0 and noise_seeds:
            noise = torch.stack([torch.randn((2,) + tuple(x.shape[1:]), generator=torch.Generator().manual_seed(s),
                                             dtype=x.dtype) for s in noise_seeds])
            a, b = a + self.pixel_noise * noise[:, 0], b + self.pixel_noise * noise[:, 1]
        return a, b

    def fingerprint(self) -> str:
        """A digest of the records, in order (a pre-training resume on other records is refused)."""
        digest = hashlib.blake2b(f"{self.images.dtype}{tuple(self.images.shape)}".encode(), digest_size=16)
        for record in self._digests:
            digest.update(record)
        return digest.hexdigest()

    def record_tensors(self) -> Tuple[torch.Tensor, ...]:
        """The tensor that holds the records (held-out images stored in the same memory are refused)."""
        return (self.images,)

    def state_dict(self) -> dict:
        """Key and draw counts: resuming from them repeats the augmentations exactly.  The counts say how often
        the sampling took each record, so they are as secret as the batches: the pre-trainer's checkpoint keeps
        them only for a seeded run."""
        return {"key": self.key, "draws": self.draws.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["draws"].shape != self.draws.shape:
            raise ValueError("augmentation state is for another number of records")
        self.key, self.draws = bytes(state["key"]), state["draws"].clone()


def _crossed_pair(xa: torch.Tensor, xb: torch.Tensor, candidates: int = 8) -> Optional[Tuple[int, int]]:
    """``(i, j)``, ``j != i``, where ``xb[i]`` equals ``xa[j]`` exactly and differs from ``xa[i]``: a second view
    taken from another pair's record.  Equal records stored twice (``xa[i] == xa[j]``) are no such pair, and views
    or modalities of one record never equal another record, and a constant row is a placeholder.  Row digests find
    the candidates (up to ``candidates`` per digest), exact comparison decides."""
    n = int(xa.shape[0])
    if n < 2:
        return None
    fa, fb = xa.detach().reshape(n, -1), xb.detach().reshape(n, -1)
    firsts: Dict[int, List[int]] = {}
    for j, d in enumerate(row_digests(fa).tolist()):
        firsts.setdefault(d, []).append(j)
    for i, d in enumerate(row_digests(fb).tolist()):
        others = firsts.get(d)
        # a constant row (zeros for a missing modality, say) is a placeholder, not another record's data
        if not others or torch.equal(fb[i], fa[i]) or bool((fb[i] == fb[i][0]).all()):
            continue
        j = next((j for j in others[:candidates] if j != i and torch.equal(fb[i], fa[j])), None)
        if j is not None:
            return i, j
    return None


class GivenPairs(Dataset):
    """Pairs ``(xa[i], xb[i])`` supplied by the user (e.g. two modalities of one record)."""

    def __init__(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        if xa.shape != xb.shape:
            raise ValueError(f"pair sides differ in shape: {tuple(xa.shape)} vs {tuple(xb.shape)}")
        check_finite(xa, "first views")
        check_finite(xb, "second views")
        crossed = _crossed_pair(xa, xb)
        if crossed is not None:
            i, j = crossed
            raise ValueError(f"the second view of pair {i} is the first view of pair {j}: a pair is one record (two "
                             "views or modalities of it), and one made with another record (a positive of the same "
                             "class, say) puts that record in two pairs, whose privacy is then that of two records, "
                             "outside the reported epsilon; pair each record with a view of itself")
        self.xa, self.xb = xa, xb

    def __len__(self) -> int:
        return int(self.xa.shape[0])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.xa[index], self.xb[index]

    def gather(self, indices: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.xa[idx], self.xb[idx]

    def fingerprint(self) -> str:
        """A digest of the pairs, in order (a pre-training resume on other records is refused)."""
        return tensors_fingerprint(self.xa, self.xb)

    def record_tensors(self) -> Tuple[torch.Tensor, ...]:
        """The tensors that hold the records (held-out pairs stored in the same memory are refused)."""
        return self.xa, self.xb
