"""Privacy checks that need a GPU: cuDNN's TF32 default is refused, IEEE float32 is accepted, secret noise differs.

    python benchmarks/cuda_checks.py --out results/cuda_checks.json   # on a machine with CUDA

1. A private CNN step under torch's default cuDNN setting (TF32 convolutions) is refused before anything is
   released; with ``torch.backends.cudnn.conv.fp32_precision = "ieee"`` it runs, and an MLP runs either way.
2. Two private steps from the same weights and batch with default (secret) randomness release different noise
   on the GPU; two with the same fixed noise seed release the same.
3. True per-example gradient norms (autograd, one example at a time, on the GPU in IEEE float32) against the
   certified bounds of the CNN and the MLP, over random inputs on the input bound.
4. Row digests of a batch agree on the CPU (where the loader digests it) and on the GPU (the forward's rows), and
   a step on the GPU whose forward repeats a drawn record (``x[idx]``) is refused.
"""

from __future__ import annotations

import argparse
import copy

import torch
from report import write_json


def _private(model, shape, device, noise_generator=None):
    import clipless as cl

    gen = torch.Generator().manual_seed(0)  # the same records for every call
    x = torch.rand(64, *shape, generator=gen)
    x = x / x.flatten(1).norm(dim=1).reshape((-1,) + (1,) * len(shape))
    data = cl.ArrayDataset(x, torch.randint(0, 10, (64,), generator=gen))
    engine = cl.PrivacyEngine("rdp")
    model, opt, _ = engine.make_private(
        module=model.to(device), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
        loss=cl.TauCrossEntropy(8.0), noise_multiplier=1.0, input_shape=shape, batch_size=16.0, input_bound=1.0,
        external_batches=True, noise_generator=noise_generator)
    return model, opt, engine, x[:16].to(device), data.labels[:16].to(device)


def _release(model, opt, x, y) -> torch.Tensor:
    import clipless as cl

    opt.zero_grad()
    cl.TauCrossEntropy(8.0).per_example(model(x), y).sum().backward()
    opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main() -> None:
    import clipless as cl
    from clipless.privacy import BoundError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--out", default="results/cuda_checks.json")
    args = parser.parse_args()
    device = args.device
    record = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "torch": torch.__version__}
    torch.manual_seed(0)
    cnn = cl.lipschitz_cnn((1, 12, 12), 10, channels=(8, 16), input_clip=1.0)
    mlp = cl.lipschitz_mlp((1, 12, 12), 10, hidden=(64,), input_clip=1.0)
    conv = getattr(torch.backends.cudnn, "conv", None)
    default = conv.fp32_precision if conv is not None else None
    record["cudnn_conv_default"] = default
    model, opt, engine, x, y = _private(copy.deepcopy(cnn), (1, 12, 12), device)
    try:
        model(x)
        record["default_cnn"] = "accepted"
    except BoundError as err:
        record["default_cnn"] = f"refused: {err}"
    record["default_cnn_steps_accounted"] = engine.accountant.steps
    model, opt, engine, x, y = _private(copy.deepcopy(mlp), (1, 12, 12), device)
    _release(model, opt, x, y)
    record["default_mlp"] = f"accepted, {engine.accountant.steps} step accounted"
    if conv is not None:
        conv.fp32_precision = "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = False
    releases = {}
    for name, seed in (("secret_a", None), ("secret_b", None), ("seeded_a", 7), ("seeded_b", 7)):
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        model, opt, engine, x, y = _private(copy.deepcopy(cnn), (1, 12, 12), device, gen)
        releases[name] = _release(model, opt, x, y)
    record["ieee_cnn"] = f"accepted, {engine.accountant.steps} step accounted"
    record["secret_releases_differ"] = not torch.equal(releases["secret_a"], releases["secret_b"])
    record["seeded_releases_equal"] = torch.equal(releases["seeded_a"], releases["seeded_b"])
    from clipless.diagnostics.tightness import per_example_gradient_norms
    from clipless.privacy import BoundEngine

    for name, net in (("cnn", cnn), ("mlp", mlp)):
        net = copy.deepcopy(net)
        loss = cl.TauCrossEntropy(8.0)
        bounds = BoundEngine(net, (1, 12, 12), 1.0, loss)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5 * torch.randn_like(p))
        bounds.project_()
        report = bounds.compute()
        net = net.to(device)
        xs = torch.randn(args.examples, 1, 12, 12, device=device)
        xs = xs / xs.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1)
        ys = torch.randint(0, 10, (args.examples,), device=device)
        norms = per_example_gradient_norms(net, loss, xs, ys, report)
        record[f"{name}_max_gradient_over_bound"] = max(float(norms[layer.name].max()) / layer.bound
                                                        for layer in report.layers if layer.bound > 0)
    from clipless.privacy.input_guard import row_digests

    batch = torch.rand(32, 1, 12, 12)
    record["row_digests_agree_across_devices"] = torch.equal(row_digests(batch), row_digests(batch.to(device)).cpu())
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 12, 12, generator=gen)
    data = cl.ArrayDataset(x / x.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1), torch.randint(0, 10, (64,)))
    net = copy.deepcopy(mlp).to(device)
    model, opt, loader = cl.PrivacyEngine("rdp").make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), data=data,
        loss=cl.TauCrossEntropy(8.0), noise_multiplier=1.0, input_shape=(1, 12, 12), batch_size=16.0,
        input_bound=1.0)
    for bx, by in loader:
        if len(bx) >= 2:
            break
    idx = torch.zeros(len(bx), dtype=torch.long)  # record 0 of the batch in every row
    cl.TauCrossEntropy(8.0).per_example(model(bx[idx].to(device)), by[idx].to(device)).sum().backward()
    try:
        opt.step()
        record["repeated_rows_on_device"] = "released"
    except BoundError as err:
        record["repeated_rows_on_device"] = f"refused: {str(err)[:80]}"
    for key, value in record.items():
        print(f"{key}: {value}")
    write_json(args.out, record)


if __name__ == "__main__":
    main()
