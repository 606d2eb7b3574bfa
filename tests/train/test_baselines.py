"""Clipped DP-SGD (Opacus) and non-private baselines: accounting, utility, CLI, errors."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import clipless as cl
from clipless.privacy.accounting import compute_epsilon
from clipless.train import baselines
from clipless.train.baselines import (dpsgd_noise_std, draw_noise_unbounded, standard_cnn, standard_mlp, train_dpsgd,
                                      train_nonprivate)

pytest.importorskip("opacus")


@pytest.fixture(scope="module")
def digits():
    return cl.load_digits()


def test_dpsgd_refuses_the_training_data_as_test_data(digits):
    model = standard_mlp(digits.input_shape, 10, hidden=(8,))
    with pytest.raises(ValueError, match="test_data is the training data"):
        train_dpsgd(model, digits.train, batch_size=256, epochs=1, delta=1e-5, max_grad_norm=1.0, target_epsilon=3.0,
                    test_data=digits.train, progress=False)


def test_dpsgd_meets_the_budget_and_learns(digits, capsys):
    torch.manual_seed(0)
    model = standard_mlp(digits.input_shape, 10, hidden=(64,))
    result = train_dpsgd(model, digits.train, batch_size=256, epochs=15, delta=1e-5, max_grad_norm=1.0,
                         target_epsilon=3.0, lr=5e-3, seed=0, noise_seed=0, test_data=digits.test, progress=False)
    assert result.epsilon <= 3.0 and result.epsilon == pytest.approx(3.0, abs=0.02)
    n_batches = -(-len(digits.train) // 256)
    assert result.sample_rate == pytest.approx(1 / n_batches) and result.steps == 15 * n_batches
    # Opacus' own RDP accountant agrees with ours (dp-accounting RDP) on the same mechanism
    ours_rdp = compute_epsilon(result.noise_multiplier, result.sample_rate, result.steps, 1e-5, "rdp")
    assert result.extra["opacus_rdp_epsilon"] == pytest.approx(ours_rdp, rel=2e-3)
    assert result.test_accuracy > 0.6
    # its wall-clock time grows with the secret Poisson batch sizes: released only on request, labelled
    assert result.nonprivate_wall_time_s is None
    timed = train_dpsgd(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=256, epochs=1,
                        delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, progress=False, log_train_stats=True)
    assert timed.nonprivate_wall_time_s > 0
    capsys.readouterr()  # and so is the progress bar's rate and elapsed time
    for stats in (False, True):
        train_dpsgd(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=256, epochs=1,
                    delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, log_train_stats=stats)
        bar = capsys.readouterr().err
        assert "dp-sgd (opacus)" in bar and ("it/s" in bar or "s/it" in bar) == stats


def test_dpsgd_noise_reaches_past_torchs_float32_bound(digits, monkeypatch):
    """Opacus draws torch.normal, whose float32 CPU draws never exceed 5.77 standard deviations (a 24-bit uniform
    radius): a coordinate past that proves which neighbour's clipped sum it was added to, outside the reported
    epsilon. The baseline's noise comes from the library's sampler: with the most extreme radius bits (and no tail
    redraw, which would move it elsewhere) one coordinate lands at sqrt(2 * 39 ln 2) = 7.35 std."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from clipless.privacy import noise

    real_bits = noise.mechanism_words

    def extreme_bits(*args, **kwargs):  # the first pair's radius bits all ones, its angle 0 (cosine 1)
        bits = real_bits(*args, **kwargs)
        bits[0] = (2 ** 39 - 1) << 24
        return bits

    monkeypatch.setattr(noise, "mechanism_words", extreme_bits)
    monkeypatch.setattr(noise, "_TAIL_LEVEL", 1e9)
    model = torch.nn.Linear(4, 1, bias=False)
    loader = DataLoader(TensorDataset(torch.zeros(8, 4), torch.zeros(8)), batch_size=8)
    model, opt, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=1.5, max_grad_norm=2.0, poisson_sampling=False, noise_generator=torch.Generator())
    draw_noise_unbounded(opt)
    model(torch.zeros(8, 4)).sum().backward()  # zero inputs: the clipped sum is 0, the gradient is noise alone
    opt.step()
    z = model._module.weight.grad.flatten() * 8 / (1.5 * 2.0)  # Opacus divides by the expected batch size, 8
    assert float(z[0]) == pytest.approx(math.sqrt(2 * 39 * math.log(2)), rel=1e-5) and float(z[0]) > 5.77
    assert opt.noise_multiplier == 1.5  # restored for Opacus' accountant hook
    # and train_dpsgd draws every step's noise there: one call per parameter per step
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(baselines, "gaussian", lambda *a, **k: calls.append(a[0]) or noise.gaussian(*a, **k))
    result = train_dpsgd(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=512, epochs=1,
                         delta=1e-5, max_grad_norm=1.0, target_epsilon=3.0, progress=False)
    assert len(calls) == 4 * result.steps and result.steps > 0 and result.extra["secure_noise"] is False
    # --secure-noise reached the baseline too (it was dropped: plain draws for a run that asked for secure ones)
    secure = []
    monkeypatch.setattr(baselines, "gaussian", lambda *a, **k: secure.append(a[4]) or noise.gaussian(*a, **k))
    result = train_dpsgd(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=512, epochs=1,
                         delta=1e-5, max_grad_norm=1.0, target_epsilon=3.0, progress=False, secure_noise=True)
    assert secure and all(secure) and result.extra["secure_noise"] is True
    with pytest.raises(ValueError, match="secure_noise must be True or False"):
        train_dpsgd(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=512, epochs=1,
                    delta=1e-5, max_grad_norm=1.0, target_epsilon=3.0, progress=False, secure_noise="yes")
    with pytest.raises(TypeError, match="DPOptimizer"):
        draw_noise_unbounded(torch.optim.SGD(model.parameters(), lr=0.1))


