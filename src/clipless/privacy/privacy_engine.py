"""``PrivacyEngine.make_private``: the Opacus-style entry point of clipless DP-SGD."""

from __future__ import annotations

import hashlib
import math
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .accounting import PrivacyAccountant, check_delta
from .bounds import BoundEngine, check_input_shape
from .calibration import plan_noise, planned_steps
from .certified import BoundError, check_flag, is_real
from .distributed import (DistributedPoissonBatchSampler, all_gather_objects, check_distinct_on_all_ranks,
                          check_same_on_all_ranks, same_outcome_on_all_ranks, world)
from .input_guard import (DATA_BOUND_REFUSAL, INPUT_BOUND_TOLERANCE, InputGuard, above_data_bound, all_finite,
                          digest_seed, row_digests, use_digest_seed)
from .modules import DeclaredConstants, InputClip, LipschitzLoss, step_mechanisms
from .noise import check_secure_flag
from .optimizer import DPOptimizer
from .randomness import check_generator
from .sampling import (check_each_record_once, dataset_size, expected_batch_size, in_memory_records, loader_parts,
                       poisson_data_loader, poisson_steps_per_epoch, poisson_threshold, record_chunks)

__all__ = ["PrivacyEngine", "resolve_input_bound", "first_leaf", "check_dataset_records", "check_model_takes"]


def first_leaf(model: nn.Module) -> nn.Module:
    """The first layer data goes through (descending into ``nn.Sequential``)."""
    while isinstance(model, nn.Sequential) and len(model) > 0:
        model = model[0]
    return model


def resolve_input_bound(model: nn.Module, input_bound: Optional[float]) -> Tuple[float, Optional[float]]:
    """``(X_0 for the engine, bound the raw data must satisfy or None)``.

    ``X_0`` comes from a leading :class:`~clipless.privacy.modules.InputClip` (e.g. ``InputNormClip``) or from a declared
    ``input_bound`` that every input is then checked against — never from the
    data itself.  The check admits norms up to ``input_bound (1 + INPUT_BOUND_TOLERANCE)``, and so does ``X_0``.
    """
    if input_bound is not None and (not is_real(input_bound) or not 0 < float(input_bound) < math.inf):
        # named as given, before the tolerance (which made -1 read as -1.000001)
        raise BoundError(f"input_bound must be a positive finite number (every input's L2 norm is checked against "
                         f"it), got {input_bound!r}")
    head = first_leaf(model)
    # a checked bound admits norms up to input_bound (1 + INPUT_BOUND_TOLERANCE): X_0 is raised to match
    checked = None if input_bound is None else float(input_bound) * (1 + INPUT_BOUND_TOLERANCE)
    if isinstance(head, InputClip):
        x0 = head.max_norm if checked is None else min(head.max_norm, checked)
        return x0, (float(input_bound) if input_bound is not None else None)
    if input_bound is None:
        raise BoundError(
            "no input bound: start the model with InputNormClip(C) or pass input_bound= (a bound fixed "
            "without looking at the data; inputs above it are refused)"
        )
    return checked, float(input_bound)  # type: ignore[return-value]


