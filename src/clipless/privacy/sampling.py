"""Poisson subsampling (spec §1): every record enters each batch independently with probability ``q``."""

from __future__ import annotations

import weakref
from fractions import Fraction
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils.data import (BatchSampler, ConcatDataset, DataLoader, Dataset, IterableDataset, RandomSampler,
                              Sampler, SequentialSampler, Subset, TensorDataset)
from torch.utils.data._utils.collate import default_collate, default_convert

from .input_guard import batch_row_digests
from .certified import DeclaredConstants, is_real, whole_number
from .randomness import check_generator, is_secret_generator, mechanism_words, secret_generator

__all__ = ["PoissonBatchSampler", "PoissonDataLoader", "poisson_data_loader", "BatchCollator", "PreCollated",
           "poisson_threshold", "realised_sample_rate", "expected_batch_size", "poisson_steps_per_epoch",
           "dataset_size", "SAMPLING_BITS", "in_memory_records", "record_chunks", "worker_options", "WORKER_SETTINGS",
           "loader_parts", "step_progress", "physical_batches", "check_physical_batch_size", "repeated_record",
           "check_each_record_once"]

# Inclusion is decided by an integer draw ``k`` uniform on [0, 2^53) against ``floor(q 2^53)``: exact integer
# arithmetic, so the realised rate is ``floor(q 2^53) / 2^53``, within 2^-53 *below* q (spec §7: float32
# uniforms have resolution 2^-24 and realised q = 3.33e-7 as 3.58e-7).  A rate at or below the accounted q
# never under-reports epsilon (the subsampled Gaussian's epsilon increases with q).
SAMPLING_BITS = 53


def dataset_size(data: Any) -> int:
    """``len(data)`` of a map-style dataset; a stream (``IterableDataset``) is refused: Poisson sampling picks each
    record by index, independently."""
    if isinstance(data, torch.Tensor) or (isinstance(data, tuple) and data
                                          and all(isinstance(t, torch.Tensor) for t in data)):
        raise TypeError("data must be a map-style Dataset of (input, label) records, got a "
                        f"{'tensor' if isinstance(data, torch.Tensor) else 'tuple of tensors'}: wrap the tensors, "
                        "e.g. clipless.ArrayDataset(x, y) or torch.utils.data.TensorDataset(x, y)")
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        raise TypeError(f"data must be a map-style Dataset with a length (got {type(data).__name__}): Poisson "
                        "sampling picks each record by index, independently, with rate batch_size / len(data)")
    return len(data)


def _record_sources(data: Any, rows: Optional[torch.Tensor] = None) -> Iterator[Tuple[Any, Optional[torch.Tensor]]]:
    """``(dataset, rows of it)`` under the ``Subset`` and ``ConcatDataset`` views of ``data`` (``rows`` None: all)."""
    if isinstance(data, Subset):
        chosen = torch.as_tensor(list(data.indices), dtype=torch.long)
        yield from _record_sources(data.dataset, chosen if rows is None else chosen[rows])
    elif isinstance(data, ConcatDataset):
        ends = torch.as_tensor(data.cumulative_sizes, dtype=torch.long)
        part = None if rows is None else torch.searchsorted(ends, rows, right=True)
        for i, dataset in enumerate(data.datasets):
            start = int(ends[i - 1]) if i else 0
            if rows is None:
                yield from _record_sources(dataset)
            elif bool((part == i).any()):
                yield from _record_sources(dataset, rows[part == i] - start)
    else:
        yield data, rows


def repeated_record(data: Any) -> Optional[Tuple[int, Any, int]]:
    """``(index, dataset, times)`` of a record that ``data`` holds more than once through its ``Subset`` and
    ``ConcatDataset`` views (repeated indices, a dataset or its records concatenated twice), or ``None``.  Poisson
    sampling draws each copy on its own: that record's privacy is then that of ``times`` records (group privacy).
    Records equal in value but stored apart are distinct records."""
    counts: Dict[int, Tuple[Any, torch.Tensor]] = {}
    for dataset, rows in _record_sources(data):
        size = dataset_size(dataset)
        held = counts.get(id(dataset), (dataset, torch.zeros(size, dtype=torch.long)))[1]
        if rows is not None:
            rows = torch.where(rows < 0, rows + size, rows)  # negative indices count from the end, as in indexing
            rows = rows[(rows >= 0) & (rows < size)]  # an index out of range fails where it is read, not here
        held += 1 if rows is None else torch.bincount(rows, minlength=size)
        counts[id(dataset)] = (dataset, held)
    for dataset, held in counts.values():
        if held.numel() and int(held.max()) > 1:
            index = int(held.argmax())
            return index, dataset, int(held[index])
    return None


