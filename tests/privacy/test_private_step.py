"""The private step: noise scale, division by the expected batch, Poisson sampling, strategies."""

from __future__ import annotations

import math

import pytest
import torch

import clipless as cl
from helpers import capture_released, empty_batch_backward

SHAPE = (1, 4, 4)


def small_setup(strategy="global", noise=1.0, batch_size=8.0, lr=0.0, layer_noise=None):
    torch.manual_seed(0)
    x = torch.rand(64, *SHAPE)
    y = torch.randint(0, 3, (64,))
    data = cl.ArrayDataset(x, y)
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=2.0)
    loss = cl.TauCrossEntropy(4.0)
    engine = cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data=data, loss=loss,
        noise_multiplier=noise, input_shape=SHAPE, batch_size=batch_size, strategy=strategy,
        layer_noise_multipliers=layer_noise, noise_generator=torch.Generator().manual_seed(1),
        external_batches=True,  # the tests step on chosen batches
    )
    return model, opt, loader, loss, engine, data


def test_noise_std_matches_global_sensitivity():
    model, opt, _, loss, _, _ = small_setup(noise=2.0, batch_size=8.0)
    released = capture_released(opt)
    for _ in range(200):
        empty_batch_backward(model, loss, SHAPE)  # the released gradient is pure noise
        opt.step()
    draws = [torch.cat([r[id(p)].flatten() for p in model.parameters()]) for r in released]
    std = torch.stack(draws).std().item()
    # two 1-Lipschitz dense layers, X0 = 2, L = sqrt(2): g_d = 2 sqrt(2), Delta = sqrt(2) * 2 sqrt(2) = 4
    expected = 2.0 * 4.0 / 8.0
    assert opt.last_report.global_sensitivity == pytest.approx(4.0, rel=1e-6)
    assert std == pytest.approx(expected, rel=0.02)


def test_per_layer_noise_and_effective_sigma():
    """noise_multiplier is the gradient's effective sigma; layer_noise_multipliers are relative weights."""
    _, opt, _, _, _, _ = small_setup(strategy="per_layer", noise=2.0)
    names = list(opt.layer_sigmas)
    assert opt.effective_noise_multiplier == pytest.approx(2.0)  # equal weights: 2 sqrt(2) each, composed to 2
    assert list(opt.layer_sigmas.values()) == pytest.approx([2.0 * math.sqrt(2)] * 2)
    model, opt, _, loss, _, _ = small_setup(strategy="per_layer", noise=2.0,
                                            layer_noise={names[0]: 1.0, names[1]: 4.0})
    c = 2.0 * math.sqrt(1 + 4**-2)  # sigma_d = c w_d with (sum_d sigma_d^-2)^-1/2 = 2
    assert list(opt.layer_sigmas.values()) == pytest.approx([c, 4 * c])
    assert opt.effective_noise_multiplier == pytest.approx(2.0)
    draws = {n: [] for n in names}
    released = capture_released(opt)
    for _ in range(200):
        empty_batch_backward(model, loss, SHAPE)
        opt.step()
        for layer in opt.last_report.layers:
            draws[layer.name].append(torch.cat([released[-1][id(p)].flatten() for p in layer.params]))
    for name, sigma in zip(names, (c, 4 * c)):
        expected = sigma * 2 * math.sqrt(2) / 8.0
        assert torch.stack(draws[name]).std().item() == pytest.approx(expected, rel=0.03)


def test_summed_gradient_divided_by_expected_batch_size():
    model, opt, _, loss, _, data = small_setup(noise=1e-12, batch_size=8.0)
    x, y = data.features[:5], data.labels[:5]  # a realised batch of 5, expected 8
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    summed = [p.grad.clone() for p in model.parameters()]
    released = capture_released(opt)
    opt.step()
    for p, s in zip(model.parameters(), summed):
        assert torch.allclose(released[0][id(p)], s / 8.0, atol=1e-9)
        assert p.grad is None  # cleared after the step: the next one needs a new batch


