"""ADBench tabular sets at epsilon = 1: validation AUROC of clipless DP-SGD and Opacus DP-SGD.

    python benchmarks/tabular.py --data-dir ../shared/data/adbench --out results/tabular.json

80/20 stratified split (seed 0); deltas as in ../shared/data/README.md. Features go through a fixed,
data-independent map (no statistics of the data are used): sign(x) log(1 + |x|), or for the configurations
that say ``"features": "sqrt"`` the Hellinger map sign(x) sqrt(|x|) (``"rff"``: random Fourier features of the
log1p map, 1024 of them, drawn from a public seed); clipless clips every input to a
radius given in units of sqrt(d). Both methods train a 2-hidden-layer MLP of the same widths (clipless: orthogonal
dense layers with bounded bias and MaxMin; Opacus: nn.Linear + ReLU), Poisson sampling, PLD accountant.

Hyper-parameter search: a small grid per method (``GRIDS``), each run at epsilon = 1. The "best" column
is the maximum over the grid, as in the paper's Table 7; selecting it is NOT covered by epsilon = 1: the
JSON states the epsilon of all runs of a method composed (PLD), which is what the search costs. The
"default" column is the grid's first configuration, chosen before seeing any data: epsilon = 1 exactly.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import clipless as cl
from clipless.privacy.accounting import PrivacyAccountant
from clipless.train.baselines import predict_scores, standard_mlp, train_dpsgd
from clipless.data.datasets import ArrayDataset, load_tabular, signed_log1p, signed_sqrt
from report import print_table, write_json

DATASETS = {  # file stem: (name in the paper, delta, paper DP-SGD AUROC, paper clipless AUROC)
    "1_ALOI": ("ALOI", 1e-5, 56.5, 56.2),
    "5_campaign": ("campaign", 1e-5, 90.0, 82.2),
    "8_celeba": ("celeba", 1e-6, 96.6, 96.5),
    "11_donors": ("donors", 1e-6, 100.0, 100.0),
    "22_magic.gamma": ("magic", 1e-5, 90.7, 89.7),
    "32_shuttle": ("shuttle", 1e-5, 98.3, 99.4),
    "33_skin": ("skin", 1e-6, 100.0, 99.8),
    "47_yeast": ("yeast", 1e-4, 66.8, 75.1),
}
GRIDS = {
    # input_clip: radius in units of sqrt(d); loss_grad_clip: C of the loss-gradient clip; batch_scale: multiple
    # of the default expected batch; features: the fixed map (FEATURE_MAPS). The first four were fixed before
    # looking at any data, the first is the default. The fifth was chosen on a validation split of ALOI's
    # training part (docs/results.md, issue 18 item 7); the test part was not read to choose it.
    "clipless": [{"tau": 8.0, "lr": 1e-2, "epochs": 20, "input_clip": 0.5, "loss_grad_clip": 0.25},
                 {"tau": 8.0, "lr": 1e-2, "epochs": 20, "input_clip": 0.5, "loss_grad_clip": 0.25, "batch_scale": 4},
                 {"tau": 8.0, "lr": 3e-3, "epochs": 40, "input_clip": 0.25, "loss_grad_clip": 0.25},
                 {"tau": 8.0, "lr": 3e-3, "epochs": 40},
                 {"tau": 8.0, "lr": 3e-3, "epochs": 40, "input_clip": 0.25, "loss_grad_clip": 0.25,
                  "features": "sqrt"}],
    "dpsgd": [{"max_grad_norm": 1.0, "lr": 1e-2, "epochs": 20}, {"max_grad_norm": 0.1, "lr": 1e-2, "epochs": 20},
              {"max_grad_norm": 1.0, "lr": 3e-3, "epochs": 40}, {"max_grad_norm": 1.0, "lr": 1e-2, "epochs": 60}],
}
HIDDEN = (64, 64)


def random_fourier(x: torch.Tensor, components: int = 1024, gamma: float = 1.0) -> torch.Tensor:
    """sign(x) log(1 + |x|), then scikit-learn's random Fourier features of the RBF kernel ``exp(-gamma |x - y|^2)``
    (norm at most sqrt 2): the weights are drawn from a public seed for the input width alone (fitted on zeros, so
    no record is read)."""
    import numpy as np
    from sklearn.kernel_approximation import RBFSampler

    z = signed_log1p(x).double().numpy()
    sampler = RBFSampler(gamma=gamma, n_components=components, random_state=0).fit(np.zeros((1, z.shape[1])))
    return torch.from_numpy(sampler.transform(z)).float()


FEATURE_MAPS = {"log1p": signed_log1p, "sqrt": signed_sqrt, "rff": random_fourier}


def mapped(data: ArrayDataset, cfg: dict) -> ArrayDataset:
    """The records through the configuration's fixed feature map (a per-record map: no privacy cost)."""
    return ArrayDataset(FEATURE_MAPS[cfg.get("features", "log1p")](data.features), data.labels)


