"""One private run across processes, on ``torch.distributed`` (spec §8).

* **Sampling.** Record ``i`` belongs to the shard of rank ``i mod W``; every rank includes each record of its
  shard with probability ``q``, from its own secret generator.  The union of the ranks' batches is therefore
  one Poisson(``q``) sample of the whole dataset (independent inclusions), and the accountant composes the
  same ``q = b / N`` as on one process (``b``: the expected *global* batch).  Local batches may be empty.
* **Noise.** Rank 0 adds the one draw of ``N(0, sigma^2 Delta^2)`` per coordinate to its local sum; the sums
  are then all-reduced (SUM) and divided by ``b``.  Rank 0 knows the noise and must be trusted as the single
  process is; another rank (honest but curious) sees its own records and the noisy global sum only.
* **Everything else is replicated.** The weights start identical (``DistributedDataParallel`` broadcasts
  them), every rank computes the same certified bounds and projection on the same noisy gradient, so the
  weights stay bit-identical; the accountant steps identically on every rank, and files are written by rank 0.
* **Refusals are collective.** The step's checks run on every rank's own backward; one more all-reduce of a
  flag per rank before the noise makes every rank refuse a step that one rank refuses.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
from .certified import BoundError
from .sampling import PoissonBatchSampler

T = TypeVar("T")

__all__ = ["world", "is_distributed", "all_reduce_sum_", "all_gather_objects", "broadcast_value",
           "check_same_on_all_ranks", "check_distinct_on_all_ranks", "same_outcome_on_all_ranks",
           "DistributedPoissonBatchSampler"]


def world() -> Tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    """True inside an initialized process group of more than one process."""
    return world()[1] > 1


def all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> None:
    """Sum ``tensors`` over all ranks in place, in one all-reduce of a flat buffer."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_value(value: float, device: Any = "cpu") -> float:
    """Rank 0's ``value`` on every rank (float64)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.broadcast(t, src=0)
    return float(t.item())


def all_gather_objects(value: Any) -> List[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` on one process."""
    _, size = world()
    if size == 1:
        return [value]
    gathered: List[Any] = [None] * size
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def check_same_on_all_ranks(values: Dict[str, Any], what: str = "run") -> None:
    """Refuse, on every rank, a ``what`` whose settings differ between ranks (one guarantee needs one plan)."""
    if world()[1] == 1:
        return
    gathered: List[Optional[Dict[str, Any]]] = all_gather_objects({k: repr(v) for k, v in values.items()})
    differing = sorted(k for k in values if len({repr(g.get(k)) if g else None for g in gathered}) > 1)
    if differing:
        # every rank has seen the same gather: wait until all are done with it, so that no rank tears the group
        # down under a peer still receiving (gloo aborts that peer instead of letting it refuse)
        torch.distributed.barrier()
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {r} {g.get(k) if g else None}" for r, g in enumerate(gathered))
                           for k in differing)
        raise BoundError(f"the ranks of this distributed {what} disagree ({detail}): every rank must run the same "
                         "configuration, or the epsilon of one is not the epsilon of the others")


def check_distinct_on_all_ranks(value: Any, what: str) -> None:
    """Refuse, on every rank, a ``value`` that two ranks share: each rank's Poisson draws must be independent of
    the others' for the union of the ranks' batches to be the one Poisson sample the accountant composes."""
    gathered = all_gather_objects(value)
    shared = [r for r in range(len(gathered)) if gathered.count(gathered[r]) > 1]
    if shared:
        torch.distributed.barrier()  # as in check_same_on_all_ranks: no rank leaves a peer still receiving
        raise BoundError(f"ranks {shared} start from the same {what}: their Poisson batches would be correlated "
                         "(the same records drawn on every shard), so the union is not one Poisson sample and the "
                         "epsilon would be wrong; give each rank its own generator, e.g. "
                         "make_generator(seed, stream=1 + 1000 * rank)")


_STEP_REFUSED = ("refused this step (their error says why): no rank released it; call optimizer.zero_grad() and run "
                 "the next batch on every rank")


def same_outcome_on_all_ranks(run: Callable[[], T], device: Any = "cpu", refused: str = _STEP_REFUSED) -> T:
    """``run()`` on every rank; if it raises on any rank, every rank raises (the rank's own error, or one naming
    the ranks that failed, then ``refused``), so that no rank goes on to a collective its peers never join."""
    rank, size = world()
    failure: Optional[Exception] = None
    result: Optional[T] = None
    try:
        result = run()
    except Exception as err:  # any failure: a peer left waiting would hang until the group's timeout
        failure = err
    flags = torch.zeros(size, dtype=torch.int64, device=device)
    flags[rank] = failure is not None
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.SUM)
    if failure is not None:
        raise failure
    failed = [r for r, flag in enumerate(flags.tolist()) if flag]
    if failed:
        raise BoundError(f"rank(s) {failed} {refused}")
    return result  # type: ignore[return-value]


class DistributedPoissonBatchSampler(PoissonBatchSampler):
    """This rank's part of one Poisson(``sample_rate``) sample of all ``num_samples`` records per step.

    The rank holds records ``rank, rank + W, rank + 2W, ...`` and includes each with probability
    ``sample_rate`` from ``generator`` (OS entropy by default; it must differ between ranks).
    ``len`` is the number of steps per epoch, the same on every rank (``round(1/q)`` by default).
    """

    # the rank's records too: a shard written over by hand (all records on every rank) would put a record in up to
    # W parts of one step's batch
    constants = PoissonBatchSampler.constants + ("rank", "world_size")

    def __init__(self, num_samples: int, sample_rate: float, rank: int, world_size: int,
                 steps_per_epoch: Optional[int] = None, generator: Optional[torch.Generator] = None) -> None:
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.rank, self.world_size = int(rank), int(world_size)
        super().__init__(num_samples, sample_rate, steps_per_epoch, generator)  # records the constants

    @property
    def shard(self) -> torch.Tensor:
        """The records this rank holds, from the declared constants (never stored: nothing to overwrite)."""
        return torch.arange(self.rank, self.num_samples, self.world_size)

    def __iter__(self) -> Iterator[List[int]]:
        shard = self.shard
        for _ in range(self.steps_per_epoch):
            yield shard[self._mask(len(shard))].tolist()
