"""``DPOptimizer``: wraps any ``torch.optim`` optimizer into a clipless private step (spec §3.2).

``step()`` = step guard -> bound engine -> Gaussian noise on the summed gradient
-> divide by the expected batch size -> inner step -> projection -> accountant
step -> gradients cleared.  In a distributed run (``distributed=True``) rank 0
adds the noise to its local sum and the sums are all-reduced before the
division (:mod:`clipless.privacy.distributed`).  The gradients it receives must
be the gradient of the **sum** of per-example losses of one Poisson batch
(``LipschitzLoss.per_example(...).sum()``); the step guard
(:class:`~clipless.privacy.input_guard.StepGuard`) refuses a step whose gradients are not.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import weakref
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from .accounting import (PrivacyAccountant, bind_accountant, check_composed_, check_composed_at,
                         check_nothing_released, check_released_steps_)
from .bounds import BoundEngine, BoundReport, FunctionNamespaces, plain_tensors
from .calibration import NoisePlan
from .certified import BoundError, check_flag, whole_number
from .distributed import all_reduce_sum_, same_outcome_on_all_ranks, world
from .input_guard import (_OPTIM, LOSS_WEIGHTS, InputGuard, StepGuard, _refuse_outside_step, allowed_uniform_weight,
                          row_digests, rows_beyond, rows_not_drawn, rows_repeated, undrawn_records, unwatched)
from .modules import DeclaredConstants, step_mechanisms
from .noise import add_noise_, check_secure_flag
from .randomness import check_generator, resume_generator, saved_generator_state, secret_generator
from .sampling import PoissonDataLoader

__all__ = ["DPOptimizer", "hooks_refused", "model_state", "attribute_tensors", "snapshot_state", "changed_state",
           "restore_state_", "put_back_changes_", "state_digests", "check_fresh_optimizer",
           "snapshot_optimizer_state", "put_back_optimizer_state_"]


# Callables an instance holds by design that the settings' check compares (with its own message): the step guard's
# loss constant and model check, and a scheduler's wrapper of the optimizer's step.
_COMPARED_ELSEWHERE = {"the private optimizer": ("step",), "the step guard": ("loss_lipschitz", "model_changed")}


def _instance_methods(opt: "DPOptimizer") -> Tuple[Tuple[str, str, Any], ...]:
    """The callables set on the instances the step runs (the step guard's callbacks, the engine's model and loss),
    by owner and name."""
    owners = (("the private optimizer", opt), ("the step guard", opt.guard), ("the bound engine", opt.bound_engine),
              ("the noise plan", opt.plan), ("the accountant", opt.accountant))
    return tuple((owner, name, value) for owner, obj in owners for name, value in sorted(vars(obj).items())
                 if callable(value) and name not in _COMPARED_ELSEWHERE.get(owner, ()))


def _tampered(opt: "DPOptimizer") -> Optional[str]:
    """Why code the step would run is not what ``make_private`` set up, or ``None``: a hook on the inner optimizer,
    its step replaced, a function or class of the privacy core replaced (``clipless.privacy.noise.gaussian = ...``),
    or a method set on one of the step's objects (``optimizer._checked_report = ...``,
    ``optimizer.guard.check_step = ...``).  A module function so that no instance attribute can stand in for it."""
    hooked = hooks_refused(opt.original_optimizer)
    if hooked is not None:
        return hooked
    if _step_functions(opt.original_optimizer) != opt.__dict__.get("_inner_steps"):
        return ("the step function of the optimizer inside the private step was replaced after make_private (on "
                "the instance, as a learning-rate scheduler made on that optimizer does, or on its class): it "
                "would run inside the private step, on the noisy gradient, but could apply anything its code "
                "holds; make schedulers on the optimizer make_private returned, and put the step back")
    own_code = opt.__dict__.get("own_code")
    replaced = own_code.change() if isinstance(own_code, FunctionNamespaces) else "the private optimizer's own_code"
    if replaced is not None:
        return (f"{replaced} was replaced after make_private (assigned in the privacy core's namespace or on one of "
                "its classes): the private step's checks, noise and accounting run that code; put the original back")
    now, then = _instance_methods(opt), opt.__dict__.get("_methods") or ()
    if now != then:
        before = {(owner, name): value for owner, name, value in then}
        changed = sorted(f"{owner}'s {name}" for owner, name, value in now if before.get((owner, name)) is not value)
        changed += sorted(f"{owner}'s {name} (removed)" for owner, name in set(before) - {(o, n) for o, n, _ in now})
        return (f"methods set on the private step's own objects ({', '.join(changed[:4])}): its checks, noise and "
                "accounting are its classes', and one set on an instance would skip or change them; delete them")
    return None


# The private optimizer that steps each model now: a later make_private of the model retires the earlier one.
_LATEST: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter (stepped or frozen) and buffer of the model, by name: what its ``state_dict`` releases; and
    every tensor a module keeps as a plain attribute (:func:`attribute_tensors`)."""
    state = {name: b for name, b in model.named_buffers()}
    state.update(model.named_parameters())
    state.update(attribute_tensors(model))
    return state


def attribute_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors that modules of ``model`` keep as plain attributes, not registered (``self.center = t``, or in
    dicts, lists or tuples: :func:`~clipless.privacy.bounds.plain_tensors`), named ``module.attribute...``.
    ``state_dict`` does not release them, but every later forward may read them and a pickle of the model releases
    them: one set from a batch (a running statistic kept by hand) holds it without noise, as a buffer would."""
    return {f"{prefix}.{name}" if prefix else name: t for prefix, module in model.named_modules()
            for name, t in plain_tensors(module).items()}


def snapshot_state(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Copies of a model's named tensors, to tell later whether anything but a private step changed them."""
    return {name: t.detach().clone() for name, t in tensors.items()}


def changed_state(current: Dict[str, torch.Tensor], saved: Dict[str, torch.Tensor]) -> List[str]:
    """The names whose tensor differs from the snapshot (values compared element by element), added or removed.
    A cast of the model (``model.double()``, ``.to(device)``) is no change: the snapshot is compared in the
    tensor's dtype and device."""
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(a.detach(), b.to(device=a.device, dtype=a.dtype))
    return sorted(name for name in set(current) | set(saved)
                  if name not in current or name not in saved or not same(current[name], saved[name]))


