"""Logit-DP vs Naive-DP vs non-private contrastive pre-training on MNIST at equal epsilon.

    python benchmarks/logit_dp.py --data-dir ../shared/data/mnist --epsilon 5 --out results/logit_dp.json

Pairs are two random crops (+ flips) of one training image; a pair is one record (add/remove), sampled
by Poisson.  Same encoder, optimizer, batch, epochs and epsilon for both private methods; each has its
own clipping norm (B per pair gradient for Logit-DP, C for the whole batch gradient for Naive-DP).
Prints a table (held-out loss before/after, kNN(3) accuracy, linear-probe accuracy, epsilon, time),
writes JSON and a plot of the held-out loss per epoch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from clipless.train.baselines import standard_mlp
from clipless.data.datasets import load_mnist
from clipless.contrastive.pairs import AugmentedPairs
from clipless.contrastive.evaluation import evaluate_encoder
from clipless.contrastive.pretrain import ContrastivePretrainer


def run(args: argparse.Namespace, method: str) -> dict:
    data = load_mnist(args.data_dir)
    torch.manual_seed(args.seed)
    encoder = standard_mlp((1, 28, 28), args.embedding_dim, hidden=args.hidden)
    pairs = AugmentedPairs(data.train.features, padding=args.crop_padding, flip=args.flip, blur=args.blur,
                           pixel_noise=args.pixel_noise)  # secret augmentations
    eval_pairs = AugmentedPairs(data.test.features[: args.eval_size], padding=args.crop_padding, flip=args.flip,
                                seed=12345)
    clip = {"logit_dp": args.clip_logit, "naive_dp": args.clip_naive}.get(method, 1.0)
    trainer = ContrastivePretrainer(
        encoder, torch.optim.Adam(encoder.parameters(), lr=args.lr), pairs, method=method, loss=args.loss,
        tau=args.tau, clip_norm=clip, batch_size=args.batch_size, epochs=args.epochs, delta=args.delta,
        target_epsilon=args.epsilon, eval_pairs=eval_pairs, progress=args.progress,
    )
    start = time.perf_counter()
    result = trainer.fit().to_dict()
    result["train_time_s"] = time.perf_counter() - start
    result.update(evaluate_encoder(encoder, data.test))
    return result


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for r in results:
        epochs = [h["epoch"] for h in r["history"]]
        ax.plot(epochs, [h["eval_loss"] for h in r["history"]], marker="o", label=r["method"])
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"held-out {results[0]['loss']} loss per pair")
    eps = [r["epsilon"] for r in results if r["epsilon"] is not None]
    ax.set_title(f"MNIST pairs, epsilon {max(eps):.2f}" if eps else "MNIST pairs")
    ax.grid(alpha=0.3)
    ax.legend()
    from report import save_plot

    save_plot(fig, path)


def add_pretraining_options(parser: argparse.ArgumentParser, batch_size, epochs, crop_padding) -> None:
    """The pre-training settings shared by the Logit-DP benchmarks (``None`` defaults: chosen per dataset)."""
    parser.add_argument("--epsilon", type=float, default=5.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=float, default=batch_size, help="expected Poisson batch (pairs)")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tau", type=float, default=1.0)
    parser.add_argument("--clip-logit", type=float, default=1.0, help="B of Logit-DP (per pair-similarity gradient)")
    parser.add_argument("--clip-naive", type=float, default=1.0, help="C of Naive-DP (whole batch gradient)")
    parser.add_argument("--hidden", type=int, nargs="*", default=[256])
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--crop-padding", type=int, default=crop_padding, help="random-crop shift in pixels")
    parser.add_argument("--blur", type=float, default=0.0, help="Gaussian blur of each view with probability 1/2, "
                        "width uniform in [0.1, BLUR] pixels (0: off)")
    parser.add_argument("--pixel-noise", type=float, default=0.0, help="std of Gaussian noise added to each view")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--methods", nargs="*", default=["logit_dp", "naive_dp", "nonprivate"])
    parser.add_argument("--loss", default="contrastive", choices=["contrastive", "spreadout"])
    add_pretraining_options(parser, batch_size=512, epochs=5, crop_padding=2)
    parser.add_argument("--no-flip", dest="flip", action="store_false")
    parser.add_argument("--eval-size", type=int, default=4096, help="held-out test images for the loss curve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--out", default="results/logit_dp.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = load_mnist(args.data_dir)
    torch.manual_seed(args.seed)
    untrained = standard_mlp((1, 28, 28), args.embedding_dim, hidden=args.hidden)  # the common initialization
    reference = evaluate_encoder(untrained, data.test)
    results = [run(args, m) for m in args.methods]
    header = ("method", "clip", "epsilon", "sigma", "sensitivity", "loss start", "loss end", "kNN(3) acc",
              "probe acc", "s/epoch")
    rows = []
    for r in results:
        eps = "inf" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
        rows.append((r["method"], "-" if r["clip_norm"] is None else f"{r['clip_norm']:g}", eps,
                     "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.3f}",
                     "-" if r["sensitivity"] is None else f"{r['sensitivity']:.3g}",
                     f"{r['history'][0]['eval_loss']:.4f}", f"{r['history'][-1]['eval_loss']:.4f}",
                     f"{r['knn3_accuracy']:.4f}", f"{r['linear_probe_accuracy']:.4f}",
                     f"{r['train_time_s'] / r['epochs']:.1f}"))
    print(f"MNIST {args.loss} pre-training, batch {args.batch_size:g}, {args.epochs} epochs, tau {args.tau}, "
          f"MLP {args.hidden} -> {args.embedding_dim}, delta {args.delta:g}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"| untrained encoder (same init) | - | - | - | - | - | - | {reference['knn3_accuracy']:.4f} | "
          f"{reference['linear_probe_accuracy']:.4f} | - |")
    out = Path(args.out)
    from report import write_json

    write_json(out, {"config": vars(args), "untrained": reference, "results": results}, quiet=True)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
