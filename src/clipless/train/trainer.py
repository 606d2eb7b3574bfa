"""``PrivateTrainer``: the full clipless DP-SGD loop with budget, logging and checkpoints.

The loop sums per-example losses of each Poisson batch (empty batches
included), lets :class:`~clipless.privacy.optimizer.DPOptimizer` add calibrated noise,
and stops before a step would take epsilon past the target.
"""

from __future__ import annotations

import copy
import functools
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..data.augment import ImageAugmentation
from ..data.datasets import check_held_out
from ..diagnostics.tightness import TightnessMonitor
from ..privacy.accounting import check_accounted_steps, check_delta, check_nothing_released
from ..privacy.certified import check_flag, is_real
from ..privacy.modules import DeclaredConstants, LipschitzLoss, project_all_
from ..privacy.distributed import all_gather_objects, world
from ..privacy.privacy_engine import PrivacyEngine, check_dataset_records
from ..privacy.randomness import make_generator, randomness_label, resume_generator, saved_generator_state
from ..privacy.sampling import (check_physical_batch_size, dataset_size, expected_batch_size, loader_parts,
                                physical_batches, poisson_steps_per_epoch, step_progress)
from .checkpoint import (check_checkpoint_free, check_fits, check_records, checkpoint_destination,
                         fingerprint_key_for, keyed_fingerprint, load_checkpoint, read_fingerprint_key,
                         save_checkpoint)
from .evaluation import evaluate, predictions

__all__ = ["PrivateTrainer", "TrainResult"]


