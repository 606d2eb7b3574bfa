"""The fast certificates (issue 16) stay upper bounds under attack: the near-orthonormal shortcut of
``certified_spectral_norm``, the half-spectrum FFT bound of convolutions, the cheap Björck pre-check,
the certified Björck step, the fused MaxMin / L2-norm pooling, and the value cache under in-place edits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless.nn.conv import LipschitzConv2d
from clipless.nn.functional import bjorck_orthonormalize, l2_norm_pool2d, max_min
from clipless.nn.linear import LipschitzLinear
from clipless.privacy.certified import BoundError, certified_bjorck_step, certified_spectral_norm


def _true_norm(w: torch.Tensor) -> float:
    return float(torch.linalg.svdvals(w.detach().double())[0])


def _orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = torch.empty(rows, cols)
    torch.nn.init.orthogonal_(w, generator=torch.Generator().manual_seed(seed))
    return w


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 10_000),
       push=st.floats(0.0, 6e-3), noise=st.floats(0.0, 1e-3))
def test_near_orthonormal_shortcut_is_an_upper_bound(rows, cols, seed, push, noise) -> None:
    """Adversarial: all the deviation from orthonormality on the top singular direction (where the
    Frobenius shortcut is tightest), plus random noise; the bound must never fall below the true norm."""
    w = _orthonormal(rows, cols, seed).double()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    s = s.clone()
    s[0] = s[0] * (1 + push)
    w = (u * s) @ vh + noise * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w32 = w.float()
    assert certified_spectral_norm(w32) >= _true_norm(w32)


def test_shortcut_and_eigensolver_agree_and_the_shortcut_is_tight() -> None:
    w = _orthonormal(64, 200, 0)
    assert certified_spectral_norm(w) == pytest.approx(1.0, abs=1e-5)
    bigger = w * 1.3  # far from orthonormal: the eigensolver path
    assert certified_spectral_norm(bigger) == pytest.approx(_true_norm(bigger), rel=1e-8)
    assert certified_spectral_norm(bigger) >= _true_norm(bigger)


def test_bound_follows_every_in_place_edit() -> None:
    """The cached bound of a layer is recomputed after any edit, even one ulp through .data."""
    torch.manual_seed(0)
    layer = LipschitzLinear(32, 16)
    layer.project_()
    first = layer.layer_bound(1.0, (32,)).lipschitz
    assert first >= _true_norm(layer.weight)
    u, _, vh = torch.linalg.svd(layer.weight.detach().double(), full_matrices=False)
    for scale in (1 + 1e-7, 1 + 1e-3, 1.05):  # push the top singular value up, in place
        layer.weight.data.add_(((scale - 1) * torch.outer(u[:, 0], vh[0])).float())
        bound = layer.layer_bound(1.0, (32,)).lipschitz
        assert bound >= _true_norm(layer.weight)
    layer.project_()
    assert layer.layer_bound(1.0, (32,)).lipschitz >= _true_norm(layer.weight)


@settings(max_examples=25, deadline=None)
@given(cin=st.integers(1, 6), cout=st.integers(1, 6), k=st.sampled_from([1, 2, 3, 5]), n=st.integers(2, 9),
       pad=st.integers(0, 2), circular=st.booleans(), seed=st.integers(0, 1000))
def test_half_spectrum_fft_bound_is_the_exact_operator_norm(cin, cout, k, n, pad, circular, seed) -> None:
    """The rfft2 + Gram bound equals the norm of the conv's dense matrix (built column by column) up to
    its margin, kernels wrapping around small circles included."""
    torch.manual_seed(seed)
    conv = LipschitzConv2d(cin, cout, k, padding=pad, padding_mode="circular" if circular else "zeros",
                           operator_norm="fft")
    with torch.no_grad():
        conv.weight.normal_()
    shape = (cin, n, n)
    try:
        conv(torch.zeros(1, *shape))
    except RuntimeError:
        return  # a kernel larger than the padded input: no such layer
    eye = torch.eye(cin * n * n, dtype=torch.float64).reshape(-1, *shape)
    with torch.no_grad():
        dense = torch.nn.functional.conv2d(
            torch.nn.functional.pad(eye, (pad,) * 4, mode="circular") if circular else eye,
            conv.weight.double(), stride=conv.stride, padding=0 if circular else pad).flatten(1)
    exact = float(torch.linalg.svdvals(dense)[0])
    bound = conv.fft_operator_norm(shape)
    assert bound >= exact * (1 - 1e-12)
    if circular:  # (times sqrt of the output repeats; the equality below is checked on zero padding)
        return
    # and it is the full-spectrum SVD bound of the circular embedding it replaced (the kernel folded on the circle)
    nh = n + 2 * pad
    full = torch.zeros(cout, cin, nh, nh, dtype=torch.float64)
    for i in range(k):
        for j in range(k):
            full[:, :, i % nh, j % nh] += conv.weight.detach().double()[:, :, i, j]
    spectrum = torch.fft.fft2(full).permute(2, 3, 0, 1).reshape(nh * nh, cout, cin)
    reference = float(torch.linalg.matrix_norm(spectrum, ord=2).max())
    assert bound >= reference and bound == pytest.approx(reference, rel=1e-6)


def test_bjorck_precheck_rescales_only_large_weights() -> None:
    w = _orthonormal(20, 30, 1) * 3.0  # top singular value 3 > 1.5: rescaled, then orthonormalized
    q, bound = bjorck_orthonormalize(w)
    assert torch.allclose(q @ q.T, torch.eye(20), atol=1e-4)
    assert _true_norm(q) <= bound <= 1 + 1e-4
    near = _orthonormal(20, 30, 2) * 1.01
    q, bound = bjorck_orthonormalize(near)
    assert torch.allclose(q @ q.T, torch.eye(20), atol=1e-4)
    assert _true_norm(q) <= bound <= 1 + 1e-4


def _with_singular_values(rows: int, cols: int, values: torch.Tensor, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=torch.float64))
    return ((u * values.double()) @ v.T).to(dtype)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 48), extra=st.integers(0, 40), seed=st.integers(0, 10_000),
       spread=st.sampled_from(["edge", "uniform", "near_one", "above"]), double=st.booleans())
def test_certified_bjorck_step_bounds_the_true_norm(rows, extra, seed, spread, double) -> None:
    """The step's certificate (1 + rounding terms, no eigensolver) against the float64 SVD of the step's actual
    float output.  Adversarial spectra: singular values at 1 and at 2, where ``|f(s)| = 1`` exactly and any
    rounding pushes the norm above 1; spread over (0, 2]; within 1e-3 of 1 (the warm-started case); above 2,
    where the premise fails and the eigensolver must take over (``|f(2.2)| = 2.02``)."""
    cols = rows + extra
    g = torch.Generator().manual_seed(seed)
    if spread == "edge":
        values = torch.where(torch.rand(rows, generator=g) < 0.5, 1.0, 2.0)
    elif spread == "uniform":
        values = 2.0 * torch.rand(rows, generator=g)
    elif spread == "near_one":
        values = 1 + 1e-3 * (2 * torch.rand(rows, generator=g) - 1)
    else:
        values = 2.0 + 0.5 * torch.rand(rows, generator=g)
    w = _with_singular_values(rows, cols, values, seed, torch.float64 if double else torch.float32)
    result, bound = certified_bjorck_step(w)
    assert result.dtype == w.dtype and result.shape == w.shape
    assert bound >= _true_norm(result)
    if spread != "above":
        assert bound <= 1 + 1e-3  # the rounding terms are small: no eigensolver was needed to be this tight


def test_certified_bjorck_step_is_not_vacuous() -> None:
    """Without its rounding terms the certificate would be 1, and the float32 step's true norm does exceed 1
    on these inputs: the rounding terms are what the test above checks."""
    exceed = []
    for seed in range(20):
        w = _with_singular_values(32, 64, torch.ones(32), seed)
        result, bound = certified_bjorck_step(w)
        exceed.append(_true_norm(result) > 1.0)
        assert bound >= _true_norm(result)
    assert any(exceed)


def test_certified_bjorck_step_falls_back_without_ieee_float32_products() -> None:
    """TF32 / bfloat16 matmul internals void the float32 rounding model: the exact eigensolver bound is used."""
    w = _with_singular_values(16, 24, torch.full((16,), 1.0005), 3)
    _, fast = certified_bjorck_step(w)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        result, slow = certified_bjorck_step(w)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert slow == certified_spectral_norm(result)
    assert fast >= _true_norm(result) and slow >= _true_norm(result)


def test_certified_bjorck_step_refuses_non_finite_weights() -> None:
    w = _orthonormal(8, 12, 0)
    w[3, 5] = float("nan")
    with pytest.raises(BoundError, match="NaN or infinite"):
        certified_bjorck_step(w)
    w[3, 5] = float("inf")
    with pytest.raises(BoundError, match="NaN or infinite"):
        bjorck_orthonormalize(w)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 10_000),
       scale=st.floats(0.05, 5.0), steps=st.integers(1, 4))
def test_projected_linear_layer_certifies_every_adam_step(rows, cols, seed, scale, steps) -> None:
    """A LipschitzLinear trained by Adam on adversarially scaled gradients: after every projection the bound the
    layer reports (the Björck certificate, cached) is at least the true norm of the weights it will use."""
    torch.manual_seed(seed)
    layer = LipschitzLinear(cols, rows)
    opt = torch.optim.Adam(layer.parameters(), lr=0.05 * scale)
    for _ in range(steps):
        opt.zero_grad()
        layer(torch.randn(7, cols) * scale).pow(3).sum().backward()
        opt.step()
        layer.project_()
        assert layer.layer_bound(1.0, (cols,)).lipschitz >= _true_norm(layer.weight)


def _reference_max_min(grouped: torch.Tensor, dim: int) -> torch.Tensor:
    a, b = grouped.select(dim, 0), grouped.select(dim, 1)
    return torch.stack((torch.maximum(a, b), torch.minimum(a, b)), dim=dim)


@pytest.mark.parametrize("shape,dim", [((5, 4, 2, 3, 3), 2), ((4, 3, 2), 2), ((3, 2, 7), 1)])
def test_fused_max_min_matches_the_reference_with_exact_gradients(shape, dim) -> None:
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.equal(max_min(x, dim), _reference_max_min(x, dim))
    assert torch.autograd.gradcheck(lambda t: max_min(t, dim), (x,))
    assert torch.autograd.gradgradcheck(lambda t: max_min(t, dim), (x,))
    g = torch.randn(shape, dtype=torch.float64)
    (gx,) = torch.autograd.grad(max_min(x, dim), x, g)
    assert math.isclose(float(gx.norm()), float(g.norm()), rel_tol=1e-12)  # a permutation: norm preserved


@pytest.mark.parametrize("shape,k", [((3, 4, 8, 8), 2), ((2, 3, 7, 9), 2), ((2, 2, 9, 9), 3)])
def test_fused_l2_norm_pool_matches_the_reference(shape, k) -> None:
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    ref = torch.sqrt(torch.nn.functional.avg_pool2d(x * x, k, stride=k) * k * k + 1e-10) - 1e-5
    assert torch.allclose(l2_norm_pool2d(x, k, 1e-10), ref)
    assert torch.autograd.gradcheck(lambda t: l2_norm_pool2d(t, k, 1e-10), (x,))
    assert torch.autograd.gradgradcheck(lambda t: l2_norm_pool2d(t, k, 1e-10), (x,))


@pytest.mark.parametrize("shape,k,channels_last", [((4, 6, 28, 28), 2, False), ((3, 4, 7, 9), 2, False),
                                                    ((2, 3, 9, 11), 3, False), ((4, 6, 14, 14), 2, True)])
def test_l2_norm_pool_float32_passes_match_the_window_formula(shape, k, channels_last) -> None:
    """The strided float32 passes (forward sums of squares, backward x * g / r repeated over each window) give
    the window formula: the forward within float32 rounding of the float64 window norms, never above them by
    more, and the backward exactly; remainder rows and columns get no gradient."""
    x = torch.randn(shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    out = l2_norm_pool2d(x, k, 1e-10)
    exact = torch.sqrt(torch.nn.functional.avg_pool2d(x.detach().double() ** 2, k, stride=k) * k * k + 1e-10) - 1e-5
    assert bool(((out.double() - exact).abs() <= 1e-6 * exact + 1e-7).all())
    g = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, x, g)
    rows, cols = out.shape[-2:]
    scale = g / (out.detach() + 1e-5)
    expected = torch.zeros(shape)
    expected[..., : rows * k, : cols * k] = x.detach()[..., : rows * k, : cols * k] * scale.repeat_interleave(
        k, -2).repeat_interleave(k, -1)
    assert torch.equal(grad, expected)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 30), cols=st.integers(1, 30), scale=st.floats(0.01, 1e4), seed=st.integers(0, 1000))
def test_spectral_rescale_keeps_a_certified_bound_for_the_stored_weight(rows, cols, scale, seed) -> None:
    """A 'spectral' layer certifies its weight once per projection and keeps that bound for the stored
    (divided, rounded) weight: it must stay >= the true norm, and be ~1 when the weight was rescaled."""
    torch.manual_seed(seed)
    layer = LipschitzLinear(cols, rows, projection="spectral")
    with torch.no_grad():
        layer.weight.normal_().mul_(scale)
    before = _true_norm(layer.weight)
    layer.project_()
    cached = layer._norm_cache.get(layer.weight, None)
    assert cached is not None and cached >= _true_norm(layer.weight)
    assert layer.layer_bound(1.0, (cols,)).lipschitz == cached
    if before > 1.0:
        assert cached <= 1.0 + 1e-5


@pytest.mark.parametrize("make", [lambda: LipschitzLinear(24, 12),
                                  lambda: LipschitzConv2d(3, 4, 3, operator_norm="fft")])
def test_checkpointed_certificates_are_kept_exactly_but_never_trusted_below_a_fresh_one(make) -> None:
    """A layer's certificate travels in its state_dict (a resumed run then draws the very same noise); a claim
    below what the loaded weights certify (tampered, or from other weights) is replaced by the fresh value."""
    torch.manual_seed(0)
    layer = make()
    shape = (24,) if isinstance(layer, LipschitzLinear) else (3, 8, 8)
    layer(torch.randn(2, *shape))
    with torch.no_grad():
        layer.weight.add_(0.01 * torch.randn_like(layer.weight))
    layer.project_()
    genuine = layer.layer_bound(1.0, shape).lipschitz
    state = layer.state_dict()
    assert state["_extra_state"]["weight_bound"]["value"] == genuine

    restored = make()
    restored.load_state_dict(state)
    assert restored.layer_bound(1.0, shape).lipschitz == genuine  # kept bit for bit

    if isinstance(layer, LipschitzLinear):
        recomputed = certified_spectral_norm(layer.weight, shortcut=False)
    else:
        recomputed = layer._fresh_lipschitz(state["_extra_state"]["weight_bound"]["key"])
    for claim in (0.5, float("nan"), -1.0):
        tampered = dict(state, _extra_state={"weight_bound": dict(state["_extra_state"]["weight_bound"], value=claim)})
        victim = make()
        victim.load_state_dict(tampered)
        assert victim.layer_bound(1.0, shape).lipschitz == recomputed
    if isinstance(layer, LipschitzLinear):
        assert recomputed >= _true_norm(layer.weight)


def test_a_genuine_checkpointed_certificate_is_kept_at_every_step_of_training() -> None:
    """Regression: checking a stored Björck certificate against the Frobenius shortcut (looser in some steps)
    replaced it on resume, and the resumed run drew noise of another scale.  Over 60 Adam steps, every stored
    certificate survives a state_dict round trip unchanged."""
    torch.manual_seed(0)
    layer = LipschitzLinear(64, 64)
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    for _ in range(60):
        opt.zero_grad()
        layer(torch.randn(16, 64)).pow(2).sum().backward()
        opt.step()
        layer.project_()
        bound = layer.layer_bound(1.0, (64,)).lipschitz
        copy = LipschitzLinear(64, 64)
        copy.load_state_dict(layer.state_dict())
        assert copy.layer_bound(1.0, (64,)).lipschitz == bound >= _true_norm(layer.weight)


def test_cuda_precision_settings_are_read_as_torch_applies_them():
    """The CUDA branches of ``ieee_convolutions`` / ``ieee_matmul`` (checked without a GPU: they read settings only).
    cuDNN's convolutions default to TF32; an explicit "ieee" at the operator wins over the levels above it, and a
    "none" inherits from them; TF32 matrix products come from the operator's setting or the legacy flag."""
    from clipless.privacy.certified import ieee_convolutions, ieee_matmul

    cuda = torch.device("cuda")
    conv = torch.backends.cudnn.conv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv, "fp32_precision", "tf32")
        assert not ieee_convolutions(cuda)  # torch's default
        mp.setattr(conv, "fp32_precision", "ieee")
        assert ieee_convolutions(cuda)
        mp.setattr(conv, "fp32_precision", "none")
        mp.setattr(torch.backends.cudnn, "fp32_precision", "ieee", raising=False)
        assert ieee_convolutions(cuda)  # inherited
        mp.setattr(torch.backends.cudnn, "fp32_precision", "tf32", raising=False)
        assert not ieee_convolutions(cuda)
    for allow_tf32, precision, ieee in ((False, "ieee", True), (False, "none", True), (False, "tf32", False),
                                        (True, "none", False)):
        with pytest.MonkeyPatch.context() as mp:
            fake = type("Matmul", (), {"allow_tf32": allow_tf32, "fp32_precision": precision})()
            mp.setattr(torch.backends.cuda, "matmul", fake)
            assert ieee_matmul(cuda) is ieee, (allow_tf32, precision)
    assert not ieee_matmul(torch.device("mps")) and not ieee_convolutions(torch.device("mps"))  # not known: not IEEE
