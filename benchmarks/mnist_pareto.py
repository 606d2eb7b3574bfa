"""MNIST test accuracy vs epsilon: clipless DP-SGD and Opacus DP-SGD (and the non-private ceiling).

    python benchmarks/mnist_pareto.py --data-dir ../shared/data/mnist --out results/mnist_pareto.json

Both methods train a 784-H-10 MLP (clipless: orthogonal dense + MaxMin + loss-gradient clip, the recipe
of benchmarks/mnist.py; Opacus: nn.Linear + ReLU, per-example clipping to C). Poisson sampling, sigma
calibrated with the same PLD accountant, delta = 1e-5; each epsilon is a separate training run. Each
method keeps its own batch size and learning rate (the ones that work for it), stated in the JSON.
"""

from __future__ import annotations

import argparse
import time
from argparse import Namespace

import torch

import clipless as cl
from clipless.diagnostics.plots import plot_pareto
from clipless.train.baselines import standard_mlp, train_dpsgd, train_nonprivate
from mnist import run as run_clipless
from report import print_table, write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--clipless-epochs", type=int, default=20)
    p.add_argument("--clipless-batch", type=float, default=16384)
    p.add_argument("--clipless-lr", type=float, default=2e-3)
    p.add_argument("--dpsgd-epochs", type=int, default=5)
    p.add_argument("--dpsgd-batch", type=int, default=1024)
    p.add_argument("--dpsgd-lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/mnist_pareto.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = cl.load_mnist(args.data_dir)
    clipless_args = Namespace(hidden=[args.hidden], projection="bjorck", input_clip=8.0, loss_grad_clip=0.25,
                              adaptive_quantile=None,
                              lr=args.clipless_lr, tau=6.0,
                              batch_size=args.clipless_batch, delta=args.delta, epochs=args.clipless_epochs,
                              seed=args.seed, progress=False, verbose=False, average_decay=None)
    rows = []
    for eps in args.epsilons:
        c = run_clipless(data, eps, clipless_args)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        d = train_dpsgd(standard_mlp(data.input_shape, 10, hidden=(args.hidden,)), data.train,
                        batch_size=args.dpsgd_batch, epochs=args.dpsgd_epochs, delta=args.delta,
                        max_grad_norm=args.max_grad_norm, target_epsilon=eps, lr=args.dpsgd_lr, seed=args.seed,
                        test_data=data.test, progress=False)
        rows.append({"epsilon": eps, "clipless_accuracy": c["test_accuracy"], "clipless_epsilon": c["epsilon"],
                     "clipless_seconds": c["total_seconds"], "dpsgd_accuracy": d.test_accuracy,
                     "dpsgd_epsilon": d.epsilon, "dpsgd_sigma": d.noise_multiplier,
                     "dpsgd_seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    torch.manual_seed(args.seed)
    ceiling = train_nonprivate(standard_mlp(data.input_shape, 10, hidden=(args.hidden,)), data.train, batch_size=256,
                               epochs=args.dpsgd_epochs, lr=1e-3, seed=args.seed, test_data=data.test,
                               progress=False)
    print_table(
        f"{'target eps':>10} {'clipless acc':>12} {'clipless eps':>12} {'clipless s':>10} "
        f"{'dpsgd acc':>9} {'dpsgd eps':>9} {'dpsgd s':>8}",
        [f"{r['epsilon']:10.2f} {r['clipless_accuracy']:12.4f} {r['clipless_epsilon']:12.4f} "
         f"{r['clipless_seconds']:10.1f} {r['dpsgd_accuracy']:9.4f} {r['dpsgd_epsilon']:9.4f} {r['dpsgd_seconds']:8.1f}"
         for r in rows],
    )
    print(f"non-private ceiling (same MLP, {args.dpsgd_epochs} epochs): {ceiling.test_accuracy:.4f}")
    write_json(args.out, {"config": vars(args), "rows": rows, "nonprivate_accuracy": ceiling.test_accuracy})

    png = plot_pareto(
        {"clipless DP-SGD": {r["epsilon"]: r["clipless_accuracy"] for r in rows},
         f"DP-SGD (Opacus, C={args.max_grad_norm})": {r["epsilon"]: r["dpsgd_accuracy"] for r in rows}},
        args.out.rsplit(".", 1)[0] + ".png", reference=ceiling.test_accuracy,
    )
    print(f"wrote {png}")

if __name__ == "__main__":
    main()
