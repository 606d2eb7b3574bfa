"""Guards of the private step: what enters the model, and what reaches the optimizer (spec §3.2).

The noise of a step is calibrated to the certified bound of the summed gradient of *one* fresh
Poisson batch, backpropagated once through the model and a clipless loss, with the weights the
bounds are computed for.  :class:`InputGuard` refuses inputs outside the declared bound.
:class:`StepGuard` follows each gradient-recording forward of the private model to the backward
passes (autograd graph tasks) that accumulate into the parameters, and the optimizer releases a
step only if every accumulation since the last step came from a backward that

* passed through the model's output, from a clipless loss applied to that output and nothing
  else, each per-example loss weighted by at most 1, every example's output gradient within the
  loss constant ``L`` (``batch x outputs`` numbers: cheap);
* was the first backward of a forward made since the last step;
* did not also pass through a layer called outside the model's forward;
* did not also pass through a use of a weight outside the model's forward (``F.linear(x, W)`` or
  a penalty on ``W`` added to the loss): the guarded parameters see every operation on them
  (:class:`_WatchedParameter`), and any recorded one outside the forward taints the backward
  that goes through it; inside the forward they enter through a gate, and each weight's incoming
  gradient must equal what its gates sent (a custom ``torch.autograd.Function``, whose ``apply``
  reports no operation, is caught there) and be accumulated unchanged (a hook on the weight);
* reached each weight's gates only in a backward that went through that forward's output (a gate reached
  otherwise carries a second derivative of the model: an input-gradient or Jacobian penalty);
* repeated no row of the drawn batch more often than the batch holds it, times ``K`` (exact row digests of
  the forwards' inputs against the loader's batch, checked by the optimizer: :func:`rows_repeated`);
* went through no hook that could change the forward's values or the backward: module hooks (the
  model's or global ones) and saved-tensor hooks active during the forward (except torch's
  value-preserving ``save_on_cpu`` and ``allow_mutation_on_saved_tensors``), and hooks on the
  output, which the output's gate runs after;

and if some such backward exists (``step()`` twice, or without a backward), no gradient was set or
edited by hand after it, and the weights are those of the forward.  After a released step the
optimizer clears the gradients (as Opacus' does), so a forgotten ``zero_grad()`` cannot mix
batches.  Backward passes that do not accumulate (``torch.autograd.grad``: diagnostics) are never
refused.  The hooks only check, never change values: the bound engine accepts them
(``is_clipless_guard``).  Not seen by these checks: hooks put by hand on the autograd graph's
nodes (``grad_fn.register_prehook``); :meth:`StepGuard.check_sums` then refuses a summed gradient larger
than the certified per-example bounds allow for the batch's output gradients (a necessary condition).
"""

from __future__ import annotations

import copy
import contextlib
import functools
import importlib
import math
import os
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from .certified import BoundError, DeclaredConstants, ieee_convolutions, ieee_matmul

__all__ = ["InputGuard", "StepGuard", "tap_loss", "paused_guards", "largest_norm", "unwatched",
           "global_hooks_registered", "module_hooks", "active_torch_mode", "saved_tensor_hooks_active",
           "replaced_forward", "redefined_call_path", "CLASS_CALL_PATH",
           "check_precision", "row_digests", "batch_row_digests", "digest_seed", "use_digest_seed", "rows_repeated",
           "undrawn_records", "rows_not_drawn", "rows_beyond", "LOSS_WEIGHTS", "allowed_uniform_weight",
           "backward_pass_id",
           "INPUT_BOUND_TOLERANCE", "DATA_BOUND_REFUSAL", "above_data_bound", "all_finite"]