def test_a_gradient_held_from_before_make_private_is_not_released():
    """A backward on 2 records before make_private (a check or warm-up step, no zero_grad) left its gradient in the
    weights, and the first private step released it added to the batch's: records of no batch, without noise
    (the sum check refuses only a sum too large for the batch). make_private drops gradients held from before."""
    torch.manual_seed(0)
    x = torch.rand(64, *SHAPE)
    y = torch.randint(0, 3, (64,))
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=2.0)
    loss = cl.TauCrossEntropy(4.0)
    loss.per_example(model(x[:2]), y[:2]).sum().backward()
    model, opt, _ = cl.PrivacyEngine("rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data=cl.ArrayDataset(x, y), loss=loss,
        noise_multiplier=1e-12, input_shape=SHAPE, batch_size=8.0, external_batches=True)
    xb, yb = x[40:45], y[40:45]
    summed = torch.autograd.grad(loss.per_example(model(xb), yb).sum(), list(model.parameters()))
    released = capture_released(opt)
    loss.per_example(model(xb), yb).sum().backward()
    opt.step()
    for p, s in zip(model.parameters(), summed):
        assert torch.allclose(released[0][id(p)], s / 8.0, atol=1e-7)


def test_accountant_steps_once_per_step_with_effective_sigma():
    model, opt, _, loss, engine, _ = small_setup(noise=1.3, batch_size=8.0)
    for _ in range(5):
        empty_batch_backward(model, loss, SHAPE)
        opt.step()
    assert engine.accountant.history == [(1.3, 8.0 / 64, 5)]


def test_poisson_sampler_statistics_and_empty_batches():
    gen = torch.Generator().manual_seed(0)
    sampler = cl.PoissonBatchSampler(1000, 0.05, generator=gen)
    assert len(sampler) == 20
    sizes = [len(b) for _ in range(20) for b in sampler]
    assert abs(sum(sizes) / len(sizes) - 50) < 1.5
    assert len(set(sizes)) > 5  # random sizes, not fixed batches
    tiny = cl.PoissonBatchSampler(10, 0.05, steps_per_epoch=200, generator=gen)
    assert any(len(b) == 0 for b in tiny)


def test_empty_batch_is_a_full_private_step():
    model, opt, loader, loss, engine, data = small_setup(batch_size=0.2)  # q = 0.2/64: mostly empty
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(cl.poisson_data_loader(data, 1e-9)))
    assert x.shape == (0,) + SHAPE and y.shape == (0,)
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    released = capture_released(opt)
    opt.step()
    assert engine.accountant.steps == 1
    # SGD with lr 0 keeps weights; noise was still drawn and released
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(before, model.parameters()))
    assert all(released[0][id(p)].abs().sum() > 0 for p in model.parameters())


def test_projection_after_step_keeps_layers_1_lipschitz():
    model, opt, _, loss, _, data = small_setup(noise=50.0, lr=1.0)
    for _ in range(3):
        opt.zero_grad()
        loss.per_example(model(data.features[:8]), data.labels[:8]).sum().backward()
        opt.step()
    for m in model.modules():
        if isinstance(m, cl.LipschitzLinear):
            assert torch.linalg.matrix_norm(m.weight.detach().double(), 2) <= 1 + 1e-5


@pytest.mark.parametrize("strategy", ["global", "per_layer"])
def test_make_private_with_epsilon_spends_at_most_the_target(strategy):
    torch.manual_seed(0)
    data = cl.ArrayDataset(torch.rand(64, *SHAPE), torch.randint(0, 3, (64,)))
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=2.0)
    engine = cl.PrivacyEngine("rdp")
    _, opt, loader = engine.make_private_with_epsilon(
        target_epsilon=2.0, target_delta=1e-3, epochs=3, module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=cl.TauCrossEntropy(),
        input_shape=SHAPE, batch_size=8, strategy=strategy)
    for _ in range(3):
        for x, y in loader:
            opt.zero_grad()
            cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
            opt.step()
    assert engine.accountant.steps == 3 * 8
    eps = engine.get_epsilon(1e-3)
    assert 1.95 <= eps <= 2.0


