"""Robustness certificates (checked by a PGD attack), membership-inference audits and the tightness monitor."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Subset

import clipless as cl
from clipless.privacy.certified import BoundError
from clipless.privacy.modules import LayerBound
from clipless.diagnostics.membership import (
    dp_advantage_bound,
    loss_threshold_attack,
    per_example_losses,
    shadow_model_attack,
)
from clipless.diagnostics.robustness import attack_radius_check, certified_accuracy, certified_radii
from clipless.data.datasets import ArrayDataset


def _digits_model(seed: int):
    data = cl.load_digits()
    torch.manual_seed(seed)
    model = cl.lipschitz_mlp((1, 8, 8), 10, hidden=(64,), input_clip=8.0)
    loss = cl.TauCrossEntropy(8.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = cl.BoundEngine(model, (1, 8, 8), 8.0, loss.lipschitz)
    x, y = data.train.features, data.train.labels
    for _ in range(15 * seed):  # seed 0: random orthogonal weights; others: trained (non-private) weights
        opt.zero_grad()
        loss.per_example(model(x), y).mean().backward()
        opt.step()
        engine.project_()
    return data, model, engine


@pytest.mark.parametrize("seed", [0, 2])
def test_no_attack_changes_a_prediction_within_its_certified_radius(seed: int) -> None:
    data, model, engine = _digits_model(seed)
    lip = engine.lipschitz_constant()
    x = data.test.features[:200]
    with torch.no_grad():
        _, radius = certified_radii(model(x), lip)
    # 1e-3 slack: at exactly the radius the attack can reach a zero margin (the certificate is tight for these
    # models), and float32 rounding of the forward pass then decides the tie.
    changed = attack_radius_check(model, x, radius * (1 - 1e-3), generator=torch.Generator().manual_seed(seed))
    assert not bool(changed.any())
    # and tight: just beyond the radius the attack flips many predictions
    flipped = attack_radius_check(model, x, radius * 1.05, generator=torch.Generator().manual_seed(1))
    assert float(flipped.double().mean()) > 0.2


def test_certified_accuracy_curve() -> None:
    data, model, engine = _digits_model(2)
    lip = engine.lipschitz_constant()
    curve = certified_accuracy(model, data.test, [0.0, 0.05, 0.1, 0.5, 1e6], lip)
    assert curve[0.0] == pytest.approx(cl.evaluate(model, data.test)["accuracy"] if isinstance(
        cl.evaluate(model, data.test), dict) else cl.evaluate(model, data.test))
    values = list(curve.values())
    assert values == sorted(values, reverse=True) and values[-1] == 0.0 and values[0] > 0.5
    with pytest.raises(ValueError, match="Lipschitz"):
        certified_radii(torch.zeros(2, 3), 0.0)


def test_single_logit_radius() -> None:
    preds, radius = certified_radii(torch.tensor([[2.0], [-0.5]]), 2.0)
    assert preds.tolist() == [1, 0] and radius.tolist() == [1.0, 0.25]


def test_dp_advantage_bound() -> None:
    assert dp_advantage_bound(0.0, 0.0) == 0.0
    assert dp_advantage_bound(1.0, 0.0) == pytest.approx((math.e - 1) / (math.e + 1))
    assert dp_advantage_bound(50.0, 1e-5) == 1.0
    with pytest.raises(ValueError):
        dp_advantage_bound(1.0, 1.0)


def test_loss_threshold_attack_extremes() -> None:
    perfect = loss_threshold_attack(torch.zeros(10), torch.ones(10))
    assert perfect == {"advantage": 1.0, "auroc": 1.0}
    gen = torch.Generator().manual_seed(0)
    same = loss_threshold_attack(torch.rand(2000, generator=gen), torch.rand(2000, generator=gen))
    assert abs(same["auroc"] - 0.5) < 0.05 and same["advantage"] < 0.08


def _overfit(data) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.stack([data[i][1] for i in range(len(data))])
    y = (y + (torch.arange(len(y)) % 3 == 0).long() * 3) % 10  # noisy labels make memorization visible
    data_noisy = ArrayDataset(x, y)
    for _ in range(120):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.noisy_data = data_noisy  # type: ignore[attr-defined]
    return model


def test_attacks_detect_an_overfit_model() -> None:
    data = cl.load_digits()
    pool = data.train
    members_raw, nonmembers_raw, shadow = Subset(pool, range(0, 200)), Subset(pool, range(200, 400)), Subset(pool, range(400, 1000))
    target = _overfit(members_raw)
    members = target.noisy_data
    nonmembers = _overfit(nonmembers_raw).noisy_data  # same label noise, not trained on by the target
    ce = lambda z, y: F.cross_entropy(z, y, reduction="none")  # noqa: E731
    threshold = loss_threshold_attack(per_example_losses(target, ce, members), per_example_losses(target, ce, nonmembers))
    assert threshold["auroc"] > 0.7 and threshold["advantage"] > 0.3
    shadow_noisy = _overfit(shadow).noisy_data
    result = shadow_model_attack(lambda d: _overfit(d), shadow_noisy, target, members, nonmembers, 10, num_shadows=2)
    assert result["auroc"] > 0.7


def _monitored_trainer(model, monitor, data, **kw):
    loss = cl.TauCrossEntropy(8.0)
    return cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), loss, data.train,
                             input_shape=data.input_shape, input_bound=8.0, batch_size=256, delta=1e-5, epochs=2,
                             noise_multiplier=1.0, noise_seed=0, progress=False, log=None, tightness_monitor=monitor,
                             **kw)


def test_tightness_monitor_passes_a_sound_model_and_records_ratios():
    data = cl.load_digits()
    monitor = cl.diagnostics.TightnessMonitor(every=3, sample=4)
    trainer = _monitored_trainer(cl.lipschitz_mlp(data.input_shape, 10, hidden=(32,)), monitor, data,
                                 log_train_stats=True)
    result = trainer.fit()
    assert set(monitor.worst) == {"1", "3"}  # the two dense layers
    assert 0.05 < max(monitor.worst.values()) <= 1.0 + 1e-4
    # measured on training examples without noise: only on request, and labelled
    assert result.history[-1]["nonprivate_max_tightness"] == max(monitor.worst.values())


def test_tightness_monitor_checks_an_empty_poisson_batch():
    """A Poisson batch can be empty: the monitor has nothing to compare and must neither crash nor record a
    ratio above 0 (it crashed on max() of no norms when such a batch fell on a check step)."""
    model = cl.lipschitz_mlp((6,), 3, hidden=(8,))
    loss = cl.TauCrossEntropy(2.0)
    report = cl.BoundEngine(model, (6,), 1.0, loss.lipschitz).compute()
    monitor = cl.diagnostics.TightnessMonitor(every=1, sample=4)
    ratios = monitor.check(model, loss, torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), report, step=0)
    assert ratios and set(ratios.values()) == {0.0} and set(monitor.worst.values()) == {0.0}
    x = torch.randn(5, 6)
    ratios = monitor.check(model, loss, x / x.norm(dim=1, keepdim=True), torch.tensor([0, 1, 2, 0, 1]), report, 1)
    assert all(0.0 < r <= 1.0 + 1e-4 for r in ratios.values())  # a non-empty batch still measures


def test_tightness_monitor_stops_training_on_an_understated_bound():
    """A dense layer declaring a weight factor 10x too small: training stops before that step is released."""

    class Understated(cl.LipschitzLinear):
        def layer_bound(self, x_bound, in_shape):
            lb = super().layer_bound(x_bound, in_shape)
            return LayerBound(lb.lipschitz, lb.out_bound, {"weight": x_bound / 10})

    data = cl.load_digits()
    model = torch.nn.Sequential(torch.nn.Flatten(), Understated(64, 32), cl.MaxMin(), cl.LipschitzLinear(32, 10))
    trainer = _monitored_trainer(model, cl.diagnostics.TightnessMonitor(every=5, sample=8), data)
    with pytest.raises(BoundError, match="bound violated at step 0: .*layer '1'") as info:
        trainer.fit()
    assert trainer.steps == 0 and trainer.accountant.steps == 0
    assert not re.search(r"\d\.\d", str(info.value))  # the measured ratio (a training statistic) is not printed


@pytest.mark.parametrize("setting", [{"tol": float("nan")}, {"tol": -1.0}, {"every": 1.5}, {"every": True},
                                     {"sample": 0}])
def test_a_tightness_monitor_with_a_bad_setting_is_refused(setting) -> None:
    """``tol=NaN`` passed every ratio (no comparison with NaN is true), so the monitor never stopped a run: the
    check was off without a word.  A fractional or boolean ``every`` was truncated."""
    with pytest.raises(ValueError, match="must be"):
        cl.diagnostics.TightnessMonitor(**setting)
