"""Where a step's time goes: torch.profiler on the speed benchmark's steps (standard, Lipschitz, clipless).

    python benchmarks/profile_step.py --device cuda --out-dir results/profile_cuda

For each model (cnn, mlp) and method, the step of ``benchmarks/speed.py`` at ``--batch`` runs 5 times, then 10
times under the profiler. Prints, per step, the self CPU time (the host's work: Python, dispatch, kernel launches),
the self device time (the kernels), the synchronizing calls and the device-to-host scalar reads (``aten::item``),
and the top operators; writes each full table to ``--out-dir``. On CUDA every method runs IEEE float32
convolutions, as in ``benchmarks/speed.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from speed import _build
from torch.profiler import ProfilerActivity, profile

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out-dir", default="results/profile")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    for model in ("cnn", "mlp"):
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
            (out / f"profile_{model}_{method}.txt").write_text(text + "\n\n" + device)
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
