"""Diagnostics of a clipless model: gradient norms vs bounds, tightness per layer, certified accuracy, input norms.

    python benchmarks/diagnostics.py --data-dir ../shared/data/mnist --out results/diagnostics.json

Trains a Lipschitz MLP on MNIST pixels with clipless DP-SGD (epsilon 2), then, on held-out test images (so the
figures may be published; the training examples' gradient norms are not private):

* true per-example gradient norms per layer (autograd, one example at a time) against the engine's bound;
* tightness per layer, max norm / bound;
* certified accuracy against the L2 radius (margin / (sqrt 2 L), L the certified Lipschitz constant);
* input-norm histograms of MNIST (pixels and scattering features) and of 32x32 colour patches of
  scikit-learn's two sample photographs in RGB, HSV, YUV and grayscale.

Writes JSON and five PNGs next to it; prints the tables.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from report import print_table, write_json

import clipless as cl
from clipless.diagnostics.robustness import certified_accuracy
from clipless.data.datasets import COLOUR_SPACES, convert_colour_space, input_norms
from clipless.data.features import ScatteringFeatures
from clipless.diagnostics.plots import (
    plot_certified_accuracy,
    plot_gradient_norms,
    plot_norm_histograms,
    plot_tightness,
)
from clipless.diagnostics.tightness import per_example_gradient_norms


def sample_image_patches(size: int = 32) -> torch.Tensor:
    """Non-overlapping ``size x size`` RGB patches of scikit-learn's sample photographs, values in [0, 1]."""
    from sklearn.datasets import load_sample_images

    patches = []
    for image in load_sample_images().images:
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        h, w = (x.shape[1] // size) * size, (x.shape[2] // size) * size
        p = x[:, :h, :w].unfold(1, size, size).unfold(2, size, size)  # (3, nh, nw, size, size)
        patches.append(p.permute(1, 2, 0, 3, 4).reshape(-1, 3, size, size))
    return torch.cat(patches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    p.add_argument("--input-clip", type=float, default=8.0)
    p.add_argument("--sample", type=int, default=300, help="test examples for the gradient norms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/diagnostics.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    stem = args.out.rsplit(".", 1)[0]
    data = cl.load_mnist(args.data_dir)

    torch.manual_seed(args.seed)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=tuple(args.hidden), input_clip=args.input_clip)
    model.append(cl.LossGradientClip(0.25))
    loss = cl.TauCrossEntropy(8.0)
    trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=2e-3), loss, data.train,
                                input_shape=data.input_shape, batch_size=4096, delta=1e-5, epochs=args.epochs,
                                target_epsilon=args.epsilon, test_data=data.test, progress=False,
                                log=None, tightness_monitor=cl.diagnostics.TightnessMonitor(every=25, sample=8))
    result = trainer.fit()
    print(f"trained: test accuracy {result.test_accuracy:.4f}, epsilon {result.epsilon:.3f}")

    model.eval()
    report = trainer.optimizer.bound_engine.compute()
    x, y = data.test.features[: args.sample], data.test.labels[: args.sample]
    norms = per_example_gradient_norms(model, loss, x, y, report)
    bounds = {layer.name: layer.bound for layer in report.layers}
    ratios = {name: float(norms[name].max()) / bounds[name] for name in bounds}
    rows = [{"layer": n, "bound": bounds[n], "median_norm": float(norms[n].median()), "max_norm": float(norms[n].max()),
             "tightness": ratios[n]} for n in bounds]
    print_table(f"{'layer':>6} {'bound':>9} {'median':>9} {'max':>9} {'max/bound':>9}",
                [f"{r['layer']:>6} {r['bound']:9.4f} {r['median_norm']:9.4f} {r['max_norm']:9.4f} "
                 f"{r['tightness']:9.4f}" for r in rows])
    plot_gradient_norms(norms, bounds, f"{stem}_gradient_norms.png")
    plot_tightness(ratios, f"{stem}_tightness.png", title="MNIST MLP, held-out examples")

    lipschitz = trainer.optimizer.bound_engine.lipschitz_constant()
    radii = [0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
    cert = certified_accuracy(model, data.test, radii, lipschitz)
    print_table(f"{'radius':>7} {'certified acc':>13}", [f"{r:7.2f} {cert[r]:13.4f}" for r in radii])
    plot_certified_accuracy(radii, {f"clipless MLP (eps {result.epsilon:.2f})": [cert[r] for r in radii]},
                            f"{stem}_certified_accuracy.png")

    patches = sample_image_patches()
    colour_norms = {space: input_norms(convert_colour_space(patches, space)) for space in COLOUR_SPACES}
    phi = ScatteringFeatures(data.input_shape)
    mnist_norms = {"MNIST pixels": input_norms(data.test.features),
                   "MNIST scattering (x 10)": 10 * input_norms(phi(data.test.features[:2000]))}
    norm_rows = []
    for label, values in {**colour_norms, **mnist_norms}.items():
        q = torch.quantile(values, torch.tensor([0.05, 0.5, 0.95], dtype=values.dtype))
        norm_rows.append({"input": label, "count": len(values), "p5": float(q[0]), "median": float(q[1]),
                          "p95": float(q[2]), "max": float(values.max())})
    print_table(f"{'input':>24} {'count':>6} {'p5':>7} {'median':>7} {'p95':>7} {'max':>7}",
                [f"{r['input']:>24} {r['count']:6d} {r['p5']:7.2f} {r['median']:7.2f} {r['p95']:7.2f} {r['max']:7.2f}"
                 for r in norm_rows])
    plot_norm_histograms(colour_norms, f"{stem}_colour_norms.png",
                         title=f"{len(patches)} colour patches 32x32 (sklearn sample images)")
    plot_norm_histograms(mnist_norms, f"{stem}_mnist_norms.png", clip=args.input_clip, title="MNIST test images")
    write_json(args.out, {"config": vars(args), "test_accuracy": result.test_accuracy, "epsilon": result.epsilon,
                          "lipschitz": lipschitz, "layers": rows, "certified_accuracy": cert,
                          # the monitor measured training batches: labelled, as the trainer labels such statistics
                          "nonprivate_monitor_worst": trainer.tightness_monitor.worst,
                          "nonprivate_note": "nonprivate_*: measured on training examples without noise",
                          "input_norms": norm_rows})
    print(f"wrote {args.out} and {Path(stem).name}_*.png")


if __name__ == "__main__":
    main()
