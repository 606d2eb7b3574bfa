"""Does private contrastive pre-training pay off?  Few-label probes of Logit-DP, Naive-DP, non-private and
untrained encoders (issue 19, item 1).

    python benchmarks/logit_dp_probe.py --data-dir ../shared/data/mnist --seeds 0 1 2 --out results/logit_dp_probe.json
    python benchmarks/logit_dp_probe.py --dataset digits --seeds 0 1 2      # the fast check on the embedded digits
    python benchmarks/logit_dp_probe.py --data-dir ../shared/data/mnist --encoder cnn --channels 8 16 --input-pool 2 \
        --batch-size 512 --epochs 3 --seeds 0 1 2 --out results/logit_dp_probe_cnn.json  # CNN encoder, ~20 min/seed

Protocol:

1. Pre-training reads the training split only, without labels. A record is a pair of two random crops of one
   image (zero padding ``--crop-padding``, no flips: digits are not mirror-symmetric), sampled by Poisson.
   Logit-DP and Naive-DP have the same epsilon, batch, epochs, encoder and optimizer (``--optimizer``). With
   SGD their gradients differ in scale (Naive-DP's clipped batch gradient has norm at most ``C`` whatever the
   batch; Logit-DP's sum grows with it), so each method's ``--lr`` is chosen on validation in runs of its own.
2. Evaluation reads the test split only. Its even records are the labelled pool and its odd records the
   queries. With ``--validation N`` the test split is not read at all: the last ``N`` training images are held
   out of pre-training and take its place (for choosing settings). ``probe_<k>_per_class`` is a linear head
   trained on ``k`` labels of each class (mean of 3 random draws); ``knn3`` is a 3-NN classifier (cosine) with
   the whole labelled pool as references.
3. Each method runs once per ``--seeds`` value (encoder initialization and augmentation keys). Private noise
   comes from OS entropy. The table gives mean +- sd.

Nothing here was tuned: the settings are those of the loss-curve run of ``benchmarks/logit_dp.py`` in
docs/results.md (batch 1024), without flips, for 5 epochs.  Writes JSON and a figure beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

METHODS = ("logit_dp", "naive_dp", "nonprivate", "untrained")
METRICS = ("probe_10_per_class", "probe_100_per_class", "knn3_accuracy")


def run(args: argparse.Namespace, data, method: str, seed: int) -> dict:
    from clipless.contrastive.evaluation import evaluate_encoder
    from clipless.contrastive.pairs import AugmentedPairs
    from clipless.contrastive.pretrain import ContrastivePretrainer, build_encoder

    torch.manual_seed(seed)
    encoder = build_encoder(args.encoder, data.input_shape, args.embedding_dim, hidden=args.hidden,
                            channels=args.channels, input_pool=args.input_pool)  # the CLI's `clipless pretrain`
    encoder = encoder.to(args.device)
    start = time.perf_counter()
    out: dict = {"method": method, "seed": seed, "epsilon": None}
    if method != "untrained":
        pairs = AugmentedPairs(data.train.features, padding=args.crop_padding, flip=False, seed=seed, blur=args.blur,
                               pixel_noise=args.pixel_noise)
        trainer = ContrastivePretrainer(
            encoder, make_optimizer(args, param_groups(encoder, args.lr, args.conv_lr_scale, args.trained)), pairs,
            method=method,
            loss=args.loss, tau=args.tau, clip_norm=args.clip_logit if method == "logit_dp" else args.clip_naive,
            batch_size=args.batch_size, epochs=args.epochs, delta=args.delta,
            target_epsilon=None if method == "nonprivate" else args.epsilon, progress=False, log=None,
            cross_term=args.cross_term)
        result = trainer.fit()
        out.update(epsilon=result.epsilon, noise_multiplier=result.noise_multiplier)
    out["train_s"] = time.perf_counter() - start
    encoder = encoder.cpu()  # the evaluation (kNN, probes) runs on the CPU wherever the pre-training ran
    out.update(evaluate_encoder(encoder, data.test, per_class=(10, 100), layer=args.layers[0]))
    for layer in args.layers[1:]:  # the first is the headline: its metrics sit at the top of the record
        out[layer] = evaluate_encoder(encoder, data.test, per_class=(10, 100), layer=layer)
    return out


def make_optimizer(args: argparse.Namespace, groups: list) -> torch.optim.Optimizer:
    """``--optimizer``: Adam (the default), or SGD with heavy-ball ``--momentum``."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=args.momentum)
    return torch.optim.Adam(groups)


