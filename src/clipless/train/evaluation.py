"""One evaluation helper for trainers, certificates, membership audits and embeddings (test data: no privacy cost)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["predictions", "collect_outputs", "evaluate"]


def predictions(logits: torch.Tensor) -> torch.Tensor:
    """Class predictions: argmax of multiclass logits, sign of a single binary logit."""
    if logits.dim() == 2 and logits.shape[1] > 1:
        return logits.argmax(dim=1)
    return (logits.reshape(-1) > 0).long()


@torch.no_grad()
def collect_outputs(
    model: nn.Module, data: Union[Dataset, DataLoader], batch_size: int = 2048,
    forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, device: Any = "cpu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(forward(x), y)`` over a labelled dataset (or a ``DataLoader``'s batches, as it yields them), concatenated
    (on ``device``), with ``model`` in eval mode (restored after); ``forward`` defaults to ``model``."""
    was_training = model.training
    model.eval()
    fn = forward if forward is not None else model
    outputs, labels = [], []
    try:
        for x, y in data if isinstance(data, DataLoader) else DataLoader(data, batch_size=batch_size):
            outputs.append(fn(x.to(device)))
            labels.append(y.to(device))
    finally:
        model.train(was_training)
    return torch.cat(outputs), torch.cat(labels)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Union[Dataset, DataLoader], loss: Optional[Any] = None,
             batch_size: int = 2048, device: Any = "cpu") -> Dict[str, float]:
    """Accuracy (and mean ``loss.per_example``) of ``model`` on ``dataset`` (or a ``DataLoader``'s batches)."""
    logits, labels = collect_outputs(model, dataset, batch_size, device=device)
    total = max(int(labels.shape[0]), 1)
    out = {"accuracy": int((predictions(logits) == labels).sum()) / total}
    if loss is not None:
        out["loss"] = float(loss.per_example(logits, labels).sum()) / total
    return out
