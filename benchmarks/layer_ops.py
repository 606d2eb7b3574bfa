"""Time the Lipschitz CNN's own operations, one at a time, at the shapes of ``benchmarks/speed.py``'s CNN.

    python benchmarks/layer_ops.py --batch-sizes 256 1024 --out results/layer_ops.json

Per operation and batch size: the median of ``--repeats`` calls after warm-up (2 threads), in milliseconds:
L2-norm pooling forward and backward and MaxMin forward and backward (on the conv outputs of a
16-32-channel CNN on 28 x 28 inputs), the FFT operator-norm certificate of each convolution, and, for
reference, the standard CNN's ReLU and average pooling on the same tensors. A full step varies by 10-30%
from one process to the next on a shared machine; single operations vary much less, so they show where
a change to one of them goes. Compare two trees by running this script once per tree, alternately
(``PYTHONPATH=<tree>/src``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from clipless.nn.conv import fft_operator_norm
from clipless.nn.functional import l2_norm_pool2d, max_min

# (channels, side) of the two conv outputs of the speed benchmark's CNN, and the kernels' shapes
_ACTIVATIONS = ((16, 28), (32, 14))
_KERNELS = (((16, 1, 3, 3), (1, 28, 28)), ((32, 16, 3, 3), (16, 14, 14)))


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _forward_backward(op, x: torch.Tensor):
    """Two callables: the forward alone, and the backward of a saved forward (a fresh graph each call)."""
    grad = torch.randn_like(op(x.detach()))

    def forward() -> None:
        with torch.no_grad():
            op(x)

    def backward() -> None:
        out = op(x)
        torch.autograd.grad(out, x, grad)

    return forward, backward


def measure(batch: int, repeats: int) -> list:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for channels, side in _ACTIVATIONS:
        x = torch.randn(batch, channels, side, side, generator=gen).requires_grad_()
        ops = {
            "l2_norm_pool2d": lambda t: l2_norm_pool2d(t, 2, 1e-10),
            "avg_pool2d (standard)": lambda t: F.avg_pool2d(t, 2),
            "max_min": lambda t: max_min(t.unflatten(1, (2, channels // 2)), 1).flatten(1, 2),
            "relu (standard)": torch.relu,
        }
        for name, op in ops.items():
            forward, backward = _forward_backward(op, x)
            fwd = _median_ms(forward, repeats)
            both = _median_ms(backward, repeats)
            rows.append({"op": name, "shape": [batch, channels, side, side], "forward_ms": fwd,
                         "backward_ms": max(both - fwd, 0.0), "forward_backward_ms": both})
    for shape, in_shape in _KERNELS:
        kernel = torch.randn(shape, generator=gen)
        ms = _median_ms(lambda: fft_operator_norm(kernel, in_shape, (1, 1), 1, False), repeats)
        rows.append({"op": "fft_operator_norm", "shape": list(shape), "forward_ms": ms, "backward_ms": 0.0,
                     "forward_backward_ms": ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for batch in args.batch_sizes:
        rows += measure(batch, args.repeats)
    print(f"{'op':<24}{'shape':<22}{'forward ms':>12}{'backward ms':>13}{'both ms':>10}")
    for r in rows:
        print(f"{r['op']:<24}{str(tuple(r['shape'])):<22}{r['forward_ms']:>12.3f}{r['backward_ms']:>13.3f}"
              f"{r['forward_backward_ms']:>10.3f}")
    if args.out:
        from report import write_json

        write_json(args.out, {"rows": rows, "threads": args.threads, "repeats": args.repeats})


if __name__ == "__main__":
    main()
