"""MNIST clipless DP-SGD: test accuracy at target epsilons, time per epoch; table + JSON.

    python benchmarks/mnist.py --data-dir ../shared/data/mnist --epsilons 1 2 --out results/mnist.json

Runs on the CPU with --threads threads (2 = the CI machine). Each epsilon is a
separate private training of the same model; sigma is calibrated (PLD) so that
the planned epochs end at the target, delta = 1e-5, Poisson sampling.
"""

from __future__ import annotations

import argparse
import time

import torch

import clipless as cl
from report import print_table, write_json


def run(data, epsilon: float, args) -> dict:
    torch.manual_seed(args.seed)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=tuple(args.hidden), input_clip=args.input_clip)
    if args.loss_grad_clip is not None:  # clip d loss / d logits per example: L -> min(L, C)
        model.append(cl.LossGradientClip(args.loss_grad_clip))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = cl.PrivateTrainer(
        model, optimizer, cl.TauCrossEntropy(args.tau), data.train,
        input_shape=data.input_shape, batch_size=args.batch_size, delta=args.delta, epochs=args.epochs,
        target_epsilon=epsilon, seed=args.seed, test_data=data.test, progress=args.progress,
        log=print if args.verbose else None, average_decay=args.average_decay,
    )
    start = time.perf_counter()
    result = trainer.fit()
    total = time.perf_counter() - start
    epoch_times = [h["epoch_time_s"] for h in result.history]
    return {
        "target_epsilon": epsilon, "epsilon": result.epsilon, "delta": result.delta,
        "test_accuracy": result.test_accuracy, "sigma": result.effective_noise_multiplier, "steps": result.steps,
        "epochs": result.epochs, "seconds_per_epoch": sum(epoch_times) / len(epoch_times),
        "total_seconds": total, "history": result.history,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024])
    p.add_argument("--input-clip", type=float, default=8.0)
    p.add_argument("--batch-size", type=float, default=16384)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--tau", type=float, default=6.0)
    p.add_argument("--loss-grad-clip", type=float, default=0.25, help="clip each example's logit gradient to C")
    p.add_argument("--average-decay", type=float, default=None, help="EMA of the iterates (post-processing)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default="results/mnist.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = cl.load_mnist(args.data_dir)
    rows = [run(data, eps, args) for eps in args.epsilons]
    print_table(
        f"{'target eps':>10} {'epsilon':>8} {'sigma':>7} {'steps':>6} {'test acc':>9} {'s/epoch':>8} {'total s':>8}",
        [
            f"{r['target_epsilon']:10.2f} {r['epsilon']:8.4f} {r['sigma']:7.3f} {r['steps']:6d} "
            f"{r['test_accuracy']:9.4f} {r['seconds_per_epoch']:8.2f} {r['total_seconds']:8.1f}"
            for r in rows
        ],
    )
    config = {k: v for k, v in vars(args).items() if k not in ("progress", "verbose")}
    write_json(args.out, {"config": config, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
