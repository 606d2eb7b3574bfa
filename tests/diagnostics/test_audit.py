"""Empirical privacy audits (spec §9): the statistics keep their confidence, the step audit of the real
private step never contradicts a correct mechanism and catches deliberate bugs, the one-run and membership
audits turn guesses into sound lower bounds, and ``clipless audit`` writes what it says."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import binom
from torch import nn

from clipless.diagnostics.audit_stats import (
    clopper_pearson_upper,
    epsilon_from_error_rates,
    gdp_epsilon,
    gdp_mu_bounds,
    one_run_bound,
    one_run_epsilon_lower,
    one_run_guesses,
    one_run_p_value,
    threshold_epsilon_lower,
)
from clipless.diagnostics.membership import membership_audit
from clipless.diagnostics.one_run import loss_scores, mislabelled_canaries, one_run_audit
from clipless.diagnostics.step_audit import audit_step
from clipless.cli import main
from clipless.data.datasets import ArrayDataset, load_digits
from clipless.nn.layers import InputNormClip
from clipless.nn.linear import LipschitzLinear
from clipless.nn.losses import MulticlassKR
from clipless.nn.models import build_loss, build_model
from clipless.privacy.accounting import compute_epsilon
from clipless.privacy.modules import LayerBound

# -- statistics ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(0, 10), (3, 50), (49, 50), (500, 1000)])
def test_clopper_pearson_upper_is_the_exact_binomial_bound(k: int, n: int) -> None:
    upper = float(clopper_pearson_upper(k, n, 0.05))
    assert binom.cdf(k, n, upper) == pytest.approx(0.05, rel=1e-6)  # a larger rate makes k errors this unlikely
    assert float(clopper_pearson_upper(n, n, 0.05)) == 1.0


def test_epsilon_from_error_rates() -> None:
    assert float(epsilon_from_error_rates(0.5, 0.5, 0.0)) == 0.0
    assert float(epsilon_from_error_rates(0.1, 0.2, 0.0)) == pytest.approx(math.log(0.8 / 0.1))  # the larger side
    assert float(epsilon_from_error_rates(0.01, 0.5, 1e-5)) == pytest.approx(math.log((0.5 - 1e-5) / 0.01))


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 8.0])
def test_gdp_epsilon_equals_the_accountant_for_one_gaussian_step(sigma: float) -> None:
    # Two independent derivations: the closed form of mu-GDP and dp-accounting's PLD of one Gaussian step.
    assert gdp_epsilon(1.0 / sigma, 1e-5) == pytest.approx(compute_epsilon(sigma, 1.0, 1, 1e-5, "pld"), rel=2e-3)


def test_threshold_and_gdp_bounds_keep_their_confidence() -> None:
    """Under identical worlds (true epsilon 0) and a mu = 1 Gaussian pair, the bounds exceed the truth in at
    most about 1 - confidence of repeated audits."""
    rng = np.random.default_rng(0)
    true_eps = gdp_epsilon(1.0, 1e-5)
    over_null = over_gauss = over_mu = 0
    runs = 200
    for _ in range(runs):
        a, b = rng.normal(0, 1, 400), rng.normal(0, 1, 400)
        over_null += threshold_epsilon_lower(a, b, 1e-5, 0.9)["epsilon_lower"] > 0
        c = rng.normal(1, 1, 400)
        over_gauss += threshold_epsilon_lower(a, c, 1e-5, 0.9)["epsilon_lower"] > true_eps
        over_mu += gdp_mu_bounds(a, c, 0.9)[1] > 1.0
    assert over_null <= 0.1 * runs + 10 and over_gauss <= 0.1 * runs + 10 and over_mu <= 0.1 * runs + 10


def test_threshold_test_finds_a_real_difference() -> None:
    rng = np.random.default_rng(1)
    far = threshold_epsilon_lower(rng.normal(0, 1, 5000), rng.normal(4, 1, 5000), 1e-5, 0.95)
    assert far["epsilon_lower"] > 3.0
    assert far["epsilon_lower"] <= gdp_epsilon(4.0, 1e-5)


def test_one_run_p_value_and_bound() -> None:
    assert one_run_p_value(100, 50, 40, 0.5, 0.0) == pytest.approx(binom.sf(39, 50, 1 / (1 + math.exp(-0.5))))
    assert one_run_p_value(100, 50, 40, 0.5, 1e-5) > one_run_p_value(100, 50, 40, 0.5, 0.0)
    # 100 correct guesses out of 100: p^100 <= 0.05 gives eps <= log(p / (1 - p)) with p = 0.05^(1/100)
    p = 0.05 ** (1 / 100)
    assert one_run_epsilon_lower(1000, 100, 100, 0.0, 0.95) == pytest.approx(math.log(p / (1 - p)), rel=1e-4)
    assert one_run_epsilon_lower(1000, 100, 100, 1e-5, 0.95) <= one_run_epsilon_lower(1000, 100, 100, 0.0, 0.95)
    assert one_run_epsilon_lower(1000, 100, 50, 1e-5, 0.95) == 0.0
    assert one_run_guesses([3.0, 2.0, 1.0, 0.0], [True, False, True, False], 1, 1) == (2, 2)
    assert one_run_guesses([3.0, 2.0, 1.0, 0.0], [False, True, True, True], 2, 1) == (3, 1)


def test_one_run_bound_is_sound_for_randomized_response() -> None:
    """Each canary's score is an eps-DP randomized response of its coin: the bound rarely exceeds eps."""
    rng = np.random.default_rng(2)
    eps, runs, over, reached = 1.0, 60, 0, []
    for _ in range(runs):
        coins = rng.random(1000) < 0.5
        keep = rng.random(1000) < math.exp(eps) / (1 + math.exp(eps))
        scores = np.where(keep, coins, ~coins) + rng.random(1000) * 1e-3
        bound = one_run_bound(scores, coins, 1e-5, 0.95)["epsilon_lower"]
        over += bound > eps
        reached.append(bound)
    assert over <= 0.05 * runs + 3
    assert np.median(reached) > 0.5  # and it is not vacuous


