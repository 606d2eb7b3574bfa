"""Embedding quality on held-out labelled data (no privacy cost for the pre-training records): kNN and a
linear probe, each trained and measured on halves of the test split."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset

from ..train.evaluation import collect_outputs
from .logit_dp import normalized_embedding

__all__ = ["LAYERS", "embed", "representation", "knn_accuracy", "linear_probe_accuracy", "few_label_probe_accuracy",
           "evaluate_encoder"]

# What is evaluated: the normalized embedding the contrastive loss sees, or the representation before the last
# nn.Linear (SimCLR's h before its projection head z; Chen et al. 2020 probe h).
LAYERS = ("embedding", "representation")


@torch.no_grad()
def embed(encoder: nn.Module, data: Dataset, batch_size: int = 2048) -> tuple:
    """Normalized embeddings and labels of a labelled dataset."""
    return collect_outputs(encoder, data, batch_size, forward=lambda x: normalized_embedding(encoder, x))


def representation(encoder: nn.Module) -> nn.Module:
    """The encoder without its last ``nn.Linear``: SimCLR's representation ``h`` under the projection ``z``."""
    if not (isinstance(encoder, nn.Sequential) and len(encoder) > 1 and isinstance(encoder[-1], nn.Linear)):
        raise ValueError("the representation layer needs an nn.Sequential encoder ending in nn.Linear (the "
                         f"projection to the embedding), got {type(encoder).__name__}; evaluate the embedding")
    body = encoder[:-1]
    if not any(p.numel() for p in body.parameters()):
        raise ValueError("the representation layer is the encoder's input here (no trained layer before its last "
                         "Linear); evaluate the embedding or give the encoder hidden layers")
    return body


def knn_accuracy(encoder: nn.Module, reference: Dataset, test: Dataset, k: int = 3) -> float:
    """Accuracy of a ``k``-NN classifier (cosine distance) on test embeddings, neighbours from ``reference``."""
    from sklearn.neighbors import KNeighborsClassifier

    ref_x, ref_y = embed(encoder, reference)
    test_x, test_y = embed(encoder, test)
    knn = KNeighborsClassifier(n_neighbors=k, metric="cosine", algorithm="brute", n_jobs=1)
    knn.fit(ref_x.numpy(), ref_y.numpy())
    return float((knn.predict(test_x.numpy()) == test_y.numpy()).mean())


def linear_probe_accuracy(encoder: nn.Module, train: Dataset, test: Dataset, epochs: int = 100,
                          lr: float = 0.05, hidden: Optional[int] = None, seed: int = 0) -> float:
    """Test accuracy of a linear (or one-hidden-layer MLP) head trained on the frozen encoder's embeddings.

    Full-batch Adam on the cross-entropy; the head is trained without privacy (an evaluation protocol).
    """
    return _probe_accuracy(*embed(encoder, train), *embed(encoder, test), epochs, lr, hidden, seed)


def _probe_accuracy(tr_x: torch.Tensor, tr_y: torch.Tensor, te_x: torch.Tensor, te_y: torch.Tensor, epochs: int,
                    lr: float, hidden: Optional[int], seed: int) -> float:
    """:func:`linear_probe_accuracy` on embeddings already computed."""
    classes = int(max(tr_y.max(), te_y.max())) + 1
    torch.manual_seed(seed)
    d = tr_x.shape[1]
    head: nn.Module = (nn.Linear(d, classes) if hidden is None else
                       nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, classes)))
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        nn.functional.cross_entropy(head(tr_x), tr_y).backward()
        opt.step()
    with torch.no_grad():
        return float((head(te_x).argmax(1) == te_y).double().mean())


def few_label_indices(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """``per_class`` random indices of each class present in ``labels`` (all of a class if it has fewer)."""
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    gen = torch.Generator().manual_seed(seed)
    picks = []
    for c in torch.unique(labels):
        members = torch.nonzero(labels == c).flatten()
        picks.append(members[torch.randperm(len(members), generator=gen)[:per_class]])
    return torch.cat(picks).sort().values


def few_label_probe_accuracy(encoder: nn.Module, reference: Dataset, queries: Dataset, per_class: int,
                             draws: int = 3, seed: int = 0) -> float:
    """Mean over ``draws`` random labelled subsets of :func:`linear_probe_accuracy` with ``per_class`` labels
    of each class from ``reference`` (the semi-supervised setting where pre-training should pay off)."""
    ref_x, ref_y = embed(encoder, reference)
    query_x, query_y = embed(encoder, queries)
    scores = []
    for draw in range(draws):
        picked = few_label_indices(ref_y, per_class, seed + draw)
        scores.append(_probe_accuracy(ref_x[picked], ref_y[picked], query_x, query_y, epochs=100, lr=0.05,
                                      hidden=None, seed=seed + draw))
    return sum(scores) / len(scores)


def evaluate_encoder(encoder: nn.Module, test: Dataset, per_class: Tuple[int, ...] = (),
                     layer: str = "embedding") -> Dict[str, Any]:
    """kNN (k=3) and linear-probe accuracy measured on the public test split alone, and with ``per_class``
    the few-label probe accuracies ``probe_<k>_per_class`` (:func:`few_label_probe_accuracy`).

    Its even records are the kNN reference set and the probe's training set, its odd records the queries:
    the pre-training records never enter a released number (spec §7).  ``layer``: one of ``LAYERS``; the
    representation is L2-normalized like the embedding (cosine kNN, probes on the unit sphere).
    """
    from torch.utils.data import Subset

    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    if layer == "representation":
        encoder = representation(encoder)
    reference, queries = Subset(test, range(0, len(test), 2)), Subset(test, range(1, len(test), 2))  # type: ignore[arg-type]
    result: Dict[str, Any] = {"knn3_accuracy": knn_accuracy(encoder, reference, queries, k=3),
                              "linear_probe_accuracy": linear_probe_accuracy(encoder, reference, queries)}
    for k in per_class:
        result[f"probe_{k}_per_class"] = few_label_probe_accuracy(encoder, reference, queries, k)
    result["evaluation"] = "test split halves (even records: reference / probe training; odd records: queries)"
    result["layer"] = layer
    return result
