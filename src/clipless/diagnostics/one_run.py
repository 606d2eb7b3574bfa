"""Black-box audit with one training run (spec §9; Steinke, Nasr, Jagielski 2023).

``m`` canary records are each added to the training data by an independent fair coin; one private
training runs on the result; every canary is scored by the trained model (higher = more likely a member,
here minus its loss) and :func:`~clipless.diagnostics.membership.membership_audit` turns the best guesses
into an epsilon lower bound at a stated confidence.  The default canaries are training records with a
wrong label drawn at random: they are hard to fit from the other records, so their inclusion shows.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ..data.datasets import ArrayDataset
from ..privacy.certified import whole_number
from ..privacy.modules import LipschitzLoss
from ..privacy.randomness import make_generator
from .audit_stats import AuditResult
from .membership import membership_audit

__all__ = ["mislabelled_canaries", "loss_scores", "one_run_audit"]


def mislabelled_canaries(data: ArrayDataset, m: int, num_classes: int, generator: Optional[torch.Generator] = None
                         ) -> Tuple[ArrayDataset, torch.Tensor, torch.Tensor]:
    """``(rest, canary_x, canary_y)``: ``m`` records taken out of ``data``, each given a random wrong label among
    ``num_classes`` (the split's declared classes, :class:`~clipless.data.datasets.DataSplit`)."""
    n, classes = len(data), num_classes
    if not (1 <= m <= n // 2):
        raise ValueError(f"the number of canaries must be in [1, N/2 = {n // 2}] for {n} training records, got {m}")
    whole_number(classes, "the number of classes of mislabelled canaries", 2)
    order = torch.randperm(n, generator=generator)
    chosen, rest = order[:m], order[m:]
    shift = torch.randint(1, classes, (m,), generator=generator)
    labels = (data.labels[chosen] + shift) % classes
    return ArrayDataset(data.features[rest], data.labels[rest]), data.features[chosen], labels.to(data.labels.dtype)


@torch.no_grad()
def loss_scores(model: nn.Module, loss: LipschitzLoss, x: torch.Tensor, y: torch.Tensor,
                batch_size: int = 2048) -> torch.Tensor:
    """Minus each record's loss under ``model`` (evaluation mode): the black-box membership score."""
    was = model.training
    model.eval()
    try:
        out = [loss.per_example(model(x[i:i + batch_size]), y[i:i + batch_size]) for i in range(0, len(x), batch_size)]
    finally:
        model.train(was)
    return -torch.cat(out).double() if out else torch.zeros(0, dtype=torch.float64)


def one_run_audit(
    train: Callable[[ArrayDataset], Tuple[nn.Module, float]],
    data: ArrayDataset,
    canaries: Tuple[torch.Tensor, torch.Tensor],
    score: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    delta: float,
    confidence: float = 0.95,
    seed: Optional[int] = None,
) -> AuditResult:
    """One training run on ``data`` plus each canary with probability 1/2; ``train`` returns
    ``(model, claimed epsilon)`` and ``score(model, x, y)`` one score per canary (higher = member).

    The coins come from OS entropy unless ``seed`` is given (they must stay unknown to the training).
    """
    cx, cy = canaries
    m = len(cx)
    if m < 2:
        raise ValueError("a one-run audit needs at least 2 canaries")
    coins = torch.randint(0, 2, (m,), generator=make_generator(seed, stream=4)).bool()
    train_set = ArrayDataset(torch.cat([data.features, cx[coins]]), torch.cat([data.labels, cy[coins]]))
    model, epsilon = train(train_set)
    scores = score(model, cx, cy).double().cpu()
    result = membership_audit(scores[coins].numpy(), scores[~coins].numpy(), delta, confidence, epsilon,
                              mode="one-run")
    result.details.update({"canaries": m, "canaries_included": int(coins.sum()), "training_records": len(train_set)})
    return result
