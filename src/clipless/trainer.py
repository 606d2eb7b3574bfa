"""``PrivateTrainer``: the full clipless DP-SGD loop with budget, logging and checkpoints.

The loop sums per-example losses of each Poisson batch (empty batches
included), lets :class:`~clipless.optimizer.DPOptimizer` add calibrated noise,
and stops before a step would take epsilon past the target.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .accounting import (
    calibrate_noise_multiplier,
    calibrate_steps,
    check_delta,
    compute_epsilon,
    gradient_noise_multiplier,
)
from .bounds import BoundedModule
from .layers import adaptive_clips
from .engine import PrivacyEngine
from .losses import LipschitzLoss
from .noise import STRATEGIES, allocate_layer_noise, noise_energy_allocation
from .tightness import TightnessMonitor

__all__ = ["PrivateTrainer", "TrainResult", "evaluate"]


@dataclass
class TrainResult:
    test_accuracy: Optional[float]
    train_accuracy: float
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
    seed: Optional[int]
    wall_time_s: float
    stopped_by_budget: bool
    history: List[Dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _predictions(logits: torch.Tensor) -> torch.Tensor:
    """Class predictions: argmax of multiclass logits, sign of a single binary logit."""
    if logits.dim() == 2 and logits.shape[1] > 1:
        return logits.argmax(dim=1)
    return (logits.reshape(-1) > 0).long()


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: Dataset, loss: Optional[LipschitzLoss] = None, batch_size: int = 2048, device: str = "cpu"
) -> Dict[str, float]:
    """Accuracy (and mean loss) of ``model`` on ``dataset`` (no privacy cost: test data)."""
    was_training = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        correct += int((_predictions(logits) == y).sum())
        total += int(y.shape[0])
        if loss is not None:
            loss_sum += float(loss.per_example(logits, y).sum())
    model.train(was_training)
    out = {"accuracy": correct / max(total, 1)}
    if loss is not None:
        out["loss"] = loss_sum / max(total, 1)
    return out


@torch.no_grad()
def collect_outputs(
    model: nn.Module, data: Dataset, batch_size: int = 2048, forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(forward(x), y)`` over a labelled dataset, concatenated, with ``model`` in eval mode (restored after);
    ``forward`` defaults to ``model``."""
    was_training = model.training
    model.eval()
    fn = forward if forward is not None else model
    outputs, labels = [], []
    for x, y in DataLoader(data, batch_size=batch_size):
        outputs.append(fn(x))
        labels.append(y)
    model.train(was_training)
    return torch.cat(outputs), torch.cat(labels)