def test_dpsgd_noise_covers_opacus_clipping_where_float32_underflows(monkeypatch):
    """Opacus clips in float32: at a clip norm C of 1e-45 to 1e-44 an example's clipped gradient came out up to
    2.8x C, while the noise was sigma C.  The noise now covers the clipped norms (C + 2^-64)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    def opacus_optimizer(model, x, clip):
        loader = DataLoader(TensorDataset(x, torch.zeros(len(x))), batch_size=len(x))
        return PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
            noise_multiplier=1.5, max_grad_norm=clip, poisson_sampling=False, noise_generator=torch.Generator())[:2]

    worst = 0.0
    for seed in range(12):
        torch.manual_seed(seed)
        clip = (1e-44, 1e-45, 3e-45)[seed % 3]
        x, y = torch.randn(1, 8), torch.randint(0, 3, (1,))
        model, opt = opacus_optimizer(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), x, clip)
        F.cross_entropy(model(x), y).backward()
        opt.clip_and_accumulate()  # one example: its clipped gradient
        norm = float(torch.cat([p.summed_grad.double().flatten() for p in opt.params]).norm())
        worst = max(worst, norm / clip)
        assert norm <= dpsgd_noise_std(1.5, clip) / 1.5, (seed, norm / clip)
    assert worst > 1  # Opacus' clipped norm does exceed C there
    # and the baseline adds that noise: zero inputs, so the gradient is the noise alone (a draw of 1 here)
    monkeypatch.setattr(baselines, "gaussian", lambda shape, *args: torch.ones(shape))
    model, opt = opacus_optimizer(nn.Linear(4, 1, bias=False), torch.zeros(8, 4), 1e-30)
    draw_noise_unbounded(opt)
    model(torch.zeros(8, 4)).sum().backward()
    opt.step()
    assert float(model._module.weight.grad[0, 0]) * 8 == pytest.approx(dpsgd_noise_std(1.5, 1e-30), rel=1e-6)
    assert dpsgd_noise_std(1.5, 1e-30) > 1e4 * 1.5 * 1e-30


def test_dpsgd_with_huge_noise_does_not_learn(digits):
    """The noise is really added: sigma = 1e4 leaves a model at chance level."""
    torch.manual_seed(0)
    model = standard_mlp(digits.input_shape, 10, hidden=(64,))
    result = train_dpsgd(model, digits.train, batch_size=256, epochs=5, delta=1e-5, max_grad_norm=1.0,
                         noise_multiplier=1e4, lr=5e-3, seed=0, noise_seed=0, test_data=digits.test, progress=False)
    assert result.test_accuracy < 0.35 and result.epsilon < 0.01


def test_nonprivate_reaches_high_accuracy(digits):
    torch.manual_seed(0)
    result = train_nonprivate(standard_mlp(digits.input_shape, 10, hidden=(64,)), digits.train, batch_size=64,
                              epochs=15, lr=3e-3, seed=0, test_data=digits.test, progress=False)
    assert result.test_accuracy > 0.93 and result.epsilon is None and result.nonprivate_wall_time_s > 0


def test_the_baselines_take_the_same_learning_rate_schedules(digits, monkeypatch):
    """``lr_schedule="cosine"`` steps a CosineAnnealingLR over the epochs after every epoch, as the clipless
    trainer's CLI schedule does (``--lr-schedule`` is the same for every method); another name is refused first."""
    from torch.optim.lr_scheduler import CosineAnnealingLR

    seen = []
    step = CosineAnnealingLR.step

    def recorded(self, *args, **kwargs):
        step(self, *args, **kwargs)
        seen.append(self.optimizer.param_groups[0]["lr"])

    monkeypatch.setattr(CosineAnnealingLR, "step", recorded)
    train_nonprivate(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=256, epochs=2,
                     lr=1e-2, seed=0, progress=False, lr_schedule="cosine")
    assert seen == pytest.approx([1e-2, 5e-3, 0.0], abs=1e-12)  # the constructor steps once
    seen.clear()
    train_dpsgd(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=256, epochs=2, lr=1e-2,
                delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, progress=False, lr_schedule="cosine")
    assert seen == pytest.approx([1e-2, 5e-3, 0.0], abs=1e-12)
    for train in (train_nonprivate, train_dpsgd):
        with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
            train(standard_mlp(digits.input_shape, 10, hidden=(8,)), digits.train, batch_size=256, epochs=1,
                  progress=False, lr_schedule="linear",
                  **({"delta": 1e-5, "max_grad_norm": 1.0, "noise_multiplier": 1.0} if train is train_dpsgd else {}))


