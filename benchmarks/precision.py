"""Per-example gradient norms against their certified bounds, in IEEE float32 and in reduced-precision arithmetic.

    python benchmarks/precision.py --examples 300 --out results/precision.json
    python benchmarks/precision.py --device cuda --models mlp cnn --out results/precision_cuda.json  # TF32 rows too

Models at their projected initial weights, every example on the input bound: ``mlp``, a 64-input Lipschitz MLP
(256-256, 10 classes, tau 64); ``cnn``, the CLI's Lipschitz CNN (16-32 channels) on 1 x 16 x 16 inputs of norm 4.
For each arithmetic, the largest ratio over the examples and layers of a true per-example gradient norm (autograd,
one example at a time, in that arithmetic) to the layer's certified bound; the rows ``mlp, batch`` take the MLP's
per-example gradients from one forward and backward of the whole batch instead (where TF32 matrix kernels run).
The bounds are certified for IEEE
float32/float64 arithmetic: a ratio above 1 is why the input guard refuses autocast, float16/bfloat16 weights or
inputs, and TF32 matrix products and convolutions (on CUDA, ``torch.backends.cudnn.allow_tf32`` is on by default).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Iterator, Optional

import torch
from report import print_table, write_json

SHAPES = {"mlp": ((64,), 1.0), "cnn": ((1, 16, 16), 4.0)}


@contextlib.contextmanager
def arithmetic(device: str, tf32: bool, autocast: Optional[torch.dtype]) -> Iterator[None]:
    """IEEE float32 products (``tf32=False``) or TF32 matrix products and convolutions, optionally under autocast."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        torch.set_float32_matmul_precision(precision)


def worst_ratio(model_name: str, examples: int, device: str, tf32: bool, autocast: Optional[torch.dtype]) -> float:
    import clipless as cl
    from clipless.privacy import BoundEngine

    torch.manual_seed(0)
    shape, radius = SHAPES[model_name]
    if model_name == "mlp":
        model, loss = cl.lipschitz_mlp(shape, 10, hidden=(256, 256)), cl.TauCrossEntropy(64.0)
    else:
        model, loss = cl.lipschitz_cnn(shape, 10, channels=(16, 32), input_clip=radius), cl.TauCrossEntropy(8.0)
    engine = BoundEngine(model, shape, radius, loss)
    engine.project_()
    report = engine.compute()
    model = model.to(device)
    x = torch.randn(examples, *shape, device=device)
    x = x * (radius / x.flatten(1).norm(dim=1)).reshape((-1,) + (1,) * len(shape))
    y = torch.randint(0, 10, (examples,), device=device)
    params = [p for layer in report.layers for p in layer.params]
    worst = 0.0
    for i in range(examples):
        with arithmetic(device, tf32, autocast):
            out = model(x[i:i + 1])
            grads = torch.autograd.grad(loss.per_example(out.float(), y[i:i + 1]).sum(), params, allow_unused=True)
        k = 0
        for layer in report.layers:
            part = [g for g in grads[k:k + len(layer.params)] if g is not None]
            k += len(layer.params)
            norm = sum(float(g.double().norm()) ** 2 for g in part) ** 0.5
            worst = max(worst, norm / layer.bound)
    return worst


def worst_ratio_batched(examples: int, device: str, tf32: bool, autocast: Optional[torch.dtype]) -> float:
    """The MLP's dense layers, from one forward and backward of the whole batch (where GEMMs, hence TF32, run; a
    one-example forward may take a matrix-vector kernel that never does): example ``i``'s weight gradient is the
    rank-one ``delta_i h_i^T``, of norm ``||delta_i|| ||h_i||``, with ``h_i`` the layer's input and ``delta_i`` the
    gradient at its output, both as the batch computed them."""
    import clipless as cl
    from clipless.privacy import BoundEngine

    torch.manual_seed(0)
    shape, radius = SHAPES["mlp"]
    model, loss = cl.lipschitz_mlp(shape, 10, hidden=(256, 256)), cl.TauCrossEntropy(64.0)
    engine = BoundEngine(model, shape, radius, loss)
    engine.project_()
    report = engine.compute()
    model = model.to(device)
    dense = {name: m for name, m in model.named_modules() if isinstance(m, cl.LipschitzLinear)}
    assert all(m.bias is None for m in dense.values()), "the rank-one norm covers weights without a bias"
    inputs, outputs = {}, {}

    def keep(name: str):
        def hook(module, args, out) -> None:
            out.retain_grad()
            inputs[name], outputs[name] = args[0], out
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in dense.items()]
    x = torch.randn(examples, *shape, device=device)
    x = x * (radius / x.flatten(1).norm(dim=1)).reshape((-1,) + (1,) * len(shape))
    y = torch.randint(0, 10, (examples,), device=device)
    with arithmetic(device, tf32, autocast):
        loss.per_example(model(x).float(), y).sum().backward()
    for h in hooks:
        h.remove()
    bounds = {layer.name: layer.bound for layer in report.layers}
    worst = 0.0
    for name in dense:
        norms = outputs[name].grad.double().norm(dim=1) * inputs[name].detach().double().flatten(1).norm(dim=1)
        worst = max(worst, float(norms.max()) / bounds[name])
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["mlp"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="results/precision.json")
    args = parser.parse_args()
    modes = [("float32", False, None)]
    if args.device.startswith("cuda"):
        modes.append(("TF32 products and convolutions", True, None))
    modes += [("autocast bfloat16", False, torch.bfloat16), ("autocast float16", False, torch.float16)]
    rows = [{"model": m, "arithmetic": name,
             "max gradient / bound": worst_ratio(m, args.examples, args.device, tf32, dt)}
            for m in args.models for name, tf32, dt in modes]
    rows += [{"model": "mlp, batch", "arithmetic": name,
              "max gradient / bound": worst_ratio_batched(args.examples, args.device, tf32, dt)}
             for name, tf32, dt in modes]
    print_table(f"{'model':<11} {'arithmetic':<32} {'max gradient / certified bound':>32}",
                [f"{r['model']:<11} {r['arithmetic']:<32} {r['max gradient / bound']:>32.6f}" for r in rows])
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write_json(args.out, {"examples": args.examples, "device": device, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
