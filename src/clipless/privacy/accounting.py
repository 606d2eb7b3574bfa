"""Privacy accounting for Poisson-subsampled Gaussian steps (spec §1, §3.4), on ``dp-accounting``.

A step releases the noisy sum of per-example gradients of a Poisson batch
(rate ``q``) under add/remove-one neighbours: a ``PoissonSampled(Gaussian(sigma_eff))``
event.  Per-layer noise with multipliers ``sigma_d`` on the same batch is one
Gaussian mechanism with ``sigma_eff = (sum_d sigma_d^-2)^-1/2``.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import dp_accounting
from dp_accounting import pld, rdp

from .certified import BoundError, DeclaredConstants, is_real, is_whole, whole_number

__all__ = [
    "bind_accountant",
    "check_nothing_released",
    "PrivacyAccountant",
    "effective_noise_multiplier",
    "gradient_noise_multiplier",
    "compute_epsilon",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "check_delta",
    "check_accounted_steps",
    "check_composed_at",
    "check_composed_",
    "extended_history",
    "check_released_steps_",
    "check_positive_finite",
]

ACCOUNTANTS = ("pld", "rdp")


def effective_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
    """``sigma_eff = (sum_d sigma_d^-2)^(-1/2)``: Gaussian mechanisms on one batch composed (spec §3.4)."""
    if len(noise_multipliers) == 0:
        raise ValueError("no noise multipliers given")
    if any(not (s > 0) for s in noise_multipliers):
        raise ValueError(f"noise multipliers must be positive, got {list(noise_multipliers)}")
    return sum(s**-2 for s in noise_multipliers) ** -0.5


def gradient_noise_multiplier(step_sigma: float, other_sigmas: Sequence[float]) -> float:
    """The ``sigma`` left for the gradient when other Gaussian mechanisms share the step (inverse of the rule above).

    ``sigma^-2 = sigma_eff^-2 - sum_k sigma_k^-2``; raises when the others alone already exceed the budget.
    """
    rest = step_sigma**-2 - sum(s**-2 for s in other_sigmas)
    if not rest > 0:
        raise ValueError(
            f"the other mechanisms of the step (noise multipliers {list(other_sigmas)}) already spend the whole "
            f"budget of sigma_eff={step_sigma:.4g}: raise their noise multipliers"
        )
    return rest**-0.5


def check_delta(delta: float, dataset_size: int) -> None:
    """Refuse ``delta`` outside ``(0, 1/N)``: larger deltas permit releasing a record outright."""
    if not is_real(delta) or not (0 < delta < 1.0 / dataset_size):
        raise ValueError(
            f"delta={delta} must satisfy 0 < delta < 1/N = {1.0 / dataset_size:.3g} for a dataset of "
            f"N={dataset_size} records"
        )


def _new_accountant(kind: str) -> dp_accounting.PrivacyAccountant:
    if kind == "pld":
        return pld.PLDAccountant()
    if kind == "rdp":
        return rdp.RdpAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {kind!r}")


# dp-accounting's PLDAccountant defaults, which the cached composition below reproduces operation for operation.
_PLD_GRID = 1e-4
_ADD_OR_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


@functools.lru_cache(maxsize=32)
def _step_pld(noise_multiplier: float, sample_rate: float) -> Any:
    """One Poisson-subsampled Gaussian step's PLD, as dp-accounting's PLDAccountant builds it.  Building it is
    most of an epsilon query's time (about 0.15 s), so it is built once per ``(sigma, q)``, not at every query."""
    return pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, value_discretization_interval=_PLD_GRID, sampling_prob=sample_rate,
        neighboring_relation=_ADD_OR_REMOVE)


# dp_accounting's PLD grid of privacy-loss values grows like 1/sigma^2 (measured here: 19 s and 0.85 GB at sigma 0.1,
# about 40 GB at 0.01).  Below this floor the PLD accountant refuses, and calibration never proposes such a sigma.
PLD_MIN_NOISE_MULTIPLIER = 0.2


def _check_pld_noise(noise_multiplier: float) -> None:
    if noise_multiplier < PLD_MIN_NOISE_MULTIPLIER:
        raise ValueError(
            f"noise multiplier {noise_multiplier:g} is below {PLD_MIN_NOISE_MULTIPLIER} (sigma_eff of the step), where "
            "the PLD accountant's grid needs tens of GB; use the rdp accountant for so little noise (its epsilon "
            "there is large: such a run is not meaningfully private)")