def _held_twice(what: str, record: str, times: str, how: str) -> ValueError:
    """The refusal of training data that holds one record more than once, ``how`` (one wording for every way)."""
    return ValueError(f"{what} holds {record} {times} ({how}): Poisson sampling draws each copy on its own, so that "
                      "record's privacy is that of several records, outside the reported epsilon; give each record "
                      "once (to weigh a class up, weigh the others' losses down with a weight in [0, 1] in each "
                      "record, (x, y, w) records: class weights the loop sets are refused by the private step)")


def check_each_record_once(data: Any, what: str = "the training data") -> None:
    """Refuse training data that holds a record more than once (:func:`repeated_record`): the accountant counts
    one Poisson draw per record and step, and each copy is one more."""
    repeated = repeated_record(data)
    if repeated is not None:
        index, base, times = repeated
        raise _held_twice(what, f"record {index} of its {type(base).__name__}", f"{times} times", "a Subset with "
                          "repeated indices, or a ConcatDataset that holds a dataset or its records twice")


class _EachRecordOnce(Dataset):
    """``data`` as read in order, refusing an input that the dataset hands out for two indices: the same tensor
    object (a list holding one record's tensor twice), or the same view of one tensor (an index list naming a row
    twice), while that tensor is alive.  Each tensor read (or viewed) is held by a weak reference, so one made
    afresh at each read and freed since (whose memory a later record may reuse) never matches, and what was noted of
    it goes when it is freed; records equal in value but stored apart stay distinct records, as for
    :func:`repeated_record`.  ``views``: how many leading tensors of a record are its inputs (2 for a pair: one
    record's two views may be one tensor, another pair's view may not)."""

    def __init__(self, data: Any, what: str, views: int = 1) -> None:
        self.data, self.what, self.views = data, what, views
        # per tensor alive: a weak reference to it, and the index that read each (offset, shape, strides) of it
        self.seen: Dict[int, Tuple[Any, Dict[Tuple[int, ...], int]]] = {}
        self._forget_freed = self._forget  # one bound method for every reference's callback

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        item = self.data[index]
        inputs = item[:self.views] if isinstance(item, (tuple, list)) else (item,)
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                continue
            base = x._base
            anchor = x if base is None else base  # a view: the tensor it views, and where (a tensor: itself, whole)
            entry = self.seen.get(id(anchor))
            if entry is None or entry[0]() is not anchor:
                ref = _Noted(anchor, self._forget_freed)
                ref.key = id(anchor)
                entry = self.seen[ref.key] = (ref, {})
            place = () if base is None else (x.storage_offset(), *x.shape, *x.stride())
            earlier = entry[1].setdefault(place, index)
            if earlier != index:
                raise _held_twice(self.what, "one record", f"twice, at indices {earlier} and {index}",
                                  "a Dataset whose __getitem__ returns the same tensor, or the same row of one, for "
                                  "both: oversampling by repeated entries, or a pair made of another pair's record")
        return item

    def _forget(self, dead: "_Noted") -> None:
        """A tensor made afresh for one read is gone, and what was noted of it with it."""
        entry = self.seen.get(dead.key)
        if entry is not None and entry[0] is dead:
            del self.seen[dead.key]


class _Noted(weakref.ref):
    """A weak reference that knows the key it was noted under (:class:`_EachRecordOnce`)."""

    __slots__ = ("key",)


