"""Memory and time of one Logit-DP step vs batch size, beside Naive-DP and a non-private step.

    python benchmarks/logit_dp_memory.py --batch-sizes 64 256 1024 --out results/logit_dp_memory.json
    python benchmarks/logit_dp_memory.py --encoder cnn --batch-sizes 64 256 1024 --out results/logit_dp_memory_cnn.json
    python benchmarks/logit_dp_memory.py --encoder cnn --batch-sizes 1024 --allocator system  # glibc's defaults
    python benchmarks/logit_dp_memory.py --encoder cnn --channels 8 16 --input-pool 2 --batch-sizes 512 1024
    python benchmarks/logit_dp_memory.py --encoder cnn --batch-sizes 1024 --methods logit_dp logit_dp_cs naive_dp

Each (method, n) runs in its own process; peak memory = peak RSS minus the RSS before the first step.
The columns ``n^2 d^2`` and ``n^2 p`` give, in MB of float32, the size of all d x d Gram blocks and of
all n^2 parameter-sized pair gradients (what a per-pair implementation would materialize).  Logit-DP
never builds either: it contracts the Gram blocks with the embeddings as it forms them
(``clipless.contrastive.logit_dp``), so its memory stays below the ``n^2 d^2`` column.
``--allocator tuned`` (the default, as ``clipless pretrain`` runs) calls ``clipless.train.tune_cpu_allocator()``
in every worker; ``system`` keeps glibc's defaults (the tables of docs/results.md before its allocator section).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from report import ALLOCATORS, rss_mb, use_allocator

# logit_dp_cs: Logit-DP with the convolutions' pair cross terms bounded by Cauchy-Schwarz (cross_term="cauchy_schwarz")
METHODS = ("logit_dp", "logit_dp_cs", "naive_dp", "nonprivate")


def worker(method: str, n: int, repeats: int, hidden: list, dim: int, encoder_kind: str, channels: list,
           allocator: str, input_pool: int) -> None:
    use_allocator(allocator)
    from clipless.contrastive.logit_dp import logit_dp_gradient, naive_dp_gradient, nonprivate_gradient
    from clipless.contrastive.pretrain import build_encoder

    torch.manual_seed(0)
    encoder = build_encoder(encoder_kind, (1, 28, 28), dim, hidden=hidden, channels=channels,
                            input_pool=input_pool)  # as the CLI's
    xa, xb = torch.rand(n, 1, 28, 28), torch.rand(n, 1, 28, 28)
    step = {
        "logit_dp": lambda: logit_dp_gradient(encoder, xa, xb, "contrastive", 1.0, 1.0),
        "logit_dp_cs": lambda: logit_dp_gradient(encoder, xa, xb, "contrastive", 1.0, 1.0,
                                                 cross_term="cauchy_schwarz"),
        "naive_dp": lambda: naive_dp_gradient(encoder, xa, xb, "contrastive", 1.0, 1.0),
        "nonprivate": lambda: nonprivate_gradient(encoder, xa, xb, "contrastive", 1.0),
    }[method]
    before = rss_mb()
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        step()
        if i >= 1:
            times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for p in encoder.parameters())
    print(json.dumps({"median_s": statistics.median(times), "peak_mb": max(peak - before, 0.0), "params": params}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--methods", nargs="+", default=["logit_dp", "naive_dp", "nonprivate"], choices=METHODS,
                        help="logit_dp_cs: Logit-DP with cross_term='cauchy_schwarz'")
    parser.add_argument("--encoder", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--hidden", type=int, nargs="*", default=[256])
    parser.add_argument("--channels", type=int, nargs="*", default=[16, 32], help="conv channels (cnn encoder)")
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--input-pool", type=int, default=1, metavar="K",
                        help="average K x K pixel windows before the encoder (clipless pretrain --input-pool)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=None,
                        help="examples per conv Jacobian chunk (default: chosen by the activation size, between "
                        "clipless.contrastive.logit_dp.CHUNK and MAX_CHUNK)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="tuned",
                        help="C allocator settings of the workers (module doc)")
    parser.add_argument("--out", default="results/logit_dp_memory.json")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.chunk is not None:
        from clipless.contrastive import logit_dp

        logit_dp.CHUNK = logit_dp.MAX_CHUNK = args.chunk
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.repeats, args.hidden, args.embedding_dim, args.encoder,
               args.channels, args.allocator, args.input_pool)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    rows = []
    d = args.embedding_dim
    for n in args.batch_sizes:
        row: dict = {"batch": n}
        for method in args.methods:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", method, str(n), "--repeats", str(args.repeats),
                 "--threads", str(args.threads), "--embedding-dim", str(d), "--encoder", args.encoder,
                 "--allocator", args.allocator, "--input-pool", str(args.input_pool),
                 "--channels", *map(str, args.channels), "--hidden", *map(str, args.hidden),
                 *(["--chunk", str(args.chunk)] if args.chunk is not None else [])],
                capture_output=True, text=True,
            )
            if out.returncode != 0:
                raise RuntimeError(f"{method} n={n} failed:\n{out.stderr[-2000:]}")
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            row[f"{method}_s"], row[f"{method}_mb"] = measured["median_s"], measured["peak_mb"]
            row["params"] = measured["params"]
        row["gram_blocks_mb"] = n * n * d * d * 4 / 2 ** 20
        row["pair_gradients_mb"] = n * n * row["params"] * 4 / 2 ** 20
        rows.append(row)
        print(row, flush=True)
    print_table(
        f"{'batch':>6} " + " ".join(f"{m + ' s':>13}" for m in args.methods) + " "
        + " ".join(f"{m + ' MB':>14}" for m in args.methods) + f" {'n^2 d^2 MB':>11} {'n^2 p MB':>11}",
        [f"{r['batch']:6d} " + " ".join(f"{r[m + '_s']:13.3f}" for m in args.methods) + " "
         + " ".join(f"{r[m + '_mb']:14.0f}" for m in args.methods)
         + f" {r['gram_blocks_mb']:11.0f} {r['pair_gradients_mb']:11.3g}" for r in rows],
    )
    write_json(args.out, {"threads": args.threads, "allocator": args.allocator, "encoder": args.encoder,
                          "hidden": args.hidden,
                          "channels": args.channels if args.encoder == "cnn" else None, "embedding_dim": d,
                          "input_pool": args.input_pool,
                          "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
