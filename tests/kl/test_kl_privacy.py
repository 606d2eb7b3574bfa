"""KL privacy of noisy GD (spec §5): closed forms, the init formula, and the estimator against exact KL."""

import math

import numpy as np
import pytest
import torch

from clipless.diagnostics.membership import loss_threshold_attack
from clipless.kl import noisy_gd as klp


def _data(n, d, k, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    x = x / x.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=g, dtype=dtype)
    y = torch.randint(0, k, (n,), generator=g)
    return x, y


def _autograd_mean_grad(model, x, y, loss):
    for p in model.weights:
        p.grad = None
    logits = model(x)
    klp.KL_LOSSES[loss](logits, y)[0].mean().backward()
    return torch.cat([p.grad.flatten() for p in model.weights])


@pytest.mark.parametrize("linearized", [False, True])
@pytest.mark.parametrize("loss", ["cross_entropy", "squared"])
@pytest.mark.parametrize("scheme", klp.INIT_SCHEMES)
def test_closed_form_gaps_equal_brute_force(linearized, loss, scheme):
    widths = [5, 7, 6, 3]
    x, y = _data(9, widths[0], widths[-1], seed=1)
    xh, yh = _data(4, widths[0], widths[-1], seed=2)
    net = klp.ReLUNetwork(widths, scheme, torch.Generator().manual_seed(3), dtype=torch.float64)
    model = klp.LinearizedNetwork(net) if linearized else net
    if linearized:  # move away from theta_0 so the linearization differs from the network
        with torch.no_grad():
            for p in model.weights:
                p.add_(0.3 * torch.randn_like(p))
    geometry = klp.gradient_geometry(model, x, y, xh, yh, loss)
    gaps = klp.neighbour_gaps(geometry)

    full = _autograd_mean_grad(model, x, y, loss)
    assert torch.allclose(torch.cat([g.flatten() for g in geometry.mean_grad]), full, atol=1e-12)
    brute = []
    for j in range(len(x)):
        keep = torch.arange(len(x)) != j
        brute.append(((full - _autograd_mean_grad(model, x[keep], y[keep], loss)) ** 2).sum())
    for i in range(len(xh)):
        bigger_x, bigger_y = torch.cat([x, xh[i:i + 1]]), torch.cat([y, yh[i:i + 1]])
        brute.append(((full - _autograd_mean_grad(model, bigger_x, bigger_y, loss)) ** 2).sum())
    assert torch.allclose(gaps, torch.stack(brute), rtol=1e-9, atol=1e-15)


def test_linearized_network_is_first_order_expansion():
    net = klp.ReLUNetwork([4, 8, 2], "he", torch.Generator().manual_seed(0), dtype=torch.float64)
    lin = klp.LinearizedNetwork(net)
    x, _ = _data(5, 4, 2, seed=0)
    assert torch.allclose(lin(x), net(x))
    direction = [1e-4 * torch.randn_like(w) for w in net.weights]
    with torch.no_grad():
        for p, dw in zip(lin.weights, direction):
            p.add_(dw)
        moved = klp.relu_network_forward([w + dw for w, dw in zip(net.weights, direction)], x)
    assert torch.allclose(lin(x), moved, atol=1e-7)  # second-order error only


@pytest.mark.parametrize("scheme", klp.INIT_SCHEMES)
def test_gradient_norm_formula_matches_monte_carlo(scheme):
    widths = [30, 256, 128, 4]
    k = widths[-1]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, widths[0], generator=g, dtype=torch.float64)
    x = 0.7 * x / x.norm()
    samples = []
    for _ in range(1500):
        net = klp.ReLUNetwork(widths, scheme, g, dtype=torch.float64)
        # ||grad_theta f(x)||_F^2 = sum over outputs i of ||grad f_i||^2 = sum_l ||delta_l||^2 ||h_l||^2 with dz = e_i
        hs, ds = klp._layer_factors(list(net.weights), x.expand(k, -1), torch.eye(k, dtype=torch.float64))
        samples.append(sum(((d * d).sum(1) * (h * h).sum(1)).sum() for d, h in zip(ds, hs)).item())
    mc = float(np.mean(samples))
    formula = klp.gradient_norm_at_init(widths, scheme, input_norm_sq=0.49)
    assert abs(mc - formula) / formula < 0.05, (scheme, mc, formula)


def test_init_variances_follow_spec():
    w = [10, 20, 5, 2]
    assert klp.init_variances(w, "lecun") == [1 / 10, 1 / 20, 1 / 5]
    assert klp.init_variances(w, "he") == [2 / 10, 2 / 20, 2 / 5]
    assert klp.init_variances(w, "xavier") == [2 / 30, 2 / 25, 2 / 7]
    assert klp.init_variances(w, "ntk") == [2 / 20, 2 / 5, 1 / 2]
    with pytest.raises(ValueError, match="unknown initialization"):
        klp.init_variances(w, "orthogonal")


