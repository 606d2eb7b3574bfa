"""How tight the per-example gradient bounds of the first convolution are, Lipschitz vs orthogonal (BCOP).

    python benchmarks/orthogonal_tightness.py --out results/orthogonal_tightness.json

The digits CNN of the CLI (input bound 8, tau 16), freshly projected: for 64 training images, the true
per-example gradient norm of each parameter of the first convolution (autograd, one example at a time)
divided by the engine's bound for it.  Noise is calibrated to the bound, so a small ratio means a parameter's
signal drowns.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import clipless as cl
from clipless.privacy.bounds import BoundEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/orthogonal_tightness.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from report import write_json

    rows = []
    torch.manual_seed(0)
    data = cl.load_digits()
    x = torch.stack([data.train[i][0] for i in range(64)])
    y = torch.tensor([int(data.train[i][1]) for i in range(64)])
    loss = cl.TauCrossEntropy(16.0)
    print(f"{'conv':<11} {'parameter':<9} {'bound':>7} {'median ratio':>12} {'max ratio':>9}")
    for conv in ("lipschitz", "orthogonal"):
        model = cl.lipschitz_cnn((1, 8, 8), 10, conv=conv)
        engine = BoundEngine(model, (1, 8, 8), 8.0, loss.lipschitz)
        engine.project_()
        layer = engine.compute().layers[0]
        first = model[0]
        names = [n for n, _ in first.named_parameters()]
        norms = torch.zeros(len(x), len(names))
        for i in range(len(x)):
            grads = torch.autograd.grad(loss.per_example(model(x[i:i + 1]), y[i:i + 1]).sum(), list(first.parameters()))
            norms[i] = torch.stack([g.norm() for g in grads])
        for j, (name, bound) in enumerate(zip(names, layer.tensor_bounds)):
            ratio = norms[:, j] / bound
            print(f"{conv:<11} {name:<9} {bound:7.2f} {float(ratio.median()):12.4f} {float(ratio.max()):9.4f}")
            rows.append({"conv": conv, "parameter": name, "bound": bound, "median_ratio": float(ratio.median()),
                         "max_ratio": float(ratio.max())})
    write_json(args.out, {"images": len(x), "input_bound": 8.0, "tau": 16.0, "rows": rows})


if __name__ == "__main__":
    main()
