"""Poisson subsampling (SPEC §1): every record enters each batch independently with probability ``q``."""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

__all__ = ["PoissonBatchSampler", "poisson_data_loader", "BatchCollator", "PreCollated"]


class PoissonBatchSampler(Sampler[List[int]]):
    """Yields ``steps_per_epoch`` batches; each holds every index independently with probability ``sample_rate``.

    Batches have random size and may be empty: this is the sampling the
    accountant assumes.  ``len`` is the number of steps per epoch,
    ``round(1/q)`` by default (one expected pass over the data).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("dataset is empty")
        if not (0 < sample_rate <= 1):
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = int(steps_per_epoch) if steps_per_epoch else max(1, round(1.0 / sample_rate))
        self.generator = generator if generator is not None else torch.Generator()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps_per_epoch):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield mask.nonzero(as_tuple=True)[0].tolist()


class BatchCollator:
    """Collate that also builds empty batches with the dataset's per-record shapes and dtypes."""

    def __init__(self, dataset: Dataset, collate_fn: Any = default_collate) -> None:
        self.collate_fn = collate_fn
        self._empty = self._empty_like(dataset[0])

    @staticmethod
    def _empty_like(sample: Any) -> Any:
        if isinstance(sample, torch.Tensor):
            return torch.zeros((0,) + tuple(sample.shape), dtype=sample.dtype)
        if isinstance(sample, (tuple, list)):
            return type(sample)(BatchCollator._empty_like(s) for s in sample)
        if isinstance(sample, (int, float)):
            return torch.zeros((0,), dtype=torch.int64 if isinstance(sample, int) else torch.float32)
        raise TypeError(f"cannot build an empty batch for records of type {type(sample).__name__}")

    def __call__(self, batch: Sequence[Any]) -> Any:
        if isinstance(batch, PreCollated):
            return batch.tensors
        if len(batch) == 0:
            return self._empty
        return self.collate_fn(batch)


class PreCollated:
    """A batch that is already stacked (from a dataset's ``gather``)."""

    def __init__(self, tensors: Any) -> None:
        self.tensors = tensors


class _GatherView(Dataset):
    """Lets the DataLoader fetch a batch through ``dataset.gather(indices)`` in one operation."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: List[int]) -> Any:
        return PreCollated(self.dataset.gather(indices)) if indices else []


def poisson_data_loader(
    dataset: Dataset,
    sample_rate: float,
    generator: Optional[torch.Generator] = None,
    steps_per_epoch: Optional[int] = None,
    num_workers: int = 0,
) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` with Poisson batches (possibly empty)."""
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps_per_epoch, generator)  # type: ignore[arg-type]
    if hasattr(dataset, "gather"):
        dataset = _GatherView(dataset)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=BatchCollator(dataset), num_workers=num_workers)

