"""Positive pairs (clipless.contrastive.pairs): crops, flips, blur and pixel noise of AugmentedPairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clipless.contrastive.pairs import AugmentedPairs, GivenPairs, gaussian_blur


def test_gaussian_blur_matches_a_direct_convolution_and_keeps_constants() -> None:
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(3, 2, 9, 7, generator=gen, dtype=torch.float64)
    sigma = torch.tensor([0.0, 0.7, 2.0], dtype=torch.float64)
    out = gaussian_blur(images, sigma)
    torch.testing.assert_close(out[0], images[0])  # width 0: unchanged
    for k in (1, 2):
        taps = torch.exp(-0.5 * (torch.arange(-2, 3, dtype=torch.float64) / sigma[k]) ** 2)
        kernel = torch.outer(taps, taps) / taps.sum() ** 2
        padded = F.pad(images[k : k + 1], (2, 2, 2, 2), mode="reflect")
        expected = F.conv2d(padded.transpose(0, 1), kernel[None, None]).transpose(0, 1)
        torch.testing.assert_close(out[k : k + 1], expected)
    flat = torch.full((2, 1, 5, 5), 0.3, dtype=torch.float64)
    torch.testing.assert_close(gaussian_blur(flat, torch.tensor([0.5, 3.0])), flat)  # taps sum to 1
    assert float(out[2].diff(dim=-1).abs().sum()) < float(images[2].diff(dim=-1).abs().sum())  # it smooths


def test_blur_and_noise_draws_follow_their_settings() -> None:
    images = torch.zeros(400, 1, 8, 8)
    images[:, :, 3:5, 3:5] = 1.0
    images[:, 0, 4, 4] += torch.arange(400) / 1000  # distinct records (identical ones share their draws)
    noisy = AugmentedPairs(images, padding=0, flip=False, seed=0, pixel_noise=0.5)
    a, b = noisy.gather(list(range(400)))
    residual = torch.cat([a - images, b - images])
    assert abs(float(residual.std()) - 0.5) < 0.01 and abs(float(residual.mean())) < 0.01
    assert not torch.equal(a, b)  # the two views get their own noise
    blurred = AugmentedPairs(images, padding=0, flip=False, seed=0, blur=2.0)
    a, _ = blurred.gather(list(range(400)))
    changed = (a - images).abs().flatten(1).amax(1) > 1e-6
    assert 0.4 < float(changed.double().mean()) < 0.6  # blurred with probability 1/2
    torch.testing.assert_close(a.sum((1, 2, 3)), images.sum((1, 2, 3)), atol=1e-4, rtol=0)  # mass kept inside
    plain = AugmentedPairs(images, padding=0, flip=False, seed=0)
    assert torch.equal(plain.gather([0, 1])[0], images[:2])


def test_seeded_augmentations_repeat_and_secret_ones_differ() -> None:
    images = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    one, two = (AugmentedPairs(images, padding=2, seed=3, blur=1.0, pixel_noise=0.1) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(one.gather(list(range(16))), two.gather(list(range(16)))))
    secret, other = (AugmentedPairs(images, padding=2, blur=1.0, pixel_noise=0.1) for _ in range(2))
    assert not torch.equal(secret.gather(list(range(16)))[0], other.gather(list(range(16)))[0])
    # crops and flips of a seeded run do not change when blur or noise are switched on (same words)
    crops = AugmentedPairs(images, padding=2, seed=3)._draw(list(range(16)))[0][:, :6]
    assert torch.equal(crops, AugmentedPairs(images, padding=2, seed=3, blur=1.0)._draw(list(range(16)))[0][:, :6])


@pytest.mark.parametrize("kwargs,match", [({"blur": 0.05}, "blur"), ({"blur": float("nan")}, "blur"),
                                          ({"pixel_noise": -0.1}, "pixel_noise"),
                                          ({"pixel_noise": float("inf")}, "pixel_noise"),
                                          # a shift of the whole side or more gave views of padding alone
                                          ({"padding": 8}, r"padding .* in \[0, 8\)"), ({"padding": -1}, "padding"),
                                          ({"padding": 1.5}, "padding"), ({"padding": True}, "padding")])
def test_bad_augmentation_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        AugmentedPairs(torch.rand(4, 1, 8, 8), **kwargs)


def test_given_pairs_whose_second_view_is_another_pairs_record_are_refused() -> None:
    """A pair is one record: ``GivenPairs(x, x[partner])`` (a positive of the same class, as supervised
    contrastive learning pairs them) passed, and put each partner in two pairs, outside the add/remove-one-pair
    accounting. Refused now; a record with itself, views of it, equal records stored twice and constant placeholder
    rows (a missing modality) pass."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 6, generator=gen)
    partner = torch.arange(40).roll(1)
    with pytest.raises(ValueError, match="the second view of pair 0 is the first view of pair 39"):
        GivenPairs(x, x[partner])
    one_crossed = x.clone()
    one_crossed[17] = x[3]
    with pytest.raises(ValueError, match="pair 17 is the first view of pair 3"):
        GivenPairs(x, one_crossed)
    twice = torch.cat([x[:20], x[:20]])
    missing = x.clone()
    missing[5] = 0.0
    placeholders = torch.zeros(40, 6)
    for xa, xb in ((x, x.clone()), (x, x + 0.01 * torch.rand(40, 6, generator=gen)), (twice, twice.flip(1).flip(1)),
                   (missing, placeholders), (placeholders, placeholders)):
        assert len(GivenPairs(xa, xb)) == 40