def _pair_digests(rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One int64 per (row digest, label digest) pair (int64 arithmetic wraps modulo 2^64)."""
    return rows * 0x5851F42D4C957F2D + labels


def check_fresh_optimizer(optimizer: torch.optim.Optimizer, given_to: str, resume: str) -> None:
    """Refuse an optimizer that has stepped already: its momentum or moments came from gradients without noise
    and would move every released step (the private steps only own what they add to the state)."""
    held = sum(1 for state in optimizer.state.values() if state)
    if held:
        raise ValueError(f"the {type(optimizer).__name__} given to {given_to} holds state from earlier steps "
                         f"(momentum or moments of {held} parameter(s)): made from gradients without noise, it "
                         f"would move every released step; give it a fresh optimizer (a resume: {resume})")


# torch.optim.Optimizer's hook registries, by the method that fills each.  A hook runs inside the private step (or
# the state_dict a checkpoint saves) on its noisy values, but may read whatever its closure holds, such as a gradient
# saved in the loop before the noise, and write it into the weights every later step releases.
_OPTIMIZER_HOOKS = {"_optimizer_step_pre_hooks": "register_step_pre_hook",
                    "_optimizer_step_post_hooks": "register_step_post_hook",
                    "_optimizer_state_dict_pre_hooks": "register_state_dict_pre_hook",
                    "_optimizer_state_dict_post_hooks": "register_state_dict_post_hook",
                    "_optimizer_load_state_dict_pre_hooks": "register_load_state_dict_pre_hook",
                    "_optimizer_load_state_dict_post_hooks": "register_load_state_dict_post_hook"}
# An optimizer's attributes that other checks cover: the per-parameter state (snapshot_optimizer_state), the groups
# (settings a schedule may change), the hooks (_optimizer_hooks)
_OPTIMIZER_CHECKED = frozenset({"state", "param_groups", *_OPTIMIZER_HOOKS})


def _optimizers_in(optimizer: torch.optim.Optimizer) -> List[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it keeps as attributes (a wrapper's base optimizer), at any depth."""
    found: List[torch.optim.Optimizer] = []
    todo = [optimizer]
    while todo:
        current = todo.pop()
        if not any(current is seen for seen in found):
            found.append(current)
            todo += [v for v in vars(current).values() if isinstance(v, torch.optim.Optimizer)]
    return found


def _optimizer_hooks(optimizer: torch.optim.Optimizer) -> List[str]:
    """The hooks that a step or a ``state_dict`` of ``optimizer`` would run: its own and those of the optimizers it
    wraps, and torch's global optimizer step hooks (but the step guard's own, which refuses a step outside the
    private one), each as ``"Adam.register_step_pre_hook (fn)"``."""
    found = []
    for held in _optimizers_in(optimizer):
        for registry, method in _OPTIMIZER_HOOKS.items():
            found += [f"{type(held).__name__}.{method} ({getattr(fn, '__qualname__', type(fn).__name__)})"
                      for fn in getattr(held, registry, {}).values()]
    for registry, method in (("_global_optimizer_pre_hooks", "register_optimizer_step_pre_hook"),
                             ("_global_optimizer_post_hooks", "register_optimizer_step_post_hook")):
        found += [f"torch.optim.optimizer.{method} ({getattr(fn, '__qualname__', type(fn).__name__)})"
                  for fn in getattr(_OPTIM, registry, {}).values() if fn is not _refuse_outside_step]
    return found


def _step_functions(optimizer: torch.optim.Optimizer) -> Tuple[Tuple[Any, Any, Any], ...]:
    """What a step of ``optimizer`` runs, for it and each optimizer it wraps: the object, its class's ``step`` and a
    ``step`` set on the instance (torch's learning-rate schedulers wrap the step of the optimizer they are given)."""
    return tuple((held, getattr(type(held), "step", None), vars(held).get("step"))
                 for held in _optimizers_in(optimizer))


def hooks_refused(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot be stepped privately because of its hooks (:func:`_optimizer_hooks`), or ``None``."""
    hooks = _optimizer_hooks(optimizer)
    if not hooks:
        return None
    return (f"the optimizer inside the private step has hooks ({', '.join(hooks[:3])}): a hook runs inside the "
            "private step on the noisy gradient, but it may read anything its code holds (a gradient saved before "
            "the noise) and write it into the weights or the optimizer's state, which every later step releases; "
            "remove the hooks (handle.remove()) and do that work in the loop after optimizer.step()")


def _held_tensors(optimizer: torch.optim.Optimizer, key_names: Optional[Dict[int, str]] = None
                 ) -> Dict[str, torch.Tensor]:
    """The tensors an optimizer keeps outside its per-parameter ``state``: in plain attributes (a momentum kept in
    ``self.buffers[p]``, a wrapper's slow weights), and the ``state`` of each optimizer it wraps.  Its step builds
    them from the noisy gradients, and later steps apply them, as they do ``state``."""
    found: Dict[str, torch.Tensor] = {}
    for i, held in enumerate(_optimizers_in(optimizer)):
        prefix = "" if i == 0 else f"<wrapped {type(held).__name__} {i}>."
        skip = _OPTIMIZER_CHECKED if i == 0 else _OPTIMIZER_CHECKED - {"state"}
        found.update({prefix + name: t for name, t in plain_tensors(held, skip, key_names).items()})
    return found


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _same(a: Any, b: Any) -> bool:
    """Equal values of one kind: tensors of one dtype, device and shape, equal element by element (NaN where the
    other has NaN); lists, tuples and dicts of such; other values by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)):
            return False
        a, b = a.detach(), b.detach()
        return torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all()))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # a value without a truth value of its equality: taken as changed
        return False


def snapshot_optimizer_state(optimizer: torch.optim.Optimizer) -> List[Tuple[Any, Dict[str, Any]]]:
    """Copies of an optimizer's per-parameter state (momentum, moments, step counts), each with its parameter, to
    tell later whether anything but a private step changed it: the released steps apply that state.  (Parameters
    are matched by identity when compared, so a deep copy of the holder and its optimizer stays matched.)"""
    return [(p, {key: _copied(value) for key, value in entry.items()}) for p, entry in optimizer.state.items() if entry]


def put_back_optimizer_state_(optimizer: torch.optim.Optimizer, saved: List[Tuple[Any, Dict[str, Any]]]) -> List[Any]:
    """The parameters whose optimizer state differs from the snapshot (:func:`snapshot_optimizer_state`; an entry
    added, removed or with a key or value changed), after which the snapshot's state is put back (as copies: the
    snapshot stays the reference).  The learning rates and other group settings are not state: a schedule may
    change them."""
    current = {id(p): (p, entry) for p, entry in optimizer.state.items() if entry}
    before = {id(p): (p, entry) for p, entry in saved}
    changed = [(current.get(key) or before[key])[0] for key in set(current) | set(before)
               if key not in current or key not in before or not _same(current[key][1], before[key][1])]
    if changed:
        restored = {p: {k: _copied(v) for k, v in entry.items()} for p, entry in saved}
        if type(optimizer.state) is defaultdict and optimizer.state.default_factory is dict:
            optimizer.state.clear()  # in place: a reference to the mapping held elsewhere sees the put-back state
            optimizer.state.update(restored)
        else:  # replaced by a mapping without the default entry torch's steps expect
            optimizer.state = defaultdict(dict, restored)
    return changed


