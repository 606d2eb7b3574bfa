"""Every layer's declared bounds against true per-example gradients and measured Lipschitz constants."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import clipless as cl
from clipless.privacy.bounds import BoundEngine, torch_layer_bound
from clipless.privacy.modules import LayerBound

from helpers import (
    CLASSES,
    TOL,
    check,
    exact_linear_operator_norm,
    head,
    measured_lipschitz,
    worst_gradient_ratios,
)

def test_dense_mlp_bounds_hold_and_are_tight():
    model = nn.Sequential(nn.Flatten(), cl.LipschitzLinear(12, 16), cl.MaxMin(), cl.LipschitzLinear(16, CLASSES))
    worst = check(model, (12,))
    # Orthogonal layers and MaxMin preserve gradient norms: the bound is nearly attained.
    assert max(worst["random"].values()) > 0.5


@pytest.mark.parametrize("projection", ["bjorck", "spectral"])
def test_dense_with_bias_bounds(projection):
    model = nn.Sequential(
        cl.LipschitzLinear(10, 8, bias=True, bias_bound=0.7, projection=projection),
        cl.GroupSort(4),
        cl.LipschitzLinear(8, CLASSES, bias=True, projection=projection),
    )
    check(model, (10,), radius=1.5)


def test_input_norm_clip_sets_input_bound():
    model = nn.Sequential(cl.InputNormClip(0.5), cl.LipschitzLinear(6, CLASSES))
    # The engine is told inputs up to 3.0; the clip makes 0.5 the bound of the dense input.
    report = BoundEngine(model, (6,), 3.0, math.sqrt(2)).compute()
    assert report.layers[0].input_bound == 0.5
    check(model, (6,), radius=3.0)


conv_configs = st.fixed_dictionaries(
    {
        "cin": st.integers(1, 3),
        "cout": st.integers(1, 4),
        "k": st.sampled_from([1, 2, 3, 5]),
        "stride": st.integers(1, 3),
        "mode": st.sampled_from(["zeros", "circular"]),
        "bias": st.booleans(),
        "size": st.integers(4, 7),
        "seed": st.integers(0, 1000),
        "norm": st.sampled_from(["reshaped", "fft"]),
    }
)


def _conv(c) -> cl.LipschitzConv2d:
    return cl.LipschitzConv2d(
        c["cin"], c["cout"], c["k"], stride=c["stride"], padding=c["k"] // 2, padding_mode=c["mode"], bias=c["bias"],
        operator_norm=c["norm"],
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_configs)
def test_conv_gradient_bounds_property(c):
    torch.manual_seed(c["seed"])
    conv = _conv(c)
    shape = (c["cin"], c["size"], c["size"])
    out_shape = conv(torch.zeros((1,) + shape)).shape[1:]
    model = nn.Sequential(conv, *head(math.prod(out_shape), bias=True))
    check(model, shape, radius=1.0, seed=c["seed"], trained=True)


@settings(max_examples=30, deadline=None)
@given(conv_configs)
def test_conv_declared_lipschitz_above_true_operator_norm(c):
    """Declared ``l`` >= exact operator norm (dense matrix of the linear map), for random and projected kernels."""
    torch.manual_seed(c["seed"])
    conv = _conv(c)
    conv.bias = None
    shape = (c["cin"], c["size"], c["size"])
    conv(torch.zeros((1,) + shape))  # the projection scales for the input size it has seen
    for phase in range(2):
        if phase:
            with torch.no_grad():
                conv.weight.mul_(3.0).add_(torch.randn_like(conv.weight))
            conv.project_()
        declared = conv.layer_bound(1.0, shape).lipschitz
        weight = conv.weight.detach().double()

        def apply(x: torch.Tensor) -> torch.Tensor:
            if conv.padding_mode == "circular":
                ph, pw = conv.padding
                return F.conv2d(F.pad(x, (pw, pw, ph, ph), mode="circular"), weight, stride=conv.stride)
            return F.conv2d(x, weight, stride=conv.stride, padding=conv.padding)

        true_norm = exact_linear_operator_norm(apply, shape)
        assert declared >= true_norm * (1 - 1e-9), (declared, true_norm)
        # After an FFT projection the certificate adds the float32 rounding of the division,
        # sqrt(s) * 2 eps ||W||_F, instead of recomputing the spectrum.
        slack = 1e-6 + math.sqrt(conv.overlap_for(shape)) * 2 * torch.finfo(torch.float32).eps * float(weight.norm())
        if c["norm"] == "fft" and c["mode"] == "circular" and c["stride"] == 1 and c["k"] % 2 == 1:
            assert declared <= true_norm * (1 + slack)  # exact for circular stride-1 convolutions
        if phase:
            assert declared <= 1 + slack  # projection keeps the layer 1-Lipschitz


def test_dense_declared_lipschitz_is_exact_spectral_norm():
    layer = cl.LipschitzLinear(9, 7, projection="spectral")
    with torch.no_grad():
        layer.weight.mul_(5.0)
    declared = layer.layer_bound(1.0, (9,)).lipschitz
    true = float(torch.linalg.svdvals(layer.weight.detach().double()).max())
    assert declared >= true and declared <= true * (1 + 1e-6)
    assert measured_lipschitz(layer, (9,)) <= declared * (1 + TOL)
    layer.project_()
    assert layer.layer_bound(1.0, (9,)).lipschitz <= 1 + 1e-6


@pytest.mark.parametrize("seed", range(5))
def test_bjorck_projection_is_orthonormal(seed):
    torch.manual_seed(seed)
    layer = cl.LipschitzLinear(20, 8)
    with torch.no_grad():
        layer.weight.add_(0.3 * torch.randn_like(layer.weight))
    layer.project_()
    s = torch.linalg.svdvals(layer.weight.double())
    assert torch.allclose(s, torch.ones_like(s), atol=1e-5)


# Elementwise torch activations the bound engine knows, with settings at the edges of their constants.
_ACTIVATIONS = (nn.Tanh(), nn.Sigmoid(), nn.Softsign(), nn.Tanhshrink(), nn.Hardtanh(), nn.Hardtanh(0.5, 3.0),
                nn.Hardtanh(-4.0, -1.0), nn.ReLU6(), nn.LeakyReLU(0.1), nn.LeakyReLU(-2.5), nn.ELU(), nn.ELU(3.0),
                nn.ELU(-0.5), nn.CELU(0.3), nn.GELU(), nn.SiLU())


@pytest.mark.parametrize("act", _ACTIVATIONS, ids=repr)
def test_torch_activation_constants_hold_pointwise(act):
    """``|f'| <= l`` (autograd, float32 and float64) and ``|f(x) - f(0)| <= m |x|`` on a dense grid through the
    places where each constant is attained (0, the kinks, sqrt 2 for GELU), and ``l`` is attained there (not
    overstated by more than 0.1%)."""
    lb = torch_layer_bound(act, 1.0, (1,))  # one entry, |x| <= 1: out_bound = m + |f(0)|
    special = torch.tensor([0.0, math.sqrt(2.0), -math.sqrt(2.0), 0.5, 3.0, -1.0, -4.0, 1e-30, -1e-30,
                            2.3993572805154675])  # SiLU' is largest there
    grid = torch.cat([torch.linspace(-60.0, 60.0, 200_001, dtype=torch.float64), special.double()])
    for dtype in (torch.float64, torch.float32):
        x = grid.to(dtype).requires_grad_(True)
        (derivative,) = torch.autograd.grad(act(x).sum(), x)
        assert derivative.abs().max() <= lb.lipschitz, f"{dtype}: |f'| {float(derivative.abs().max())}"
    assert derivative.abs().max() >= lb.lipschitz * (1 - 1e-3)
    with torch.no_grad():
        offset = act(torch.zeros(1, dtype=torch.float64))
        m = lb.out_bound - float(offset.abs())
        assert ((act(grid) - offset).abs() <= m * grid.abs() + 1e-12).all()


@pytest.mark.parametrize("act", [nn.CELU(-1.0), nn.GELU(approximate="tanh"), nn.Softplus(), nn.Mish(),
                                 nn.Hardtanh(-math.inf, 1.0)], ids=repr)
def test_activations_without_a_certified_constant_refused(act):
    with pytest.raises(cl.BoundError, match="declares no"):
        BoundEngine(nn.Sequential(cl.LipschitzLinear(4, 4), act, cl.LipschitzLinear(4, CLASSES)), (4,), 1.0, 1.0)


def test_an_activation_setting_changed_after_set_up_is_refused():
    """A LeakyReLU slope raised to 3 after the engine was built is refused: the bounds used to follow it at every
    computation, which let a slope raised for the forward and put back before the step go unseen (the step's
    bounds described the old slope). A slope of 3 set before the engine is built is bounded and checked; a CELU
    turned to a negative alpha (no finite constant) is refused."""
    act = nn.LeakyReLU(0.1)
    model = nn.Sequential(cl.LipschitzLinear(4, 4), act, cl.LipschitzLinear(4, CLASSES))
    engine = BoundEngine(model, (4,), 1.0, 1.0)
    before = engine.compute().layers[0].bound
    act.negative_slope = 3.0
    with pytest.raises(cl.BoundError, match="its constant negative_slope changed from 0.1 to 3.0"):
        engine.compute()
    assert BoundEngine(model, (4,), 1.0, 1.0).compute().layers[0].bound == pytest.approx(3.0 * before)
    check(model, (4,), radius=1.0, trained=False)
    celu = nn.CELU(0.5)
    engine = BoundEngine(nn.Sequential(cl.LipschitzLinear(4, 4), celu, cl.LipschitzLinear(4, CLASSES)), (4,), 1.0,
                         1.0)
    celu.alpha = -0.5
    with pytest.raises(cl.BoundError, match="declares no"):
        engine.compute()


@pytest.mark.parametrize(
    "layer,shape",
    [
        (cl.MaxMin(), (6,)),
        (cl.GroupSort(3), (6,)),
        (cl.MaxMin(), (4, 3, 3)),
        (cl.L2NormPool2d(2), (2, 4, 4)),
        (cl.L2NormPool2d(3), (1, 7, 7)),  # border dropped
        (cl.ScaledAvgPool2d(2), (2, 4, 4)),
        (cl.LayerCentering(), (2, 3, 3)),
        (cl.LayerCentering(dims=1), (4, 3, 3)),
        (cl.InputNormClip(0.7), (5,)),
        (nn.Flatten(), (2, 3, 3)),
        (nn.ReLU(), (7,)),
        *((act, (7,)) for act in _ACTIVATIONS),
        (nn.Sigmoid(), (2, 3, 3)),
    ],
)
def test_parameter_free_layers(layer, shape):
    """Declared ``l`` and ``out_bound`` against measurement; used inside a model, gradients stay bounded."""
    lb: LayerBound = (layer.layer_bound(2.0, shape) if isinstance(layer, cl.BoundedModule)
                      else torch_layer_bound(layer, 2.0, shape))
    # measured in float64: float32 finite differences of a sigmoid near 1/2 read its slope 2e-5 high
    assert measured_lipschitz(lambda x: layer(x.double()), shape, radius=2.0) <= lb.lipschitz * (1 + TOL)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn((8,) + shape, generator=gen)
        x = 2.0 * x / torch.linalg.vector_norm(x.reshape(8, -1), dim=1).reshape((-1,) + (1,) * len(shape))
        out = torch.linalg.vector_norm(layer(x).reshape(8, -1), dim=1).max()
        assert out <= lb.out_bound * (1 + TOL)
    width = math.prod(layer(torch.zeros((1,) + shape)).shape[1:])
    model = nn.Sequential(cl.LipschitzLinear(math.prod(shape), math.prod(shape)), nn.Unflatten(1, shape), layer, *head(width))
    model = nn.Sequential(nn.Flatten(), *model)
    check(model, shape, radius=2.0, trained=False)


def test_residual_block_bounds():
    branch = nn.Sequential(cl.LipschitzLinear(8, 8), cl.MaxMin(), cl.LipschitzLinear(8, 8))
    model = nn.Sequential(
        cl.LipschitzLinear(6, 8), cl.Residual(branch), cl.MaxMin(), cl.Residual(nn.Sequential(cl.LipschitzLinear(8, 8)), 0.3, 0.7),
        cl.LipschitzLinear(8, CLASSES),
    )
    check(model, (6,))
    engine = BoundEngine(model, (6,), 1.0, 1.0)
    assert measured_lipschitz(model, (6,)) <= engine.lipschitz_constant() * (1 + TOL)


def test_residual_with_bias_output_bound():
    branch = nn.Sequential(cl.LipschitzLinear(5, 5, bias=True, bias_bound=2.0))
    model = nn.Sequential(cl.Residual(branch, 1.0, 1.0), cl.LipschitzLinear(5, CLASSES, bias=True))
    with torch.no_grad():
        branch[0].bias.copy_(torch.full((5,), 0.8))
    check(model, (5,), radius=1.0, trained=False)


def test_loss_gradient_clip_caps_the_bound():
    base = [nn.Flatten(), cl.LipschitzLinear(8, 8), cl.MaxMin(), cl.LipschitzLinear(8, CLASSES)]
    clipped = nn.Sequential(*base, cl.LossGradientClip(0.3))
    loss = cl.TauCrossEntropy(1.0)
    report = BoundEngine(clipped, (8,), 1.0, loss.lipschitz).compute()
    assert all(abs(layer.grad_out_bound - 0.3) < 1e-6 for layer in report.layers)
    check(clipped, (8,), radius=1.0, loss=loss)


@pytest.mark.parametrize("case", ["clip 1e-44", "clip 1e-45", "inputs 3e-45", "weights 3e-45", "conv clip 1e-44"])
def test_bounds_hold_where_float32_underflows(case):
    """Below float32's normal range, rounding is absolute (up to 2^-150 per product): at a loss-gradient clip of
    1e-44 the true per-example gradients came out 1.1-3.2x their bounds before every bound got its underflow term."""
    torch.manual_seed(3)
    shape, radius = ((1, 8, 8), 2.0) if case.startswith("conv") else ((12,), 2.0)
    if case.startswith("conv"):
        model = nn.Sequential(cl.LipschitzConv2d(1, 4, 3, padding=1), cl.MaxMin(), *head(4 * 8 * 8))
    else:
        projection = "spectral" if case.startswith("weights") else "bjorck"
        model = nn.Sequential(cl.LipschitzLinear(12, 16, projection=projection), cl.MaxMin(),
                              cl.LipschitzLinear(16, 16, projection=projection), cl.MaxMin(),
                              cl.LipschitzLinear(16, CLASSES, projection=projection))
    loss = cl.TauCrossEntropy(tau=4.0)
    BoundEngine(model, shape, radius, loss.lipschitz).project_()
    if case.startswith("weights"):
        with torch.no_grad():
            model[-1].weight.mul_(3e-45)  # within its norm ball: the layers before get gradient bounds of ~3e-45
    if "clip" in case:
        model.append(cl.LossGradientClip(float(case.split()[-1])))
    if case.startswith("inputs"):
        radius = 3e-45
    worst = worst_gradient_ratios(model, loss, shape, radius, CLASSES, n_random=64, n_adversarial=0)
    assert max(worst.values()) <= 1 + TOL, worst


def test_cnn_model_bounds():
    model = cl.lipschitz_cnn((1, 8, 8), CLASSES, channels=(4, 6), input_clip=1.0)
    check(model, (1, 8, 8), radius=3.0)


def test_checker_detects_an_understated_bound():
    """The same check fails on a conv declaring factor 1 instead of sqrt(s) (the spec §6 pitfall)."""

    class Understated(cl.LipschitzConv2d):
        def layer_bound(self, x_bound, in_shape):
            lb = super().layer_bound(x_bound, in_shape)
            return LayerBound(lb.lipschitz, lb.out_bound, {"weight": x_bound})

    torch.manual_seed(0)
    conv = Understated(1, 2, 3)
    # Pooling the whole map makes the output gradient constant over positions, where sqrt(s) is attained.
    model = nn.Sequential(conv, cl.ScaledAvgPool2d(6), *head(2))
    with pytest.raises(AssertionError, match="gradient"):
        check(model, (1, 6, 6), radius=1.0, trained=False)


def test_model_lipschitz_constant_bounds_measurement():
    model = cl.lipschitz_mlp((1, 6, 6), CLASSES, hidden=(16, 16))
    engine = BoundEngine(model, (1, 6, 6), 1.0, 1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    engine.project_()
    assert measured_lipschitz(model, (1, 6, 6), restarts=6) <= engine.lipschitz_constant() * (1 + TOL)


def test_bounds_hold_after_private_training_on_real_data():
    """Weights trained by the private trainer on digits; real training examples plus adversarial inputs."""
    torch.manual_seed(0)
    data = cl.load_digits()
    model = cl.lipschitz_cnn(data.input_shape, 10, channels=(4, 8), input_clip=None, pool=2)
    loss = cl.TauCrossEntropy(8.0)
    trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=0.02), loss, data.train,
                                input_shape=data.input_shape, input_bound=8.0, batch_size=256, delta=1e-5, epochs=3,
                                noise_multiplier=1.0, noise_seed=0, progress=False, log=None, accountant="rdp")
    trainer.fit()
    report = trainer.optimizer.bound_engine.compute()
    real = cl.diagnostics.tightness(model, loss, data.train.features[:64], data.train.labels[:64], report)
    assert max(real.values()) <= 1 + TOL
    model.eval()  # the input guard checks the data bound in training mode only; adversarial inputs stay in the ball
    worst = worst_gradient_ratios(model, loss, data.input_shape, 8.0, 10, report=report)
    assert max(worst.values()) <= 1 + TOL


def test_conv_bound_cache_is_sound_and_invalidated_by_any_weight_change():
    """After projection the bound comes from a rounding argument, not a second FFT; it must still be
    >= the exact FFT norm of the stored weights, and any change of the weights (even via .data) recomputes."""
    torch.manual_seed(0)
    conv = cl.LipschitzConv2d(4, 6, 3, operator_norm="fft")
    shape = (4, 10, 10)
    conv(torch.zeros((1,) + shape))
    with torch.no_grad():
        conv.weight.mul_(7.0)
    conv.project_()
    cached = conv.certified_lipschitz(shape)
    fresh = conv.fft_operator_norm(shape)
    assert fresh <= cached <= 1 + 1e-5
    conv.weight.data.mul_(2.0)  # not seen by autograd's version counter
    assert conv.certified_lipschitz(shape) == pytest.approx(2 * fresh, rel=1e-6)
    assert conv.layer_bound(1.0, (4, 12, 12)).lipschitz == pytest.approx(conv.fft_operator_norm((4, 12, 12)))


def test_fft_mode_declares_the_smaller_of_two_certified_bounds():
    """Striding makes the FFT bound loose; the layer then falls back to the reshaped-kernel bound."""
    torch.manual_seed(0)
    conv = cl.LipschitzConv2d(4, 6, 3, stride=2, padding=1, operator_norm="fft")
    with torch.no_grad():
        conv.weight.copy_(torch.randn(6, 4, 1, 1) * (1 + 0.1 * torch.randn(6, 4, 3, 3)))  # smooth kernel
    shape = (4, 8, 8)
    reshaped = math.sqrt(conv.overlap_for(shape)) * cl.privacy.certified.certified_spectral_norm(conv._kernel_matrix())
    fft = conv.fft_operator_norm(shape)
    declared = conv.layer_bound(1.0, shape).lipschitz
    assert declared == min(reshaped, fft) and reshaped < fft
    weight = conv.weight.detach().double()
    true = exact_linear_operator_norm(lambda x: F.conv2d(x, weight, stride=2, padding=1), shape)
    assert true <= declared


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("build", [
    lambda: cl.L2NormPool2d(0), lambda: cl.L2NormPool2d(2, eps=-1.0), lambda: cl.L2NormPool2d(2, eps=_NAN),
    lambda: cl.L2NormPool2d(2, eps=0.0),
    lambda: cl.L2NormPool2d(2.5), lambda: cl.ScaledAvgPool2d(0), lambda: cl.ScaledAvgPool2d(-2),
    lambda: cl.GroupSort(2.5), lambda: cl.GroupSort(True), lambda: cl.MaxMin(dim=1.0),
    lambda: cl.TauCrossEntropy(_NAN), lambda: cl.TauCrossEntropy(_INF),
    lambda: cl.CrossEntropyWithTemperature(_NAN), lambda: cl.BinaryCrossEntropyWithTemperature(_INF),
    lambda: cl.MulticlassHinge(2.5), lambda: cl.MulticlassHinge(3, margin=_NAN), lambda: cl.MulticlassKR(3.7),
    lambda: cl.MulticlassHKR(3, alpha=_NAN), lambda: cl.MulticlassHKR(2.5), lambda: cl.KCosineSimilarity(_NAN),
    lambda: cl.LipschitzLinear(0, 3), lambda: cl.LipschitzLinear(4, 3, bias=True, bias_bound=-0.5),
    lambda: cl.LipschitzLinear(4, 3, bias=True, bias_bound=_NAN), lambda: cl.LipschitzLinear(4, 3, bjorck_iters=0),
    lambda: cl.LipschitzConv2d(1, 2, 3, stride=1.5, padding=1), lambda: cl.LipschitzConv2d(1, 2, 2.5, padding=0),
    lambda: cl.LipschitzConv2d(0, 2, 3), lambda: cl.LipschitzConv2d(1, 2, 3, bias=True, bias_bound=-1.0),
    lambda: cl.OrthogonalConv2d(2.0, 2), lambda: cl.OrthogonalConv2d(2, 2, bjorck_iters=-1),
    # True read as 1 (check_positive_finite)
    lambda: cl.TauCrossEntropy(True), lambda: cl.InputNormClip(True), lambda: cl.L2NormPool2d(2, eps=True),
])
def test_a_bad_declared_constant_is_refused_when_the_layer_is_built(build):
    """Each was accepted before and failed later, far from its cause, or not at all: a class count of 2.5
    declared ``sqrt(2.5/1.5) = 1.29`` for a loss computed with 2 classes (gradient norm sqrt(2) = 1.41), a
    negative bias radius crashed the projection with a ZeroDivisionError, NaN radii skipped it, NaN or
    infinite temperatures made every loss NaN, a zero kernel size divided by zero, and pooling with ``eps = 0``
    has a NaN derivative at an all-zero window."""
    with pytest.raises(ValueError, match="must be"):
        build()


def test_the_validated_constants_keep_their_meaning():
    assert cl.MulticlassHinge(3).lipschitz == pytest.approx(math.sqrt(1.5))
    assert cl.MulticlassHKR(4, alpha=0).lipschitz == pytest.approx(math.sqrt(4 / 3))
    assert cl.LipschitzLinear(4, 3, bias=True, bias_bound=_INF).bias_bound == _INF  # no projection: bound uses ||b||
    assert cl.L2NormPool2d(2, eps=1e-12).eps == 1e-12
    assert cl.GroupSort(4, dim=-1).group_size == 4