def _exact_linear_chain_kl(x, y, heldout_x, heldout_y, k, beta, eta, sigma, steps):
    """Exact KL(A(D)||A(D')) for each neighbour when the model is linear, W in R^{k x d}, with the squared loss.

    grad L(W; D) = W A - B, A = mean x x^T, B = mean onehot(y) x^T, so W_t is Gaussian (rows independent,
    mean M_t, covariance S_t) and E||Delta g_t||^2 = ||M_t dA - dB||_F^2 + k tr(dA S_t dA).
    """
    d = x.shape[1]
    v = 2 * eta * sigma ** 2

    def moments(xs, ys):
        onehot = torch.nn.functional.one_hot(ys, k).double()
        return xs.T @ xs / len(xs), onehot.T @ xs / len(xs)

    A, B = moments(x, y)
    neighbours = []
    for j in range(len(x)):
        keep = torch.arange(len(x)) != j
        neighbours.append(moments(x[keep], y[keep]))
    for i in range(len(heldout_x)):
        neighbours.append(moments(torch.cat([x, heldout_x[i:i + 1]]), torch.cat([y, heldout_y[i:i + 1]])))
    M = torch.zeros(k, d, dtype=torch.float64)
    S = beta * torch.eye(d, dtype=torch.float64)
    total = torch.zeros(len(neighbours), dtype=torch.float64)
    transition = torch.eye(d, dtype=torch.float64) - eta * A
    for _ in range(steps):
        for idx, (A2, B2) in enumerate(neighbours):
            dA, dB = A - A2, B - B2
            total[idx] += ((M @ dA - dB) ** 2).sum() + k * torch.trace(dA @ S @ dA)
        M = M @ transition + eta * B
        S = transition.T @ S @ transition + v * torch.eye(d, dtype=torch.float64)
    return (eta ** 2 / (2 * v)) * total


def test_estimator_equals_exact_gaussian_chain_kl():
    d, k, eta, sigma, steps, runs = 3, 2, 0.5, 0.05, 15, 800
    x, y = _data(6, d, k, seed=5)
    xh, yh = _data(2, d, k, seed=6)
    beta = klp.init_variances([d, k], "lecun")[0]
    exact = _exact_linear_chain_kl(x, y, xh, yh, k, beta, eta, sigma, steps)
    trace, _ = klp.kl_trace(
        lambda r: klp.ReLUNetwork([d, k], "lecun", torch.Generator().manual_seed(100 + r), dtype=torch.float64),
        x, y, xh, yh, eta=eta, sigma=sigma, steps=steps, runs=runs, seed=0, loss="squared",
    )
    estimated = klp.kl_per_unit_gap(eta, sigma) * trace.mean_gaps.sum(axis=0)
    assert np.allclose(estimated, exact.numpy(), rtol=0.06), (estimated, exact)
    assert trace.worst_neighbour_kl()[-1] == pytest.approx(exact.max().item(), rel=0.06)
    # the paper's estimator (max over neighbours inside the expectation) upper-bounds the worst neighbour
    assert trace.kl >= trace.worst_neighbour_kl()[-1]


def test_linearized_trajectory_kl_stays_under_theoretical_bound():
    widths, eta, sigma, steps = [20, 64, 2], 0.5, 0.05, 30
    x, y = _data(40, widths[0], 2, seed=7)
    xh, yh = _data(20, widths[0], 2, seed=8)
    max_norm_sq = float(torch.cat([x, xh]).norm(dim=1).max() ** 2)
    for scheme in klp.INIT_SCHEMES:
        trace, _ = klp.kl_trace(
            lambda r: klp.LinearizedNetwork(klp.ReLUNetwork(widths, scheme, torch.Generator().manual_seed(r),
                                                            dtype=torch.float64)),
            x, y, xh, yh, eta=eta, sigma=sigma, steps=steps, runs=20, seed=0,
        )
        bound = klp.linearized_kl_bound(widths, scheme, max_norm_sq, len(x), eta, sigma, steps)
        assert 0 < trace.worst_neighbour_kl()[-1] <= bound, (scheme, trace.worst_neighbour_kl()[-1], bound)