@torch.no_grad()
def check_model_takes(model: nn.Module, dtype: torch.dtype, input_shape: Tuple[int, ...], what: str) -> None:
    """The model's forward takes records of ``dtype``: one record of zeros (no data) goes through it, so that
    float64 records and a float32 model (or the reverse) are refused by name before any step, not by torch's
    dtype error at the first Poisson batch or at the first evaluation, after released steps."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # a running statistic (a wing's encoder may hold one) must not take the probe in
    try:
        model(torch.zeros((1, *input_shape), dtype=dtype, device=device))
    except RuntimeError as exc:
        weights = "" if param is None else f", the model's weights {param.dtype}"
        raise ValueError(f"{what}: records of dtype {dtype}{weights}, and the model's forward refuses them ({exc}); "
                         "convert one to the other's dtype, e.g. x.float() for the records or model.double() "
                         "for the model") from exc
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def check_dataset_records(data: Optional[Dataset], what: str, loss: LipschitzLoss, input_shape: Tuple[int, ...],
                          output_shape: Tuple[int, ...], data_bound: Optional[float] = None, read: bool = True,
                          indices: Optional[Sequence[int]] = None, progress: bool = False,
                          model: Optional[nn.Module] = None, digests: Optional[List[torch.Tensor]] = None,
                          each_once: bool = False) -> None:
    """Every record of ``data`` (of ``indices`` if given), checked as the private step checks a batch, before any
    step: its per-example shape, its dtype (float32 or float64, and one ``model``'s forward takes:
    :func:`check_model_takes`), finite values, the data bound (training data) and
    its label by the loss's own rule for the model's output shape.  A record that fails would otherwise stop the
    run at the step whose Poisson batch first holds it: after a number of released steps that depends on that
    record, or never.  An in-memory dataset is checked from its tensors; another is read once in order
    (:func:`~clipless.privacy.sampling.record_chunks`; ``progress``: with a bar), unless ``read=False``.  A dataset
    whose records change from one read to the next (random transforms in ``__getitem__``) is checked on the draws
    read here; the step checks its later draws.  ``digests``, a list, receives the row digests of the records
    checked (:func:`~clipless.privacy.input_guard.row_digests`).  ``each_once`` (training data): a dataset read
    record by record may not hand out one record's input for two indices (``record_chunks``)."""
    if data is None or (not read and in_memory_records(data) is None):
        return
    taken = set()
    for inputs, labels in record_chunks(data, indices, progress=progress, each_once=what if each_once else None):
        if tuple(inputs.shape[1:]) != tuple(input_shape):
            raise ValueError(f"{what}: records of per-example shape {tuple(inputs.shape[1:])}, the model's "
                             f"input_shape is {tuple(input_shape)}")
        if inputs.dtype not in (torch.float32, torch.float64):  # the step's norms and certified bounds need these
            raise ValueError(f"{what}: records of dtype {inputs.dtype}; the private step takes float32 or float64 "
                             "inputs (the bounds are certified for that arithmetic): convert them first, e.g. "
                             "x.float() / 255 for 8-bit pixels")
        if model is not None and inputs.dtype not in taken:
            check_model_takes(model, inputs.dtype, tuple(input_shape), what)
            taken.add(inputs.dtype)
        if not all_finite(inputs):
            raise ValueError(f"{what} contains NaN or infinite values; clean the data before private training")
        if digests is not None:
            digests.append(row_digests(inputs))
        if data_bound is not None and above_data_bound(inputs, data_bound):
            raise BoundError(f"{what}: a record {DATA_BOUND_REFUSAL.format(bound=data_bound)}")
        try:
            loss.per_example(torch.zeros((labels.shape[0], *output_shape), device=labels.device), labels)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None


def _dataset_of(data: Union[Dataset, DataLoader],
                batch_size: Optional[float]) -> Tuple[Dataset, float, Dict[str, Any]]:
    """The dataset, the expected batch size and, of a loader, its worker settings (:func:`worker_options`)."""
    if isinstance(data, DataLoader) and batch_size is None:
        if data.batch_size is None:
            raise ValueError("give batch_size: the data loader has no fixed batch size")
        batch_size = data.batch_size
    dataset, options = loader_parts(data)
    if batch_size is None:
        raise ValueError("give the expected batch size (batch_size)")
    check_each_record_once(dataset)
    return dataset, expected_batch_size(batch_size, dataset_size(dataset)), options


