"""One Logit-DP step of this tree against the same step of another commit, alternating in one process.

    python benchmarks/logit_dp_ab.py --commit 0208520 --encoder-channels 8 16 --input-pool 2 --rounds 6

On a shared 2-core machine, steps timed in separate processes vary by 10-30% from one process to the next;
timing both versions (and Naive-DP) in turn in one process, on the same encoder and batch, gives ratios that
can be trusted.  The other commit's ``clipless/contrastive/logit_dp.py`` is loaded as a module of its own
(``git show``, its relative imports made absolute against this tree's package): its other modules must be
compatible.  Prints medians and ratios; writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_commit_module(commit: str):
    """``clipless.contrastive.logit_dp`` as it was at ``commit``."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:src/clipless/contrastive/logit_dp.py"],
                          check=True, capture_output=True, text=True).stdout
    text = re.sub(r"^from \.\.(\S*) import", r"from clipless.\1 import", text, flags=re.M)
    text = re.sub(r"^from \.(\S+) import", r"from clipless.contrastive.\1 import", text, flags=re.M)
    path = Path(tempfile.mkdtemp()) / "logit_dp_at_commit.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("logit_dp_at_commit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the commit to compare with (e.g. the one before a change)")
    parser.add_argument("--encoder-channels", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--input-pool", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--cross-term", choices=["exact", "cauchy_schwarz"], default="cauchy_schwarz")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/logit_dp_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import clipless.contrastive.logit_dp as current
    from clipless.contrastive.pretrain import build_encoder
    from clipless.train import tune_cpu_allocator

    tune_cpu_allocator()
    before = load_commit_module(args.commit)
    torch.manual_seed(0)
    encoder = build_encoder("cnn", (1, 28, 28), args.embedding_dim, hidden=[], channels=args.encoder_channels,
                            input_pool=args.input_pool)
    xa, xb = torch.rand(args.batch_size, 1, 28, 28), torch.rand(args.batch_size, 1, 28, 28)
    steps = {
        "before": lambda: before.logit_dp_gradient(encoder, xa, xb, "contrastive", 1.0, 1.0,
                                                   cross_term=args.cross_term),
        "after": lambda: current.logit_dp_gradient(encoder, xa, xb, "contrastive", 1.0, 1.0,
                                                   cross_term=args.cross_term),
        "naive_dp": lambda: current.naive_dp_gradient(encoder, xa, xb, "contrastive", 1.0, 1.0),
    }
    for step in steps.values():  # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    record = {"commit": args.commit, "channels": args.encoder_channels, "input_pool": args.input_pool,
              "batch": args.batch_size, "cross_term": args.cross_term, "rounds": args.rounds,
              "median_s": median, "times_s": times,
              "before_over_naive": median["before"] / median["naive_dp"],
              "after_over_naive": median["after"] / median["naive_dp"],
              "after_over_before": median["after"] / median["before"]}
    print(f"channels {args.encoder_channels}, input pool {args.input_pool}, batch {args.batch_size}, "
          f"{args.cross_term}: before {median['before']:.3f} s, after {median['after']:.3f} s, Naive-DP "
          f"{median['naive_dp']:.3f} s; before / naive {record['before_over_naive']:.1f}x, after / naive "
          f"{record['after_over_naive']:.1f}x, after / before {record['after_over_before']:.2f}")
    out = Path(args.out)
    from report import write_json

    write_json(out, record, quiet=True)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