def in_memory_records(data: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, labels)``, every record of an in-memory dataset as the loader yields them: a dataset with an
    ``in_memory_records()`` method (``clipless.ArrayDataset``), ``TensorDataset(x, y)``, or a ``Subset`` of one;
    ``None`` for another dataset, whose records show only when it is read."""
    if isinstance(data, Subset):
        records = in_memory_records(data.dataset)
        if records is None:
            return None
        index = torch.as_tensor(list(data.indices), dtype=torch.long)
        return records[0][index], records[1][index]
    own = getattr(data, "in_memory_records", None)
    if callable(own):
        return own()
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return data.tensors[0], data.tensors[1]
    return None


def record_chunks(data: Dataset, indices: Optional[Sequence[int]] = None, chunk: int = 1 << 12, progress: bool = False,
                  each_once: Optional[str] = None, views: int = 1) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Every record of ``data`` (those of ``indices`` if given) as ``(inputs, labels)`` chunks, as the Poisson
    loader yields them: an in-memory dataset's tensors (:func:`in_memory_records`), another dataset read once in
    order through the loader's collate (``progress``: with a bar of the records read).  Stops at a chunk that is not
    an ``(inputs, labels)`` pair of tensors (records of another structure are checked when a batch holds them).
    ``each_once`` (the data's name): a dataset read record by record may not hand out one input (of the ``views``
    leading tensors of a record) for two indices (:class:`_EachRecordOnce`)."""
    records = in_memory_records(data)
    if records is not None:
        inputs, labels = (torch.as_tensor(t) for t in records)  # a dataset of one's own may hand over arrays
        if indices is not None:
            index = torch.as_tensor(list(indices), dtype=torch.long)
            inputs, labels = inputs[index], labels[index]
        yield from zip(inputs.split(chunk), labels.split(chunk))
        return
    order = list(range(len(data))) if indices is None else list(indices)  # type: ignore[arg-type]
    if not order:
        return
    view = _GatherView(data) if hasattr(data, "gather") else data
    if each_once is not None and view is data:
        view = _EachRecordOnce(data, each_once, views)
    loader = DataLoader(view, batch_sampler=[order[i:i + chunk] for i in range(0, len(order), chunk)],
                        collate_fn=BatchCollator(data))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(order), desc="checking the records", unit="record", leave=False)
    try:
        for batch in loader:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                    and all(isinstance(t, torch.Tensor) for t in batch)):
                return
            if bar is not None:
                bar.update(len(batch[1]))
            yield batch[0], batch[1]
    finally:
        if bar is not None:
            bar.close()


# A bar's rate and elapsed time grow with the realised (secret) Poisson batch sizes: shown only where timings are
# asked for (log_train_stats), as for the times in result files.
_NO_TIMING_BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt}"


def step_progress(iterable: Any = None, total: Optional[int] = None, desc: str = "", timing: bool = False,
                  disable: bool = False) -> Any:
    """A ``tqdm`` bar over private steps (or epochs): counts only, redrawn at every step, unless ``timing`` (then
    tqdm's rate and times too, and its redraws every 0.1 s: which states a log holds then tells how long steps took)."""
    from tqdm.auto import tqdm

    counts_only = {} if timing else {"bar_format": _NO_TIMING_BAR, "mininterval": 0, "miniters": 1}
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=disable, **counts_only)


def check_physical_batch_size(size: Any) -> Optional[int]:
    """``max_physical_batch_size`` as given: ``None`` (whole batches) or an integer >= 1."""
    return None if size is None else whole_number(size, "max_physical_batch_size")


