"""Distributed clipless DP-SGD: steps/s and examples/s for 1, 2, ... processes at a fixed global batch.

    python benchmarks/distributed.py --processes 1 2 --global-batch 1024 --out results/distributed.json

Each configuration runs ``--steps`` private steps of the CNN (or ``--model mlp``) on random MNIST-shaped
data, with the expected global batch fixed: every process holds ``1/N`` of the records and draws its part
of the Poisson batch.  Processes use the gloo backend on CPU (NCCL with ``--device cuda``) and
``--threads`` threads each (default: cores / N, so 1 and N processes use the same cores).  The time is the
median step time of rank 0 after warm-up; the all-reduce of the noisy gradient sum is included.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _worker(rank: int, size: int, args: argparse.Namespace, init: str, out: str) -> None:
    import clipless as cl

    if size > 1:
        backend = "nccl" if args.device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method=init, rank=rank, world_size=size)
    threads = args.threads or max(1, (os.cpu_count() or 2) // size)
    torch.set_num_threads(threads)
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    torch.manual_seed(0)
    n = args.records
    x = torch.rand(n, 1, 28, 28)
    y = torch.randint(0, 10, (n,))
    if args.model == "cnn":
        model = cl.lipschitz_cnn((1, 28, 28), 10, channels=(16, 32), input_clip=28.0)
    else:
        model = cl.lipschitz_mlp((1, 28, 28), 10, hidden=(256, 256), input_clip=28.0)
    model = model.to(device)
    loss = cl.TauCrossEntropy(8.0)
    ddp, opt, loader = cl.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), data=cl.ArrayDataset(x, y), loss=loss,
        noise_multiplier=1.0, input_shape=(1, 28, 28), batch_size=float(args.global_batch), input_bound=28.0)
    times, examples = [], []
    it = iter(loader)
    for i in range(args.steps + 3):
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            xb, yb = next(it)
        xb, yb = xb.to(device), yb.to(device)
        if size > 1:
            torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss.per_example(ddp(xb), yb).sum().backward()
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
            examples.append(len(xb))
    if rank == 0:
        from report import write_json

        write_json(out, {"median_s": statistics.median(times), "local_examples": examples, "threads": threads},
                   quiet=True)
    if size > 1:
        del ddp, opt, loader
        gc.collect()  # a DistributedDataParallel that outlives its group now and then aborts the process at exit
        torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--records", type=int, default=16384)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="threads per process (0: cores / processes)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="results/distributed.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    rows = []
    for size in args.processes:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rank0.json")
            mp.spawn(_worker, args=(size, args, f"file://{tmp}/rendezvous", out), nprocs=size, join=True)
            measured = json.loads(Path(out).read_text())
        step = measured["median_s"]
        rows.append({"processes": size, "threads_per_process": measured["threads"], "step_s": step,
                     "steps_per_s": 1 / step, "examples_per_s": args.global_batch / step})
        print(rows[-1], flush=True)
    base = rows[0]["steps_per_s"]
    for r in rows:
        r["speedup"] = r["steps_per_s"] / base
    print_table(f"{'processes':>9} {'threads':>7} {'step ms':>8} {'steps/s':>8} {'examples/s':>10} {'x 1 process':>11}",
                [f"{r['processes']:9d} {r['threads_per_process']:7d} {1e3 * r['step_s']:8.1f} {r['steps_per_s']:8.2f} "
                 f"{r['examples_per_s']:10.0f} {r['speedup']:11.2f}" for r in rows])
    import clipless as cl

    model = (cl.lipschitz_cnn((1, 28, 28), 10, channels=(16, 32)) if args.model == "cnn"
             else cl.lipschitz_mlp((1, 28, 28), 10, hidden=(256, 256)))
    params = sum(p.numel() for p in model.parameters())
    write_json(args.out, {"config": vars(args), "torch": torch.__version__, "parameters": params,
                          "all_reduce_bytes_per_step": 4 * params, "rows": rows})


if __name__ == "__main__":
    main()