# dp_accounting's PLD truncates each step's privacy-loss tails at a mass of about 1e-15 (pessimistically), so its
# epsilon is infinite for any delta at or below that: measured, finite at 3e-15 and infinite at 1e-15 for every
# sigma in 0.3-10, q in 1e-3-1 and 1-3000 steps.  Calibration would then climb to an absurd sigma and report a
# tiny epsilon; below this floor the PLD accountant refuses instead.
PLD_MIN_DELTA = 1e-14


def _check_delta_resolvable(mechanism: str, delta: float) -> None:
    if not is_real(delta) or not 0 < delta < 1:
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    if mechanism == "pld" and delta < PLD_MIN_DELTA:
        raise ValueError(f"delta={delta:g} is below {PLD_MIN_DELTA:g}, the smallest delta the PLD accountant resolves "
                         "(it truncates privacy-loss tails of mass about 1e-15, so its epsilon there is infinite); "
                         "use the rdp accountant for so small a delta")


def check_positive_finite(value: Any, what: str) -> float:
    """A noise multiplier or an epsilon as a float: ``True`` would read as 1, NaN fails every comparison (so every
    check after it), and a string compares with nothing."""
    if not is_real(value) or not 0 < value < math.inf:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _check_rate(sample_rate: Any) -> None:
    if not is_real(sample_rate) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate!r}")


def _step_count(steps: Any) -> int:
    """A number of composed steps: a whole number >= 0.  ``int()`` would truncate 2.7 to 2 and a negative count
    merged into the history would take steps away, each a silently low epsilon."""
    if not is_real(steps) or not (is_whole(steps) or float(steps).is_integer()) or steps < 0:
        raise ValueError(f"a step count must be a whole number >= 0, got {steps!r}")
    return int(steps)


def _step_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    _check_rate(sample_rate)
    check_positive_finite(noise_multiplier, "noise multiplier")
    event = dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.SelfComposedDpEvent(event, int(steps))


@dataclass(frozen=True)
class _Entry:  # frozen, in a tuple: the history changes only by step() and load_state_dict(), never in place
    noise_multiplier: float
    sample_rate: float
    steps: int


def check_accounted_steps(accountant_state: Dict[str, Any], steps: Any, path: Any,
                          mechanism: Optional[Tuple[float, float]] = None) -> None:
    """A checkpoint's accountant must have composed exactly the steps its run released: fewer would
    under-report epsilon from the resumed run on.  ``mechanism``: the ``(noise multiplier, sample rate)`` that
    every step of the run composes (its noise plan's): a history holding steps at another (a larger multiplier, a
    smaller rate) would report a lower epsilon for the same steps."""
    accountant = _loaded(accountant_state)
    if not is_whole(steps) or accountant.steps != steps:
        raise ValueError(f"checkpoint {path}: its accountant composed {accountant.steps} steps but the run records "
                         f"{steps!r} released steps; resume from an intact checkpoint or restart training")
    if mechanism is not None:
        _check_history_at(accountant.history, mechanism, f"checkpoint {path}",
                          "its epsilon would not be that of the steps released; resume from an intact checkpoint")


def _loaded(accountant_state: Dict[str, Any]) -> "PrivacyAccountant":
    """A saved accountant state, validated as live steps are (a stored history is an untrusted claim)."""
    accountant = PrivacyAccountant(accountant_state.get("mechanism", "pld"))
    accountant.load_state_dict(accountant_state)
    return accountant


def check_composed_at(accountant_state: Dict[str, Any], mechanism: Tuple[float, float], what: str, fix: str) -> None:
    """Every step of a saved accountant history composed at ``mechanism``, the ``(noise multiplier, sample rate)``
    of the run that resumes it: a budget counted in steps of its plan (``NoisePlan.max_steps``) holds only for
    steps at that plan's mechanism, and a run's config names its mechanism for all of its steps."""
    _check_history_at(_loaded(accountant_state).history, mechanism, what, fix)


def _check_history_at(history: Sequence[tuple], mechanism: Tuple[float, float], what: str, fix: str) -> None:
    sigma_plan, rate_plan = float(mechanism[0]), float(mechanism[1])
    for sigma, rate, count in history:
        if (sigma, rate) != (sigma_plan, rate_plan):
            raise ValueError(f"{what}: its accountant composed {count} step(s) at noise multiplier {sigma!r} and "
                             f"sample rate {rate!r}, where every step of this run has {sigma_plan!r} and "
                             f"{rate_plan!r} (its noise plan): {fix}")


