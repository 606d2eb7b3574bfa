"""Figures for the diagnostics (matplotlib, imported lazily; nothing here decides a bound or a noise scale)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "plot_norm_histograms",
    "plot_gradient_norms",
    "plot_tightness",
    "plot_certified_accuracy",
    "plot_pareto",
]

PathLike = Union[str, Path]


def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.4):
    from ..extras import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return plt, fig, axes[0]


def _save(plt, fig, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_norm_histograms(
    norms: Mapping[str, torch.Tensor], path: PathLike, clip: Optional[float] = None, title: str = "input norms"
) -> Path:
    """One histogram per entry (e.g. per colour space); a dashed line at the clip radius if given."""
    plt, fig, (ax,) = _figure()
    for label, values in norms.items():
        ax.hist(values.detach().cpu().numpy(), bins=40, histtype="step", linewidth=1.5, label=label)
    if clip is not None:
        ax.axvline(clip, color="k", linestyle="--", label=f"clip radius {clip:g}")
    ax.set_xlabel("L2 norm of an example")
    ax.set_ylabel("examples")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_gradient_norms(norms: Mapping[str, torch.Tensor], bounds: Mapping[str, float], path: PathLike) -> Path:
    """Per layer: histogram of true per-example gradient norms, with the engine's bound as a red line."""
    names = list(norms)
    plt, fig, axes = _figure(ncols=len(names), width=3.6)
    for ax, name in zip(axes, names):
        ax.hist(norms[name].detach().cpu().numpy(), bins=30, color="tab:blue")
        ax.axvline(bounds[name], color="tab:red", linewidth=2, label="certified bound")
        ax.set_title(f"layer {name}", fontsize=9)
        ax.set_xlabel("per-example gradient norm")
        ax.set_xlim(left=0)
    axes[0].set_ylabel("examples")
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def plot_tightness(ratios: Mapping[str, float], path: PathLike, title: str = "bound tightness") -> Path:
    """Bar per layer of max empirical per-example gradient norm / bound (must stay <= 1)."""
    plt, fig, (ax,) = _figure()
    names = list(ratios)
    ax.bar(range(len(names)), [ratios[n] for n in names], color="tab:green")
    ax.axhline(1.0, color="tab:red", linestyle="--", label="bound")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("max ||grad_i|| / bound")
    ax.set_ylim(0, 1.1)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_certified_accuracy(radii: Sequence[float], curves: Mapping[str, Sequence[float]], path: PathLike) -> Path:
    """Certified accuracy as a function of the L2 radius, one curve per model."""
    plt, fig, (ax,) = _figure()
    for label, accuracies in curves.items():
        ax.plot(list(radii), list(accuracies), marker="o", markersize=3, label=label)
    ax.set_xlabel("L2 radius")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_pareto(points: Mapping[str, Dict[float, float]], path: PathLike, reference: Optional[float] = None) -> Path:
    """Privacy/utility front: test accuracy against epsilon, one curve per method."""
    plt, fig, (ax,) = _figure()
    for label, by_eps in points.items():
        eps = sorted(by_eps)
        ax.plot(eps, [by_eps[e] for e in eps], marker="o", label=label)
    if reference is not None:
        ax.axhline(reference, color="gray", linestyle=":", label="non-private")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