def test_membership_audit() -> None:
    perfect = membership_audit(np.arange(200.0) + 1000, np.arange(200.0), 1e-5, 0.95, epsilon_claimed=1.0)
    assert perfect.epsilon_lower > 2.0 and perfect.verdict == "VIOLATION"
    assert perfect.details["advantage"] == 1.0
    rng = np.random.default_rng(3)
    same = membership_audit(rng.normal(size=300), rng.normal(size=300), 1e-5, 0.95, epsilon_claimed=1.0)
    assert same.epsilon_lower < 1.0 and same.verdict == "consistent"


# -- white-box step audit of the real private step ----------------------------------------------------------

DIGITS = (1, 8, 8)
BUILDERS = {"mlp": {"hidden": [64]}, "cnn": {"channels": [8, 16]}, "vgg": {"channels": [8, 16]},
            "resnet": {"channels": [8, 16]}, "mixer": {"channels": 16, "patch_size": 4}}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_step_audit_never_contradicts_a_builder(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, DIGITS, 10, **BUILDERS[name])
    result = audit_step(model, build_loss("tau_ce", 10, tau=8.0), input_shape=DIGITS, input_bound=8.0,
                        noise_multiplier=1.0, trials=150, noise_seed=0)
    assert result.epsilon_claimed == pytest.approx(compute_epsilon(1.0, 1.0, 1, 1e-5))
    assert 0 < result.details["canary_bound_ratio"] <= 1 + 1e-5
    assert result.epsilon_lower <= result.epsilon_claimed and result.verdict == "consistent"


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return build_model("mlp", DIGITS, 10, hidden=[64])


def test_step_audit_is_tight_when_the_canary_reaches_its_bound() -> None:
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    result = audit_step(model, build_loss("tau_ce", 10, tau=8.0), input_shape=DIGITS, input_bound=8.0,
                        noise_multiplier=1.0, trials=600, noise_seed=1)
    assert result.details["canary_bound_ratio"] > 0.99  # the crafted canary attains the certified bound
    assert abs(result.details["mu_estimate"] - result.details["mu_planned"]) < 0.25
    assert 0.6 * result.epsilon_claimed < result.epsilon_lower <= result.epsilon_claimed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the audit works on a copy


