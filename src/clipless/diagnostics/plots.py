"""Figures for the diagnostics (matplotlib, imported lazily; nothing here decides a bound or a noise scale)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "plot_norm_histograms",
    "plot_gradient_norms",
    "plot_tightness",
    "plot_certified_accuracy",
    "plot_pareto",
    "plot_audit_scores",
    "plot_audit_tightness",
    "plot_training",
    "save_figure",
]

PathLike = Union[str, Path]


def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.4):
    from ..extras import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return plt, fig, axes[0]


def save_figure(plt, fig, path: PathLike) -> Path:
    """Render ``fig`` to memory, then replace ``path`` at once (a crash never leaves a half-written figure); the
    figure is closed."""
    import io

    from ..train.checkpoint import write_atomically  # not at import: train imports the diagnostics

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    write_atomically(path, buffer.getvalue())
    return path


# What a training curve may show: held-out scores and the accountant's epsilon, never training statistics.
_CURVES = {"test_accuracy": "test accuracy (held out)", "eval_loss": "held-out loss"}


def plot_training(history: Sequence[Mapping[str, Any]], path: PathLike, title: str = "private training") -> Path:
    """The held-out score (test accuracy, or a pre-training run's held-out loss) and epsilon after each epoch.
    Statistics of the training batches (``nonprivate_*``) are left out even when they were logged."""
    plt, fig, (ax,) = _figure(width=5.5)
    epochs = [row["epoch"] for row in history]
    for key, label in _CURVES.items():
        if history and all(row.get(key) is not None for row in history):
            ax.plot(epochs, [row[key] for row in history], marker="o", markersize=3, color="C0", label=label)
            ax.set_ylabel(label, color="C0")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_title(title)
    if history and all(row.get("epsilon") is not None for row in history):
        right = ax.twinx()
        right.plot(epochs, [row["epsilon"] for row in history], color="C1", linestyle="--", label="epsilon")
        right.set_ylabel("epsilon spent", color="C1")
        right.set_ylim(bottom=0)
    return save_figure(plt, fig, path)


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
    return save_figure(plt, fig, path)


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
    return save_figure(plt, fig, path)


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
    return save_figure(plt, fig, path)


def plot_certified_accuracy(radii: Sequence[float], curves: Mapping[str, Sequence[float]], path: PathLike) -> Path:
    """Certified accuracy as a function of the L2 radius, one curve per model."""
    plt, fig, (ax,) = _figure()
    for label, accuracies in curves.items():
        ax.plot(list(radii), list(accuracies), marker="o", markersize=3, label=label)
    ax.set_xlabel("L2 radius")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


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
    return save_figure(plt, fig, path)


_WORLDS = {"step": ("D (without the canary)", "D' (with the canary)"),
           "one-run": ("canaries left out", "canaries included"),
           "membership": ("non-members", "members")}


def plot_audit_scores(result: Any, path: PathLike) -> Path:
    """The attack's two score distributions (an :class:`~clipless.diagnostics.audit_stats.AuditResult`),
    with the claimed and the audited epsilon in the title."""
    plt, fig, (ax,) = _figure(width=5.6)
    out_label, in_label = _WORLDS.get(result.mode, ("D", "D'"))
    both = list(result.scores_out) + list(result.scores_in)
    bins = 40 if len(both) > 200 else 20
    ax.hist(result.scores_out, bins=bins, histtype="step", linewidth=1.5, density=True, label=out_label)
    ax.hist(result.scores_in, bins=bins, histtype="step", linewidth=1.5, density=True, label=in_label)
    threshold = result.details.get("threshold_test", {}).get("threshold")
    if threshold is not None:
        ax.axvline(threshold, color="k", linestyle=":", label="chosen threshold")
    claimed = "none" if result.epsilon_claimed is None else f"{result.epsilon_claimed:.2f}"
    ax.set_title(f"{result.mode} audit: epsilon >= {result.epsilon_lower:.2f} ({result.confidence:.0%}), "
                 f"claimed {claimed}: {result.verdict}", fontsize=9)
    ax.set_xlabel("attack score" + (" (whitened projection on the canary gradient)" if result.mode == "step" else ""))
    ax.set_ylabel("density")
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def plot_audit_tightness(rows: Sequence[Mapping[str, Any]], path: PathLike) -> Path:
    """Claimed vs audited epsilon against the noise multiplier (rows with ``noise_multiplier``,
    ``epsilon_claimed`` and one or more ``epsilon_lower*`` keys)."""
    plt, fig, (ax,) = _figure()
    sigmas = [r["noise_multiplier"] for r in rows]
    ax.plot(sigmas, [r["epsilon_claimed"] for r in rows], marker="o", color="k", label="claimed (accountant)")
    for key, label in (("epsilon_lower_gdp", "audited, Gaussian-DP fit"),
                       ("epsilon_lower_threshold_test", "audited, threshold test (Clopper-Pearson)")):
        if all(key in r for r in rows):
            ax.plot(sigmas, [r[key] for r in rows], marker="s", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("noise multiplier sigma (one unsubsampled step)")
    ax.set_ylabel("epsilon (delta = 1e-5)")
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)