def physical_batches(x: torch.Tensor, y: torch.Tensor,
                     max_size: Optional[int]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """One drawn batch as parts of at most ``max_size`` rows (the whole batch for ``None``), as Opacus'
    ``BatchMemoryManager`` splits a Poisson batch: backpropagate each part's sum of per-example losses, then step
    once.  The gradient summed over the parts is the batch's (per-example gradients are independent of the
    batch), so the step is the same and only the activations of one part are held at a time.  The parts are views
    of ``x`` and ``y``; an empty batch is one empty part (it is a step too)."""
    max_size = check_physical_batch_size(max_size)
    if max_size is None or x.shape[0] <= max_size:
        return [(x, y)]
    return list(zip(x.split(max_size), y.split(max_size)))


def expected_batch_size(batch_size: Any, records: int) -> float:
    """The expected Poisson batch size ``b = qN`` as a float in ``(0, N]``; a bool (``True`` would read as 1),
    a non-number, NaN or a size outside the range is refused."""
    if records < 1:
        raise ValueError("the training dataset is empty: there is nothing to sample batches from")
    if not is_real(batch_size) or not (0 < batch_size <= records):
        raise ValueError(f"batch_size (the expected Poisson batch size) must be a number in (0, N={records}], "
                         f"got {batch_size!r}")
    return float(batch_size)


def poisson_steps_per_epoch(sample_rate: float) -> int:
    """Steps of one epoch of Poisson batches at rate ``q``: ``round(1/q)``, at least 1 (an epoch draws ``N``
    records in expectation); a run's step budget is its epochs times this."""
    poisson_threshold(sample_rate)  # a rate the sampler cannot realise (below 2^-53: 1/q may be infinite) is refused
    return max(1, round(1.0 / sample_rate))


def poisson_threshold(sample_rate: float) -> int:
    """``floor(q 2^53)``, exactly (``q`` as the binary fraction it is); refuses a rate that cannot be realised."""
    if not (0 < sample_rate <= 1):
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    threshold = int(Fraction(sample_rate) * (1 << SAMPLING_BITS))
    if threshold == 0:
        raise ValueError(f"sample rate {sample_rate:g} is below 2^-{SAMPLING_BITS}: Poisson sampling cannot realise it")
    return threshold


def realised_sample_rate(sample_rate: float) -> Fraction:
    """The inclusion probability the sampler actually realises for ``sample_rate`` (``<= q``, within 2^-53)."""
    return Fraction(poisson_threshold(sample_rate), 1 << SAMPLING_BITS)


def poisson_mask(num_samples: int, threshold: int, generator: torch.Generator) -> torch.Tensor:
    """Boolean mask, each entry True independently with probability ``threshold / 2^53``
    (``threshold = poisson_threshold(q)``, so the probability is ``realised_sample_rate(q)``); a secret generator's
    53-bit draws come from its AES key stream (:func:`~clipless.privacy.randomness.mechanism_words`)."""
    if is_secret_generator(generator):
        draws = mechanism_words(generator, num_samples, generator.device) >> (63 - SAMPLING_BITS)
    else:
        draws = torch.randint(0, 1 << SAMPLING_BITS, (num_samples,), generator=generator, dtype=torch.int64,
                              device=generator.device)
    return draws < threshold


class PoissonBatchSampler(DeclaredConstants, Sampler[List[int]]):
    """Yields ``steps_per_epoch`` batches; each holds every index independently with probability ``sample_rate``.

    Batches have random size and may be empty: this is the sampling the
    accountant assumes.  ``len`` is the number of steps per epoch,
    ``round(1/q)`` by default (one expected pass over the data).  Without a
    ``generator`` the batches are drawn from OS entropy (:func:`~clipless.privacy.randomness.secret_generator`).
    """

    # the inclusion rate the accountant composes and the secret stream it is drawn from
    constants = ("threshold", "num_samples", "sample_rate", "generator")

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("dataset is empty")
        check_generator(generator, "generator")
        self.threshold = poisson_threshold(sample_rate)  # validates
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = int(steps_per_epoch) if steps_per_epoch else poisson_steps_per_epoch(sample_rate)
        self.generator = generator if generator is not None else secret_generator()
        self.record_declared()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _mask(self, num_samples: int) -> torch.Tensor:
        """One Poisson draw, refused if a constant was written past the read-only guard (the optimizer's check at
        the step would not see a rate raised for the draw and put back before it)."""
        self.check_declared("the Poisson sampler", "its batches would not be the samples the accountant composes")
        return poisson_mask(num_samples, self.threshold, self.generator)

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps_per_epoch):
            yield self._mask(self.num_samples).nonzero(as_tuple=True)[0].tolist()


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
    batch_sampler: Optional[Sampler[List[int]]] = None,
    worker_options: Optional[Mapping[str, Any]] = None,
) -> PoissonDataLoader:
    """A ``DataLoader`` over ``dataset`` with Poisson batches (possibly empty); ``batch_sampler`` replaces the
    one-process sampler (a rank's part of a distributed Poisson batch); ``worker_options``: how records are loaded
    (:func:`worker_options`), never which."""
    sampler = batch_sampler if batch_sampler is not None else PoissonBatchSampler(
        len(dataset), sample_rate, steps_per_epoch, generator)  # type: ignore[arg-type]
    if hasattr(dataset, "gather"):
        dataset = _GatherView(dataset)
    options = {"num_workers": num_workers, **(worker_options or {})}
    return PoissonDataLoader(dataset, batch_sampler=sampler, collate_fn=BatchCollator(dataset), **options)


# The DataLoader settings that say how records are loaded (processes, pinned memory), not which records a batch holds
# or how they are put together: kept from a loader given to make_private.
WORKER_SETTINGS = ("num_workers", "pin_memory", "pin_memory_device", "timeout", "worker_init_fn",
                   "multiprocessing_context", "prefetch_factor", "persistent_workers")


