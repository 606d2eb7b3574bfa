"""Logit-DP (spec §4): Gram pair norms vs autograd, the lambda trick vs explicit clipped sums,
sensitivity under add/remove of one pair (adversarial), Naive-DP's 2C, the trainer, errors, CLI."""

from __future__ import annotations

import copy
import math
import shutil
import warnings
from typing import Dict, Tuple

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from clipless.privacy.accounting import compute_epsilon
from clipless.privacy.certified import BoundError
from clipless.train.baselines import standard_cnn
from clipless.train.checkpoint import fingerprint_key_path, load_checkpoint, save_checkpoint
from clipless.cli import main as cli_main
from clipless.data.datasets import load_digits
from clipless.contrastive.logit_dp import (
    LOSS_FUNCTIONS,
    clip_factors,
    logit_dp_gradient,
    logit_dp_sensitivity,
    logit_gradient,
    naive_dp_gradient,
    naive_dp_sensitivity,
    normalized_embedding,
    pair_gradient_norms,
    pair_logits,
    similarity_logits,
)
from clipless.contrastive.pairs import AugmentedPairs, GivenPairs, random_crop_flip
from clipless.contrastive.evaluation import knn_accuracy, linear_probe_accuracy
from clipless.contrastive.pretrain import ContrastivePretrainer, build_encoder


def _mlp(seed: int, dims=(12, 9, 6, 4), act=nn.Tanh, scale: float = 1.0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b, bias=(i % 2 == 0)))
        if i < len(dims) - 2:
            layers.append(act())
    model = nn.Sequential(*layers).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def _pair_grads(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor) -> Dict[Tuple[int, int], torch.Tensor]:
    """g_ij = grad_w cos(Phi(xa_i), Phi(xb_j)) by autograd, one pair at a time (trainable parameters only)."""
    params = [p for p in encoder.parameters() if p.requires_grad]
    out = {}
    for i in range(xa.shape[0]):
        for j in range(xb.shape[0]):
            c = (normalized_embedding(encoder, xa[i : i + 1]) * normalized_embedding(encoder, xb[j : j + 1])).sum()
            out[i, j] = torch.cat([g.flatten() for g in torch.autograd.grad(c, params)]).double()
    return out