def check_released_steps_(accountant: "PrivacyAccountant", released: Sequence[tuple]) -> None:
    """Refuse a step where ``accountant`` no longer holds ``released``, the history its releases composed (an entry
    removed or rewritten outside :meth:`PrivacyAccountant.step`): epsilon would be under-reported and a budget
    counted in its steps overspent.  The history is put back first."""
    if accountant.holds(released):
        return
    now = accountant.steps
    accountant.put_back_(released)
    raise BoundError(f"the accountant no longer holds the steps released so far (it held {now} step(s), the "
                     f"releases composed {accountant.steps}; an entry removed or rewritten outside its step): epsilon "
                     "would be under-reported and the budget overspent; its history was put back. Only the private "
                     "step composes steps")


def check_nothing_released(released_steps: int, what: str) -> None:
    """A saved state loads only into a run that has released nothing yet: loaded later, it rolls the run back
    (the restored noise stream repeats the noise of steps already released, the accountant forgets them)."""
    if released_steps > 0:
        raise ValueError(f"{what} has already released {released_steps} private step(s): loading a saved state "
                         "would roll them back (the restored noise stream would draw their noise again, and the "
                         "accountant would forget them); resume into a new run")


# The accountant that composes the private steps a model (or encoder) has released, kept on the module itself so that
# it travels with it (a copy of the model carries a copy of its history).
_ACCOUNTANT_ATTR = "_clipless_privacy_accountant"


def bind_accountant(model: Any, accountant: "PrivacyAccountant") -> None:
    """Record that ``accountant`` composes every private step released on ``model`` from now on; refuse when another
    accountant has already composed steps on it.  A second engine's fresh accountant would report the epsilon of
    its own steps only, while the model also carries the earlier ones."""
    previous = getattr(model, _ACCOUNTANT_ATTR, None)
    if previous is not None and previous is not accountant and previous.steps > 0:
        raise ValueError(f"this model has already released {previous.steps} private step(s) composed by another "
                         "accountant: a new one would report the epsilon of its own steps only. Make it private again "
                         "through the same PrivacyEngine (its accountant goes on composing), resume a fresh model "
                         "from the run's checkpoint (its accountant state is restored), or start from a model never "
                         "trained on the data")
    object.__setattr__(model, _ACCOUNTANT_ATTR, accountant)


def _quiet_excluded_orders(record: logging.LogRecord) -> bool:
    """dp-accounting's RDP leaves out a fractional order whose series does not converge, which can only raise
    epsilon (the minimum is then over fewer orders), and logs a warning per order and call: 110 lines for one
    `clipless train --accountant rdp`.  Those lines are dropped; every other message of its logger is kept."""
    return "failed to converge" not in record.getMessage()


def extended_history(history: Sequence[tuple], noise_multiplier: float, sample_rate: float,
                     steps: int = 1) -> List[tuple]:
    """``history`` (``(noise_multiplier, sample_rate, steps)`` entries) after ``steps`` more steps, as
    :meth:`PrivacyAccountant.step` extends it: consecutive steps of one mechanism merged into one entry."""
    out = [tuple(e) for e in history]
    if out and out[-1][0] == noise_multiplier and out[-1][1] == sample_rate:
        out[-1] = (out[-1][0], out[-1][1], out[-1][2] + steps)
    else:
        out.append((float(noise_multiplier), float(sample_rate), int(steps)))
    return out


def check_composed_(accountant: "PrivacyAccountant", expected: Sequence[tuple]) -> None:
    """Refuse a step that ``accountant`` did not compose as planned (its history is not ``expected``, what the
    planned step makes of the history before it), and put ``expected`` back: a ``step`` replaced on the accountant,
    or a subclass's, would otherwise release the step without its epsilon."""
    if accountant.history == [tuple(e) for e in expected] and not _own_methods(accountant):
        return
    PrivacyAccountant.put_back_(accountant, expected)
    raise BoundError("the accountant did not compose the released step as planned (a method replaced on it, e.g. "
                     "accountant.step = ...): its epsilon would leave the step out; the step was accounted and "
                     "refused. Only PrivacyAccountant's own methods compose steps")


def _own_methods(accountant: "PrivacyAccountant") -> List[str]:
    """Methods set on the accountant instance (``accountant.get_epsilon = ...``), which its class never has."""
    return sorted(k for k, v in vars(accountant).items() if callable(v))