def test_energy_allocation_keeps_sigma_eff_and_minimises_noise_energy():
    from clipless.privacy.noise import allocate_layer_noise, noise_energy_allocation

    _, opt, _, _, _, _ = small_setup(strategy="per_layer", noise=2.0)
    report = opt.last_report
    sigmas = allocate_layer_noise(1.5, noise_energy_allocation(report))
    assert cl.effective_noise_multiplier(list(sigmas.values())) == pytest.approx(1.5)

    def energy(s):
        return sum(sum(p.numel() for p in layer.params) * (s[layer.name] * layer.bound) ** 2 for layer in report.layers)

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        other = allocate_layer_noise(1.5, {layer.name: float(torch.rand(1, generator=gen)) + 0.05 for layer in report.layers})
        assert energy(sigmas) <= energy(other) * (1 + 1e-9)


def test_trainer_energy_allocation_spends_the_budget():
    torch.manual_seed(0)
    data = cl.load_digits()
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(32,))
    trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cl.TauCrossEntropy(4.0),
                                data.train, input_shape=data.input_shape, input_bound=8.0, batch_size=256, delta=1e-5,
                                epochs=2, target_epsilon=2.0, strategy="per_layer", layer_noise_multipliers="energy",
                                accountant="rdp", progress=False, log=None)
    sigmas = trainer.optimizer.layer_sigmas
    first, last = list(sigmas.values())
    assert first < last  # the 64x32 layer gets less noise per coordinate than the 32x10 one
    assert trainer.fit().epsilon <= 2.0


def test_a_step_that_fails_after_its_noisy_gradient_reached_the_optimizer_is_accounted(monkeypatch):
    """The accountant recorded a step only at its very end.  A failure after the inner optimizer's step (here the
    projection) put the model back, but momentum had taken in that step's noisy gradient, and every later released
    step applied it: a release of a sampled batch that no epsilon counted.  The step now counts from the moment its
    noisy gradient exists."""
    failing, project = [], cl.BoundEngine.project_

    def projection(self) -> None:  # set before make_private: the step refuses its own code replaced after it
        if failing:
            raise RuntimeError("projection failed")
        project(self)

    monkeypatch.setattr(cl.BoundEngine, "project_", projection)
    model, opt, _, loss, engine, data = small_setup(lr=0.1)
    opt.original_optimizer.param_groups[0]["momentum"] = 0.9
    x, y = data.features[:8], data.labels[:8]
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    released = [p.detach().clone() for p in model.parameters()]
    failing.append(True)
    loss.per_example(model(x), y).sum().backward()
    with pytest.raises(RuntimeError, match="projection failed"):
        opt.step()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), released))  # the model is put back ...
    assert engine.accountant.steps == 2  # ... but the momentum holds the noisy gradient: the step is counted
    failing.clear()
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 3


@pytest.mark.parametrize("how", ["dict", "object_setattr", "update_", "keep_only_"])
def test_a_per_step_mechanism_changed_past_its_read_only_guard_is_refused(how):
    """The adaptive clip's ``count_noise_multiplier`` is read-only, but a write to the instance's ``__dict__`` (or
    ``object.__setattr__``) passed: the count was then released with almost no noise while the accountant composed
    the planned multiplier.  A method set on the instance (``clip.update_ = ...``) released whatever it liked.  Both
    are now refused by the step, before anything is released."""
    from torch import nn

    torch.manual_seed(0)
    x = torch.randn(32, 6)
    x, y = x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (32,))
    clip = cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=5.0)
    model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3), clip)
    loss, engine = cl.TauCrossEntropy(2.0), cl.PrivacyEngine("rdp")
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=cl.ArrayDataset(x, y), loss=loss,
        noise_multiplier=1.0, input_shape=(6,), batch_size=16.0, input_bound=1.0, external_batches=True)
    loss.per_example(model(x[:16]), y[:16]).sum().backward()
    opt.step()
    c, steps = float(clip.clip_norm), engine.accountant.steps
    if how == "dict":
        clip.__dict__["count_noise_multiplier"] = 1e-9
    elif how == "object_setattr":
        object.__setattr__(clip, "count_noise_multiplier", 1e-9)
    else:
        object.__setattr__(clip, how, lambda *args, **kwargs: None)
    loss.per_example(model(x[:16]), y[:16]).sum().backward()
    match = "its constant count_noise_multiplier changed" if how in ("dict", "object_setattr") else \
        f"has its own {how}"
    with pytest.raises(cl.BoundError, match=match):
        opt.step()
    assert float(clip.clip_norm) == c and engine.accountant.steps == steps


