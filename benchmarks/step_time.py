"""Time of a clipless private step vs non-private steps on the same Lipschitz model.

    python benchmarks/step_time.py --batch-sizes 256 1024 --out results/step_time.json

Three steps, each timed as the median of many repetitions after warm-up:
  plain      forward + backward + optimizer step (no constraint kept: not a Lipschitz model after the step)
  projected  plain + projection (what non-private training of the same Lipschitz model costs)
  private    projected + certified bounds + Gaussian noise + accountant step (clipless DP-SGD)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import clipless as cl
from clipless.bounds import BoundEngine
from clipless.noise import add_noise_
from report import print_table, write_json


def build(model_name: str):
    shape = (1, 28, 28)
    if model_name == "mlp":
        return cl.lipschitz_mlp(shape, 10, hidden=(256, 256), input_clip=8.0), shape
    return cl.lipschitz_cnn(shape, 10, channels=(16, 32), input_clip=8.0), shape


def time_steps(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/step_time.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model_name in args.models:
        for b in args.batch_sizes:
            torch.manual_seed(0)
            model, shape = build(model_name)
            loss = cl.TauCrossEntropy(8.0)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            engine = BoundEngine(model, shape, 8.0, loss.lipschitz)
            accountant = cl.PrivacyAccountant()
            gen = torch.Generator().manual_seed(0)
            x, y = torch.rand(b, *shape), torch.randint(0, 10, (b,))

            def plain():
                opt.zero_grad()
                loss.per_example(model(x), y).sum().backward()
                opt.step()

            def projected():
                plain()
                engine.project_()

            def private():
                opt.zero_grad()
                loss.per_example(model(x), y).sum().backward()
                report = engine.compute()
                sigmas = {layer.name: 1.0 for layer in report.layers}
                add_noise_(report, "global", sigmas, float(b), gen)
                opt.step()
                engine.project_()
                accountant.step(1.0, 0.01)

            t = {name: time_steps(fn, args.repeats) for name, fn in
                 (("plain", plain), ("projected", projected), ("private", private))}
            rows.append({"model": model_name, "batch": b, **{f"{k}_s": v for k, v in t.items()},
                         "private/projected": t["private"] / t["projected"], "private/plain": t["private"] / t["plain"]})
    print_table(
        f"{'model':6} {'batch':>6} {'plain ms':>9} {'proj ms':>9} {'priv ms':>9} {'priv/proj':>9} {'priv/plain':>10}",
        [
            f"{r['model']:6} {r['batch']:6d} {1e3 * r['plain_s']:9.2f} {1e3 * r['projected_s']:9.2f} "
            f"{1e3 * r['private_s']:9.2f} {r['private/projected']:9.3f} {r['private/plain']:10.3f}"
            for r in rows
        ],
    )
    write_json(args.out, {"threads": args.threads, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