def state_digests(tensors: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """SHA-256 of each named tensor's shape and values, floating and complex ones widened to double precision
    first (exactly), so that a cast that keeps every value (``model.double()``, ``.to(device)``) is no change, as
    for :func:`changed_state`: what a saved optimizer state records of the model state it released."""
    digests = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if t.is_complex():
            t = t.to(torch.complex128)
        elif t.is_floating_point():
            t = t.to(torch.float64)
        kind = "float" if t.is_floating_point() or t.is_complex() else str(t.dtype)
        h = hashlib.sha256(f"{kind}:{tuple(t.shape)}:".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests[name] = h.hexdigest()
    return digests


@torch.no_grad()
def restore_state_(current: Dict[str, torch.Tensor], saved: Dict[str, torch.Tensor]) -> None:
    """Put the snapshot's values back into the tensors of the same names (of the same shape: a plain attribute
    replaced by a tensor of another shape cannot be written back in place, and stays refused at every step)."""
    for name in set(current) & set(saved):
        if current[name].shape == saved[name].shape:
            current[name].copy_(saved[name].to(current[name].device))


def put_back_changes_(current: Dict[str, torch.Tensor], saved: Dict[str, torch.Tensor]) -> List[str]:
    """The names changed since the snapshot (:func:`changed_state`), whose snapshot values are then put back."""
    changed = changed_state(current, saved)
    if changed:
        restore_state_(current, saved)
    return changed


# Why a plain attribute of a module may change only in the private step (the values behind its names, stated once).
_SET = ("changed since the last private step: a value set from a batch (a running statistic or a centre kept by hand) "
        "holds it without noise, every later forward reads it, and a pickle of the model releases it; keep such "
        "state out of the model, or make it a constant set before make_private")


ROWS_LEFT_OUT = ("rows of the batch drawn from the private loader were left out of the step's forwards (with "
                 "augmentation multiplicity K: an example in fewer than K rows): which rows are trained on was "
                 "chosen in the loop (the hardest examples by a first pass, a filter on other rows, a part "
                 "skipped), and one added record can push another out, up to twice the certified bound; "
                 "backpropagate every drawn row, with augmentation multiplicity K in K rows each (filter records by "
                 "their own values in the Dataset, or give them a weight column of 0)")


class DPOptimizer(DeclaredConstants, torch.optim.Optimizer):
    """A private optimizer step around ``optimizer`` for the model covered by ``bound_engine``.

    A ``torch.optim.Optimizer`` to torch's utilities (learning-rate schedulers, ``swa_utils.SWALR``), as in Opacus:
    its ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, so a schedule changes the learning
    rate the inner step uses (a function of the step count or of held-out data: post-processing).

    The noise comes from ``plan`` (:func:`~clipless.privacy.calibration.plan_noise`, the one noise plan); the
    step refuses to run past ``plan.max_steps`` (the target epsilon) and refuses a gradient on any
    parameter its bounds do not cover.  Without ``generator`` the noise is drawn from OS entropy.
    ``secure_noise``: every noise value (and each per-step mechanism's) is a sum of draws that fills the gaps of a
    floating-point Gaussian (:func:`~clipless.privacy.noise.gaussian`), at 4 draws per value.
    ``augmentation_multiplicity`` ``K``: the backward may carry ``K`` augmented rows per example, each loss
    weighted ``1/K`` (the mean of an example's ``K`` gradients is within the same per-example bound).
    """

    # What the noise and the accountant's composition rest on: set once, then read-only (a replaced plan, accountant
    # or generator would draw or count other noise than the run reports); each step also checks them against the
    # values frozen at construction (a write to the instance's __dict__ passes the read-only guard).
    constants = ("original_optimizer", "bound_engine", "plan", "expected_batch_size", "sample_rate", "accountant",
                 "step_mechanisms", "augmentation_multiplicity", "generator", "secure_noise", "rank", "world_size",
                 "own_code")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        bound_engine: BoundEngine,
        plan: NoisePlan,
        expected_batch_size: float,
        accountant: PrivacyAccountant,
        generator: Optional[torch.Generator] = None,
        distributed: bool = False,
        augmentation_multiplicity: int = 1,
        secure_noise: bool = False,
    ) -> None:
        augmentation_multiplicity = whole_number(augmentation_multiplicity, "augmentation_multiplicity")
        check_secure_flag(secure_noise)
        check_flag(distributed, "distributed")
        check_generator(generator, "generator")
        if accountant.mechanism != plan.accountant:
            raise ValueError(f"the noise plan was made for the {plan.accountant!r} accountant, the run uses "
                             f"{accountant.mechanism!r}")
        step_arg = inspect.signature(optimizer.step).parameters.get("closure")
        if step_arg is not None and step_arg.default is inspect.Parameter.empty:
            raise ValueError(f"{type(optimizer).__name__} needs a closure in step(): it evaluates the loss several "
                             "times per step, and each evaluation's gradient would be used without noise; use a "
                             "first-order optimizer (SGD, Adam, ...)")
        check_fresh_optimizer(optimizer, "make_private", "make_private, then dp_optimizer.load_state_dict(saved)")
        hooked = hooks_refused(optimizer)
        if hooked is not None:
            raise ValueError(hooked)
        self._inner_steps = _step_functions(optimizer)  # the inner step as given: nothing may replace it later
        bind_accountant(bound_engine.model, accountant)
        self.original_optimizer = optimizer
        self.rank, self.world_size = world() if distributed else (0, 1)
        if distributed and self.world_size == 1:
            raise ValueError("distributed=True needs an initialized torch.distributed process group of >= 2 processes")
        self.bound_engine = bound_engine
        self.plan = plan
        self.expected_batch_size = float(expected_batch_size)
        self.sample_rate = plan.sample_rate
        self.accountant = accountant
        self._accounted = accountant.history  # what the steps so far composed: nothing may take it away
        report = bound_engine.compute()
        if set(plan.layer_sigmas) != {layer.name for layer in report.layers}:
            raise ValueError("the noise plan does not name exactly the model's bounded layers")
        # Adaptive clipping releases a noisy count per step on the same batch: one more Gaussian mechanism.
        self.step_mechanisms = step_mechanisms(bound_engine.model)
        counts = tuple(clip.count_noise_multiplier for clip in self.step_mechanisms)
        if tuple(sorted(counts)) != tuple(sorted(plan.mechanism_sigmas)):
            raise ValueError(f"the noise plan accounts per-step mechanisms {list(plan.mechanism_sigmas)} but the "
                             f"model releases counts with multipliers {list(counts)}")
        plain = [type(clip).__name__ for clip in self.step_mechanisms
                 if "secure" not in inspect.signature(clip.update_).parameters] if secure_noise else []
        if plain:
            raise ValueError(f"secure_noise=True, but {', '.join(plain)}.update_ takes no 'secure' argument: its "
                             "per-step statistic would get torch's plain Gaussian; give update_ a 'secure' flag "
                             "passed on to clipless.privacy.noise.noisy_count")
        self.secure_noise = secure_noise
        if augmentation_multiplicity > 1 and self.step_mechanisms:
            raise ValueError("augmentation multiplicity > 1 with adaptive clipping: the per-step count would count "
                             "each example up to K times (sensitivity K, not 1); use a fixed LossGradientClip")
        self.augmentation_multiplicity = augmentation_multiplicity
        self._bounded = {id(p) for layer in report.layers for p in layer.params}
        self._bounded_names = [n for n, p in bound_engine.model.named_parameters() if id(p) in self._bounded]
        self._check_covered()
        self.generator = generator if generator is not None else secret_generator(
            next(bound_engine.model.parameters()).device)
        self.last_report: Optional[BoundReport] = report
        self.last_noise_std: Dict[str, float] = {}
        bound_engine.project_()  # start from feasible weights
        # A gradient held from before (a check or warm-up backward, an earlier private optimizer's unstepped batch)
        # was computed without noise from records of no Poisson batch: the first step would add it to its own.
        bound_engine.model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        self._released_state = self._snapshot_released()  # only a private step may change it
        self._released_inner = snapshot_optimizer_state(optimizer)  # nor the inner optimizer's state
        self._released_held = snapshot_state(self._held())  # nor what it keeps elsewhere
        self._batches: Optional[PoissonDataLoader] = None  # the loader whose batches the steps consume, one each
        self._batches_released = 0
        self._external_batches = False
        self._record_digests: Optional[torch.Tensor] = None  # sorted digests of the training records
        # without them (records not read): sorted digests of the rows earlier released batches held, in a few chunks
        self._drawn_before: List[torch.Tensor] = []
        self._derived: Tuple[int, List[torch.Tensor]] = (-1, [])  # rows made from the batch drawn n-th: (n, digests)
        self._watched: Tuple[Any, ...] = ()  # the sampler and input guard: their declared constants, every step
        self._steps_released = 0  # by this optimizer, in this process
        self._retire_earlier(bound_engine.model)
        self.guard = StepGuard(bound_engine.model, bound_engine.leaves,
                               [p for layer in report.layers for p in layer.params],
                               bound_engine.loss, lambda: bound_engine.loss_lipschitz,
                               rows_per_example=augmentation_multiplicity,
                               model_changed=self._changed_at_forward, before_release=self._before_release)
        names = self._parameter_names()
        self._guard_weight_names = [names.get(id(p), "") for p in self.guard.params]  # to hand it the released copies
        self._retired = False
        self._release_hooks: "OrderedDict[int, Callable[[Dict[str, torch.Tensor]], Any]]" = OrderedDict()
        # the privacy core's modules and classes as make_private found them (a declared constant)
        self.own_code = FunctionNamespaces(step_code=("clipless.privacy.",))
        self._methods = _instance_methods(self)
        self._frozen = self._settings()
        _LATEST[bound_engine.model] = weakref.ref(self)

    def _settings(self) -> Tuple[Any, ...]:
        """What each step's noise and accounting use: the plan's values, and objects compared by identity (a deep
        copy of the optimizer copies them with the snapshot)."""
        return (self.declared_values(),  # every declared constant: a write into __dict__ passes the read-only guard
                self.plan.values(), tuple(self.step_mechanisms),  # fields and list items changed in place
                self.bound_engine.input_bound, self.bound_engine.loss,
                tuple((obj, obj.declared_values() if isinstance(obj, DeclaredConstants) else None,
                       obj.attached() if isinstance(obj, InputGuard) else None) for obj in self._watched),
                None if self._batches is None else self._batches.parts(),
                # what the step guard checks against: the loss constant, the rows per example, the record digests,
                # the summed gradients, the weights it compares between a forward and the step
                self.guard.loss_lipschitz, self.guard.rows_per_example, self.guard.digest_inputs,
                self.guard.model_changed, self.guard.sum_check, tuple(map(id, self.guard.params)))

    def audit_replace_plan_(self, plan: NoisePlan) -> None:
        """A deliberate bug for empirical audits only (``clipless audit --noise-scale``): from now on draw the noise
        of ``plan`` while the accountant goes on composing the original plan's ``step_sigma``.  The run's epsilon
        is then false; the audit that calls this labels its result as a diagnostic, not a private run."""
        if set(plan.layer_sigmas) != set(self.plan.layer_sigmas) or plan.accountant != self.plan.accountant:
            raise ValueError("the replacement plan must name the same layers and accountant")
        accounted = self.plan
        object.__setattr__(self, "plan", dataclasses.replace(plan, step_sigma=accounted.step_sigma,
                                                             sample_rate=accounted.sample_rate,
                                                             max_steps=accounted.max_steps))
        self._frozen = self._settings()

    def audit_skip_sum_check_(self) -> None:
        """For the white-box step audit only (``clipless.diagnostics.step_audit``): stop checking the summed
        gradient against the declared bounds, so that a canary beyond an understated bound is released and
        measured instead of refused.  The run is then a diagnostic; written past this, the change is refused."""
        self.guard.sum_check = False
        self._frozen = self._settings()

    def _retire_earlier(self, model: torch.nn.Module) -> None:
        """A model made private again is stepped by the new optimizer only: the earlier one's guard leaves the
        model (its hooks would go on watching every forward), and a step of it is refused by name (its refusal
        would otherwise put its own, older, released state back into the model)."""
        earlier = _LATEST.get(model)
        earlier = earlier() if earlier is not None else None
        if earlier is not None and earlier is not self and not earlier._retired:
            earlier.guard.remove()
            earlier._retired = True

    # Read-only views of the plan (one meaning each, see clipless.privacy.calibration).
    @property
    def strategy(self) -> str:
        return self.plan.strategy

    @property
    def noise_multiplier(self) -> float:
        return self.plan.gradient_sigma

    @property
    def layer_sigmas(self) -> Dict[str, float]:
        return dict(self.plan.layer_sigmas)

    @property
    def effective_noise_multiplier(self) -> float:
        return self.plan.step_sigma

    def _check_covered(self) -> None:
        for group in self.original_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._bounded and (p.requires_grad or p.grad is not None):
                    raise BoundError("the optimizer holds a trainable parameter that the bound engine does not cover "
                                     "(added after make_private, or frozen when the bounds were computed); "
                                     "call make_private again on the same PrivacyEngine (its accountant goes on "
                                     "composing)")

    def _settings_change(self) -> Optional[str]:
        tampered = _tampered(self)  # code the step would run, changed after make_private
        if tampered is not None:
            return tampered
        if self._settings() == self._frozen:
            return None
        return ("the private optimizer's settings (noise plan, accountant, noise generator, inner optimizer, batch "
                "size, augmentation multiplicity, rank), the loader's sampler, collate or dataset, the input guard's "
                "bound or hook, or the step guard's settings changed after make_private (written past their "
                "read-only guard, a hook removed): the step would draw or account other noise, or check other "
                "bounds, than the run reports; make the model private again for other settings")

    def _check_settings(self) -> None:
        why = self._settings_change()
        if why is not None:
            raise BoundError(why)

    def watch_batches(self, loader: PoissonDataLoader, external_batches: bool = False,
                      input_guard: Optional[InputGuard] = None, record_digests: Optional[torch.Tensor] = None) -> None:
        """Each step must then release exactly one new batch of ``loader``.

        The accountant composes one Poisson-subsampled Gaussian per step.  Two steps on one batch are not two
        independent samples, and one step on the sum of several batches has per-step inclusion rate about
        ``k q``, not ``q`` (an example may also appear in several, doubling its sensitivity).  A step before the
        loop has drawn anything from ``loader`` is refused too: its batch came from elsewhere (a shuffled,
        fixed-size ``DataLoader`` is not Poisson sampling), unless ``external_batches`` says the caller draws
        Poisson batches at the same rate itself; those, and rows mixing several examples, cannot be checked.
        A refused step spends the batches drawn before it.  The loader's batch sampler (its inclusion rate) and
        ``input_guard`` (the data bound it checks, and that it still checks the forwards) are compared with their
        values now at every forward and step.  ``record_digests``: the row digests of the training records (those
        read by the record check); a step whose forwards saw one of them that the batch does not hold is refused."""
        check_flag(external_batches, "external_batches")
        self._check_settings()  # a new snapshot must not hide a change made before it
        self._batches = loader
        self._batches_released = loader.batches_drawn
        self._external_batches = bool(external_batches)
        self._record_digests = None if record_digests is None else torch.unique(record_digests)  # sorted
        self._drawn_before = []
        self.guard.digest_inputs = True  # the rows of its batches are checked against the forwards' inputs
        self._watched = (loader.batch_sampler, input_guard)
        self._frozen = self._settings()

    def _loader_in_use(self) -> Optional[PoissonDataLoader]:
        """The watched loader once the loop has drawn from it (None before: see :meth:`_check_one_new_batch`)."""
        return self._batches if self._batches is not None and self._batches.batches_drawn else None

    def _check_one_new_batch(self) -> None:
        loader = self._loader_in_use()
        if loader is None:
            if self._batches is not None and not self._external_batches:
                raise BoundError("this step's batch was not drawn from the Poisson loader that make_private returned: "
                                 "the accountant composes Poisson-sampled steps at the sample rate, which a shuffled "
                                 "or fixed-size DataLoader is not; iterate over the returned loader (if you draw "
                                 "Poisson batches at that rate yourself, pass external_batches=True to make_private)")
            return
        new = loader.batches_drawn - self._batches_released
        if new == 0:
            raise BoundError("no new batch was drawn from the private loader since the last step: a second step on "
                             "the same batch is not accounted (the accountant composes one fresh Poisson sample per "
                             "step); draw the next batch from the loader for each step")
        if new > 1:
            raise BoundError(f"{new} batches were drawn from the private loader since the last step: call step() "
                             "once per batch, empty batches included (gradients of several Poisson batches summed "
                             "in one step are not what the accountant composes, and skipping a batch reveals its "
                             "size; a wrapper that draws batches ahead of the loop is refused for the same reason)")

    def derived_rows_(self, rows: torch.Tensor) -> None:
        """Rows the loop made from the batch just drawn, one per example and copy, such as its augmented copies: they
        may equal another record's exact values (a near-blank image shifted off its content equals a blank record),
        or each other's, without being that record or a repeat, so the row checks count them as drawn rows."""
        loader = self._loader_in_use()
        if loader is None:
            return
        if self._derived[0] != loader.batches_drawn:
            self._derived = (loader.batches_drawn, [])
        digests = row_digests(rows.detach())
        drawn = loader.last_batch_rows
        declared = digests.numel() + sum(d.numel() for d in self._derived[1])
        if drawn is not None and declared > self.augmentation_multiplicity * drawn:
            # without the counts: a Poisson batch's size is secret
            raise BoundError("derived_rows_ was given more rows than K = "
                             f"{self.augmentation_multiplicity} copies of the batch drawn from the private loader "
                             "(K: augmentation multiplicity): rows made from the drawn batch are one per example "
                             "and copy; declare only those (records from elsewhere are not the Poisson sample)")
        self._derived[1].append(digests)

    def _check_rows(self) -> None:
        """More output rows than the drawn batch holds (times K) means some example was used twice: a row
        duplicated or an augmented copy added without ``augmentation_multiplicity``, each at full weight; so does
        a drawn row repeated in the forwards' inputs more often than the batch holds it (:func:`rows_repeated`)."""
        loader = self._loader_in_use()
        drawn = None if loader is None else loader.last_batch_rows
        if drawn is None:
            return
        rows, k = self.guard.released_rows(), self.augmentation_multiplicity
        if rows > k * drawn:
            # without the counts: a Poisson batch's size is secret
            raise BoundError(f"the backward carried more rows of the private model's output than K = {k} times the "
                             "batch drawn from the private loader (K: augmentation multiplicity): an example used in "
                             "several rows, each with loss weight 1, has several times the certified sensitivity; "
                             "for augmented copies pass augmentation_multiplicity=K to make_private and backpropagate "
                             "the mean over each example's K rows")
        shape = self.bound_engine.input_shape
        drawn_rows = [d for row_shape, d in loader.last_batch_digests if row_shape == shape]
        references = list(drawn_rows)
        if self._derived[0] == loader.batches_drawn:  # rows made from this batch count as drawn, each copy once
            references += self._derived[1]
        seen = self.guard.released_digests()
        if rows_repeated(seen, references, k):
            raise BoundError(f"a record of the batch entered the private model's forwards in more rows than K = {k} "
                             "times the batch drawn from the private loader holds it (rows repeated inside the "
                             "batch: resampling or class balancing by index, x[idx]): each copy at full weight "
                             "multiplies its certified sensitivity; use each drawn record once (weight classes "
                             "through the data, not by repeating rows), or for augmented copies pass "
                             "augmentation_multiplicity=K and backpropagate the mean over each example's K rows (a "
                             "transform in the loop that maps distinct records to equal rows, such as rounding, "
                             "looks the same: apply it in the Dataset)")
        # records not read (check_records=False): at least a row of an earlier batch is seen (a batch kept and
        # trained on again, say concatenated with the next one)
        known = [self._record_digests] if self._record_digests is not None else self._drawn_before
        if any(undrawn_records(seen, references, records) for records in known):
            raise BoundError("a row that entered the private model's forwards is a training record that the batch "
                             "drawn from the private loader does not hold: batches from a DataLoader of your own (say "
                             "zipped with the private loader to count steps) or records taken from the dataset by "
                             "index are not the Poisson sample the accountant composes, and that record would be "
                             "used at every such step; train on the rows of the loader's batches (a transform in the "
                             "loop that maps a drawn record to another record's exact values looks the same: apply "
                             "it in the Dataset)")
        if rows_not_drawn(seen, references):
            raise BoundError("a row that entered the private model's forwards is neither a row of the batch drawn "
                             "from the private loader nor one declared as made from it: a row mixed from several "
                             "records (mixup, a batch mean or other batch statistic subtracted) carries each of them, "
                             "beyond the certified per-example bound; transform each record alone, in the Dataset's "
                             "__getitem__, or declare the rows your loop made each from one drawn record with "
                             "dp_optimizer.derived_rows_(x) before their forward")
        # K rows for every drawn example.  The rows are drawn (or declared) ones, none more than K times (above), so
        # K times the batch's count means every drawn row in K of them; fewer means rows the loop chose to leave out
        # (and the mean's 1/n would weigh a number of rows it chose)
        if rows < k * drawn:
            raise BoundError(ROWS_LEFT_OUT)
        self._check_labels(loader, k)
        if self._record_digests is None and drawn_rows:
            chunks = self._drawn_before
            chunks.append(torch.unique(torch.cat(drawn_rows)))
            while len(chunks) > 1 and 2 * len(chunks[-1]) >= len(chunks[-2]):  # sizes halve: log-many to search
                last = chunks.pop()
                chunks[-1] = torch.unique(torch.cat([chunks[-1], last]))

    def _drawn_column_pairs(self, loader: Optional[PoissonDataLoader]) -> Optional[torch.Tensor]:
        """``(input, column)`` digest pairs of the batch last drawn from ``loader``, for each column of the batch
        besides its one tensor of inputs (``(x, y, w)``: ``y`` and ``w``), or ``None`` where there are none."""
        if loader is None or loader.last_batch_rows is None:
            return None
        shape = self.bound_engine.input_shape
        leaves = loader.last_batch_digests
        inputs = [d for row_shape, d in leaves if row_shape == shape]
        if len(inputs) != 1:
            return None
        columns = [d for row_shape, d in leaves if row_shape != shape and d.shape == inputs[0].shape]
        if not columns:
            return None
        return torch.cat([_pair_digests(inputs[0].cpu(), column.cpu()) for column in columns])

    def _check_labels(self, loader: PoissonDataLoader, k: int) -> None:
        """Each drawn row's loss target must be its own record's label: one record's label given to other rows (the
        labels shuffled apart from the inputs, one label for all) reaches several examples' losses.  Checked on
        ``(input, label)`` digest pairs against the drawn batch's, where the batch has one tensor of inputs: a label
        may be any other tensor of the batch (``(x, y, w)``: ``y`` or ``w``), each the record's own; rows the loop
        declared (:meth:`derived_rows_`) are its own word and are not checked."""
        drawn = self._drawn_column_pairs(loader)
        if drawn is None:
            return
        seen, targets = self.guard.released_labelled_rows()
        seen, targets = seen.cpu(), targets.cpu()
        checked = torch.ones_like(seen, dtype=torch.bool)
        if self._derived[0] == loader.batches_drawn:
            for rows in self._derived[1]:
                checked &= ~torch.isin(seen, rows.cpu())
        if rows_beyond(_pair_digests(seen[checked], targets[checked]), drawn, k):
            raise BoundError("a row of the batch entered the loss with another label than its record's in the batch "
                             "drawn from the private loader: one record's label given to other rows (labels "
                             "shuffled apart from their inputs, one label for all) reaches several examples' losses, "
                             "beyond the certified per-example bound; give each row its own record's label as the "
                             "loader yields it (a relabelling of each record belongs in the Dataset; labels the loop "
                             "computes from each row alone, such as the model's predictions, are declared with their "
                             "rows: dp_optimizer.derived_rows_(x))")

    def _check_loss_weights(self) -> None:
        """Every row of the step must enter the backward with one weight that reads no other example: the sum's 1,
        the mean's ``1/n`` over the step's ``n`` rows, ``1/K`` per augmented row, or each row's own record's weight,
        a column of the batch drawn from the private loader paired with the row's input (``(x, y, w)``:
        ``(l * w).sum()``), which moves that record's gradient alone (the weights are at most 1).  Anything else
        (a scale, class weights, a selection) is set by the loop, which sees the whole batch, and may depend on the
        other examples; that one record moves the released sum by at most its bound is not known for it."""
        weights = self.guard.released_loss_weights()
        if not weights:
            return
        if any(w is None for w in weights):
            raise BoundError(LOSS_WEIGHTS)
        flat = torch.cat([w.reshape(-1) for w in weights])  # type: ignore[union-attr]
        if flat.numel() == 0:
            return
        first = float(flat[0])
        if bool((flat == flat[0]).all()) and allowed_uniform_weight(first, flat.numel(),
                                                                    self.augmentation_multiplicity):
            return
        seen, own = self.guard.released_weighted_rows()
        drawn = self._drawn_column_pairs(self._loader_in_use()) if self.augmentation_multiplicity == 1 else None
        if drawn is None or seen.numel() != flat.numel() or \
                rows_beyond(_pair_digests(seen.cpu(), row_digests(own).cpu()), drawn, 1):
            raise BoundError(LOSS_WEIGHTS)

    def _snapshot_released(self) -> Dict[str, torch.Tensor]:
        return snapshot_state(model_state(self.bound_engine.model))

    def _changed_at_forward(self) -> Optional[str]:
        """Why the model a forward runs is not the one this step's bounds will describe, or ``None``: a constant
        changed (:meth:`BoundEngine.declared_change`), or a buffer or frozen parameter not as the last step released
        it (an adaptive clip's norm raised for the forward and put back before ``step()`` passes a check at the
        step alone).  Asked by the step guard at every forward; the stepped weights it follows itself."""
        why = self.bound_engine.declared_change()
        if why is not None:
            return why
        why = self._settings_change()  # the input guard's bound, say, switched off for this forward's check
        if why is not None:
            return why
        state = model_state(self.bound_engine.model)
        swapped = [n for n in self._bounded_names if id(state.get(n)) not in self._bounded]
        if swapped:
            return (f"the model's weights ({', '.join(swapped[:4])}) were other tensors than its own (torch.func."
                    "functional_call, a parameter replaced or shared between layers): the bounds describe the "
                    "model's own weights")
        current = {n: t for n, t in state.items() if n not in self._bounded_names}
        changed = changed_state(current, {n: t for n, t in self._released_state.items() if n in current})
        if not changed:
            return None
        plain = [n for n in changed if n in attribute_tensors(self.bound_engine.model)]
        if plain:
            return f"tensors that modules of the private model keep as plain attributes ({', '.join(plain[:4])}) {_SET}"
        return (f"buffers or frozen parameters ({', '.join(changed[:4])}) were not as the last private step released "
                "them: the bounds are computed from the released values; only the private step may change the model")

    def _before_release(self) -> None:
        """The model's ``state_dict()`` or pickle is about to release its weights: they must be the last step's."""
        if self._retired:
            return
        try:
            self.check_released_state()
        except BoundError as err:
            raise BoundError(f"model.state_dict() or a pickle of the model: {err}. (A change that reads no training "
                             "data, such as pruning, is post-processing: make it on copy.deepcopy(model), which is an "
                             "ordinary model)") from None

    def check_released_state(self) -> None:
        """Refuse a model that is not as the last private step released it (or refused and put back), and put
        that state back.  A weight changed outside the step (``p -= lr * p.grad`` by hand, an assignment to
        ``.data``, ``load_state_dict`` after the optimizer's) holds a batch's gradient without noise; a buffer or
        frozen parameter that a forward updates (a running statistic) holds the batch itself; the model's
        ``state_dict`` would release either.  So would every later step the inner optimizer's state (momentum,
        moments) changed outside the step.  Every step checks this; call it before saving the model."""
        current = model_state(self.bound_engine.model)
        changed = put_back_changes_(current, self._released_state)
        self._check_inner_state(" with the model" if changed else "")
        if not changed:
            return
        weights = [name for name in changed if name in current and id(current[name]) in self._bounded]
        if weights:
            raise BoundError(f"weights of the private model changed outside the private step since its last release "
                             f"({', '.join(weights[:4])}): an update computed from a batch without noise (by hand, "
                             "through .data, or a load_state_dict after the optimizer's) would be released with the "
                             "model; they were put back. Change the weights only through the private optimizer's "
                             "step(): set them before make_private (on a resume, load the model's state before the "
                             "optimizer's)")
        plain = [name for name in changed if name in attribute_tensors(self.bound_engine.model)]
        if plain:
            raise BoundError(f"tensors that modules of the private model keep as plain attributes "
                             f"({', '.join(plain[:4])}) {_SET}; they were put back")
        raise BoundError(f"buffers or frozen parameters of the private model changed since the last private step "
                         f"({', '.join(changed[:4])}): state that a forward or backward updates (a running statistic) "
                         "holds the batch without noise and would be released with the model; it was put back. Only "
                         "the private step may change the model: use layers without such state (on a resume, load "
                         "the model's state before the optimizer's)")

    def _check_inner_state(self, also: str = "") -> None:
        """Refuse the inner optimizer's state if it is not as the last step (or a resume) left it, and put that
        state back (``also``: what else was put back)."""
        inner = put_back_optimizer_state_(self.original_optimizer, self._released_inner)
        kept = put_back_changes_(self._held(), self._released_held)
        if kept:
            raise BoundError(f"tensors that the {type(self.original_optimizer).__name__} inside the private optimizer "
                             f"keeps outside its state ({', '.join(kept[:4])}) changed outside the private step since "
                             f"its last release: written in the loop, they could hold a gradient without noise, which "
                             f"every later step would apply; they were put back{also}. Only the private step may "
                             "change them")
        tampered = _tampered(self)  # before a state_dict would run an inner optimizer's hooks
        if tampered is not None:
            raise BoundError(tampered)
        if not inner:
            return
        names = self._parameter_names()
        held = sorted(names.get(id(p), "a tensor outside the model") for p in inner)
        raise BoundError(f"the state of the {type(self.original_optimizer).__name__} inside the private optimizer "
                         f"(momentum or moments of {', '.join(held[:4])}) changed outside the private step since its "
                         "last release: written by hand or loaded with original_optimizer.load_state_dict, it could "
                         f"hold a gradient without noise, which every later step would apply; it was put back{also}. "
                         "Only the private step may change it (a resume: the private optimizer's load_state_dict)")

    def _parameter_names(self) -> Dict[int, str]:
        return {id(p): name for name, p in self.bound_engine.model.named_parameters()}

    def _held(self) -> Dict[str, torch.Tensor]:
        """The inner optimizer's tensors outside its per-parameter state (:func:`_held_tensors`), the model's weights
        left out (they are the released state's)."""
        names = self._parameter_names()
        return {name: t for name, t in _held_tensors(self.original_optimizer, names).items() if id(t) not in names}

    def restart_from_(self, state: Dict[str, torch.Tensor]) -> None:
        """Load ``state`` (a ``state_dict`` of the model) and take it as the released state: for a harness that
        runs independent steps from the same weights, such as the step audit.  The accountant keeps composing every
        step; a state the caller did not get from a release is the caller's own release."""
        self.bound_engine.model.load_state_dict(state)
        self._released_state = self._snapshot_released()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.original_optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.original_optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    # torch.optim.Optimizer.__init__ is not run (the inner optimizer holds the groups and state), and its pickling
    # (groups and state only) is not this object's: copies and pickles follow the plain object protocol
    def __getstate__(self) -> Dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def register_release_hook(self, hook: Callable[[Dict[str, torch.Tensor]], Any]) -> RemovableHandle:
        """Call ``hook(gradients)`` at every released step with copies of the gradients the inner optimizer is then
        given (noisy, divided by the expected batch size), by parameter name: to log or audit what a step releases.
        They are copies, so the hook cannot change the step.  ``handle.remove()`` detaches it.  (The inner optimizer
        itself may have no hooks: they would run inside the step, on whatever their code holds.)"""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(self._release_hooks)
        self._release_hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.guard.clear_gradient_state()

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if self._retired:
            raise BoundError("this private optimizer was replaced: its model was made private again, and only the "
                             "optimizer the latest make_private returned may step it (its accountant goes on "
                             "composing the steps)")
        loss = None

        def checked() -> Tuple[List[torch.Tensor], BoundReport]:
            nonlocal loss
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._check_one_new_batch()
            self._check_covered()
            params = [p for group in self.original_optimizer.param_groups for p in group["params"]]
            with unwatched(params):  # the user's closure is done: from here on only the step's own operations run
                return params, self._checked_report(params)

        try:
            tampered = _tampered(self)
            if tampered is not None:
                raise BoundError(tampered)
            check_released_steps_(self.accountant, self._accounted)
            self.plan.check_budget(self.accountant.steps)
            if self.world_size == 1:
                params, report = checked()
            else:  # a rank that refuses alone would leave its peers waiting in the all-reduce of the noisy sum
                params, report = same_outcome_on_all_ranks(checked, next(self.bound_engine.model.parameters()).device)
            with unwatched(params):
                self._release(params, report)
        except BaseException:
            # refused (or failed while releasing): nothing of the batch stays in the model or the inner optimizer's
            # state, whichever check spoke
            restore_state_(model_state(self.bound_engine.model), self._released_state)
            put_back_optimizer_state_(self.original_optimizer, self._released_inner)
            restore_state_(self._held(), self._released_held)
            raise
        finally:  # released or refused, the batches drawn so far are spent: the next step needs a new one
            if self._batches is not None:
                self._batches_released = self._batches.batches_drawn
        return loss

    def _checked_report(self, params: List[torch.Tensor]) -> BoundReport:
        """Every check of the step's gradients, then the certified bounds they are noised with."""
        self.guard.check_step(params)
        self._check_rows()
        self._check_loss_weights()
        report = self.bound_engine.compute()
        bounded = [id(p) for layer in report.layers for p in layer.params]
        noised = set(bounded)
        if len(bounded) != len(noised) or not noised <= self._bounded:
            raise BoundError("a parameter of the model was replaced or shared between layers after make_private: "
                             "the optimizer would not step it, or its gradient would sum two separately bounded "
                             "blocks; call make_private again on the same PrivacyEngine")
        # The noise goes to the report's parameters; the optimizer steps every parameter that has a gradient,
        # frozen or not (a weight frozen between the backward and step() kept its summed gradient).
        if any(p.grad is not None and id(p) not in noised for p in params):
            raise BoundError("a parameter that receives no noise this step (frozen with requires_grad_(False) "
                             "after the backward) has a gradient: the optimizer would apply it without noise; "
                             "freeze parameters before the forward, or set their .grad to None")
        self.guard.check_sums(report)
        self._check_settings()
        self.check_released_state()  # after the checks that name a replaced or frozen parameter more precisely
        return report

    def _release(self, params: List[torch.Tensor], report: BoundReport) -> None:
        """Add the planned noise, account, step, project, and start the next step."""
        self.last_report = report
        if self.world_size == 1:
            self.last_noise_std = add_noise_(report, self.plan.strategy, self.plan.layer_sigmas,
                                             self.expected_batch_size, self.generator, secure=self.secure_noise)
        else:  # one draw of noise (rank 0) on the global sum, then / b
            self.last_noise_std = add_noise_(report, self.plan.strategy, self.plan.layer_sigmas, 1.0, self.generator,
                                             draw=self.rank == 0, secure=self.secure_noise)
            grads = [p.grad for layer in report.layers for p in layer.params]
            all_reduce_sum_(grads)  # type: ignore[arg-type]
            for g in grads:
                g.div_(self.expected_batch_size)  # type: ignore[union-attr]
        # Accounted as soon as the noisy gradient exists: the inner step consumes it into its state (momentum, Adam's
        # moments), which later released steps apply even if what follows here fails and the model is put back.
        self._accounted = self.plan.account_step(self.accountant, self._accounted)  # whatever its step did
        check_composed_(self.accountant, self._accounted)
        if self._release_hooks:
            released = {name: p.grad.detach() for name, p in self.bound_engine.model.named_parameters()
                        if p.grad is not None}
            for hook in list(self._release_hooks.values()):
                hook({name: g.clone() for name, g in released.items()})  # each its own copies
        self.original_optimizer.step()
        self._released_inner = snapshot_optimizer_state(self.original_optimizer)  # what later steps may build on
        self.bound_engine.project_()
        passes = self.guard.released_backward_passes() if self.step_mechanisms else ()
        for clip in self.step_mechanisms:  # after the step: its noise used the C of this batch's backward
            # the count of the released passes only: not of one cleared by zero_grad, refused, or an input gradient
            clip.keep_only_(passes)
            secure = {"secure": True} if self.secure_noise else {}  # a mechanism without the flag is refused above
            if self.world_size > 1:
                clip.update_(self.expected_batch_size, self.generator, distributed=True, **secure)
            else:  # the one-process call, as every PerStepMechanism implements it
                clip.update_(self.expected_batch_size, self.generator, **secure)
        self._released_state = self._snapshot_released()  # stepped and projected (a noisy count may update a buffer)
        self._released_held = snapshot_state(self._held())  # after the projection: a tensor may alias a weight
        self._steps_released += 1
        # the next step needs a new batch's backward (no zero_grad can be forgotten); its forward compares the
        # weights with the released copies (a copy that does not match is made again there)
        released = [self._released_state.get(name) for name in self._guard_weight_names]
        self.guard.finish_step(params, None if any(w is None for w in released) else released)  # type: ignore[arg-type]

    def state_dict(self) -> Dict[str, Any]:
        """What a resume needs (:meth:`load_state_dict`); refused, and the inner state put back, where the inner
        optimizer's state is not as the last step left it (a resume would take it as released)."""
        self._check_inner_state()
        return {
            # a copy: torch's state_dict holds the live momentum, which later steps would move in the saved dict
            # while its accountant history stays at this step (a resume from it would build on unaccounted steps)
            "optimizer": copy.deepcopy(self.original_optimizer.state_dict()),
            "noise_generator": saved_generator_state(self.generator),
            # the steps the inner state comes from: a resume that loads it goes on composing them
            "accountant": self.accountant.state_dict(),
            # the model those steps released: a resume must load this model, not one changed or trained elsewhere
            "released_state": state_digests(self._released_state),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The inner optimizer's state, the accountant's history of the steps that produced it, and the noise
        generator's state when it was given (a fixed seed, for a reproducible experiment).  The history goes into
        this optimizer's accountant (fresh, or already holding that history): a resume of the optimizer alone
        would otherwise report the epsilon of its new steps only.  A secret generator keeps its fresh OS-entropy
        state: the noise only has to be secret, and two runs resumed from one state would otherwise draw the same
        noise, so that the difference of their releases would show the difference of their gradients without
        noise.  The model must hold the state those steps released (load the model's state first; its
        digests are compared, :func:`state_digests`): it becomes this optimizer's released state, and a model
        changed after make_private (an update by hand from a batch's gradient) or taken from another run would
        otherwise be released by the next step without its noise or its accounting."""
        check_nothing_released(self._steps_released, "this private optimizer")
        if not isinstance(state, dict) or not {"optimizer", "noise_generator"} <= set(state):
            inner = isinstance(state, dict) and {"state", "param_groups"} <= set(state)
            raise ValueError("not a private optimizer's state: " + (
                "this is a torch optimizer's state_dict, which records neither the noise generator nor the "
                "steps it came from; save and load dp_optimizer.state_dict()" if inner else
                f"expected the dict of DPOptimizer.state_dict() ('optimizer', 'noise_generator', 'accountant'), "
                f"got {type(state).__name__}" + (f" with keys {sorted(map(str, state))}"
                                                 if isinstance(state, dict) else "")))
        saved = state.get("accountant")
        mine = (self.accountant.mechanism, [tuple(e) for e in self.accountant.history])
        if saved is None:
            if self.accountant.steps == 0:
                raise ValueError("this optimizer state records no accountant history (saved by an older version): "
                                 "load the accountant's saved state first (engine.accountant.load_state_dict), so "
                                 "that epsilon counts the steps the state came from")
        elif (saved.get("mechanism"), [tuple(e) for e in saved.get("history", [])]) != mine:
            if saved.get("mechanism") != self.accountant.mechanism:
                raise ValueError(f"this optimizer state was accounted with the {saved.get('mechanism')!r} accountant, "
                                 f"this run uses {self.accountant.mechanism!r}: resume with the same accountant")
            check_nothing_released(self.accountant.steps, "this optimizer's accountant")
        if saved is not None and self.plan.max_steps is not None:
            # the budget counts steps of this plan: steps at another multiplier or rate would not add up to it
            check_composed_at(saved, (self.plan.step_sigma, self.plan.sample_rate), "this optimizer state",
                              "this run's budget (target epsilon or planned epochs) counts steps at its own noise "
                              "multiplier and rate; resume with the noise plan the state was saved with, or give "
                              "noise_multiplier without a target epsilon or epochs")
        self._check_resumed_model(state.get("released_state"))
        # a copy: torch keeps the given tensors as the live state, whose steps would then move the caller's dict
        self.original_optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self._released_inner = snapshot_optimizer_state(self.original_optimizer)
        self._released_held = snapshot_state(self._held())
        resume_generator(self.generator, state["noise_generator"])
        if saved is not None and self.accountant.steps == 0:
            self.accountant.load_state_dict(saved)
        self._accounted = self.accountant.history  # the resumed steps (loaded here or by the caller just before)
        self._released_state = self._snapshot_released()  # the resumed model's, loaded before this

    def _check_resumed_model(self, released: Optional[Dict[str, str]]) -> None:
        if not isinstance(released, dict):
            raise ValueError("this optimizer state does not record the model state its steps released (saved by an "
                             "older version of clipless): a model changed after that release would be released "
                             "without noise, and nothing can check it; resume from a state saved by this version")
        current = state_digests(model_state(self.bound_engine.model))
        changed = sorted(name for name in set(current) | set(released) if current.get(name) != released.get(name))
        if changed:
            names = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
            raise ValueError(f"the model does not hold the state this optimizer state released ({names}): load the "
                             "model's state saved with it before the optimizer's; a model changed since (an update "
                             "by hand) or another run's would be released by the next step without its noise or the "
                             "steps that made it")

    def __repr__(self) -> str:
        return (
            f"DPOptimizer(strategy={self.strategy}, sigma_eff={self.effective_noise_multiplier:.4g}, "
            f"expected_batch_size={self.expected_batch_size:g}, inner={type(self.original_optimizer).__name__})"
        )

