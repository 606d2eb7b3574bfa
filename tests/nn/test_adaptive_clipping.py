"""Adaptive loss-gradient clipping (private quantile, Andrew et al. 2021): accounting, bounds, convergence."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from torch import nn

import clipless as cl
from clipless.privacy.bounds import BoundEngine

from helpers import check

DELTA = 1e-5


def _trainer(clip: nn.Module, epochs: int = 3, **kw):
    torch.manual_seed(0)
    data = cl.load_digits(seed=0)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(64,))
    model.append(clip)
    args = dict(input_shape=data.input_shape, input_bound=8.0, batch_size=128, delta=DELTA, epochs=epochs,
                noise_seed=0, test_data=data.test, progress=False, log=None)
    args.update(kw)
    return cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cl.TauCrossEntropy(8.0),
                             data.train, **args)


def _hand_built_epsilon(sigma: float, count_sigma: float, q: float, steps: int, mechanism: str) -> float:
    """The step as dp-accounting events written out by hand: gradient and count mechanisms on one Poisson batch."""
    if mechanism == "rdp":
        step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(count_sigma)]))
        accountant = rdp.RdpAccountant()
    else:  # PLD takes the composed Gaussian as one, sigma_eff = (sigma^-2 + count_sigma^-2)^-1/2
        sigma_eff = (sigma**-2 + count_sigma**-2) ** -0.5
        step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_eff))
        accountant = pld.PLDAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_epsilon_includes_the_quantile_mechanism(mechanism):
    clip = cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=2.0)
    trainer = _trainer(clip, noise_multiplier=1.2, accountant=mechanism)
    result = trainer.fit()
    q = trainer.sample_rate
    expected = _hand_built_epsilon(1.2, 2.0, q, result.steps, mechanism)
    assert result.epsilon == pytest.approx(expected, rel=1e-6)
    without_count = cl.compute_epsilon(1.2, q, result.steps, DELTA, mechanism)
    assert result.epsilon > 1.05 * without_count  # the count is not free
    assert result.noise_multiplier == 1.2 and result.effective_noise_multiplier < 1.2


def test_calibration_to_a_target_counts_the_quantile_from_the_first_step():
    clip = cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=8.0)
    trainer = _trainer(clip, epochs=4, target_epsilon=2.0, accountant="rdp")
    result = trainer.fit()
    assert result.epsilon <= 2.0
    assert result.epsilon == pytest.approx(
        _hand_built_epsilon(result.noise_multiplier, 8.0, trainer.sample_rate, result.steps, "rdp"), rel=1e-6)
    assert result.epsilon > 1.9  # calibrated to the target, not far below it
    plain = _trainer(cl.LossGradientClip(1.0), epochs=4, target_epsilon=2.0, accountant="rdp")
    assert result.noise_multiplier > plain.optimizer.noise_multiplier  # the gradient gets less of the budget


def test_count_noise_too_small_for_the_budget_is_refused():
    with pytest.raises(ValueError, match="raise their noise multipliers"):
        _trainer(cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=0.3), target_epsilon=1.0)


def test_clip_norm_tracks_the_target_quantile(monkeypatch):
    """With little count noise, C moves to where about the target fraction of examples is unclipped."""
    clip = cl.AdaptiveLossGradientClip(10.0, count_noise_multiplier=5.0, target_quantile=0.3, learning_rate=0.3)
    trainer = _trainer(clip, epochs=12, noise_multiplier=1.0)
    history = []
    original_update = cl.AdaptiveLossGradientClip.update_

    def update(self, expected_batch_size, generator=None):
        fraction = original_update(self, expected_batch_size, generator)
        history.append((fraction, self.max_norm))
        return fraction

    # a spy on the class: one set on the instance is refused by the step (it could release anything)
    monkeypatch.setattr(cl.AdaptiveLossGradientClip, "update_", update)
    trainer.fit()
    assert clip.max_norm < 5.0  # it came down from 10
    late = [f for f, _ in history[len(history) // 2 :]]
    assert abs(sum(late) / len(late) - 0.3) < 0.1


def test_bound_uses_the_current_clip_norm_and_holds():
    clip = cl.AdaptiveLossGradientClip(0.4, count_noise_multiplier=5.0)
    model = nn.Sequential(nn.Flatten(), cl.LipschitzLinear(8, 8), cl.MaxMin(), cl.LipschitzLinear(8, 4), clip)
    loss = cl.TauCrossEntropy(1.0)
    engine = BoundEngine(model, (8,), 1.0, loss.lipschitz)
    assert all(layer.grad_out_bound == pytest.approx(0.4, rel=1e-6) for layer in engine.compute().layers)
    clip.clip_norm.fill_(0.1)
    assert all(layer.grad_out_bound == pytest.approx(0.1, rel=1e-6) for layer in engine.compute().layers)
    check(model, (8,), radius=1.0, loss=loss)


def test_count_counts_each_example_once_per_step_and_ignores_diagnostics():
    clip = cl.AdaptiveLossGradientClip(1e6, count_noise_multiplier=1.0)  # nothing is clipped: all counted
    model = nn.Sequential(cl.LipschitzLinear(5, 3), clip)
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    cl.TauCrossEntropy(1.0).per_example(model(x), y).sum().backward()
    assert clip._below == 7
    with clip.counting_paused():
        cl.TauCrossEntropy(1.0).per_example(model(x), y).sum().backward()
    assert clip._below == 7
    fraction = clip.update_(7.0, torch.Generator().manual_seed(0))
    assert clip._below == 0 and abs(fraction - 1.0) < 1.0  # noise std 1/7 on the fraction
    state = model.state_dict()
    assert "1.clip_norm" in state  # checkpoints keep C



class _CountingClip(cl.AdaptiveLossGradientClip):
    """Records the count each ``update_`` draws its noise for (make_private refuses ``noisy_count`` replaced in the
    namespace the clip reads, so the count is taken here)."""

    def update_(self, *args, **kwargs):
        self.released.append(self._below)
        return super().update_(*args, **kwargs)


def _released_counts(monkeypatch, slip):
    """The counts the private step releases when ``slip`` runs one step's loop body (nothing clipped: C = 1e6)."""
    torch.manual_seed(0)
    clip = _CountingClip(1e6, count_noise_multiplier=1.0)
    released = clip.released = []
    model = nn.Sequential(cl.InputNormClip(1.0), cl.LipschitzLinear(5, 3), clip)
    data = cl.ArrayDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model, opt, loader = cl.PrivacyEngine("rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=cl.TauCrossEntropy(),
        noise_multiplier=1.0, input_shape=(5,), batch_size=16.0)
    rows = slip(model, opt, iter(loader), lambda x, y: cl.TauCrossEntropy().per_example(model(x), y).sum())
    return released, rows


