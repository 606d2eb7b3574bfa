"""Augmentation multiplicity: accuracy and step cost of K augmented rows per example (issue 18, item 5).

    python benchmarks/augmult.py --ks 1 2 4 --seeds 0 1 2 --out results/augmult.json
    python benchmarks/augmult.py --dataset mnist --data-dir ../shared/data/mnist --model cnn --epochs 5 ...

Each (K, seed) is one ``clipless train`` run (same flags as the CLI, secret-free fixed seeds so runs can be
repeated) at the same target epsilon: K changes neither the per-example bound nor the noise nor epsilon, only
how many augmented copies of each sampled example the gradient averages.  Reported: test accuracy (mean and
spread over seeds), epsilon, and wall time per epoch.  The accuracy is read on the test split after training;
no setting is chosen on it (K is the only variable).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data-dir")
    p.add_argument("--model", default="cnn")
    p.add_argument("--channels", type=int, nargs="*", default=[16, 32])
    p.add_argument("--hidden", type=int, nargs="*", default=[])
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=float, default=256)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--shift", type=int, default=1)
    p.add_argument("--input-clip", type=float)
    p.add_argument("--loss-grad-clip", type=float)
    p.add_argument("--tau", type=float, default=8.0)
    p.add_argument("--out", default="results/augmult.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    from clipless.cli import DEFAULTS, run_train, validate

    rows = []
    for k in args.ks:
        runs = []
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as out:
                config = validate(dict(DEFAULTS, dataset=args.dataset, data_dir=args.data_dir, model=args.model,
                                       channels=args.channels, hidden=args.hidden, epsilon=args.epsilon,
                                       epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=seed,
                                       noise_seed=seed, augmult=k, augment_shift=args.shift, progress=False,
                                       features="none", input_clip=args.input_clip, tau=args.tau,
                                       loss_grad_clip=args.loss_grad_clip, output_dir=out,
                                       log_train_stats=True))  # for the epoch times (non-private)
                result = run_train(config)
            runs.append({"seed": seed, "test_accuracy": result["test_accuracy"], "epsilon": result["epsilon"],
                         "epoch_time_s": statistics.median(h["nonprivate_epoch_time_s"] for h in result["history"])})
            print(f"K={k} seed={seed}: {runs[-1]}", flush=True)
        accs = [r["test_accuracy"] for r in runs]
        rows.append({"K": k, "runs": runs, "mean_accuracy": statistics.mean(accs),
                     "sd_accuracy": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "epsilon": max(r["epsilon"] for r in runs),
                     "epoch_time_s": statistics.median(r["epoch_time_s"] for r in runs)})
    print_table(f"{'K':>3} {'test acc (mean +- sd)':>22} {'epsilon':>8} {'s / epoch':>10}",
                [f"{r['K']:>3} {100 * r['mean_accuracy']:>14.2f} +- {100 * r['sd_accuracy']:4.2f} "
                 f"{r['epsilon']:>8.3f} {r['epoch_time_s']:>10.2f}" for r in rows])
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
