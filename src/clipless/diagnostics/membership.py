"""Membership-inference audits of a trained model (spec §3.5), and the bound DP puts on them.

Two attacks: the loss threshold of Yeom et al. (guess "member" when the loss is low) and a shadow-model
attack (Shokri et al.): shadow models trained on known halves of a disjoint pool give labelled
(features -> member?) examples for a logistic-regression attacker.  An (epsilon, delta)-DP training
bounds every attack's advantage ``TPR - FPR`` by ``(e^eps - 1 + 2 delta) / (e^eps + 1)``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ..train.evaluation import collect_outputs

__all__ = ["dp_advantage_bound", "per_example_losses", "loss_threshold_attack", "shadow_model_attack"]


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


def shadow_model_attack(
    train_shadow: Callable[[Dataset], nn.Module],
    shadow_pool: Dataset,
    target: nn.Module,
    members: Dataset,
    nonmembers: Dataset,
    num_classes: int,
    num_shadows: int = 4,
    seed: int = 0,
) -> Dict[str, float]:
    """Shadow-model attack: ``train_shadow`` (the target's training recipe) is run on ``num_shadows`` random
    halves of ``shadow_pool`` (data disjoint from the target's); a logistic regression learns member vs
    non-member from the shadows' outputs and is scored on the target's ``members`` / ``nonmembers``."""
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
    x = np.concatenate([_features(target, members, num_classes), _features(target, nonmembers, num_classes)])
    y = np.concatenate([np.ones(len(members)), np.zeros(len(nonmembers))])  # type: ignore[arg-type]
    return _attack_metrics(y, attacker.predict_proba(x)[:, 1])