def _norm_matrix(grads: Dict[Tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """The (n, n) matrix of ||g_ij|| from :func:`_pair_grads`."""
    n = 1 + max(i for i, _ in grads)
    return torch.tensor([[float(grads[i, j].norm()) for j in range(n)] for i in range(n)], dtype=torch.float64)


def _grad_vector(encoder: nn.Module) -> torch.Tensor:
    """The released gradient of the trainable parameters, flat (a frozen parameter must have none)."""
    assert all(p.grad is None for p in encoder.parameters() if not p.requires_grad)
    return torch.cat([p.grad.flatten().double() for p in encoder.parameters() if p.requires_grad])


@pytest.mark.parametrize("method", ["factored", "jacobian"])
@pytest.mark.parametrize("seed", range(4))
def test_gram_pair_norms_equal_autograd(method: str, seed: int) -> None:
    act = (nn.Tanh, nn.ReLU, nn.GELU, nn.Softplus)[seed]
    enc = _mlp(seed, act=act, scale=1.0 + seed)
    gen = torch.Generator().manual_seed(seed)
    n = 3 + seed
    xa, xb = torch.randn(n, 3, 4, generator=gen, dtype=torch.float64), torch.randn(n, 3, 4, generator=gen, dtype=torch.float64)
    xb[0] = xa[0]  # identical views: cos = 1 for every w, so g_00 = 0 (A + 2C + B cancels exactly)
    brute = _pair_grads(enc, xa, xb)
    norms = pair_gradient_norms(enc, xa, xb, method=method, block=2)
    expected = _norm_matrix(brute)
    # squared norms agree to float64 rounding of the scale A + B (~1); norms to its square root
    torch.testing.assert_close(norms**2, expected**2, rtol=1e-9, atol=1e-12)
    assert float(expected[0, 0]) < 1e-12



class _TimesTen(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 10.0 * w


@pytest.mark.parametrize("how", ["times_ten", "weight_norm", "orthogonal"])
def test_pair_norms_of_a_parametrized_encoder_equal_autograd(how: str) -> None:
    """A parametrized nn.Linear is not a plain one: its gradient goes to the stored tensor through the
    parametrization (10x here), so the factored path must not apply; the Jacobian path measures it."""
    from torch.nn.utils import parametrizations, parametrize

    enc = _mlp(0)
    if how == "times_ten":
        parametrize.register_parametrization(enc[1], "weight", _TimesTen())
    elif how == "weight_norm":
        parametrizations.weight_norm(enc[1])
    else:
        parametrizations.orthogonal(enc[3])
    gen = torch.Generator().manual_seed(0)
    xa, xb = (torch.randn(4, 3, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    expected = _norm_matrix(_pair_grads(enc, xa, xb))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # vmap's "no batching rule" performance notes
        norms = pair_gradient_norms(enc, xa, xb, method="auto", block=2)
    torch.testing.assert_close(norms, expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="factored"):
        pair_gradient_norms(enc, xa, xb, method="factored")

def _conv_encoders():
    """Convolutional encoders of several shapes (double precision), all on the factored path."""
    torch.manual_seed(0)
    yield standard_cnn((1, 6, 6), 5, channels=(3,), hidden=(7,))
    yield standard_cnn((1, 6, 6), 4, channels=(2, 3), hidden=(6, 5))  # a deep Linear layer too
    yield nn.Sequential(nn.Conv2d(1, 3, 3, bias=False), nn.GELU(), nn.MaxPool2d(2), nn.GroupNorm(1, 3),
                        nn.Flatten(), nn.Linear(12, 4))
    yield nn.Sequential(nn.Conv2d(1, 2, 2, stride=2), nn.Tanh(), nn.Flatten(), nn.LayerNorm(18), nn.Linear(18, 5),
                        nn.ReLU(), nn.Linear(5, 3))
    yield nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                        nn.Linear(8, 6), nn.Softplus(), nn.Linear(6, 4), nn.Tanh())
    yield nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(inplace=True), nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 3))
    yield nn.Sequential(nn.Conv2d(1, 3, 3, stride=2, dilation=2, padding=2, bias=False), nn.ELU(), nn.Flatten(),
                        nn.Linear(27, 4))
    yield nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"), nn.ReLU(), nn.Flatten(), nn.Linear(72, 4))
    yield build_encoder("cnn", (1, 6, 6), 4, hidden=(5,), channels=(2, 3), input_pool=2)  # a fixed pooling first


@pytest.mark.parametrize("index", range(9))
def test_gram_pair_norms_conv_encoders_equal_autograd(index: int, monkeypatch) -> None:
    """Convolutional layers take a per-example Jacobian block beside the Linear layers' factors (by unfold for
    plain Conv2d layers, by torch.func for the others); all paths equal brute-force pair gradients, including
    identical views (g_ii = 0)."""
    from clipless.contrastive import logit_dp as ld

    enc = list(_conv_encoders())[index].double()
    gen = torch.Generator().manual_seed(index)
    x = torch.rand(5, 1, 6, 6, generator=gen, dtype=torch.float64)
    xb = random_crop_flip(x, 1, True, torch.Generator().manual_seed(1))
    xb[0] = x[0]
    assert ld._layer_factors(enc, x, 64)[3] is not None  # the conv block is there
    expected = _norm_matrix(_pair_grads(enc, x, xb))
    for method in ("factored", "auto", "jacobian"):
        with monkeypatch.context() as patch:
            holders = [m for m in enc.modules() if not isinstance(m, (nn.Linear, nn.Sequential)) and
                       any(True for _ in m.parameters(recurse=False))]
            if method == "factored" and all(ld._plain_conv2d(m) for m in holders):
                patch.setattr(ld, "_jacobian", None)  # the unfold path, not torch.func
            norms = pair_gradient_norms(enc, x, xb, method=method, chunk=2)
        torch.testing.assert_close(norms**2, expected**2, rtol=1e-9, atol=1e-12)
    assert _max_clipped_pair_norm(enc, x, xb, clip=float(expected.median())) <= float(expected.median()) * (1 + 1e-9)


def _float32_conv_case(seed: int, linear_head: bool) -> Tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 conv encoder (``linear_head``: Linear factors after the conv block; else the conv block alone),
    views with identical and near-identical pairs on and off the diagonal, and the float64 true pair norms."""
    torch.manual_seed(seed)
    head = ([nn.AvgPool2d(2), nn.Flatten(), nn.Linear(96, 16), nn.ReLU(), nn.Linear(16, 5)] if linear_head
            else [nn.AdaptiveAvgPool2d(1), nn.Flatten()])
    enc32 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 6, 3, padding=1), *head)
    with torch.no_grad():
        for prm in enc32.parameters():
            prm.mul_(2.0)
    enc64 = copy.deepcopy(enc32).double()
    gen = torch.Generator().manual_seed(seed)
    xa, xb = torch.randn(6, 1, 8, 8, generator=gen), torch.randn(6, 1, 8, 8, generator=gen)
    xb[0] = xa[0]
    # Near-identical views: ||g|| ~ 1e-4, below float32's rounding of A + 2C + B, which the margin must cover.
    xb[1:3] = xa[1:3] + 3e-3 * torch.randn(2, 1, 8, 8, generator=gen)
    xb[4] = xa[5]  # an off-diagonal pair of identical images: its two parts cancel exactly
    true = pair_gradient_norms(enc64, xa.double(), xb.double(), method="jacobian")
    assert float(true.min()) < 1e-6 and float(true[1, 1]) < 1e-3
    return enc32, xa, xb, true


@pytest.mark.parametrize("method", ["factored", "jacobian"])
@pytest.mark.parametrize("linear_head", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_conv_clipped_pair_gradients_never_exceed_b_in_float32(seed: int, linear_head: bool, method: str) -> None:
    """Float32 conv encoders (conv Jacobian block, alone or beside Linear factors; the factored path and the
    generic Jacobian path): with the rounding margin no clipped pair gradient exceeds B, with the clip norm right
    at the true norms and near-cancelling pairs.  The Jacobian path once took the float64 margin of its sums for
    float32 Jacobians and let near-cancelling pairs through up to 3% over B here."""
    from clipless.contrastive import logit_dp as ld

    enc32, xa, xb, true = _float32_conv_case(seed, linear_head)
    kept = true > 1e-5  # below: the float64 reference is itself rounding noise
    slack = ld._gram_terms(enc32, xa, xb, method, 256, 64)[1].double()
    for clip in (0.5 * float(true[kept].min()), float(true[kept].min()), float(true.median()),
                 float(true.max()) * (1 - 1e-7)):
        factor = clip_factors(enc32, xa, xb, clip, method=method)
        assert bool((factor * true <= clip * (1 + 1e-9))[kept].all())
        # No over-clipping beyond the certified margin: ||Clip(g)|| >= min(||g||, B / sqrt(1 + slack / ||g||^2)).
        floor = torch.minimum(true, clip / (1 + slack / true.square()).sqrt())
        assert bool((factor * true >= 0.99 * floor)[kept].all())


def _pair_parts(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(n, n) norms of the two parts of g_ij by autograd: ||J_i^T v_j|| (v_j held fixed), ||J'_j^T u_i||."""
    params = list(encoder.parameters())
    n = xa.shape[0]
    first, second = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            u, v = normalized_embedding(encoder, xa[i : i + 1]), normalized_embedding(encoder, xb[j : j + 1])
            for out, c in ((first, (u * v.detach()).sum()), (second, (u.detach() * v).sum())):
                out[i, j] = torch.cat([g.flatten() for g in torch.autograd.grad(c, params)]).double().norm()
    return first, second


@pytest.mark.parametrize("index", range(9))
def test_cauchy_schwarz_pair_norms_bound_autograd(index: int) -> None:
    """cross_term="cauchy_schwarz": every pair norm is at least the brute-force one (a sound clip) and at most the
    norms of its two parts summed (the Cauchy-Schwarz bound itself, no looser); the positive pairs i = i, whose
    parts nearly cancel, keep their exact norm."""
    enc = list(_conv_encoders())[index].double()
    gen = torch.Generator().manual_seed(index)
    x = torch.rand(5, 1, 6, 6, generator=gen, dtype=torch.float64)
    xb = random_crop_flip(x, 1, True, torch.Generator().manual_seed(1))
    xb[0] = x[0]
    exact = _norm_matrix(_pair_grads(enc, x, xb))
    first, second = _pair_parts(enc, x, xb)
    off = ~torch.eye(5, dtype=torch.bool)
    for method in ("factored", "jacobian"):
        bound = pair_gradient_norms(enc, x, xb, method=method, chunk=2, cross_term="cauchy_schwarz")
        assert bool((bound**2 >= exact**2 - 1e-12).all())
        assert bool((bound**2 <= (first + second) ** 2 * (1 + 1e-5) + 1e-12).all())  # + its rounding margin
        torch.testing.assert_close(bound.diagonal() ** 2, exact.diagonal() ** 2, rtol=1e-9, atol=1e-12)
        assert float((bound / exact)[off].max()) > 1.01  # the bound is a bound, not the exact path again


def test_cauchy_schwarz_is_exact_without_a_jacobian_block() -> None:
    """An encoder of nn.Linear layers only has no cross term to bound on the factored path."""
    enc = _mlp(0, act=nn.ReLU, scale=2.0)
    gen = torch.Generator().manual_seed(0)
    xa, xb = (torch.randn(5, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(pair_gradient_norms(enc, xa, xb, method="factored", cross_term="cauchy_schwarz"),
                               pair_gradient_norms(enc, xa, xb, method="factored"), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="cross_term"):
        pair_gradient_norms(enc, xa, xb, cross_term="bound")
    with pytest.raises(ValueError, match="cross_term"):
        logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 1.0, cross_term="none")
    with pytest.raises(ValueError, match="cross_term"):  # the trainer refuses it before it draws or calibrates
        ContrastivePretrainer(enc, torch.optim.SGD(enc.parameters(), lr=0.1), GivenPairs(xa, xb), batch_size=2,
                              epochs=1, delta=1e-5, noise_multiplier=1.0, cross_term="Cauchy-Schwarz")


@pytest.mark.parametrize("linear_head", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_cauchy_schwarz_clipped_pair_gradients_never_exceed_b_in_float32(seed: int, linear_head: bool) -> None:
    """The bounded cross term in float32 (conv block alone or beside Linear factors, chunked Jacobians): no
    clipped pair gradient exceeds B, with the clip at the true norms and near-cancelling pairs, on and off the
    diagonal."""
    enc32, xa, xb, true = _float32_conv_case(seed, linear_head)
    kept = true > 1e-5
    for clip in (0.5 * float(true[kept].min()), float(true[kept].min()), float(true.median()),
                 float(true.max()) * (1 - 1e-7)):
        factor = clip_factors(enc32, xa, xb, clip, cross_term="cauchy_schwarz")
        assert bool((factor * true <= clip * (1 + 1e-9))[kept].all())


def test_cauchy_schwarz_gradient_is_the_sum_of_pairs_clipped_by_the_bound() -> None:
    """The released gradient with the bounded cross term is sum_ij a_ij min(1, B / bound_ij) g_ij / tau, and
    its add/remove-one-pair sensitivity stays within Delta (adversarial k) on a convolutional encoder."""
    enc = list(_conv_encoders())[1].double()
    gen = torch.Generator().manual_seed(3)
    n, tau, clip = 5, 0.5, 0.05
    x = torch.rand(n, 1, 6, 6, generator=gen, dtype=torch.float64)
    xb = random_crop_flip(x, 1, True, torch.Generator().manual_seed(2))
    brute = _pair_grads(enc, x, xb)
    bound = pair_gradient_norms(enc, x, xb, cross_term="cauchy_schwarz")
    with torch.no_grad():
        a = logit_gradient(similarity_logits(normalized_embedding(enc, x), normalized_embedding(enc, xb), tau),
                           "contrastive")
    expected = sum(a[i, j] * brute[i, j] * min(1.0, clip / float(bound[i, j])) for i in range(n) for j in range(n))
    logit_dp_gradient(enc, x, xb, "contrastive", tau, clip, cross_term="cauchy_schwarz")
    full = _grad_vector(enc)
    torch.testing.assert_close(full, expected / tau, rtol=1e-7, atol=1e-12)
    delta = logit_dp_sensitivity(clip, tau, "contrastive", batch_size=n)
    for k in range(n):
        keep = [i for i in range(n) if i != k]
        logit_dp_gradient(enc, x[keep], xb[keep], "contrastive", tau, clip, cross_term="cauchy_schwarz")
        assert float((full - _grad_vector(enc)).norm()) <= delta * (1 + 1e-9)


def test_jacobian_tiles_cover_every_pair() -> None:
    """Tiles smaller than a row (one column of pairs at a time) and larger than the batch give the same terms."""
    from clipless.contrastive import logit_dp as ld

    gen = torch.Generator().manual_seed(0)
    n, d, p = 70, 3, 5
    ja, jb = (torch.randn(n, d, p, generator=gen, dtype=torch.float64) for _ in range(2))
    u, v = torch.randn(n, d, generator=gen, dtype=torch.float64), torch.randn(n, d, generator=gen, dtype=torch.float64)
    expected = torch.stack([torch.stack([(ja[i].T @ v[j] + jb[j].T @ u[i]).square().sum() for j in range(n)])
                            for i in range(n)])
    for elements in (1, 7 * p, 1 << 30):
        total, _, _, _ = ld._jacobian_terms(ja, jb, u, v, block_elements=elements)
        torch.testing.assert_close(total, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_a_streamed_conv_jacobian_gives_the_terms_of_the_whole_block(chunk: int) -> None:
    """View b's conv Jacobian is formed a chunk of examples at a time (memory); its terms, traces and rows are
    those of the whole block, for chunks of one example, uneven chunks and one chunk."""
    from clipless.contrastive import logit_dp as ld

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1), nn.AvgPool2d(2),
                        nn.Flatten(), nn.Linear(18, 4)).double()
    convs = [enc[0], enc[2]]
    gen = torch.Generator().manual_seed(1)
    xa, xb = (torch.rand(7, 1, 6, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    u, v = normalized_embedding(enc, xa), normalized_embedding(enc, xb)
    whole_a, whole_b = ld._conv_jacobian(enc, convs, xa, 64), ld._conv_jacobian(enc, convs, xb, 64)
    lazy_a, lazy_b = ld._LazyConvJacobian(enc, convs, xa, chunk), ld._LazyConvJacobian(enc, convs, xb, chunk)
    torch.testing.assert_close(lazy_b.rows(2, 6), whole_b[2:6], rtol=1e-12, atol=1e-14)
    expected = ld._jacobian_terms(whole_a, whole_b, u, v, block_elements=5)
    for got, want in zip(ld._jacobian_terms(lazy_a, lazy_b, u, v, block_elements=5)[:3], expected[:3]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("tail", ["relu_pool", "pool_with_padding_then_inplace_relu", "gelu_then_ceil_pool_no_bias",
                                  "elu_then_flatten", "wide_patches_not_folded"])
def test_the_first_convs_rows_carried_forward_equal_the_backward_path(tail: str) -> None:
    """Below the first convolution nothing needs the cotangents, so its rows come from its patches carried forward
    through the channelwise layers after it (activations, average pooling) when the patch is shorter than d:
    the same rows as the d-fold backward, in float64 to 1e-14."""
    from clipless.contrastive import logit_dp as ld

    torch.manual_seed(0)
    in_ch, head = 1, 12
    first = {"relu_pool": [nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2)],
             "pool_with_padding_then_inplace_relu": [nn.Conv2d(1, 3, 3, padding=1),
                                                     nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
                                                     nn.ReLU(inplace=True)],
             "gelu_then_ceil_pool_no_bias": [nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.GELU(),
                                             nn.AvgPool2d(3, ceil_mode=True, divisor_override=4)],
             "elu_then_flatten": [nn.Conv2d(1, 3, 3, padding=1), nn.ELU()],
             "wide_patches_not_folded": [nn.Conv2d(1, 3, 4, padding=1), nn.ReLU()]}[tail]
    if tail == "wide_patches_not_folded":
        head = 16  # 4 x 4 + 1 >= d
    enc = nn.Sequential(*first, nn.Conv2d(3, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.LazyLinear(head)).double()
    x = torch.rand(5, in_ch, 8, 8, dtype=torch.float64)
    enc(x)
    convs = [m for m in enc if isinstance(m, nn.Conv2d)]
    calls = [(m, None) for m in enc]
    folded = ld._foldable_after([(m, x[:, :1].expand(5, 3, 8, 8)) for m, _ in calls], 0, head)
    assert (len(folded) > 0) == (tail != "wide_patches_not_folded")
    got = ld._conv_jacobian(enc, convs, x, 2)
    original = ld._foldable_after
    try:
        ld._foldable_after = lambda calls, first, d: []
        want = ld._conv_jacobian(enc, convs, x, 2)
    finally:
        ld._foldable_after = original
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("channels,pool,expected",
                         [((16, 32), 1, "CHUNK"), ((8, 16), 1, 32), ((8, 16), 2, "MAX_CHUNK")])
def test_the_conv_jacobian_chunk_follows_the_activation_size(channels, pool, expected) -> None:
    """A chunk's d-fold activations stay near CHUNK_ELEMENTS: the CLI's encoder keeps 16 examples, smaller
    activations take more (up to MAX_CHUNK); the pair norms do not depend on it."""
    from clipless.contrastive import logit_dp as ld
    from clipless.contrastive.pretrain import build_encoder

    torch.manual_seed(0)
    enc = build_encoder("cnn", (1, 28, 28), 32, hidden=[], channels=list(channels), input_pool=pool)
    x = torch.rand(3, 1, 28, 28)
    chunk = ld._layer_factors(enc, x, None)[3].chunk
    assert chunk == (getattr(ld, expected) if isinstance(expected, str) else expected)
    if pool == 2:  # in float64: float32 pair norms that nearly cancel differ by rounding between blockings
        enc, x, xb = enc.double(), x.double(), torch.rand(3, 1, 28, 28, dtype=torch.float64)
        torch.testing.assert_close(pair_gradient_norms(enc, x, xb), pair_gradient_norms(enc, x, xb, chunk=1),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pool", [nn.AvgPool2d(2), nn.AvgPool2d((2, 3)), nn.AvgPool2d(3), nn.AvgPool2d(3, stride=2),
                                  nn.AvgPool2d(2, padding=1), nn.AvgPool2d(2, ceil_mode=True),
                                  nn.AvgPool2d(2, count_include_pad=False), nn.AvgPool2d(2, divisor_override=3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_pooling_vjp_equals_autograd(pool: nn.Module, dtype: torch.dtype, monkeypatch) -> None:
    """The conv Jacobian carries chunk x d cotangents back through average pooling with one pooling backward for
    all of them: it equals autograd's vector-Jacobian products of the repeated input, bit for bit, for disjoint,
    overlapping, padded, ceil-mode and custom-divisor windows, on inputs that the windows tile or not; disjoint
    windows by 0/1 matrix products (the whole window matrix on small maps, with or without a remainder; tiled on
    larger maps that the windows tile), the others (and where matrix products may not be IEEE) by the pooling
    backward."""
    from clipless.contrastive import logit_dp as ld

    tiled, dense = [], []
    original, original_dense = ld._tiled_avg_pool_backward, ld._dense_avg_pool_backward
    monkeypatch.setattr(ld, "_tiled_avg_pool_backward", lambda *a: tiled.append(1) or original(*a))
    monkeypatch.setattr(ld, "_dense_avg_pool_backward", lambda *a: dense.append(1) or original_dense(*a))
    gen = torch.Generator().manual_seed(0)
    for ieee in (True, False):
        monkeypatch.setattr(ld, "ieee_matmul", lambda device, ieee=ieee: ieee)
        for height, width in ((12, 12), (7, 9), (5, 5)):
            h = torch.randn(3, 2, height, width, generator=gen, dtype=dtype)
            g = torch.randn(3 * 4, *pool(h).shape[1:], generator=gen, dtype=dtype)  # 4 cotangents per example
            g[0, 0, 0, 0] = 1e-40 if dtype == torch.float32 else 1e-310  # a subnormal passes unchanged
            leaf = h.repeat_interleave(4, dim=0).requires_grad_()
            expected = torch.autograd.grad(pool(leaf), leaf, g)[0]
            assert torch.equal(ld._batched_vjp(pool, h, g), expected)
    disjoint = pool.kernel_size == (pool.stride or pool.kernel_size) and pool.padding == 0 and not pool.ceil_mode
    size = torch.nn.modules.utils._pair(pool.kernel_size)
    small = [(hh, ww) for hh, ww in ((12, 12), (7, 9), (5, 5)) if (hh // size[0]) * (ww // size[1]) * hh * ww <= 512]
    tiling = sum(1 for hh, ww in ((12, 12), (7, 9), (5, 5))
                 if hh % size[0] == 0 and ww % size[1] == 0 and (hh, ww) not in small)
    # IEEE products only: the whole window matrix on small maps, the tiled form where windows tile a larger one
    assert (len(dense), len(tiled)) == ((len(small), tiling) if disjoint else (0, 0))
    assert not disjoint or small  # every disjoint pooling here meets the dense form on some map


def test_unknown_layers_refuse_the_factored_path() -> None:
    class Scale(nn.Module):  # a per-example layer the factored path does not know
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(3, 4), Scale(), nn.Linear(4, 2)).double()
    xa, xb = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    brute = _pair_grads(enc, xa, xb)
    expected = _norm_matrix(brute)
    torch.testing.assert_close(pair_gradient_norms(enc, xa, xb), expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="method='factored'"):
        pair_gradient_norms(enc, xa, xb, method="factored")


@pytest.mark.parametrize("loss,tau", [("contrastive", 1.0), ("contrastive", 0.3), ("spreadout", 1.0),
                                      ("spectral", 1.0), ("spectral", 0.25)])
@pytest.mark.parametrize("clip", [1e-3, 0.2, 1e3])
def test_lambda_gradient_equals_sum_of_clipped_pair_gradients(loss: str, tau: float, clip: float) -> None:
    enc = _mlp(1, act=nn.ReLU, scale=2.0)
    gen = torch.Generator().manual_seed(7)
    n = 5
    xa, xb = torch.randn(n, 12, generator=gen, dtype=torch.float64), torch.randn(n, 12, generator=gen, dtype=torch.float64)
    brute = _pair_grads(enc, xa, xb)
    with torch.no_grad():
        a = logit_gradient(similarity_logits(normalized_embedding(enc, xa), normalized_embedding(enc, xb), tau), loss)
    expected = sum(a[i, j] * brute[i, j] * min(1.0, clip / float(brute[i, j].norm()))
                   for i in range(n) for j in range(n)) / tau
    for method in ("factored", "jacobian"):  # coefficients up to 2 / tau^2 (spectral): cancellations scale so
        logit_dp_gradient(enc, xa, xb, loss, tau, clip, method=method)
        torch.testing.assert_close(_grad_vector(enc), expected, rtol=1e-9, atol=1e-12 / min(1.0, tau) ** 2)
    if clip > 1e2:  # nothing clipped: gbar is the ordinary loss gradient
        for p in enc.parameters():
            p.grad = None
        from clipless.contrastive.logit_dp import LOSS_FUNCTIONS

        z = similarity_logits(normalized_embedding(enc, xa), normalized_embedding(enc, xb), tau)
        LOSS_FUNCTIONS[loss](z).backward()
        torch.testing.assert_close(_grad_vector(enc), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["auto", "jacobian"])
@pytest.mark.parametrize("seed", range(6))
def test_clipped_pair_gradients_never_exceed_b_in_float32(seed: int, method: str) -> None:
    """The clip factors are computed in float32; with the rounding margin no clipped pair gradient exceeds B,
    even when the clip norm sits right at the true norms and when g_ij nearly cancels (x'_j = x_i)."""
    enc32 = _mlp(seed, dims=(12, 32, 32, 8), act=nn.ReLU, scale=3.0, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    xa = torch.randn(6, 12, generator=gen)
    xb = xa + 1e-3 * torch.randn(6, 12, generator=gen)
    xb[::2] = xa[::2]
    enc64 = _mlp(seed, dims=(12, 32, 32, 8), act=nn.ReLU, scale=3.0, dtype=torch.float64)
    true = pair_gradient_norms(enc64, xa.double(), xb.double(), method="jacobian")
    assert float(true.min()) < 1e-6  # g_ii = 0 exactly for identical views
    smallest = float(true[true > 1e-3].min())
    for clip in (1e-3, smallest, float(true.median()), float(true.max()) * (1 - 1e-7)):
        factor = clip_factors(enc32, xa, xb, clip, method=method)
        clipped = (factor * true)[true > 1e-3]  # below: the float64 reference is itself rounding noise
        assert bool((clipped <= clip * (1 + 1e-9)).all())
        far = true > 10 * clip
        if bool(far.any()):  # and the margin does not over-clip: ||g|| >= 10 B gives factor ~ B / ||g||
            # (the Jacobian path's chain of roundings runs over all p parameters at once: a wider margin)
            assert float((factor * true)[far].min()) > (0.99 if method == "auto" else 0.97) * clip


def _gbar(enc: nn.Module, xa: torch.Tensor, xb: torch.Tensor, loss: str, tau: float, clip: float) -> torch.Tensor:
    logit_dp_gradient(enc, xa, xb, loss, tau, clip, method="factored")
    return _grad_vector(enc)


@pytest.mark.parametrize("loss,tau", [("contrastive", 1.0), ("contrastive", 0.5), ("contrastive", 2.0),
                                      ("spreadout", 1.0), ("spectral", 1.0), ("spectral", 0.125)])
def test_sensitivity_holds_for_every_removed_pair(loss: str, tau: float) -> None:
    """||gbar(X) - gbar(X minus pair k)|| <= Delta(n) over random batches, models and every k (the worst k
    is the adversarial choice), including tiny B (everything clipped), large weights and repeated inputs."""
    worst = 0.0
    for trial in range(30):
        gen = torch.Generator().manual_seed(100 + trial)
        n = 1 + trial % 7
        enc = _mlp(trial, dims=(6, 10, 5), act=nn.ReLU, scale=(0.5, 3.0, 10.0)[trial % 3])
        xa = torch.randn(n, 6, generator=gen, dtype=torch.float64)
        xb = xa + 0.1 * torch.randn(n, 6, generator=gen, dtype=torch.float64)
        if trial % 5 == 0:
            xa[:] = xa[0]  # every pair the same
            xb[:] = xb[0]
        clip = (1e-4, 0.05, 1.0)[trial % 3]
        full = _gbar(enc, xa, xb, loss, tau, clip)
        bound = logit_dp_sensitivity(clip, tau, loss, batch_size=n)
        assert bound <= logit_dp_sensitivity(clip, tau, loss) * (1 + 1e-12)
        for k in range(n):
            keep = [i for i in range(n) if i != k]
            reduced = _gbar(enc, xa[keep], xb[keep], loss, tau, clip)
            ratio = float((full - reduced).norm()) / bound
            worst = max(worst, ratio)
            assert ratio <= 1 + 1e-9, (trial, k, ratio)
    assert worst > 0.05  # the test exercises the bound, not a vacuous corner


@pytest.mark.parametrize("method", ["logit_dp", "naive_dp"])
def test_the_sensitivity_holds_in_float32_at_clip_norms_where_it_underflows(method: str) -> None:
    """Below float32's normal range rounding is absolute: at clip norms of 1e-45 to 1e-44 a removed pair moved the
    Logit-DP gradient by up to 2.5x its sensitivity, and the Naive-DP gradient clipped to C came out 1.2x C, before
    the sensitivities got their underflow term."""
    worst = 0.0
    for trial in range(12):
        gen = torch.Generator().manual_seed(trial)
        n = 2 + trial % 5
        enc = _mlp(trial, dims=(12, 32, 32, 8), act=nn.ReLU, scale=3.0, dtype=torch.float32)
        xa = torch.randn(n, 12, generator=gen)
        xb = xa + 0.1 * torch.randn(n, 12, generator=gen)
        clip = (1e-44, 1e-45, 3e-45)[trial % 3]
        if method == "naive_dp":
            bound = naive_dp_sensitivity(clip)
            gbar = lambda a, b: (naive_dp_gradient(enc, a, b, "contrastive", 1.0, clip), _grad_vector(enc))[1]
        else:
            bound = logit_dp_sensitivity(clip, 1.0, "contrastive")
            gbar = lambda a, b: _gbar(enc, a, b, "contrastive", 1.0, clip)
        full = gbar(xa, xb).double()
        if method == "naive_dp":  # the whole clipped gradient: within C, half the sensitivity 2C
            assert float(full.norm()) <= bound / 2, (trial, float(full.norm()) / clip)
        for k in range(n):
            keep = [i for i in range(n) if i != k]
            ratio = float((full - gbar(xa[keep], xb[keep]).double()).norm()) / bound
            worst = max(worst, ratio)
            assert ratio <= 1, (trial, k, ratio)
    assert worst > 0  # the gradients are not all rounded away


def test_contrastive_sensitivity_values() -> None:
    # tau = 1: Delta_inf = 2 B (1 + e^2); Delta_1 = 2B (the single pair's row only); increasing in n.
    assert logit_dp_sensitivity(1.0, 1.0) == pytest.approx(2 * (1 + math.e**2))
    assert logit_dp_sensitivity(0.5, 1.0, batch_size=1) == pytest.approx(1.0)
    values = [logit_dp_sensitivity(1.0, 0.5, batch_size=n) for n in (1, 2, 10, 1000, 10**7)]
    assert values == sorted(values) and values[-1] < logit_dp_sensitivity(1.0, 0.5)
    # the 1/tau factor the reference code omits: tau = 0.2 multiplies the per-pair scale by 5
    assert logit_dp_sensitivity(1.0, 0.2, batch_size=1) == pytest.approx(10.0)
    assert logit_dp_sensitivity(2.0, 1.0, "spreadout") == 12.0
    assert logit_dp_sensitivity(2.0, 1.0, "spectral") == 16.0  # spreadout's 6B and the pair's own -2
    assert logit_dp_sensitivity(1.0, 0.5, "spectral") == pytest.approx(2 * 2 * (1 + 6))  # (2B/tau)(1 + 3/tau)
    assert naive_dp_sensitivity(3.0) == 6.0
    # a fixed batch's size is a whole number: 2.7 was truncated to 2, the bound of a smaller batch
    for bad in (2.7, 0, -3, True, "8"):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            logit_dp_sensitivity(1.0, 0.5, batch_size=bad)
    with pytest.raises(ValueError, match="tau = 1"):
        logit_dp_sensitivity(1.0, 0.5, "spreadout")
    with pytest.raises(ValueError, match="positive"):
        logit_dp_sensitivity(0.0, 1.0)


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.125, 0.01])
def test_spectral_coefficients_reach_and_never_exceed_the_sensitivity(tau: float) -> None:
    """||gbar(X) - gbar(X - k)|| <= (B/tau) (sum_j |a_kj| + sum_(i != k) |a_ik| + sum_(i, j != k) |a_ij - a'_ij|)
    whatever the clipped pair gradients (each of norm <= B).  That coefficient sum is at most 2 + 6/tau for every
    n and every Z in [-1/tau, 1/tau] (random, extreme, and rounded a few ulps past 1/tau), and equals it when
    every |Z| = 1/tau and n >= 3: the constant cannot be lowered."""
    gen = torch.Generator().manual_seed(3)
    limit = 2.0 + 6.0 / tau
    assert logit_dp_sensitivity(1.0, tau, "spectral") == pytest.approx(limit / tau, rel=1e-15)
    reached = 0.0
    for n in (1, 2, 3, 5, 64, 1024):
        for kind in ("random", "extreme", "over"):
            z = (2 * torch.rand(n, n, generator=gen, dtype=torch.float64) - 1) / tau
            if kind != "random":
                z = torch.sign(z) / tau
            if kind == "over":  # a cosine of normalized float32 vectors can round above 1
                z = z * (1 + 4e-7)
            a = logit_gradient(z, "spectral", tau)
            for k in {0, n // 2, n - 1}:
                keep = [i for i in range(n) if i != k]
                rest = logit_gradient(z[keep][:, keep], "spectral", tau)
                moved = a[k].abs().sum() + a[keep, k].abs().sum() + (a[keep][:, keep] - rest).abs().sum()
                assert float(moved) <= limit * (1 + 1e-12), (n, kind, k, float(moved))
                reached = max(reached, float(moved) / limit)
    assert reached == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.2, 0.05, 0.01, 0.004])
def test_contrastive_sensitivity_at_small_temperatures(tau: float) -> None:
    # The spec's formula in exact rational arithmetic on the float e^{2/tau}: the value never falls below it by
    # more than rounding, for known n, nor exceeds the sup over n; no overflow where n is known.
    from fractions import Fraction

    e = Fraction(math.exp(2.0 / tau)) if 2.0 / tau < 709 else None
    for n in (1, 2, 3, 1024, 10**9):
        value = logit_dp_sensitivity(1.0, tau, batch_size=n)
        assert math.isfinite(value) and value <= logit_dp_sensitivity(1.0, tau) * (1 + 1e-12)
        if e is not None:
            exact = (2 + 2 * (n - 1) * e / (e + n - 1)) / Fraction(tau)
            assert value >= float(exact) * (1 - 1e-12)
    assert logit_dp_sensitivity(1.0, tau) == pytest.approx(2 / tau * (1 + math.exp(2 / tau)), rel=1e-12)


@pytest.mark.parametrize("tau", [2.0 / 710, 1e-3, 1e-9])
def test_contrastive_sensitivity_overflow_is_a_clear_error(tau: float) -> None:
    with pytest.raises(ValueError, match="overflows at tau"):
        logit_dp_sensitivity(1.0, tau)
    assert math.isfinite(logit_dp_sensitivity(1.0, tau, batch_size=1024))  # known n: (n-1) q_n <= n - 1


def test_naive_dp_sensitivity_two_c() -> None:
    gen = torch.Generator().manual_seed(0)
    enc = _mlp(3, dims=(6, 10, 5), act=nn.ReLU, scale=3.0)
    xa = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    xb = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    naive_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1)
    full = _grad_vector(enc)
    assert float(full.norm()) <= 0.1 * (1 + 1e-9)
    for k in range(6):
        keep = [i for i in range(6) if i != k]
        naive_dp_gradient(enc, xa[keep], xb[keep], "contrastive", 1.0, 0.1)
        assert float((full - _grad_vector(enc)).norm()) <= naive_dp_sensitivity(0.1) * (1 + 1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_naive_dp_released_gradient_never_exceeds_c(dtype) -> None:
    """Before, the factor C / ||g|| was applied as is: half of these float32 released gradients had a norm
    above C (by up to 5e-8 relative), so the sensitivity 2C held only up to rounding."""
    for seed in range(40):
        enc = _mlp(seed, dims=(12, 32, 32, 8), act=nn.ReLU, scale=3.0, dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        xa, xb = torch.randn(6, 12, generator=gen, dtype=dtype), torch.randn(6, 12, generator=gen, dtype=dtype)
        clip = 1e-3
        stats = naive_dp_gradient(enc, xa, xb, "contrastive", 1.0, clip)
        assert stats["clipped_fraction"] == 1.0
        norm = float(_grad_vector(enc).norm())
        assert clip * (1 - 1e-6) < norm <= clip


@pytest.mark.parametrize("how", ["autocast", "bfloat16", "half"])
@pytest.mark.parametrize("private", ["logit_dp", "naive_dp"])
def test_reduced_precision_private_gradients_refused(how: str, private: str) -> None:
    """Clip factors measured in one reduced-precision pass and applied in another are not covered by the
    rounding margins (before: autocast failed with an unrelated rounding error in Logit-DP, ran in Naive-DP)."""
    enc = _mlp(0, dims=(12, 16, 8), act=nn.ReLU, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(4, 12, generator=gen), torch.randn(4, 12, generator=gen)
    run = (lambda a, b: logit_dp_gradient(enc, a, b, "contrastive", 1.0, 1.0)) if private == "logit_dp" else (
        lambda a, b: naive_dp_gradient(enc, a, b, "contrastive", 1.0, 1.0))
    with pytest.raises(ValueError, match="autocast" if how == "autocast" else "float32 or float64"):
        if how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                run(xa, xb)
        else:
            dtype = torch.bfloat16 if how == "bfloat16" else torch.float16
            enc.to(dtype)
            run(xa.to(dtype), xb.to(dtype))
    enc.float()
    run(xa, xb)  # float32 is accepted


def test_empty_batch_gives_zero_gradient() -> None:
    enc = _mlp(0)
    empty = torch.zeros(0, 12, dtype=torch.float64)
    for fn in (lambda: logit_dp_gradient(enc, empty, empty, "contrastive", 1.0, 1.0),
               lambda: naive_dp_gradient(enc, empty, empty, "contrastive", 1.0, 1.0)):
        fn()
        assert float(_grad_vector(enc).abs().max()) == 0.0


def test_random_crop_flip() -> None:
    x = torch.arange(2 * 1 * 4 * 5, dtype=torch.float32).reshape(2, 1, 4, 5)
    assert torch.equal(random_crop_flip(x, 0, False), x)
    gen = torch.Generator().manual_seed(0)
    out = random_crop_flip(x, 2, True, gen)
    assert out.shape == x.shape
    for i in range(2):  # every output pixel is 0 (padding) or a pixel of the same image
        assert set(out[i].flatten().tolist()) <= set(x[i].flatten().tolist()) | {0.0}
    flips = random_crop_flip(x.repeat(50, 1, 1, 1), 0, True, gen)
    mirrored = sum(bool(torch.equal(f, x[i % 2].flip(-1))) for i, f in enumerate(flips))
    assert 30 < mirrored < 70  # of 100, each mirrored with probability 1/2
    with pytest.raises(ValueError, match=r"\(n, C, H, W\)"):
        random_crop_flip(x[0], 1)


def _digits_pairs():
    data = load_digits()
    return data, AugmentedPairs(data.train.features, padding=1, flip=False,
                                seed=0)


def test_eval_pairs_of_the_training_images_refused():
    """The held-out loss is logged and saved without noise: pairs of the training images are refused."""
    data, _ = _digits_pairs()
    with pytest.raises(ValueError, match="eval_pairs holds the same records"):
        _trainer("logit_dp", eval_pairs=AugmentedPairs(data.train.features, padding=1, flip=False))


def _trainer(method: str, **kw) -> ContrastivePretrainer:
    data, pairs = _digits_pairs()
    pairs = kw.pop("pairs", pairs)
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    opts = dict(method=method, batch_size=128, epochs=2, delta=1e-4, noise_multiplier=1.0, noise_seed=0,
                eval_pairs=AugmentedPairs(data.test.features, 1, False), progress=False, log=None)
    opts.update(kw)
    lr = opts.pop("lr", 1e-3)
    return ContrastivePretrainer(enc, torch.optim.Adam(enc.parameters(), lr=lr), pairs, **opts)


def test_the_pretrainers_loader_parts_cannot_be_swapped() -> None:
    """A full-batch sampler written into the pre-trainer's loader (past ``DataLoader``'s guard) ran every step on all
    pairs while the accountant composed Poisson steps at q = 128 / n."""
    t = _trainer("logit_dp", epochs=1)
    n = len(t.pairs)
    t.loader.__dict__["batch_sampler"] = torch.utils.data.BatchSampler(range(n), n, False)
    with pytest.raises(ValueError, match="sampling and its loader's parts"):
        t.fit()
    assert t.accountant.steps == 0


def test_steps_taken_out_of_the_pretrainers_accountant_are_refused_and_put_back() -> None:
    """As for the private optimizer: a history rebound to fewer steps would let the budget count from there."""
    t = _trainer("logit_dp", epochs=2)
    t.epochs = 1
    t.fit()
    released = t.accountant.history
    t.accountant._history = t.accountant._history[:0]
    t.epochs = 2
    with pytest.raises(BoundError, match="the accountant no longer holds the steps released so far"):
        t.fit()
    assert t.accountant.history == released and t.steps == t.accountant.steps


def test_an_accountant_step_replaced_on_the_pretrainers_accountant_is_refused_and_counted() -> None:
    """``accountant.step`` replaced by a function that composes nothing released the pre-trainer's steps outside
    epsilon; each step now checks that the history is exactly the planned extension of the one before."""
    t = _trainer("logit_dp", epochs=1)
    t.accountant.__dict__["step"] = lambda *args, **kwargs: None
    with pytest.raises(BoundError, match="did not compose the released step"):
        t.fit()
    assert t.accountant.steps == 1  # counted all the same
    del t.accountant.__dict__["step"]


def test_the_pretrainers_noise_replaced_after_it_was_built_is_refused(monkeypatch) -> None:
    """``clipless.contrastive.pretrain.add_gaussian_noise_ = ...`` (or the privacy core's noise) after the
    pre-trainer was built released the clipped gradient sum without noise; and its optimizer may have no hooks."""
    import clipless.contrastive.pretrain as pretrain_module
    import clipless.privacy.noise as noise_module

    for owner, name in ((pretrain_module, "add_gaussian_noise_"), (noise_module, "gaussian")):
        t = _trainer("logit_dp", epochs=1)
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: None)
        with pytest.raises(ValueError, match=f"{name} was replaced after the pre-trainer was built"):
            t.fit()
        assert t.accountant.steps == 0
        monkeypatch.undo()
    t = _trainer("logit_dp", epochs=1)
    handle = t.optimizer.register_step_post_hook(lambda *args: None)
    with pytest.raises(ValueError, match="has hooks"):
        t.fit()
    assert t.accountant.steps == 0
    handle.remove()
    t.fit()
    assert t.accountant.steps > 0


def test_the_training_pairs_swapped_in_as_eval_pairs_are_refused() -> None:
    """``t.eval_pairs = t.pairs`` after construction (past ``check_held_out``) logged the training pairs' loss
    without noise as the held-out loss. The pairs are declared constants, checked before a held-out loss."""
    t = _trainer("logit_dp", epochs=1)
    with pytest.raises(AttributeError, match="declared constant"):
        t.eval_pairs = t.pairs
    t.__dict__["eval_pairs"] = t.pairs
    with pytest.raises(ValueError, match="training or held-out pairs"):
        t.fit()
    assert t.history == [] and t.accountant.steps == 0


def test_trainer_epsilon_matches_accountant_and_target() -> None:
    t = _trainer("logit_dp", target_epsilon=3.0, noise_multiplier=None)
    result = t.fit()
    assert result.epsilon <= 3.0
    steps = 2 * round(1 / t.sample_rate)
    assert result.steps == steps
    assert result.epsilon == pytest.approx(compute_epsilon(result.noise_multiplier, t.sample_rate, steps, 1e-4))
    assert result.sensitivity == pytest.approx(2 * (1 + math.e**2))
    assert result.sampling.startswith("poisson")


def test_trainer_noise_scale_is_sigma_times_sensitivity_over_b() -> None:
    """With B tiny, gbar ~ 0 and one SGD step moves parameters by lr * N(0, (sigma Delta / b)^2)."""
    t = _trainer("logit_dp", clip_norm=1e-12, noise_multiplier=2.0, epochs=1)
    t.optimizer = torch.optim.SGD(t.encoder.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in t.encoder.parameters()])
    xa, xb = t.pairs.gather(list(range(100)))
    t._step(xa, xb)
    moved = torch.cat([p.detach().flatten() for p in t.encoder.parameters()]) - before
    expected = 2.0 * t.sensitivity / 128
    assert float(moved.std()) == pytest.approx(expected, rel=0.05)


def test_nonprivate_pretraining_learns_and_private_huge_noise_does_not() -> None:
    free = _trainer("nonprivate", epochs=6, lr=3e-3).fit()
    assert free.epsilon is None
    assert free.history[-1]["eval_loss"] < free.history[0]["eval_loss"] - 0.2
    noisy = _trainer("logit_dp", noise_multiplier=1e4, epochs=2).fit()
    assert abs(noisy.history[-1]["eval_loss"] - noisy.history[0]["eval_loss"]) < 0.15


def test_knn_and_probe_accuracy_above_chance() -> None:
    data, _ = _digits_pairs()
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 32))
    assert knn_accuracy(enc, data.train, data.test) > 0.8  # random projections keep digits' neighbourhoods
    assert linear_probe_accuracy(enc, data.train, data.test) > 0.6


def test_few_label_probe_draws_k_labels_per_class() -> None:
    from clipless.contrastive.evaluation import evaluate_encoder, few_label_indices, few_label_probe_accuracy

    labels = torch.arange(10).repeat(30)[torch.randperm(300, generator=torch.Generator().manual_seed(0))]
    picked = few_label_indices(labels, 4, seed=1)
    assert torch.bincount(labels[picked], minlength=10).tolist() == [4] * 10
    assert torch.equal(picked, few_label_indices(labels, 4, seed=1))
    assert not torch.equal(picked, few_label_indices(labels, 4, seed=2))
    assert len(few_label_indices(labels, 100, seed=0)) == 300  # a class with fewer records gives all of them
    with pytest.raises(ValueError, match="per_class"):
        few_label_indices(labels, 0, seed=0)
    data, _ = _digits_pairs()
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 32))
    one = few_label_probe_accuracy(enc, data.train, data.test, per_class=1)
    many = few_label_probe_accuracy(enc, data.train, data.test, per_class=50)
    assert 0.2 < one < many  # above chance (0.1) with one label per class, better with more
    result = evaluate_encoder(enc, data.test, per_class=(2,))
    assert set(result) >= {"knn3_accuracy", "linear_probe_accuracy", "probe_2_per_class"}


def test_representation_layer_is_the_encoder_before_its_last_linear() -> None:
    from clipless.contrastive.evaluation import evaluate_encoder, representation

    data, _ = _digits_pairs()
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))
    assert representation(enc)[-1] is enc[2] and len(representation(enc)) == 3
    got = evaluate_encoder(enc, data.test, per_class=(2,), layer="representation")
    # the same numbers as the embedding evaluation of the cut encoder: h is read, not z
    want = evaluate_encoder(enc[:-1], data.test, per_class=(2,))
    assert got["layer"] == "representation" and want["layer"] == "embedding"
    assert {k: got[k] for k in want if k != "layer"} == {k: want[k] for k in want if k != "layer"}
    assert got != evaluate_encoder(enc, data.test, per_class=(2,))  # 48 ReLU features are not the 8-dim z
    for bad in (nn.Linear(64, 8), nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU()),
                nn.Sequential(nn.Linear(64, 8)), nn.Sequential(nn.Flatten(), nn.Linear(64, 8))):
        with pytest.raises(ValueError, match="representation layer"):
            evaluate_encoder(bad, data.test, layer="representation")
    with pytest.raises(ValueError, match="layer must be one of"):
        evaluate_encoder(enc, data.test, layer="hidden")


