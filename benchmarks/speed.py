"""Per-step time and peak memory vs batch size: clipless DP-SGD, Opacus DP-SGD, non-private.

    python benchmarks/speed.py --batch-sizes 64 256 1024 4096 --out results/speed.json
    python benchmarks/speed.py --models cnn --batch-sizes 256 1024 --allocators system tuned  # both, side by side

Every (method, model, batch) runs in ``--rounds`` separate processes, in alternating order (peak memory =
peak RSS, or CUDA peak allocation, minus the memory in use before the first step). Time = median of the
``--repeats`` steps after warm-up of all rounds pooled: on a shared 2-core machine, one process's median
varies by about +-15% from one process to the next, so single-process ratios are not to be trusted.

  lipschitz  non-private step of the Lipschitz model: forward + backward + Adam + projection
  clipless   clipless private step of the same model (DPOptimizer: certified bounds, noise, /b, Adam,
             projection, accountant, the step guard's checks)
  unguarded  the same private step with the step guard's checks removed (benchmark only: what they cost)
  secure     the same private step with secure_noise=True (each noise value a sum of 4 draws)
  standard   non-private step of the unconstrained counterpart (same widths, nn.Conv2d/nn.Linear, ReLU)
  opacus     Opacus DP-SGD step of the standard model (per-example gradients, clipping, noise, Adam)
  ghost      Opacus DP-SGD with ghost clipping (grad_sample_mode="ghost": per-example norms without
             per-example gradients, two backward passes), where the installed Opacus has it

On CUDA every method runs IEEE float32 convolutions (``torch.backends.cudnn.conv.fp32_precision = "ieee"``;
cuDNN's default is TF32, which the private step refuses).

Allocator (every method alike): ``tuned`` calls ``clipless.train.tune_cpu_allocator()`` in the worker, as the
CLI does (glibc keeps freed blocks up to 32 MiB for the next step); ``system`` leaves glibc's defaults, which
hand activation memory back to the OS and fault it in again each step.

Ratios: clipless / standard (the promise: a private step at the price of an ordinary step of an ordinary
network), clipless / lipschitz (the cost of privacy on the same model), clipless / unguarded (the cost of
the checks that the private step owns its inputs), secure / clipless (the cost of the secure sampler), opacus /
standard, clipless / opacus and clipless / ghost; memory ratio clipless / standard.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from report import ALLOCATORS, rss_mb, use_allocator

METHODS = ("lipschitz", "clipless", "unguarded", "secure", "standard", "opacus", "ghost")


class _NoChecks:
    """Stands in for the step guard (clipless.privacy.input_guard.StepGuard) in the 'unguarded' measurement only.

    It keeps the removed guard's settings, which the optimizer compares with their values at make_private."""

    SETTINGS = ("loss_lipschitz", "rows_per_example", "digest_inputs", "model_changed", "sum_check", "params")

    def __init__(self, guard) -> None:
        for name in self.SETTINGS:
            setattr(self, name, getattr(guard, name))

    def check_step(self, params) -> None:
        pass

    def check_sums(self, report) -> None:
        pass

    def clear_gradient_state(self) -> None:
        pass

    def released_loss_weights(self):
        """No forward's loss weights were seen (none is watched)."""
        return []

    def finish_step(self, params, weights=None) -> None:
        for p in params:
            p.grad = None