def _epochs(requested: int, n: int, scale: int = 1) -> int:
    # very large sets need fewer passes (and the CPU time stays bounded): cap at ~1500 steps of batch b
    return max(2, min(requested, 1500 * _batch(n, scale) // n))


def _batch(n: int, scale: int = 1) -> int:
    return min(n // 2, scale * min(4096, max(64, n // 8)))


def run_clipless(train, test, delta, cfg, seed, accountant_log):
    train, test = mapped(train, cfg), mapped(test, cfg)
    d = train.features.shape[1]
    torch.manual_seed(seed)
    # input_clip: radius as a multiple of sqrt(d) (data-independent); loss_grad_clip: L -> min(L, C)
    model = cl.lipschitz_mlp((d,), 2, hidden=tuple(cfg.get("hidden", HIDDEN)),
                             input_clip=cfg.get("input_clip", 1.0) * math.sqrt(d), bias=True)
    if cfg.get("loss_grad_clip"):
        model.append(cl.LossGradientClip(cfg["loss_grad_clip"]))
    trainer = cl.PrivateTrainer(
        model, torch.optim.Adam(model.parameters(), lr=cfg["lr"]), cl.TauCrossEntropy(cfg["tau"]), train,
        input_shape=(d,), batch_size=_batch(len(train), cfg.get("batch_scale", 1)), delta=delta,
        epochs=_epochs(cfg["epochs"], len(train), cfg.get("batch_scale", 1)),
        target_epsilon=1.0, progress=False, log=None,
    )
    result = trainer.fit()
    accountant_log.step(result.effective_noise_multiplier, result.sample_rate, result.steps)
    return predict_scores(model, test)["auroc"], result.epsilon


def run_dpsgd(train, test, delta, cfg, seed, accountant_log):
    train, test = mapped(train, cfg), mapped(test, cfg)
    d = train.features.shape[1]
    torch.manual_seed(seed)
    result = train_dpsgd(
        standard_mlp((d,), 2, hidden=HIDDEN), train, batch_size=_batch(len(train)),
        epochs=_epochs(cfg["epochs"], len(train)), delta=delta, max_grad_norm=cfg["max_grad_norm"],
        target_epsilon=1.0, lr=cfg["lr"], seed=seed, test_data=test, progress=False,
    )
    accountant_log.step(result.noise_multiplier, result.sample_rate, result.steps)
    return result.test_auroc, result.epsilon


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/adbench")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS))
    p.add_argument("--methods", nargs="+", default=["clipless", "dpsgd"], choices=list(GRIDS))
    p.add_argument("--grid-size", type=int, default=5, help="use the first K configurations of each grid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/tabular.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runners = {"clipless": run_clipless, "dpsgd": run_dpsgd}
    rows = []
    for stem in args.datasets:
        paper_name, delta, paper_dpsgd, paper_clipless = DATASETS[stem]
        data = load_tabular(Path(args.data_dir) / f"{stem}.npz", seed=args.seed)
        train, test = data.train, data.test  # raw features: each configuration applies its own map
        row = {"dataset": paper_name, "n_train": len(train), "features": train.features.shape[1], "delta": delta,
               "paper_dpsgd": paper_dpsgd, "paper_clipless": paper_clipless}
        for method in args.methods:
            search = PrivacyAccountant("pld")  # all runs of the search, composed
            runs = []
            for cfg in GRIDS[method][: args.grid_size]:
                start = time.perf_counter()
                auroc, eps = runners[method](train, test, delta, cfg, args.seed, search)
                runs.append({**cfg, "auroc": auroc, "epsilon": eps, "seconds": time.perf_counter() - start})
                print(paper_name, method, runs[-1], flush=True)
            row[method] = {
                "default_auroc": 100 * runs[0]["auroc"], "best_auroc": 100 * max(r["auroc"] for r in runs),
                "runs": runs, "search_epsilon_composed": search.get_epsilon(delta),
            }
        rows.append(row)

    def col(r, method, key):
        return f"{r[method][key]:.1f}" if method in r else "-"

    print_table(
        f"{'dataset':9} {'n':>7} {'paper dpsgd':>11} {'dpsgd best':>10} {'dpsgd dflt':>10} "
        f"{'paper clipless':>14} {'clipless best':>13} {'clipless dflt':>13} {'search eps':>10}",
        [f"{r['dataset']:9} {r['n_train']:7d} {r['paper_dpsgd']:11.1f} {col(r, 'dpsgd', 'best_auroc'):>10} "
         f"{col(r, 'dpsgd', 'default_auroc'):>10} {r['paper_clipless']:14.1f} {col(r, 'clipless', 'best_auroc'):>13} "
         f"{col(r, 'clipless', 'default_auroc'):>13} "
         f"{(format(r['clipless']['search_epsilon_composed'], '.2f') if 'clipless' in r else '-'):>10}"
         for r in rows],
    )
    if "clipless" in args.methods:
        wins = sum(round(r["clipless"]["best_auroc"], 1) >= r["paper_clipless"] for r in rows)
        print(f"clipless best >= paper's clipless column on {wins} of {len(rows)} datasets")
    write_json(args.out, {"grids": GRIDS, "hidden": HIDDEN, "seed": args.seed, "rows": rows})


if __name__ == "__main__":
    main()