def test_a_new_pretrainer_never_writes_over_an_earlier_runs_checkpoint(tmp_path) -> None:
    """As for PrivateTrainer: a fresh pre-trainer replaced an earlier run's checkpoint at its checkpoint_path at the
    end of its first epoch; it now refuses to start, and continues the file once it has resumed from it."""
    from clipless.train.checkpoint import CheckpointError

    path = tmp_path / "c.pt"
    first = _trainer("logit_dp", epochs=2, checkpoint_path=path)
    first.epochs = 1
    first.fit()
    written = path.read_bytes()
    fresh = _trainer("logit_dp", epochs=2, checkpoint_path=path)
    with pytest.raises(CheckpointError, match="holds a file already .* load_checkpoint"):
        fresh.fit()
    assert path.read_bytes() == written and fresh.steps == 0 and fresh.accountant.steps == 0
    resumed = _trainer("logit_dp", epochs=2, checkpoint_path=path)
    resumed.load_checkpoint(path)
    resumed.fit()
    assert resumed.epoch == 2 and path.read_bytes() != written


def test_checkpoint_keeps_accountant(tmp_path) -> None:
    t = _trainer("logit_dp", epochs=2)
    t.epochs = 1
    t.fit()
    t.save_checkpoint(tmp_path / "c.pt")
    resumed = _trainer("logit_dp", epochs=2)
    resumed.load_checkpoint(tmp_path / "c.pt")
    assert resumed.accountant.steps == t.accountant.steps and resumed.epoch == 1
    assert resumed.fit().epsilon == pytest.approx(_trainer("logit_dp", epochs=2).fit().epsilon)
    state = load_checkpoint(tmp_path / "c.pt")
    state["accountant"] = None
    save_checkpoint(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="accountant"):
        _trainer("logit_dp").load_checkpoint(tmp_path / "bad.pt")
    # an accountant that composed fewer steps than the run released would under-report epsilon from here on
    state = load_checkpoint(tmp_path / "c.pt")
    state["steps"] += 5
    save_checkpoint(state, tmp_path / "short.pt")
    for name in ("short.pt", "other.pt"):  # a checkpoint travels with its key file
        shutil.copy(fingerprint_key_path(tmp_path / "c.pt"), fingerprint_key_path(tmp_path / name))
    fresh = _trainer("logit_dp", epochs=2)
    with pytest.raises(ValueError, match="composed .* steps but the run records"):
        fresh.load_checkpoint(tmp_path / "short.pt")
    assert fresh.steps == 0 and fresh.accountant.steps == 0
    state = load_checkpoint(tmp_path / "c.pt")  # steps composed at a larger noise multiplier: a lower epsilon
    state["accountant"]["history"] = [(2 * s, q, k) for s, q, k in state["accountant"]["history"]]
    save_checkpoint(state, tmp_path / "lower.pt")
    shutil.copy(fingerprint_key_path(tmp_path / "c.pt"), fingerprint_key_path(tmp_path / "lower.pt"))
    with pytest.raises(ValueError, match="at noise multiplier .* where every step of this run"):
        fresh.load_checkpoint(tmp_path / "lower.pt")
    assert fresh.steps == 0 and fresh.accountant.steps == 0
    state = load_checkpoint(tmp_path / "c.pt")
    state["encoder"] = {k: torch.zeros(v.shape[0] + 1) for k, v in state["encoder"].items()}
    save_checkpoint(state, tmp_path / "other.pt")
    before = [p.detach().clone() for p in fresh.encoder.parameters()]
    with pytest.raises(ValueError, match="another encoder"):
        fresh.load_checkpoint(tmp_path / "other.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.encoder.parameters()))
    with pytest.raises(ValueError, match="this pre-trainer has already released"):  # a rollback of released steps
        t.load_checkpoint(tmp_path / "c.pt")


@pytest.mark.parametrize("seed", [None, 0])
def test_a_resumed_pretrainer_draws_fresh_secret_randomness(tmp_path, seed) -> None:
    """As for classification: two resumes of one secret run's checkpoint must not share noise or batches
    (before, they were bit-identical); a seeded run's resume continues its streams."""
    first = _trainer("naive_dp", epochs=2, noise_seed=seed)
    first.epochs = 1
    first.fit()
    first.save_checkpoint(tmp_path / "c.pt")
    forks = []
    for _ in range(2):
        fork = _trainer("naive_dp", epochs=2, noise_seed=seed)
        fork.load_checkpoint(tmp_path / "c.pt")
        fork.fit()
        forks.append(torch.cat([p.detach().flatten() for p in fork.encoder.parameters()]))
    assert torch.equal(forks[0], forks[1]) is (seed is not None)
    saved = load_checkpoint(tmp_path / "c.pt")  # a secret run's checkpoint keeps no generator state at all
    assert (saved["noise_rng"] is None and saved["sampling_rng"] is None) is (seed is None)
    # nor the augmentation's per-record draw counts: how often the secret sampling took each record
    assert (saved["pairs"] is None) is (seed is None)
    assert seed is None or torch.equal(saved["pairs"]["draws"], first.pairs.draws)


def test_a_pretraining_resume_on_other_records_is_refused(tmp_path) -> None:
    """A pre-trainer's checkpoint did not record its records: a resume on another dataset went on silently.
    It now keeps their digest, keyed like the classification trainer's (``checkpoint.pt.key`` beside it)."""
    first = _trainer("naive_dp", epochs=1)
    first.fit()
    first.save_checkpoint(tmp_path / "c.pt")
    assert first.pairs.fingerprint() not in repr(load_checkpoint(tmp_path / "c.pt"))  # keyed, not plain
    _trainer("naive_dp", epochs=1).load_checkpoint(tmp_path / "c.pt")  # the same records: resumes
    flipped = AugmentedPairs(first.pairs.images.flip(0), 1, False)  # the same records, another order
    other = _trainer("naive_dp", epochs=1, pairs=flipped)
    with pytest.raises(ValueError, match="train_data=.*resume with the same records in the same order"):
        other.load_checkpoint(tmp_path / "c.pt")
    fingerprint_key_path(tmp_path / "c.pt").unlink()
    with pytest.raises(ValueError, match="its key file c.pt.key is missing"):
        _trainer("naive_dp", epochs=1).load_checkpoint(tmp_path / "c.pt")
    pairs = GivenPairs(torch.zeros(3, 2), torch.ones(3, 2))
    assert pairs.fingerprint() != GivenPairs(torch.ones(3, 2), torch.zeros(3, 2)).fingerprint()


def test_a_pretraining_resume_with_other_settings_names_what_they_change(tmp_path) -> None:
    """A resume whose options change a privacy setting is refused; the message said only "sigma=...", which a user
    who changed the target epsilon or the clip norm could not map back to an option."""
    first = _trainer("naive_dp", epochs=1, target_epsilon=2.0, noise_multiplier=None)
    first.fit()
    first.save_checkpoint(tmp_path / "c.pt")
    for kw, match in ((dict(target_epsilon=3.0, noise_multiplier=None), "sigma=.*calibrated from the target epsilon"),
                      (dict(target_epsilon=2.0, noise_multiplier=None, clip_norm=2.0),
                       "sensitivity=.*follows the clip norm"),
                      (dict(target_epsilon=2.0, noise_multiplier=None, batch_size=64),
                       "(sigma|sample_rate)=.*(target epsilon|batch size)")):
        with pytest.raises(ValueError, match=match):
            _trainer("naive_dp", epochs=1, **kw).load_checkpoint(tmp_path / "c.pt")
    _trainer("naive_dp", epochs=1, target_epsilon=2.0, noise_multiplier=None).load_checkpoint(tmp_path / "c.pt")


@pytest.mark.parametrize("method", ["logit_dp", "naive_dp"])
def test_a_gradient_left_on_a_frozen_parameter_is_never_applied(method: str) -> None:
    """A backward of the user's own on training data, then the parameter frozen: the private step noises the
    trainable parameters only, so the optimizer must not step the frozen one with that un-noised gradient
    (it did: Adam applied it at every step)."""
    trainer = _trainer(method, epochs=1)
    frozen = trainer.encoder[1].weight
    x = torch.as_tensor(trainer.pairs[0][0]).unsqueeze(0)
    trainer.encoder(x).sum().backward()
    frozen.requires_grad_(False)
    before, trained = frozen.detach().clone(), trainer.encoder[3].weight.detach().clone()
    assert frozen.grad is not None and bool(frozen.grad.abs().sum() > 0)
    trainer.fit()
    assert torch.equal(frozen.detach(), before)
    assert not torch.equal(trainer.encoder[3].weight.detach(), trained)  # the steps ran


@pytest.mark.parametrize("seed", [None, 0])
def test_copies_of_a_pretrainer_draw_their_own_noise_and_batches(seed) -> None:
    """``copy.deepcopy`` of a pre-trainer (two forks of a run, say for a learning-rate search): before, the copy
    replayed the original's secret noise and batches, so the difference of the two releases carried no noise.
    Secret generators now copy as fresh ones (also when pickled); seeded ones still copy exactly."""
    import pickle

    original = _trainer("naive_dp", epochs=1, noise_seed=seed)
    copied = copy.deepcopy(original)
    pickled = pickle.loads(pickle.dumps(original.noise_generator))
    assert torch.equal(pickled.get_state(), original.noise_generator.get_state()) is (seed is not None)
    weights = []
    for run in (original, copied):
        run.fit()
        weights.append(torch.cat([p.detach().flatten() for p in run.encoder.parameters()]))
    assert torch.equal(weights[0], weights[1]) is (seed is not None)


def test_bad_input_errors() -> None:
    with pytest.raises(ValueError, match="delta"):
        _trainer("logit_dp", delta=0.01)
    with pytest.raises(ValueError, match="tau = 1"):
        _trainer("logit_dp", loss="spreadout", tau=0.5)
    with pytest.raises(ValueError, match="method"):
        _trainer("dpsgd")
    # refused when the pre-trainer is built, not at its first step; True is no temperature or clip norm of 1
    for kwargs, message in ((dict(gram_method="exact"), "method must be one of"), (dict(tau=True), "tau"),
                            (dict(clip_norm=True), "clip norm B")):
        with pytest.raises(ValueError, match=message):
            _trainer("logit_dp", **kwargs)
    bad = torch.rand(4, 1, 8, 8)
    bad[1, 0, 2, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN|finite"):
        AugmentedPairs(bad)
    with pytest.raises(ValueError, match="differ in shape"):
        GivenPairs(torch.rand(3, 5), torch.rand(3, 4))
    with pytest.raises(ValueError, match="differ in shape"):
        pair_gradient_norms(_mlp(0), torch.rand(3, 12).double(), torch.rand(2, 12).double())
    x = torch.rand(4, 12)
    for layer, message in ((nn.BatchNorm1d(8), "batch"), (nn.Dropout(0.1), "dropout")):
        enc = nn.Sequential(nn.Linear(12, 8), layer, nn.Linear(8, 4))
        with pytest.raises(ValueError, match=message):
            logit_dp_gradient(enc, x, x, "contrastive", 1.0, 1.0)


class _RunningMean(nn.Module):
    """A layer that keeps a running mean of its inputs in a buffer: a statistic of the batches without noise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x


@pytest.mark.parametrize("method", ["naive_dp", "logit_dp"])
def test_private_pretraining_refuses_an_encoder_that_keeps_batch_statistics(method) -> None:
    """Naive-DP accepted BatchNorm: its whole-batch clip bounds the gradient, but the running mean and variance of
    the private batches stayed in the encoder's buffers without noise, released with it.  Known layers are refused
    up front; any other change of the encoder by a forward or backward is refused at the step, the encoder restored
    and nothing released."""
    data, pairs = _digits_pairs()
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    with pytest.raises(ValueError, match="running statistics"):
        ContrastivePretrainer(enc, torch.optim.SGD(enc.parameters(), lr=0.1), pairs, method=method, batch_size=64,
                              epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False, log=None)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), _RunningMean(16), nn.Linear(16, 8))
    t = ContrastivePretrainer(enc, torch.optim.SGD(enc.parameters(), lr=0.1), pairs, method=method, batch_size=64,
                              epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False, log=None)
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    # Logit-DP's torch.func Jacobians of this layer refuse the mutation themselves, after the plain forward made it
    with pytest.raises(ValueError if method == "naive_dp" else RuntimeError,
                       match="changed 2.mean" if method == "naive_dp" else "mutate"):
        t.fit()
    assert all(torch.equal(v, before[k]) for k, v in enc.state_dict().items())
    assert t.steps == 0 and t.accountant.steps == 0 and all(p.grad is None for p in enc.parameters())
    # without privacy nothing is refused (nothing is claimed)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    ContrastivePretrainer(enc, torch.optim.SGD(enc.parameters(), lr=0.1), pairs, method="nonprivate", batch_size=64,
                          epochs=1, progress=False, log=None)


@pytest.mark.parametrize("how", ["by_hand", "optimizer", "load_state_dict"])
@pytest.mark.parametrize("method", ["naive_dp", "logit_dp"])
def test_an_encoder_changed_between_private_steps_is_refused_and_put_back(method, how, tmp_path) -> None:
    """Before, an update made outside the pre-trainer between two private steps (a non-private step on the
    training pairs, by hand or with the pre-trainer's own optimizer, or a load_state_dict) went into the encoder
    un-noised: the next step and the checkpoint released it.  Now the next step, and a checkpoint, refuse it and
    put the released encoder back."""
    t = _trainer(method, epochs=1)
    xa, xb = t.pairs.gather(list(range(64)))
    t._step(xa, xb)  # a released private step
    released = {k: v.clone() for k, v in t.encoder.state_dict().items()}
    for p in t.encoder.parameters():
        p.grad = None
    LOSS_FUNCTIONS["contrastive"](pair_logits(t.encoder, xa, xb, 1.0)).backward()  # no clip, no noise
    with torch.no_grad():
        if how == "by_hand":
            for p in t.encoder.parameters():
                p -= 0.1 * p.grad
        elif how == "optimizer":
            t.optimizer.step()
        else:
            t.encoder.load_state_dict({k: v + 0.01 for k, v in released.items()})
    steps = t.accountant.steps
    with pytest.raises(ValueError, match=f"the {'optimizer.s state' if how == 'optimizer' else 'encoder'} changed "
                                         "outside the private pre-training"):
        t.save_checkpoint(tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt").exists()
    assert all(torch.equal(v, released[k]) for k, v in t.encoder.state_dict().items())
    with torch.no_grad():
        next(t.encoder.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="the encoder changed outside the private pre-training"):
        t._step(xa, xb)
    assert all(torch.equal(v, released[k]) for k, v in t.encoder.state_dict().items())
    assert t.accountant.steps == steps
    t._step(xa, xb)  # the released encoder goes on training privately
    assert t.accountant.steps == steps + 1
    t.save_checkpoint(tmp_path / "ckpt.pt")


@pytest.mark.parametrize("how", ["outside_step", "load_state_dict", "cleared"])
def test_an_optimizer_state_changed_between_private_steps_is_refused_and_put_back(how, tmp_path) -> None:
    """The encoder was put back after a step of the pre-trainer's own optimizer outside ``fit()``, but the
    optimizer's moments kept that step's gradient, computed without noise: Adam carried it into every later
    released step, and a checkpoint saved it.  Now the next step and a checkpoint refuse a changed optimizer
    state, and put it back with the encoder."""
    t = _trainer("logit_dp", epochs=1)
    xa, xb = t.pairs.gather(list(range(64)))
    t._step(xa, xb)
    released = copy.deepcopy(t.optimizer.state_dict()["state"])
    weights = {k: v.clone() for k, v in t.encoder.state_dict().items()}

    def change() -> None:
        if how == "outside_step":
            for p in t.encoder.parameters():
                p.grad = None
            LOSS_FUNCTIONS["contrastive"](pair_logits(t.encoder, xa, xb, 1.0)).backward()  # no clip, no noise
            t.optimizer.step()
        elif how == "load_state_dict":
            other = copy.deepcopy(t.optimizer.state_dict())
            for entry in other["state"].values():
                entry["exp_avg"].add_(1.0)
            t.optimizer.load_state_dict(other)
        else:
            t.optimizer.state.clear()

    for act in (lambda: t.save_checkpoint(tmp_path / "ckpt.pt"), lambda: t._step(xa, xb)):
        change()
        with pytest.raises(ValueError, match="the optimizer's state changed outside the private pre-training"):
            act()
        now = t.optimizer.state_dict()["state"]
        assert now.keys() == released.keys()
        assert all(torch.equal(torch.as_tensor(now[i][k]), torch.as_tensor(v))
                   for i in released for k, v in released[i].items())
        assert all(torch.equal(v, weights[k]) for k, v in t.encoder.state_dict().items())
    assert not (tmp_path / "ckpt.pt").exists()
    for p in t.encoder.parameters():
        p.grad = None
    steps = t.accountant.steps
    t._step(xa, xb)  # the released state goes on training privately
    assert t.accountant.steps == steps + 1
    t.save_checkpoint(tmp_path / "ckpt.pt")


def test_a_pretraining_step_past_its_planned_steps_is_refused_before_reading_the_batch() -> None:
    """With a given noise multiplier the planned steps are the budget.  Before, the refusal came after the batch's
    clipped gradient was computed and left it, un-noised, in the encoder's ``.grad``, and said "the privacy budget
    (epsilon None, ...)"; now it comes first and names the planned steps."""
    from clipless.privacy.calibration import BudgetExhaustedError
    t = _trainer("naive_dp", epochs=1)
    t.fit()
    for p in t.encoder.parameters():
        p.grad = None
    xa, xb = t.pairs.gather(list(range(64)))
    with pytest.raises(BudgetExhaustedError, match=r"planned \d+ steps at the given noise multiplier"):
        t._step(xa, xb)
    assert all(p.grad is None for p in t.encoder.parameters())


def test_held_out_pairs_of_another_kind_are_refused_by_name() -> None:
    """A labelled dataset given as ``eval_pairs`` (its records are ``(image, label)``) died in the first held-out
    loss with "IndexError: Dimension out of range"; it is now named at construction."""
    data, _ = _digits_pairs()
    with pytest.raises(ValueError, match=r"eval_pairs must hold positive pairs \(xa, xb\)"):
        _trainer("logit_dp", eval_pairs=data.test)


def test_pairs_the_encoder_cannot_take_are_refused_by_name() -> None:
    """Float64 views with a float32 encoder failed with torch's "mat1 and mat2 must have the same dtype": the
    training pairs at the first step, ``eval_pairs`` at the first held-out loss, after the first epoch's private
    steps. Both are named at construction, for in-memory pairs and pairs read through ``__getitem__``."""
    from torch.utils.data import Dataset

    from clipless.contrastive import GivenPairs

    data, pairs = _digits_pairs()
    xa, xb = pairs.gather(list(range(len(pairs))))

    class Read(Dataset):  # pairs made in __getitem__, read once by the record check
        def __len__(self):
            return xa.shape[0]

        def __getitem__(self, i):
            return xa[i].double(), xb[i].double()

    for wide in (GivenPairs(xa.double(), xb.double()), Read()):
        with pytest.raises(ValueError, match=r"the training pairs: records of dtype torch.float64, the model's "
                                             r"weights torch.float32"):
            _trainer("logit_dp", pairs=wide)
    with pytest.raises(ValueError, match=r"eval_pairs: records of dtype torch.float64, the model's weights "
                                         r"torch.float32"):
        _trainer("logit_dp", eval_pairs=GivenPairs(xa[:16].double(), xb[:16].double()))


def test_held_out_pairs_are_read_and_checked_before_training() -> None:
    """Held-out pairs read through ``__getitem__`` were checked on their first record only: a NaN view made every
    logged held-out loss NaN, and views of another shape stopped the run at the first held-out loss, after the first
    epoch's private steps. They are read once and checked as the training pairs are, before any step."""
    from torch.utils.data import Dataset

    data, _ = _digits_pairs()
    views = data.test.features[:40].clone()

    class Read(Dataset):
        def __init__(self, bad=None):
            self.bad = bad

        def __len__(self):
            return views.shape[0]

        def __getitem__(self, i):
            if i == 25 and self.bad == "nan":
                return views[i] * float("nan"), views[i]
            if i == 25 and self.bad == "shape":
                return views[i, :, :4], views[i, :, :4]
            return views[i], views[i]

    for method in ("logit_dp", "nonprivate"):
        with pytest.raises(ValueError, match="eval_pairs contain NaN or infinite values"):
            _trainer(method, eval_pairs=Read("nan"))
        with pytest.raises(ValueError, match="eval_pairs cannot be read into batches"):
            _trainer(method, eval_pairs=Read("shape"))
    _trainer("logit_dp", eval_pairs=Read())


def test_a_directory_as_the_pretraining_checkpoint_is_refused_before_training(tmp_path) -> None:
    """It trained a whole epoch, then died on the first write ("Is a directory")."""
    with pytest.raises(ValueError, match="is a directory: give a file in it"):
        _trainer("logit_dp", checkpoint_path=tmp_path)


@pytest.mark.parametrize("method", ["logit_dp", "naive_dp"])
def test_an_optimizer_that_already_stepped_is_refused(method) -> None:
    """The pre-trainer took the optimizer's state as given for released: Adam's moments from a non-private step on
    the training images moved every private step.  Refused for the private methods; a fresh optimizer runs."""
    data, pairs = _digits_pairs()
    enc = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))
    warm = torch.optim.Adam(enc.parameters(), lr=0.0)
    enc(data.train.features[:32]).square().sum().backward()
    warm.step()
    options = dict(method=method, batch_size=128, epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False,
                   log=None)
    with pytest.raises(ValueError, match=r"the Adam given to the pre-trainer holds state from earlier steps"):
        ContrastivePretrainer(enc, warm, pairs, **options)
    ContrastivePretrainer(enc, warm, pairs, **{**options, "method": "nonprivate"})  # its own business
    enc.zero_grad()
    t = ContrastivePretrainer(enc, torch.optim.Adam(enc.parameters(), lr=0.1), pairs, **options)
    t._step(*pairs.gather(list(range(16))))
    assert t.accountant.steps == 1


@pytest.mark.parametrize("given", ["with_a_head", "of_another_model"])
def test_an_optimizer_of_parameters_outside_the_encoder_is_refused(given) -> None:
    """Before, a head in the pre-trainer's optimizer, holding the gradient of a non-private backward, was stepped
    with that gradient (no clipping, no noise) at every private step: it moved by 1.1 in a 1-epoch run at lr 0.1.
    An optimizer of another model's parameters spent the budget and left the encoder as it was."""
    data, pairs = _digits_pairs()
    enc, head = nn.Sequential(nn.Flatten(), nn.Linear(64, 16)), nn.Linear(16, 10)
    nn.functional.cross_entropy(head(enc(data.train.features[:32])), data.train.labels[:32]).backward()
    params = list(enc.parameters()) + list(head.parameters()) if given == "with_a_head" else list(head.parameters())
    with pytest.raises(ValueError, match="outside the encoder"):
        ContrastivePretrainer(enc, torch.optim.Adam(params, lr=0.1), pairs, method="logit_dp", batch_size=128,
                              epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False, log=None)
    t = ContrastivePretrainer(enc, torch.optim.Adam(enc.parameters(), lr=0.1), pairs, method="logit_dp",
                              batch_size=128, epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False, log=None)
    t.optimizer.add_param_group({"params": list(head.parameters())})  # after construction: the step refuses it
    with pytest.raises(ValueError, match="outside the encoder"):
        t._step(*pairs.gather(list(range(16))))
    assert t.accountant.steps == 0
    frozen = [p.requires_grad_(False) for p in head.parameters()]
    for p in frozen:
        p.grad = None
    with pytest.raises(ValueError, match="none of the encoder's trainable parameters"):
        ContrastivePretrainer(enc, torch.optim.Adam(frozen, lr=0.1), pairs, method="logit_dp", batch_size=128,
                              epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False, log=None)


def test_cli_pretrain_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert cli_main(["pretrain", "--epochs", "1", "--batch-size", "128", "--hidden", "32", "--embedding-dim", "8",
                     "--accountant", "rdp", "--no-progress", "--output-dir", str(out), "--probe-labels", "5"]) == 0
    text = capsys.readouterr().out
    assert "kNN(3) accuracy" in text and "epsilon" in text and "probe with 5 labels/class" in text
    import json

    result = json.loads((out / "result.json").read_text())
    assert result["epsilon"] <= 5.0 and result["method"] == "logit_dp" and (out / "encoder.pt").exists()
    assert (out / "training.png").read_bytes().startswith(b"\x89PNG")  # held-out loss and epsilon per epoch
    encoder = (out / "encoder.pt").read_bytes()
    assert cli_main(["pretrain", "--epochs", "1", "--batch-size", "128", "--hidden", "32", "--embedding-dim", "8",
                     "--accountant", "rdp", "--no-progress", "--output-dir", str(out)]) == 0
    (kept,) = [p for p in out.iterdir() if p.is_dir()]  # the first run's files, moved aside by the second
    assert (kept / "encoder.pt").read_bytes() == encoder and json.loads((kept / "result.json").read_text()) == result
    assert 0.1 < result["probe_5_per_class"] <= 1.0
    with pytest.raises(SystemExit, match="--probe-labels"):
        cli_main(["pretrain", "--probe-labels", "0", "--output-dir", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()  # refused before anything ran or was written
    for flags, match in ((["--noise-seed", "-1"], "--noise-seed: must be >= 0"),
                         (["--hidden", "0"], "--hidden: each width must be > 0"),
                         (["--encoder", "cnn", "--channels", "8", "0"], "--channels: each width must be > 0"),
                         (["--embedding-dim", "0"], "--embedding-dim: must be > 0"),
                         (["--input-pool", "0"], "--input-pool: must be >= 1"),
                         (["--input-pool", "9"], "--encoder mlp: input_pool 9 needs image inputs"),  # digits: 8 x 8
                         (["--hidden", "--evaluate-layer", "representation"],
                          "--evaluate-layer representation: the representation layer is the encoder's input here"),
                         (["--probe-labels", "10", "1000"], r"--probe-labels: at most \d+ per class"),
                         (["--method", "naive_dp", "--cross-term", "cauchy_schwarz"],  # ran without it, silently
                          "--cross-term is an option of --method logit_dp, not of --method naive_dp")):
        with pytest.raises(SystemExit, match=match):
            cli_main(["pretrain", *flags, "--output-dir", str(tmp_path / "bad")])
        assert not (tmp_path / "bad").exists()
    for flags in (["--blur", "0.05"], ["--pixel-noise", "-1"], ["--pixel-noise", "nan"]):
        with pytest.raises(SystemExit, match="--blur / --pixel-noise"):
            cli_main(["pretrain", *flags, "--output-dir", str(tmp_path / "bad")])
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("method", ["logit_dp", "naive_dp"])
def test_cli_pretrain_spectral_loss_at_a_small_temperature(tmp_path, method) -> None:
    """The spectral loss keeps its sensitivity polynomial in 1/tau: tau = 0.125 calibrates to the target with a
    finite sigma (the contrastive loss's 2 (B/tau)(1 + e^16) would make the noise useless), and the result says
    which loss and sensitivity it used."""
    import json

    out = tmp_path / method
    assert cli_main(["pretrain", "--method", method, "--loss", "spectral", "--tau", "0.125", "--epochs", "1",
                     "--batch-size", "128", "--hidden", "32", "--embedding-dim", "8", "--accountant", "rdp",
                     "--no-progress", "--output-dir", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["epsilon"] <= 5.0 and result["config"]["loss"] == "spectral"
    assert result["sensitivity"] == pytest.approx(2 / 0.125 * (1 + 3 / 0.125) if method == "logit_dp" else 2.0)


def test_cli_pretrain_cnn_encoder_takes_the_factored_path(tmp_path, capsys, monkeypatch) -> None:
    """`clipless pretrain --encoder cnn` clips with the factored pair norms (conv Jacobian blocks beside the
    Linear factors), not the all-parameter Jacobian path; `--cross-term cauchy_schwarz` bounds the conv block's
    cross term on every step and says so in result.json."""
    import json

    from clipless.contrastive import logit_dp as ld

    def refuse(*args, **kwargs):
        raise AssertionError("the CNN encoder fell back to the all-parameter Jacobian path")

    monkeypatch.setattr(ld, "_jacobian_terms_all_parameters", refuse)
    out = tmp_path / "cnn"
    assert cli_main(["pretrain", "--encoder", "cnn", "--channels", "4", "--epochs", "1", "--batch-size", "128",
                     "--hidden", "16", "--embedding-dim", "8", "--no-progress", "--output-dir", str(out),
                     "--blur", "1.0", "--pixel-noise", "0.1"]) == 0
    assert "kNN(3) accuracy" in capsys.readouterr().out
    assert json.loads((out / "result.json").read_text())["cross_term"] == "exact"
    bounded = []  # --cross-term cauchy_schwarz: the conv block's cross term is bounded, every step
    monkeypatch.setattr(ld, "_cauchy_schwarz_terms",
                        lambda *a, _f=ld._cauchy_schwarz_terms: bounded.append(1) or _f(*a))
    pooled = tmp_path / "pooled"  # --input-pool 2: the encoder averages 2 x 2 windows first, on the same path
    assert cli_main(["pretrain", "--encoder", "cnn", "--channels", "4", "--epochs", "1", "--batch-size", "128",
                     "--hidden", "16", "--embedding-dim", "8", "--no-progress", "--output-dir", str(pooled),
                     "--input-pool", "2", "--evaluate-layer", "representation", "--cross-term", "cauchy_schwarz"]) == 0
    result = json.loads((pooled / "result.json").read_text())
    assert result["config"]["input_pool"] == 2 and result["layer"] == "representation"
    assert result["cross_term"] == "cauchy_schwarz" and len(bounded) == result["steps"] > 0
    assert "representation kNN(3) accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="holds another encoder"):  # a resume must build the same encoder
        cli_main(["pretrain", "--encoder", "cnn", "--channels", "4", "--epochs", "1", "--batch-size", "128",
                  "--hidden", "16", "--embedding-dim", "8", "--no-progress", "--output-dir", str(pooled), "--resume"])


# ---------------------------------------------------------------------------------------------------
# Encoders the fast path must not misread (privacy-by-default findings 9, 10, 13)
# ---------------------------------------------------------------------------------------------------


def _max_clipped_pair_norm(encoder: nn.Module, xa: torch.Tensor, xb: torch.Tensor, clip: float) -> float:
    """Largest ||Clip_B(g_ij)|| with the library's clip factors and brute-force autograd pair gradients."""
    factors = clip_factors(encoder, xa, xb, clip)
    brute = _pair_grads(encoder, xa, xb)
    return max(float(factors[i, j]) * float(g.norm()) for (i, j), g in brute.items())


def _frozen_cases():
    """(encoder, names of the parameters to freeze): a Linear's weight, its bias, a whole Linear, the
    convolutions (weights only, or entirely), the first parameter of a conv encoder."""
    mlp = lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(),  # noqa: E731
                                nn.Linear(6, 4))
    cnn = lambda pool: build_encoder("cnn", (1, 6, 6), 4, hidden=(5,), channels=(2, 3), input_pool=pool)  # noqa: E731
    yield mlp, ["1.weight"]
    yield mlp, ["1.bias", "3.bias"]
    yield mlp, ["3.weight", "3.bias"]
    yield mlp, ["5.weight"]
    yield lambda: cnn(1), ["0.weight", "3.weight"]
    yield lambda: cnn(1), ["0.weight", "0.bias", "3.weight", "3.bias"]
    yield lambda: cnn(2), ["1.weight"]
    yield lambda: cnn(2), ["7.weight", "9.bias"]
    # everything before the last Linear frozen (a head trained on random features): the frozen layers' outputs
    # carry no autograd graph, and must not be differentiated
    yield mlp, ["1.weight", "1.bias", "3.weight", "3.bias"]
    yield mlp, ["1.weight", "1.bias"]
    yield lambda: cnn(2), ["1.weight", "1.bias", "4.weight", "4.bias", "7.weight", "7.bias"]


@pytest.mark.parametrize("index", range(11))
def test_frozen_parameters_are_left_out_of_the_pair_norms(index: int) -> None:
    """Parameters with ``requires_grad=False`` get no gradient, so they take no share of the clip: every path's
    pair norms equal brute-force pair gradients of the trainable parameters alone (the Linear factors once
    counted a frozen weight or bias, over-clipping), the clipped pairs stay within B, and removing a pair moves
    the released gradient by at most the sensitivity."""
    build, frozen = list(_frozen_cases())[index]
    torch.manual_seed(200 + index)
    enc = build().double()
    names = dict(enc.named_parameters())
    assert all(k in names for k in frozen)
    with torch.no_grad():
        for k, p in names.items():
            p.mul_(2.0)
            p.requires_grad_(k not in frozen)
    gen = torch.Generator().manual_seed(index)
    x = torch.randn(5, 1, 6, 6, generator=gen, dtype=torch.float64)
    xb = random_crop_flip(x, 1, True, torch.Generator().manual_seed(1))
    expected = _norm_matrix(_pair_grads(enc, x, xb))
    assert float(expected.median()) > 1e-4  # not a dead encoder (identical views have g = 0)
    for method in ("factored", "auto", "jacobian"):
        for cross_term in ("exact", "cauchy_schwarz"):
            norms = pair_gradient_norms(enc, x, xb, method=method, chunk=2, cross_term=cross_term)
            if cross_term == "exact":
                torch.testing.assert_close(norms**2, expected**2, rtol=1e-9, atol=1e-12)
            else:
                assert bool((norms**2 >= expected**2 * (1 - 1e-9) - 1e-12).all())
    clip = float(expected.median())
    assert _max_clipped_pair_norm(enc, x, xb, clip) <= clip * (1 + 1e-9)
    full = _gbar(enc, x, xb, "spectral", 0.5, clip)
    for r in range(5):
        keep = [i for i in range(5) if i != r]
        move = float((full - _gbar(enc, x[keep], xb[keep], "spectral", 0.5, clip)).norm())
        assert move <= logit_dp_sensitivity(clip, 0.5, "spectral") * (1 + 1e-9)


@pytest.mark.parametrize("linear_head", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_frozen_parameters_float32_clipped_pairs_stay_within_b(seed: int, linear_head: bool) -> None:
    """Float32 conv encoders with parts frozen (first conv weight, a whole conv, the biases, the head): the
    rounding margins still keep every clipped pair within B, for both paths and both cross terms."""
    enc32, xa, xb, _ = _float32_conv_case(seed, linear_head)
    names = [k for k, _ in enc32.named_parameters()]
    for frozen in ([names[0]], names[:2], [k for k in names if k.endswith("bias")], names[-2:]):
        enc = copy.deepcopy(enc32)
        for k, p in enc.named_parameters():
            p.requires_grad_(k not in frozen)
        true = pair_gradient_norms(copy.deepcopy(enc).double(), xa.double(), xb.double(), method="jacobian")
        kept = true > 1e-5
        for method in ("factored", "jacobian"):
            for cross_term in ("exact", "cauchy_schwarz"):
                for clip in (float(true[kept].min()), float(true.median()), float(true.max()) * (1 - 1e-7)):
                    factor = clip_factors(enc, xa, xb, clip, method=method, cross_term=cross_term)
                    assert bool((factor * true <= clip * (1 + 1e-9))[kept].all())


def test_in_place_activations_do_not_skip_their_derivative() -> None:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)).double()
    xa, xb = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    brute = _pair_grads(enc, xa, xb)
    expected = _norm_matrix(brute)
    torch.testing.assert_close(pair_gradient_norms(enc, xa, xb, method="factored"), expected, rtol=1e-7, atol=1e-10)
    assert _max_clipped_pair_norm(enc, xa, xb, clip=0.05) <= 0.05 * (1 + 1e-9)


def test_tied_weights_are_summed_before_the_norm() -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(5, 5), nn.Linear(5, 5)
    second.weight = first.weight  # one parameter used twice
    enc = nn.Sequential(first, nn.Tanh(), second).double()
    xa, xb = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    brute = _pair_grads(enc, xa, xb)
    expected = _norm_matrix(brute)
    torch.testing.assert_close(pair_gradient_norms(enc, xa, xb), expected, rtol=1e-7, atol=1e-10)
    assert _max_clipped_pair_norm(enc, xa, xb, clip=0.05) <= 0.05 * (1 + 1e-9)
    with pytest.raises(ValueError, match="method='factored'"):
        pair_gradient_norms(enc, xa, xb, method="factored")


def test_a_torch_mode_is_refused() -> None:
    """A dispatch mode sees every operation, and may act on the pass that measures the pair norms otherwise than on
    the one that differentiates them (here: every matrix product 1.5x, the norms' own products included)."""

    class Products(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 1.5 if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) else out

    enc = _mlp(0)
    xa, xb = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 12, dtype=torch.float64)
    with Products(), pytest.raises(ValueError, match="a torch function or dispatch mode"):
        logit_dp_gradient(enc, xa, xb, "spectral", 0.5, 0.1)
    with torch.device("cpu"):  # places new tensors only
        logit_dp_gradient(enc, xa, xb, "spectral", 0.5, 0.1)


@pytest.mark.parametrize("method", ["auto", "jacobian"])
def test_a_module_called_twice_keeps_its_parameters(method: str) -> None:
    """One ``nn.Linear`` module run twice in the forward (tied by reuse, not by assignment): torch's
    ``functional_call`` put its substitute tensors back into such a module in place of its parameters, so the
    first pair-norm pass replaced the layer's weight by a detached copy (a later pass left it out of the norms and
    the optimizer's updates no longer reached the encoder), and the next pass crashed on the mismatched Jacobians.
    The module keeps its parameters; every pass, the release included, matches brute-force pair gradients."""
    torch.manual_seed(3)
    shared = nn.Linear(6, 6)
    enc = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(6, 4)).double()
    before = {k: p for k, p in enc.named_parameters()}
    xa, xb = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    expected = _norm_matrix(_pair_grads(enc, xa, xb))
    for _ in range(2):
        torch.testing.assert_close(pair_gradient_norms(enc, xa, xb, method=method), expected, rtol=1e-7, atol=1e-10)
        assert {k: p for k, p in enc.named_parameters()} == before
        assert all(type(p) is nn.Parameter and p.requires_grad for p in enc.parameters())
    assert enc[2].weight is enc[4].weight is before["2.weight"]
    clip = float(expected.median())
    assert _max_clipped_pair_norm(enc, xa, xb, clip) <= clip * (1 + 1e-9)
    brute = _pair_grads(enc, xa, xb)
    with torch.no_grad():
        a = logit_gradient(similarity_logits(normalized_embedding(enc, xa), normalized_embedding(enc, xb), 0.5),
                           "spectral")
    released = sum(a[i, j] * g * min(1.0, clip / float(g.norm())) for (i, j), g in brute.items()) / 0.5
    for _ in range(2):
        logit_dp_gradient(enc, xa, xb, "spectral", 0.5, clip, method=method)
        assert {k: p for k, p in enc.named_parameters()} == before
        torch.testing.assert_close(_grad_vector(enc), released, rtol=1e-9, atol=1e-12)


def test_custom_module_using_a_linear_weight_directly_takes_the_exact_path() -> None:
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)

        def forward(self, x):
            return self.fc(x) + torch.tanh(x @ self.fc.weight.T)  # a use no forward hook sees

    torch.manual_seed(1)
    enc = Reuse().double()
    xa, xb = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    brute = _pair_grads(enc, xa, xb)
    expected = _norm_matrix(brute)
    torch.testing.assert_close(pair_gradient_norms(enc, xa, xb), expected, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("train", [True, False])
def test_batch_statistics_refused_whatever_the_mode(train: bool, affine: bool) -> None:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, affine=affine, track_running_stats=False), nn.Linear(8, 4))
    enc.train(train)
    xa, xb = torch.randn(6, 6), torch.randn(6, 6)
    with pytest.raises(ValueError, match="couples examples"):
        logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 1.0)