def _build(method: str, model_name: str, batch: int, device: str):
    import torch.nn.functional as F

    import clipless as cl
    from clipless.train.baselines import standard_cnn, standard_mlp

    # "linear": the MNIST recipe's head on 3969 scattering features (benchmarks/mnist.py), features precomputed
    shape = (3969,) if model_name == "linear" else (1, 28, 28)
    bound = 1.0 if model_name == "linear" else 28.0
    x = torch.rand(batch, *shape, device=device)
    if model_name == "linear":  # scattering features lie on the unit sphere
        x = x / x.norm(dim=1, keepdim=True)
    y = torch.randint(0, 10, (batch,), device=device)
    if method in ("lipschitz", "clipless", "unguarded", "secure"):
        if model_name == "cnn":
            model = cl.lipschitz_cnn(shape, 10, channels=(16, 32), input_clip=bound)
        elif model_name == "linear":
            model = cl.lipschitz_mlp(shape, 10, hidden=(), input_clip=bound, projection="spectral")
        else:
            model = cl.lipschitz_mlp(shape, 10, hidden=(256, 256), input_clip=bound)
        model = model.to(device)
        loss = cl.TauCrossEntropy(8.0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if method == "lipschitz":
            engine = cl.BoundEngine(model, shape, bound, loss.lipschitz)

            def step() -> None:
                opt.zero_grad()
                loss.per_example(model(x), y).sum().backward()
                opt.step()
                engine.project_()
            return step
        model, dp_opt, _ = cl.PrivacyEngine().make_private(
            module=model, optimizer=opt, data=cl.ArrayDataset(x.cpu(), y.cpu()), loss=loss, noise_multiplier=1.0,
            # like benchmarks/mnist.py, the linear head relies on its InputNormClip alone (no data-bound check)
            input_shape=shape, batch_size=batch / 2, input_bound=None if model_name == "linear" else bound,
            external_batches=True,  # every step reuses one fixed batch: a timing, not a private run
            secure_noise=method == "secure",
        )
        if method == "unguarded":
            import clipless.privacy.optimizer as private_optimizer

            dp_opt.guard.remove()
            dp_opt.guard = _NoChecks(dp_opt.guard)
            # the stand-in's callables become the step's own (the step refuses methods set on its objects later)
            dp_opt.__dict__["_methods"] = private_optimizer._instance_methods(dp_opt)

        def step() -> None:
            dp_opt.zero_grad()
            loss.per_example(model(x), y).sum().backward()
            dp_opt.step()
        return step
    if model_name == "cnn":
        model = standard_cnn(shape, 10, channels=(16, 32))
    else:
        model = standard_mlp(shape, 10, hidden=() if model_name == "linear" else (256, 256))
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if method in ("opacus", "ghost"):
        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=batch // 2)
        if method == "ghost":
            model, opt, criterion, _ = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                poisson_sampling=True, criterion=torch.nn.CrossEntropyLoss(), grad_sample_mode="ghost")

            def ghost_step() -> None:
                opt.zero_grad()
                criterion(model(x), y).backward()
                opt.step()
            return ghost_step
        model, opt, _ = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                                     noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def ieee_float32(device: str) -> None:
    """On CUDA, cuDNN's float32 convolutions in IEEE float32 (TF32 by default), the arithmetic the private step's
    bounds are certified for, for every method alike."""
    if not device.startswith("cuda"):
        return
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "ieee"
    else:  # torch before 2.9
        torch.backends.cudnn.allow_tf32 = False