def test_noise_is_secret_unless_seeded():
    """Two unseeded runs from one initialization differ (OS entropy, whatever the torch global seed); two runs
    with one seed are equal, and the trace says which it was."""
    x, y = _data(10, 3, 2, seed=9)

    def net():
        return klp.ReLUNetwork([3, 4, 2], "lecun", torch.Generator().manual_seed(1), dtype=torch.float64)

    def trained(seed):
        torch.manual_seed(0)  # a public global seed must not fix the noise
        trace, models = klp.kl_trace(lambda r: net(), x, y, None, None, eta=0.1, sigma=0.1, steps=2, runs=1, seed=seed)
        return trace, torch.cat([w.detach().flatten() for w in models[0].weights])

    (t1, w1), (_, w2) = trained(None), trained(None)
    assert not torch.equal(w1, w2) and t1.extra["randomness"] == "os-entropy"
    (t3, w3), (_, w4) = trained(5), trained(5)
    assert torch.equal(w3, w4) and "not private" in t3.extra["randomness"]
    net_a, net_b = net(), net()
    for model in (net_a, net_b):
        torch.manual_seed(0)
        klp.noisy_gradient_descent(model, x, y, None, None, eta=0.1, sigma=0.1, steps=1)
    assert not torch.equal(net_a.weights[0], net_b.weights[0])


def test_conversions_and_attack():
    assert klp.kl_to_delta(0.5) == pytest.approx(0.5)
    assert klp.membership_advantage_bound(0.02) == pytest.approx(0.1)
    assert klp.membership_advantage_bound(50.0) == pytest.approx(math.sqrt(1 - math.exp(-50)))
    separated = loss_threshold_attack(torch.zeros(10), torch.ones(10))
    assert separated["advantage"] == pytest.approx(1.0) and separated["auroc"] == pytest.approx(1.0)
    same = loss_threshold_attack(torch.arange(10.0), torch.arange(10.0) + 0.5)
    assert same["advantage"] <= 0.2


def test_bad_input_is_refused():
    net = klp.ReLUNetwork([3, 4, 2], "lecun")
    x = torch.randn(5, 3)
    y = torch.randint(0, 2, (5,))
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        klp.noisy_gradient_descent(net, bad, y, None, None, eta=0.1, sigma=0.1, steps=1)
    for eta, sigma, name in ((0.0, 0.1, "eta"), (float("nan"), 0.1, "eta"), (0.1, float("nan"), "sigma"),
                             (0.1, float("inf"), "sigma"), (True, 0.1, "eta")):  # NaN passed "<= 0", True ran as 1
        with pytest.raises(ValueError, match=name):
            klp.noisy_gradient_descent(net, x, y, None, None, eta=eta, sigma=sigma, steps=1)
    with pytest.raises(ValueError, match="unknown loss"):
        klp.gradient_geometry(net, x, y, loss="hinge")
    with pytest.raises(TypeError):
        klp.gradient_geometry(torch.nn.Linear(3, 2), x, y)