def test_the_optimizers_noise_settings_are_read_only_and_checked_every_step():
    """The plan, accountant, noise generator and batch size of a DPOptimizer were plain attributes: a plan with
    other sigmas (``dataclasses.replace``), a fresh accountant or a seeded generator put in their place drew or
    counted other noise than the run reported (a 1e-9 sigma ran at the reported epsilon 3; a fresh accountant
    reported epsilon 0).  They are now read-only, and each step checks them against their values at
    ``make_private`` (a write to the instance's ``__dict__`` passes the read-only guard)."""
    import dataclasses

    model, opt, _, loss, engine, data = small_setup(lr=0.1)
    x, y = data.features[:8], data.labels[:8]
    quiet = dataclasses.replace(opt.plan, layer_sigmas={k: 1e-9 for k in opt.plan.layer_sigmas}, gradient_sigma=1e-9)
    for name, value in [("plan", quiet), ("accountant", cl.PrivacyAccountant("rdp")),
                        ("generator", torch.Generator().manual_seed(0)), ("expected_batch_size", 1e9),
                        ("sample_rate", 1e-9)]:
        with pytest.raises(AttributeError, match=f"DPOptimizer.{name} is a declared constant"):
            setattr(opt, name, value)
        frozen = opt.__dict__[name]
        opt.__dict__[name] = value
        loss.per_example(model(x), y).sum().backward()
        weights = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(cl.BoundError, match="changed after make_private"):
            opt.step()
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)) and engine.accountant.steps == 0
        opt.__dict__[name] = frozen
        opt.zero_grad()
    plan, step_sigma = opt.plan, opt.plan.step_sigma  # a field written in place: the accountant would compose 1e9
    object.__setattr__(plan, "step_sigma", 1e9)
    loss.per_example(model(x), y).sum().backward()
    with pytest.raises(cl.BoundError, match="changed after make_private"):
        opt.step()
    assert engine.accountant.steps == 0
    object.__setattr__(plan, "step_sigma", step_sigma)
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    opt.step()  # as built, it steps
    assert engine.accountant.steps == 1


def test_a_secret_generator_refuses_to_be_reseeded():
    """``opt.generator.manual_seed(0)`` made a secret run's noise public while its result still said OS entropy.
    Every secret generator (the default of every entry point) now refuses it; a fixed-seed one does not."""
    from clipless.privacy.randomness import make_generator, secret_generator

    for generator in (secret_generator(), make_generator(None, stream=2)):
        for reseed in (lambda g: g.manual_seed(0), lambda g: g.set_state(torch.Generator().get_state()),
                       lambda g: g.seed()):
            with pytest.raises(RuntimeError, match="on a secret generator"):
                reseed(generator)
    make_generator(0, stream=2).manual_seed(1)


def _unit_rows(n, d, classes):
    torch.manual_seed(0)
    x = torch.randn(n, d)
    return x / x.norm(dim=1, keepdim=True), torch.randint(0, classes, (n,))


def _made_private(model, loss, x, y, batch_size=16.0, **kwargs):
    """``model`` made private by a fresh RDP engine (SGD on its trainable weights, sigma 1): model, opt, loader,
    engine."""
    engine = cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data=cl.ArrayDataset(x, y), loss=loss, noise_multiplier=1.0, input_shape=tuple(x.shape[1:]),
        batch_size=batch_size, **kwargs)
    return model, opt, loader, engine


