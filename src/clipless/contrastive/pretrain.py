"""Private contrastive / spreadout pre-training of an embedding model: Logit-DP, Naive-DP, non-private.

The loop around :mod:`clipless.contrastive.logit_dp`: Poisson sampling of pairs, noise ``N(0, (sigma Delta)^2)`` on
the summed gradient, division by the expected batch size, any ``torch.optim`` optimizer, and the
accountant (a Poisson-subsampled Gaussian step per iteration, spec §1).  Evaluation: k-NN accuracy of
test embeddings and a linear head trained on frozen embeddings.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..data.datasets import check_finite, check_held_out
from ..privacy.accounting import (PrivacyAccountant, bind_accountant, check_accounted_steps, check_composed_,
                                  check_delta, check_nothing_released, check_released_steps_)
from ..privacy.calibration import NoisePlan, plan_noise, planned_steps
from ..privacy.certified import check_flag, whole_number
from ..privacy.noise import add_gaussian_noise_, check_secure_flag
from ..privacy.bounds import FunctionNamespaces
from ..privacy.optimizer import (changed_state, check_fresh_optimizer, hooks_refused, model_state, put_back_changes_,
                                 put_back_optimizer_state_, restore_state_, snapshot_optimizer_state, snapshot_state)
from ..privacy.distributed import world
from ..privacy.modules import DeclaredConstants
from ..privacy.randomness import make_generator, randomness_label, resume_generator, saved_generator_state
from ..privacy.input_guard import all_finite
from ..privacy.privacy_engine import check_model_takes
from ..privacy.sampling import (check_each_record_once, expected_batch_size, loader_parts, poisson_data_loader,
                                poisson_steps_per_epoch, record_chunks, step_progress)
from ..train.checkpoint import (check_checkpoint_free, check_fits, check_records, checkpoint_destination,
                                fingerprint_key_for, keyed_fingerprint, load_checkpoint, read_fingerprint_key,
                                save_checkpoint)
from .logit_dp import (
    LOSS_FUNCTIONS,
    _check_clip_norm,
    _check_cross_term,
    _check_gram_method,
    _check_loss,
    logit_dp_gradient,
    logit_dp_sensitivity,
    naive_dp_gradient,
    naive_dp_sensitivity,
    nonprivate_gradient,
    pair_logits,
)

__all__ = ["METHODS", "ENCODERS", "PretrainResult", "ContrastivePretrainer", "build_encoder"]

METHODS = ("logit_dp", "naive_dp", "nonprivate")
ENCODERS = ("mlp", "cnn")


def build_encoder(kind: str, input_shape, embedding_dim: int, hidden=(256,), channels=(16, 32),
                  input_pool: int = 1) -> nn.Module:
    """The encoders of ``clipless pretrain --encoder``: an MLP (``hidden`` widths) or a CNN (``channels`` conv
    layers with ReLU and average pooling, then ``hidden``), each ending in a Linear to ``embedding_dim``.

    ``input_pool=k`` first averages disjoint ``k x k`` pixel windows of image inputs (``nn.AvgPool2d``, a fixed
    per-example map): ``k^2`` times fewer positions for every convolution, hence cheaper Logit-DP Jacobians.
    """
    from ..train.baselines import standard_cnn, standard_mlp

    if kind not in ENCODERS:
        raise ValueError(f"encoder must be one of {ENCODERS}, got {kind!r}")
    input_pool = whole_number(input_pool, "input_pool")
    shape = tuple(input_shape)
    stem: List[nn.Module] = []
    if input_pool > 1:
        if len(shape) != 3 or min(shape[1:]) < input_pool:
            raise ValueError(f"input_pool {input_pool} needs image inputs (C, H, W) of at least {input_pool} x "
                             f"{input_pool} pixels, got shape {shape}")
        stem.append(nn.AvgPool2d(input_pool))
        shape = (shape[0], shape[1] // input_pool, shape[2] // input_pool)
    if kind == "cnn":
        body = standard_cnn(shape, embedding_dim, channels=channels, hidden=hidden)
    else:
        body = standard_mlp(shape, embedding_dim, hidden=hidden)
    return nn.Sequential(*stem, *body) if stem else body



@dataclass
class PretrainResult:
    method: str
    loss: str
    tau: float
    clip_norm: Optional[float]
    epsilon: Optional[float]
    delta: Optional[float]
    noise_multiplier: Optional[float]
    sensitivity: Optional[float]
    steps: int
    epochs: int
    expected_batch_size: float
    sample_rate: float
    sampling: str
    accountant: Optional[str]
    private: bool
    randomness: str
    privacy_note: str
    nonprivate_wall_time_s: Optional[float]  # only with log_train_stats: it grows with the secret batch sizes
    history: List[Dict[str, float]] = field(default_factory=list)
    cross_term: Optional[str] = None  # how Logit-DP's pair norms were formed (exact, or a Cauchy-Schwarz bound)
    stopped_by_budget: bool = False  # a fixed sigma with a target: the budget ended the run before its epochs

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _check_no_running_statistics(encoder: nn.Module) -> None:
    """Running statistics (BatchNorm's, updated by every training forward) are averages of the private batches
    kept without noise in the encoder, and released with it."""
    for name, m in encoder.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            raise ValueError(f"layer {name or 'encoder'} ({type(m).__name__}) keeps running statistics of the batches: "
                             "they would be released with the encoder without noise; use a per-example "
                             "normalization (LayerNorm, GroupNorm)")


def _check_pair_dataset(pairs: Optional[Dataset], what: str, encoder: Optional[nn.Module] = None) -> None:
    """Each record of ``pairs`` is a positive pair ``(xa, xb)`` of two views of one shape (a labelled dataset's
    ``(x, y)`` is not), of a dtype the ``encoder`` takes: read from its first record, so a held-out set of another
    kind is named before training, not after the first epoch's private steps."""
    if pairs is None:
        return
    if len(pairs) == 0:  # type: ignore[arg-type]
        raise ValueError(f"{what} is empty")
    first = pairs[0]
    if (not isinstance(first, (tuple, list)) or len(first) != 2
            or not all(isinstance(v, torch.Tensor) for v in first) or first[0].shape != first[1].shape):
        kinds = ([tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in first]
                 if isinstance(first, (tuple, list)) else type(first).__name__)
        raise ValueError(f"{what} must hold positive pairs (xa, xb), two views of one shape (e.g. AugmentedPairs of "
                         f"held-out images), got records of {kinds}")
    if encoder is not None:
        check_model_takes(encoder, first[0].dtype, tuple(first[0].shape), what)


def _check_pair_records(pairs: Dataset, encoder: nn.Module, what: str = "the training pairs",
                        read_first: bool = False, each_once: bool = False) -> None:
    """Every pair a private step could draw, checked before any step as the step checks its batch (finite views, one
    shape for every view, a dtype the encoder takes): a bad pair would otherwise stop the run at the step whose
    secret Poisson batch first holds it.  A dataset that declares the tensors it draws its views from
    (``record_tensors()``: the crops, blurs and pixel noise of :class:`AugmentedPairs` are finite for finite images
    and keep their shape and dtype) is checked from them; any other is read once, in order.  Held-out pairs
    (``what="eval_pairs"``) alike: a bad one would stop the run at the first held-out loss, after an epoch of
    private steps, or make that loss NaN.  ``read_first``: the kind of the records is checked from the first one
    even when the dataset holds tensors (a labelled dataset does too); not for the training pairs, whose read
    would draw augmentations.  ``each_once`` (training pairs): no pair handed out for two indices
    (``record_chunks``)."""
    own = getattr(pairs, "record_tensors", None)
    if read_first or not callable(own):
        _check_pair_dataset(pairs, what, None if callable(own) else encoder)  # held tensors: probed below
    if callable(own):
        for tensor in own():
            check_finite(tensor, f"{what}' data")
            check_model_takes(encoder, tensor.dtype, tuple(tensor.shape[1:]), what)
        return
    shape = None
    try:
        for xa, xb in record_chunks(pairs, each_once=what if each_once else None, views=2):
            if xa.shape[1:] != xb.shape[1:] or shape not in (None, xa.shape[1:]):
                raise ValueError(f"{what} hold views of different per-example shapes "
                                 f"({tuple(xa.shape[1:])}, {tuple(xb.shape[1:])}"
                                 + ("" if shape is None else f", {tuple(shape)}") + "): every view must have one shape")
            shape = xa.shape[1:]
            if not (all_finite(xa) and all_finite(xb)):
                raise ValueError(f"{what} contain NaN or infinite values; clean the data before private training")
    except RuntimeError as err:  # the collate of records of different shapes
        raise ValueError(f"{what} cannot be read into batches: {err}") from None


def _check_state_unchanged(encoder: nn.Module, before: Dict[str, torch.Tensor]) -> None:
    """The gradient pass of a private step may change nothing of the encoder: a parameter or buffer changed by a
    forward (a running average, a weight normalised in place) holds a function of the batch without noise."""
    changed = changed_state(model_state(encoder), before)
    if changed:
        raise ValueError(f"the encoder's forward or backward changed {', '.join(changed[:4])}: a function of the "
                         "private batch, kept without noise and released with the encoder; the private step refused "
                         "it and restored the encoder (only the noisy optimizer step may change it)")


# The options a resumed run may have changed without knowing it changed a privacy setting
_SETTINGS_BEHIND = {
    "sigma": " (sigma is calibrated from the target epsilon, the epochs and the batch size, or given)",
    "sensitivity": " (the sensitivity follows the clip norm, the temperature and the loss)",
    "sample_rate": " (the batch size over the number of pairs)",
    "max_steps": " (the steps a fixed sigma allows within the target epsilon)",
}


class ContrastivePretrainer(DeclaredConstants):
    """Pre-train ``encoder`` on the positive pairs ``pairs`` with ``method`` in ``METHODS``.

    ``pairs`` (and ``eval_pairs``): a dataset of ``(view, view)`` records, or a ``DataLoader`` of one, whose worker
    settings the Poisson loader keeps (its sampler and batch size give way; a ``collate_fn`` of its own is refused).

    ``clip_norm`` is ``B`` (per pair gradient, Logit-DP) or ``C`` (whole batch gradient, Naive-DP).
    Give ``target_epsilon`` (sigma is calibrated for ``epochs`` through the one noise plan,
    :func:`~clipless.privacy.calibration.plan_noise`) or ``noise_multiplier``.
    ``eval_pairs`` (held-out, no privacy cost) gives the loss logged after every epoch, computed on
    batches of the expected batch size so that it is comparable between methods.
    Noise and sampling come from OS entropy unless ``noise_seed`` fixes them (the result then says the
    run is not private).  ``cross_term="cauchy_schwarz"`` (Logit-DP) clips each pair by an upper bound on its
    norm whose convolution part skips the exact cross term (faster, clips more; same sensitivity, see
    :func:`~clipless.contrastive.logit_dp.pair_gradient_norms`).  ``log_train_stats`` adds the fraction of
    clipped pair gradients of the training batches (no noise: labelled ``nonprivate_clipped_fraction``) and the
    run's time.  ``secure_noise``: each noise value is a sum of draws against floating-point attacks on the
    Gaussian sampler (:func:`~clipless.privacy.noise.gaussian`).
    """

    # What its clipping, noise, accounting and privacy label rest on: set once, then read-only; each step also
    # checks them against their values at construction.
    constants = ("method", "loss", "tau", "clip_norm", "batch_size", "delta", "noise_seed", "sample_rate", "accountant",
                 "plan", "sigma", "sensitivity", "loader", "noise_generator", "secure_noise", "pairs", "eval_pairs")

    def __init__(
        self,
        encoder: nn.Module,
        optimizer: torch.optim.Optimizer,
        pairs: Union[Dataset, DataLoader],
        *,
        method: str = "logit_dp",
        loss: str = "contrastive",
        tau: float = 1.0,
        clip_norm: float = 1.0,
        batch_size: float,
        epochs: int,
        delta: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        accountant: str = "pld",
        noise_seed: Optional[int] = None,
        eval_pairs: Union[Dataset, DataLoader, None] = None,
        gram_method: str = "auto",
        cross_term: str = "exact",
        progress: bool = True,
        log: Optional[Callable[[str], None]] = print,
        checkpoint_path: Optional[Union[str, Path]] = None,
        log_train_stats: bool = False,
        secure_noise: bool = False,
    ) -> None:
        if world()[1] > 1:
            raise ValueError("Logit-DP / Naive-DP pre-training runs in one process; it does not support a distributed "
                             "process group (train with clipless.PrivateTrainer for multi-process training)")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        _check_loss(loss, tau)  # as given: float() would read True as 1
        _check_clip_norm(clip_norm, "C" if method == "naive_dp" else "B")
        pairs, loader_options = loader_parts(pairs)  # as make_private: Poisson batches over a loader's dataset
        eval_pairs, _ = loader_parts(eval_pairs, training=False)
        n = len(pairs)  # type: ignore[arg-type]
        batch_size = expected_batch_size(batch_size, n)
        check_each_record_once(pairs, "the training pairs")
        check_held_out(pairs, eval_pairs, "eval_pairs")  # their loss is logged and saved without noise
        if eval_pairs is not None:
            _check_pair_records(eval_pairs, encoder, "eval_pairs", read_first=True)
        self.encoder, self.optimizer, self.pairs, self.eval_pairs = encoder, optimizer, pairs, eval_pairs
        self.method, self.loss, self.tau, self.clip_norm = method, loss, float(tau), float(clip_norm)
        self.batch_size, self.delta, self.noise_seed = float(batch_size), delta, noise_seed
        self.log_train_stats = check_flag(log_train_stats, "log_train_stats")  # the opt-in to un-noised statistics
        _check_cross_term(cross_term)  # before any calibration or sampling
        _check_gram_method(gram_method)
        check_flag(progress, "progress")
        self.gram_method, self.cross_term, self.progress, self.log = gram_method, cross_term, progress, log
        self.checkpoint_path = checkpoint_destination(checkpoint_path)
        self._continues: Optional[Path] = None  # the checkpoint file this run resumed from or wrote (resolved)
        self.sample_rate = self.batch_size / n
        self.steps_per_epoch = poisson_steps_per_epoch(self.sample_rate)
        self.planned_steps = planned_steps(epochs, self.steps_per_epoch)
        self.epochs = self.planned_steps // self.steps_per_epoch
        logit_dp_sensitivity(1.0, self.tau, loss)  # validates (loss, tau) before any calibration
        accounting: Optional[PrivacyAccountant] = None
        plan: Optional[NoisePlan] = None
        sensitivity: Optional[float] = None
        if method != "nonprivate":
            check_fresh_optimizer(optimizer, "the pre-trainer", "load_checkpoint")
            _check_no_running_statistics(encoder)
            _check_pair_records(pairs, encoder, each_once=True)  # one pair, one record: never two indices
            if delta is None:
                raise ValueError("a private method needs delta")
            check_delta(delta, n)
            accounting = PrivacyAccountant(accountant)
            bind_accountant(encoder, accounting)
            # One Gaussian mechanism per step (the whole clipped gradient), planned like every other run.
            plan = plan_noise(None, sample_rate=self.sample_rate, accountant=accountant,
                              noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, delta=delta,
                              steps=self.planned_steps)
            # Poisson batches have a random, private size: the sensitivity must hold for every n.
            sensitivity = (logit_dp_sensitivity(self.clip_norm, self.tau, loss) if method == "logit_dp"
                           else naive_dp_sensitivity(self.clip_norm))
        self.accountant, self.plan, self.sensitivity = accounting, plan, sensitivity
        self._accounted: List[tuple] = []  # what the released steps composed: nothing may take it away
        self.sigma: Optional[float] = None if plan is None else plan.step_sigma
        self.loader = poisson_data_loader(pairs, self.sample_rate, generator=make_generator(noise_seed, stream=1),
                                          worker_options=loader_options)
        # The noise is drawn where the gradients are (a CUDA encoder: a secret CUDA generator); batches follow.
        self.device = next((p.device for p in encoder.parameters()), torch.device("cpu"))
        self.noise_generator = make_generator(noise_seed, self.device, stream=2)
        self.secure_noise = check_secure_flag(secure_noise)
        self.steps = 0
        self.epoch = 0
        self.history: List[Dict[str, float]] = []
        self._wall = 0.0
        # the code its steps run (the privacy core's and this wing's), as found now: replaced later, it is refused
        self._own_code = FunctionNamespaces(step_code=("clipless.privacy.", "clipless.contrastive."))
        self._frozen = self._settings()
        # the encoder and the optimizer's state as given, then as each private step released them: nothing else
        # may change them
        self._released = None if self.accountant is None else snapshot_state(model_state(encoder))
        self._released_optimizer = self._snapshot_optimizer()
        self._check_optimizer()

    @property
    def epsilon(self) -> Optional[float]:
        return None if self.accountant is None else self.accountant.get_epsilon(self.delta)  # type: ignore[arg-type]

    def _budget_spent(self) -> bool:
        return self.plan is not None and self.plan.max_steps is not None and self.steps >= self.plan.max_steps

    def _check_optimizer(self) -> None:
        """The optimizer steps the encoder's parameters and nothing else that could move: a parameter outside the
        encoder gets no clipping and no noise, so one holding a gradient (left by a non-private backward) would be
        stepped with it at every private step; and an optimizer of none of them would spend the budget on nothing."""
        mine = {id(p) for p in self.encoder.parameters()}
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        outside = [p for p in stepped if id(p) not in mine and (p.requires_grad or p.grad is not None)]
        if outside:
            raise ValueError(f"the optimizer steps {len(outside)} trainable parameter(s) outside the encoder: they get "
                             "no clipping and no noise (a gradient left in them by a non-private backward would be "
                             "applied at every private step); give the pre-trainer an optimizer of the encoder's "
                             "parameters only")
        if not any(id(p) in mine and p.requires_grad for p in stepped):
            raise ValueError("the optimizer steps none of the encoder's trainable parameters: the pre-training would "
                             "spend its privacy budget and leave the encoder as it is")
        hooked = None if self.method == "nonprivate" else hooks_refused(self.optimizer)  # as make_private's
        if hooked is not None:
            raise ValueError(hooked)

    def _snapshot_optimizer(self) -> Optional[List[Tuple[Any, Dict[str, Any]]]]:
        return None if self.accountant is None else snapshot_optimizer_state(self.optimizer)

    def _check_released(self) -> None:
        """The encoder as given or as the last private step released it.  A change since (a step of the optimizer
        outside the pre-trainer, ``p -= lr * p.grad`` by hand, a ``load_state_dict``) holds what it was computed
        from without noise, and the encoder would release it: refused, and the released state put back.  So is a
        change of the optimizer's state (an outside step's moments would move every later released step)."""
        saved = self._released_optimizer
        if saved is not None and put_back_optimizer_state_(self.optimizer, saved):
            put_back_changes_(model_state(self.encoder), self._released)  # type: ignore[arg-type]
            raise ValueError("the optimizer's state changed outside the private pre-training since its last release "
                             "(a step of the pre-trainer's optimizer outside fit(), or its load_state_dict): its "
                             "moments would carry a gradient without noise into every later released step; the "
                             "optimizer's state and the encoder were put back. Step the optimizer only through fit() "
                             "(a resume: load_checkpoint)")
        changed = put_back_changes_(model_state(self.encoder), self._released)  # type: ignore[arg-type]
        if changed:
            raise ValueError(f"the encoder changed outside the private pre-training since its last release "
                             f"({', '.join(changed[:4])}): an update without noise would be released with it; it "
                             "was put back. Set the encoder's weights before creating the pre-trainer (a resume: "
                             "load_checkpoint), and change them only through fit()")

    def _settings(self) -> Tuple[Any, ...]:
        """What each step's clipping, noise and accounting use, as values and objects (compared by identity: a deep
        copy of the pre-trainer copies them with the snapshot)."""
        return (self.method, self.loss, self.tau, self.clip_norm, self.batch_size, self.delta, self.noise_seed,
                self.sample_rate, self.sigma, self.sensitivity, self.accountant, self.loader, self.loader.parts(),
                self.noise_generator, self.secure_noise, None if self.plan is None else self.plan.values(), self.pairs,
                self.eval_pairs)

    def _check_settings(self) -> None:
        replaced = self._own_code.change() if isinstance(self._own_code, FunctionNamespaces) else "_own_code"
        if replaced is not None:
            raise ValueError(f"{replaced} was replaced after the pre-trainer was built (assigned in the namespace of "
                             "the privacy core or of clipless.contrastive, or on one of their classes): its steps' "
                             "clipping, noise and accounting run that code; put the original back")
        if self._settings() != self._frozen:  # a write to the instance's __dict__ passes the read-only guard
            raise ValueError("the pre-trainer's privacy settings (method, loss, tau, clip norm, noise multiplier, "
                             "sensitivity, sampling and its loader's parts, accountant, noise generator, training or "
                             "held-out pairs) changed after it was built: a step would clip, noise or account "
                             "otherwise than its epsilon says, or a held-out loss be computed on other pairs; build a "
                             "new pre-trainer for other settings")

    def _step(self, xa: torch.Tensor, xb: torch.Tensor) -> Dict[str, float]:
        self._check_settings()
        self.encoder.train()
        before = self._released
        self._check_optimizer()
        if before is not None:
            self._check_released()
            check_released_steps_(self.accountant, self._accounted)  # type: ignore[arg-type]
            self.plan.check_budget(self.accountant.steps)  # type: ignore[union-attr]  # before the batch is read
        try:
            if self.method == "logit_dp":
                stats = logit_dp_gradient(self.encoder, xa, xb, self.loss, self.tau, self.clip_norm, self.gram_method,
                                          cross_term=self.cross_term)
            elif self.method == "naive_dp":
                stats = naive_dp_gradient(self.encoder, xa, xb, self.loss, self.tau, self.clip_norm)
            else:
                stats = nonprivate_gradient(self.encoder, xa, xb, self.loss, self.tau)
            if before is not None:
                _check_state_unchanged(self.encoder, before)
        except BaseException:  # a refused or failed step leaves nothing of the batch in the encoder
            if before is not None:
                restore_state_(model_state(self.encoder), before)
                for p in self.encoder.parameters():
                    p.grad = None  # un-noised functions of the batch
            raise
        params = [p for p in self.encoder.parameters() if p.requires_grad]
        if self.accountant is not None:
            add_gaussian_noise_(params, self.sigma * self.sensitivity, self.batch_size,  # type: ignore[operator]
                                self.noise_generator, self.secure_noise)
            self._accounted = self.plan.account_step(self.accountant, self._accounted)  # type: ignore[union-attr]
            check_composed_(self.accountant, self._accounted)  # type: ignore[arg-type]
        else:
            for p in params:  # same scaling as the private paths: sum / expected batch size
                if p.grad is not None:
                    p.grad /= self.batch_size
        self.optimizer.step()
        if self.accountant is not None:
            self._released = snapshot_state(model_state(self.encoder))
            self._released_optimizer = self._snapshot_optimizer()
        self.steps += 1
        return stats

    @torch.no_grad()
    def eval_loss(self) -> Optional[float]:
        """Mean per-pair loss on ``eval_pairs`` in batches of the expected batch size."""
        self._check_settings()  # the training pairs written in as eval_pairs would publish their loss without noise
        if self.eval_pairs is None:
            return None
        self.encoder.eval()
        size = max(2, round(self.batch_size))
        total, count = 0.0, 0
        for xa, xb in DataLoader(self.eval_pairs, batch_size=size, drop_last=len(self.eval_pairs) >= size):  # type: ignore[arg-type]
            z = pair_logits(self.encoder, xa.to(self.device), xb.to(self.device), self.tau)
            total += float(LOSS_FUNCTIONS[self.loss](z))
            count += xa.shape[0]
        self.encoder.train()
        return total / max(count, 1)

    def fit(self) -> PretrainResult:
        check_checkpoint_free(self.checkpoint_path, self._continues)
        if self.epoch == 0 and not self.history:
            self.history.append({"epoch": 0, "eval_loss": self.eval_loss(), "epsilon": self.epsilon})  # type: ignore[dict-item]
        while self.epoch < self.epochs and not self._budget_spent():
            start = time.perf_counter()
            clipped = []
            bar = step_progress(self.loader, desc=f"{self.method} epoch {self.epoch + 1}/{self.epochs}",
                                timing=self.log_train_stats or self.accountant is None, disable=not self.progress)
            for xa, xb in bar:
                if self._budget_spent():  # a fixed sigma with a target may allow fewer steps than the epochs
                    break
                stats = self._step(xa.to(self.device), xb.to(self.device))
                clipped.append(stats["clipped_fraction"])
            self._wall += time.perf_counter() - start
            self.epoch += 1
            eps = self.epsilon
            row = {"epoch": self.epoch, "eval_loss": self.eval_loss(), "epsilon": eps}
            if self.log_train_stats:  # measured on the training pairs without noise: outside the guarantee
                row["nonprivate_clipped_fraction"] = sum(clipped) / max(1, len(clipped))
            self.history.append(row)  # type: ignore[arg-type]
            if self.log:
                loss_text = "n/a" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}"
                eps_text = "inf (non-private)" if eps is None else f"{eps:.3f}"
                extra = (f", clipped {row['nonprivate_clipped_fraction']:.2f} (non-private statistic)"
                         if self.log_train_stats else "")
                self.log(f"[{self.method}] epoch {self.epoch}/{self.epochs}: held-out loss {loss_text}, "
                         f"epsilon {eps_text}{extra}")
            if self.checkpoint_path:
                self.save_checkpoint(self.checkpoint_path)
        return self.result()

    def result(self) -> PretrainResult:
        return PretrainResult(
            method=self.method, loss=self.loss, tau=self.tau,
            clip_norm=None if self.method == "nonprivate" else self.clip_norm,
            epsilon=self.epsilon, delta=self.delta if self.accountant else None,
            noise_multiplier=self.sigma, sensitivity=self.sensitivity, steps=self.steps, epochs=self.epoch,
            expected_batch_size=self.batch_size, sample_rate=self.sample_rate,
            sampling="poisson over pairs (add/remove one pair)",
            accountant=self.accountant.mechanism if self.accountant else None,
            **(randomness_label(self.noise_seed) if self.accountant else
               {"private": False, "randomness": "n/a", "privacy_note": "non-private baseline: no guarantee"}),
            nonprivate_wall_time_s=self._wall if self.log_train_stats or self.accountant is None else None,
            history=list(self.history),
            cross_term=self.cross_term if self.method == "logit_dp" else None,
            stopped_by_budget=bool(self.plan is not None and self.plan.budget_limited and self._budget_spent()),
        )

    def _privacy_config(self) -> Dict[str, Any]:
        return {"method": self.method, "sigma": self.sigma, "sensitivity": self.sensitivity,
                "sample_rate": self.sample_rate, "delta": self.delta,
                "accountant": self.accountant.mechanism if self.accountant else None,
                "max_steps": self.plan.max_steps if self.accountant else None,
                "randomness": randomness_label(self.noise_seed)["randomness"]}

    @functools.cached_property
    def _data_fingerprint(self) -> Optional[str]:
        """The pairs' digest (None for a dataset without one), computed at the first checkpoint."""
        return getattr(self.pairs, "fingerprint", lambda: None)()

    def save_checkpoint(self, path: Union[str, Path]) -> None:
        """Encoder, optimizer, progress, RNG states, augmentation state and the accountant's history (atomic,
        checksummed: :mod:`clipless.train.checkpoint`)."""
        if self._released is not None:
            self._check_released()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sampling_rng = saved_generator_state(self.loader.batch_sampler.generator)  # type: ignore[union-attr]
        # The augmentation state counts each record's draws, i.e. how often the secret Poisson sampling took it:
        # kept only where the sampling state is (a seeded run); a secret run's resume draws fresh augmentations.
        keep_pairs = sampling_rng is not None and hasattr(self.pairs, "state_dict")
        state = {
            "kind": "pretraining",
            "encoder": self.encoder.state_dict(), "optimizer": self.optimizer.state_dict(),
            "accountant": None if self.accountant is None else self.accountant.state_dict(),
            "config": {**self._privacy_config(), "train_data": keyed_fingerprint(self._data_fingerprint,
                                                                                 fingerprint_key_for(path))},
            "steps": self.steps, "epoch": self.epoch, "history": self.history,
            "wall": self._wall if self.log_train_stats else None,  # grows with the secret batch sizes
            "noise_rng": saved_generator_state(self.noise_generator),
            "sampling_rng": sampling_rng,
            "pairs": self.pairs.state_dict() if keep_pairs else None,  # type: ignore[attr-defined]
        }
        save_checkpoint(state, path)
        self._continues = path.resolve()

    def load_checkpoint(self, path: Union[str, Path]) -> None:
        """Resume; refuses a checkpoint without accountant state or with another privacy configuration, and a
        pre-trainer that has already released steps (a rollback)."""
        check_nothing_released(self.steps if self.accountant is not None else 0, "this pre-trainer")
        state = load_checkpoint(path, kind="pretraining")
        if self.accountant is not None and not state.get("accountant"):
            raise ValueError(f"checkpoint {path} has no accountant state: its privacy cost cannot be resumed")
        saved = state.get("config") or {}
        for key, mine in self._privacy_config().items():
            if saved.get(key) != mine:
                raise ValueError(f"checkpoint {path} was trained with {key}={saved.get(key)!r}, not {mine!r}: resume "
                                 f"with the same privacy configuration{_SETTINGS_BEHIND.get(key, '')}")
        if saved.get("train_data") is not None:  # absent from checkpoints of earlier versions
            check_records(path, "train_data", saved["train_data"], self._data_fingerprint, read_fingerprint_key(path),
                          "in the same order")
        if self.accountant is not None:
            check_accounted_steps(state["accountant"], state.get("steps"), path,
                                  (self.plan.step_sigma, self.plan.sample_rate))
        check_fits(self.encoder, state["encoder"], path, "encoder")
        self.encoder.load_state_dict(state["encoder"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.accountant is not None:
            self._released = snapshot_state(model_state(self.encoder))
            self._released_optimizer = self._snapshot_optimizer()
            self.accountant.load_state_dict(state["accountant"])
            self._accounted = self.accountant.history
        self.steps, self.epoch, self.history = state["steps"], state["epoch"], state["history"]
        self._wall = state.get("wall") or 0.0  # kept only where asked for
        resume_generator(self.noise_generator, state["noise_rng"])
        resume_generator(self.loader.batch_sampler.generator, state["sampling_rng"])  # type: ignore[union-attr]
        if state.get("pairs") is not None and hasattr(self.pairs, "load_state_dict"):
            self.pairs.load_state_dict(state["pairs"])
        self._continues = Path(path).resolve()