@pytest.mark.parametrize("change, match", [
    # each of these ran before: a NaN KL, an addition-free KL, a rounded width, or a torch error deep inside
    (dict(eta=1e30), "diverged at step"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite number"),
    (dict(steps=2.5), "steps must be an integer"),
    (dict(steps=True), "steps must be an integer"),
    (dict(x_heldout=torch.ones(4, 3) / 3, y_heldout=None), "held-out records and their labels together"),
    (dict(y_train=torch.tensor([0, 1, 2, 0, 1])), r"labels must lie in \[0, 2\)"),
    (dict(y_train=torch.zeros(5)), "int64"),
    (dict(y_train=torch.zeros(4, dtype=torch.int64)), r"\(5,\) int64"),
    (dict(x_train=torch.ones(5, 4)), r"\(records, 3\)"),
    (dict(x_train=torch.ones(5, 3, dtype=torch.float64)), "float32"),
])
def test_noisy_gd_refuses_what_would_void_the_kl(change, match):
    net = klp.ReLUNetwork([3, 4, 2], "lecun", torch.Generator().manual_seed(0))
    run = dict(x_train=torch.ones(5, 3) / 3, y_train=torch.tensor([0, 1, 1, 0, 1]), x_heldout=None, y_heldout=None,
               eta=0.1, sigma=0.1, steps=2)
    with pytest.raises(ValueError, match=match):
        klp.noisy_gradient_descent(net, **{**run, **change})


def test_kl_conversions_refuse_a_failed_measurement():
    for kl in (float("nan"), -0.1):  # returned NaN, or 0 (perfect privacy) for a negative KL
        with pytest.raises(ValueError, match="KL divergence"):
            klp.kl_to_delta(kl)
        with pytest.raises(ValueError, match="KL divergence"):
            klp.membership_advantage_bound(kl)
    assert klp.membership_advantage_bound(math.inf) == 1.0
    with pytest.warns(UserWarning, match="vacuous"):
        assert klp.kl_to_delta(math.inf) == 1.0
    for change, match in ((dict(steps=-5), "steps"), (dict(eta=-0.1), "eta"), (dict(input_norm_sq=-1.0), "input_norm"),
                          (dict(sigma=float("nan")), "sigma"), (dict(n_train=True), "n_train")):
        with pytest.raises(ValueError, match=match):  # each gave a negative or NaN bound
            klp.linearized_kl_bound(**{**dict(widths=[5, 8, 2], scheme="he", input_norm_sq=1.0, n_train=20, eta=0.1,
                                                sigma=1e-3, steps=5), **change})
    with pytest.raises(ValueError, match=r"widths\[1\] must be an integer"):
        klp.ReLUNetwork([5, 8.7, 2], "he")  # built 8 units


def test_kl_study_cli_end_to_end(shared_data, tmp_path, capsys):
    import json

    from clipless.cli import main

    out = tmp_path / "kl"
    main(["kl-study", "--data-dir", str(shared_data / "mnist"), "--n-train", "60", "--n-heldout", "40",
          "--inits", "lecun", "he", "--width", "16", "--widths", "8", "16", "--depths", "2", "3", "--steps", "4",
          "--short-steps", "2", "--runs", "2", "--output-dir", str(out), "--no-progress"])
    study = json.loads((out / "kl_study.json").read_text())
    assert {p.split("/")[-1] for p in study["plots"]} == {"kl_vs_steps.png", "kl_vs_width.png", "kl_vs_depth.png"}
    assert all((out / name).stat().st_size > 0 for name in ("kl_vs_steps.png", "kl_vs_width.png", "kl_vs_depth.png"))
    # written through a temporary file each (a crash leaves an earlier study's files whole), none of them left
    assert sorted(p.name for p in out.iterdir()) == ["kl_study.json", "kl_vs_depth.png", "kl_vs_steps.png",
                                                    "kl_vs_width.png"]
    kinds = [r["experiment"] for r in study["results"]]
    assert kinds.count("steps") == 4 and kinds.count("attack") == 2  # network + linearized per init
    for r in study["results"]:
        assert len(r["kl_curve_mean"]) == 4 and np.all(np.diff(r["kl_curve_mean"]) >= 0)
        assert r["kl_short"] <= r["kl"] and r["advantage_bound"] <= 1
    assert set(study["summary"]["width"]) == {"lecun", "he"}
    printed = capsys.readouterr().out
    assert "membership attacks within the KL advantage bound" in printed
    # computed from the training records without noise: labelled so in the file and on screen
    assert study["private"] is False and "non-private" in study["privacy_note"] and "non-private study" in printed
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    main(["kl-study", "--data-dir", str(shared_data / "mnist"), "--n-train", "60", "--n-heldout", "40",
          "--inits", "lecun", "--width", "16", "--widths", "8", "--depths", "2", "--steps", "2",
          "--short-steps", "1", "--runs", "1", "--output-dir", str(out), "--no-progress"])
    (kept,) = [p for p in out.iterdir() if p.is_dir()]  # the first study's files, moved aside by the second
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == written


@pytest.mark.parametrize("flags, match", [
    (["--digits", "3", "3"], "digits must be two different MNIST digits"),
    (["--digits", "3", "11"], "digits must be two different MNIST digits"),
    (["--n-train", "1"], "n_train must be an integer >= 2"),
    (["--n-heldout", "0"], "n_heldout must be an integer >= 1"),
    (["--inits", "foo"], "inits must name at least one of"),
    (["--inits"], "inits must name at least one of"),
    (["--widths", "8", "0"], r"widths\[1\] must be an integer >= 1"),
    (["--runs", "0"], "runs must be an integer >= 1"),
    (["--sigma", "nan"], "sigma must be a positive finite number"),
    (["--eta", "-1"], "eta must be a positive finite number"),
    # a ZeroDivisionError, an OverflowError and torch's C++ trace before
    (["--sigma", "1e-320"], "sigma must be at least 1e-150 .its square underflows to 0."),
    (["--mia-sigma", "1e-320"], "mia_sigma must be at least 1e-150"),
    (["--depth", "99999999999999999999"], "depth must be below 2\\^31"),
    (["--width", "99999999999999999999"], "width must be below 2\\^31"),
    (["--runs", "99999999999999999999"], "runs must be below 2\\^31"),
    (["--seed", "99999999999999999999"], "seed must be an integer of magnitude below 2\\^53"),
])
def test_kl_study_settings_refused_before_anything_runs(tmp_path, flags, match):
    from clipless.cli import main

    out = tmp_path / "kl"
    with pytest.raises(SystemExit, match=match):  # checked before the data directory is even read
        main(["kl-study", "--data-dir", str(tmp_path / "absent"), *flags, "--output-dir", str(out), "--no-progress"])
    assert not out.exists()