def param_groups(encoder: torch.nn.Module, lr: float, conv_lr_scale: float, trained: str = "all") -> list:
    """The optimizer's groups: the convolutions at ``lr * conv_lr_scale``, the rest at ``lr``.  Scale 0 freezes the
    convolutions (``requires_grad`` off): the pre-training then clips, noises and trains the dense layers only,
    on top of the random convolutional features.  ``trained="head"`` freezes everything but the last Linear,
    ``"convolutions"`` everything but the convolutions (random dense layers read what they learn)."""
    if trained != "all":
        kind = torch.nn.Conv2d if trained == "convolutions" else torch.nn.Linear
        layers = [m for m in encoder.modules() if isinstance(m, kind)]
        kept = layers if trained == "convolutions" else layers[-1:]
        ids = {id(p) for m in kept for p in m.parameters()}
        for p in encoder.parameters():
            p.requires_grad_(id(p) in ids)
        return [{"params": [p for p in encoder.parameters() if id(p) in ids], "lr": lr}]
    convs = [p for m in encoder.modules() if isinstance(m, torch.nn.Conv2d) for p in m.parameters()]
    ids = {id(p) for p in convs}
    rest = [p for p in encoder.parameters() if id(p) not in ids]
    if conv_lr_scale == 1 or not convs:
        return [{"params": rest + convs, "lr": lr}]
    if conv_lr_scale == 0:
        for p in convs:
            p.requires_grad_(False)
        return [{"params": rest, "lr": lr}]
    return [{"params": rest, "lr": lr}, {"params": convs, "lr": lr * conv_lr_scale}]


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(summary)
    for k, (method, stats) in enumerate(summary.items()):
        xs = [i + k * width for i in range(len(METRICS))]
        ax.bar(xs, [stats[m]["mean"] for m in METRICS], width, yerr=[stats[m]["sd"] for m in METRICS],
               capsize=3, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(METRICS))])
    ax.set_xticklabels(["probe, 10 labels/class", "probe, 100 labels/class", "3-NN, all labels"])
    ax.set_ylabel("test accuracy (queries)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="lower right")
    from report import save_plot

    save_plot(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    # batch, epochs and crop default per dataset: 1024, 5 and 2 on MNIST; 256, 30 and 1 on digits
    sys.path.insert(0, str(Path(__file__).parent))
    from logit_dp import add_pretraining_options
    from report import print_table, use_allocator, write_json

    from clipless.contrastive.evaluation import LAYERS
    from clipless.contrastive.logit_dp import CROSS_TERMS

    add_pretraining_options(p, batch_size=None, epochs=None, crop_padding=None)
    p.add_argument("--encoder", choices=["mlp", "cnn"], default="mlp",
                   help="cnn: 17-31 s per Logit-DP step at batch 1024 on 2 cores, 7 s with --channels 8 16 "
                   "--input-pool 2 (docs/results.md)")
    p.add_argument("--channels", type=int, nargs="*", default=[16, 32], help="conv channels (cnn encoder)")
    p.add_argument("--input-pool", type=int, default=1, metavar="K",
                   help="average K x K pixel windows before the encoder (after the crops): fewer conv positions")
    p.add_argument("--conv-lr-scale", type=float, default=1.0, metavar="S",
                   help="cnn encoder: the convolutions learn at S times --lr; 0 freezes them (random features, "
                   "only the dense layers are pre-trained, for every method)")
    p.add_argument("--trained", choices=["all", "head", "convolutions"], default="all",
                   help="what pre-training trains, for every method: the whole encoder, its last Linear only, or "
                   "its convolutions only (cnn); the rest stays at its random initialization")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="the pre-training optimizer, for every method; sgd needs each method's own --lr (on "
                   "MNIST about 1 for Logit-DP and 100-400 for Naive-DP, chosen on validation in docs/results.md)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's heavy-ball momentum (--optimizer sgd)")
    p.add_argument("--validation", type=int, default=0, metavar="N",
                   help="hold out the last N training images for evaluation instead of the test split")
    p.add_argument("--layers", nargs="+", default=["embedding"], choices=LAYERS,
                   help="what the probes and kNN read: the normalized embedding and/or the representation before "
                   "the last Linear (SimCLR's h); the first is the table's, the others go to the JSON and log")
    p.add_argument("--cross-term", choices=CROSS_TERMS, default="exact",
                   help="Logit-DP's pair norms (clipless pretrain --cross-term)")
    p.add_argument("--loss", choices=["contrastive", "spectral"], default="contrastive",
                   help="clipless pretrain --loss: spectral is HaoChen et al.'s -2 Z_ii + sum_(j != i) Z_ij^2 / "
                   "(n - 1), Logit-DP sensitivity (2B/tau)(1 + 3/tau) against contrastive's 2 (B/tau)(1 + e^(2/tau))")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where pre-training runs (cuda: IEEE float32 products, which "
                   "the private step requires)")
    p.add_argument("--out", default="results/logit_dp_probe.json")
    args = p.parse_args()
    if not args.conv_lr_scale >= 0:
        raise SystemExit(f"--conv-lr-scale must be >= 0, got {args.conv_lr_scale}")
    if args.trained != "all" and args.conv_lr_scale != 1:
        raise SystemExit("--trained and --conv-lr-scale both choose what trains: give one")
    if args.trained == "convolutions" and args.encoder != "cnn":
        raise SystemExit("--trained convolutions needs --encoder cnn")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    use_allocator("tuned")  # as `clipless pretrain` runs
    mnist = args.dataset == "mnist"
    args.batch_size = args.batch_size or (1024.0 if mnist else 256.0)
    args.epochs = args.epochs or (5 if mnist else 30)
    args.crop_padding = args.crop_padding if args.crop_padding is not None else (2 if mnist else 1)

    from clipless.data.datasets import load_digits, load_mnist

    data = load_mnist(args.data_dir) if mnist else load_digits()
    if args.validation:
        from clipless.data.datasets import ArrayDataset, DataSplit

        n = len(data.train)
        if not 0 < args.validation < n:
            raise SystemExit(f"--validation must be in 1..{n - 1}, got {args.validation}")
        x, y = data.train.features, data.train.labels
        cut = n - args.validation
        data = DataSplit(ArrayDataset(x[:cut], y[:cut]), ArrayDataset(x[cut:], y[cut:]), data.name + "-validation",
                         data.coordinate_bound, data.num_classes)
    runs = []
    for seed in args.seeds:
        for method in args.methods:
            runs.append(run(args, data, method, seed))
            r = runs[-1]
            print(f"{method} seed {seed}: " + ", ".join(f"{m} {r[m]:.4f}" for m in METRICS)
                  + f" ({r['train_s']:.0f} s)", flush=True)
            for layer in args.layers[1:]:
                print(f"  {layer}: " + ", ".join(f"{m} {r[layer][m]:.4f}" for m in METRICS), flush=True)

    def summarize(metrics_of) -> dict:
        summary = {}
        for method in args.methods:
            mine = [r for r in runs if r["method"] == method]
            summary[method] = {m: {"mean": statistics.mean(metrics_of(r)[m] for r in mine),
                                   "sd": statistics.stdev(metrics_of(r)[m] for r in mine) if len(mine) > 1 else 0.0,
                                   "values": [metrics_of(r)[m] for r in mine]} for m in METRICS}
            eps = [r["epsilon"] for r in mine if r["epsilon"] is not None]
            summary[method]["epsilon"] = max(eps) if eps else None
            summary[method]["train_s"] = statistics.mean(r["train_s"] for r in mine)
        return summary

    by_layer = {layer: summarize(lambda r, k=k, layer=layer: r if k == 0 else r[layer])
                for k, layer in enumerate(args.layers)}
    for layer, summary in by_layer.items():
        print(f"{layer}:")
        print_table(f"{'method':>11} {'epsilon':>8} " + " ".join(f"{m:>22}" for m in METRICS) + f" {'train s':>8}",
                    [f"{method:>11} {'-' if s['epsilon'] is None else format(s['epsilon'], '.3f'):>8} "
                     + " ".join(f"{100 * s[m]['mean']:>14.1f} +- {100 * s[m]['sd']:4.1f}" for m in METRICS)
                     + f" {s['train_s']:8.0f}" for method, s in summary.items()])
    summary = by_layer[args.layers[0]]
    write_json(args.out, {"config": vars(args), "summary": summary, "summary_by_layer": by_layer, "runs": runs})
    figure = Path(args.out).with_suffix(".png")
    plot(summary, figure, f"{args.dataset}, {args.encoder} encoder: contrastive pre-training at epsilon "
                          f"{args.epsilon:g} ({len(args.seeds)} seeds, {args.layers[0]})")
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
