"""Membership-inference audits of a trained model (spec §3.5, §9), and the bound DP puts on them.

Two attacks: the loss threshold of Yeom et al. (guess "member" when the loss is low) and a shadow-model
attack (Shokri et al.): shadow models trained on known halves of a disjoint pool give labelled
(features -> member?) examples for a logistic-regression attacker.  An (epsilon, delta)-DP training
bounds every attack's advantage ``TPR - FPR`` by ``(e^eps - 1 + 2 delta) / (e^eps + 1)``.
:func:`membership_audit` turns any attack's scores into an epsilon lower bound (an
:class:`~clipless.diagnostics.audit_stats.AuditResult`, like the step and one-run audits): with the
one-run statistic of Steinke et al., valid when each record's membership was an independent fair coin.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ..train.evaluation import collect_outputs
from .audit_stats import AuditResult, one_run_bound

__all__ = ["dp_advantage_bound", "per_example_losses", "loss_threshold_attack", "shadow_model_attack",
           "shadow_model_scores", "membership_audit"]


def dp_advantage_bound(epsilon: float, delta: float) -> float:
    """Largest membership advantage ``TPR - FPR`` under (epsilon, delta)-DP: ``TPR <= e^eps FPR + delta`` and
    ``1 - FPR <= e^eps (1 - TPR) + delta`` give ``(e^eps - 1 + 2 delta) / (e^eps + 1)``."""
    if epsilon < 0 or not (0 <= delta < 1):
        raise ValueError("need epsilon >= 0 and 0 <= delta < 1")
    return min(1.0, (math.expm1(epsilon) + 2 * delta) / (math.exp(epsilon) + 1))


@torch.no_grad()
def per_example_losses(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       data: Dataset, batch_size: int = 2048) -> torch.Tensor:
    """``loss_fn(logits, labels)`` per example (it must return one value per example)."""
    logits, labels = collect_outputs(model, data, batch_size)
    return loss_fn(logits, labels).reshape(-1).double()


def _attack_metrics(labels: np.ndarray, scores: np.ndarray) -> Dict[str, float]:
    from sklearn.metrics import roc_auc_score, roc_curve

    fpr, tpr, _ = roc_curve(labels, scores)
    return {"advantage": float(np.max(tpr - fpr)), "auroc": float(roc_auc_score(labels, scores))}


def loss_threshold_attack(member_losses: torch.Tensor, nonmember_losses: torch.Tensor) -> Dict[str, float]:
    """Loss-threshold attack (Yeom et al.): best advantage ``max_t TPR(t) - FPR(t)`` over thresholds, and AUROC."""
    scores = -torch.cat([member_losses, nonmember_losses]).double().numpy()
    labels = np.concatenate([np.ones(len(member_losses)), np.zeros(len(nonmember_losses))])
    return _attack_metrics(labels, scores)


@torch.no_grad()
def _features(model: nn.Module, data: Dataset, num_classes: int) -> np.ndarray:
    """Attack features: the softmax probability of the true label, its log, and the sorted top-3 probabilities."""
    logits, y = collect_outputs(model, data)
    p = torch.softmax(logits.double(), dim=1)
    true = p[torch.arange(len(y)), y]
    top = p.topk(min(3, num_classes), dim=1).values
    return torch.cat([true[:, None], true.clamp_min(1e-30).log()[:, None], top], dim=1).numpy()


def shadow_model_scores(
    train_shadow: Callable[[Dataset], nn.Module],
    shadow_pool: Dataset,
    target: nn.Module,
    members: Dataset,
    nonmembers: Dataset,
    num_classes: int,
    num_shadows: int = 4,
    seed: int = 0,
) -> Tuple[np.ndarray, np.ndarray]:
    """Shadow-model attack: ``train_shadow`` (the target's training recipe) is run on ``num_shadows`` random
    halves of ``shadow_pool`` (data disjoint from the target's); a logistic regression learns member vs
    non-member from the shadows' outputs.  Returns its member probabilities on the target's ``members``
    and ``nonmembers``."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(seed)
    n = len(shadow_pool)  # type: ignore[arg-type]
    feats, labels = [], []
    for _ in range(num_shadows):
        perm = rng.permutation(n)
        inside, outside = perm[: n // 2].tolist(), perm[n // 2 :].tolist()
        model = train_shadow(Subset(shadow_pool, inside))
        feats += [_features(model, Subset(shadow_pool, inside), num_classes),
                  _features(model, Subset(shadow_pool, outside), num_classes)]
        labels += [np.ones(len(inside)), np.zeros(len(outside))]
    attacker = LogisticRegression(max_iter=1000).fit(np.concatenate(feats), np.concatenate(labels))
    return (attacker.predict_proba(_features(target, members, num_classes))[:, 1],
            attacker.predict_proba(_features(target, nonmembers, num_classes))[:, 1])


def shadow_model_attack(*args: Any, **kwargs: Any) -> Dict[str, float]:
    """Advantage and AUROC of the shadow-model attack (arguments of :func:`shadow_model_scores`)."""
    inside, outside = shadow_model_scores(*args, **kwargs)
    labels = np.concatenate([np.ones(len(inside)), np.zeros(len(outside))])
    return _attack_metrics(labels, np.concatenate([inside, outside]))


def membership_audit(member_scores: Any, nonmember_scores: Any, delta: float, confidence: float = 0.95,
                     epsilon_claimed: Optional[float] = None, mode: str = "membership") -> AuditResult:
    """Epsilon lower bound from an attack's scores (higher = member), as an :class:`AuditResult`.

    The one-run statistic (spec §9) guesses "member" for the highest scores and "non-member" for the
    lowest; it bounds epsilon at ``confidence`` when every record's membership was decided by an
    independent fair coin (as :func:`~clipless.diagnostics.one_run.one_run_audit` does).  For a fixed
    train/test split it is an estimate.  The attack's advantage and AUROC are in ``details``.
    """
    inside = np.asarray(member_scores, dtype=float).reshape(-1)
    outside = np.asarray(nonmember_scores, dtype=float).reshape(-1)
    if len(inside) == 0 or len(outside) == 0:
        raise ValueError("a membership audit needs members and non-members")
    scores = np.concatenate([inside, outside])
    included = np.concatenate([np.ones(len(inside), dtype=bool), np.zeros(len(outside), dtype=bool)])
    bound = one_run_bound(scores, included, delta, confidence)
    metrics = _attack_metrics(included.astype(float), scores)
    return AuditResult(mode=mode, epsilon_claimed=epsilon_claimed, epsilon_lower=bound["epsilon_lower"],
                       confidence=confidence, delta=delta, trials=len(scores),
                       method="one-run guesses (Steinke et al. 2023), best of k+ = k- settings with Bonferroni",
                       details={**metrics, "guesses": bound["guesses"], "correct": bound["correct"],
                                "settings_tried": bound["settings_tried"],
                                "advantage_bound": dp_advantage_bound(epsilon_claimed, delta)
                                if epsilon_claimed is not None else None},
                       scores_out=outside, scores_in=inside)