def test_unknown_coupling_module_detected_on_the_exact_path() -> None:
    class MixBatch(nn.Module):
        def forward(self, x):
            return x - 0.5 * x.mean(dim=0, keepdim=True)  # one example's output moves with the others

    enc = nn.Sequential(nn.Linear(6, 8), MixBatch(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="depends on the other examples"):
        logit_dp_gradient(enc, torch.randn(5, 6), torch.randn(5, 6), "contrastive", 1.0, 1.0)


# ---------------------------------------------------------------------------------------------------
# The tail path: layers whose output reaches the embedding through R diag(m) (issue 19)
# ---------------------------------------------------------------------------------------------------


def _tail_encoders():
    """Encoders whose last two layers (or last layer) take the tail path, with every shape of tail."""
    torch.manual_seed(3)
    yield nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 5))  # both layers are tail layers
    yield nn.Sequential(nn.Linear(7, 16, bias=False), nn.Tanh(), nn.Softplus(), nn.Linear(16, 5), nn.Flatten())
    yield nn.Sequential(nn.Linear(7, 9), nn.GELU(), nn.Linear(9, 6), nn.Tanh())  # activation after the last layer
    yield nn.Sequential(nn.Linear(7, 4))  # one layer: R = identity, m = 1
    yield nn.Sequential(nn.Sequential(nn.Linear(7, 8), nn.ELU()), nn.Sequential(nn.Linear(8, 8), nn.SiLU()),
                        nn.Linear(8, 3))  # nested containers and a deep first layer
    shared = nn.Tanh()  # one activation module called twice: module order alone would hide the second call
    yield nn.Sequential(nn.Linear(7, 9), shared, nn.Linear(9, 4), shared)


