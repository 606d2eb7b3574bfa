"""Time of noise calibration: ``calibrate_noise_multiplier`` against the plain bisection it replaced.

    python benchmarks/calibration.py --out results/calibration.json

Each case calibrates sigma for a target epsilon, in both ways, one after the other, each with an empty PLD cache
(an epsilon query at a new sigma builds that sigma's PLD, seconds at the 1e-4 grid: most of the time). The table
gives the sigma found, the number of epsilon queries and the seconds, and checks that both sigmas are feasible
and that no sigma ``tol`` below either is.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Tuple

from report import print_table, write_json

import clipless.privacy.accounting as acc

# (target epsilon, delta, sample rate, steps, accountant): the CLI's digits job (batch 1024 of 1437, 40 epochs;
# pretrain's 128 of 1437, 1 epoch), MNIST at batch 256 for 10 epochs, a long run at q 0.01, a loose target whose
# answer is near the PLD floor, and rdp.
CASES = [
    (3.0, 1e-5, 1024 / 1437, 40, "pld"),
    (5.0, 1e-5, 128 / 1437, 11, "pld"),
    (1.0, 1e-5, 256 / 60000, 2350, "pld"),
    (3.0, 1e-5, 0.01, 1000, "pld"),
    (50.0, 1e-5, 0.1, 10, "pld"),
    (8.0, 1e-5, 0.3, 100, "rdp"),
]
TOL = 1e-3


def bisection(target: float, delta: float, q: float, steps: int, accountant: str, tol: float = TOL) -> float:
    """The search ``calibrate_noise_multiplier`` used before: double up from 1, then bisect to ``tol``."""
    def feasible(sigma: float) -> bool:
        if accountant == "pld" and sigma < acc.PLD_MIN_NOISE_MULTIPLIER:
            return False
        return acc.compute_epsilon(sigma, q, steps, delta, accountant) <= target

    hi = 1.0
    while not feasible(hi):
        hi *= 2.0
    lo = hi / 2.0 if hi > 1.0 else 0.0
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def timed(search: Callable[..., float], case: Tuple) -> Tuple[float, int, float]:
    """sigma, epsilon queries, seconds; the PLD cache emptied first."""
    acc._step_pld.cache_clear()
    queries = [0]
    real = acc.compute_epsilon

    def counted(*args):
        queries[0] += 1
        return real(*args)

    acc.compute_epsilon = counted
    try:
        start = time.perf_counter()
        sigma = search(*case)
        return sigma, queries[0], time.perf_counter() - start
    finally:
        acc.compute_epsilon = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/calibration.json")
    args = parser.parse_args()
    rows, lines = [], []
    for case in CASES:
        target, delta, q, steps, accountant = case
        row = {"target_epsilon": target, "delta": delta, "sample_rate": q, "steps": steps, "accountant": accountant}
        for name, search in (("bisection", bisection), ("calibrate", acc.calibrate_noise_multiplier)):
            sigma, queries, seconds = timed(search, case)
            below = sigma * (1 - TOL)
            row[name] = {"sigma": sigma, "queries": queries, "seconds": seconds,
                         "feasible": acc.compute_epsilon(sigma, q, steps, delta, accountant) <= target,
                         "tol_below_infeasible": below < acc.PLD_MIN_NOISE_MULTIPLIER and accountant == "pld"
                         or acc.compute_epsilon(below, q, steps, delta, accountant) > target}
        rows.append(row)
        b, c = row["bisection"], row["calibrate"]
        lines.append(f"{target:>6g} {q:>8.4f} {steps:>6d} {accountant:>4s} {b['sigma']:>9.5f} {c['sigma']:>9.5f} "
                     f"{b['queries']:>5d} {c['queries']:>5d} {b['seconds']:>7.1f} {c['seconds']:>7.1f} "
                     f"{b['seconds'] / c['seconds']:>6.2f} {str(b['feasible'] and c['feasible']):>5s} "
                     f"{str(b['tol_below_infeasible'] and c['tol_below_infeasible']):>5s}")
    print_table("   eps        q  steps  acc   sigma b   sigma c  q(b)  q(c)    s(b)    s(c)  b / c  feas  tight",
                lines)
    write_json(args.out, {"tol": TOL, "cases": rows})


if __name__ == "__main__":
    main()