def _refused_then_released(opt, engine, model, loss, x, y, match, weights=None):
    """``opt.step()`` is refused, nothing accounted and ``weights`` (if given) unchanged; run again on ``x, y``
    with the model as built, the batch is released."""
    with pytest.raises(cl.BoundError, match=match):
        opt.step()
    assert engine.accountant.steps == 0
    assert weights is None or all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def test_the_bounds_input_check_sampling_and_accountant_are_read_only():
    """``opt.bound_engine.input_bound = 0.5`` halved every certified bound, and the noise, while the input guard
    still accepted inputs of norm 1: the step ran at the reported epsilon with half the sensitivity it needed.
    ``engine.guard.data_bound = None`` switched the input check off, ``loader.batch_sampler.threshold`` set the
    inclusion rate the accountant composes, and ``engine.accountant = PrivacyAccountant()`` reported epsilon 0.
    Each is refused; the bound engine's input bound is also checked by every step."""
    x, y = _unit_rows(32, 6, 3)
    model = torch.nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    loss = cl.TauCrossEntropy(2.0)
    model, opt, loader, engine = _made_private(model, loss, x, y, input_bound=1.0, external_batches=True)
    for owner, name, value in [(opt.bound_engine, "input_bound", 0.5), (engine.guard, "data_bound", None),
                               (loader.batch_sampler, "threshold", 2**53), (loader.batch_sampler, "sample_rate", 0.9),
                               (loader.batch_sampler, "generator", torch.Generator()),
                               (engine, "accountant", cl.PrivacyAccountant("rdp"))]:
        with pytest.raises(AttributeError, match=f"{type(owner).__name__}.{name} is a declared constant"):
            setattr(owner, name, value)
    frozen = opt.bound_engine.input_bound
    opt.bound_engine.__dict__["input_bound"] = 0.5  # past the guard: the step still refuses
    loss.per_example(model(x[:16]), y[:16]).sum().backward()
    with pytest.raises(cl.BoundError, match="input_bound changed from"):
        opt.step()
    assert engine.accountant.steps == 0
    opt.bound_engine.__dict__["input_bound"] = frozen
    opt.zero_grad()
    # the input guard's bound and the sampler's rate written past their guards: each step compares them too
    for owner, name, value in [(engine.guard, "data_bound", None), (loader.batch_sampler, "threshold", 2**53),
                               (loader.batch_sampler, "sample_rate", 0.9)]:
        frozen = owner.__dict__[name]
        owner.__dict__[name] = value
        loss.per_example(model(x[:16]), y[:16]).sum().backward()
        with pytest.raises(cl.BoundError, match="or the step guard's settings changed after make_private"):
            opt.step()
        assert engine.accountant.steps == 0
        owner.__dict__[name] = frozen
        opt.zero_grad()
    with pytest.raises(cl.BoundError, match="changed after make_private"):  # nor can a new snapshot hide one
        loader.batch_sampler.__dict__["threshold"] = 2**53
        opt.watch_batches(loader, external_batches=True, input_guard=engine.guard)
    loader.batch_sampler.__dict__["threshold"] = cl.privacy.sampling.poisson_threshold(0.5)
    loss.per_example(model(x[:16]), y[:16]).sum().backward()
    opt.step()  # restored, it steps
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("layer, name, value", [
    (torch.nn.LeakyReLU(0.5), "negative_slope", 3.0), (torch.nn.ELU(0.5), "alpha", 3.0),
    (torch.nn.Hardtanh(-1.0, 1.0), "max_val", 9.0), (torch.nn.GELU(), "approximate", "tanh"),
    (cl.InputNormClip(1.0), "max_norm", 1.3)])
def test_a_constant_changed_for_the_forward_and_put_back_before_the_step_is_refused(layer, name, value):
    """``act.negative_slope = 3.0`` before the forward and ``= 0.5`` again before ``step()``: a torch activation's
    setting is a plain attribute, and the step's bounds, computed at the step, described the slope 0.5. The step
    released a gradient whose true per-example norm (4.08, autograd) was nearly three times its certified bound
    (1.41). A declared constant written through ``__dict__`` did the same: an ``InputNormClip(1.0)`` radius set to
    1.3 let inputs of norm 1.3 through while the bounds started from 1 (true per-example gradient 1.79, bound 1.41).
    The step guard now asks the bound engine at every forward whether a constant differs from the bounds'."""
    x, y = _unit_rows(64, 16, 4)
    model = torch.nn.Sequential(cl.LipschitzLinear(16, 16), layer, cl.LipschitzLinear(16, 4))
    loss = cl.TauCrossEntropy(8.0)
    model, opt, _, engine = _made_private(model, loss, x, y, input_bound=1.0, external_batches=True)
    frozen = layer.__dict__[name]
    weights = [p.detach().clone() for p in model.parameters()]
    layer.__dict__[name] = value
    loss.per_example(model(x[:16]), y[:16]).sum().backward()
    layer.__dict__[name] = frozen
    why = "the model changed .*layer '1' .* declares no" if name == "approximate" else \
        f"module '1' .*its constant {name} changed from {frozen!r} to {value!r}"  # tanh GELU: no bound declared
    _refused_then_released(opt, engine, model, loss, x[:16], y[:16], f"at the private model's forward, {why}", weights)