@pytest.mark.parametrize("index", range(6))
def test_tail_path_equals_autograd_and_the_jacobian_path(index: int) -> None:
    enc = list(_tail_encoders())[index].double()
    gen = torch.Generator().manual_seed(index)
    with torch.no_grad():
        for p in enc.parameters():
            p.mul_(1 + 2 * index)  # large weights: large and small pair norms side by side
    xa = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    xb = xa + 0.3 * torch.randn(6, 7, generator=gen, dtype=torch.float64)
    xb[1] = xa[1]  # identical views: g_11 cancels exactly
    xb[2] = -xa[2]  # opposite embeddings for the one-layer encoder: c = -1
    brute = _pair_grads(enc, xa, xb)
    expected = _norm_matrix(brute)
    for method in ("factored", "jacobian"):
        norms = pair_gradient_norms(enc, xa, xb, method=method)
        torch.testing.assert_close(norms**2, expected**2, rtol=1e-9, atol=1e-12 * float(expected.max()) ** 2)
    assert float(expected[1, 1]) < 1e-6 * float(expected.max())


def test_tail_path_is_taken_where_it_applies() -> None:
    """The fast path is not silently skipped: the benchmark's MLP encoder never forms d x width blocks."""
    from clipless.contrastive import logit_dp as ld

    enc = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    _, _, factors, _ = ld._layer_factors(enc, torch.randn(4, 3, 4), 64)
    assert [f[0] for f in factors] == ["tail", "tail"]
    deep = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))
    _, _, factors, _ = ld._layer_factors(deep, torch.randn(4, 12), 64)
    assert [f[0] for f in factors] == ["deep", "tail", "tail"]
    ends_in_act = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU())
    _, _, factors, _ = ld._layer_factors(ends_in_act, torch.randn(4, 12), 64)
    assert [f[0] for f in factors] == ["deep", "tail"]  # D W D: not R diag(m)