class PrivacyEngine(DeclaredConstants):
    """Holds the accountant; turns (model, optimizer, data) into a clipless private training setup.

    Noise and Poisson batches are drawn from OS entropy unless generators are passed (a fixed-seed
    generator makes the run non-private against anyone who knows the seed).
    """

    # the accountant that composes every step of its models (a fresh one would report their epsilon as 0)
    constants = ("accountant",)

    def __init__(self, accountant: str = "pld") -> None:
        self.accountant = PrivacyAccountant(accountant)
        self.record_declared()

    def check_accountant(self) -> None:
        """Refuse an accountant written into ``__dict__`` past the read-only guard: a fresh one reports the
        epsilon of no step, and the steps of the models made private go on composing in the original."""
        self.check_declared("the privacy engine", "its epsilon would not be that of the steps taken; build a new "
                            "PrivacyEngine for another accountant")

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Union[Dataset, DataLoader],
        loss: LipschitzLoss,
        noise_multiplier: Optional[float] = None,
        input_shape: Sequence[int],
        batch_size: Optional[float] = None,
        input_bound: Optional[float] = None,
        strategy: str = "global",
        layer_noise_multipliers: Union[Mapping[str, float], str, None] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        epochs: Optional[int] = None,
        noise_generator: Optional[torch.Generator] = None,
        sampling_generator: Optional[torch.Generator] = None,
        distributed: Optional[bool] = None,
        augmentation_multiplicity: int = 1,
        external_batches: bool = False,
        check_records: bool = True,
        progress: Optional[bool] = None,
        secure_noise: bool = False,
    ) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
        """Returns ``(module, dp_optimizer, poisson_loader)``.

        ``distributed`` (default: on inside a ``torch.distributed`` group of >= 2 processes, e.g. under
        ``torchrun``): the module comes back wrapped in ``DistributedDataParallel`` (weights broadcast from
        rank 0; gradients are summed by the private step, after rank 0's noise), the loader yields this rank's
        part of each global Poisson batch and ``batch_size`` is the expected *global* batch
        (:mod:`clipless.privacy.distributed`).  Every rank must call it with the same settings: checked.

        ``data``: a map-style dataset, or a ``DataLoader`` whose dataset and worker settings (``num_workers``,
        ``pin_memory``, ...) the Poisson loader keeps; its sampler and batch size are replaced by Poisson sampling,
        and a ``collate_fn`` of its own is refused (it may mix the records of a batch).
        ``batch_size`` is the *expected* Poisson batch size ``b = qN``.  In the
        loop, backpropagate ``loss.per_example(module(x), y).sum()`` and call
        ``dp_optimizer.step()`` once per batch, empty batches included.
        ``noise_multiplier`` is the gradient's effective multiplier and
        ``layer_noise_multipliers`` relative per-layer weights (or ``"energy"``),
        as everywhere (:mod:`clipless.privacy.calibration`).  With ``target_epsilon``
        (and ``target_delta``) the optimizer refuses any step past the budget; without
        ``noise_multiplier`` sigma is calibrated so ``epochs`` epochs fit it.  ``secure_noise``: each noise value
        is a sum of 4 draws (:func:`~clipless.privacy.noise.gaussian`; Opacus' ``secure_mode``), against
        floating-point attacks on the Gaussian sampler, for 4 times the draws.
        ``augmentation_multiplicity`` ``K`` (augmult): each example of a batch may enter the forward as ``K``
        augmented rows; backpropagate the mean of its ``K`` per-row losses, summed over the examples
        (``per_example.view(K, -1).mean(0).sum()`` for ``K`` stacked copies of the batch).  The per-example
        bound, the noise and the accounting are unchanged: the mean of ``K`` gradients within the bound is.
        Each step must release exactly one new batch of ``poisson_loader``; ``external_batches=True`` lifts
        that check for a loop that draws Poisson batches at rate ``batch_size / len(data)`` by other means
        (the accountant assumes it does; nothing can check it).  Every record of ``data`` is checked first, by
        the step's own rules and, but for external batches, against the model's forward
        (:func:`check_dataset_records`): a dataset that is not in memory is read once for it (on each rank, its own
        shard), unless ``check_records=False``; its records are then checked only when a batch holds them, and a
        bad one stops the run at a step that depends on the secret sampling.  ``progress``: a bar while that read
        runs (default: on a terminal, on rank 0).
        """
        self.check_accountant()
        # switches and generators as given: a truthy string ("no") or an int would read as a choice
        for value, name in ((external_batches, "external_batches"), (check_records, "check_records")):
            check_flag(value, name)
        check_secure_flag(secure_noise)  # here too, before any record is read
        check_flag(distributed, "distributed", optional=True)
        check_flag(progress, "progress", optional=True)
        check_generator(noise_generator, "noise_generator")
        check_generator(sampling_generator, "sampling_generator")
        if not isinstance(loss, LipschitzLoss):
            raise BoundError(f"{type(loss).__name__} declares no Lipschitz constant; use a clipless loss")
        input_shape = check_input_shape(input_shape)
        dataset, b, loader_options = _dataset_of(data, batch_size)
        n = len(dataset)  # type: ignore[arg-type]
        rank, world_size = world()
        if distributed is None:
            distributed = world_size > 1
        if progress is None:
            progress = sys.stderr.isatty()
        progress = bool(progress) and rank == 0
        if distributed:
            if world_size == 1:
                raise ValueError("distributed=True needs an initialized torch.distributed process group of >= 2 "
                                 "processes (torchrun, or torch.distributed.init_process_group)")
            check_same_on_all_ranks({
                "records": n, "expected batch size": b, "noise_multiplier": noise_multiplier,
                "target_epsilon": target_epsilon, "target_delta": target_delta, "epochs": epochs,
                "strategy": strategy, "layer_noise_multipliers": layer_noise_multipliers,
                "accountant": self.accountant.mechanism, "input_shape": tuple(input_shape), "input_bound": input_bound,
                "loss": (type(loss).__name__, loss.lipschitz),
                "parameters": [tuple(p.shape) for p in module.parameters()],
                "noise randomness": "fixed generator" if noise_generator is not None else "os-entropy",
                "sampling randomness": "fixed generator" if sampling_generator is not None else "os-entropy",
                "augmentation_multiplicity": augmentation_multiplicity,
                "external_batches": bool(external_batches), "secure_noise": secure_noise,
            }, "make_private")
            if sampling_generator is not None:
                state = sampling_generator.get_state().cpu().numpy().tobytes()
                check_distinct_on_all_ranks(hashlib.sha256(state).hexdigest(), "sampling generator state")
        wrapped: nn.Module = module
        if distributed:
            from torch.nn.parallel import DistributedDataParallel

            # DDP broadcasts rank 0's weights (and buffers, once) before any bound is computed; the private
            # step sums the gradients itself, after the noise, so DDP's averaging all-reduce is switched off
            wrapped = DistributedDataParallel(module, forward_sync_buffers=False)
            wrapped.require_backward_grad_sync = False
        if target_delta is not None:
            check_delta(target_delta, n)
        if target_epsilon is not None and target_delta is None:
            raise ValueError("target_epsilon needs target_delta")
        if target_epsilon is not None and self.accountant.steps > 0:
            raise ValueError(f"this engine's accountant has already composed {self.accountant.steps} step(s): a "
                             "target epsilon plans a run from its first step and would not count them; give "
                             "noise_multiplier instead (the accountant composes every step, get_epsilon(delta) "
                             "reports the total)")
        sample_rate = b / n
        poisson_threshold(sample_rate)  # refuses a rate the sampler cannot realise, before anything runs
        x0, data_bound = resolve_input_bound(module, input_bound)
        engine = BoundEngine(module, input_shape, x0, loss)
        probe = None if external_batches else module  # the records reach the model only through the Poisson loader
        # the records' digests, against which each step's rows are checked (none for batches drawn elsewhere)
        digests: Optional[List[torch.Tensor]] = None if external_batches else []
        if distributed:  # each rank reads its own shard; a refusal on one is a refusal on all (no rank left waiting)
            if digests is not None:  # rank 0's digest weights on every rank: a record gets one digest everywhere
                use_digest_seed(all_gather_objects(digest_seed())[0])
            same_outcome_on_all_ranks(lambda: check_dataset_records(
                dataset, "the training data", loss, engine.input_shape, engine.output_shape, data_bound,
                read=check_records, indices=range(rank, n, world_size), progress=progress, model=probe,
                digests=digests, each_once=True),
                device=next((p.device for p in module.parameters()), torch.device("cpu")),  # NCCL: CUDA tensors only
                refused="refused a record of their shard of the training data (their error says which check): no "
                        "rank goes on; clean the data")
            if digests is not None:  # every shard's records: a rank's rows are checked against all of them
                digests = all_gather_objects(torch.cat(digests).cpu() if digests else torch.zeros(0, dtype=torch.int64))
        else:
            check_dataset_records(dataset, "the training data", loss, engine.input_shape, engine.output_shape,
                                  data_bound, read=check_records, progress=progress, model=probe, digests=digests,
                                  each_once=True)
        steps_per_epoch = poisson_steps_per_epoch(sample_rate)
        plan = plan_noise(
            engine.compute(),
            sample_rate=sample_rate,
            accountant=self.accountant.mechanism,
            strategy=strategy,
            layer_noise_multipliers=layer_noise_multipliers,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=target_delta,
            steps=None if epochs is None else planned_steps(epochs, steps_per_epoch),
            mechanism_sigmas=[clip.count_noise_multiplier for clip in step_mechanisms(module)],
        )
        dp_optimizer = DPOptimizer(optimizer, engine, plan, expected_batch_size=b, accountant=self.accountant,
                                   generator=noise_generator, distributed=bool(distributed),
                                   augmentation_multiplicity=augmentation_multiplicity, secure_noise=secure_noise)
        self.guard = InputGuard(module, input_shape, data_bound)
        if distributed:
            sampler = DistributedPoissonBatchSampler(n, sample_rate, rank, world_size, steps_per_epoch,
                                                     sampling_generator)
            loader = poisson_data_loader(dataset, sample_rate, steps_per_epoch=steps_per_epoch, batch_sampler=sampler,
                                         worker_options=loader_options)
        else:
            loader = poisson_data_loader(dataset, sample_rate, generator=sampling_generator,
                                         steps_per_epoch=steps_per_epoch, worker_options=loader_options)
        dp_optimizer.watch_batches(loader, external_batches, input_guard=self.guard,
                                   record_digests=torch.cat(digests) if digests else None)
        return wrapped, dp_optimizer, loader

    def make_private_with_epsilon(
        self,
        *,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        **kwargs,
    ) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
        """As :meth:`make_private`, with ``sigma`` calibrated so ``epochs`` epochs stay within ``target_epsilon``
        (every per-step mechanism and the per-layer allocation included); the optimizer stops at the budget."""
        if kwargs.get("noise_multiplier") is not None:
            raise ValueError("make_private_with_epsilon calibrates noise_multiplier; use make_private to fix it")
        return self.make_private(target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, **kwargs)

    def get_epsilon(self, delta: float) -> float:
        self.check_accountant()
        return self.accountant.get_epsilon(delta)
