"""The KL-privacy study of noisy GD without clipping (Ye et al.; spec §5) on a two-class MNIST subset.

Experiments: cumulative KL vs steps per initialization (network, its linearization, and the linearized
bound); final KL vs width; KL vs depth after short and long training; a loss-threshold membership attack
on every trained model against the advantage bound implied by the measured KL.  ``clipless kl-study``
runs it and writes ``kl_study.json`` and PNG plots.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..data.datasets import load_mnist
from ..diagnostics.membership import loss_threshold_attack
from ..diagnostics.plots import save_figure
from ..privacy.certified import is_whole, whole_number
from ..privacy.accounting import check_positive_finite
from ..privacy.distributed import world
from ..train.checkpoint import claim_directory, keep_earlier_files, write_atomically
from . import noisy_gd as klp


# What the study writes into its output directory (an earlier study's are kept, moved aside).
STUDY_FILES = ("kl_study.json", "kl_vs_steps.png", "kl_vs_width.png", "kl_vs_depth.png")
# The study measures the mechanism on its training records: every number it writes is computed from them
# without noise of its own.
NON_PRIVATE_NOTE = ("non-private study: the KL curves, losses, accuracies and attack scores are computed from the "
                    "training records without noise; do not publish them as a private release")


@dataclass
class KLStudyConfig:
    data_dir: str
    digits: Tuple[int, int] = (0, 1)
    n_train: int = 1000
    n_heldout: int = 1000
    inits: Tuple[str, ...] = klp.INIT_SCHEMES
    width: int = 128
    depth: int = 2
    widths: Tuple[int, ...] = (32, 64, 128, 256)
    depths: Tuple[int, ...] = (2, 3, 4, 5)
    eta: float = 0.5
    sigma: float = 0.003
    steps: int = 100
    short_steps: int = 5
    mia_sigma: float = 0.03
    runs: int = 2
    seed: int = 0
    output_dir: str = "runs/kl-study"
    progress: bool = True

    def __post_init__(self) -> None:
        """Every setting checked before any data is read or any run starts (ValueError names the setting)."""
        a, b = self.digits
        if a == b or not (0 <= a <= 9 and 0 <= b <= 9):
            raise ValueError(f"digits must be two different MNIST digits 0-9, got {self.digits}")
        unknown = [i for i in self.inits if i not in klp.INIT_SCHEMES]
        if not self.inits or unknown:
            raise ValueError(f"inits must name at least one of {klp.INIT_SCHEMES}, got {list(self.inits)}")
        counts = {"n_train": (self.n_train, 2), "n_heldout": (self.n_heldout, 1), "width": (self.width, 1),
                  "depth": (self.depth, 1), "steps": (self.steps, 1), "short_steps": (self.short_steps, 1),
                  "runs": (self.runs, 1)}
        counts.update({f"widths[{i}]": (w, 1) for i, w in enumerate(self.widths)})
        counts.update({f"depths[{i}]": (L, 1) for i, L in enumerate(self.depths)})
        for name, (value, low) in counts.items():
            if whole_number(value, name, low) >= 2 ** 31:  # torch's sizes and loops past this fail without a word
                raise ValueError(f"{name} must be below 2^31, got {value}")
        if not (is_whole(self.seed) and abs(self.seed) < 2 ** 53):  # torch's generators take 64-bit seeds
            raise ValueError(f"seed must be an integer of magnitude below 2^53, got {self.seed!r}")
        for name in ("eta", "sigma", "mia_sigma"):
            value = check_positive_finite(getattr(self, name), name)
            if value * value == 0:  # the study divides by its square
                raise ValueError(f"{name} must be at least 1e-150 (its square underflows to 0), got {value}")


def two_class_mnist(data_dir: str, digits: Tuple[int, int], n_train: int, n_heldout: int,
                    seed: int) -> Dict[str, Any]:
    """Training records, held-out candidates (from the rest of the training split) and the test set.

    Labels are 0/1 for ``digits[0]``/``digits[1]``; every input is scaled to unit L2 norm (per example,
    data-independent).
    """
    data = load_mnist(data_dir)

    def select(ds: Any) -> Tuple[Tensor, Tensor]:
        x, y = ds.features, ds.labels
        keep = (y == digits[0]) | (y == digits[1])
        x = x[keep].flatten(1).float()
        norms = x.norm(dim=1, keepdim=True)
        if (norms == 0).any():
            raise ValueError("an all-zero image cannot be scaled to unit norm")
        return x / norms, (y[keep] == digits[1]).long()

    x, y = select(data.train)
    if n_train + n_heldout > len(x):
        raise ValueError(f"digits {digits} have only {len(x)} training images; asked {n_train} + {n_heldout}")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    tr, ho = perm[:n_train], perm[n_train:n_train + n_heldout]
    xt, yt = select(data.test)
    # the linearized bound needs max ||x||^2 over training and held-out records (1 after the scaling)
    max_norm_sq = float(torch.cat([x[tr], x[ho]]).norm(dim=1).max() ** 2)
    return {"x": x[tr], "y": y[tr], "xh": x[ho], "yh": y[ho], "x_test": xt, "y_test": yt, "max_norm_sq": max_norm_sq}


def _run(data: Dict[str, Any], widths: List[int], init: str, cfg: KLStudyConfig, sigma: float,
         linearized: bool = False) -> Dict[str, Any]:
    def make(run: int) -> torch.nn.Module:
        net = klp.ReLUNetwork(widths, init, torch.Generator().manual_seed(cfg.seed * 7919 + run))
        return klp.LinearizedNetwork(net) if linearized else net

    trace, models = klp.kl_trace(make, data["x"], data["y"], data["xh"], data["yh"], eta=cfg.eta, sigma=sigma,
                                 steps=cfg.steps, runs=cfg.runs, seed=cfg.seed)
    mean, std = trace.cumulative_kl()
    short = min(cfg.short_steps, cfg.steps) - 1
    attacks = []
    for model in models:
        with torch.no_grad():
            acc = (model(data["x_test"]).argmax(1) == data["y_test"]).double().mean().item()
        attack = loss_threshold_attack(klp.example_losses(model, data["x"], data["y"]),
                                           klp.example_losses(model, data["xh"], data["yh"]))
        attacks.append({"test_accuracy": acc, **attack})
    kl = float(mean[-1])
    bound = klp.membership_advantage_bound(kl)
    return {
        "widths": widths,
        "init": init,
        "linearized": linearized,
        "sigma": sigma,
        "kl_curve_mean": mean.tolist(),
        "kl_curve_std": std.tolist(),
        "kl": kl,
        "kl_std": float(std[-1]),
        "kl_short": float(mean[short]),
        "worst_neighbour_kl": float(trace.worst_neighbour_kl()[-1]),
        "delta_at_eps0": klp.kl_to_delta(kl),
        "advantage_bound": bound,
        "linearized_kl_bound": klp.linearized_kl_bound(widths, init, data["max_norm_sq"], len(data["x"]), cfg.eta,
                                                       sigma, cfg.steps),
        "final_train_loss": float(trace.train_loss[:, -1].mean()),
        "attacks": attacks,
        "attack_within_bound": all(a["advantage"] <= bound for a in attacks),
    }


def _trend(values: Sequence[float]) -> str:
    diffs = np.diff(values)
    if np.all(diffs > 0):
        return "increasing"
    if np.all(diffs < 0):
        return "decreasing"
    return "mixed"


def run_kl_study(cfg: KLStudyConfig) -> Dict[str, Any]:
    """Run all experiments of the study; returns the JSON-ready result (also written with plots by :func:`main`)."""
    started = time.time()
    data = two_class_mnist(cfg.data_dir, cfg.digits, cfg.n_train, cfg.n_heldout, cfg.seed)
    d, k = data["x"].shape[1], 2
    base = [d] + [cfg.width] * (cfg.depth - 1) + [k]
    jobs: List[Tuple[str, List[int], str, float, bool]] = []
    for init in cfg.inits:
        jobs.append(("steps", base, init, cfg.sigma, False))
        jobs.append(("steps", base, init, cfg.sigma, True))
        jobs += [("width", [d] + [w] * (cfg.depth - 1) + [k], init, cfg.sigma, False)
                 for w in cfg.widths if w != cfg.width]
        jobs += [("depth", [d] + [cfg.width] * (L - 1) + [k], init, cfg.sigma, False)
                 for L in cfg.depths if L != cfg.depth]
        # more noise, so that the advantage bound implied by the KL is informative (< 1)
        jobs.append(("attack", base, init, cfg.mia_sigma, False))
    results: List[Dict[str, Any]] = []
    for kind, widths, init, sigma, linearized in tqdm(jobs, desc="kl-study", disable=not cfg.progress):
        results.append({"experiment": kind, **_run(data, widths, init, cfg, sigma, linearized)})

    def lookup(init: str, widths: List[int]) -> Dict[str, Any]:
        return next(r for r in results if r["init"] == init and r["widths"] == widths and not r["linearized"]
                    and r["experiment"] != "attack")

    summary: Dict[str, Any] = {"width": {}, "depth": {}}
    for init in cfg.inits:
        by_width = [lookup(init, [d] + [w] * (cfg.depth - 1) + [k]) for w in cfg.widths]
        by_depth = [lookup(init, [d] + [cfg.width] * (L - 1) + [k]) for L in cfg.depths]
        summary["width"][init] = {"kl": [r["kl"] for r in by_width], "trend": _trend([r["kl"] for r in by_width])}
        summary["depth"][init] = {
            "kl_short": [r["kl_short"] for r in by_depth], "trend_short": _trend([r["kl_short"] for r in by_depth]),
            "kl_long": [r["kl"] for r in by_depth], "trend_long": _trend([r["kl"] for r in by_depth]),
        }
    summary["expected"] = {
        "kl_grows_with_width_every_init": all(summary["width"][i]["trend"] == "increasing" for i in cfg.inits),
        "short_training_depth_trends": {i: summary["depth"][i]["trend_short"] for i in cfg.inits},
        "paper": "short training: decreasing with depth for lecun/xavier, increasing for he/ntk",
    }
    summary["all_attacks_within_bound"] = all(r["attack_within_bound"] for r in results)
    config = asdict(cfg)
    return {"config": config, "n_train": cfg.n_train, "n_heldout": cfg.n_heldout, "results": results,
            "summary": summary, "wall_time_s": time.time() - started, "private": False,
            "privacy_note": NON_PRIVATE_NOTE}


def plot_kl_study(study: Dict[str, Any], out_dir: Path) -> List[Path]:
    """KL vs steps (per init, network and linearization), KL vs width, KL vs depth (short and long)."""
    from ..extras import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = study["config"]
    results = study["results"]
    colors = dict(zip(cfg["inits"], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in (r for r in results if r["experiment"] == "steps"):
        mean, std = np.array(r["kl_curve_mean"]), np.array(r["kl_curve_std"])
        steps = np.arange(1, len(mean) + 1)
        style = "--" if r["linearized"] else "-"
        label = f"{r['init']}{' (linearized)' if r['linearized'] else ''}"
        ax.plot(steps, mean, style, color=colors[r["init"]], label=label)
        ax.fill_between(steps, mean - std, mean + std, color=colors[r["init"]], alpha=0.15)
        if r["linearized"]:  # the bound is linear in the number of steps
            ax.plot(steps, r["linearized_kl_bound"] * steps / len(steps), ":", color=colors[r["init"]], lw=1)
    ax.set(xlabel="step (full-batch epoch)", ylabel="cumulative KL", yscale="log",
           title=f"KL vs training, widths {results[0]['widths']} (dotted: linearized bound)")
    ax.legend(fontsize=7)
    paths.append(out_dir / "kl_vs_steps.png")

    def sweep(ax: Any, key: str, xs: Sequence[int], field_name: str, title: str) -> None:
        for init in cfg["inits"]:
            ys = study["summary"][key][init][field_name]
            ax.plot(xs, ys, "o-", color=colors[init], label=init)
        ax.set(yscale="log", ylabel="KL", title=title)
        ax.legend(fontsize=7)

    fig2, ax2 = plt.subplots(figsize=(6, 4))
    sweep(ax2, "width", cfg["widths"], "kl", f"KL after {cfg['steps']} steps vs width (depth {cfg['depth']})")
    ax2.set(xscale="log", xlabel="hidden width")
    paths.append(out_dir / "kl_vs_width.png")

    fig3, (ax3, ax4) = plt.subplots(1, 2, figsize=(10, 4))
    sweep(ax3, "depth", cfg["depths"], "kl_short", f"short training ({cfg['short_steps']} steps)")
    sweep(ax4, "depth", cfg["depths"], "kl_long", f"long training ({cfg['steps']} steps)")
    for a in (ax3, ax4):
        a.set(xlabel="depth (layers)")
    paths.append(out_dir / "kl_vs_depth.png")

    for figure, path in zip((fig, fig2, fig3), paths):
        save_figure(plt, figure, path)  # replaced at once: an earlier figure is never half-overwritten
    return paths


def format_summary(study: Dict[str, Any]) -> str:
    cfg = study["config"]
    lines = [f"{'experiment':<10} {'widths':<28} {'init':<7} {'lin':<4} {'sigma':>6} {'KL':>10} {'KL short':>10} "
             f"{'adv bound':>9} {'attack adv':>10} {'test acc':>8}"]
    for r in study["results"]:
        adv = max(a["advantage"] for a in r["attacks"])
        acc = np.mean([a["test_accuracy"] for a in r["attacks"]])
        lines.append(f"{r['experiment']:<10} {str(r['widths']):<28} {r['init']:<7} {'yes' if r['linearized'] else 'no':<4} "
                     f"{r['sigma']:>6.3g} "
                     f"{r['kl']:>10.4g} {r['kl_short']:>10.4g} {r['advantage_bound']:>9.3f} {adv:>10.3f} {acc:>8.4f}")
    s = study["summary"]
    lines.append(NON_PRIVATE_NOTE)
    lines.append(f"eta {cfg['eta']}, sigma {cfg['sigma']}, {cfg['steps']} steps, {cfg['runs']} runs, "
                 f"n_train {cfg['n_train']}, n_heldout {cfg['n_heldout']}, {study['wall_time_s']:.0f}s")
    lines.append("KL vs width: " + ", ".join(f"{i} {s['width'][i]['trend']}" for i in cfg["inits"]))
    lines.append("KL vs depth (short): " + ", ".join(f"{i} {s['depth'][i]['trend_short']}" for i in cfg["inits"]))
    lines.append("KL vs depth (long): " + ", ".join(f"{i} {s['depth'][i]['trend_long']}" for i in cfg["inits"]))
    lines.append(f"all membership attacks within the KL advantage bound: {s['all_attacks_within_bound']}")
    return "\n".join(lines)


def main_kl_study(cfg: KLStudyConfig) -> Dict[str, Any]:
    if world()[1] > 1:
        raise ValueError("the KL study runs in one process; it does not support a distributed process group")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    claim_directory(out)  # a study writing here at the same time would lose its files
    kept = keep_earlier_files(out, STUDY_FILES)  # an earlier study's files: this one replaces none of them
    if kept is not None:
        print(f"{out} held an earlier study's files: moved to {kept}", file=sys.stderr)
    study = run_kl_study(cfg)
    study["plots"] = [str(p) for p in plot_kl_study(study, out)]
    write_atomically(out / "kl_study.json", json.dumps(study, indent=2).encode())
    return study


__all__ = ["KLStudyConfig", "format_summary", "main_kl_study", "plot_kl_study", "run_kl_study", "two_class_mnist"]
