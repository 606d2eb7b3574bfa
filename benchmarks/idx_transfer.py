"""Does the MNIST recipe transfer, untouched, to other 28x28 grayscale IDX datasets? (issue 18, item 4)

    python benchmarks/idx_transfer.py --mnist-dir ../shared/data/mnist --out results/idx_transfer.json
    python benchmarks/idx_transfer.py --extra-dirs ~/data/fashion-mnist   # any directory of four IDX files

The recipe is ``configs/mnist.yaml`` run through the CLI (``clipless train --config configs/mnist.yaml --dataset
idx --data-dir DIR``) with nothing changed. Only MNIST is in the project's data, so the script also writes
datasets MNIST's settings were never looked at on, in IDX files:

- ``inverted``: every pixel x -> 1 - x (white background; the input norms change completely);
- ``transposed``: every image transposed and mirrored (other stroke directions for the wavelets).

The recipe's expected batch (4096) needs at least that many training images: a smaller set is refused with
that message (``--batch-size`` then is the one setting to change).

Each row is one private run at the recipe's epsilon, with OS-entropy noise (``--noise-seed`` to repeat one).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "mnist.yaml"


def write_idx_dataset(directory: Path, train: tuple, test: tuple) -> Path:
    """``(images in [0, 1] (n, 28, 28), labels)`` pairs as the four MNIST-named IDX files (unsigned bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    from clipless.data.datasets import write_idx

    for prefix, (images, labels) in (("train", train), ("t10k", test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", np.rint(np.asarray(images) * 255))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", np.asarray(labels))
    return directory


def variants(mnist_dir: Path, root: Path) -> dict:
    import clipless as cl

    mnist = cl.load_mnist(mnist_dir)
    sides = [(s.features[:, 0].numpy(), s.labels.numpy()) for s in (mnist.train, mnist.test)]
    dirs = {
        "inverted": write_idx_dataset(root / "inverted", *[(1.0 - x, y) for x, y in sides]),
        "transposed": write_idx_dataset(root / "transposed",
                                        *[(x.transpose(0, 2, 1)[:, :, ::-1], y) for x, y in sides]),
    }
    return dirs


def run(name: str, directory: Path, out_dir: Path, extra: list) -> dict:
    from clipless.cli import main as cli

    run_dir = out_dir / name
    args = ["train", "--config", str(RECIPE), "--dataset", "idx", "--data-dir", str(directory), "--output-dir",
            str(run_dir), "--no-progress", *extra]
    if cli(args) != 0:
        raise RuntimeError(f"clipless {' '.join(args)} failed")
    result = json.loads((run_dir / "result.json").read_text())
    return {"dataset": name, "n_train": result.get("n_train"), "test_accuracy": result["test_accuracy"],
            "epsilon": result["epsilon"], "delta": result["delta"], "steps": result["steps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mnist-dir", default="../shared/data/mnist")
    p.add_argument("--extra-dirs", nargs="*", default=[], help="more directories of four IDX files")
    p.add_argument("--noise-seed", type=int, default=None)
    p.add_argument("--out", default="results/idx_transfer.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    torch.set_num_threads(2)
    extra = ["--noise-seed", str(args.noise_seed)] if args.noise_seed is not None else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        datasets = {"mnist": Path(args.mnist_dir), **variants(Path(args.mnist_dir), root / "data"),
                    **{Path(d).name: Path(d) for d in args.extra_dirs}}
        for name, directory in datasets.items():
            rows.append(run(name, directory, root / "runs", extra))
            print(rows[-1], flush=True)
    print_table(f"{'dataset':>12} {'test acc':>9} {'epsilon':>8} {'steps':>6}",
                [f"{r['dataset']:>12} {r['test_accuracy']:9.4f} {r['epsilon']:8.3f} {r['steps']:6d}" for r in rows])
    write_json(args.out, {"recipe": str(RECIPE), "rows": rows})


if __name__ == "__main__":
    main()