@pytest.mark.parametrize("what", ["adaptive_clip_norm", "frozen_weight"])
def test_a_buffer_or_frozen_weight_changed_for_the_forward_and_put_back_before_the_step_is_refused(what):
    """An adaptive clip's norm (a buffer) raised from 0.1 to 0.3 for the forward and put back before ``step()``:
    the step's bounds, computed from the put-back value, said 0.1 while the backward had clipped at 0.3, and the
    step released it (the summed-gradient check only catches gross factors). The step compares buffers and frozen
    parameters with the released state only at the step; the step guard now asks at every forward as well."""
    x, y = _unit_rows(64, 16, 4)
    clip = cl.AdaptiveLossGradientClip(0.1, 5.0)
    model = torch.nn.Sequential(cl.LipschitzLinear(16, 16), cl.MaxMin(), cl.LipschitzLinear(16, 4), clip)
    model[0].weight.requires_grad_(False)
    loss = cl.TauCrossEntropy(8.0)
    model, opt, _, engine = _made_private(model, loss, x, y, input_bound=1.0, external_batches=True)
    tensor, name = (clip.clip_norm, "3.clip_norm") if what == "adaptive_clip_norm" else (model[0].weight, "0.weight")
    saved = tensor.detach().clone()
    with torch.no_grad():
        tensor.mul_(3.0)
    loss.per_example(model(x[:16]), y[:16]).sum().backward()
    with torch.no_grad():
        tensor.copy_(saved)
    why = f"at the private model's forward, buffers or frozen parameters \\({name}\\)"
    _refused_then_released(opt, engine, model, loss, x[:16], y[:16], why)


def test_the_input_bound_and_sampling_rate_changed_around_a_forward_or_a_draw_are_refused():
    """The input guard's bound switched off (``__dict__``) for one forward took an input of norm 3 past the
    check of a model bounded for norm 1, and the sampler's threshold raised for one draw gave a batch of twice the
    inclusion rate; both were put back before ``step()``, whose check of the settings then passed. The step guard
    now asks at every forward, and the sampler at every draw."""
    x, y = _unit_rows(64, 6, 3)
    model = torch.nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    loss = cl.TauCrossEntropy(2.0)
    model, opt, loader, engine = _made_private(model, loss, x, y, batch_size=8.0, input_bound=1.0)
    batches = iter(loader)
    xb, yb = next(batches)
    engine.guard.__dict__["data_bound"] = None
    loss.per_example(model(torch.cat([3 * xb[:1], xb[1:]])), yb).sum().backward()
    engine.guard.__dict__["data_bound"] = 1.0
    with pytest.raises(cl.BoundError, match="at the private model's forward, .*the step guard's settings"):
        opt.step()
    assert engine.accountant.steps == 0
    opt.zero_grad()
    sampler = loader.batch_sampler
    threshold = sampler.threshold
    sampler.__dict__["threshold"] = 2 * threshold
    with pytest.raises(cl.BoundError, match="the Poisson sampler's threshold changed"):
        next(batches)
    sampler.__dict__["threshold"] = threshold
    xb, yb = next(iter(loader))
    loss.per_example(model(xb), yb).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def test_a_loss_constant_changed_for_the_backward_and_put_back_before_the_step_is_refused():
    """After the forward, a ``CrossEntropyWithTemperature(1.0)`` given temperature 1/3 and constant 3 sqrt(2)
    through ``__dict__`` for its backward, then put back: the output-gradient check at the backward read the raised
    constant, the step's bounds the put-back one, and a gradient of three times the bound was released. The step
    guard now also asks at the backward into the output whether a constant differs from the bounds'."""
    x, y = _unit_rows(64, 16, 4)
    model = torch.nn.Sequential(cl.LipschitzLinear(16, 16), cl.MaxMin(), cl.LipschitzLinear(16, 4))
    loss = cl.CrossEntropyWithTemperature(1.0)
    model, opt, _, engine = _made_private(model, loss, x, y, input_bound=1.0, external_batches=True)
    out = model(x[:16])
    loss.__dict__.update(temperature=1 / 3, lipschitz=3 * math.sqrt(2))
    loss.per_example(out, y[:16]).sum().backward()
    loss.__dict__.update(temperature=1.0, lipschitz=math.sqrt(2))
    why = r"at the backward into the private model's output, the loss \(CrossEntropyWithTemperature\): its constant"
    _refused_then_released(opt, engine, model, loss, x[:16], y[:16], why)


