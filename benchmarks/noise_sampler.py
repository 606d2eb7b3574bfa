"""The Gaussian sampler of the private step against torch's float32 ``randn``: time, and the largest draw.

    python benchmarks/noise_sampler.py --out results/noise_sampler.json
    python benchmarks/noise_sampler.py --tail-draws 1000000000 --out results/noise_sampler_tail.json  # ~1 min

Time: medians of ``--calls`` calls for ``--size`` values (268,800: the MLP of ``speed.py``), the samplers one after
the other in alternating rounds in one process.  Tail: the largest ``|z|`` over ``--tail-draws`` draws of each, in
chunks, beside the largest a true standard normal would give at that count (its median, ``Phi^-1(1 - ln 2 / 2n)``
two-sided) and the bound of a Box-Muller radius from a ``k``-bit uniform, ``sqrt(2 k ln 2)``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from statistics import NormalDist

import torch
from report import print_table, write_json

from clipless.privacy.noise import gaussian
from clipless.privacy.randomness import secret_generator

_SECRET = secret_generator()

# ``g`` is a seeded torch generator (MT19937: an experiment's draws); a private run's generator is secret, and its
# bits come from an AES key stream
SAMPLERS = {
    "torch.randn (float32)": lambda n, g: torch.randn(n, generator=g),
    "gaussian, seeded": lambda n, g: gaussian(n, g),
    "gaussian, secret (AES)": lambda n, g: gaussian(n, _SECRET),
    "gaussian, secure, seeded": lambda n, g: gaussian(n, g, secure=True),
    "gaussian, secure, secret": lambda n, g: gaussian(n, _SECRET, secure=True),
}


def timings(size: int, calls: int, rounds: int = 5) -> dict:
    g = torch.Generator().manual_seed(0)
    times = {name: [] for name in SAMPLERS}
    for _ in range(rounds):  # alternate, so that a busy spell of the machine falls on every sampler
        for name, draw in SAMPLERS.items():
            draw(size, g)
            for _ in range(calls // rounds):
                start = time.perf_counter()
                draw(size, g)
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def largest(draw, count: int, chunk: int = 50_000_000) -> float:
    g, top, done = torch.Generator().manual_seed(1), 0.0, 0
    while done < count:
        n = min(chunk, count - done)
        top = max(top, float(draw(n, g).abs().max()))
        done += n
    return top


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=268_800)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--tail-draws", type=int, default=0, help="draws per sampler for the largest |z| (0: skip)")
    p.add_argument("--out", default="results/noise_sampler.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    ms = timings(args.size, args.calls)
    base = ms["torch.randn (float32)"]
    print_table(f"{'sampler':<28} {'ms':>8} {'/ randn':>8}",
                [f"{name:<28} {t:8.3f} {t / base:8.2f}" for name, t in ms.items()])
    payload = {"size": args.size, "calls": args.calls, "threads": 2, "median_ms": ms}
    if args.tail_draws:
        n = args.tail_draws
        tops = {name: largest(draw, n) for name, draw in SAMPLERS.items() if "secure" not in name}
        expected = NormalDist().inv_cdf(1 - math.log(2) / (2 * n))
        print_table(f"{'sampler':<28} {'max |z| over ' + str(n):>22}",
                    [f"{name:<28} {t:22.3f}" for name, t in tops.items()]
                    + [f"{'true N(0, 1), median':<28} {expected:22.3f}",
                       f"{'bound, 24-bit uniform':<28} {math.sqrt(48 * math.log(2)):22.3f}",
                       f"{'bound, 53-bit uniform':<28} {math.sqrt(106 * math.log(2)):22.3f}"])
        payload.update(tail_draws=n, largest=tops, true_normal_median_largest=expected)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