def test_step_audit_catches_too_little_noise() -> None:
    result = audit_step(_mlp(), build_loss("tau_ce", 10, tau=8.0), input_shape=DIGITS, input_bound=8.0,
                        noise_multiplier=4.0, trials=200, noise_scale=0.2, noise_seed=2)
    assert result.verdict == "VIOLATION" and result.epsilon_lower > 2 * result.epsilon_claimed


class HalfDeclaredLinear(LipschitzLinear):
    """A layer that declares half its true per-example gradient factor (a bound bug)."""

    def layer_bound(self, x_bound, in_shape):
        true = super().layer_bound(x_bound, in_shape)
        return LayerBound(lipschitz=true.lipschitz, out_bound=true.out_bound,
                          param_factors={k: v / 2 for k, v in true.param_factors.items()})


@pytest.mark.parametrize("layer,expect", [(LipschitzLinear, "consistent"), (HalfDeclaredLinear, "VIOLATION")])
def test_step_audit_catches_an_understated_constant(layer, expect: str) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(InputNormClip(1.0), layer(16, 4))
    result = audit_step(model, MulticlassKR(4), input_shape=(16,), noise_multiplier=2.0, trials=300, noise_seed=3)
    assert result.verdict == expect
    if expect == "VIOLATION":
        assert result.details["canary_bound_ratio"] == pytest.approx(2.0, rel=1e-3)


def test_step_audit_of_the_subsampled_and_per_layer_steps() -> None:
    result = audit_step(_mlp(), build_loss("tau_ce", 10, tau=8.0), input_shape=DIGITS, input_bound=8.0,
                        noise_multiplier=1.0, sample_rate=0.25, strategy="per_layer", trials=300, noise_seed=4)
    assert result.epsilon_claimed == pytest.approx(compute_epsilon(1.0, 0.25, 1, 1e-5), rel=1e-6)
    assert result.verdict == "consistent" and "epsilon_lower_gdp" not in result.details


def test_step_audit_refuses_bad_settings() -> None:
    kwargs = dict(input_shape=DIGITS, input_bound=8.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="trials"):
        audit_step(_mlp(), build_loss("tau_ce", 10), trials=2, **kwargs)
    with pytest.raises(ValueError, match="noise_scale"):
        audit_step(_mlp(), build_loss("tau_ce", 10), trials=10, noise_scale=-1.0, **kwargs)
    with pytest.raises(ValueError, match="sample_rate"):
        audit_step(_mlp(), build_loss("tau_ce", 10), trials=10, sample_rate=0.0, **kwargs)


# -- one-run audit ------------------------------------------------------------------------------------------


def test_one_run_audit_sees_memorisation_and_canaries_are_well_formed() -> None:
    data = load_digits().train
    rest, cx, cy = mislabelled_canaries(data, 300, 10, torch.Generator().manual_seed(0))
    assert len(rest) == len(data) - 300 and len(cx) == 300
    seen = {tuple(r.tolist()) for r in data.features.flatten(1)}
    assert all(tuple(r.tolist()) in seen for r in cx.flatten(1))
    originals = {tuple(r.tolist()): int(y) for r, y in zip(data.features.flatten(1), data.labels)}
    assert all(originals[tuple(r.tolist())] != int(y) for r, y in zip(cx.flatten(1), cy))  # every label is wrong

    class Lookup(nn.Module):  # a non-private "training" that memorises its records exactly
        def __init__(self, train_set: ArrayDataset) -> None:
            super().__init__()
            self.known = {tuple(r.tolist()) for r in train_set.features.flatten(1)}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hit = torch.tensor([tuple(r.tolist()) in self.known for r in x.flatten(1)], dtype=torch.float64)
            return hit[:, None].repeat(1, 10)

    result = one_run_audit(lambda ds: (Lookup(ds), 1.0), rest, (cx, cy), lambda m, x, y: m(x)[:, 0],
                           delta=1e-5, confidence=0.95, seed=0)
    assert result.verdict == "VIOLATION" and result.epsilon_lower > 3.0
    assert result.details["canaries_included"] + len(result.scores_out) == 300