def test_zero_embedding_takes_the_exact_derivative() -> None:
    """A final ReLU can output e = 0, where normalization is not (I - u u^T)/r: such a side falls back to the
    autograd deltas, on one side only as well as on both."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.ReLU()).double()
    pool = 3 * torch.randn(400, 4, dtype=torch.float64)
    with torch.no_grad():
        enc[2].bias.zero_()  # the three outputs all negative on some inputs
        dead = enc(pool).abs().sum(1) == 0
    assert 0 < int(dead.sum()) < 400
    live = pool[~dead]
    xa = torch.cat([pool[dead][:1], live[:4]])  # one zero embedding on side a
    xb = live[4:9].clone()
    from clipless.contrastive import logit_dp as ld

    assert [f[0] for f in ld._layer_factors(enc, xa, 64)[2]] == ["deep", "deep"]
    assert [f[0] for f in ld._layer_factors(enc, xb, 64)[2]] == ["deep", "tail"]
    for a, b in ((xa, xb), (xb, xa), (xa, xa.flip(0))):
        brute = _pair_grads(enc, a, b)
        expected = _norm_matrix(brute)
        norms = pair_gradient_norms(enc, a, b, method="factored")
        torch.testing.assert_close(norms**2, expected**2, rtol=1e-9, atol=1e-12 * float(expected.max()) ** 2)


@pytest.mark.parametrize("seed", range(4))
def test_tail_path_clipped_pair_gradients_never_exceed_b_in_float32(seed: int) -> None:
    """Float32 clip factors on the tail path against float64 brute force, with near-cancelling pairs
    (identical or almost identical views), embeddings nearly parallel to R's columns and wide layers."""
    torch.manual_seed(seed)
    enc64 = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 6)).double()
    with torch.no_grad():
        enc64[2].weight.mul_(5.0 * (seed + 1))
        if seed % 2:  # R's columns all along one direction: beta_i = R^T u_i nearly maximal
            enc64[2].weight.copy_(torch.randn(6, 1, dtype=torch.float64) * torch.rand(1, 64, dtype=torch.float64))
    enc32 = copy.deepcopy(enc64).float()
    gen = torch.Generator().manual_seed(seed)
    xa = torch.randn(8, 20, generator=gen)
    xb = xa + 1e-4 * torch.randn(8, 20, generator=gen)
    xb[::2] = xa[::2]
    true = pair_gradient_norms(enc64, xa.double(), xb.double(), method="jacobian")
    positive = true[true > 1e-3 * float(true.max())]
    for clip in (1e-9 * float(true.max()), float(positive.min()), float(true.median()),
                 float(true.max()) * (1 - 1e-7)):
        factor = clip_factors(enc32, xa, xb, clip)
        big = true > 1e-6 * float(true.max())  # below: the float64 reference is itself rounding noise
        assert bool(((factor * true)[big] <= clip * (1 + 1e-9)).all())
        # Nor does the margin over-clip the larger pairs of a generic layer.  With R of rank one (odd seeds) every
        # embedding lies near R's direction and every pair norm is tiny against the margin's scale
        # ||m||_inf^2 ||R||_F^2 ||h||^2 / r^2: there they are over-clipped, never under-clipped.
        far = (true > 10 * clip) & (true > 0.01 * float(true.max()))
        if seed % 2 == 0 and bool(far.any()):
            assert float((factor * true)[far].min()) > 0.99 * clip