# Relative slack for float32 rounding of a loss gradient whose exact norm is at most L.
_LOGIT_GRAD_TOL = 1e-5
# Relative rounding slack between autograd's sum of a weight's gradients through the forward and ours.
_SUM_TOL = 1e-5
# Relative float32 slack between a batch's gradient and the sum of its rows' gradients computed apart.
_SPLIT_TOL = 1e-4
# Relative float32 slack of a summed gradient's norm against the bound the certified per-example bounds give it.
_SUM_CHECK_TOL = 1e-4
# Saved-tensor hooks that give the backward the forward's exact values: torch's save_on_cpu (a copy to host
# memory and back) and allow_mutation_on_saved_tensors (a clone before a mutation).
_VALUE_PRESERVING = {
    (("torch.autograd.graph", "save_on_cpu.__init__.<locals>.pack_to_cpu"),
     ("torch.autograd.graph", "save_on_cpu.__init__.<locals>.unpack_from_cpu")),
    (("torch.autograd.graph", "_swap_with_cloned.__init__.<locals>.pack_hook"),
     ("torch.autograd.graph", "_swap_with_cloned.__init__.<locals>.unpack_hook")),
}
_RECORD_ATTR = "_clipless_forward"
# Row digests: (weak reference, version, data pointer, digests) of the last few tensors digested, so that a
# forward on the very batch the loader handed out does not digest it again.
_RECENT_DIGESTS: List[Tuple[Any, int, int, torch.Tensor]] = []
_DIGEST_WEIGHTS: Dict[Tuple[int, int, int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
_DIGEST_SEED: List[int] = []  # this process's seed of the digest weights, drawn from OS entropy when first needed


def digest_seed() -> int:
    """The seed of this process's row-digest weights (from OS entropy, once)."""
    if not _DIGEST_SEED:
        _DIGEST_SEED.append(int.from_bytes(os.urandom(8), "little") >> 1)
    return _DIGEST_SEED[0]


def use_digest_seed(seed: int) -> None:
    """Take ``seed`` (another process's :func:`digest_seed`) for the row-digest weights, so that the ranks of a
    distributed run digest a record alike and can compare each other's digests.  Digests this process made with
    other weights no longer match new ones: call it before any is kept."""
    if _DIGEST_SEED and _DIGEST_SEED[0] == seed:
        return
    _DIGEST_SEED[:] = [int(seed)]
    _DIGEST_WEIGHTS.clear()
    _RECENT_DIGESTS.clear()


def _digest_weights(cols: int, bits: int, forms: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random ``(cols, forms)`` integer weights below ``2^bits`` (as float64) and odd int64 mixers, per process
    (:func:`digest_seed`) and the same on every device: a batch digested on the CPU (the loader's) and on a GPU
    (the forward's) must agree."""
    key = (cols, bits, forms, str(device))
    if key not in _DIGEST_WEIGHTS:
        host = (cols, bits, forms, "cpu")
        if host not in _DIGEST_WEIGHTS:
            generator = torch.Generator().manual_seed(digest_seed() ^ (cols * 1_000_003 + bits * 101 + forms))
            weights = torch.randint(0, 2**bits, (cols, forms), generator=generator).to(torch.float64)
            mixers = torch.randint(-2**62, 2**62, (forms,), dtype=torch.int64, generator=generator) * 2 + 1
            _DIGEST_WEIGHTS[host] = (weights, mixers)
        weights, mixers = _DIGEST_WEIGHTS[host]
        _DIGEST_WEIGHTS[key] = (weights.to(device), mixers.to(device))
    return _DIGEST_WEIGHTS[key]


def row_digests(x: torch.Tensor) -> torch.Tensor:
    """One int64 per row of ``x`` that depends only on the row's values: its bytes, read as integers ``b`` (8, 16
    or 32 bits), ``m`` random integer forms ``w . b``, mixed; a float64 row that float32 holds exactly is digested
    as float32 (a cast of the batch to a float64 model is the same record), integers and booleans as floats.  Each
    form is a float64 matrix product whose partial sums are integers below ``2^52``, hence exact in any summation
    order: equal rows get equal digests in any position or batch.  Two distinct rows agree on a form with
    probability at most ``2^-k`` (``k`` bits per weight, ``m k >= 32``)."""
    n = int(x.shape[0]) if x.dim() else 0
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    for ref, version, pointer, digests in _RECENT_DIGESTS:
        if ref() is x and x._version == version and x.data_ptr() == pointer:
            return digests
    flat = x.detach().contiguous().reshape(n, -1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(n, -1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if not flat.is_floating_point():  # integers by value: class 3 is the same label in int32, int64 or as 3.0
        wide = flat.to(torch.float64)
        if flat.element_size() < 8 or bool((wide.to(flat.dtype) == flat).all()):  # beyond 2^53: by bytes
            flat = wide
    if flat.dtype == torch.float64:
        single = flat.to(torch.float32)
        exact = (single.to(torch.float64) == flat).all(1)  # NaN is never exact: its row keeps its float64 bytes
        if bool(exact.all()):
            digests = _byte_digests(single)
        else:
            digests = _byte_digests(flat)
            if bool(exact.any()):
                digests[exact] = _byte_digests(single[exact])
    else:
        digests = _byte_digests(flat)
    _RECENT_DIGESTS.insert(0, (weakref.ref(x), x._version, x.data_ptr(), digests))
    del _RECENT_DIGESTS[4:]
    return digests


def _byte_digests(flat: torch.Tensor) -> torch.Tensor:
    """:func:`row_digests` of the rows of a 2-D tensor (no booleans), from their bytes."""
    if flat.element_size() == 1:
        ints, magnitude = flat.view(torch.uint8), 8
    elif flat.element_size() >= 4 and flat.shape[1] * flat.element_size() // 4 <= 2**11:
        ints, magnitude = flat.view(torch.int32), 31  # short rows: half the values, 10 or more bits per weight
    else:
        ints, magnitude = flat.view(torch.int16), 15
    cols = ints.shape[1]
    bits = min(20, 52 - magnitude - math.ceil(math.log2(max(cols, 2))))
    if bits < 1:
        raise BoundError(f"rows of {cols} values are too long for exact row digests")
    weights, mixers = _digest_weights(cols, bits, -(-32 // bits), ints.device)
    forms = (ints.to(torch.float64) @ weights).to(torch.int64)  # exact integers
    return (forms * mixers).sum(1)  # int64 arithmetic wraps modulo 2^64


def batch_row_digests(batch: Any) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """``(per-row shape, row_digests)`` of each tensor of a (nested) batch with a leading batch dimension."""
    return [(tuple(leaf.shape[1:]), row_digests(leaf)) for leaf in tree_leaves(batch)
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and not leaf.is_sparse]


def rows_repeated(inputs: torch.Tensor, references: Sequence[torch.Tensor], k: int) -> bool:
    """Whether some row entered the forwards (``inputs``: their row digests) in more copies than ``k`` times
    the drawn batch holds it.  A row equal to a row of a reference tensor of the batch may appear ``k`` times
    its count there; any other row (a transformed one: normalized, augmented) ``k`` times the largest count of
    one row in the batch, since a row-wise function of the batch repeats a row no more often than the batch
    does unless it maps distinct records to the same row."""
    if inputs.numel() == 0:
        return False
    values, counts = torch.unique(inputs, return_counts=True)
    merged = [torch.unique(ref, return_counts=True) for ref in references if ref.numel()]
    largest = max((int(c.max()) for _, c in merged), default=1)
    matched = torch.zeros_like(counts)  # k times the row's largest count in a reference tensor, 0 if in none
    for known, known_counts in merged:
        where = torch.searchsorted(known, values).clamp_max(len(known) - 1)
        hit = known[where] == values
        matched = torch.where(hit, torch.maximum(matched, k * known_counts[where]), matched)
    allowed = torch.where(matched > 0, matched, torch.full_like(counts, k * largest))
    return bool((counts > allowed).any())


def undrawn_records(inputs: torch.Tensor, references: Sequence[torch.Tensor], records: Optional[torch.Tensor]) -> bool:
    """Whether a row that entered the forwards (``inputs``: their row digests) equals a training record
    (``records``: the sorted digests of the training set's rows) that no reference tensor of the drawn batch holds:
    a record the Poisson sampler did not draw for this step (a batch of another loader, a row taken by index)."""
    if records is None or records.numel() == 0 or inputs.numel() == 0:
        return False
    values = torch.unique(inputs)
    where = torch.searchsorted(records, values).clamp_max(len(records) - 1)
    undrawn = records[where] == values
    for ref in references:
        if ref.numel():
            undrawn &= ~torch.isin(values, ref)
    return bool(undrawn.any())


def rows_not_drawn(inputs: torch.Tensor, references: Sequence[torch.Tensor]) -> bool:
    """Whether a row that entered the forwards (``inputs``: their row digests) is in none of the reference tensors
    (the drawn batch's rows and the rows declared as made from them): a row the loop made without saying so."""
    if inputs.numel() == 0:
        return False
    values = torch.unique(inputs)
    known = torch.zeros_like(values, dtype=torch.bool)
    for ref in references:
        if ref.numel():
            known |= torch.isin(values, ref)
    return not bool(known.all())


def rows_beyond(inputs: torch.Tensor, reference: torch.Tensor, k: int) -> bool:
    """Whether some value of ``inputs`` is not in ``reference`` or is there more than ``k`` times as often as in
    ``reference`` (both digests)."""
    if inputs.numel() == 0:
        return False
    if reference.numel() == 0:
        return True
    values, counts = torch.unique(inputs, return_counts=True)
    known, known_counts = torch.unique(reference, return_counts=True)
    where = torch.searchsorted(known, values).clamp_max(len(known) - 1)
    allowed = torch.where(known[where] == values, k * known_counts[where], torch.zeros_like(counts))
    return bool((counts > allowed).any())


LOSS_WEIGHTS = ("the per-example losses entered the backward with weights other than one of these: 1 for every row "
                "(the sum), 1/n for every row of the step's n rows (the mean), 1/K for every row (the mean over each "
                "example's K augmented rows, summed), or each record's own weight column. Any other weights are set "
                "by the loop from the batch it sees (a scale, class weights, a weighted mean that divides by the "
                "batch's weights, max(), a top-k or trimmed sum, a selection by position), so one added record can "
                "move several examples' gradients, beyond the certified bound; backpropagate "
                "loss.per_example(model(x), y).sum() or .mean(), scale the step through the learning rate, and give "
                "class or sample weights in [0, 1] as a column of each record ((x, y, w) from the Dataset, "
                "(loss.per_example(model(x), y) * w).sum())")
# Relative float32 slack of a mean's or a 1/K weight against 1/n or 1/K: two roundings of a quotient
_WEIGHT_TOL = 2.0 ** -20


def allowed_uniform_weight(weight: float, rows: int, k: int) -> bool:
    """Whether every row's loss weight ``weight`` is the sum's ``1``, the mean's ``1/rows`` over the step's rows
    or ``1/k`` per augmented row (up to :data:`_WEIGHT_TOL`): each a constant or the step's own batch size, with
    which one record moves the released sum by at most its bound (the mean: ``2C/(n+1) <= C``)."""
    return abs(weight * k - 1.0) <= _WEIGHT_TOL or abs(weight * rows - 1.0) <= _WEIGHT_TOL


def largest_norm(x: torch.Tensor, bound: float) -> float:
    """Largest per-example L2 norm, exact enough to compare with ``bound``.

    Computed in the input's dtype first: a float32 norm of ``n`` entries has relative error below
    ``gamma_n = n u / (1 - n u)`` (``u = 2^-24``, Higham's bound for the sum of squares, halved by the root
    and doubled for safety), so if even ``norm (1 + gamma_n)`` is below the bound, no example exceeds it.
    Otherwise (or for long rows) it is recomputed in float64.
    """
    flat = x.flatten(1)
    if flat.shape[0] == 0:
        return 0.0
    if flat.dtype == torch.float32:
        nu = flat.shape[1] * 2.0**-24
        if nu < 0.01:
            approx = torch.linalg.vector_norm(flat, dim=1).max().item()
            if approx * (1 + 2 * nu / (1 - nu)) <= bound:
                return approx
    return torch.linalg.vector_norm(flat.double(), dim=1).max().item()


# the norm itself is never shown: error messages reach logs, and it is a statistic of a record
DATA_BOUND_REFUSAL = ("has a norm above the declared input_bound {bound:.6g}: the sensitivity would be wrong; clip the "
                      "data (InputNormClip) or raise input_bound")


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite: a finite sum implies finite entries (NaN and inf propagate), so the
    full check runs only when the sum is not finite (one pass in the common case)."""
    return not x.is_floating_point() or bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def above_data_bound(x: torch.Tensor, bound: float) -> bool:
    """Whether an example of ``x`` has a norm above ``bound`` by more than ``INPUT_BOUND_TOLERANCE`` relative (the
    bounds include that much): what the input guard refuses."""
    return x.shape[0] > 0 and largest_norm(x, bound) > bound * (1 + INPUT_BOUND_TOLERANCE)


def global_hooks_registered() -> bool:
    """Whether hooks registered for every module (``torch.nn.modules.module.register_module_*``) exist."""
    from torch.nn.modules import module as _module

    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)


# What nn.Module.__call__ reads through the instance: one set on it replaces the class's forward.
_CALL_ATTRIBUTES = ("forward", "_call_impl", "_wrapped_call_impl", "_compiled_call_impl")


def replaced_forward(module: nn.Module) -> Optional[str]:
    """The name of the call attribute set on ``module`` itself (``module.forward = ...``, ``module.compile()``),
    or ``None``: bounds and factored gradients describe the class's forward."""
    return next((k for k in _CALL_ATTRIBUTES if module.__dict__.get(k) is not None), None)


# What a module's class may not redefine: nn.Module's call path (which runs forward and the hooks) and its
# attribute lookup (which hands forward and the bounds their weights).
CLASS_CALL_PATH = ("__call__", "_call_impl", "_wrapped_call_impl", "__getattr__", "__getattribute__")


def redefined_call_path(module: nn.Module) -> Optional[str]:
    """The first of nn.Module's call path or attribute lookup that ``module``'s class redefines, or ``None``: a
    subclass whose ``__call__`` scales ``forward``'s output computes what neither its forward nor its bounds say."""
    cls = type(module)
    return next((k for k in CLASS_CALL_PATH if getattr(cls, k) is not getattr(nn.Module, k)), None)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks other than torch's value-preserving ones are active: they could hand the
    backward values other than the forward's."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # only the innermost pair applies
    return hooks is not None and tuple((h.__module__, h.__qualname__) for h in hooks) not in _VALUE_PRESERVING


def active_torch_mode() -> Optional[str]:
    """The name of the torch function or dispatch mode active now (``with MyMode(): ...``), or ``None``: a mode sees
    every operation of the forward or the backward and may return other values.  Torch's value-preserving ones
    are accepted: ``torch.device(...)`` and ``torch.set_default_device`` only choose where new tensors are made,
    ``torch.autograd.graph.allow_mutation_on_saved_tensors`` clones a saved tensor before it is changed in place."""
    if not (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()):
        return None  # the common case: two C calls
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    preserving = (DeviceContext, getattr(torch.autograd.graph, "_CloneArgBeforeMutateMode", DeviceContext))
    modes = list(_get_current_function_mode_stack()) + list(_get_current_dispatch_mode_stack())
    modes = [m for m in modes if type(m) not in preserving]
    return type(modes[0]).__name__ if modes else None


def _overriding_subclass(x: Any) -> Optional[str]:
    """Why an input of a ``torch.Tensor`` subclass with its own ``__torch_function__`` or ``__torch_dispatch__``
    could change the forward (each operation on it goes through its class first), or ``None``."""
    cls = type(x)
    if not isinstance(x, torch.Tensor) or cls is torch.Tensor:
        return None
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    # torch.Tensor's own, or torch's pass-through (nn.Parameter's): both compute the operation as it is
    plain = function in (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)
    if not plain or getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        return (f"the input was a {cls.__name__}, a torch.Tensor subclass whose own __torch_function__ or "
                "__torch_dispatch__ sees every operation of the forward; pass plain tensors")
    return None


def module_hooks(module: nn.Module) -> List[Any]:
    """The module's own forward/backward hooks, except the private step's guards (which only refuse)."""
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    hooks += list(module._backward_hooks.values()) + list(getattr(module, "_backward_pre_hooks", {}).values())
    return [h for h in hooks if not getattr(h, "is_clipless_guard", False)]


class _Detached:
    """What a deep copy of a guarded model holds instead of the guard: a copy is an ordinary model."""

    is_clipless_guard = True

    def __call__(self, *args: Any) -> None:
        return None


class _Guard:
    """A hook of ours: the bound engine accepts it (it only refuses, never changes values); a deep copy or a
    pickle of the model (``torch.save(model)``) gets an inert stand-in, never the guard's state of the batches."""

    is_clipless_guard = True

    def __deepcopy__(self, memo: Dict[int, Any]) -> _Detached:
        return _Detached()

    def __reduce__(self) -> Any:
        return (_Detached, ())


def check_precision(module: nn.Module, x: torch.Tensor) -> None:
    """The bounds are certified for float32/float64 arithmetic: a bfloat16 autocast forward was measured to give
    a per-example gradient 1.0006x its certified bound (``benchmarks/precision.py``), so reduced precision is
    refused wherever the output can reach a private step."""
    if torch.is_autocast_enabled(x.device.type):
        raise BoundError("the private model ran under torch.autocast: reduced-precision arithmetic can push a "
                         "per-example gradient past its certified bound; run the training forward outside autocast "
                         "(evaluation under torch.no_grad() in eval() mode may use it)")
    # dtype attributes, not is_floating_point(): a method call on a watched parameter dispatches through its
    # __torch_function__ (3x the cost on every forward)
    low = [t.dtype for t in (x, *module.parameters()) if t.dtype.is_floating_point and t.dtype not in _CERTIFIED_DTYPES]
    if low:
        raise BoundError(f"the private model's input or weights are {low[0]}: the per-example bounds are certified "
                         "for float32 or float64 arithmetic only; keep the model and its inputs in float32 or float64")
    # TF32 (10-bit mantissa) products: the same kind of rounding as bfloat16's, 8 times finer
    # (benchmarks/precision.py --device cuda measures it)
    device = x.device
    if device.type not in ("cpu", "cuda"):  # no known precision settings to read
        return
    if not ieee_matmul(device):
        raise BoundError(f"float32 matrix products on {device.type} are set to reduced precision (TF32 or "
                         "bfloat16 internals, torch.set_float32_matmul_precision or a backend's fp32_precision): the "
                         "per-example bounds are certified for IEEE float32; call "
                         "torch.set_float32_matmul_precision('highest') and leave fp32_precision at 'ieee' for "
                         "private training")
    if not ieee_convolutions(device) and _runs_convolutions(module):
        raise BoundError(f"float32 convolutions on {device.type} run in reduced precision (cuDNN's TF32 default on "
                         "CUDA): the per-example bounds are certified for IEEE float32; set "
                         "torch.backends.cudnn.conv.fp32_precision = 'ieee' (torch.backends.mkldnn.conv on the CPU) "
                         "for private training")


def _runs_convolutions(module: nn.Module) -> bool:
    """torch's convolutions, or a layer that declares it runs one (``runs_convolutions = True``)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) or getattr(m, "runs_convolutions", False)
               for m in module.modules())


_CERTIFIED_DTYPES = (torch.float32, torch.float64)


def _refuse_compile() -> None:
    """Raised eagerly, outside the compiled frame (which cannot raise it itself): the guards watch eager operations.
    ``torch.compiler.disable`` is applied here, where dynamo is running, not at import: it would import dynamo
    (2 s) into every run."""
    torch.compiler.disable(_compile_refusal)()


def _compile_refusal() -> None:
    raise BoundError("the private model runs under torch.compile: the step guard and the input checks watch eager "
                     "operations, so a compiled forward is not supported; train the private model eagerly (compile "
                     "the trained model for inference, e.g. after clipless.export)")


# The data-bound check accepts norms up to input_bound (1 + this): data normalized to the bound in float32 has
# float64 norms a few units of 2^-24 above it.  The bounds then use that raised X_0 (resolve_input_bound).
INPUT_BOUND_TOLERANCE = 1e-6


class InputGuard(DeclaredConstants, _Guard):
    """Forward pre-hook that refuses inputs the privacy analysis does not cover.

    Wrong per-example shape or NaN/inf values always raise.  A norm above the declared data bound (by more
    than ``INPUT_BOUND_TOLERANCE`` relative, which the bounds include) raises on every forward whose output
    can reach a private step: in training mode, and whenever autograd records the forward (an ``eval()``-mode
    forward with gradients can still be backpropagated and released).  Only no-grad evaluation in ``eval()``
    mode is left unchecked.
    """

    # the bound every batch is checked against (None would switch the check off)
    constants = ("input_shape", "data_bound")

    def __init__(self, model: nn.Module, input_shape: Sequence[int], data_bound: Optional[float]) -> None:
        self.input_shape = tuple(input_shape)
        self.data_bound = data_bound
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() and (module.training or torch.is_grad_enabled()):
            _refuse_compile()
        if not args or not isinstance(args[0], torch.Tensor):
            raise BoundError("the private model takes one tensor input")
        x = args[0]
        if tuple(x.shape[1:]) != self.input_shape:
            raise BoundError(f"input of per-example shape {tuple(x.shape[1:])}, expected {self.input_shape}")
        # A finite sum implies finite entries (NaN and inf propagate); only a non-finite sum needs the full check.
        if not all_finite(x):
            raise BoundError("input contains NaN or infinite values")
        checked = module.training or torch.is_grad_enabled()
        if checked:
            check_precision(module, x)
        if checked and self.data_bound is not None and above_data_bound(x, self.data_bound):
            raise BoundError(f"an input of the batch {DATA_BOUND_REFUSAL.format(bound=self.data_bound)}")

    def attached(self) -> bool:
        """Whether this hook still checks every forward of the model (``handle.remove()`` or a cleared hook dict
        would leave the data bound, the precision and the compile checks undone)."""
        hooks = self.handle.hooks_dict_ref()
        return hooks is not None and hooks.get(self.handle.id) is self


class _ForwardRecord:
    """One gradient-recording forward of the private model, until its backward reaches the output."""

    __slots__ = ("guard", "epoch", "snapshot", "loss_grad", "losses", "backpropagated", "hooked", "changed", "digests",
                 "labels", "task", "entry", "calls", "loss_changed")

    def __init__(self, guard: "StepGuard", epoch: int, snapshot: List[torch.Tensor], hooked: Optional[str],
                 digests: Optional[torch.Tensor], changed: Optional[str] = None,
                 entry: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        self.guard, self.epoch, self.snapshot = guard, epoch, snapshot
        self.entry = entry  # the forward's input and a copy of it as the forward read it, or None
        self.hooked = hooked  # why the forward may not compute what the bounds describe (hooks), or None
        self.changed = changed  # why the model at the forward differs from the bounds' (a constant, a buffer), or None
        self.digests = digests  # row_digests of the forward's input
        self.labels: Optional[torch.Tensor] = None  # row_digests of the targets its loss was given, row for row
        self.task: Optional[int] = None  # the backward that last went through the output
        self.loss_grad: Optional[torch.Tensor] = None
        self.losses: List[Any] = []  # the clipless losses applied to this output
        self.calls: List[_LossCall] = []  # each with its weights and what the step needs to compute its rows alone
        self.loss_changed: Optional[str] = None  # why a loss applied is not the one the bounds were computed for
        self.backpropagated = False

    def add_loss_grad(self, grad: torch.Tensor) -> None:
        self.loss_grad = grad if self.loss_grad is None else self.loss_grad + grad


class _Tap(torch.autograd.Function):
    """Identity whose backward hands the incoming gradient to ``seen``.  A node of the graph rather than a tensor
    hook: it runs after every hook a user puts on the tensor (such a hook could rescale the gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: Callable[[torch.Tensor], Any]) -> torch.Tensor:  # type: ignore
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.seen(grad)
        return grad, None


def loss_state(loss: Any) -> Tuple[Tuple[str, Any], ...]:
    """What a loss computes with besides its input: its class, every value its instance holds (declared constants
    and other attributes, copied), its parameters and buffers, its sub-modules' states, and the plain values its
    classes define; compared with :func:`same_loss_state`."""
    items: List[Tuple[str, Any]] = [("class", type(loss))]
    for name, value in sorted(vars(loss).items()):
        if name == "training" or (name.startswith("_") and isinstance(value, (dict, set))):
            continue  # torch's module bookkeeping (hooks, parameter and module tables, read below)
        items.append((name, _copied(value)))
    if isinstance(loss, nn.Module):
        items += [(f"tensor {name}", t.detach().clone()) for name, t in loss.named_parameters(recurse=False)]
        items += [(f"tensor {name}", t.detach().clone()) for name, t in loss.named_buffers(recurse=False)]
        items += [(f"module {name}", loss_state(child)) for name, child in loss.named_children()]
    for cls in type(loss).__mro__:
        if cls in (nn.Module, object):
            continue
        items += [(f"{cls.__name__}.{name}", _copied(value)) for name, value in sorted(vars(cls).items())
                  if not name.startswith("_") and isinstance(value, (bool, int, float, str, tuple, torch.Tensor))]
    return tuple(items)


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    try:
        return copy.deepcopy(value)  # a list or array edited in place must not change the snapshot with it
    except Exception:
        return value


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    try:
        return a is b or bool(a == b)
    except Exception:  # values without a plain equality (arrays): only the same object is the same
        return False


def same_loss_state(a: Tuple[Tuple[str, Any], ...], b: Tuple[Tuple[str, Any], ...]) -> bool:
    """Whether two :func:`loss_state` snapshots hold the same class and values."""
    return len(a) == len(b) and all(na == nb and _same_value(va, vb) for (na, va), (nb, vb) in zip(a, b))


LOSS_CHANGED = ("the backward came from another loss than the one given to make_private (another class, or other "
                "constants or attributes: a temperature, a scale or a class weight set in the loop, perhaps from "
                "the batch, makes every example's loss depend on the other examples); use the loss given to "
                "make_private, or an equal copy, unchanged")
LOSS_COUPLED = ("the per_example of the loss {name} couples the examples of a batch: the gradient it sent to a row "
                "of the model's output is not that of the row's loss computed alone, a batch of one (a mean, a "
                "normalization or a scale over the batch, or a loss that cannot compute one example alone): one "
                "added record then moves every example's gradient, beyond the certified bound; compute each "
                "example's loss from its own output and target only")


def _defined_outside(obj: Any) -> bool:
    """Whether ``obj``'s class is defined outside clipless and torch: a user's loss or layer, whose forward no
    test of ours has shown to compute each example from its own values alone (the step recomputes it)."""
    return type(obj).__module__.partition(".")[0] not in ("clipless", "torch")


class _LossCall:
    """One clipless loss applied to a guarded output: what the step needs to compute its rows alone."""

    __slots__ = ("loss", "row", "z", "target", "batched", "weights")

    def __init__(self, loss: Any, row: Optional[Callable[[torch.Tensor, Any], torch.Tensor]], z: torch.Tensor,
                 target: Any, batched: bool) -> None:
        self.loss, self.row, self.z, self.target, self.batched = loss, row, z, target, batched
        self.weights: Optional[torch.Tensor] = None  # the weights its per-example values entered the backward with


def _row_gradients(call: _LossCall) -> torch.Tensor:
    """Each row's gradient of ``call``'s loss at its output row, computed on that row alone (a batch of one)."""
    row = call.row
    if row is None:
        raise BoundError(LOSS_COUPLED.format(name=type(call.loss).__name__))

    def one(zi: torch.Tensor, ti: Any) -> torch.Tensor:
        return row(zi.unsqueeze(0), ti.unsqueeze(0) if call.batched else ti).sum()

    with torch.enable_grad():
        try:
            dims = (0, 0 if call.batched else None)
            return torch.func.vmap(torch.func.grad(one), in_dims=dims)(call.z, call.target)
        except Exception:  # user code vmap cannot run (.item(), data-dependent branches): one row at a time
            pass
        grads = []
        try:
            for i in range(call.z.shape[0]):
                zi = call.z[i].detach().clone().requires_grad_(True)
                value = one(zi, call.target[i] if call.batched else call.target)
                (g,) = torch.autograd.grad(value, zi, allow_unused=True)
                grads.append(torch.zeros_like(zi) if g is None else g)
        except Exception as err:
            raise BoundError(LOSS_COUPLED.format(name=type(call.loss).__name__)
                             + f" (on one example alone it raised {type(err).__name__})") from None
        return torch.stack(grads) if grads else torch.zeros_like(call.z)


def coupled_loss(calls: Sequence[_LossCall], grad: torch.Tensor) -> Optional[str]:
    """Why the output gradient ``grad`` is not the sum over ``calls`` of each row's weight times the gradient of
    its loss on that row alone (up to :data:`_LOGIT_GRAD_TOL` relative), or ``None``."""
    expected = torch.zeros_like(grad, dtype=torch.float64)
    for call in calls:
        if call.weights is None:
            continue
        h = _row_gradients(call).to(grad.device, torch.float64).reshape(grad.shape)
        expected += call.weights.to(grad.device, torch.float64).view(-1, *[1] * (grad.dim() - 1)) * h
    got = grad.detach().double()
    diff = torch.linalg.vector_norm((got - expected).flatten(1), dim=1)
    scale = torch.maximum(torch.linalg.vector_norm(got.flatten(1), dim=1),
                          torch.linalg.vector_norm(expected.flatten(1), dim=1))
    if bool((diff > _LOGIT_GRAD_TOL * scale).any()):
        custom = next((c.loss for c in calls if _defined_outside(c.loss)), calls[0].loss)
        return LOSS_COUPLED.format(name=type(custom).__name__)
    return None


def tap_loss(loss: Any, logits: torch.Tensor, per_example: Callable[[torch.Tensor], torch.Tensor],
             target: Any = None, row: Optional[Callable[[torch.Tensor, Any], torch.Tensor]] = None) -> torch.Tensor:
    """``per_example(logits)`` of the clipless ``loss``, watched by the step guard when ``logits`` is a guarded
    model's output (``target``: the labels, one row per example, digested for the step's row checks; ``row(z, t)``:
    the loss's own ``per_example``, with which the step computes a custom loss's rows one at a time).  Called by
    every :class:`~clipless.privacy.modules.LipschitzLoss`; one attribute look-up otherwise.
    """
    record = getattr(logits, _RECORD_ATTR, None)
    if record is None or not logits.requires_grad:
        return per_example(logits)
    record.losses.append(loss)
    reference = record.guard.loss_reference
    if reference is not None and record.loss_changed is None and not same_loss_state(loss_state(loss), reference):
        record.loss_changed = LOSS_CHANGED
    # the labels as the loss reads them, one row per example: for the step's row checks and the weights' below
    rows = target.detach().clone() if isinstance(target, torch.Tensor) and target.dim() >= 1 and \
        target.shape[0] == logits.shape[0] else None
    if rows is not None and record.digests is not None:
        record.labels = row_digests(rows)
    batched = rows is not None and isinstance(target, torch.Tensor)
    call = _LossCall(loss, row, logits.detach().clone(), rows if batched else target, batched)
    record.calls.append(call)
    values = per_example(_Tap.apply(logits, record.add_loss_grad))  # the gradient the loss sends to the logits
    if values.dim() != 1 or values.shape[0] != logits.shape[0]:
        # the shape without the batch size: a Poisson batch's size is secret
        raise BoundError("a clipless loss must return one value per example, got "
                         + (f"per-example shape {tuple(values.shape[1:])}" if values.dim() > 1 else
                            "a scalar" if values.dim() == 0 else "another number of values than of examples"))
    # the weight each loss enters the gradient with: checked at the step against the step's rows
    return _Tap.apply(values, lambda weights: record.guard._loss_weights(weights, record, call))


_WATCH_ATTR = "_clipless_watch"
_ACCESSORS = ("__get__", "__set__")  # attribute reads (shape, grad, ...): no operation on the values
# ... except the properties that are differentiable views of the values: ``W.T`` is an operation on ``W`` as ``W.t()``
_VIEW_PROPERTIES = frozenset(("T", "mT", "H", "mH", "real", "imag"))


def _operates_on_values(func: Any) -> bool:
    """Whether ``func`` (as ``__torch_function__`` receives it) computes from a tensor's values under autograd."""
    name = getattr(func, "__name__", "")
    if name not in _ACCESSORS:
        return True
    return name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_PROPERTIES


_WEIGHT_USED = "a weight of the private model was used outside the model's forward"


class _WatchedParameter(nn.Parameter):
    """A guarded model's parameter: an ``nn.Parameter`` that reports to its step guard every autograd-recorded
    operation on it made outside the model's forward (the gradient of such a use bypasses the bounds).

    Values, gradients, ``state_dict`` and optimizers are those of a plain parameter: operations run on the
    plain tensor and return plain tensors (as ``nn.Parameter``'s own ``__torch_function__`` does).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        outside: List[StepGuard] = []
        if torch.is_grad_enabled() and _operates_on_values(func):
            def route(arg: Any) -> Any:
                ref = getattr(arg, _WATCH_ATTR, None) if isinstance(arg, _WatchedParameter) else None
                guard = ref() if ref is not None else None
                if guard is None or guard._paused:
                    return arg
                if guard._inside and not torch._C._are_functorch_transforms_active():
                    return guard._gate(arg)
                outside.append(guard)
                return arg
            args, kwargs = tree_map(route, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if outside:
            guard, name = outside[0], getattr(func, "__name__", str(func))
            for t in tree_leaves(out):  # a result that a backward could go through (never the leaf itself)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(lambda grad, g=guard, n=name: g._weight_used_outside(n))
        return out

    def __deepcopy__(self, memo: Dict[int, Any]) -> nn.Parameter:  # a copy is an ordinary parameter
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled (torch.save of a whole model) as a plain parameter
        return nn.Parameter, (self.data, self.requires_grad)


@contextlib.contextmanager
def unwatched(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """The watched ``params`` as plain parameters inside: the private step's own work (bounds, noise, the inner
    optimizer, projection) records no autograd graph a user's backward could go through, so it need not pay the
    per-operation report."""
    watched = [p for p in params if type(p) is _WatchedParameter]
    for p in watched:
        p.__class__ = nn.Parameter
    try:
        yield
    finally:
        for p in watched:
            p.__class__ = _WatchedParameter


def _refuse_outside_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every optimizer's step pre-hook (registered by the first step guard): a guarded parameter is stepped only
    by its private optimizer, inside which it is plain (:func:`unwatched`).  Anything else (the optimizer given to
    ``make_private`` kept under its old name, a second optimizer) would apply a gradient without noise."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is _WatchedParameter and getattr(p, _WATCH_ATTR, lambda: None)() is not None:
                raise BoundError(
                    f"{type(optimizer).__name__}.step() on the private model's parameters outside the private "
                    "optimizer: the gradient it applies has no noise; step the optimizer make_private returned "
                    "(model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, ...))")


_STEP_HOOK: List[Any] = []  # the handle of the one global hook


# Optimizers choose their multi-tensor kernels by exact parameter type; the watched parameter is a plain one there.
_OPTIM = importlib.import_module("torch.optim.optimizer")
_FOREACH_TYPES = getattr(_OPTIM, "_foreach_supported_types", None)
if isinstance(_FOREACH_TYPES, list) and _WatchedParameter not in _FOREACH_TYPES:
    _FOREACH_TYPES.append(_WatchedParameter)


def backward_pass_id() -> int:
    """The running backward pass (autograd graph task; -1 outside one), as ``torch.utils.checkpoint`` reads it."""
    return torch._C._current_graph_task_id()


class StepGuard:
    """Follows the private model's forwards to their backward; :meth:`check_step` refuses slips (module doc)."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], params: Sequence[torch.Tensor],
                 loss: Any, loss_lipschitz: Callable[[], float], rows_per_example: int = 1,
                 model_changed: Callable[[], Optional[str]] = lambda: None,
                 before_release: Callable[[], None] = lambda: None) -> None:
        """``layers``/``params``: the model's bounded layers and their parameters; ``loss_lipschitz()``: the
        ``L`` of the bounds (every clipless loss applied must declare at most that; ``loss`` names it).
        ``rows_per_example`` ``K``: each example enters the forward as up to ``K`` rows (augmentation
        multiplicity), so each row's loss may weigh at most ``1/K``: whatever rows belong to one example,
        their weights sum to at most 1 and the example's gradient stays within the per-example bound.
        ``model_changed()``: why the model differs from what the step's bounds will describe (a constant, a buffer),
        or None; asked at each forward, whose backward is then refused.  ``before_release()``: run before the model's
        ``state_dict()`` and before a pickle of the model (``torch.save(model)``) release its weights (it refuses a
        model that is not as the last step released it)."""
        self.params = tuple(params)
        self.rows_per_example = int(rows_per_example)
        self.sum_check = True  # check_sums on (the white-box step audit turns it off to measure a wrong bound)
        self.loss_name = type(loss).__name__ if loss is not None else "loss"
        # the loss as given: every loss applied to the model's output must equal it (class, constants, attributes)
        self.loss_reference = None if loss is None else loss_state(loss)
        self.loss_lipschitz = loss_lipschitz
        self.model_changed = model_changed
        self.before_release = before_release
        self.epoch = 0  # private steps released
        self._paused = 0
        self._inside = False
        self._warned_scale = False
        self._snapshot: Optional[List[torch.Tensor]] = None
        self.clear_gradient_state()
        self._handles = [
            model.register_forward_pre_hook(_ModelEnter(self)),
            model.register_forward_hook(_ModelLeave(self), always_call=True),
            model.register_state_dict_pre_hook(_ModelRelease(self)),
        ]
        names = {id(m): n for n, m in model.named_modules()}
        for layer in layers:
            if layer is not model and any(True for _ in layer.parameters(recurse=False)):
                self._handles.append(layer.register_forward_hook(_LayerCall(self, names.get(id(layer), "?"))))
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        self._watched = [p for p in self.params if type(p) in (nn.Parameter, _WatchedParameter)]
        self._gates: Dict[int, torch.Tensor] = {}  # id(weight) -> its gated alias in the running forward
        self._through: Dict[int, List[Tuple[torch.Tensor, int]]] = {}  # id(weight) -> gradients via the forward
        self._through_task = -1
        self._expected: Dict[int, Tuple[int, torch.Tensor]] = {}  # id(weight) -> (backward, .grad it must give)
        self._by_id = {id(p): p for p in self._watched}
        self._modules = list(model.modules())
        self._model = weakref.ref(model)
        self._split_rows = torch.Generator()  # which rows the step recomputes apart (custom layers)
        self._split_rows.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._hooked_at_entry: Optional[str] = None
        self._changed_at_entry: Optional[str] = None
        self._entry_digests: Optional[torch.Tensor] = None
        self._entry: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._forward: List[_ForwardRecord] = []
        # Row digests of the forwards' inputs are read only by the optimizer's check against a watched loader's
        # batch (DPOptimizer.watch_batches turns them on): without one they would be computed for nothing.
        self.digest_inputs = False
        param_names = {id(p): n for n, p in model.named_parameters()}
        for p in self._watched:
            hook = functools.partial(self._weight_grad, id(p), param_names.get(id(p), "?"))
            self._handles.append(p.register_hook(hook))  # the weight's whole incoming gradient, before accumulation
        if not _STEP_HOOK:
            _STEP_HOOK.append(_OPTIM.register_optimizer_step_pre_hook(_refuse_outside_step))
        for p in self._watched:
            p.__class__ = _WatchedParameter  # same object, same storage: only its operations are now seen
            setattr(p, _WATCH_ATTR, weakref.ref(self))

    def clear_gradient_state(self) -> None:
        """Forget the gradients' history (they were just cleared): a step needs a new backward."""
        self._checked: Dict[int, _ForwardRecord] = {}  # backward passes that went through the output correctly
        self._problems: Dict[int, str] = {}  # backward passes whose gradient must not be released, and why
        self._released: Dict[int, _ForwardRecord] = {}  # checked backward passes that reached the parameters
        self._accumulations: Dict[int, Tuple[torch.Tensor, int]] = {}  # id(param) -> (its grad, grad version)
        # backward -> (sum over its rows of ||output gradient|| / L, rows with a nonzero output gradient, rows)
        self._mass: Dict[int, Tuple[float, int, int]] = {}
        self._digests: Dict[int, List[torch.Tensor]] = {}  # backward -> row digests of the inputs of its forwards
        self._labels: Dict[int, List[Optional[torch.Tensor]]] = {}  # backward -> their loss targets' digests
        self._weights: Dict[int, List[Optional[torch.Tensor]]] = {}  # backward -> their forwards' loss weights
        # backward -> (loss calls, output gradient) of its forwards where a custom loss was applied
        self._row_checks: Dict[int, List[Tuple[List[_LossCall], torch.Tensor]]] = {}
        # backward -> (input as the forward read it, output gradient) of its forwards, where the model has custom
        # modules
        self._split_checks: Dict[int, List[Tuple[Optional[torch.Tensor], torch.Tensor]]] = {}
        self._violation: Optional[str] = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for p in self._watched:
            if getattr(p, _WATCH_ATTR, lambda: None)() is self:  # not when a newer guard of the model took it over
                delattr(p, _WATCH_ATTR)
                p.__class__ = nn.Parameter
        self._watched = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards and backwards inside are diagnostics (e.g. the tightness monitor), not part of a step."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- forward -------------------------------------------------------------
    def _enter(self, x: Any) -> None:
        self._inside = True
        self._gates = {}
        self._forward: List[_ForwardRecord] = []  # this forward's record, once made: its gates check against it
        stepping = not self._paused and torch.is_grad_enabled() and isinstance(x, torch.Tensor)
        self._entry_digests = row_digests(x) if stepping and self.digest_inputs else None
        # the backward reads the input again (the first layer saves it): kept to see a change made past autograd's
        # version counters (.data, a NumPy view), which would give the backward rows the input bound never saw
        self._entry = (x, x.detach().clone()) if stepping else None
        # hooks act from the forward on (a module's backward hooks are wired in at its call): one look, at entry
        self._hooked_at_entry = None if self._paused else self._hooked() or _overriding_subclass(x)
        # a compiled forward that could reach a step is refused by the input guard, which runs next
        self._changed_at_entry = None if self._paused or torch.compiler.is_compiling() else self.model_changed()

    def _hooked(self) -> Optional[str]:
        """Why hooks active now could make the forward or its backward differ from what the bounds describe."""
        if global_hooks_registered():
            return "global module hooks (torch.nn.modules.module.register_module_*) were registered"
        for module in self._modules:
            if module_hooks(module):
                return "a module of the private model had a forward or backward hook"
        if saved_tensor_hooks_active():
            return ("saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, torch.utils.checkpoint) were "
                    "active: the backward might not use the forward's values")
        mode = active_torch_mode()
        if mode is not None:
            return (f"a torch function or dispatch mode ({mode}) was active: it can change every operation of the "
                    "forward")
        return None

    def _gate(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as the model's forward uses it: one gate per weight and forward (see :meth:`_weight_grad`)."""
        gated = self._gates.get(id(weight))
        if gated is None:
            gated = self._gates[id(weight)] = _Tap.apply(
                weight, functools.partial(self._through_model, id(weight), self._forward))
        return gated

    def _leave(self, output: Any) -> Optional[torch.Tensor]:
        """The model's output, gated when a step could backpropagate it (the forward hook's replacement)."""
        self._inside = False
        self._gates = {}
        if self._paused or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
            return None
        if not output.requires_grad or torch._C._are_functorch_transforms_active():
            return None
        if self._snapshot is None or self._weights_differ(self._snapshot):
            self._snapshot = [p.detach().clone() for p in self.params]
        record = _ForwardRecord(self, self.epoch, self._snapshot, self._hooked_at_entry, self._entry_digests,
                                self._changed_at_entry, self._entry)
        self._forward.append(record)
        gated = _Tap.apply(output, functools.partial(self._output_grad, record))  # after the output's own hooks
        setattr(gated, _RECORD_ATTR, record)
        return gated

    def _weights_differ(self, snapshot: List[torch.Tensor]) -> bool:
        return any(not torch.equal(p.detach(), saved) for p, saved in zip(self.params, snapshot))

    # -- backward ------------------------------------------------------------
    def _problem(self, why: str) -> None:
        self._problems.setdefault(backward_pass_id(), why)

    def _loss_weights(self, weights: torch.Tensor, record: Optional[_ForwardRecord] = None,
                      call: Optional[_LossCall] = None) -> None:
        w = weights.detach().reshape(-1)
        if call is not None:
            call.weights = w.clone() if call.weights is None else call.weights + w
        if weights.numel() == 0:
            return
        largest = float(weights.abs().max())  # never shown: a mean's weight 1/|B| is a Poisson batch's secret size
        k = self.rows_per_example
        if k > 1:  # augmentation multiplicity: rows of one example share the weight 1
            if largest > (1 + 1e-6) / k:
                self._problem(f"a per-example loss entered the backward with weight above 1/K = {1 / k:.4g} "
                              f"(augmentation multiplicity K = {k}): the K rows of an example would together exceed "
                              "the certified bound; backpropagate the mean over the K rows of each example, summed "
                              "over the examples")
            elif largest < (1 - 1e-6) / k and not self._warned_scale:
                self._warned_scale = True
                warnings.warn("the per-example losses enter the backward with weights below 1/K: "
                              "this wastes privacy budget; backpropagate the mean over each example's K rows, summed",
                              stacklevel=2)
        elif largest > 1 + 1e-6:
            self._problem("a per-example loss entered the backward with weight above 1: its gradient would "
                          "exceed the certified bound; backpropagate loss.per_example(model(x), y).sum(), unscaled")
        elif largest < 1 - 1e-6 and not self._warned_scale:
            self._warned_scale = True
            warnings.warn(
                "the per-example losses enter the backward with weights below 1 (the mean): the "
                "noise is calibrated to the SUM of per-example gradients, so this wastes privacy "
                "budget; backpropagate loss.per_example(model(x), y).sum()", stacklevel=2)
        # after the checks of the largest weight, whose refusals name the weight; the step checks the rest
        if not bool((w == w[0]).all()) and (k > 1 or record is None or record.digests is None):
            self._problem(LOSS_WEIGHTS)  # uneven weights pass only as each drawn record's own, which needs digests

    def _output_grad(self, record: _ForwardRecord, grad: torch.Tensor) -> None:
        loss_grad, record.loss_grad = record.loss_grad, None
        losses, record.losses = record.losses, []
        twice, record.backpropagated = record.backpropagated, True
        record.task = backward_pass_id()
        lipschitz = self.loss_lipschitz()
        # the loss's constant checked below is read now: it must still be the bounds' (not raised for this backward)
        changed_now = None if self._paused else self.model_changed()
        mode_now = active_torch_mode()  # a mode around this backward acts on every operation of it
        norms = torch.linalg.vector_norm(grad.detach().flatten(1).double(), dim=1)  # each example's loss gradient
        largest = float(norms.max()) if norms.numel() else 0.0
        if record.epoch != self.epoch:
            why = "the backward of a forward made before the last private step: run the forward again on a new batch"
        elif twice:
            why = "a forward backpropagated twice: the batch's gradient would count twice; one backward per forward"
        elif record.hooked is not None:
            why = (f"during the private model's forward, {record.hooked}: the per-example bounds describe the model "
                   "without hooks or modes; remove them")
        elif mode_now is not None:
            why = (f"during the backward, a torch function or dispatch mode ({mode_now}) was active: it "
                   "can change every operation of the backward, which the per-example bounds describe without it; "
                   "run the backward outside it")
        elif record.changed is not None:
            why = f"at the private model's forward, {record.changed}"
        elif changed_now is not None:
            why = f"at the backward into the private model's output, {changed_now}"
        elif record.entry is not None and not torch.equal(record.entry[0].detach(), record.entry[1]):
            why = ("the forward's input batch was changed in place after the forward (through .data, a NumPy view or "
                   "its storage): the backward reads it again, so it would use rows the input bound never checked; "
                   "leave the batch as it is until the backward")
        elif loss_grad is None:
            why = ("the backward into the private model's output did not come from a clipless loss applied to that "
                   "output: backpropagate loss.per_example(model(x), y).sum()")
        elif record.loss_changed is not None:
            why = record.loss_changed
        elif any(float(loss.lipschitz) > lipschitz for loss in losses):
            why = (f"the backward came from a loss with a larger constant than the {self.loss_name} the bounds were "
                   "computed for; use the loss given to make_private")
        elif not bool(torch.isfinite(loss_grad).all()):
            why = ("the loss gradient at the private model's output is not finite (NaN or infinite outputs: a weight "
                   "set to NaN or inf by hand, or an overflow); no bound covers it: check the weights")
        elif not torch.equal(grad, loss_grad):
            why = ("the private model's output received gradient from outside its clipless loss: the per-example "
                   "bound assumes the loss is the only use of the output")
        elif largest > lipschitz * (1 + _LOGIT_GRAD_TOL):
            why = (f"an example's loss gradient has a norm above the loss constant L = {lipschitz:.6g} (the loss "
                   "declares a wrong constant): the certified bound does not cover it")
        elif self._weights_differ(record.snapshot):
            why = "the weights changed between the forward and its backward: the bounds are those of other weights"
        else:
            task = record.task
            self._checked[task] = record
            mass, nonzero, rows = self._mass.get(task, (0.0, 0, 0))
            self._mass[task] = (mass + float(norms.sum()) / lipschitz, nonzero + int((norms > 0).sum()),
                                rows + int(norms.numel()))
            # the losses applied to one output add up, row for row (None: no loss's weights were seen)
            seen = [call.weights for call in record.calls if call.weights is not None]
            self._weights.setdefault(task, []).append(sum(seen[1:], seen[0]) if seen else None)
            if any(_defined_outside(call.loss) for call in record.calls):
                self._row_checks.setdefault(task, []).append((record.calls, grad.detach().clone()))
            if self.custom_modules():
                entry = None if record.entry is None else record.entry[1]
                self._split_checks.setdefault(task, []).append((entry, grad.detach().clone()))
            if record.digests is not None:
                self._digests.setdefault(task, []).append(record.digests)
                self._labels.setdefault(task, []).append(record.labels)
            return
        self._problem(why)

    def _taint(self, name: str) -> None:
        task = backward_pass_id()
        if self._problems.get(task, "").startswith(_WEIGHT_USED):  # the layer's weights: name the layer instead
            del self._problems[task]
        self._problem(f"layer '{name}' of the private model was called outside the model's forward, and the backward "
                      "went through it: its gradient bypasses the privacy analysis; call the whole model")

    def _weight_used_outside(self, op: str) -> None:
        self._problem(f"{_WEIGHT_USED} ({op}), and the backward went through that use: its gradient bypasses the "
                      "privacy analysis; use the weights only through the model (a weight penalty: the optimizer's "
                      "weight_decay)")

    def _through_model(self, key: int, forward: List[_ForwardRecord], grad: torch.Tensor) -> None:
        task = backward_pass_id()
        if not forward or forward[0].task != task:
            # The output is reached first in a backward through it; a gate reached in a backward that never went
            # through this forward's output is a derivative of the model's own backward (create_graph=True).
            self._problem("a weight's gradient came through the backward of an earlier backward of the model (an "
                          "input-gradient or Jacobian penalty, torch.autograd.grad(..., create_graph=True)): no "
                          "bound covers such second derivatives; train on the clipless loss alone")
        if task != self._through_task:  # a new backward: what earlier ones sent is checked or was not accumulated
            self._through_task, self._through = task, {}
        self._through.setdefault(key, []).append((grad, grad._version))

    def _weight_grad(self, key: int, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """The weight's incoming gradient must be the sum of what its gates in the model's forward sent: a
        path that no operation reports (a custom ``autograd.Function`` applied to the weight outside the model)
        taints the backward, so nothing else can reach an accumulated gradient unseen."""
        if self._paused:
            return None
        if not all_finite(grad):
            self._problem(f"weight '{name}' of the private model got a gradient that is not finite (NaN or inf in the "
                          "backward: a layer's derivative divided by zero or overflowed); no bound covers it")
        parts = self._through.pop(key, []) if backward_pass_id() == self._through_task else []
        if parts and all(g._version == v for g, v in parts):  # a part changed in place no longer says what it sent
            sent = parts[0][0]
            for part, _ in parts[1:]:  # in arrival order, as autograd sums them
                sent = sent + part
            exact = grad is sent or torch.equal(grad, sent)
            if exact or float((grad - sent).abs().max()) <= _SUM_TOL * float(sent.abs().max()):
                weight = self._by_id[key]
                # checked again once accumulated: a hook that runs after this one must not change it
                self._expected[key] = (backward_pass_id(), sent if weight.grad is None else weight.grad + sent)
                return None if exact else sent  # beyond rounding of the sum, accumulate the forward's part exactly
        self._problem(f"weight '{name}' of the private model received gradient by a path outside the model's "
                      "forward (e.g. a custom torch.autograd.Function applied to the weight): its gradient bypasses "
                      "the privacy analysis; use the weights only through the model")
        return None  # left as it is (torch.autograd.grad diagnostics see it); accumulated, it refuses the step

    def _accumulated(self, param: torch.Tensor) -> None:
        task = backward_pass_id()
        backward, expected = self._expected.pop(id(param), (None, None))
        if backward == task and not (param.grad is expected or torch.equal(param.grad, expected)):
            self._problem("a weight's gradient was changed between its backward and its accumulation (a hook on the "
                          "weight): its sensitivity is not the bound's; remove the hook")
        # the gradient tensor and its version: one replaced or edited in place afterwards is not this one
        self._accumulations[id(param)] = (param.grad, param.grad._version)  # type: ignore[union-attr]
        if self._violation is not None:
            return
        if task in self._problems:
            self._violation = self._problems[task]
        elif task not in self._checked:
            self._violation = ("a gradient reached the parameters by a backward that did not go through the private "
                               "model's output and its clipless loss (a layer or weight used elsewhere)")
        else:
            self._released[task] = self._checked[task]

    # -- step ----------------------------------------------------------------
    def check_step(self, params: Sequence[torch.Tensor]) -> None:
        """Refuse to release ``params``' gradients unless they come from checked backwards of this step."""
        fix = "; call optimizer.zero_grad() and run the batch again"
        if self._violation is not None:
            raise BoundError(self._violation + fix)
        if not self._released:
            raise BoundError(
                "no backward of the private model since the last step: step() releases the gradient of one fresh "
                "Poisson batch; run loss.per_example(model(x), y).sum().backward() on the batch first (an empty "
                "batch too)")
        for p in params:
            grad, version = self._accumulations.get(id(p), (None, 0))
            if p.grad is not None and (p.grad is not grad or p.grad._version != version):
                raise BoundError("a parameter holds a gradient that no backward of this step produced, or one changed "
                                 "after its backward (set or scaled by hand): its sensitivity is not the bound's" + fix)
        for task in self._released:
            for calls, grad in self._row_checks.get(task, []):
                why = coupled_loss(calls, grad)
                if why is not None:
                    raise BoundError(why + fix)
        why = self._coupled_modules(params)
        if why is not None:
            raise BoundError(why + fix)
        for record in {id(r.snapshot): r for r in self._released.values()}.values():
            if self._weights_differ(record.snapshot):
                raise BoundError("the weights changed between the forward and the step: the noise would be calibrated "
                                 "to the bounds of other weights than the backward used; change weights only through "
                                 "the private optimizer" + fix)

    def custom_modules(self) -> List[str]:
        """Classes of the model's modules defined outside clipless and torch, whose forwards no test of ours has
        shown to compute each example from its own input alone."""
        model = self._model()
        if model is None:
            return []
        return sorted({type(m).__name__ for m in model.modules() if _defined_outside(m)})

    def _coupled_modules(self, params: Sequence[torch.Tensor]) -> Optional[str]:
        """With custom modules: the released gradient must equal the sum of the gradients of the step's rows
        computed apart (up to :data:`_SPLIT_TOL` relative): up to 8 rows drawn at random each alone, the rest
        together.  A module that reads the batch (a mean, a normalization, a gate over it) gives each row alone
        another output or gradient.  A test at the step's batch: it finds a coupling where it shows there."""
        checks = [c for task in self._released for c in self._split_checks.get(task, [])]
        model = self._model()
        if not checks or model is None:
            return None
        names = ", ".join(self.custom_modules()) or "custom"
        why = (f"the model's modules of classes defined outside clipless ({names}) couple the examples of a batch: "
               "the batch's gradient is not the sum of its rows' gradients computed apart (a batch statistic: a "
               "mean, a normalization or a gate over the batch; or randomness in the forward), so one added record "
               "moves every example's gradient, beyond the certified bound; compute each example from its own "
               "input alone")
        params = [p for p in params if p.requires_grad]
        expected = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        with paused_guards(model), torch.enable_grad():  # the recomputation's backwards count in no statistic
            for x, grad in checks:
                if x is None:
                    return why
                n = x.shape[0]
                order = torch.randperm(n, generator=self._split_rows).to(x.device)
                parts = [order[i:i + 1] for i in range(min(8, n))] + ([order[8:]] if n > 8 else [])
                for rows in parts:
                    out = model(x[rows])
                    if not isinstance(out, torch.Tensor) or out.shape != grad[rows].shape:
                        return why
                    got = torch.autograd.grad(out, list(params), grad[rows], allow_unused=True)
                    for e, g in zip(expected, got):
                        if g is not None:
                            e += g.double()
        for p, e in zip(params, expected):
            released = torch.zeros_like(e) if p.grad is None else p.grad.detach().double()
            scale = max(float(e.abs().max()), float(released.abs().max())) if e.numel() else 0.0
            if e.numel() and float((released - e).abs().max()) > _SPLIT_TOL * scale:
                return why
        return None

    def check_sums(self, report: Any) -> None:
        """What the bounds imply for the sum: a layer's summed gradient has norm at most ``m g``, ``g`` its
        per-example bound and ``m`` the sum over the released backwards' rows of ``||output gradient|| / L``
        (each row's gradient is linear in its output gradient), or the number of rows with a nonzero output
        gradient when a layer clips the per-example gradient (``report.gradient_capped``: a row's gradient is
        then within ``g`` only).  Only a changed backward (a hook put on an autograd node by hand, which nothing
        else sees) or a wrong declared bound can fail it; a necessary condition, not the guarantee."""
        if not self.sum_check:
            return
        masses = [self._mass.get(task, (0.0, 0, 0)) for task in self._released]
        mass = float(sum(nonzero for _, nonzero, _ in masses)) if report.gradient_capped else sum(
            m for m, _, _ in masses)
        for layer in report.layers:
            norm = math.sqrt(sum(float(torch.linalg.vector_norm(p.grad.double())) ** 2
                                 for p in layer.params if p.grad is not None))
            if norm > mass * layer.bound * (1 + _SUM_CHECK_TOL):
                raise BoundError(  # without the norms: they are un-noised statistics of the batch
                    f"layer '{layer.name}': the summed gradient has a norm above what the batch's examples can have "
                    f"under the certified per-example bound {layer.bound:.6g}: the backward was changed (a hook on an "
                    "autograd node?) or the layer declares a wrong bound; call optimizer.zero_grad() and run the "
                    "batch again")

    def released_backward_passes(self) -> Tuple[int, ...]:
        """The backward passes (:func:`backward_pass_id`) whose gradients this step releases."""
        return tuple(self._released)

    def released_rows(self) -> int:
        """Rows of the private model's output whose backward this step releases (micro-batches summed)."""
        return sum(self._mass.get(task, (0.0, 0, 0))[2] for task in self._released)

    def released_digests(self) -> torch.Tensor:
        """Row digests of the inputs of the forwards whose backward this step releases (micro-batches joined)."""
        parts = [d for task in self._released for d in self._digests.get(task, [])]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _released_rows_with(self, per_task: Dict[int, List[Any]]) -> Iterator[Tuple[torch.Tensor, Any]]:
        """``(input row digests, entry)`` of each released forward, with its entry of ``per_task``."""
        for task in self._released:
            yield from zip(self._digests.get(task, []), per_task.get(task, []))

    @staticmethod
    def _joined(parts: List[Tuple[torch.Tensor, torch.Tensor]],
                empty: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The row digests and the entries of ``parts``, each concatenated (``empty`` entries without parts)."""
        if not parts:
            return torch.zeros(0, dtype=torch.int64), empty
        return torch.cat([d for d, _ in parts]), torch.cat([t.to(d.device) for d, t in parts])

    def released_labelled_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Row digests of the inputs and of the loss targets, row for row, of the released forwards whose loss was
        given one target row per example."""
        parts = [(d, t) for d, t in self._released_rows_with(self._labels) if t is not None]
        return self._joined(parts, torch.zeros(0, dtype=torch.int64))

    def released_loss_weights(self) -> List[Optional[torch.Tensor]]:
        """The weights each released forward's losses entered the backward with, row for row (``None``: none
        seen)."""
        return [w for task in self._released for w in self._weights.get(task, [])]

    def released_weighted_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Row digests of the inputs and the loss weights, row for row, of the released forwards (all of them, or
        empty ones where a forward has no digests or no weights)."""
        parts = list(self._released_rows_with(self._weights))
        if len(parts) != len(self.released_loss_weights()) or any(w is None for _, w in parts):
            parts = []
        return self._joined(parts, torch.zeros(0))

    def finish_step(self, params: Sequence[torch.Tensor], weights: Optional[List[torch.Tensor]] = None) -> None:
        """After a released step: clear the gradients and start the next step.  ``weights``: copies of
        ``self.params`` as released, which the next forward compares with instead of copying them again."""
        for p in params:
            p.grad = None
        self.epoch += 1
        self._snapshot = weights
        self.clear_gradient_state()


class _Hook(_Guard):
    """A module hook of a step guard."""

    def __init__(self, guard: StepGuard) -> None:
        self.guard = guard


class _ModelEnter(_Hook):
    def __call__(self, module: nn.Module, args: Any) -> None:
        self.guard._enter(args[0] if args else None)


class _ModelLeave(_Hook):
    def __call__(self, module: nn.Module, args: Any, output: Any) -> Optional[torch.Tensor]:
        return self.guard._leave(output)


class _ModelRelease(_Hook):
    """Before the model's ``state_dict()`` or a pickle of the model: a weight changed since the last step (a last
    update by hand after the loop) would be released with it, outside every step's checks."""

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self.guard._paused:
            self.guard.before_release()

    def __reduce__(self) -> Any:
        self.guard.before_release()
        return super().__reduce__()


class _LayerCall(_Hook):
    """Forward hook on each trainable layer: a backward through a call outside the model's forward is refused."""

    def __init__(self, guard: StepGuard, name: str) -> None:
        super().__init__(guard)
        self.name = name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        guard = self.guard
        if guard._inside or guard._paused or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        output.register_hook(lambda grad: guard._taint(self.name))


@contextlib.contextmanager
def paused_guards(model: nn.Module) -> Iterator[None]:
    """Pause the step guards of ``model`` and the counting of its per-step mechanisms (``counting_paused``: an
    adaptive clip's count): the forwards and backwards inside are diagnostics, not part of a step."""
    guards = [h.guard for h in model._forward_hooks.values() if isinstance(h, _ModelLeave)]
    with contextlib.ExitStack() as stack:
        for guard in guards:
            stack.enter_context(guard.paused())
        for m in model.modules():  # by name: the mechanisms' base class (modules.py) imports this module
            if callable(getattr(m, "counting_paused", None)):
                stack.enter_context(m.counting_paused())
        yield