def test_mislabelled_canaries_refuse_too_many() -> None:
    with pytest.raises(ValueError, match="canaries"):
        mislabelled_canaries(load_digits().train, 10_000, 10)
    with pytest.raises(ValueError, match="number of classes of mislabelled canaries must be an integer >= 2"):
        mislabelled_canaries(load_digits().train, 10, 1)


def test_loss_scores_are_minus_the_loss() -> None:
    torch.manual_seed(0)
    model, loss = build_model("mlp", DIGITS, 10, hidden=[16]), build_loss("tau_ce", 10)
    x, y = torch.rand(5, *DIGITS), torch.arange(5)
    with torch.no_grad():
        assert torch.allclose(loss_scores(model, loss, x, y), -loss.per_example(model(x), y).double())


# -- command line -------------------------------------------------------------------------------------------


def test_cli_step_audit_writes_audit_json_and_plot(tmp_path, capsys) -> None:
    # A correct step is reported as a violation in up to 1 - confidence of audits (about 1% here, see
    # test_threshold_and_gdp_bounds_keep_their_confidence): the verdict is asserted on a seeded audit.
    assert main(["audit", "--trials", "200", "--noise-seed", "0", "--output-dir", str(tmp_path),
                 "--no-progress"]) == 0
    line = capsys.readouterr().out
    record = json.loads((tmp_path / "audit.json").read_text())
    for key in ("epsilon_claimed", "epsilon_lower", "confidence", "mode", "trials", "verdict"):
        assert key in record
    assert record["mode"] == "step" and record["trials"] == 200 and record["verdict"] == "consistent"
    assert "consistent" in line and (tmp_path / "audit.png").stat().st_size > 0
    assert record["private"] is False and record["randomness"] != "os-entropy"


def test_cli_step_audit_draws_secret_noise_by_default(tmp_path, capsys) -> None:
    assert main(["audit", "--trials", "50", "--output-dir", str(tmp_path), "--no-progress"]) == 0
    record = json.loads((tmp_path / "audit.json").read_text())
    assert record["private"] is True and record["randomness"] == "os-entropy"
    assert record["verdict"] in capsys.readouterr().out
    figure = (tmp_path / "audit.png").read_bytes()
    assert main(["audit", "--trials", "50", "--output-dir", str(tmp_path), "--no-progress"]) == 0
    (kept,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # the first audit's files, moved aside by the second
    assert json.loads((kept / "audit.json").read_text()) == record and (kept / "audit.png").read_bytes() == figure


def test_cli_audit_catches_a_noise_bug(tmp_path, capsys) -> None:
    """The main job's configuration with 0.2 x its planned noise: the audit reports the violation."""
    assert main(["audit", "--trials", "300", "--noise-scale", "0.2", "--output-dir", str(tmp_path),
                 "--no-progress"]) == 0
    record = json.loads((tmp_path / "audit.json").read_text())
    assert record["epsilon_lower"] > record["epsilon_claimed"] and record["verdict"] == "VIOLATION"
    out = capsys.readouterr().out
    assert "VIOLATION" in out and "up to 5% of audits" in out and "diagnostic" in record


def test_cli_one_run_audit(tmp_path, capsys) -> None:
    assert main(["audit", "--mode", "one-run", "--trials", "100", "--epochs", "3", "--output-dir", str(tmp_path),
                 "--no-progress"]) == 0
    record = json.loads((tmp_path / "audit.json").read_text())
    assert record["mode"] == "one-run" and record["canaries"] == 100 and record["verdict"] == "consistent"
    assert record["epsilon_claimed"] <= 3.0 + 1e-9
    # the canaries are training records scored without noise: the audit's files are labelled non-private
    assert record["private"] is False and "training records" in record["privacy_note"]
    assert "NOT PRIVATE: the canaries are training records" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [
    (["--confidence", "1.5"], "confidence"),
    (["--method", "dpsgd"], "clipless"),
    (["--trials", "3"], "trials"),
    (["--noise-scale", "0"], "noise-scale"),
    (["--mode", "one-run", "--trials", "5000"], "canaries"),
])
def test_cli_audit_refuses_bad_options(tmp_path, argv, match) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["audit", "--output-dir", str(tmp_path), "--no-progress", *argv])
    assert not (tmp_path / "audit.json").exists()
