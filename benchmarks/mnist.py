"""MNIST clipless DP-SGD: test accuracy at target epsilons, time per epoch; table + JSON.

    python benchmarks/mnist.py --data-dir ../shared/data/mnist --epsilons 1 2 --out results/mnist.json

Default recipe: fixed scattering features (``clipless.data.features``, computed once,
data-independent, on the sphere of radius 1) and a 1-Lipschitz linear head
trained with clipless DP-SGD.  ``--features pixels`` trains on raw pixels
instead (the earlier recipe: ``--features pixels --hidden 1024 --batch-size 16384
--epochs 40 --lr 2e-3 --tau 6 --input-clip 8``).

Runs on the CPU with --threads threads (2 = the CI machine). Each epsilon is a
separate private training of the same model; sigma is calibrated (PLD) so that
the planned epochs end at the target, delta = 1e-5, Poisson sampling.
"""

from __future__ import annotations

import argparse
import time

import torch

import clipless as cl
from clipless.data.features import scattering_split
from report import print_table, write_json


def run(data, epsilon: float, args, setup_seconds: float = 0.0) -> dict:
    torch.manual_seed(args.seed)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=tuple(args.hidden), input_clip=args.input_clip,
                             projection=args.projection)
    if args.adaptive_quantile is not None:  # C follows a private quantile; the count's noise enters epsilon
        model.append(cl.AdaptiveLossGradientClip(args.loss_grad_clip, count_noise_multiplier=args.batch_size / 20,
                                                 target_quantile=args.adaptive_quantile))
    elif args.loss_grad_clip is not None:  # clip d loss / d logits per example: L -> min(L, C)
        model.append(cl.LossGradientClip(args.loss_grad_clip))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = cl.PrivateTrainer(
        model, optimizer, cl.TauCrossEntropy(args.tau), data.train,
        input_shape=data.input_shape, batch_size=args.batch_size, delta=args.delta, epochs=args.epochs,
        target_epsilon=epsilon, test_data=data.test, progress=args.progress,
        log=print if args.verbose else None, average_decay=args.average_decay,
        log_train_stats=True,  # for the epoch times (non-private: they grow with the secret batch sizes)
    )
    start = time.perf_counter()
    result = trainer.fit()
    total = time.perf_counter() - start
    epoch_times = [h["nonprivate_epoch_time_s"] for h in result.history]
    return {
        "target_epsilon": epsilon, "epsilon": result.epsilon, "delta": result.delta,
        "test_accuracy": result.test_accuracy, "sigma": result.effective_noise_multiplier, "steps": result.steps,
        "epochs": result.epochs, "seconds_per_epoch": sum(epoch_times) / len(epoch_times),
        "train_seconds": total, "total_seconds": total + setup_seconds, "history": result.history,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--features", choices=["scattering", "pixels"], default="scattering")
    p.add_argument("--hidden", type=int, nargs="*", default=[], help="hidden widths (none: a linear head)")
    p.add_argument("--projection", choices=["spectral", "bjorck"], default="spectral")
    p.add_argument("--input-clip", type=float, default=1.0, help="input norm bound (scattering features: radius 1)")
    p.add_argument("--batch-size", type=float, default=4096)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tau", type=float, default=64.0)
    p.add_argument("--loss-grad-clip", type=float, default=0.25, help="clip each example's logit gradient to C")
    p.add_argument("--adaptive-quantile", type=float, default=None,
                   help="adaptive loss-gradient clip (starts at --loss-grad-clip, count noise = batch / 20)")
    p.add_argument("--average-decay", type=float, default=None, help="EMA of the iterates (post-processing)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default="results/mnist.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = cl.load_mnist(args.data_dir)
    if args.features == "scattering":
        data = scattering_split(data, radius=1.0, progress=args.progress)
    setup = time.perf_counter() - start
    print(f"data and features: {setup:.1f} s ({args.features}, input shape {data.input_shape})")
    rows = [run(data, eps, args, setup) for eps in args.epsilons]
    print_table(
        f"{'target eps':>10} {'epsilon':>8} {'sigma':>7} {'steps':>6} {'test acc':>9} {'s/epoch':>8} "
        f"{'total s (incl. features)':>24}",
        [
            f"{r['target_epsilon']:10.2f} {r['epsilon']:8.4f} {r['sigma']:7.3f} {r['steps']:6d} "
            f"{r['test_accuracy']:9.4f} {r['seconds_per_epoch']:8.2f} {r['total_seconds']:24.1f}"
            for r in rows
        ],
    )
    config = {k: v for k, v in vars(args).items() if k not in ("progress", "verbose")}
    write_json(args.out, {"config": config, "torch": torch.__version__, "feature_seconds": setup, "rows": rows})


if __name__ == "__main__":
    main()