class PrivacyAccountant(DeclaredConstants):
    """Composes Poisson-subsampled Gaussian steps; ``get_epsilon(delta)`` like Opacus.

    ``history`` is a list of ``(noise_multiplier, sample_rate, steps)``;
    consecutive identical steps are merged, so PLD composition stays fast.
    """

    constants = ("mechanism",)  # the run's budget was planned with it (a resume checks it)

    def __setattr__(self, name: str, value: Any) -> None:
        if callable(value):  # a method set on the instance would compose or report other than its class
            raise AttributeError(f"PrivacyAccountant.{name}: the accountant's methods are its class's; an "
                                 "accountant that composes or reports otherwise would leave epsilon wrong")
        super().__setattr__(name, value)

    def __init__(self, mechanism: str = "pld") -> None:
        _new_accountant(mechanism)  # validates the name
        self.mechanism = mechanism
        self._history: Tuple[_Entry, ...] = ()

    @property
    def history(self) -> List[tuple]:
        return [(e.noise_multiplier, e.sample_rate, e.steps) for e in self._history]

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self._history)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        steps = _step_count(steps)
        _step_event(noise_multiplier, sample_rate, steps)  # validates the rate and the multiplier
        if self.mechanism == "pld":
            _check_pld_noise(noise_multiplier)
        if steps == 0:
            return
        self._history = tuple(_Entry(float(s), float(q), int(n))
                              for s, q, n in extended_history(self.history, noise_multiplier, sample_rate, steps))

    def holds(self, earlier: Sequence[tuple]) -> bool:
        """Whether this history still holds every step of ``earlier`` (an earlier value of :attr:`history`) as
        :meth:`step` extends it: the same entries, the last one's count grown, then new entries."""
        now, earlier = self.history, [tuple(e) for e in earlier]
        if not earlier:
            return True
        k = len(earlier) - 1
        return (len(now) > k and now[:k] == earlier[:k] and now[k][:2] == earlier[k][:2]
                and now[k][2] >= earlier[k][2])

    def put_back_(self, earlier: Sequence[tuple]) -> None:
        """Make the history ``earlier`` again (what a check that saw steps removed or rewritten restores)."""
        self._history = tuple(_Entry(float(s), float(q), int(n)) for s, q, n in earlier)

    def dp_event(self) -> dp_accounting.DpEvent:
        return dp_accounting.ComposedDpEvent(
            [_step_event(e.noise_multiplier, e.sample_rate, e.steps) for e in self._history]
        )

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of everything composed so far at ``delta`` (0 before any step)."""
        _check_delta_resolvable(self.mechanism, delta)
        if not self._history:
            return 0.0
        if self.mechanism == "pld":  # PLDAccountant.compose(self.dp_event()), with each step's PLD cached
            total = pld.privacy_loss_distribution.identity(value_discretization_interval=_PLD_GRID)
            for e in self._history:
                total = total.compose(_step_pld(e.noise_multiplier, e.sample_rate).self_compose(e.steps))
            return float(total.get_epsilon_for_delta(delta))
        accountant = _new_accountant(self.mechanism)
        absl = logging.getLogger("absl")
        absl.addFilter(_quiet_excluded_orders)
        try:
            accountant.compose(self.dp_event())
            return float(accountant.get_epsilon(delta))
        finally:
            absl.removeFilter(_quiet_excluded_orders)

    def state_dict(self) -> Dict[str, Any]:
        return {"mechanism": self.mechanism, "history": self.history}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or "history" not in state or "mechanism" not in state:
            raise ValueError("accountant state must contain 'mechanism' and 'history'")
        check_nothing_released(self.steps, "this accountant")
        loaded = PrivacyAccountant(state["mechanism"])
        for s, q, n in state["history"]:  # validated like live steps: a stored history is an untrusted claim
            loaded.step(float(s), float(q), n)
        # all or nothing; an accountant that has composed nothing takes the saved state's mechanism (the one
        # place it may change: the budget is then planned and spent with that one)
        self.__dict__["mechanism"], self._history = loaded.mechanism, loaded._history


def compute_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld"
) -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps."""
    acc = PrivacyAccountant(accountant)
    if _step_count(steps) > 0:
        acc.step(noise_multiplier, sample_rate, steps)
    return acc.get_epsilon(delta)


def _aim(points: List[Tuple[float, float]]) -> float:
    """Where ``log epsilon`` reaches the target, by inverse interpolation in ``log sigma`` through the last
    (up to) three points ``(log sigma, log epsilon - log target)``; the caller keeps it inside the bracket."""
    (x0, y0), (x1, y1) = points[-2:]
    if len(points) >= 3:
        x2, y2 = points[-3]
        if len({y0, y1, y2}) == 3:
            return (x0 * y1 * y2 / ((y0 - y1) * (y0 - y2)) + x1 * y0 * y2 / ((y1 - y0) * (y1 - y2))
                    + x2 * y0 * y1 / ((y2 - y0) * (y2 - y1)))
    return x1 - y1 * (x1 - x0) / (y1 - y0) if y1 != y0 else math.nan