@dataclass
class TrainResult:
    """What a run releases.  Everything here is covered by the guarantee or measured on the test split,
    except the ``nonprivate_*`` entries, present only when asked for (``log_train_stats``): among them the
    wall-clock times, which grow with the realised (secret) Poisson batch sizes."""

    test_accuracy: Optional[float]
    epsilon: float
    delta: float
    noise_multiplier: float
    effective_noise_multiplier: float
    steps: int
    epochs: float
    expected_batch_size: float
    sample_rate: float
    sampling: str
    accountant: str
    strategy: str
    private: bool
    randomness: str
    privacy_note: str
    nonprivate_wall_time_s: Optional[float]
    stopped_by_budget: bool
    history: List[Dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _ours(function: Any) -> bool:
    """Whether ``function`` (a function, or an object called as one) is defined in clipless."""
    module = function.__module__ if isinstance(function, types.FunctionType) else type(function).__module__
    return str(module).partition(".")[0] == "clipless"


class PrivateTrainer(DeclaredConstants):
    """Train ``model`` with clipless DP-SGD on ``train_data`` under (``target_epsilon``, ``delta``).

    Give ``target_epsilon`` (sigma is calibrated for ``epochs``), or
    ``noise_multiplier`` (with ``target_epsilon`` too, the number of steps is
    calibrated and training stops at the budget); both go through the one noise
    plan (:func:`~clipless.privacy.calibration.plan_noise`).  With ``strategy='per_layer'``,
    ``layer_noise_multipliers`` are relative weights or ``'energy'``.
    Noise and sampling are drawn from OS entropy; ``noise_seed`` fixes them for
    experiments, and the result then says the run is not private.  ``secure_noise``: each noise value is a sum of
    draws against floating-point attacks on the Gaussian sampler (``make_private``'s).
    ``lr_scheduler``: a function of the private optimizer returning a torch learning-rate scheduler (e.g.
    ``lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)``), stepped after every epoch and
    kept in the checkpoint: a function of the epoch count, post-processing.  ``ReduceLROnPlateau`` is refused (its
    metric would be a training statistic without noise, or the test score tuned on).
    ``log_train_stats`` adds the loss and accuracy of the training batches to the
    history, labelled ``nonprivate_*``: they are computed without noise.
    ``tightness_monitor`` checks true per-example gradients against the bounds
    during training and stops with :class:`~clipless.BoundError` if one exceeds them.
    ``max_physical_batch_size``: each Poisson batch goes forward and backward in parts of at most that many
    examples (:func:`~clipless.privacy.sampling.physical_batches`; their gradients are summed, then one step): the
    same steps, with the activation memory of a part.
    Every training and test record is checked before any step (``make_private``'s ``check_records``: ``False``
    skips the read of a dataset that is not in memory, whose bad records then stop the run where a batch or the
    first evaluation meets them).
    """

    # What its epsilon, its privacy label and its test score are computed from: set once (a changed delta would
    # report another epsilon, a changed noise_seed another label, a new privacy engine the epsilon of no step, than
    # the run's noise and batches have; the training data as test_data a score without noise).
    constants = ("delta", "target_epsilon", "noise_seed", "sample_rate", "strategy", "privacy_engine", "optimizer",
                 "loader", "train_data", "test_data")

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: LipschitzLoss,
        train_data: Union[Dataset, DataLoader],
        *,
        input_shape: Any,
        batch_size: float,
        delta: float,
        epochs: Optional[int] = None,
        target_epsilon: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        input_bound: Optional[float] = None,
        strategy: str = "global",
        layer_noise_multipliers: Union[Mapping[str, float], str, None] = None,
        accountant: str = "pld",
        noise_seed: Optional[int] = None,
        test_data: Union[Dataset, DataLoader, None] = None,
        device: str = "cpu",
        progress: bool = True,
        log: Optional[Callable[[str], None]] = print,
        checkpoint_path: Optional[Union[str, Path]] = None,
        average_decay: Optional[float] = None,
        tightness_monitor: Optional[TightnessMonitor] = None,
        log_train_stats: bool = False,
        distributed: Optional[bool] = None,
        augmentation_multiplicity: int = 1,
        augment: Optional[Callable[[torch.Tensor, Optional[torch.Generator]], torch.Tensor]] = None,
        check_records: bool = True,
        secure_noise: bool = False,
        lr_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
        max_physical_batch_size: Optional[int] = None,
    ) -> None:
        if target_epsilon is None and noise_multiplier is None:
            raise ValueError("give target_epsilon, noise_multiplier, or both")
        # settings first read at the first batch or step: refused here, before the records are read and checked
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1'), got {device!r}") from None
        for value, name in ((log, "log"), (augment, "augment"), (lr_scheduler, "lr_scheduler")):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be a function or None, got {type(value).__name__} {value!r}")
        if tightness_monitor is not None and not isinstance(tightness_monitor, TightnessMonitor):
            raise TypeError("tightness_monitor must be a TightnessMonitor or None, got "
                            f"{type(tightness_monitor).__name__}")
        self.max_physical_batch_size = check_physical_batch_size(max_physical_batch_size)
        if epochs is None and target_epsilon is None:
            raise ValueError("give epochs or target_epsilon: training would never stop")
        # a loader stands for its dataset (its records, not its batches, are counted and held out); make_private
        # keeps its worker settings
        records, _ = loader_parts(train_data)
        n = dataset_size(records)
        check_delta(delta, n)
        test_data, _ = loader_parts(test_data, training=False)  # scored in batches of its own
        check_held_out(records, test_data)
        batch_size = expected_batch_size(batch_size, n)
        self.model, self.loss, self.train_data, self.test_data = model, loss, records, test_data
        self.delta, self.target_epsilon, self.strategy = delta, target_epsilon, strategy
        self.device, self.progress, self.log = device, progress, log
        self.noise_seed = noise_seed
        self.log_train_stats = check_flag(log_train_stats, "log_train_stats")  # the opt-in to un-noised statistics
        self.checkpoint_path = checkpoint_destination(checkpoint_path)
        self._continues: Optional[Path] = None  # the checkpoint file this run resumed from or wrote (resolved)
        self.sample_rate = batch_size / n
        self.steps_per_epoch = poisson_steps_per_epoch(self.sample_rate)
        self.privacy_engine = PrivacyEngine(accountant)
        # every rank samples its own shard: its own stream (rank 0's is the one-process stream)
        self.sampling_generator = make_generator(noise_seed, stream=1 + 1000 * world()[0])
        self.model, self.optimizer, self.loader = self.privacy_engine.make_private(
            module=model,
            optimizer=optimizer,
            data=train_data,
            loss=loss,
            noise_multiplier=noise_multiplier,
            input_shape=input_shape,  # checked there (check_input_shape) before anything reads it
            batch_size=batch_size,
            input_bound=input_bound,
            strategy=strategy,
            layer_noise_multipliers=layer_noise_multipliers,
            target_epsilon=target_epsilon,
            target_delta=delta,
            epochs=epochs,
            noise_generator=make_generator(noise_seed, next(model.parameters()).device, stream=2),
            sampling_generator=self.sampling_generator,
            distributed=distributed,
            augmentation_multiplicity=augmentation_multiplicity,
            check_records=check_records,
            progress=progress,
            secure_noise=secure_noise,
        )
        # the training records were checked by make_private; a bad held-out record would stop the run at the first
        # evaluation, after an epoch of private steps, or (a label out of range) make its accuracy silently wrong
        check_dataset_records(test_data, "test_data", loss, self.optimizer.bound_engine.input_shape,
                              self.optimizer.bound_engine.output_shape, read=check_records,
                              model=model)  # not the DistributedDataParallel wrapper: no collective in the probe
        # Augmentation multiplicity: K augmented rows per example, each loss weighted 1/K (make_private).
        self.augmentation_multiplicity = augmentation_multiplicity
        if augmentation_multiplicity > 1 and augment is None:
            if len(tuple(input_shape)) != 3:
                raise ValueError(f"augmentation multiplicity needs an augment function for inputs of shape "
                                 f"{tuple(input_shape)} (the default, ImageAugmentation, shifts (C, H, W) images)")
            augment = ImageAugmentation()
        self.augment = augment
        self.augment_generator = (make_generator(noise_seed, stream=3 + 1000 * world()[0])
                                  if augment is not None else None)
        # (0, 1) unless the run is distributed: a trainer kept to one process inside a group writes its own files
        self.rank, self.world_size = self.optimizer.rank, self.optimizer.world_size
        # (steps, every rank's streams), gathered at the end of each epoch of a distributed run
        self._rank_streams: Optional[Tuple[int, List[Dict[str, Optional[torch.Tensor]]]]] = None
        # the module itself (the one DistributedDataParallel wraps): evaluation, averaging and checkpoints
        self.module: nn.Module = model
        if self.rank != 0:  # one process writes and logs for all
            self.log, self.checkpoint_path, self.progress = None, None, False
        plan = self.optimizer.plan
        self.max_steps: int = plan.max_steps  # type: ignore[assignment]
        self.steps = 0
        self.epoch = 0
        self.history: List[Dict[str, float]] = []
        # Exponential moving average of the released iterates: post-processing, no privacy cost.
        decay = average_decay
        if decay is not None and (not is_real(decay) or not 0 < decay < 1):
            raise ValueError(f"average_decay must be a number in (0, 1), got {average_decay!r}")
        self.average_decay = average_decay
        self.tightness_monitor = tightness_monitor
        # A deep copy leaves the guards behind (clipless.privacy.input_guard): the average is never stepped by the optimizer.
        self.averaged_model: Optional[nn.Module] = copy.deepcopy(self.module) if average_decay else None
        self._wall = 0.0
        self.lr_scheduler = None if lr_scheduler is None else lr_scheduler(self.optimizer)
        if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("ReduceLROnPlateau steps on a metric: a training loss would be a statistic of the "
                             "batches without noise, and the test score would be tuned on; use a schedule of the "
                             "epoch count (StepLR, CosineAnnealingLR, ...)")
        if self.lr_scheduler is not None and not callable(getattr(self.lr_scheduler, "state_dict", None)):
            raise ValueError(f"lr_scheduler must return a torch learning-rate scheduler, got "
                             f"{type(self.lr_scheduler).__name__}")
        # What made the run (e.g. the CLI's resolved flags): kept in the checkpoint so a resume can restore it.
        self.run_config: Optional[Dict[str, Any]] = None
        self.record_declared()

    def _check_settings(self) -> None:
        """The settings the epsilon and the randomness label are computed from are still those the run was built
        with (a write into ``__dict__`` passes the read-only guard: ``noise_seed`` set to None would label a seeded
        run "os-entropy"; a fresh accountant written into the engine's would report the epsilon of no step; the
        training data as ``test_data`` would publish a score computed without noise)."""
        self.privacy_engine.check_accountant()
        self.check_declared("the trainer", "its epsilon, randomness label or test score would describe another run; "
                            "build a new PrivateTrainer for other settings")

    @torch.no_grad()
    def _update_average(self) -> None:
        decay = self.average_decay
        for avg, p in zip(self.averaged_model.parameters(), self.module.parameters()):  # type: ignore[union-attr]
            avg.mul_(decay).add_(p, alpha=1 - decay)

    def eval_model(self) -> nn.Module:
        """The model to evaluate and ship: the projected average of the iterates when averaging, else the model."""
        if self.averaged_model is None:
            return self.module
        return project_all_(copy.deepcopy(self.averaged_model))  # the average of feasible weights, re-projected

    @property
    def accountant(self):
        return self.privacy_engine.accountant

    def epsilon(self) -> float:
        self._check_settings()
        return self.accountant.get_epsilon(self.delta)

    def _train_epoch(self) -> Dict[str, float]:
        self.model.train()
        loss_sum, correct, seen = 0.0, 0, 0
        batches = self.loader
        bar = None
        if self.progress:
            bar = step_progress(total=min(len(batches), int(self.max_steps - self.steps)),
                                desc=f"epoch {self.epoch + 1}", timing=self.log_train_stats)
        for x, y in batches:  # fit() calls this only while steps < max_steps
            x, y = x.to(self.device), y.to(self.device)
            self.optimizer.zero_grad()
            k = self.augmentation_multiplicity
            first = None
            # an example's K augmented rows stay in its part: the part's loss weighs each of them 1/K
            for xs, ys in physical_batches(x, y, self.max_physical_batch_size):
                if self.augment is not None:  # K stacked augmented copies of the part (k-major rows)
                    xs = torch.cat([self._augmented(xs) for _ in range(k)])
                    self.optimizer.derived_rows_(xs)  # augmented copies of the drawn records, whatever they equal
                    ys = ys.repeat(k)
                logits = self.model(xs)
                per_row = self.loss.per_example(logits, ys)
                per_example = per_row.view(k, -1).mean(0) if k > 1 else per_row
                per_example.sum().backward()
                first = (xs, ys) if first is None else first
                if self.log_train_stats:  # otherwise nothing of the batch is read back: no work, nothing to leak
                    with torch.no_grad():
                        loss_sum += float(per_row.sum())
                        correct += int((predictions(logits) == ys).sum())
                        seen += int(ys.shape[0])
            monitor = self.tightness_monitor
            if monitor is not None and monitor.due(self.steps):
                # before the step: the noise of this step is calibrated to the report of these weights (the first
                # rows of the batch, as without parts)
                monitor.check(self.module, self.loss, *first, self.optimizer.bound_engine.compute(), self.steps)
            self.optimizer.step()
            if self.averaged_model is not None:
                self._update_average()
            self.steps += 1
            if bar is not None:
                bar.update(1)
            if self.steps >= self.max_steps:  # before the next draw: every batch drawn is released
                break
        if bar is not None:
            bar.close()
        if not self.log_train_stats:
            return {}
        # Computed from the training batches without noise: outside the guarantee, labelled as such.
        return {"nonprivate_train_loss": loss_sum / max(seen, 1), "nonprivate_train_accuracy": correct / max(seen, 1)}

    def fit(self) -> TrainResult:
        """Train until the planned epochs or the privacy budget run out."""
        self._check_settings()
        check_checkpoint_free(self.checkpoint_path, self._continues)
        while self.steps < self.max_steps:
            start = time.perf_counter()
            stats = self._train_epoch()
            self._wall += time.perf_counter() - start
            self.epoch += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            row = {"epoch": self.epoch, "steps": self.steps, **stats, "epsilon": self.epsilon()}
            if self.log_train_stats:  # a timing side channel: the time grows with the secret batch sizes
                row["nonprivate_epoch_time_s"] = time.perf_counter() - start
            if self.log_train_stats and self.tightness_monitor is not None and self.tightness_monitor.worst:
                row["nonprivate_max_tightness"] = max(self.tightness_monitor.worst.values())
            if self.test_data is not None and self.rank == 0:
                row["test_accuracy"] = evaluate(self.eval_model(), self.test_data, device=self.device)["accuracy"]
            self.history.append(row)
            if self.log is not None:
                self.log(
                    " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                )
            if self.world_size > 1:  # every rank, every epoch: the checkpoint keeps each rank's streams
                self._rank_streams = (self.steps, all_gather_objects(self._streams()))
            if self.checkpoint_path is not None:
                self.save_checkpoint(self.checkpoint_path)
        return self.result()

    def _augmented(self, xs: torch.Tensor) -> torch.Tensor:
        """``augment(xs)``.  An augmentation of clipless's own (``ImageAugmentation``) computes each row from that row
        alone and sees the batch at once; one of the user's sees each row alone: the trainer declares the rows it
        returns as copies of the drawn records (``derived_rows_``), and one that mixed rows (mixup, a batch mean)
        would move every example's gradient with each added record, beyond the certified bound."""
        if _ours(self.augment):
            return self.augment(xs, self.augment_generator)
        return torch.cat([self.augment(row, self.augment_generator) for row in xs.split(1)]) if len(xs) else xs

    def _streams(self) -> Dict[str, Optional[torch.Tensor]]:
        """This process's sampling and augmentation generator states."""
        augment = self.augment_generator
        return {"sampling_generator": saved_generator_state(self.sampling_generator),
                "augment_generator": saved_generator_state(augment) if augment is not None else None}

    def result(self) -> TrainResult:
        test_acc = self.history[-1].get("test_accuracy") if self.history else None
        return TrainResult(
            test_accuracy=test_acc,
            epsilon=self.epsilon(),
            delta=self.delta,
            noise_multiplier=self.optimizer.noise_multiplier,
            effective_noise_multiplier=self.optimizer.effective_noise_multiplier,
            steps=self.steps,
            epochs=self.steps / self.steps_per_epoch,
            expected_batch_size=self.optimizer.expected_batch_size,
            sample_rate=self.sample_rate,
            sampling="poisson",
            accountant=self.accountant.mechanism,
            strategy=self.strategy,
            **randomness_label(self.noise_seed),
            nonprivate_wall_time_s=self._wall if self.log_train_stats else None,
            stopped_by_budget=self.optimizer.plan.budget_limited and self.steps >= self.max_steps,
            history=list(self.history),
        )

    # -- checkpoints ------------------------------------------------------
    @functools.cached_property
    def _data_fingerprints(self) -> Tuple[Optional[str], Optional[str]]:
        """Digests of the train and test records, computed at the first checkpoint (not at every start)."""
        return tuple(getattr(d, "fingerprint", lambda: None)() if d is not None else None  # type: ignore[return-value]
                     for d in (self.train_data, self.test_data))

    def _config(self, key: bytes) -> Dict[str, Any]:
        """The privacy configuration a checkpoint must share with the run that resumes it, with the records'
        digests keyed by ``key``."""
        plan = self.optimizer.plan
        train_digest, test_digest = (keyed_fingerprint(d, key) for d in self._data_fingerprints)
        return {
            "accountant": self.accountant.mechanism,
            "sample_rate": self.sample_rate,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "strategy": self.strategy,
            "layer_sigmas": dict(plan.layer_sigmas),
            "effective_noise_multiplier": plan.step_sigma,
            "max_steps": plan.max_steps,
            "randomness": randomness_label(self.noise_seed)["randomness"],
            # the same records and split: a test accuracy measured on training records would be wrong
            "train_data": train_digest,
            "test_data": test_digest,
        }

    def save_checkpoint(self, path: Union[str, Path]) -> None:
        """Model, optimizer, accountant, generators and progress: everything a resume needs (atomic, checksummed:
        :mod:`clipless.train.checkpoint`).  A model changed since the last private step is refused (and put back):
        the change would be saved without noise."""
        self._check_settings()
        self.optimizer.check_released_state()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fingerprint_key = fingerprint_key_for(path)
        state = {
            "kind": "training",
            "model": self.module.state_dict(),
            "world_size": self.world_size,
            "averaged_model": self.averaged_model.state_dict() if self.averaged_model is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "accountant": self.accountant.state_dict(),
            **self._streams(),
            # one entry per rank (distributed runs): a rank that restarted its seeded stream would replay its
            # first batches, correlated with the ones already drawn
            "rank_streams": self._rank_streams[1] if self._rank_streams and self._rank_streams[0] == self.steps
            else None,
            "steps": self.steps,
            "epoch": self.epoch,
            "history": self.history,
            "nonprivate_wall_time_s": self._wall if self.log_train_stats else None,
            "config": self._config(fingerprint_key),
            "run_config": self.run_config,
        }
        save_checkpoint(state, path)
        self._continues = path.resolve()

    @staticmethod
    def read_run_config(path: Union[str, Path]) -> Optional[Dict[str, Any]]:
        """The ``run_config`` a checkpoint was saved with (None if the run recorded none)."""
        return load_checkpoint(path, kind="training").get("run_config")

    def load_checkpoint(self, path: Union[str, Path]) -> None:
        """Resume; refuses a checkpoint without accountant state or with another privacy configuration, and a
        trainer that has already released steps (a rollback).  A seeded run continues its saved noise, sampling
        and augmentation streams; a private run keeps its fresh OS-entropy ones (two resumes of one checkpoint
        must not share noise or batches)."""
        check_nothing_released(self.steps, "this trainer")
        state = load_checkpoint(path, map_location=self.device, kind="training")
        accountant_state = state.get("accountant")
        if not accountant_state or (not accountant_state.get("history") and state.get("steps", 0) > 0):
            raise ValueError(
                f"checkpoint {path} has no accountant state: resuming would under-report epsilon; "
                "restart training from scratch"
            )
        fingerprint_key = read_fingerprint_key(path)  # None: a checkpoint of an older version, plain digests
        saved, current = state.get("config", {}), self._config(fingerprint_key or b"")
        mechanism = accountant_state.get("mechanism")
        if mechanism != self.accountant.mechanism:
            raise ValueError(
                f"checkpoint {path} was accounted with the {mechanism!r} accountant but this run uses "
                f"{self.accountant.mechanism!r}: its budget would be planned with one and spent with the other; "
                f"resume with accountant={mechanism!r}")
        for key in ("accountant", "sample_rate", "delta", "target_epsilon", "strategy", "effective_noise_multiplier",
                    "layer_sigmas", "max_steps", "randomness", "train_data", "test_data"):
            if key not in saved:
                raise ValueError(f"checkpoint {path} does not record {key!r}: it was written by an older version; "
                                 "restart training")
            if key.endswith("_data"):
                fingerprint = self._data_fingerprints[0 if key == "train_data" else 1]
                check_records(path, key, saved[key], fingerprint, fingerprint_key,
                              "and train/test split (dataset, data files, --seed)")
            elif saved[key] != current[key]:
                raise ValueError(f"checkpoint {path} has {key}={saved[key]!r} but this run has {current[key]!r}: "
                                 "resume with the same privacy configuration")
        saved_world = state.get("world_size", 1)
        if saved_world != self.world_size:
            raise ValueError(f"checkpoint {path} was written by a run of {saved_world} process(es), this run has "
                             f"{self.world_size}: resume with the same number of processes (the Poisson shards and "
                             "the sampling streams are per process)")
        # Every check before anything is loaded: a refused checkpoint leaves this trainer as it was.
        if self.averaged_model is not None and state.get("averaged_model") is None:
            raise ValueError("checkpoint has no averaged model but this run averages iterates")
        if (self.lr_scheduler is None) != (state.get("lr_scheduler") is None):
            kept, here = ("with", "none") if self.lr_scheduler is None else ("without", "one")
            raise ValueError(f"checkpoint {path} was written by a run {kept} a learning-rate schedule and this run has "
                             f"{here}: resume with the same lr_scheduler")
        rank_streams = state.get("rank_streams") or [_own_streams(state)]
        if len(rank_streams) != self.world_size:
            raise ValueError(f"checkpoint {path} does not record the sampling streams of every process (an older "
                             "version, or saved by hand between epochs): their restarted streams would repeat batches "
                             "already drawn; resume from a checkpoint written at the end of an epoch")
        plan = self.optimizer.plan
        check_accounted_steps(accountant_state, state.get("steps"), path, (plan.step_sigma, plan.sample_rate))
        check_fits(self.module, state["model"], path)
        if self.averaged_model is not None:
            check_fits(self.averaged_model, state["averaged_model"], path, "averaged model")
        self.module.load_state_dict(state["model"])
        if self.averaged_model is not None:
            self.averaged_model.load_state_dict(state["averaged_model"])
        self.accountant.load_state_dict(state["accountant"])
        self.optimizer.load_state_dict(state["optimizer"])  # its own history, if recorded, is the same
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        streams = rank_streams[self.rank]
        resume_generator(self.sampling_generator, streams["sampling_generator"])
        if self.augment_generator is not None:
            resume_generator(self.augment_generator, streams.get("augment_generator"))
        self._rank_streams = (state["steps"], rank_streams)
        self.steps, self.epoch = state["steps"], state["epoch"]
        # an earlier version recorded unlabelled times (epoch_time_s): they grow with the secret batch sizes
        self.history = [{k: v for k, v in row.items() if k != "epoch_time_s"} for row in state.get("history", [])]
        self._wall = state.get("nonprivate_wall_time_s") or 0.0  # kept only where asked for
        self._continues = Path(path).resolve()


def _own_streams(state: Dict[str, Any]) -> Dict[str, Any]:
    """The one-process checkpoint's generator states, in the per-rank layout."""
    return {"sampling_generator": state["sampling_generator"], "augment_generator": state.get("augment_generator")}
