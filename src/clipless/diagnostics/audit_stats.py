"""Statistics of empirical privacy audits (spec §9): epsilon lower bounds at a stated confidence.

* **Threshold test** (Nasr et al. 2023): a test telling D from D' with false-positive rate ``a`` and
  false-negative rate ``b`` shows ``epsilon >= max(log((1 - delta - b) / a), log((1 - delta - a) / b))``
  for any (epsilon, delta)-DP mechanism; ``a`` and ``b`` are replaced by one-sided Clopper-Pearson upper
  bounds, and the threshold is chosen on one half of the trials and evaluated on the other, so the stated
  confidence holds without assumptions on the score distributions.
* **Gaussian DP** (Dong, Roth, Su): equal-variance Gaussian scores ``N(0, s^2)`` / ``N(m, s^2)`` are exactly
  ``mu``-GDP with ``mu = m / s``, and ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.
  Valid where the scores are Gaussian, as the projection of one unsubsampled Gaussian step is.
* **One run** (Steinke, Nasr, Jagielski 2023, Theorem 3.1 and its delta term): with ``m`` canaries each
  included with probability 1/2 and ``v`` correct guesses out of ``r``, an (eps, delta)-DP training gives
  ``P[V >= v] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 m delta alpha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "AuditResult",
    "clopper_pearson_upper",
    "epsilon_from_error_rates",
    "threshold_epsilon_lower",
    "gdp_mu_bounds",
    "gdp_epsilon",
    "one_run_p_value",
    "one_run_epsilon_lower",
    "one_run_guesses",
    "one_run_bound",
]


def _check_confidence(confidence: float) -> float:
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return float(confidence)


def _check_delta(delta: float) -> float:
    if not (0.0 <= delta < 1.0):
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    return float(delta)


def clopper_pearson_upper(errors: Any, n: Any, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound, at level ``1 - alpha``, on a rate with ``errors`` of ``n``."""
    from scipy.stats import beta

    errors, n = np.asarray(errors, dtype=float), np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        upper = beta.ppf(1.0 - alpha, errors + 1.0, np.maximum(n - errors, 1e-300))
    return np.where((errors >= n) | (n <= 0), 1.0, upper)