def _generator(seed: Optional[int], device: Union[str, torch.device] = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # fresh OS entropy
    else:
        g.manual_seed(seed)
    return g


class PrivateTrainer:
    """Train ``model`` with clipless DP-SGD on ``train_data`` under (``target_epsilon``, ``delta``).

    Give ``target_epsilon`` (sigma is calibrated for ``epochs``), or
    ``noise_multiplier`` (with ``target_epsilon`` too, the number of steps is
    calibrated and training stops at the budget).  With ``strategy='per_layer'``,
    ``layer_noise_multipliers`` may be a dict of relative weights or ``'energy'``
    (:func:`~clipless.noise.noise_energy_allocation`).  ``seed`` fixes the
    sampling and noise generators (for experiments; the result says so).
    ``tightness_monitor`` checks true per-example gradients against the bounds
    during training and stops with :class:`~clipless.BoundError` if one exceeds them.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: LipschitzLoss,
        train_data: Dataset,
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
        seed: Optional[int] = None,
        test_data: Optional[Dataset] = None,
        device: str = "cpu",
        progress: bool = True,
        log: Optional[Callable[[str], None]] = print,
        checkpoint_path: Optional[Union[str, Path]] = None,
        average_decay: Optional[float] = None,
        tightness_monitor: Optional[TightnessMonitor] = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}")
        if target_epsilon is None and noise_multiplier is None:
            raise ValueError("give target_epsilon, noise_multiplier, or both")
        n = len(train_data)  # type: ignore[arg-type]
        check_delta(delta, n)
        self.model, self.loss, self.train_data, self.test_data = model, loss, train_data, test_data
        self.delta, self.target_epsilon, self.strategy = delta, target_epsilon, strategy
        self.device, self.progress, self.log = device, progress, log
        self.seed = seed
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.sample_rate = batch_size / n
        self.steps_per_epoch = max(1, round(1.0 / self.sample_rate))
        self.privacy_engine = PrivacyEngine(accountant)
        mechanism = self.privacy_engine.accountant.mechanism

        if noise_multiplier is None:
            if epochs is None:
                raise ValueError("calibrating sigma to target_epsilon needs epochs")
            sigma = calibrate_noise_multiplier(
                target_epsilon, delta, self.sample_rate, epochs * self.steps_per_epoch, mechanism  # type: ignore[arg-type]
            )
        else:
            sigma = float(noise_multiplier)
        counts = [clip.count_noise_multiplier for clip in adaptive_clips(model)]
        if counts and noise_multiplier is None:
            sigma = gradient_noise_multiplier(sigma, counts)

        self.sampling_generator = _generator(None if seed is None else seed + 1)
        self.model, self.optimizer, self.loader = self.privacy_engine.make_private(
            module=model,
            optimizer=optimizer,
            data=train_data,
            loss=loss,
            noise_multiplier=sigma,
            input_shape=tuple(input_shape),
            batch_size=batch_size,
            input_bound=input_bound,
            strategy=strategy,
            layer_noise_multipliers=None if isinstance(layer_noise_multipliers, str) else layer_noise_multipliers,
            noise_generator=_generator(None if seed is None else seed + 2, next(model.parameters()).device),
            sampling_generator=self.sampling_generator,
        )
        if isinstance(layer_noise_multipliers, str):
            if layer_noise_multipliers != "energy" or strategy != "per_layer":
                raise ValueError("layer_noise_multipliers='energy' needs strategy='per_layer'")
            if noise_multiplier is not None:
                raise ValueError("layer_noise_multipliers='energy' allocates a calibrated sigma: give target_epsilon")
        if strategy == "per_layer" and noise_multiplier is None:
            # sigma was calibrated as sigma_eff: layer multipliers (relative weights if given)
            # are scaled to compose to it (SPEC §3.4).
            weights = self.optimizer.layer_sigmas
            if layer_noise_multipliers == "energy":
                weights = noise_energy_allocation(self.optimizer.last_report)  # type: ignore[arg-type]
            self.optimizer.set_layer_noise(allocate_layer_noise(sigma, weights))
        sigma_eff = self.optimizer.effective_noise_multiplier
        self.max_steps: float = math.inf
        planned = epochs * self.steps_per_epoch if epochs is not None else None
        self._budget_limited = False
        if target_epsilon is not None:
            within = planned is not None and (
                compute_epsilon(sigma_eff, self.sample_rate, planned, delta, mechanism) <= target_epsilon
            )
            if not within:  # the budget, not the epochs, decides when to stop
                self._budget_limited = True
                self.max_steps = calibrate_steps(target_epsilon, delta, self.sample_rate, sigma_eff, mechanism)
                if self.max_steps == 0:
                    raise ValueError(
                        f"a single step at sigma_eff={sigma_eff:.4g} already exceeds epsilon={target_epsilon}"
                    )
        if planned is not None:
            self.max_steps = min(self.max_steps, planned)
        if not math.isfinite(self.max_steps):
            raise ValueError("give epochs or target_epsilon: training would never stop")
        self.steps = 0
        self.epoch = 0
        self.history: List[Dict[str, float]] = []
        # Exponential moving average of the released iterates: post-processing, no privacy cost.
        if average_decay is not None and not (0.0 < average_decay < 1.0):
            raise ValueError("average_decay must be in (0, 1)")
        self.average_decay = average_decay
        self.tightness_monitor = tightness_monitor
        self.averaged_model: Optional[nn.Module] = copy.deepcopy(self.model) if average_decay else None
        if self.averaged_model is not None:
            self.averaged_model._forward_pre_hooks.clear()  # the input guard belongs to the trained model
        self._wall = 0.0

    @torch.no_grad()
    def _update_average(self) -> None:
        decay = self.average_decay
        for avg, p in zip(self.averaged_model.parameters(), self.model.parameters()):  # type: ignore[union-attr]
            avg.mul_(decay).add_(p, alpha=1 - decay)

    def eval_model(self) -> nn.Module:
        """The model to evaluate and ship: the projected average of the iterates when averaging, else the model."""
        if self.averaged_model is None:
            return self.model
        model = copy.deepcopy(self.averaged_model)
        for m in model.modules():
            if isinstance(m, BoundedModule):
                m.project_()  # an average of feasible weights is re-projected to stay 1-Lipschitz
        return model

    @property
    def accountant(self):
        return self.privacy_engine.accountant

    def epsilon(self) -> float:
        return self.accountant.get_epsilon(self.delta)

    def _train_epoch(self) -> Dict[str, float]:
        self.model.train()
        loss_sum, correct, seen = 0.0, 0, 0
        batches = self.loader
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=min(len(batches), int(self.max_steps - self.steps)), desc=f"epoch {self.epoch + 1}", leave=False)
        for x, y in batches:
            if self.steps >= self.max_steps:
                break
            x, y = x.to(self.device), y.to(self.device)
            self.optimizer.zero_grad()
            logits = self.model(x)
            per_example = self.loss.per_example(logits, y)
            per_example.sum().backward()
            monitor = self.tightness_monitor
            if monitor is not None and monitor.due(self.steps):
                # before the step: the noise of this step is calibrated to the report of these weights
                monitor.check(self.model, self.loss, x, y, self.optimizer.bound_engine.compute(), self.steps)
            self.optimizer.step()
            if self.averaged_model is not None:
                self._update_average()
            self.steps += 1
            with torch.no_grad():
                loss_sum += float(per_example.sum())
                correct += int((_predictions(logits) == y).sum())
                seen += int(y.shape[0])
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return {"train_loss": loss_sum / max(seen, 1), "train_accuracy": correct / max(seen, 1)}

    def fit(self) -> TrainResult:
        """Train until the planned epochs or the privacy budget run out."""
        while self.steps < self.max_steps:
            start = time.perf_counter()
            stats = self._train_epoch()
            self._wall += time.perf_counter() - start
            self.epoch += 1
            row = {"epoch": self.epoch, "steps": self.steps, **stats, "epsilon": self.epsilon()}
            row["epoch_time_s"] = time.perf_counter() - start
            if self.tightness_monitor is not None and self.tightness_monitor.worst:
                row["max_tightness"] = max(self.tightness_monitor.worst.values())
            if self.test_data is not None:
                row["test_accuracy"] = evaluate(self.eval_model(), self.test_data, device=self.device)["accuracy"]
            self.history.append(row)
            if self.log is not None:
                self.log(
                    " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                )
            if self.checkpoint_path is not None:
                self.save_checkpoint(self.checkpoint_path)
        return self.result()

    def result(self) -> TrainResult:
        test_acc = self.history[-1].get("test_accuracy") if self.history else None
        return TrainResult(
            test_accuracy=test_acc,
            train_accuracy=self.history[-1]["train_accuracy"] if self.history else 0.0,
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
            seed=self.seed,
            wall_time_s=self._wall,
            stopped_by_budget=self._budget_limited and self.steps >= self.max_steps,
            history=list(self.history),
        )

    # -- checkpoints ------------------------------------------------------
    def _config(self) -> Dict[str, Any]:
        return {
            "sample_rate": self.sample_rate,
            "delta": self.delta,
            "strategy": self.strategy,
            "layer_sigmas": dict(self.optimizer.layer_sigmas),
            "effective_noise_multiplier": self.optimizer.effective_noise_multiplier,
            "max_steps": self.max_steps,
        }

    def save_checkpoint(self, path: Union[str, Path]) -> None:
        """Model, optimizer, accountant, generators and progress: everything a resume needs."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "averaged_model": self.averaged_model.state_dict() if self.averaged_model is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "accountant": self.accountant.state_dict(),
            "sampling_generator": self.sampling_generator.get_state(),
            "steps": self.steps,
            "epoch": self.epoch,
            "history": self.history,
            "wall_time_s": self._wall,
            "config": self._config(),
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    def load_checkpoint(self, path: Union[str, Path]) -> None:
        """Resume; refuses a checkpoint without accountant state or with another privacy configuration."""
        state = torch.load(path, map_location=self.device, weights_only=False)
        accountant_state = state.get("accountant") if isinstance(state, dict) else None
        if not accountant_state or (not accountant_state.get("history") and state.get("steps", 0) > 0):
            raise ValueError(
                f"checkpoint {path} has no accountant state: resuming would under-report epsilon; "
                "restart training from scratch"
            )
        saved, current = state.get("config", {}), self._config()
        for key in ("sample_rate", "delta", "strategy", "effective_noise_multiplier"):
            if key in saved and saved[key] != current[key]:
                raise ValueError(f"checkpoint {key}={saved[key]!r} differs from this run's {current[key]!r}")
        self.model.load_state_dict(state["model"])
        if self.averaged_model is not None:
            if state.get("averaged_model") is None:
                raise ValueError("checkpoint has no averaged model but this run averages iterates")
            self.averaged_model.load_state_dict(state["averaged_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.accountant.load_state_dict(state["accountant"])
        if self.accountant.steps != state["steps"]:
            raise ValueError("checkpoint accountant history does not match its step count")
        self.sampling_generator.set_state(state["sampling_generator"])
        self.steps, self.epoch = state["steps"], state["epoch"]
        self.history = list(state.get("history", []))
        self._wall = state.get("wall_time_s", 0.0)