def worker_options(loader: DataLoader) -> Dict[str, Any]:
    """The worker settings of ``loader`` for its Poisson replacement; a collate function of its own is refused: it
    sees a whole batch and may mix its records (mixup, normalising by the batch's statistics), so that one record
    reaches every row and the per-example bound no longer holds for it."""
    _check_sampler(loader, "make_private draws Poisson batches over every record of the loader's dataset (what "
                           "the accountant composes): the records it leaves out would be trained on, and its weights "
                           "ignored; give the records to train on as the dataset (torch.utils.data.Subset(dataset, "
                           "indices))")
    collate = loader.collate_fn
    if isinstance(collate, BatchCollator):  # a Poisson loader's own (a model made private again)
        collate = collate.collate_fn
    if collate not in (default_collate, default_convert):
        raise ValueError(f"the data loader has a collate_fn of its own ({getattr(collate, '__name__', collate)!r}): "
                         "it sees the whole batch and may mix its records, so that one record reaches several "
                         "rows and the per-example bound would not hold; transform each record in the dataset's "
                         "__getitem__ (the Poisson loader collates records with torch's default_collate)")
    options = {name: getattr(loader, name) for name in WORKER_SETTINGS if hasattr(loader, name)}
    if not options.get("num_workers"):  # torch refuses these without worker processes
        for name in ("prefetch_factor", "persistent_workers", "timeout", "worker_init_fn", "multiprocessing_context"):
            options.pop(name, None)
    return options


def loader_parts(data: Any, training: bool = True) -> Tuple[Any, Dict[str, Any]]:
    """``data`` as given, or a ``DataLoader``'s dataset and worker settings (:func:`worker_options`): a private run
    draws its own Poisson batches from the dataset.  ``training=False`` (held-out data, scored in batches of its
    own): the dataset alone, whatever its loader's settings.  Bare tensors and streams are refused by name
    (:func:`dataset_size`), before anything runs."""
    dataset, options = data, {}
    if isinstance(data, DataLoader):
        dataset = data.dataset
        if training:
            options = worker_options(data)
        else:
            _check_sampler(data, "held-out data is scored on every record of the loader's dataset: the records it "
                                 "leaves out would be scored too; give the records to score as the dataset "
                                 "(torch.utils.data.Subset(dataset, indices))")
    if dataset is not None:
        dataset_size(dataset)
    return dataset, options


def _check_sampler(loader: DataLoader, consequence: str) -> None:
    """Refuse a loader whose sampler chooses the records (a subset, weights, a shard) where the library reads the
    whole dataset: a plain or shuffled order chooses none, and a Poisson loader's own sampler is the accounted one."""
    if isinstance(loader, PoissonDataLoader) or isinstance(loader.dataset, IterableDataset):
        return  # a stream has no sampler; dataset_size refuses it
    batches = loader.batch_sampler
    chooser = loader.sampler if batches is None else batches.sampler if type(batches) is BatchSampler else batches
    # an order over another source (SequentialSampler(range(k))) chooses records as a subset sampler does
    plain = type(chooser) in (SequentialSampler, RandomSampler) and len(chooser.data_source) == len(loader.dataset)
    if not plain:
        raise ValueError(f"the data loader's {type(chooser).__name__} chooses the records its batches hold; "
                         + consequence)


class PoissonDataLoader(DataLoader):
    """A ``DataLoader`` that counts the batches it hands out (``batches_drawn``), so that the private step can
    check it releases exactly one new batch per step: the accountant composes one Poisson sample per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_drawn = 0
        self._last_batch_rows: Optional[int] = None
        self._last_batch_digests: List[Tuple[Tuple[int, ...], torch.Tensor]] = []

    # Read-only: a count set by hand would let one batch be released by two steps, which the accountant composes
    # as two fresh Poisson samples.
    @property
    def batches_drawn(self) -> int:
        """Batches handed out so far."""
        return self._batches_drawn

    @property
    def last_batch_rows(self) -> Optional[int]:
        """Records in the batch handed out last (None: not a tensor batch)."""
        return self._last_batch_rows

    @property
    def last_batch_digests(self) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
        """(per-row shape, row digests) of each tensor of that batch: the private step checks that no record
        entered its forwards in more rows than the batch holds it."""
        return self._last_batch_digests

    def parts(self) -> Tuple[Any, Any, Any]:
        """The batch sampler, collate function and dataset its batches come from, for an identity check: written
        into ``__dict__`` past ``DataLoader``'s guard, a sampler draws at another rate than the accountant's, and a
        collate that repeats rows makes each record count several times in a batch its digests call drawn."""
        return self.batch_sampler, self.collate_fn, self.dataset

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for batch in super().__iter__():
            # counted when handed to the caller, not when the sampler runs (workers prefetch ahead)
            self._batches_drawn += 1
            self._last_batch_rows = _rows(batch)
            self._last_batch_digests = batch_row_digests(batch)
            yield batch


def _rows(batch: Any) -> Optional[int]:
    """The leading size of the first tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        rows = _rows(item)
        if rows is not None:
            return rows
    return None

