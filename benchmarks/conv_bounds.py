"""Certified convolution bounds: reshaped-kernel bound vs exact FFT bound vs the true operator norm.

    python benchmarks/conv_bounds.py --out results/conv_bounds.json

For each configuration and kernel kind, prints both bounds, what the layer declares (``operator_norm='fft'``:
the smaller of the two) and the gain reshaped / declared. The true norm is
the largest singular value of the convolution's dense matrix (float64), computed independently of both bounds.
A layer projected with the reshaped bound to l <= 1 has a true norm of 1 / gain: that is how much every
conv layer contracts the signal (and the gradients) for nothing.

Kernels: ``gaussian`` (i.i.d. N(0, 1)), ``orthogonal`` (the library's init: orthogonal reshaped matrix) and
``smooth`` (all taps equal up to 10% noise, the worst case for the reshaped bound: the frequency response
peaks at 0 and sums all taps).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from report import print_table, write_json

import clipless as cl

CONFIGS = [  # (c_in, c_out, kernel, input size, stride, padding mode)
    (1, 16, 3, 28, 1, "zeros"),
    (16, 32, 3, 14, 1, "zeros"),
    (16, 32, 3, 14, 2, "zeros"),
    (32, 32, 3, 8, 1, "zeros"),
    (8, 8, 5, 16, 1, "zeros"),
    (3, 16, 3, 32, 1, "circular"),
]


def true_operator_norm(conv: cl.LipschitzConv2d, size: int) -> float:
    weight = conv.weight.detach().double()
    n = conv.in_channels * size * size
    eye = torch.eye(n, dtype=torch.float64).reshape(n, conv.in_channels, size, size)
    with torch.no_grad():
        if conv.padding_mode == "circular":
            ph, pw = conv.padding
            out = F.conv2d(F.pad(eye, (pw, pw, ph, ph), mode="circular"), weight, stride=conv.stride)
        else:
            out = F.conv2d(eye, weight, stride=conv.stride, padding=conv.padding)
    matrix = out.reshape(n, -1)
    gram = matrix @ matrix.T if matrix.shape[0] <= matrix.shape[1] else matrix.T @ matrix
    return math.sqrt(float(torch.linalg.eigvalsh(gram)[-1]))


def make_kernel(conv: cl.LipschitzConv2d, kind: str, gen: torch.Generator) -> None:
    with torch.no_grad():
        if kind == "gaussian":
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        elif kind == "smooth":
            base = torch.randn(conv.out_channels, conv.in_channels, 1, 1, generator=gen)
            conv.weight.copy_(base * (1 + 0.1 * torch.randn(conv.weight.shape, generator=gen)))
        # "orthogonal": keep the layer's own initialisation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/conv_bounds.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)  # the orthogonal initialisation draws from the global generator
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for cin, cout, k, size, stride, mode in CONFIGS:
        for kind in ("gaussian", "orthogonal", "smooth"):
            padding = "same" if stride == 1 else k // 2
            conv = cl.LipschitzConv2d(cin, cout, k, stride=stride, padding=padding, padding_mode=mode,
                                      operator_norm="fft")
            make_kernel(conv, kind, gen)
            shape = (cin, size, size)
            reshaped = math.sqrt(conv.overlap_for(shape)) * cl.privacy.certified.certified_spectral_norm(conv._kernel_matrix())
            fft = conv.fft_operator_norm(shape)
            true = true_operator_norm(conv, size)
            assert fft >= true * (1 - 1e-9) and reshaped >= true * (1 - 1e-9), "a certified bound fell below the truth"
            used = conv.certified_lipschitz(shape)  # what the layer declares: min of the two
            rows.append({"c_in": cin, "c_out": cout, "kernel": k, "size": size, "stride": stride, "padding": mode,
                         "weights": kind, "reshaped": reshaped, "fft": fft, "declared": used, "true": true,
                         "gain": reshaped / used, "declared_over_true": used / true})
    print_table(
        f"{'conv':>22} {'weights':>10} {'reshaped':>9} {'FFT':>9} {'declared':>9} {'true':>9} {'gain':>6} "
        f"{'decl/true':>9}",
        [f"{r['c_in']:>3}->{r['c_out']:<3} k{r['kernel']} {r['size']:>2}px s{r['stride']} {r['padding'][:4]:>4} "
         f"{r['weights']:>10} {r['reshaped']:9.3f} {r['fft']:9.3f} {r['declared']:9.3f} {r['true']:9.3f} "
         f"{r['gain']:6.2f} {r['declared_over_true']:9.4f}" for r in rows],
    )
    write_json(args.out, {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