def test_the_baselines_step_the_same_in_physical_parts(digits):
    """``max_physical_batch_size`` runs each batch in parts and steps once: with the same seeds the weights equal
    those of whole batches (Opacus sums the parts' clipped per-example gradients before its one noisy step; the
    non-private parts weigh their mean by their share), and the accountant composes one step per batch."""
    def weights(train, size, **kw):
        torch.manual_seed(0)
        model = standard_mlp(digits.input_shape, 10, hidden=(16,))
        result = train(model, digits.train, batch_size=256, epochs=2, seed=0, progress=False,
                       max_physical_batch_size=size, **kw)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), result

    private = {"delta": 1e-5, "max_grad_norm": 1.0, "noise_multiplier": 1.0, "noise_seed": 3}
    whole, reference = weights(train_dpsgd, None, **private)
    for size in (1, 37, 4096):
        parts, result = weights(train_dpsgd, size, **private)
        torch.testing.assert_close(parts, whole, rtol=0, atol=1e-6)
        assert (result.steps, result.epsilon) == (reference.steps, reference.epsilon)
    whole = weights(train_nonprivate, None)[0]
    torch.testing.assert_close(weights(train_nonprivate, 50)[0], whole, rtol=0, atol=1e-6)
    for train, kw in ((train_dpsgd, private), (train_nonprivate, {})):
        with pytest.raises(ValueError, match="max_physical_batch_size must be an integer >= 1"):
            weights(train, 0, **kw)


def test_standard_cnn_matches_lipschitz_cnn_shapes():
    shape = (1, 28, 28)
    plain, lipschitz = standard_cnn(shape, 10, channels=(16, 32)), cl.lipschitz_cnn(shape, 10, channels=(16, 32))
    x = torch.rand(3, *shape)
    assert plain(x).shape == lipschitz(x).shape == (3, 10)
    conv_weights = lambda m: [p.shape for n, p in m.named_parameters() if p.dim() == 4]  # noqa: E731
    assert conv_weights(plain) == conv_weights(lipschitz)


def test_bad_baseline_input(digits):
    model = standard_mlp(digits.input_shape, 10, hidden=(8,))
    with pytest.raises(ValueError, match="target_epsilon, noise_multiplier, or both"):
        train_dpsgd(model, digits.train, batch_size=64, epochs=1, delta=1e-5, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="single step"):  # a fixed sigma whose first step passes the target
        train_dpsgd(model, digits.train, batch_size=64, epochs=1, delta=1e-5, max_grad_norm=1.0,
                    target_epsilon=1.0, noise_multiplier=0.3)
    with pytest.raises(ValueError, match="delta"):
        train_dpsgd(model, digits.train, batch_size=64, epochs=1, delta=0.01, max_grad_norm=1.0, target_epsilon=1.0)
    for clip in (0.0, float("nan"), float("inf")):  # NaN passed a "<= 0" test
        with pytest.raises(ValueError, match="max_grad_norm"):
            train_dpsgd(model, digits.train, batch_size=64, epochs=1, delta=1e-5, max_grad_norm=clip,
                        target_epsilon=1.0)


@pytest.mark.parametrize("method", ["dpsgd", "nonprivate"])
def test_cli_method(method, tmp_path, capsys):
    from clipless.cli import main

    main(["train", "--method", method, "--epochs", "3", "--hidden", "32", "--no-progress", "--output-dir", str(tmp_path)])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["method"] == method and 0 <= result["test_accuracy"] <= 1
    assert (result["epsilon"] is None) == (method == "nonprivate")
    assert f"[{method}]" in capsys.readouterr().out
    if method == "dpsgd":  # --secure-noise reaches the baseline's draws (it was silently dropped)
        main(["train", "--method", method, "--epochs", "1", "--hidden", "8", "--no-progress", "--secure-noise",
              "--output-dir", str(tmp_path / "secure")])
        assert json.loads((tmp_path / "secure" / "result.json").read_text())["extra"]["secure_noise"] is True