@pytest.mark.parametrize("n", [257, 1024])
def test_tail_path_at_large_batches_on_sampled_pairs(n: int) -> None:
    """At the batch sizes of training, sampled pair norms (the identical-view diagonal included) equal
    brute-force autograd, and the clipped pairs stay within B."""
    torch.manual_seed(n)
    enc = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 6)).double()
    gen = torch.Generator().manual_seed(n)
    xa = torch.randn(n, 10, generator=gen, dtype=torch.float64)
    xb = xa + 0.2 * torch.randn(n, 10, generator=gen, dtype=torch.float64)
    xb[: n // 4] = xa[: n // 4]
    norms = pair_gradient_norms(enc, xa, xb, method="factored")
    clip = float(norms.median())
    factor = clip_factors(enc, xa, xb, clip, method="factored")
    rows = torch.randint(0, n, (30,), generator=gen).tolist() + [0, 1, n - 1]
    cols = torch.randint(0, n, (30,), generator=gen).tolist() + [0, n - 1, 1]
    params = list(enc.parameters())
    for i, j in zip(rows, cols):
        c = (normalized_embedding(enc, xa[i : i + 1]) * normalized_embedding(enc, xb[j : j + 1])).sum()
        true = float(torch.cat([g.flatten() for g in torch.autograd.grad(c, params)]).norm())
        assert abs(float(norms[i, j]) ** 2 - true**2) <= 1e-10 * float(norms.max()) ** 2
        assert float(factor[i, j]) * true <= clip * (1 + 1e-9)


@pytest.mark.parametrize("loss,tau", [("contrastive", 0.5), ("contrastive", 2.0), ("spreadout", 1.0),
                                      ("spectral", 0.125)])
def test_sensitivity_holds_at_batch_1024(loss: str, tau: float) -> None:
    """Add/remove one pair from a batch of 1024 (the removed pair chosen adversarially: the largest row of
    clipped weights, an identical-view pair and a repeated example) moves gbar by at most the bound."""
    n = 1024
    torch.manual_seed(5)
    enc = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 6)).double()
    gen = torch.Generator().manual_seed(6)
    xa = torch.randn(n, 10, generator=gen, dtype=torch.float64)
    xb = xa + 0.1 * torch.randn(n, 10, generator=gen, dtype=torch.float64)
    xa[1:9] = xa[0]  # a repeated example
    xb[1:9] = xb[0]
    xb[20] = xa[20]
    clip = 0.05
    full = _gbar(enc, xa, xb, loss, tau, clip)
    bound = logit_dp_sensitivity(clip, tau, loss, batch_size=n)
    with torch.no_grad():
        weights = logit_gradient(similarity_logits(normalized_embedding(enc, xa), normalized_embedding(enc, xb), tau),
                                 loss).abs()
    worst_row = int((weights.sum(1) + weights.sum(0)).argmax())
    worst = 0.0
    for k in {worst_row, 0, 20, n - 1}:
        keep = [i for i in range(n) if i != k]
        ratio = float((full - _gbar(enc, xa[keep], xb[keep], loss, tau, clip)).norm()) / bound
        worst = max(worst, ratio)
        assert ratio <= 1 + 1e-9, (k, ratio)
    assert worst > 5e-3  # the removals probe the bound (0.009-0.15 of it here), not a vacuous corner


