"""Where a Logit-DP step on a CNN encoder spends its time, against the machine's matrix-product rate.

    python benchmarks/logit_dp_profile.py --batch-size 256 --cross-batch 512 --out results/logit_dp_profile.json

Two measurements, in one process:

1. One per-example conv Jacobian (``_conv_jacobian``) of the CLI's CNN encoder at ``--batch-size``, with the
   time of each module's vector-Jacobian product (``_batched_vjp``) and of the ``delta unfold(h)^T`` products.
2. The conv block's cross term (``_jacobian_terms``, ``2 n^2 d p`` multiply-adds) on random Jacobians of the
   encoder's shape at ``--cross-batch`` examples, as multiply-adds per second beside one large square float32
   matrix product: the fraction of the machine's product rate the cross term reaches.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from report import print_table, write_json


def time_conv_jacobian(n: int, dim: int, chunk: int) -> dict:
    import clipless.contrastive.logit_dp as logit_dp
    from clipless.contrastive.pretrain import build_encoder

    torch.manual_seed(0)
    encoder = build_encoder("cnn", (1, 28, 28), dim)
    x = torch.rand(n, 1, 28, 28)
    convs = [m for m in encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    spent: dict = collections.defaultdict(float)
    vjp, einsum = logit_dp._batched_vjp, logit_dp.torch.einsum

    def timed_vjp(module, h, g):
        start = time.perf_counter()
        out = vjp(module, h, g)
        name = type(module).__name__ if isinstance(module, torch.nn.Module) else "normalize"
        spent[name] += time.perf_counter() - start
        return out

    def timed_einsum(*args, **kwargs):
        start = time.perf_counter()
        out = einsum(*args, **kwargs)
        spent[f"einsum {args[0]}"] += time.perf_counter() - start
        return out

    logit_dp._batched_vjp, logit_dp.torch.einsum = timed_vjp, timed_einsum
    try:
        logit_dp._conv_jacobian(encoder, convs, x, chunk)  # warm-up
        spent.clear()
        start = time.perf_counter()
        jac = logit_dp._conv_jacobian(encoder, convs, x, chunk)
        total = time.perf_counter() - start
    finally:
        logit_dp._batched_vjp, logit_dp.torch.einsum = vjp, einsum
    return {"batch": n, "total_s": total, "p_conv": jac.shape[2], "parts_s": dict(spent)}


def time_cross_term(n: int, dim: int, p: int) -> dict:
    from clipless.contrastive.logit_dp import _jacobian_terms

    gen = torch.Generator().manual_seed(0)
    ja, jb = torch.randn(n, dim, p, generator=gen), torch.randn(n, dim, p, generator=gen)
    u, v = torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)
    start = time.perf_counter()
    _jacobian_terms(ja, jb, u, v)
    cross = time.perf_counter() - start
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    a @ b
    start = time.perf_counter()
    for _ in range(3):
        a @ b
    gemm_rate = 3 * 2048 ** 3 / (time.perf_counter() - start)
    macs = 2 * n * n * dim * p
    return {"batch": n, "p": p, "cross_term_s": cross, "cross_term_gmacs": macs / cross / 1e9,
            "square_gemm_gmacs": gemm_rate / 1e9, "fraction_of_gemm_rate": macs / cross / gemm_rate,
            "at_gemm_rate_s": macs / gemm_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--cross-batch", type=int, default=512)
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64, help="examples per chunk of the conv Jacobian (as the step)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/logit_dp_profile.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    jac = time_conv_jacobian(args.batch_size, args.embedding_dim, args.chunk)
    print(f"conv Jacobian at batch {args.batch_size}: {jac['total_s']:.3f} s")
    print_table(f"{'part':>40} {'s':>8}",
                [f"{k:>40} {v:8.3f}" for k, v in sorted(jac["parts_s"].items(), key=lambda kv: -kv[1])])
    cross = time_cross_term(args.cross_batch, args.embedding_dim, jac["p_conv"])
    print_table(f"{'batch':>6} {'p':>6} {'cross s':>9} {'G MAC/s':>9} {'square GEMM G MAC/s':>20} {'fraction':>9}",
                [f"{cross['batch']:6d} {cross['p']:6d} {cross['cross_term_s']:9.2f} {cross['cross_term_gmacs']:9.1f} "
                 f"{cross['square_gemm_gmacs']:20.1f} {cross['fraction_of_gemm_rate']:9.2f}"])
    write_json(args.out, {"threads": args.threads, "torch": torch.__version__, "conv_jacobian": jac,
                          "cross_term": cross})


if __name__ == "__main__":
    main()
