"""Accountant: literal values, an independent RDP implementation, per-layer sigma_eff, calibration."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from hypothesis import given, settings
from hypothesis import strategies as st

import clipless as cl
from clipless.privacy.accounting import check_delta

SIGMA, Q, STEPS, DELTA = 1.1, 256 / 60000, 14062, 1e-5


def independent_rdp_epsilon(sigma: float, q: float, steps: int, delta: float, orders) -> float:
    """Poisson-subsampled Gaussian RDP at integer orders (Mironov et al. 2019, binomial expansion),
    converted with the bound of Balle et al. 2020 / Canonne et al. (as Opacus does). Written from the
    formulas, not from dp-accounting."""
    best = math.inf
    for a in orders:
        k = np.arange(a + 1)
        log_binom = np.array([math.lgamma(a + 1) - math.lgamma(i + 1) - math.lgamma(a - i + 1) for i in k])
        with np.errstate(divide="ignore"):
            terms = log_binom + (a - k) * np.log1p(-q) + k * np.log(q) + (k * k - k) / (2 * sigma**2)
        m = terms.max()
        rdp_a = steps * (m + math.log(np.exp(terms - m).sum())) / (a - 1)
        eps = rdp_a + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return best


def test_literal_reference_values():
    assert cl.compute_epsilon(SIGMA, Q, STEPS, DELTA, "rdp") == pytest.approx(2.5966, abs=1e-3)
    assert cl.compute_epsilon(SIGMA, Q, STEPS, DELTA, "pld") == pytest.approx(2.3817, abs=1e-3)


def test_rdp_matches_independent_implementation():
    orders = list(range(2, 129))
    ours = independent_rdp_epsilon(SIGMA, Q, STEPS, DELTA, orders)
    acc = rdp.RdpAccountant(orders=orders)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), STEPS))
    assert acc.get_epsilon(DELTA) == pytest.approx(ours, rel=1e-6)
    # fractional orders (dp-accounting default) can only help
    assert cl.compute_epsilon(SIGMA, Q, STEPS, DELTA, "rdp") <= ours + 1e-9


@pytest.mark.parametrize("sigma,q,steps", [(0.8, 0.01, 500), (2.0, 0.1, 200), (5.0, 0.5, 50)])
def test_rdp_independent_other_regimes(sigma, q, steps):
    orders = list(range(2, 257))
    acc = rdp.RdpAccountant(orders=orders)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    assert acc.get_epsilon(1e-5) == pytest.approx(independent_rdp_epsilon(sigma, q, steps, 1e-5, orders), rel=1e-6)


def test_pld_is_tighter_than_rdp_but_close():
    pld_eps = cl.compute_epsilon(1.0, 0.02, 1000, 1e-5, "pld")
    rdp_eps = cl.compute_epsilon(1.0, 0.02, 1000, 1e-5, "rdp")
    assert pld_eps <= rdp_eps and pld_eps > 0.7 * rdp_eps


@pytest.mark.parametrize("history", [
    [(6.355, 0.7126, 40)],
    [(0.9, 1.0, 30), (2.0, 0.05, 120)],
    [(1.1, 0.01, 5), (1.1, 0.02, 5), (1.1, 0.01, 7)],  # a (sigma, q) seen twice: its cached step PLD reused
])
def test_pld_epsilon_equals_dp_accountings_pld_accountant_exactly(history):
    """Each step's PLD is built once per (sigma, q) and reused; the epsilon must stay the PLDAccountant's, bit
    for bit, at every query (the per-epoch queries of a run grow the history one step at a time)."""
    acc = cl.PrivacyAccountant("pld")
    for sigma, q, steps in history:
        for _ in range(2):
            acc.step(sigma, q, steps)
            reference = dp_accounting.pld.PLDAccountant()
            reference.compose(acc.dp_event())
            for delta in (1e-5, 1e-8):
                assert acc.get_epsilon(delta) == reference.get_epsilon(delta)


def test_effective_sigma_rule_matches_nested_composition():
    sigmas = [1.5, 2.0, 3.0, 4.0]
    eff = cl.effective_noise_multiplier(sigmas)
    assert eff == pytest.approx(sum(s**-2 for s in sigmas) ** -0.5)
    assert cl.effective_noise_multiplier([2.0] * 4) == pytest.approx(1.0)  # sigma / sqrt(D)
    q, steps = 0.05, 300
    nested = rdp.RdpAccountant()
    nested.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(s) for s in sigmas])), steps))
    assert cl.compute_epsilon(eff, q, steps, 1e-5, "rdp") == pytest.approx(nested.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_calibration_round_trip(accountant):
    q, steps, target = 0.01, 2000, 1.5
    sigma = cl.calibrate_noise_multiplier(target, 1e-5, q, steps, accountant, tol=1e-3)
    eps = cl.compute_epsilon(sigma, q, steps, 1e-5, accountant)
    assert eps <= target  # never above target (spec §6)
    assert eps >= target * 0.99
    assert cl.compute_epsilon(sigma * 0.995, q, steps, 1e-5, accountant) > target * 0.999


@settings(max_examples=200, deadline=None)
@given(c=st.floats(0.01, 100.0), k=st.floats(0.3, 4.0), c2=st.floats(0.0, 50.0), target=st.floats(0.05, 50.0),
       floor=st.sampled_from([0.0, 0.2]), jump=st.floats(0.0, 3.0), tol=st.sampled_from([1e-3, 1e-2]))
def test_calibration_search_returns_a_feasible_sigma_within_tol_of_the_smallest(c, k, c2, target, floor, jump, tol):
    """The search behind calibrate_noise_multiplier against epsilons whose smallest feasible sigma is known:
    smooth power laws, a second power (curvature), a jump (RDP's minimum over orders is not smooth) and the PLD
    floor (infinite below it).  Whatever the aims, the answer is evaluated feasible and within tol of the root."""
    from clipless.privacy.accounting import _smallest_feasible

    def eps(x: float) -> float:
        if x < floor or x <= 0:
            return math.inf
        return c * x ** -k + c2 * x ** -2 + (jump if x < 1.3 else 0.0)

    lo, e_lo, hi = 0.0, math.inf, 1.0
    while not eps(hi) <= target:
        lo, e_lo, hi = hi, eps(hi), hi * 2.0
        if hi > 1e6:
            return  # no sigma reaches this target: calibrate_noise_multiplier raises there
    calls = []  # queries where epsilon is finite: those build a PLD (below the floor nothing is built)
    sigma = _smallest_feasible(lambda x: (x >= floor and calls.append(x)) or eps(x), target, lo, hi, e_lo, eps(hi),
                               tol, floor)
    assert eps(sigma) <= target  # feasible: never above the target
    # the smallest feasible sigma, by a bisection to far below tol
    a, b = lo, hi
    for _ in range(200):
        m = 0.5 * (a + b)
        a, b = (a, m) if eps(m) <= target else (m, b)
    assert sigma - b <= tol * sigma * (1 + 1e-9)
    # never worse than three queries per halving of the bracket (an aim that misses, then bisection's midpoint)
    assert len(calls) <= 3 * math.ceil(math.log2(max(hi - lo, 1e-12) / (tol * max(b, 1e-12)))) + 6


def test_calibration_takes_fewer_pld_builds_than_bisection(monkeypatch):
    """Each epsilon query at a new sigma builds a PLD (seconds each); the aimed search asks about half as often
    as the bisection it replaced (12 queries on this case)."""
    import clipless.privacy.accounting as acc

    asked = []
    real = acc.compute_epsilon
    monkeypatch.setattr(acc, "compute_epsilon", lambda s, *a: asked.append(s) or real(s, *a))
    sigma = acc.calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000, "pld")
    assert real(sigma, 0.01, 1000, 1e-5, "pld") <= 3.0 < real(sigma * (1 - 1e-3), 0.01, 1000, 1e-5, "pld")
    assert len(asked) <= 7


def test_steps_calibration_round_trip():
    q, sigma, target = 0.02, 1.2, 2.0
    steps = cl.calibrate_steps(target, 1e-5, q, sigma, "rdp")
    assert cl.compute_epsilon(sigma, q, steps, 1e-5, "rdp") <= target
    assert cl.compute_epsilon(sigma, q, steps + 1, 1e-5, "rdp") > target
    assert cl.calibrate_steps(1e-4, 1e-5, 0.5, 0.3, "rdp") == 0


@pytest.mark.parametrize("count", [-60, -1, 2.7, 0.5, True, float("nan"), float("inf"), "3", None])
def test_step_counts_are_whole_and_not_negative(count):
    """A negative count merged into the history took steps away (100 then -60 composed 40), 2.7 was truncated to 2,
    and a checkpoint's history with such a count loaded: each a silently low epsilon.  All are refused, live or
    loaded, and nothing is composed."""
    acc = cl.PrivacyAccountant("rdp")
    acc.step(1.0, 0.01, 100)
    with pytest.raises(ValueError, match="step count"):
        acc.step(1.0, 0.01, count)
    assert acc.history == [(1.0, 0.01, 100)]
    fresh = cl.PrivacyAccountant("pld")
    with pytest.raises(ValueError, match="step count"):
        fresh.load_state_dict({"mechanism": "pld", "history": [(1.0, 0.01, 100), (1.0, 0.01, count)]})
    assert fresh.steps == 0
    with pytest.raises(ValueError, match="step count"):
        cl.compute_epsilon(1.0, 0.01, count, 1e-5, "rdp")


def test_whole_step_counts_of_any_integer_type_compose():
    import numpy as np

    acc = cl.PrivacyAccountant("rdp")
    acc.step(1.0, 0.01, np.int64(5))
    acc.step(1.0, 0.01, 3.0)
    acc.step(1.0, 0.01, 0)  # nothing composed
    assert acc.history == [(1.0, 0.01, 8)]
    assert acc.get_epsilon(1e-5) == cl.compute_epsilon(1.0, 0.01, 8, 1e-5, "rdp")
    assert cl.compute_epsilon(1.0, 0.01, 0, 1e-5, "rdp") == 0.0


def test_steps_calibration_never_returns_an_unchecked_cap():
    """The answer under a cap ``max_steps`` is a count whose epsilon was checked: a cap between two doublings whose
    epsilon exceeds the target gives the largest feasible count below it, never the cap itself."""
    q, sigma, target = 0.02, 1.2, 2.0
    free = cl.calibrate_steps(target, 1e-5, q, sigma, "rdp")
    assert free > 8
    for cap in (free - 3, free, free + 1, 1):
        steps = cl.calibrate_steps(target, 1e-5, q, sigma, "rdp", max_steps=cap)
        assert steps == min(cap, free)
        assert cl.compute_epsilon(sigma, q, steps, 1e-5, "rdp") <= target
    top = 1 << (free.bit_length() - 1)  # the last doubling below the answer: a cap just above the answer's bracket
    assert cl.calibrate_steps(target, 1e-5, q, sigma, "rdp", max_steps=2 * top - 1) == min(2 * top - 1, free)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_steps"):
            cl.calibrate_steps(target, 1e-5, q, sigma, "rdp", max_steps=bad)


def test_accountant_history_and_state():
    acc = cl.PrivacyAccountant("rdp")
    assert acc.get_epsilon(1e-5) == 0.0
    for _ in range(100):
        acc.step(1.0, 0.01)
    acc.step(2.0, 0.01, steps=50)
    assert acc.history == [(1.0, 0.01, 100), (2.0, 0.01, 50)]
    clone = cl.PrivacyAccountant("pld")
    clone.load_state_dict(acc.state_dict())
    assert clone.mechanism == "rdp" and clone.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    expected = rdp.RdpAccountant()
    for s, n in [(1.0, 100), (2.0, 50)]:
        expected.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(s)), n)
    assert acc.get_epsilon(1e-5) == pytest.approx(expected.get_epsilon(1e-5), rel=1e-9)


def test_delta_must_be_below_one_over_n():
    check_delta(1e-5, 60000)
    with pytest.raises(ValueError, match="1/N"):
        check_delta(1e-3, 60000)
    with pytest.raises(ValueError):
        check_delta(0.0, 10)


def test_bad_arguments():
    with pytest.raises(ValueError):
        cl.PrivacyAccountant("moments")
    with pytest.raises(ValueError):
        cl.PrivacyAccountant().step(0.0, 0.1)
    with pytest.raises(ValueError):
        cl.PrivacyAccountant().step(1.0, 1.5)


def test_pld_refuses_noise_below_its_floor():
    """Below sigma 0.2 the PLD grid needs tens of GB (about 40 at sigma 0.01): a clear error, never a hang."""
    with pytest.raises(ValueError, match="below 0.2 .* use the rdp accountant"):
        cl.PrivacyAccountant("pld").step(0.01, 0.1)
    with pytest.raises(ValueError, match="below 0.2"):
        cl.compute_epsilon(0.1, 0.1, 10, 1e-5, "pld")
    assert cl.compute_epsilon(0.01, 0.1, 10, 1e-5, "rdp") > 100  # rdp answers, with a meaningless epsilon
    stored = cl.PrivacyAccountant("rdp")
    stored.step(0.01, 0.1, 5)
    tampered = {**stored.state_dict(), "mechanism": "pld"}
    target = cl.PrivacyAccountant("rdp")  # fresh: a state loads only into an accountant that composed nothing
    with pytest.raises(ValueError, match="below 0.2"):
        target.load_state_dict(tampered)
    assert target.mechanism == "rdp" and target.history == []  # a refused state leaves it untouched
    target.step(1.0, 0.1, 3)
    with pytest.raises(ValueError, match="already released 3 private step"):
        target.load_state_dict(stored.state_dict())
    assert target.mechanism == "rdp" and target.history == [(1.0, 0.1, 3)]


def test_pld_calibration_of_a_loose_target_stops_at_the_floor():
    """A target so loose that the best sigma is below the PLD floor: calibration returns the floor's side, within
    target, after one PLD build at the floor (the bisection before built one at each of 10 steps towards it, 50 s)."""
    from clipless.privacy.accounting import PLD_MIN_NOISE_MULTIPLIER, calibrate_noise_multiplier

    sigma = calibrate_noise_multiplier(500.0, 1e-5, 0.05, 3, "pld")
    assert PLD_MIN_NOISE_MULTIPLIER <= sigma <= PLD_MIN_NOISE_MULTIPLIER * 1.01
    assert cl.compute_epsilon(sigma, 0.05, 3, 1e-5, "pld") <= 500.0


def test_pld_refuses_a_delta_below_its_resolution_instead_of_calibrating_absurd_noise(tmp_path):
    """PLD's epsilon is infinite at delta <= 1e-15 (its tail truncation): calibration used to climb to sigma
    2878 and report epsilon 0.002 at delta 1e-16, a silently useless run.  Now a clear error; rdp answers."""
    from clipless.cli import main as cli_main
    from clipless.privacy.accounting import PLD_MIN_DELTA, calibrate_noise_multiplier

    with pytest.raises(ValueError, match="smallest delta the PLD accountant resolves.*rdp"):
        calibrate_noise_multiplier(3.0, 1e-16, 0.7, 1, "pld")
    with pytest.raises(ValueError, match="PLD accountant resolves"):
        cl.compute_epsilon(1.0, 0.5, 10, 1e-16, "pld")
    assert math.isfinite(cl.compute_epsilon(1.0, 0.5, 10, PLD_MIN_DELTA, "pld"))
    assert 1.5 < calibrate_noise_multiplier(3.0, 1e-16, 0.7, 1, "rdp") < 5
    for bad in (0.0, 1.0, -1e-5, float("nan")):
        with pytest.raises(ValueError, match="delta"):
            cl.compute_epsilon(1.0, 0.5, 10, bad, "rdp")
    out = tmp_path / "never"
    with pytest.raises(SystemExit, match="PLD accountant resolves"):
        cli_main(["train", "--delta", "1e-16", "--epochs", "1", "--no-progress", "--output-dir", str(out)])
    assert not out.exists()


def test_rdp_order_exclusions_are_not_logged_other_warnings_are(caplog):
    """dp-accounting logged one warning per non-converging fractional order per call (110 lines for one
    `clipless train --accountant rdp`); leaving an order out only raises epsilon, so those lines are dropped."""
    import logging

    with caplog.at_level(logging.WARNING):
        eps = cl.compute_epsilon(1.0, 1 / 6, 6, 1e-3, "rdp")
        logging.getLogger("absl").warning("another dp-accounting warning")
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "failed to converge" in m], messages
    assert "another dp-accounting warning" in messages
    assert eps == pytest.approx(cl.compute_epsilon(1.0, 1 / 6, 6, 1e-3, "rdp"))
    assert not logging.getLogger("absl").filters  # the filter is there only during the computation


@pytest.mark.parametrize("call", ["step_sigma", "step_rate", "rate_true", "epsilon_delta", "calibrate", "steps_nan",
                                  "sigma_inf"])
def test_the_accountants_entry_points_refuse_values_of_the_wrong_kind(call) -> None:
    """A string died with "'<' not supported between instances of 'int' and 'str'"; ``sample_rate=True`` was
    accounted as q = 1; ``calibrate_steps`` with a NaN target answered 0 steps without a word."""
    acc = cl.PrivacyAccountant("rdp")
    acc.step(1.0, 0.1)
    run = {"step_sigma": lambda: cl.PrivacyAccountant("pld").step("1", 0.1),
           "step_rate": lambda: cl.compute_epsilon(1.0, "0.1", 10, 1e-5),
           "rate_true": lambda: cl.PrivacyAccountant("rdp").step(1.0, True),
           "epsilon_delta": lambda: acc.get_epsilon("1e-5"),
           "calibrate": lambda: cl.calibrate_noise_multiplier("3", 1e-5, 0.01, 100),
           "steps_nan": lambda: cl.calibrate_steps(float("nan"), 1e-5, 0.01, 1.0),
           "sigma_inf": lambda: cl.PrivacyAccountant("rdp").step(float("inf"), 0.1)}[call]
    with pytest.raises(ValueError, match="must be"):
        run()


def test_the_accountants_mechanism_is_read_only():
    """``accountant.mechanism = "pld"`` on an RDP run's accountant was accepted: its epsilon changed (2.41 to 1.92
    here) under a budget planned with RDP, and a resume's check of the accountant compared the new name."""
    accountant = cl.PrivacyAccountant("rdp")
    accountant.step(1.0, 0.1, steps=2)
    before = accountant.get_epsilon(1e-5)
    with pytest.raises(AttributeError, match="PrivacyAccountant.mechanism is a declared constant"):
        accountant.mechanism = "pld"
    assert accountant.mechanism == "rdp" and accountant.get_epsilon(1e-5) == before