def test_a_forward_with_other_weights_through_functional_call_is_refused_by_name():
    """``torch.func.functional_call(model, {name: 3 * w}, x)`` runs the model with other tensors in its weights'
    places; refused before as "buffers or frozen parameters (0.weight, 2.weight) were not as released", it is now
    named for what it is."""
    from torch.func import functional_call

    x, y = _unit_rows(64, 16, 4)
    model = torch.nn.Sequential(cl.LipschitzLinear(16, 16), cl.MaxMin(), cl.LipschitzLinear(16, 4))
    loss = cl.TauCrossEntropy(8.0)
    model, opt, _, engine = _made_private(model, loss, x, y, input_bound=1.0, external_batches=True)
    out = functional_call(model, {k: 3 * v for k, v in model.named_parameters()}, (x[:16],))
    loss.per_example(out, y[:16]).sum().backward()
    why = r"the model's weights \(0.weight, 2.weight\) were other tensors than its own \(torch.func.functional_call"
    _refused_then_released(opt, engine, model, loss, x[:16], y[:16], why)


def test_the_augmentation_multiplicity_and_rank_are_checked_every_forward_and_step():
    """``opt.__dict__["augmentation_multiplicity"] = 6`` let each record of the batch enter the backward in 6 rows
    at full weight (the step guard still weighed rows for K = 1): released.  The rank decides which process draws
    the noise of a distributed step.  Both are part of the optimizer's settings now."""
    x, y = _unit_rows(64, 16, 4)
    model = torch.nn.Sequential(cl.LipschitzLinear(16, 16), cl.MaxMin(), cl.LipschitzLinear(16, 4))
    loss = cl.TauCrossEntropy(8.0)
    model, opt, loader, engine = _made_private(model, loss, x, y, input_bound=1.0)
    for name, value, repeats in (("augmentation_multiplicity", 6, 6), ("rank", 1, 1)):
        frozen = opt.__dict__[name]
        opt.__dict__[name] = value
        xb, yb = next(iter(loader))
        loss.per_example(model(xb.repeat(repeats, 1)), yb.repeat(repeats)).sum().backward()
        with pytest.raises(cl.BoundError, match=r"settings \(.*augmentation multiplicity, rank\)"):
            opt.step()
        assert engine.accountant.steps == 0
        opt.__dict__[name] = frozen
        opt.zero_grad()


@pytest.mark.parametrize("name, value", [("digest_inputs", False), ("loss_lipschitz", lambda: 1e9),
                                         ("model_changed", lambda: None)])
def test_the_step_guards_settings_are_checked_every_forward_and_step(name, value):
    """``opt.guard.digest_inputs = False`` switched off the check that no record enters the batch's rows more
    often than drawn: a record repeated 6 times (rows resampled by index, row count unchanged) was released at
    6 times its sensitivity. ``loss_lipschitz`` replaced raised the constant the output gradients are checked
    against; ``model_changed`` replaced switched off the per-forward check of constants. They are part of the
    optimizer's settings now."""
    x, y = _unit_rows(64, 16, 4)
    model = torch.nn.Sequential(cl.LipschitzLinear(16, 16), cl.MaxMin(), cl.LipschitzLinear(16, 4))
    loss = cl.TauCrossEntropy(8.0)
    model, opt, loader, engine = _made_private(model, loss, x, y, input_bound=1.0)
    frozen = getattr(opt.guard, name)
    setattr(opt.guard, name, value)
    xb, yb = next(iter(loader))
    if name == "digest_inputs":  # a record in 6 rows: what the digests would have refused
        xb, yb = xb.clone(), yb.clone()
        xb[1:6], yb[1:6] = xb[0], yb[0]
    loss.per_example(model(xb), yb).sum().backward()
    with pytest.raises(cl.BoundError, match="the step guard's settings changed after make_private"):
        opt.step()
    assert engine.accountant.steps == 0
    setattr(opt.guard, name, frozen)
    opt.zero_grad()
    xb, yb = next(iter(loader))
    loss.per_example(model(xb), yb).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def _declared_owners(*roots):
    return [(m, name) for root in roots for m in root.modules()
            if isinstance(m, cl.privacy.certified.DeclaredConstants) for name in type(m).constants]