def _backward_discarded(model, opt, batches, loss):
    x, y = next(batches)
    opt.zero_grad()
    loss(x, y).backward()
    opt.zero_grad()  # a backward thrown away (a warm-up, a diagnostic): its gradient is not released
    loss(x, y).backward()
    opt.step()
    return len(x)


def _step_refused(model, opt, batches, loss):
    x, y = next(batches)
    opt.zero_grad()
    loss(x, y).backward()
    loss(x, y).backward()  # the batch twice: refused
    with pytest.raises(cl.BoundError):
        opt.step()
    x, y = next(batches)
    opt.zero_grad()
    loss(x, y).backward()
    opt.step()
    return len(x)


def _input_gradient_first(model, opt, batches, loss):
    x, y = next(batches)
    opt.zero_grad()
    xs = x.clone().requires_grad_(True)
    torch.autograd.grad(loss(xs, y), xs)  # a saliency map of the batch: reaches no weight, passes the clip
    loss(x, y).backward()
    opt.step()
    return len(x)


@pytest.mark.parametrize("slip", [_backward_discarded, _step_refused, _input_gradient_first])
def test_the_count_released_is_that_of_the_released_backward_alone(monkeypatch, slip):
    """The count was kept from every backward through the clip since the last release: one thrown away by
    zero_grad, one of a refused step's batch, or an input gradient counted each example a second time, and the
    released count had sensitivity 2 where the accountant composes 1. Now only the released backward counts."""
    released, rows = _released_counts(monkeypatch, slip)
    assert released == [rows]

def test_tightness_monitor_does_not_enter_the_count(monkeypatch):
    clip = cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=3.0)
    trainer = _trainer(clip, epochs=1, noise_multiplier=1.0, tightness_monitor=cl.diagnostics.TightnessMonitor(every=1, sample=4))
    seen = []
    original_update = cl.AdaptiveLossGradientClip.update_

    def update(self, expected_batch_size, generator=None):
        seen.append(self._below)
        return original_update(self, expected_batch_size, generator)

    monkeypatch.setattr(cl.AdaptiveLossGradientClip, "update_", update)  # a spy on the class, as above
    trainer.fit()
    # each count is at most the Poisson batch size, so the monitor's extra backward passes were left out
    assert max(seen) <= 128 * 1.6 and max(trainer.tightness_monitor.worst.values()) <= 1 + 1e-4


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=1.0, target_quantile=1.0)
    with pytest.raises(ValueError):
        cl.AdaptiveLossGradientClip(-1.0, count_noise_multiplier=1.0)


def test_cli_adaptive_clip(tmp_path):
    import json

    from clipless.cli import main

    out = tmp_path / "run"
    main(["train", "--epochs", "2", "--loss-grad-clip", "0.5", "--adaptive-clip-quantile", "0.6",
          "--count-noise-multiplier", "20", "--accountant", "rdp", "--output-dir", str(out), "--no-progress"])
    result = json.loads((out / "result.json").read_text())
    assert result["epsilon"] <= 3.0 + 1e-9
    assert result["effective_noise_multiplier"] < result["noise_multiplier"]  # the count shares the budget
    config = tmp_path / "no-clip.yaml"
    config.write_text("loss-grad-clip: null\n")  # the default clip is 0.25; a YAML null turns it off
    with pytest.raises(SystemExit, match="initial clip"):
        main(["train", "--config", str(config), "--adaptive-clip-quantile", "0.5", "--output-dir", str(out),
              "--no-progress"])