def test_build_encoder_kinds() -> None:
    cnn = build_encoder("cnn", (1, 8, 8), 5, hidden=[7], channels=[3])
    assert any(isinstance(m, nn.Conv2d) for m in cnn.modules()) and cnn(torch.rand(2, 1, 8, 8)).shape == (2, 5)
    mlp = build_encoder("mlp", (1, 8, 8), 5, hidden=[7])
    assert not any(isinstance(m, nn.Conv2d) for m in mlp.modules()) and mlp(torch.rand(2, 1, 8, 8)).shape == (2, 5)
    with pytest.raises(ValueError, match="encoder must be one of"):
        build_encoder("resnet", (1, 8, 8), 5)
    for kind in ("cnn", "mlp"):  # input_pool=2 averages 2 x 2 windows first: the same encoder on 4 x 4 images
        pooled = build_encoder(kind, (1, 8, 8), 5, hidden=[7], channels=[3], input_pool=2)
        assert isinstance(pooled[0], nn.AvgPool2d) and pooled(torch.rand(2, 1, 8, 8)).shape == (2, 5)
        torch.manual_seed(0)
        plain = build_encoder(kind, (1, 4, 4), 5, hidden=[7], channels=[3])
        nn.Sequential(*pooled[1:]).load_state_dict(plain.state_dict())
        x = torch.rand(3, 1, 8, 8)
        torch.testing.assert_close(pooled(x), plain(nn.functional.avg_pool2d(x, 2)))
    for bad in (0, 1.5, True, 9):
        with pytest.raises(ValueError, match="input_pool"):
            build_encoder("cnn", (1, 8, 8), 5, input_pool=bad)
    with pytest.raises(ValueError, match="needs image inputs"):
        build_encoder("mlp", (12,), 5, input_pool=2)


def _views(seed: int, n: int, dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two ``(n, 12)`` Gaussian batches of views from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=gen, dtype=dtype), torch.randn(n, 12, generator=gen, dtype=dtype)


def _scaling_slips():
    """Ways to make the backward of the released pass differ from the function whose pair norms were clipped."""

    def weight_hook(enc):
        enc[1].weight.register_hook(lambda g: 100 * g)

    def accumulate_hook(enc):
        enc[1].weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(100))

    return {"weight tensor hook": weight_hook, "post-accumulate hook": accumulate_hook}


@pytest.mark.parametrize("slip", sorted(_scaling_slips()))
def test_hooks_on_parameters_do_not_reach_the_released_gradient(slip: str) -> None:
    """A hook on a weight scaled Logit-DP's released sum 58-fold: it is now taken at fresh leaves."""
    xa, xb = _views(3, 6)
    clean = _mlp(2, act=nn.ReLU)
    logit_dp_gradient(clean, xa, xb, "contrastive", 1.0, 0.1)
    hooked = _mlp(2, act=nn.ReLU)
    _scaling_slips()[slip](hooked)
    logit_dp_gradient(hooked, xa, xb, "contrastive", 1.0, 0.1)
    torch.testing.assert_close(_grad_vector(hooked), _grad_vector(clean), rtol=0, atol=0)


def _refused_slips():
    def backward_hook(enc):
        return enc[3].register_full_backward_hook(lambda m, gi, go: (100 * gi[0],))

    def backward_pre_hook(enc):
        return enc[3].register_full_backward_pre_hook(lambda m, go: (100 * go[0],))

    def forward_hook(enc):
        return enc[3].register_forward_hook(lambda m, a, out: 100 * out)

    def global_backward_hook(enc):
        return nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: tuple(
            None if g is None else 100 * g for g in gi))

    return {"backward hook": backward_hook, "backward pre-hook": backward_pre_hook, "forward hook": forward_hook,
            "global backward hook": global_backward_hook}


@pytest.mark.parametrize("slip", sorted(_refused_slips()))
def test_hooks_that_could_change_the_backward_are_refused(slip: str) -> None:
    xa, xb = _views(4, 4)
    enc = _mlp(5, act=nn.ReLU)
    handle = _refused_slips()[slip](enc)
    try:
        with pytest.raises(ValueError, match="hook"):
            logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1)
    finally:
        handle.remove()
    assert all(p.grad is None for p in enc.parameters())
    logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1)  # and accepted once removed


def test_saved_tensor_hooks_refused_and_save_on_cpu_accepted() -> None:
    xa, xb = _views(5, 4)
    enc = _mlp(6, act=nn.ReLU)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: 100 * t, lambda t: t):
        with pytest.raises(ValueError, match="saved-tensor hooks"):
            logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1)
    logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1)
    clean = _grad_vector(enc)
    with torch.autograd.graph.save_on_cpu():
        logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1)
    torch.testing.assert_close(_grad_vector(enc), clean, rtol=0, atol=0)


def test_a_forward_that_changes_between_passes_is_refused() -> None:
    """The third call on scales the input: the pair norms would be measured on another function than the one
    differentiated (the released sum was 1.2 here for a bound of about 0.3 before the check)."""

    class Drifting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(12, 4, dtype=torch.float64)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.lin(x * (100.0 if self.calls > 2 else 1.0))

    xa, xb = _views(6, 4)
    with pytest.raises(ValueError, match="changed between the pass that measured"):
        logit_dp_gradient(Drifting(), xa, xb, "contrastive", 1.0, 0.1)


class _ScalesOutsideVmap(torch.autograd.Function):
    """Identity forward; a backward that is the identity under vmap (where the pair norms are measured) and
    1000x outside it (the released pass): released 691x the clean gradient before the check."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * (1.0 if torch._C._functorch.is_batchedtensor(g) else 1000.0)

    generate_vmap_rule = True


@pytest.mark.parametrize("method", ["auto", "jacobian"])
def test_a_custom_autograd_function_in_the_encoder_is_refused(method: str) -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(12, 16, dtype=torch.float64), nn.Linear(16, 4, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(_ScalesOutsideVmap.apply(torch.tanh(self.first(x))))

    xa, xb = _views(7, 64)
    with pytest.raises(ValueError, match="custom torch.autograd.Function _ScalesOutsideVmap"):
        logit_dp_gradient(Encoder(), xa, xb, "contrastive", 1.0, 0.1, method=method)


def test_a_custom_function_used_for_some_inputs_only_is_refused_in_the_released_pass() -> None:
    """The early check sees the first example; the released pass's whole graph is checked too."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(12, 4, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            if x.shape[0] > 1:  # not on a single example
                out = _ScalesOutsideVmap.apply(out)
            return out

    xa, xb = _views(8, 8)
    with pytest.raises(ValueError, match="custom torch.autograd.Function"):
        logit_dp_gradient(Encoder(), xa, xb, "contrastive", 1.0, 0.1, method="jacobian")


@pytest.mark.parametrize("batch_size", [True, "8", 0, 10 ** 6, float("nan")])
def test_pretrainer_refuses_a_bad_expected_batch_size(batch_size) -> None:
    """``batch_size=True`` was accepted as 1 (a boolean is an int): q = 1/N accounted for a batch of 1."""
    with pytest.raises(ValueError, match="batch_size"):
        _trainer("logit_dp", batch_size=batch_size)


@pytest.mark.parametrize("method", ["auto", "factored", "jacobian"])
def test_an_instance_level_forward_is_refused(method: str) -> None:
    """``encoder[0].forward`` replaced by the same values with 100x the gradient (``y + 99 (y - y.detach())``):
    the factored path measured the class's Jacobian, and the release used the instance's: 62x the clean gradient."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    lin = enc[0]

    def amplified(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, lin.weight, lin.bias)
        return y + 99 * (y - y.detach())

    lin.forward = amplified
    xa, xb = _views(9, 32, torch.float32)
    with pytest.raises(ValueError, match="has its own forward"):
        logit_dp_gradient(enc, xa, xb, "contrastive", 1.0, 0.1, method=method)


def test_non_finite_views_and_overflowing_encoders_refused_clearly() -> None:
    """NaN views were reported as an encoder whose forward changed between passes; an encoder overflowing to
    inf embeddings gave NaN clip factors."""
    enc = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    good = torch.randn(4, 12)
    for bad_value in (float("nan"), float("inf")):
        bad = good.clone()
        bad[2, 5] = bad_value
        with pytest.raises(ValueError, match="second views contain NaN or infinite"):
            logit_dp_gradient(enc, good, bad, "contrastive", 1.0, 1.0)
    overflow = nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 4))
    with torch.no_grad():
        overflow[0].weight.mul_(1e36)
        overflow[1].weight.mul_(1e36)
    with pytest.raises(ValueError, match="NaN or infinite .*overflow"):
        logit_dp_gradient(overflow, good, good, "contrastive", 1.0, 1.0)


@pytest.mark.parametrize("method", ["logit_dp", "naive_dp"])
def test_a_bad_training_pair_is_refused_before_any_private_step(method) -> None:
    """A pair the step refuses (a NaN or infinite view, views of another shape) stopped a private pre-training at
    the step whose secret Poisson batch first held it, after a number of released steps that depends on that pair.
    The pre-trainer now checks every pair at construction: a pair dataset of one's own is read once, in order; one
    that declares its ``record_tensors()`` (``AugmentedPairs``, ``GivenPairs``) is checked from them."""
    from torch.utils.data import Dataset

    data, _ = _digits_pairs()
    x = data.train.features

    class Read(Dataset):  # pairs built on each read, handing no tensors over
        def __init__(self, images):
            self.images = images

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            return self.images[i].clone(), self.images[i].flip(-1)

    bad = x.clone()
    bad[len(x) - 3, 0, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="the training pairs contain NaN or infinite values"):
        _trainer(method, pairs=Read(bad))
    bad[len(x) - 3, 0, 2, 5] = float("inf")
    with pytest.raises(ValueError, match="the training pairs contain NaN or infinite values"):
        _trainer(method, pairs=Read(bad))

    class Cropped(Read):  # one pair's second view is smaller
        def __getitem__(self, i):
            a, b = super().__getitem__(i)
            return a, (b[..., 1:] if i == 1000 else b)

    with pytest.raises(ValueError, match="the training pairs"):
        _trainer(method, pairs=Cropped(x))
    t = _trainer(method, pairs=Read(x), epochs=1)
    t.fit()
    assert t.accountant.steps == t.planned_steps
    # the built-in pair datasets are checked from the tensors they hold, without drawing an augmentation
    pairs = AugmentedPairs(x.clone(), padding=1, flip=False, seed=0)
    _trainer(method, pairs=pairs)
    assert pairs.draws.tolist() == [1] + [0] * (len(x) - 1)  # the loader's collate: record 0, its empty batch's shape
    pairs.images[7, 0, 1, 1] = float("inf")  # changed in place after construction
    with pytest.raises(ValueError, match="the training pairs' data contains 1 NaN or infinite values"):
        _trainer(method, pairs=pairs)
    given = GivenPairs(x.clone(), x.clone())
    given.xb[3, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="the training pairs' data contains 1 NaN or infinite values"):
        _trainer(method, pairs=given)
    _trainer("nonprivate", pairs=given)  # no private step, no check


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -1.0, "1"])
def test_clip_norms_and_temperatures_must_be_positive_and_finite(bad):
    """An infinite B was accepted: the sensitivity was infinite and the first noisy step overflowed.  A string
    died with "'>' not supported between instances of 'str' and 'int'"."""
    from clipless.contrastive.logit_dp import logit_dp_sensitivity, naive_dp_sensitivity

    with pytest.raises(ValueError, match="must be a positive finite number"):
        logit_dp_sensitivity(bad, 1.0)
    with pytest.raises(ValueError, match="must be a positive finite number"):
        logit_dp_sensitivity(1.0, bad)
    with pytest.raises(ValueError, match="must be a positive finite number"):
        naive_dp_sensitivity(bad)


def test_the_pretrainers_privacy_settings_are_read_only_and_checked_every_step() -> None:
    """``t.tau = 0.1`` after construction ran InfoNCE at tau 0.1, whose sensitivity is e^18 times the one the
    noise was calibrated to, at the reported epsilon; ``t.clip_norm``, ``t.sigma``, ``t.method`` or ``t.delta``
    (epsilon 0 at delta 0.5) did the same.  They are now read-only, and a step checks them against their values
    at construction (a write to the instance's ``__dict__`` passes the read-only guard)."""
    t = _trainer("logit_dp", epochs=1)
    for name, value in [("tau", 0.1), ("clip_norm", 100.0), ("sigma", 1e-6), ("sensitivity", 1e-6),
                        ("method", "nonprivate"), ("delta", 0.5), ("noise_generator", torch.Generator())]:
        with pytest.raises(AttributeError, match=f"ContrastivePretrainer.{name} is a declared constant"):
            setattr(t, name, value)
    xa, xb = t.pairs.gather(list(range(64)))
    weights = {k: v.clone() for k, v in t.encoder.state_dict().items()}
    for name, value in [("tau", 0.1), ("clip_norm", 100.0), ("sigma", 1e-6)]:
        frozen = t.__dict__[name]
        t.__dict__[name] = value
        with pytest.raises(ValueError, match="privacy settings .* changed after it was built"):
            t._step(xa, xb)
        assert all(torch.equal(v, weights[k]) for k, v in t.encoder.state_dict().items())
        assert t.accountant.steps == 0
        t.__dict__[name] = frozen
    step_sigma = t.plan.step_sigma  # a field of the frozen plan written in place: the accountant would compose 1e9
    object.__setattr__(t.plan, "step_sigma", 1e9)
    with pytest.raises(ValueError, match="privacy settings .* changed after it was built"):
        t._step(xa, xb)
    assert t.accountant.steps == 0
    object.__setattr__(t.plan, "step_sigma", step_sigma)
    t._step(xa, xb)  # as built, it steps
    assert t.accountant.steps == 1


def test_pairs_given_as_a_data_loader_keep_its_workers_and_get_poisson_batches() -> None:
    """A ``DataLoader`` of pairs failed with ``'DataLoader' object is not subscriptable``. As in ``make_private``,
    its dataset is sampled by Poisson batches at ``batch_size / len(dataset)`` (not per loader batch), its worker
    settings are kept, and a collate function of its own is refused (it may mix the pairs of a batch)."""
    from torch.utils.data import DataLoader

    data, pairs = _digits_pairs()
    held_out = AugmentedPairs(data.test.features, 1, False)
    t = _trainer("logit_dp", pairs=DataLoader(pairs, batch_size=64, num_workers=2, shuffle=True), epochs=1,
                 eval_pairs=DataLoader(held_out, batch_size=32))
    assert t.pairs is pairs and t.eval_pairs is held_out and t.sample_rate == 128 / len(pairs)
    assert t.loader.num_workers == 2
    t.fit()
    assert t.accountant.steps == t.planned_steps
    with pytest.raises(ValueError, match="collate_fn of its own"):
        _trainer("logit_dp", pairs=DataLoader(pairs, batch_size=64, collate_fn=lambda b: b))