@pytest.mark.parametrize("build", ["cnn", "orthogonal_resnet", "mlp_adaptive", "hkr"])
def test_every_declared_constant_of_the_layers_and_the_loss_is_checked_by_the_bounds(build):
    """Each declared constant of each layer and loss, written into the instance's ``__dict__``, makes the bound
    engine refuse to compute bounds (naming the module and the constant); put back, it computes them again."""
    shape = (1, 8, 8)
    if build == "cnn":
        model, loss = cl.lipschitz_cnn(shape, 4, channels=(4,), input_clip=8.0), cl.TauCrossEntropy(4.0)
    elif build == "orthogonal_resnet":
        model = cl.lipschitz_resnet(shape, 4, channels=(4,), input_clip=8.0, conv="orthogonal")
        loss = cl.CrossEntropyWithTemperature(0.5)
    elif build == "mlp_adaptive":
        model = torch.nn.Sequential(cl.InputNormClip(2.0), torch.nn.Flatten(), cl.LipschitzLinear(64, 8),
                                    cl.GroupSort(4), cl.LipschitzLinear(8, 4), cl.AdaptiveLossGradientClip(1.0, 5.0))
        loss = cl.MulticlassKR(4)
    else:
        model, loss = cl.lipschitz_mlp(shape, 4, hidden=(8,), input_clip=2.0), cl.MulticlassHKR(4, margin=0.5)
    engine = cl.BoundEngine(model, shape, 8.0, loss)
    owners = _declared_owners(model, loss)
    assert len({type(m) for m, _ in owners}) >= 3
    for module, name in owners:
        frozen = module.__dict__[name]
        module.__dict__[name] = object()  # differs from any value
        with pytest.raises(cl.BoundError, match=f"its constant {name} changed"):
            engine.compute()
        with pytest.raises(cl.BoundError, match=f"its constant {name} changed"):
            engine.lipschitz_constant()
        module.__dict__[name] = frozen
    engine.compute()


def test_torch_learning_rate_schedulers_drive_the_private_optimizer():
    """``StepLR(dp_optimizer, ...)`` raised "DPOptimizer is not an Optimizer". The private optimizer is now a
    ``torch.optim.Optimizer`` to torch's schedulers, as in Opacus: they set the inner optimizer's learning rate, which
    its steps use; copies keep the private optimizer whole (not the groups-and-state pickle of torch's class)."""
    import copy

    model, opt, loader, loss, engine, data = small_setup(lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer) and opt.state is opt.original_optimizer.state
    assert opt.defaults is opt.original_optimizer.defaults and repr(opt).startswith("DPOptimizer(strategy=global")
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                  torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)]
    x, y = data[torch.arange(8)]
    for i in range(3):
        opt.zero_grad()
        loss.per_example(model(x), y).sum().backward()
        opt.step()
        schedulers[0].step()
        assert opt.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (i + 1))
    schedulers[1].step(1.0)  # a held-out metric
    schedulers[1].step(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3 * 0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0  # the inner step uses the scheduled rate: nothing moves at 0
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert all(torch.allclose(p, b, atol=1e-6) for p, b in zip(model.parameters(), before))
    assert engine.accountant.steps == 4
    twin = copy.deepcopy(opt)
    assert type(twin) is type(opt) and twin.plan == opt.plan and twin.original_optimizer is not opt.original_optimizer