def _smallest_feasible(epsilon_at: Callable[[float], float], target: float, lo: float, hi: float, e_lo: float,
                       e_hi: float, tol: float, floor: float = 0.0) -> float:
    """Smallest ``x`` in ``[lo, hi]`` (to ``tol`` relative) with ``epsilon_at(x) <= target``, for an epsilon that
    falls as ``x`` grows; ``e_lo = epsilon_at(lo) > target >= e_hi = epsilon_at(hi)`` (``e_lo`` may be infinite).
    Below ``floor`` nothing is feasible, and ``epsilon_at`` is not asked there.

    The bracket keeps an infeasible ``lo`` and a feasible ``hi``, and the answer is ``hi``: feasible by evaluation.
    A round aims at the target by inverse interpolation of ``log sigma`` against ``log epsilon`` (smooth and
    nearly linear over a short range) and probes ``tol / 4`` on either side of the aim, so an accurate aim closes
    the bracket at once; a round that did not halve the bracket is followed by bisection's midpoint.  An aim below
    ``floor`` probes the floor.  Fewer evaluations than bisection's 10-12, each a PLD build of seconds."""
    points = [(math.log(x), math.log(e) - math.log(target)) for x, e in ((lo, e_lo), (hi, e_hi))
              if x > 0 and 0 < e < math.inf]
    bisect_next = False
    while hi - lo > tol * hi:
        width = hi - lo
        probes = [0.5 * (lo + hi)]
        if len(points) >= 2 and not bisect_next:
            aim = _aim(points)
            if math.isfinite(aim):  # kept inside the bracket in log space: no overflow, whatever the line
                aim = math.exp(min(max(aim, math.log(lo + 0.02 * width)), math.log(hi - 0.02 * width)))
                if lo < floor < hi and aim * (1 - tol / 4) < floor:
                    probes = [floor]
                elif len(points) >= 3:
                    probes = [aim * (1 + tol / 4), aim * (1 - tol / 4)]
                else:  # two points give a secant, whose aim lands on one side: one probe, then three points
                    probes = [aim]
        learned = False
        for x in probes:
            if lo < x < hi:
                e = epsilon_at(x) if x >= floor else math.inf
                if 0 < e < math.inf:
                    points.append((math.log(x), math.log(e) - math.log(target)))
                    learned = True
                if e <= target:
                    hi, e_hi = x, e
                else:
                    lo, e_lo = x, e
        # an aim off by more than its probes' spread, or a probe that taught nothing: bisect next
        bisect_next = hi - lo > 0.5 * width and (len(probes) == 2 or not learned)
    return hi


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    tol: float = 1e-3,
) -> float:
    """Smallest ``sigma`` (to relative ``tol``) whose epsilon is ``<= target_epsilon``.

    A bracketing search that only ever returns a feasible point (spec §6: never above target).
    """
    check_positive_finite(target_epsilon, "target epsilon")

    def epsilon_at(sigma: float) -> float:
        return compute_epsilon(sigma, sample_rate, steps, delta, accountant)

    lo, e_lo = 0.0, math.inf
    hi, e_hi = 1.0, epsilon_at(1.0)
    while not e_hi <= target_epsilon:
        lo, e_lo = hi, e_hi
        hi *= 2.0
        if hi > 1e6:
            raise ValueError("no noise multiplier reaches the target epsilon")
        e_hi = epsilon_at(hi)
    floor = PLD_MIN_NOISE_MULTIPLIER if accountant == "pld" else 0.0  # PLD refuses less noise; more is within target
    return _smallest_feasible(epsilon_at, target_epsilon, lo, hi, e_lo, e_hi, tol, floor)


def calibrate_steps(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    noise_multiplier: float,
    accountant: str = "pld",
    max_steps: int = 10_000_000,
) -> int:
    """Largest number of steps, at most ``max_steps``, whose epsilon is ``<= target_epsilon`` (0 if even one step
    exceeds it).  Epsilon grows with the steps: doubling brackets the answer, bisection finds it, and every
    answer is a count whose epsilon was evaluated."""
    max_steps = whole_number(max_steps, "max_steps")
    check_positive_finite(target_epsilon, "target epsilon")  # NaN or a negative target would answer 0 steps

    def feasible(steps: int) -> bool:
        return compute_epsilon(noise_multiplier, sample_rate, steps, delta, accountant) <= target_epsilon

    if not feasible(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_steps and feasible(hi):
        lo, hi = hi, hi * 2
    if hi > max_steps:  # the cap itself, which lies in [lo, hi), may be within the target
        if lo == max_steps or feasible(max_steps):
            return int(max_steps)
        hi = int(max_steps)
    while hi - lo > 1:  # invariant: feasible(lo), not feasible(hi)
        mid = (lo + hi) // 2
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo
