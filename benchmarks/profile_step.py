"""Where a step's time goes: torch.profiler on the speed benchmark's steps (standard, Lipschitz, clipless).

    python benchmarks/profile_step.py --device cuda --out-dir results/profile_cuda

For each model (cnn, mlp) and method, the step of ``benchmarks/speed.py`` at ``--batch`` runs 5 times, then 10
times under the profiler. Prints, per step, the self CPU time (the host's work: Python, dispatch, kernel launches),
the self device time (the kernels), the synchronizing calls and the device-to-host scalar reads (``aten::item``),
and the top operators; writes each full table to ``--out-dir``. On CUDA every method runs IEEE float32
convolutions, as in ``benchmarks/speed.py``.

    python benchmarks/profile_step.py --device cpu --phases --models mlp --batch 256 --out-dir results/phases

``--phases``: wall-clock medians (``--steps`` steps after 30 of warm-up) of the parts of one step, the Lipschitz
model's non-private step (forward, backward, Adam, projection) beside the clipless private step of the same model
(forward and backward with the step guard, then inside ``step()``: the checks and certified bounds, the noise,
Adam, the projection, and the rest); writes ``phases_<model>_<batch>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from report import use_allocator, write_json, write_text
from speed import _build, ieee_float32
from torch.profiler import ProfilerActivity, profile

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def _timed(times: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - start)
    return wrapper


def phases(model_name: str, batch: int, device: str, steps: int) -> dict:
    """Medians (ms) of the parts of the Lipschitz model's non-private step and of its clipless private step."""
    import clipless as cl
    import clipless.privacy.optimizer as private_optimizer

    shape, bound = (1, 28, 28), 28.0
    x, y = torch.rand(batch, *shape, device=device), torch.randint(0, 10, (batch,), device=device)
    loss = cl.TauCrossEntropy(8.0)

    def build():
        torch.manual_seed(0)
        model = (cl.lipschitz_cnn(shape, 10, channels=(16, 32), input_clip=bound) if model_name == "cnn" else
                 cl.lipschitz_mlp(shape, 10, hidden=(256, 256), input_clip=bound)).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def medians(times: dict) -> dict:
        return {k: 1e3 * statistics.median(v[-steps:]) for k, v in times.items()}

    def run(model, zero_grad, after_backward: dict) -> dict:
        """``30 + steps`` steps of ``model``: zero_grad, forward, backward, then each of ``after_backward``."""
        times: dict = {}
        names = ("zero_grad", "forward", "backward", *after_backward)
        for _ in range(30 + steps):
            marks = []

            def mark() -> None:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())

            mark()
            zero_grad()
            mark()
            out = model(x)
            mark()
            loss.per_example(out, y).sum().backward()
            mark()
            for part in after_backward.values():
                part()
                mark()
            for name, a, b in zip(names, marks, marks[1:]):
                times.setdefault(name, []).append(b - a)
            times.setdefault("total", []).append(marks[-1] - marks[0])
        return times

    model, opt = build()
    engine = cl.BoundEngine(model, shape, bound, loss.lipschitz)
    plain = run(model, opt.zero_grad, {"adam": opt.step, "projection": engine.project_})

    model, opt = build()
    parts: dict = {}  # inside step(), filled by the wrappers
    # installed before make_private: the private step refuses its own code replaced after it
    wrapped = [(private_optimizer.DPOptimizer, "_checked_report", "step: checks and certified bounds"),
               (private_optimizer, "add_noise_", "step: noise"), (cl.BoundEngine, "project_", "step: projection")]
    originals = [(owner, name, vars(owner)[name]) for owner, name, _ in wrapped]
    for owner, name, label in wrapped:
        setattr(owner, name, _timed(parts, label, vars(owner)[name]))
    opt.step = _timed(parts, "step: adam", opt.step)
    try:
        model, dp, _ = cl.PrivacyEngine().make_private(
            module=model, optimizer=opt, data=cl.ArrayDataset(x.cpu(), y.cpu()), loss=loss, noise_multiplier=1.0,
            input_shape=shape, batch_size=batch / 2, input_bound=bound, external_batches=True)
        private = {**run(model, dp.zero_grad, {"step": dp.step}), **parts}
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    measured = medians(private)
    order = ("zero_grad", "forward", "backward", "step", "step: checks and certified bounds", "step: noise",
             "step: adam", "step: projection")
    private_ms = {k: measured[k] for k in order}
    private_ms["step: the rest"] = measured["step"] - sum(v for k, v in private_ms.items() if k.startswith("step: "))
    private_ms["total"] = measured["total"]
    return {"model": model_name, "batch": batch, "device": device, "steps": steps,
            "lipschitz_ms": medians(plain), "clipless_ms": private_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda where there is one, else cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out-dir", default="results/profile")
    parser.add_argument("--phases", action="store_true", help="time the parts of a step (module doc)")
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=["cnn", "mlp"])
    parser.add_argument("--steps", type=int, default=100, help="--phases: timed steps per model")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ieee_float32(args.device)  # the private step refuses TF32 convolutions: the phases of the cnn failed on CUDA
    if args.phases:
        use_allocator("tuned")  # as the speed benchmark's workers and the CLI
        for model_name in args.models:
            result = phases(model_name, args.batch, args.device, args.steps)
            write_json(out / f"phases_{model_name}_{args.batch}.json", result, quiet=True)
            print(f"{model_name}, batch {args.batch}, {args.device}: medians of {args.steps} steps (ms)")
            for method in ("lipschitz_ms", "clipless_ms"):
                print(f"  {method[:-3]:9s} " + ", ".join(f"{k} {v:.2f}" for k, v in result[method].items()))
        return
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for model in args.models:
        for method in ("standard", "lipschitz", "clipless"):
            step = _build(method, model, args.batch, args.device)
            for _ in range(5):
                step()
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                for _ in range(10):
                    step()
                if cuda:
                    torch.cuda.synchronize()
            avg = prof.key_averages()
            text = avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
            device = (avg.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
                      if cuda else "")
            write_text(out / f"profile_{model}_{method}.txt", text + "\n\n" + device)
            syncs = sum(e.count for e in avg if e.key in SYNCS)
            reads = [(e.key, e.count) for e in avg
                     if "Memcpy DtoH" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")]
            host = sum(e.self_cpu_time_total for e in avg) / 10 / 1000
            kernels = sum(getattr(e, "self_device_time_total", 0) for e in avg) / 10 / 1000
            print(f"{model} {method}: self CPU {host:.2f} ms/step, self device {kernels:.2f} ms/step, "
                  f"sync-like calls {syncs / 10:.1f}/step, {reads}")
            print(avg.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))


if __name__ == "__main__":
    main()
