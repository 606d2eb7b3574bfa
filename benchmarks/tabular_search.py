"""Clipless configurations on one ADBench set, each over several noise draws: mean and spread of the AUROC.

    python benchmarks/tabular_search.py --dataset 1_ALOI --validation --repeats 3 \\
        --configs '{"tau": 8, "lr": 3e-3, "epochs": 40, "input_clip": 0.25, "loss_grad_clip": 0.25, "features": "sqrt"}'

``--validation`` cuts the training part into fit (80%) and validation (20%) by a fixed permutation and scores on
validation: the test part is not read. Without it, training uses the whole training part and scores on the test
part (the split of benchmarks/tabular.py). Every run is at epsilon 1 with noise from OS entropy (the seed only
sets the initialization). The runs are not composed here: a configuration chosen with this script joins
benchmarks/tabular.py's grid, whose composed search epsilon that script reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from clipless.data.datasets import load_tabular
from clipless.privacy.accounting import PrivacyAccountant
from main_job import _split
from report import print_table, write_json
from tabular import DATASETS, run_clipless


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/adbench")
    p.add_argument("--dataset", required=True, choices=list(DATASETS), help="file stem in --data-dir")
    p.add_argument("--configs", nargs="+", required=True, type=json.loads,
                   help="clipless configurations as JSON objects (the keys of benchmarks/tabular.py's GRIDS)")
    p.add_argument("--repeats", type=int, default=3, help="noise draws per configuration")
    p.add_argument("--validation", action="store_true", help="score on a validation split of the training part")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/tabular_search.json")
    args = p.parse_args()
    if args.repeats < 2:
        p.error("--repeats must be at least 2 (a spread needs two draws)")
    torch.set_num_threads(args.threads)
    data = load_tabular(Path(args.data_dir) / f"{args.dataset}.npz", seed=0)
    if args.validation:
        data = _split(data, seed=1)
    delta = DATASETS[args.dataset][1]
    rows = []
    for cfg in args.configs:
        aurocs = [100 * run_clipless(data.train, data.test, delta, cfg, seed, PrivacyAccountant("pld"))[0]
                  for seed in range(args.repeats)]
        rows.append({"config": cfg, "aurocs": aurocs, "mean": statistics.mean(aurocs), "sd": statistics.stdev(aurocs)})
        print(rows[-1], flush=True)
    part = "validation" if args.validation else "test"
    print_table(f"{part + ' AUROC':>16}  configuration",
                [f"{r['mean']:7.2f} +- {r['sd']:4.2f}  {json.dumps(r['config'])}" for r in rows])
    write_json(args.out, {"dataset": args.dataset, "scored_on": part, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
