"""What the private step trusts of its own objects: the layers' cached certificates, their projection and state
methods, the accountant's composition, the private optimizer's methods.  Each attack released a step with less
noise than its bound, a weight moved by the raw gradient, or a step left out of epsilon before these checks.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import clipless as cl
from helpers import exact_linear_operator_norm, honest_steps, next_batch_backward, small_private_run
from clipless.privacy.accounting import check_composed_, extended_history
from clipless.privacy.certified import BoundError, CertifiedValueCache, certified_spectral_norm



# -- the certificate cache ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(8, 6), (6, 8), (3, 8), (1, 5), (40, 40)])
@pytest.mark.parametrize("orthonormal", [True, False])
def test_a_certificate_below_the_matrix_norm_is_refused_and_a_true_one_accepted(rows, cols, orthonormal):
    torch.manual_seed(rows * cols)
    w = torch.empty(rows, cols)
    if orthonormal:
        nn.init.orthogonal_(w)
    else:
        w.normal_()
    cache = CertifiedValueCache()
    true = certified_spectral_norm(w)
    assert cache.put(w, None, true) == true and cache.get(w, None) == true
    # orthonormal rows (what Björck keeps): any probe measures the norm itself; otherwise the probe's power
    # iteration, one step per put, reaches the top direction over the steps of a run
    for _ in range(0 if orthonormal else 40):
        cache.put(w, None, true)
    with pytest.raises(BoundError, match="not an upper bound"):
        cache.put(w, None, true * (0.9999 if orthonormal else 0.999))
    with pytest.raises(BoundError, match="not an upper bound"):
        cache.put(w, None, float("nan"))
    assert cache.get(w, None) == true  # the refused claims left the certificate as it was


def test_writing_the_cache_attributes_changes_no_certificate():
    """The certificate lives outside the cache object: ``cache._value = 0.3`` (the attack) sets a dead attribute."""
    w = torch.empty(8, 6)
    nn.init.orthogonal_(w)
    cache = CertifiedValueCache()
    value = cache.put(w, None, certified_spectral_norm(w))
    for attr in ("_value", "value", "_tensor", "_key"):
        setattr(cache, attr, 0.3)
    assert cache.get(w, None) == value


def test_a_copied_or_pickled_layer_keeps_its_certificate_and_a_forged_pickle_is_refused():
    layer = cl.LipschitzLinear(6, 8)
    layer.project_()
    value = layer._norm_cache.get(layer.weight, None)
    assert value is not None and value >= certified_spectral_norm(layer.weight) * (1 - 1e-6)
    assert copy.deepcopy(layer)._norm_cache.get(layer.weight, None) == value
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._norm_cache.get(loaded.weight, None) == value
    state = layer._norm_cache.__getstate__()
    forged = pickle.dumps(state)
    cache = CertifiedValueCache()
    claim = pickle.loads(forged)
    claim["value"] = 0.3
    with pytest.raises(BoundError, match="not an upper bound"):
        cache.__setstate__(claim)


def test_a_certificate_forged_in_a_layer_cache_never_reaches_the_noise():
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader)
    honest = dict(opt.last_noise_std)
    layer = model[0]
    layer._norm_cache._value = 0.3  # the attack of this round: 3.3x less noise, accepted before
    honest_steps(model, opt, loss, loader)
    assert opt.last_noise_std == pytest.approx(honest, rel=1e-5)  # the Björck certificate moves by ~1e-9 a step
    with pytest.raises(BoundError, match="not an upper bound"):
        layer._norm_cache.put(layer.weight, None, 0.3)
    honest_steps(model, opt, loss, loader)
    assert opt.last_noise_std == pytest.approx(honest, rel=1e-5) and engine.accountant.steps == 3


# -- a layer's methods set on the instance --------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["project_", "set_extra_state", "get_extra_state", "_load_from_state_dict"])
def test_a_layer_method_set_on_the_instance_is_refused_before_it_runs(method):
    """``layer.project_ = f`` ran ``f`` inside the private step after its checks (it added the raw gradient to the
    weight in the attack); ``set_extra_state`` decides the certificate a resume puts back."""
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader)
    layer, ran = model[0], []
    setattr(layer, method, lambda *args, **kwargs: ran.append(method))
    opt.zero_grad()
    next_batch_backward(model, loss, loader)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BoundError, match=f"has its own {method}"):
        opt.step()
    assert not ran and engine.accountant.steps == 1
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    delattr(layer, method)
    honest_steps(model, opt, loss, loader)
    assert engine.accountant.steps == 2


@pytest.mark.parametrize("method", ["set_extra_state", "_load_from_state_dict"])
def test_a_layer_state_method_replaced_on_the_class_is_refused(method):
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader)
    cls = type(model[0])
    original = cls.__dict__.get(method)
    setattr(cls, method, lambda self, *args, **kwargs: None)
    try:
        opt.zero_grad()
        with pytest.raises(BoundError, match=f"its class's {method} changed"):
            next_batch_backward(model, loss, loader)
            opt.step()
        assert engine.accountant.steps == 1
    finally:
        if original is None:
            delattr(cls, method)
        else:
            setattr(cls, method, original)
    honest_steps(model, opt, loss, loader)
    assert engine.accountant.steps == 2


# -- the accountant and the private optimizer -----------------------------------------------------------------------

def test_a_method_set_on_the_accountant_is_refused_before_the_step():
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader)
    accountant = opt.accountant
    with pytest.raises(AttributeError, match="methods are its class's"):
        accountant.step = lambda *args, **kwargs: None
    for name in ("step", "get_epsilon"):  # composes nothing; composes right but reports wrong
        accountant.__dict__[name] = lambda *args, **kwargs: None  # past the guard: the attack of this round
        weights = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        next_batch_backward(model, loss, loader)
        with pytest.raises(BoundError, match=f"own objects \\(the accountant's {name}\\)"):
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
        del accountant.__dict__[name]
    honest_steps(model, opt, loss, loader)
    assert accountant.steps == 2 and accountant.history == [(1.0, 16 / 96, 2)]


def test_a_step_the_accountant_did_not_compose_is_put_back_and_refused():
    """The check after each release: the history must be exactly the planned extension of the one before."""
    accountant = cl.PrivacyAccountant("rdp")
    accountant.step(1.0, 0.1, 3)
    expected = [(1.0, 0.1, 4)]
    with pytest.raises(BoundError, match="did not compose the released step"):
        check_composed_(accountant, expected)
    assert accountant.history == expected
    check_composed_(accountant, expected)  # now it holds it
    assert extended_history(expected, 1.0, 0.1) == [(1.0, 0.1, 5)]
    assert extended_history(expected, 2.0, 0.1) == [(1.0, 0.1, 4), (2.0, 0.1, 1)]
    accountant.step(2.0, 0.1)
    assert accountant.history == extended_history(expected, 2.0, 0.1)


def test_a_function_or_class_of_the_privacy_core_replaced_after_make_private_is_refused():
    """``clipless.privacy.noise.gaussian = zeros`` (or ``optimizer.add_noise_``) released the raw gradient."""
    import clipless.privacy.noise as noise_module
    import clipless.privacy.optimizer as optimizer_module
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader)
    for owner, name, fake in [(noise_module, "gaussian", lambda shape, *a, **k: torch.zeros(shape)),
                              (optimizer_module, "add_noise_", lambda *a, **k: {}),
                              (cl.PrivacyAccountant, "step", lambda *a, **k: None),
                              (optimizer_module.DPOptimizer, "_checked_report", lambda *a, **k: None)]:
        original = vars(owner)[name]
        setattr(owner, name, fake)
        try:
            opt.zero_grad()
            with pytest.raises(BoundError, match=f"{name} was replaced after make_private"):
                next_batch_backward(model, loss, loader)
                opt.step()
        finally:
            setattr(owner, name, original)
        assert engine.accountant.steps == 1
    honest_steps(model, opt, loss, loader)
    assert engine.accountant.steps == 2


@pytest.mark.parametrize("method", ["_checked_report", "_release", "_check_one_new_batch"])
def test_a_method_set_on_the_private_optimizer_is_refused(method):
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader)
    ran = []
    opt.__dict__[method] = lambda *args, **kwargs: ran.append(method)
    opt.zero_grad()
    next_batch_backward(model, loss, loader)
    with pytest.raises(BoundError, match=f"own objects \\(the private optimizer's {method}\\)"):
        opt.step()
    assert not ran and engine.accountant.steps == 1
    del opt.__dict__[method]
    honest_steps(model, opt, loss, loader)
    assert engine.accountant.steps == 2
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # a scheduler's wrapper of step() is no such method
    honest_steps(model, opt, loss, loader)
    assert engine.accountant.steps == 3


@pytest.mark.parametrize("stride, padding, mode, operator_norm", [(1, "same", "zeros", "reshaped"),
                                                                  (1, "same", "circular", "fft"),
                                                                  (2, 1, "zeros", "reshaped"), (2, 0, "zeros", "fft"),
                                                                  (1, 0, "circular", "reshaped")])
def test_a_convolution_certificate_is_checked_from_below_by_the_convolution_itself(stride, padding, mode,
                                                                                   operator_norm):
    """The measured norm stays below the exact operator norm (the dense matrix of the map), reaches it within the
    steps of a run, and a claim below it is refused; a true certificate never is."""
    torch.manual_seed(stride * 7 + len(mode))
    conv = cl.LipschitzConv2d(3, 5, 3, stride=stride, padding=padding, padding_mode=mode,
                              operator_norm=operator_norm)
    with torch.no_grad():
        conv.weight.normal_()
    key = (operator_norm, (9, 9))
    for _ in range(40):
        value = conv.certified_lipschitz((3, 9, 9))
        assert conv._norm_cache.put(conv.weight, key, value) == value
    kernel = conv.weight.detach().double()
    ph, pw = conv.padding
    exact = exact_linear_operator_norm(
        lambda x: (torch.nn.functional.conv2d(torch.nn.functional.pad(x, (pw, pw, ph, ph), mode="circular"), kernel,
                                              stride=stride) if mode == "circular"
                   else torch.nn.functional.conv2d(x, kernel, stride=stride, padding=conv.padding)), (3, 9, 9))
    assert value >= exact * (1 - 1e-9)
    with pytest.raises(BoundError, match="not an upper bound"):
        conv._norm_cache.put(conv.weight, key, exact * 0.99)
    assert conv._norm_cache.get(conv.weight, key) == value


def test_a_layers_cache_cannot_be_replaced_by_one_that_checks_nothing():
    conv = cl.LipschitzConv2d(3, 4, 3)
    with pytest.raises(AttributeError, match="declared constant"):
        conv._norm_cache = CertifiedValueCache()
    model = nn.Sequential(conv, cl.MaxMin(), nn.Flatten(), cl.LipschitzLinear(4 * 36, 3))
    data = cl.ArrayDataset(torch.rand(48, 3, 6, 6) / 18, torch.randint(0, 3, (48,)))
    loss = cl.TauCrossEntropy(2.0)
    engine = cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data=data, loss=loss, noise_multiplier=1.0, input_shape=(3, 6, 6),
                                             batch_size=8.0, input_bound=1.0)
    honest_steps(model, opt, loss, loader)
    conv.__dict__["_norm_cache"] = CertifiedValueCache()  # past the guard: refused at the forward
    opt.zero_grad()
    with pytest.raises(BoundError, match="_norm_cache"):
        next_batch_backward(model, loss, loader)
        opt.step()
    assert engine.accountant.steps == 1
