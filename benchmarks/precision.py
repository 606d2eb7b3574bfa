"""Per-example gradient norms against their certified bounds, in float32 and under reduced-precision autocast.

    python benchmarks/precision.py --examples 300 --out results/precision.json

A 64-input Lipschitz MLP (256-256, 10 classes, tau 64) at its projected initial weights; every example on the
input bound (norm 1). For each arithmetic, the largest ratio over the examples and layers of a true
per-example gradient norm (autograd, one example at a time) to the layer's certified bound. The bounds are
certified for float32/float64 arithmetic: a ratio above 1 is why the input guard refuses autocast and
float16/bfloat16 training forwards.
"""

from __future__ import annotations

import argparse

import torch
from report import print_table, write_json


def worst_ratio(examples: int, dtype) -> float:
    import clipless as cl
    from clipless.privacy import BoundEngine

    torch.manual_seed(0)
    model = cl.lipschitz_mlp((64,), 10, hidden=(256, 256))
    loss = cl.TauCrossEntropy(64.0)
    engine = BoundEngine(model, (64,), 1.0, loss)
    engine.project_()
    report = engine.compute()
    x = torch.randn(examples, 64)
    x = x / x.norm(dim=1, keepdim=True)
    y = torch.randint(0, 10, (examples,))
    params = [p for layer in report.layers for p in layer.params]
    worst = 0.0
    for i in range(examples):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            out = model(x[i:i + 1])
        grads = torch.autograd.grad(loss.per_example(out.float(), y[i:i + 1]).sum(), params, allow_unused=True)
        k = 0
        for layer in report.layers:
            part = [g for g in grads[k:k + len(layer.params)] if g is not None]
            k += len(layer.params)
            norm = sum(float(g.double().norm()) ** 2 for g in part) ** 0.5
            worst = max(worst, norm / layer.bound)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--out", default="results/precision.json")
    args = parser.parse_args()
    rows = [{"arithmetic": name, "max gradient / bound": worst_ratio(args.examples, dtype)}
            for name, dtype in (("float32", None), ("autocast bfloat16", torch.bfloat16),
                                ("autocast float16", torch.float16))]
    print_table(f"{'arithmetic':<20} {'max gradient / certified bound':>32}",
                [f"{r['arithmetic']:<20} {r['max gradient / bound']:>32.6f}" for r in rows])
    write_json(args.out, {"examples": args.examples, "rows": rows})


if __name__ == "__main__":
    main()
