"""Orthogonal (BCOP) against norm-contracting Lipschitz convolutions, same architectures and settings (issue 18).

    python benchmarks/orthogonal_conv.py --out results/orthogonal_conv.json
    python benchmarks/orthogonal_conv.py --dataset mnist --data-dir ../shared/data/mnist --models cnn --epochs 5 \
        --batch-size 4096 --target-only --out results/orthogonal_conv_mnist.json

Every run goes through ``clipless train`` (the CLI's defaults unless set here) with each ``--conv`` of ``--convs``,
one after the other in one process, and reports test accuracy, epsilon and wall time.
Two privacy levels: little (``--noise-multiplier 0.2``, rdp accountant, no budget limit: the epsilon reported is
in the hundreds, no meaningful guarantee; it shows what the architectures can learn) and the target ``--epsilon``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def run(flags: list) -> dict:
    from clipless.cli import main

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        assert main(["train", *flags, "--no-progress", "--output-dir", out]) == 0
        result = json.loads((Path(out) / "result.json").read_text())
    return {"accuracy": result["test_accuracy"], "epsilon": result["epsilon"],
            "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data-dir")
    p.add_argument("--models", nargs="+", default=["cnn", "vgg", "resnet"])
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=float, default=512)
    p.add_argument("--tau", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--loss-grad-clip", type=float, default=0.5)
    p.add_argument("--convs", nargs="+", default=["lipschitz", "orthogonal", "orthogonal_fixed"])
    p.add_argument("--target-only", action="store_true", help="skip the little-noise runs")
    p.add_argument("--out", default="results/orthogonal_conv.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    common = ["--dataset", args.dataset, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
              "--tau", str(args.tau), "--lr", str(args.lr), "--loss-grad-clip", str(args.loss_grad_clip),
              "--features", "none"] + (["--data-dir", args.data_dir] if args.data_dir else [])
    levels = {"sigma 0.2": ["--noise-multiplier", "0.2", "--accountant", "rdp", "--epsilon", "1e9"],
              f"epsilon {args.epsilon:g}": ["--epsilon", str(args.epsilon)]}
    if args.target_only:
        del levels["sigma 0.2"]
    rows = []
    for model in args.models:
        for level, flags in levels.items():
            for conv in args.convs:
                outcome = run(common + flags + ["--model", model, "--conv", conv])
                rows.append({"model": model, "privacy": level, "conv": conv, **outcome})
                print(rows[-1], flush=True)
    print_table(f"{'model':<7} {'privacy':<11} {'conv':<16} {'test acc':>8} {'epsilon':>9} {'s':>6}",
                [f"{r['model']:<7} {r['privacy']:<11} {r['conv']:<16} {100 * r['accuracy']:8.1f} {r['epsilon']:9.3g} "
                 f"{r['seconds']:6.0f}" for r in rows])
    write_json(args.out, {"dataset": args.dataset, "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