def epsilon_from_error_rates(fpr: Any, fnr: Any, delta: float) -> np.ndarray:
    """``max(log((1 - delta - fnr) / fpr), log((1 - delta - fpr) / fnr), 0)``, elementwise."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.where(1 - delta - fnr > 0, np.log(np.maximum(1 - delta - fnr, 1e-300)) - np.log(fpr), 0.0)
        second = np.where(1 - delta - fpr > 0, np.log(np.maximum(1 - delta - fpr, 1e-300)) - np.log(fnr), 0.0)
    return np.maximum(np.maximum(first, second), 0.0)


def _threshold_counts(out: np.ndarray, inside: np.ndarray, thresholds: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """For the test "score > t means D'": false positives among ``out``, false negatives among ``inside``."""
    out, inside = np.sort(out), np.sort(inside)
    false_pos = len(out) - np.searchsorted(out, thresholds, side="right")
    false_neg = np.searchsorted(inside, thresholds, side="right")
    return false_pos, false_neg


def threshold_epsilon_lower(scores_out: Sequence[float], scores_in: Sequence[float], delta: float,
                            confidence: float = 0.95, max_thresholds: int = 4000) -> Dict[str, float]:
    """Epsilon lower bound of the best threshold test, at ``confidence`` (Clopper-Pearson, spec §9).

    ``scores_out`` come from runs on D, ``scores_in`` from runs on D' (higher = more like D').  The
    threshold and the test's direction are chosen on the first half of each sample; the error rates of
    the other half get one-sided Clopper-Pearson bounds at ``(1 - confidence) / 2`` each, so the bound
    holds at ``confidence`` whatever the score distributions.
    """
    confidence, delta = _check_confidence(confidence), _check_delta(delta)
    out, inside = np.asarray(scores_out, dtype=float), np.asarray(scores_in, dtype=float)
    if len(out) < 4 or len(inside) < 4:
        raise ValueError("the threshold test needs at least 4 scores on each side")
    alpha = (1.0 - confidence) / 2.0
    h0, h1 = len(out) // 2, len(inside) // 2
    pick_out, pick_in, eval_out, eval_in = out[:h0], inside[:h1], out[h0:], inside[h1:]
    candidates = np.unique(np.concatenate([pick_out, pick_in]))
    if len(candidates) > max_thresholds:
        candidates = np.quantile(candidates, np.linspace(0, 1, max_thresholds))
    best = (-1.0, 0.0, 1)
    for sign in (1, -1):  # "score > t means D'", and the reverse test
        fp, fn = _threshold_counts(sign * pick_out, sign * pick_in, sign * candidates)
        eps = epsilon_from_error_rates(clopper_pearson_upper(fp, h0, alpha), clopper_pearson_upper(fn, h1, alpha), delta)
        i = int(np.argmax(eps))
        if eps[i] > best[0]:
            best = (float(eps[i]), float(candidates[i]), sign)
    _, threshold, sign = best
    fp, fn = _threshold_counts(sign * eval_out, sign * eval_in, np.array([sign * threshold]))
    fpr_u = float(clopper_pearson_upper(fp, len(eval_out), alpha)[0])
    fnr_u = float(clopper_pearson_upper(fn, len(eval_in), alpha)[0])
    return {
        "epsilon_lower": float(epsilon_from_error_rates(fpr_u, fnr_u, delta)),
        "threshold": threshold,
        "direction": "higher score means D'" if sign == 1 else "lower score means D'",
        "fpr": float(fp[0]) / len(eval_out),
        "fnr": float(fn[0]) / len(eval_in),
        "fpr_upper": fpr_u,
        "fnr_upper": fnr_u,
    }


def gdp_mu_bounds(scores_out: Sequence[float], scores_in: Sequence[float],
                  confidence: float = 0.95) -> Tuple[float, float]:
    """``(mu estimate, lower confidence bound on mu)`` for equal-variance Gaussian scores.

    ``mu = (mean_in - mean_out) / s`` with the pooled ``s``; the lower bound combines a one-sided t bound on
    the mean difference and a chi-square upper bound on ``s``, each at ``(1 - confidence) / 2``.
    """
    from scipy.stats import chi2, t

    confidence = _check_confidence(confidence)
    out, inside = np.asarray(scores_out, dtype=float), np.asarray(scores_in, dtype=float)
    n0, n1 = len(out), len(inside)
    if n0 < 2 or n1 < 2:
        raise ValueError("the Gaussian fit needs at least 2 scores on each side")
    dof = n0 + n1 - 2
    pooled = (((out - out.mean()) ** 2).sum() + ((inside - inside.mean()) ** 2).sum()) / dof
    s = math.sqrt(max(pooled, 1e-300))
    diff = float(inside.mean() - out.mean())
    alpha = (1.0 - confidence) / 2.0
    diff_low = diff - float(t.ppf(1 - alpha, dof)) * s * math.sqrt(1 / n0 + 1 / n1)
    s_high = s * math.sqrt(dof / float(chi2.ppf(alpha, dof)))
    return diff / s, max(diff_low, 0.0) / s_high


def gdp_delta(mu: float, epsilon: float) -> float:
    """``delta(eps)`` of ``mu``-GDP: ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``."""
    from scipy.stats import norm

    if mu <= 0:
        return 0.0
    return float(norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon + norm.logcdf(-epsilon / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ``eps >= 0`` with ``delta(eps) <= delta`` under ``mu``-GDP (bisection; ``delta(eps)`` decreases)."""
    delta = _check_delta(delta)
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            return math.inf
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if gdp_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of ``>= v`` correct guesses out of ``r`` under (eps, delta)-DP with ``m`` canaries.

    ``P[Binomial(r, p) >= v] + 2 m delta max_{1 <= i <= v} (1/i) sum_{j=1..i} P[Binomial(r, p) = v - j]``,
    ``p = e^eps / (1 + e^eps)`` (Steinke, Nasr, Jagielski 2023).
    """
    from scipy.stats import binom

    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, p))
    alpha = 0.0
    if v > 0 and delta > 0:
        i = np.arange(1, v + 1)
        alpha = float(np.max(np.cumsum(binom.pmf(v - i, r, p)) / i))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def one_run_epsilon_lower(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """Largest ``eps`` whose p-value is ``<= 1 - confidence`` (0 if none): the one-run lower bound."""
    confidence, delta = _check_confidence(confidence), _check_delta(delta)
    target = 1.0 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) > target:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= target:
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if one_run_p_value(m, r, v, mid, delta) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def one_run_guesses(scores: Sequence[float], included: Sequence[bool], k_plus: int, k_minus: int) -> Tuple[int, int]:
    """Guess "in" for the ``k_plus`` highest scores and "out" for the ``k_minus`` lowest: ``(r, v)``."""
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > len(scores):
        raise ValueError(f"need 0 <= k+ + k- <= m = {len(scores)}, got {k_plus} + {k_minus}")
    order = np.argsort(-scores, kind="stable")
    correct = int(included[order[:k_plus]].sum())
    if k_minus:
        correct += int((~included[order[len(scores) - k_minus:]]).sum())
    return k_plus + k_minus, correct


def one_run_bound(scores: Sequence[float], included: Sequence[bool], delta: float, confidence: float = 0.95,
                  fractions: Sequence[float] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)) -> Dict[str, float]:
    """Best one-run lower bound over ``k+ = k- = fraction * m / 2`` guesses; the choice among the
    ``len(fractions)`` settings is paid by a Bonferroni correction, so the bound holds at ``confidence``."""
    confidence = _check_confidence(confidence)
    m = len(scores)
    settings = sorted({max(1, int(f * m / 2)) for f in fractions if f * m / 2 >= 1} or {1})
    level = 1.0 - (1.0 - confidence) / len(settings)
    best = {"epsilon_lower": 0.0, "guesses": 0, "correct": 0}
    for k in settings:
        if 2 * k > m:
            continue
        r, v = one_run_guesses(scores, included, k, k)
        eps = one_run_epsilon_lower(m, r, v, delta, level)
        if eps > best["epsilon_lower"] or best["guesses"] == 0:
            best = {"epsilon_lower": eps, "guesses": r, "correct": v}
    return {**best, "settings_tried": len(settings)}


@dataclass
class AuditResult:
    """An empirical audit: a lower bound on epsilon at ``confidence`` next to the claimed epsilon.

    ``scores_out`` / ``scores_in`` are the attack's scores on D and D' (or non-members and members): noisy
    releases of the mechanism (step audit), or records scored by a privately trained model (one-run and
    membership audits). Those scores are statistics of the scored records without noise: such a result is
    not a private release (``clipless audit --mode one-run`` labels its files so).
    """

    mode: str
    epsilon_claimed: Optional[float]
    epsilon_lower: float
    confidence: float
    delta: float
    trials: int
    method: str
    details: Dict[str, Any] = field(default_factory=dict)
    scores_out: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    scores_in: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @property
    def verdict(self) -> str:
        """``consistent`` when ``epsilon_lower <= epsilon_claimed``, ``VIOLATION`` otherwise."""
        if self.epsilon_claimed is None:
            return "no claim"
        return "consistent" if self.epsilon_lower <= self.epsilon_claimed else "VIOLATION"

    def to_dict(self) -> Dict[str, Any]:
        def summary(s: np.ndarray) -> Dict[str, float]:
            return {"n": int(len(s)), "mean": float(np.mean(s)) if len(s) else math.nan,
                    "std": float(np.std(s)) if len(s) else math.nan}

        return {
            "mode": self.mode,
            "epsilon_claimed": self.epsilon_claimed,
            "epsilon_lower": self.epsilon_lower,
            "confidence": self.confidence,
            "delta": self.delta,
            "trials": self.trials,
            "verdict": self.verdict,
            "method": self.method,
            **self.details,
            "scores_out": summary(self.scores_out),
            "scores_in": summary(self.scores_in),
        }

    def summary_line(self) -> str:
        claimed = "none" if self.epsilon_claimed is None else f"{self.epsilon_claimed:.3f}"
        line = (f"{self.mode} audit: epsilon lower bound {self.epsilon_lower:.3f} at {self.confidence:.0%} confidence "
                f"vs claimed {claimed} (delta {self.delta:g}, {self.trials} trials): {self.verdict}")
        if self.verdict == "VIOLATION":  # a lower bound at confidence c exceeds the truth in up to 1 - c of audits
            line += (f" (a correct mechanism shows this in up to {1 - self.confidence:.0%} of audits: rerun with more "
                     "trials or at a higher confidence to confirm)")
        return line
