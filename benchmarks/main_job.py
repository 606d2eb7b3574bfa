"""The main job (embedded digits) against Opacus DP-SGD, each with settings chosen on a validation split.

    python benchmarks/main_job.py --epsilons 1 3 --seeds 0 1 2 --out results/main_job.json

Protocol (issue 18, item 3):

1. The digits training split is cut once (fixed permutation) into fit (80%) and validation (20%); the test
   split is never read until step 3.
2. Each method trains on *fit* for every configuration of its grid (below), at the target epsilon, and is scored
   on *validation*; Opacus gets three times as many configurations, on pixels and on the same scattering
   features.
3. The best configuration of each is retrained on the whole training split and scored on the test split, over
   ``--seeds`` (fixed noise seeds, so the table can be rerun; mean and spread reported).

The search is not accounted in epsilon (as in the papers compared with); the README says so.  The chosen clipless
configuration is what ``clipless train`` runs by default (configs/digits.yaml).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

EPOCHS = 40
# clipless: the linear head on fixed scattering features (the MNIST recipe's family, found best on the validation
# split among ~25 exploratory configurations: pixel MLPs with input clips 3-4, loss-gradient clips 0.1-0.5,
# widths 128-512, batch 256-1024; see docs/results.md), here over learning rate x epochs x temperature
_SCATTER = {"features": "scattering", "hidden": [], "loss_grad_clip": 0.25, "batch_size": 1024}
CLIPLESS_GRID = [dict(_SCATTER, lr=lr, epochs=e, tau=t) for lr in (0.01, 0.03) for e in (40, 80) for t in (16, 32)]
# What the last run of the search chose at epsilon 3 (and at 1), on 2026-11-29 with the current noise sampler
# (results/main_job_30seeds.json): the main job's defaults, configs/digits.yaml (tests/test_cli_inputs.py checks both)
CHOSEN = dict(_SCATTER, lr=0.01, epochs=80, tau=16.0)
# Opacus: pixels (nn.Linear + ReLU 64-128-10) or the same scattering features (a linear head, the ScatterNet
# baseline of Tramer & Boneh), over learning rate x batch size x clipping norm: three times the clipless search
OPACUS_GRID = [dict(features=f, hidden=[] if f == "scattering" else [128], lr=lr, batch_size=b, max_grad_norm=c)
               for f in ("none", "scattering") for lr in (0.01, 0.03, 0.1) for b in (512, 1024) for c in (0.5, 2.0)]


def _split(data, seed: int = 0, fit_size: int = None):
    """Training split -> (fit, validation) by a fixed permutation; fit is 80% unless ``fit_size`` is given."""
    from clipless.data import ArrayDataset, DataSplit

    x, y = data.train.features, data.train.labels
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y)) if fit_size is None else fit_size
    fit, val = perm[:cut], perm[cut:]
    # the same pixels and classes: the same input bound and output width
    return DataSplit(ArrayDataset(x[fit], y[fit]), ArrayDataset(x[val], y[val]), data.name,
                     data.coordinate_bound, data.num_classes)


def run(method: str, data, cfg: dict, epsilon: float, seed: int) -> float:
    from clipless.cli import DEFAULTS, _build_clipless, _trainer, validate
    from clipless.train.baselines import standard_mlp, train_dpsgd

    config = validate({**DEFAULTS, "epochs": EPOCHS, **cfg, "epsilon": epsilon, "seed": seed, "noise_seed": seed,
                       "progress": False})
    torch.manual_seed(seed)
    if config["features"] == "scattering":
        from clipless.data.features import scattering_split

        data = scattering_split(data, radius=1.0, progress=False)
    if method == "clipless":
        model, loss, optimizer, bound = _build_clipless(config, data, data.input_shape)
        trainer = _trainer(config, model, loss, optimizer, data.train, data.test, data.input_shape, bound, None)
        trainer.log = None
        return trainer.fit().test_accuracy
    model = standard_mlp(data.input_shape, data.num_classes, hidden=config["hidden"])
    outcome = train_dpsgd(model, data.train, batch_size=int(config["batch_size"]), epochs=config["epochs"],
                          delta=config["delta"], max_grad_norm=config["max_grad_norm"], target_epsilon=epsilon,
                          lr=config["lr"], optimizer=config["optimizer"], accountant=config["accountant"], seed=seed,
                          noise_seed=seed, test_data=data.test, progress=False)
    return outcome.test_accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="results/main_job.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from report import print_table, write_json

    import clipless as cl

    data = cl.load_digits()
    validation = _split(data)
    rows = []
    for epsilon in args.epsilons:
        for method, grid in (("clipless", CLIPLESS_GRID), ("opacus", OPACUS_GRID)):
            search = []
            for cfg in grid:
                acc = run(method, validation, cfg, epsilon, seed=0)
                search.append({"config": cfg, "validation_accuracy": acc})
                print(f"eps={epsilon} {method} {cfg}: validation {acc:.4f}", flush=True)
            best = max(search, key=lambda r: r["validation_accuracy"])
            if method == "clipless" and epsilon == 3.0 and best["config"] != CHOSEN:
                print(f"note: the search now chooses {best['config']}, not CHOSEN (the main job's defaults): update "
                      "CHOSEN, configs/digits.yaml and the CLI's defaults", flush=True)
            tests = [run(method, data, best["config"], epsilon, seed) for seed in args.seeds]
            rows.append({"epsilon": epsilon, "method": method, "configurations_tried": len(search),
                         "chosen": best["config"], "validation_accuracy": best["validation_accuracy"],
                         "test_accuracies": tests, "mean": statistics.mean(tests),
                         "sd": statistics.stdev(tests) if len(tests) > 1 else 0.0, "search": search})
    print_table(f"{'eps':>4} {'method':>9} {'configs':>7} {'chosen':>110} {'test acc (mean +- sd)':>22}",
                [f"{r['epsilon']:>4g} {r['method']:>9} {r['configurations_tried']:>7} {str(r['chosen']):>110} "
                 f"{100 * r['mean']:>14.2f} +- {100 * r['sd']:4.2f}" for r in rows])
    write_json(args.out, {"seeds": args.seeds, "rows": rows})


if __name__ == "__main__":
    main()