def worker(method: str, model_name: str, batch: int, repeats: int, threads: int, device: str,
           allocator: str) -> None:
    use_allocator(allocator)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    ieee_float32(device)
    step = _build(method, model_name, batch, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2 ** 20
    else:
        before = rss_mb()
    times = []
    for i in range(repeats + 3):
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps({"median_s": statistics.median(times), "times_s": times, "peak_mb": max(peak - before, 0.0)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--models", nargs="+", default=["cnn"], choices=["cnn", "mlp", "linear"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per (method, batch), run in alternating order; times are pooled")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--allocators", nargs="+", default=["tuned"], choices=ALLOCATORS,
                        help="C allocator settings of the workers (module doc); several: rows for each")
    parser.add_argument("--allocator", default="tuned", choices=ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/speed.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "MODEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), args.repeats, args.threads, args.device,
               args.allocator)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    rows = []
    for model_name, b, allocator in [(m, b, a) for m in args.models for b in args.batch_sizes
                                     for a in args.allocators]:
        row = {"model": model_name, "batch": b, "allocator": allocator}
        pooled: dict = {m: [] for m in args.methods}
        process_medians: dict = {m: [] for m in args.methods}
        peaks: dict = {m: 0.0 for m in args.methods}
        for r in range(args.rounds):
            # Alternate the order so that drift of the machine's speed hits every method alike.
            for method in (args.methods if r % 2 == 0 else args.methods[::-1]):
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", method, model_name, str(b), "--repeats",
                     str(args.repeats), "--threads", str(args.threads), "--device", args.device,
                     "--allocator", allocator],
                    capture_output=True, text=True,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"{method} {model_name} b={b} failed:\n{out.stderr[-2000:]}")
                measured = json.loads(out.stdout.strip().splitlines()[-1])
                pooled[method] += measured["times_s"]
                process_medians[method].append(1e3 * measured["median_s"])
                peaks[method] = max(peaks[method], measured["peak_mb"])
        for method in args.methods:
            row[f"{method}_ms"] = 1e3 * statistics.median(pooled[method])
            row[f"{method}_process_medians_ms"] = process_medians[method]
            row[f"{method}_mb"] = peaks[method]
        if "clipless_ms" in row and "lipschitz_ms" in row:
            row["clipless/lipschitz"] = row["clipless_ms"] / row["lipschitz_ms"]
        if "clipless_ms" in row and "unguarded_ms" in row:
            row["clipless/unguarded"] = row["clipless_ms"] / row["unguarded_ms"]
        if "clipless_ms" in row and "secure_ms" in row:
            row["secure/clipless"] = row["secure_ms"] / row["clipless_ms"]
        if "opacus_ms" in row and "standard_ms" in row:
            row["opacus/standard"] = row["opacus_ms"] / row["standard_ms"]
        for other in ("standard", "opacus", "ghost"):
            if "clipless_ms" in row and f"{other}_ms" in row:
                row[f"clipless/{other}"] = row["clipless_ms"] / row[f"{other}_ms"]
        if "clipless_mb" in row and "standard_mb" in row and row["standard_mb"] > 0:
            row["clipless/standard MB"] = row["clipless_mb"] / row["standard_mb"]
        rows.append(row)
        print(row, flush=True)

    def cell(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    print_table(
        f"{'model':5} {'batch':>6} {'alloc':>6} " + " ".join(f"{m + ' ms':>13}" for m in args.methods)
        + f" {'clipless/std':>12} {'clipless/lip':>12} {'clipless/ung':>12} {'secure/cl':>9} {'opacus/std':>10}"
        + f" {'cl/opacus':>9}"
        + f" {'cl/ghost':>8} {'cl/std MB':>9} "
        + " ".join(f"{m + ' MB':>13}" for m in args.methods),
        [f"{r['model']:5} {r['batch']:6d} {r['allocator']:>6} "
         + " ".join(f"{cell(r, m + '_ms', '.2f'):>13}" for m in args.methods)
         + f" {cell(r, 'clipless/standard', '.3f'):>12} {cell(r, 'clipless/lipschitz', '.3f'):>12}"
         + f" {cell(r, 'clipless/unguarded', '.3f'):>12} {cell(r, 'secure/clipless', '.3f'):>9}"
         + f" {cell(r, 'opacus/standard', '.3f'):>10}"
         + f" {cell(r, 'clipless/opacus', '.3f'):>9} {cell(r, 'clipless/ghost', '.3f'):>8}"
         + f" {cell(r, 'clipless/standard MB', '.2f'):>9} "
         + " ".join(f"{cell(r, m + '_mb', '.0f'):>13}" for m in args.methods) for r in rows],
    )
    write_json(args.out, {"threads": args.threads, "device": args.device, "torch": torch.__version__,
                          "allocators": args.allocators,
                          "repeats": args.repeats, "rows": rows})
    plot_path = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
    plot(rows, args.methods, plot_path)


def plot(rows, methods, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for model_name, allocator in sorted({(r["model"], r["allocator"]) for r in rows}):
        sub = [r for r in rows if r["model"] == model_name and r["allocator"] == allocator]
        bs = [r["batch"] for r in sub]
        style = "o-" if allocator == "tuned" else "x--"
        for m in methods:
            label = f"{model_name} {m} ({allocator})"
            ax1.plot(bs, [r[f"{m}_ms"] for r in sub], style, label=label)
            ax2.plot(bs, [max(r[f"{m}_mb"], 1e-1) for r in sub], style, label=label)
    ax1.set(xscale="log", yscale="log", xlabel="batch size", ylabel="median step time (ms)")
    ax2.set(xscale="log", yscale="log", xlabel="batch size", ylabel="peak memory increase (MB)")
    ax1.legend(fontsize=7)
    from report import save_plot

    print(f"wrote {save_plot(fig, path)}")


if __name__ == "__main__":
    main()
