"""Peak memory and time of a private training run with each Poisson batch in physical parts.

    python benchmarks/physical_batches.py --data-dir ../shared/data/mnist --sizes 0 4096 1024 \\
        --out results/physical_batches.json

Each size runs ``clipless train --config configs/mnist_pixels.yaml --epochs 1 --max-physical-batch-size N`` (0: whole
batches of the recipe's expected 16,384 examples) in a fresh process, with a fixed noise seed so that every size
draws the same batches and noise (the released weights then agree to float rounding: the parts only change the
order of the sums).  Peak memory is the process's peak resident set size, the data included; the time is the whole
run's wall time (loading, the record check and the evaluation included).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from report import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent


def worker(size: int, data_dir: str, config: str, threads: int) -> None:
    from clipless.cli import main

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        flags = ["train", "--config", config, "--data-dir", data_dir, "--epochs", "1", "--noise-seed", "0",
                 "--no-progress", "--output-dir", out]
        if size:
            flags += ["--max-physical-batch-size", str(size)]
        start = time.perf_counter()
        assert main(flags) == 0
        seconds = time.perf_counter() - start
        result = json.loads((Path(out) / "result.json").read_text())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": peak, "run_s": seconds, "steps": result["steps"],
                      "test_accuracy": result["test_accuracy"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--config", default=str(ROOT / "configs" / "mnist_pixels.yaml"))
    p.add_argument("--sizes", type=int, nargs="+", default=[0, 4096, 1024],
                   help="largest physical batch (0: the whole Poisson batch)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/physical_batches.json")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.data_dir, args.config, args.threads)
        return
    rows = []
    for size in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--worker", str(size), "--data-dir", args.data_dir,
                              "--config", args.config, "--threads", str(args.threads)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"size {size} failed:\n{out.stderr[-2000:]}")
        rows.append({"max_physical_batch_size": size or None, **json.loads(out.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    print_table(f"{'parts of at most':>17} {'peak MB':>9} {'run s':>7} {'steps':>6} {'test acc':>9}",
                [f"{r['max_physical_batch_size'] or 'whole batch':>17} {r['peak_mb']:9.0f} {r['run_s']:7.1f} "
                 f"{r['steps']:6d} {r['test_accuracy']:9.4f}" for r in rows])
    write_json(args.out, {"config": args.config, "threads": args.threads, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
