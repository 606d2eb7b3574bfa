"""Backpropagation for bounds (spec §2): per-example gradient bounds of every layer.

Every leaf layer declares, for an input-norm bound ``X``, a :class:`LayerBound`:
its Lipschitz constant ``l`` (certified for the current weights), an output-norm
bound, and for each parameter tensor a factor ``c`` such that the per-example
gradient of that tensor satisfies ``||grad|| <= G_out * c`` whenever the
gradient of the loss w.r.t. the layer output has norm ``<= G_out``.
The engine runs

    X_d = out_bound_d(X_{d-1})                  (forward)
    g_d = G_d * c_d + 2^-64                     (per parameter tensor; the term covers float32 underflow)
    G_{d-1} = l_d * min(G_d, cap_d)             (backward)

over ``nn.Sequential`` and :class:`~clipless.privacy.modules.Residual` graphs, starting
from ``G_D = L`` (loss Lipschitz constant w.r.t. the logits).  The bound ``g_d``
of a layer is the root-sum-square of its tensors' bounds; it is the
add/remove sensitivity of that layer's summed gradient.
"""

from __future__ import annotations

import builtins
import functools
import math
import os
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from .certified import UNDERFLOW_MARGIN, BoundError, DeclaredConstants, is_whole
from .input_guard import (CLASS_CALL_PATH, _defined_outside, global_hooks_registered, module_hooks,
                          redefined_call_path, replaced_forward)
from .modules import BoundedModule, LayerBound, PerStepMechanism, Residual

__all__ = ["LayerSensitivity", "BoundReport", "BoundEngine", "torch_layer_bound", "check_input_shape",
           "plain_tensors"]

# Stateless torch layers whose constants are exact: l = 1 and ||f(x)|| <= ||x||.
_PARAMETER_FREE_1LIP: Tuple[type, ...] = (nn.Flatten, nn.Unflatten, nn.Identity, nn.ReLU)

# sup of GELU' = Phi(x) + x phi(x), at x = sqrt(2) where GELU'' = phi(x)(2 - x^2) vanishes (sqrt(2) phi(sqrt 2) =
# e^-1 / sqrt(pi)); the 1e-6 covers the float64 evaluation here and the float32 rounding of the backward's own.
_GELU_LIPSCHITZ = (0.5 * (1.0 + math.erf(1.0)) + math.exp(-1.0) / math.sqrt(math.pi)) * (1 + 1e-6)


def _silu_lipschitz() -> float:
    """sup of SiLU' = s(x)(1 + x(1 - s(x))), s the sigmoid: SiLU'' = s(1 - s)(2 - x tanh(x/2)) vanishes only where
    x tanh(x/2) = 2 (increasing in |x|), at x* = 2.3994 (the max; at -x* the min, -0.0998); x* by bisection."""
    lo, hi = 2.0, 3.0  # 2 tanh(1) < 2 < 3 tanh(1.5)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mid * math.tanh(0.5 * mid) < 2.0 else (lo, mid)
    sig = 1.0 / (1.0 + math.exp(-lo))
    return sig * (1.0 + lo * (1.0 - sig)) * (1 + 1e-6)  # 1.09984: the 1e-6 as for GELU


_SILU_LIPSCHITZ = _silu_lipschitz()


def _replacement(module: nn.Module) -> str:
    """What to use instead of a torch layer that declares no bounds (empty for a layer of the user's own)."""
    if isinstance(module, nn.Linear):
        return "use LipschitzLinear"
    if isinstance(module, nn.Conv2d):
        return "use LipschitzConv2d or OrthogonalConv2d"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "remove it: batch statistics mix the examples; LayerCentering centres each example alone"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)):
        return "remove it: its division by a per-example deviation has no finite constant; LayerCentering centres"
    if isinstance(module, (nn.modules.dropout._DropoutNd, nn.AlphaDropout)):
        return "remove it: training-mode dropout rescales by 1/(1-p)"
    if isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                           nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)):
        return "use L2NormPool2d or ScaledAvgPool2d"
    if type(module).__module__ == nn.ReLU.__module__:  # torch's activations
        return "use an activation with a certified constant: MaxMin, GroupSort, ReLU, Tanh, GELU, SiLU, ELU, ..."
    return ""


def _undeclared_error(layers: Sequence[Tuple[str, nn.Module]]) -> BoundError:
    """One refusal naming every layer without declared bounds (at most eight), each with what to use instead."""
    def entry(name: str, module: nn.Module) -> str:
        fix = _replacement(module)
        return f"'{name}' ({type(module).__name__}{': ' + fix if fix else ''})"

    shown = ", ".join(entry(*layer) for layer in layers[:8])
    if len(layers) > 8:
        shown += f" and {len(layers) - 8} more"
    what = f"layer {shown} declares" if len(layers) == 1 else f"{len(layers)} layers declare"
    listed = "" if len(layers) == 1 else f" ({shown})"
    convertible = any(isinstance(m, (nn.Linear, nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)) for _, m in layers)
    hint = "; clipless.to_lipschitz(model) replaces torch's Linear, Conv2d and pooling layers" if convertible else ""
    return BoundError(f"{what} no Lipschitz/gradient bounds{listed}; use the clipless layers (LipschitzLinear, "
                      "LipschitzConv2d, MaxMin, ...) or subclass clipless.BoundedModule and implement layer_bound()"
                      f"{hint}")


def _activation_constants(module: nn.Module) -> Optional[Tuple[float, float, float]]:
    """``(l, m, c)`` of an elementwise torch activation (exact type): ``|f'| <= l``, ``|f(x) - c| <= m |x|``,
    ``c = f(0)``; ``None`` for any other layer, or settings without a finite constant."""
    kind = type(module)
    if kind in (nn.Tanh, nn.Softsign, nn.Tanhshrink):
        return 1.0, 1.0, 0.0
    if kind is nn.Sigmoid:  # sigma' = sigma (1 - sigma) <= 1/4
        return 0.25, 0.25, 0.5
    if kind in (nn.Hardtanh, nn.ReLU6):  # a clamp to [min_val, max_val]
        lo, hi = float(module.min_val), float(module.max_val)  # type: ignore[arg-type]
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            return None
        return 1.0, 1.0, min(max(0.0, lo), hi)
    if kind is nn.LeakyReLU:
        slope = abs(float(module.negative_slope))  # type: ignore[arg-type]
        return (max(1.0, slope),) * 2 + (0.0,) if math.isfinite(slope) else None
    if kind is nn.ELU:  # alpha e^x for x < 0, and |alpha (e^x - 1)| <= |alpha| |x|
        alpha = abs(float(module.alpha))  # type: ignore[arg-type]
        return (max(1.0, alpha),) * 2 + (0.0,) if math.isfinite(alpha) else None
    if kind is nn.CELU:  # e^(x / alpha) <= 1 for x < 0 when alpha > 0; unbounded for alpha < 0
        alpha = float(module.alpha)  # type: ignore[arg-type]
        return (1.0, 1.0, 0.0) if alpha > 0 and math.isfinite(alpha) else None
    if kind is nn.GELU and module.approximate == "none":  # x Phi(x): |f(x)| <= |x|
        return _GELU_LIPSCHITZ, 1.0, 0.0
    if kind is nn.SiLU:  # x s(x): |f(x)| <= |x|
        return _SILU_LIPSCHITZ, 1.0, 0.0
    return None


# The settings of the torch layers above that their constants are read from: frozen like declared constants
_TORCH_SETTINGS: Dict[type, Tuple[str, ...]] = {
    nn.Hardtanh: ("min_val", "max_val"), nn.ReLU6: ("min_val", "max_val"), nn.LeakyReLU: ("negative_slope",),
    nn.ELU: ("alpha",), nn.CELU: ("alpha",), nn.GELU: ("approximate",),
}


# What every module holds in its __dict__ (torch's own bookkeeping), and the mode train()/eval() switches.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}


_SCALARS = (bool, int, float, complex, str)
_DEPTH = 4  # how deep plain attributes are searched: dicts, lists and tuples inside one another


def _plain_value(value: Any, level: int = 0) -> Any:
    """A copy of ``value``'s plain settings: a scalar as it is, a dict, list or tuple as a tuple of its items'
    (copied: one changed in place is a change), anything else (a tensor, an object) as its kind alone."""
    if isinstance(value, _SCALARS):
        return value
    if level < _DEPTH and isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_plain_value(v, level + 1) for v in value))
    if level < _DEPTH and isinstance(value, dict):
        return ("dict", tuple((repr(k), _plain_value(v, level + 1)) for k, v in value.items()))
    return f"<{type(value).__name__}>"


def _plain_settings(module: nn.Module) -> List[Tuple[str, Any]]:
    """The plain settings of a layer of one's own: its attributes that are numbers, strings, flags, or dicts, lists
    and tuples holding such (copied).  It declares what it likes, but its forward reads these like constants, and
    one set from a batch would carry that batch into every later step."""
    return sorted(((k, _plain_value(v)) for k, v in vars(module).items()
                   if k not in _MODULE_INTERNALS and isinstance(v, _SCALARS + (list, tuple, dict))),
                  key=lambda setting: setting[0])


def plain_tensors(obj: Any, skip: Any = _MODULE_INTERNALS,
                  key_names: Optional[Dict[int, str]] = None) -> Dict[str, torch.Tensor]:
    """The tensors ``obj`` (a module: not registered as parameters or buffers) keeps as plain attributes, those
    not in ``skip``: directly (``attr``) or inside dicts, lists and tuples (``attr[key]``, ``attr[key][i]``, ...).
    A dict keyed by tensors (an optimizer's per-parameter dict) names each by ``key_names[id(key)]``, or by its
    position."""
    found: Dict[str, torch.Tensor] = {}

    def walk(name: str, value: Any, level: int) -> None:
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif level < _DEPTH and isinstance(value, (dict, list, tuple)):
            for i, (key, item) in enumerate(value.items() if isinstance(value, dict) else enumerate(value)):
                if isinstance(key, torch.Tensor):  # never its values: a parameter's repr prints them all
                    key = (key_names or {}).get(id(key), f"<tensor {i}>")
                walk(f"{name}[{key}]", item, level + 1)

    for key, value in vars(obj).items():
        if key not in skip:
            walk(key, value, 0)
    return found


# The methods a module's class computes with, compared at every forward and step with their values when the bounds
# were set up.
_BOUND_METHODS = ("layer_bound", "project_")
_STATE_METHODS = ("get_extra_state", "set_extra_state", "_load_from_state_dict", "_save_to_state_dict")
_CLASS_METHODS = ("forward", "per_example") + _BOUND_METHODS + _STATE_METHODS + CLASS_CALL_PATH


# Where the layers' forwards and the bounds' certificates find their functions.  One replaced there after the bounds
# were set up (torch.nn.functional.linear = ...) changes every layer that calls it, past every check on the layers
# themselves.  (The noise and the accountant are other concerns: a function replaced there is not one the bounds
# describe.)
_FUNCTION_NAMESPACES = ("builtins", "math", "torch", "torch.nn.functional", "torch.linalg", "torch.fft",
                        "torch.special", "clipless.privacy.bounds", "clipless.privacy.certified",
                        "clipless.privacy.modules")


@functools.lru_cache(maxsize=None)
def _trusted_roots() -> Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]:
    """Directories whose code may define the watched functions: torch's and clipless' own, the standard library's
    (less the installed packages, which the standard library's directory holds)."""
    paths = sysconfig.get_paths()
    installed = {paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", lambda: [])(),
                 site.getusersitepackages()}

    def norm(dirs: Any) -> Tuple[str, ...]:
        return tuple(os.path.normcase(os.path.realpath(d)) + os.sep for d in dirs if d)

    own = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return norm(own), norm((paths["stdlib"], paths["platstdlib"])), norm(installed)


# Python's own builtins, as this module was imported: C functions and types (a shell's additions are Python objects)
_PYTHON_BUILTINS = frozenset(k for k, v in vars(builtins).items() if isinstance(v, (types.BuiltinFunctionType, type)))

# Third-party modules whose objects torch's namespace holds (torch._TypeIs, a typing_extensions special form;
# torch._check_is_size, wrapped by typing_extensions.deprecated)
_TRUSTED_MODULES = frozenset({"typing_extensions"})


@functools.lru_cache(maxsize=None)
def _trusted_file(path: str) -> bool:
    own, stdlib, installed = _trusted_roots()
    real = os.path.normcase(os.path.realpath(path))
    trusted_modules = {os.path.normcase(os.path.realpath(str(getattr(sys.modules.get(m), "__file__", ""))))
                       for m in _TRUSTED_MODULES}
    return (real.startswith(own) or real in trusted_modules
            or (real.startswith(stdlib) and not real.startswith(installed)))


def _foreign_definition(value: Any) -> Optional[str]:
    """Where ``value`` was defined, if outside torch, clipless and the standard library; else ``None``."""
    while True:  # what a wrapper object calls
        if isinstance(value, (classmethod, staticmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        elif not isinstance(value, types.FunctionType) and "__wrapped__" in (getattr(value, "__dict__", None) or {}):
            value = value.__wrapped__  # a wrapper object of C (functools.lru_cache): what it calls
        else:
            break
    if isinstance(value, types.FunctionType):
        path = value.__code__.co_filename
        return None if _trusted_file(path) else f"defined in {path}"
    if isinstance(value, types.ModuleType):
        name = getattr(value, "__name__", None)
        return None if sys.modules.get(name) is value else f"a module not imported as {name!r}"
    cls = value if isinstance(value, type) else type(value)
    if cls.__module__ in _TRUSTED_MODULES:
        return None
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return None if path is None or _trusted_file(path) else f"{cls.__qualname__}, defined in {path}"


def foreign_layer_method(model: nn.Module) -> Optional[str]:
    """The first method or property of a torch or clipless layer class of ``model`` (or of their torch and clipless
    bases) defined outside torch, clipless and the standard library (``"LipschitzLinear.forward (defined in
    train.py)"``), or ``None``: a method assigned on the class before ``make_private``, which every instance
    computes with.  A layer class of your own, defined elsewhere, declares its own bounds and is not placed."""
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            if klass.__module__.split(".")[0] not in ("torch", "clipless"):
                continue
            for key, value in vars(klass).items():
                parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
                for part in parts:
                    if part is None or not (callable(part) or isinstance(part, (classmethod, staticmethod))):
                        continue
                    where = _foreign_definition(part)
                    if where is not None:
                        return f"{klass.__qualname__}.{key} ({where})"
    return None


def _default_storage(space: str, key: str, value: Any) -> bool:
    """``torch.Storage`` rebound by ``torch.set_default_dtype`` to torch's storage class of the new default dtype
    (``torch.DoubleStorage``): torch's own alias, which no layer computes with."""
    name = getattr(value, "__name__", "")
    return ((space, key) == ("torch", "Storage") and isinstance(value, type) and name != "Storage"
            and name.endswith("Storage") and getattr(torch, name, None) is value
            and getattr(value, "__module__", "").split(".")[0] == "torch")


class FunctionNamespaces:
    """The callables of torch's, Python's, clipless' layers' and certificates' namespaces (and ``torch.Tensor``'s
    methods) as they were when the bounds were set up.

    :meth:`change` runs at every forward and step: one dict comparison per namespace (a C loop) in the common case;
    only when one differs are its entries compared one by one.  A callable or a module replaced (a layer module's
    ``F``), or a name added to a module that shadows a builtin or to ``torch.Tensor`` (shadowing a method of its
    base), is a change; other additions (torch's lazily loaded attributes) and plain values set are not."""

    def __init__(self, layer_modules: Sequence[str] = (), step_code: Sequence[str] = ()) -> None:
        # torch replaces torch.manual_seed by a wrapper when dynamo is first imported, which the first torch.optim
        # optimizer does: imported here, that happens before the snapshot instead of after it, where it would be
        # refused as a replaced function at the next forward.
        import torch._dynamo  # noqa: F401

        self._layer_modules, self._step_code = tuple(layer_modules), tuple(step_code)
        if step_code:  # the modules (by name prefix, e.g. "clipless.privacy.") and classes a private step runs
            core = sorted(n for n in list(sys.modules) if n.startswith(tuple(step_code)))
            classes = [(f"{n}.{k}", v) for n in core for k, v in sorted(vars(sys.modules[n]).items())
                       if isinstance(v, type) and v.__module__ == n]
            names = [n for n in core if n not in _FUNCTION_NAMESPACES]  # not those the bounds' snapshot compares
        else:
            names = [n for n in _FUNCTION_NAMESPACES if n in sys.modules]
            names += sorted(n for n in list(sys.modules) if n == "clipless.nn" or n.startswith("clipless.nn."))
            # the torch modules defining the model's torch layers (nn.ReLU reads F from torch.nn.modules.activation)
            names += sorted({n for n in layer_modules if n.startswith("torch.") and n in sys.modules} - set(names))
            classes = [("torch.Tensor", torch.Tensor)]
        self._spaces: List[Tuple[str, Any]] = [(n, vars(sys.modules[n])) for n in names]
        self._spaces += [(name, vars(cls)) for name, cls in classes]
        # spaces compared entry by entry, a new callable in them a change too: every class, and the privacy core's
        # modules (they rebind no global, so a replaced object of any kind is a change)
        self._strict = frozenset(name for name, _ in self._spaces) if step_code else frozenset(n for n, _ in classes)
        self._seen = [dict(space) for _, space in self._spaces]
        # functions, classes and modules (a layer's module's `F` swapped for another module is a change too); of a
        # class every entry (torch.Tensor's __torch_function__ is a classmethod, which is not callable; a property)
        self._callables = [dict(seen) if name in self._strict else
                           {k: v for k, v in seen.items() if callable(v) or isinstance(v, types.ModuleType)}
                           for (name, _), seen in zip(self._spaces, self._seen)]
        self._builtins = frozenset(k for k, v in vars(sys.modules["builtins"]).items() if callable(v))

    def change(self) -> Optional[str]:
        """The first function replaced since the snapshot (``"torch.nn.functional.linear"``), or ``None``."""
        for i, (name, space) in enumerate(self._spaces):
            try:
                if space == self._seen[i]:
                    continue
            except Exception:  # a plain value replaced by one whose == does not give a bool (a tensor): look closer
                pass
            for key, fn in self._callables[i].items():
                if space.get(key) is not fn and not _default_storage(name, key, space.get(key)):
                    return f"{name}.{key}"
            for key in set(space) - set(self._seen[i]):
                if callable(space[key]) and (name in self._strict or key in self._builtins):
                    return f"{name}.{key}"
            self._seen[i] = dict(space)  # only lazy attributes or plain values changed: compare with them from now
        return None

    def foreign(self) -> Optional[str]:
        """The first callable of the namespaces defined outside torch, clipless and Python's standard library
        (``"torch.nn.functional.linear (defined in train.py)"``), or ``None``: a function replaced before the
        snapshot, which :meth:`change` compares with, not with torch's own.  A Python function is placed by its
        code's file (``functools.wraps`` does not move it), a callable object or class by its class's module, a
        module must be the one imported under its name; functions of C extensions have no file to place."""
        for (name, _), callables in zip(self._spaces, self._callables):
            for key, value in callables.items():
                if name == "builtins" and key not in _PYTHON_BUILTINS:
                    continue  # names a shell adds (IPython's display, get_ipython, exit), which no layer reads
                where = _foreign_definition(value)
                if where is not None:
                    return f"{name}.{key} ({where})"
        return None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FunctionNamespaces":
        return self  # it describes the interpreter's namespaces, which a copy of a run shares

    def __reduce__(self) -> Any:
        return (FunctionNamespaces, (self._layer_modules, self._step_code))


def torch_layer_bound(module: nn.Module, x_bound: float, in_shape: Sequence[int]) -> Optional[LayerBound]:
    """The bound of a parameter-free torch layer the engine knows, or ``None``.

    Shape layers and ReLU: ``l = 1``, ``||f(x)|| <= ||x||``.  An elementwise activation with ``|f'| <= l``,
    ``|f(x) - f(0)| <= m |x|`` on ``P`` entries: ``l``, and ``||f(x)|| <= m ||x|| + |f(0)| sqrt(P)``.
    """
    if type(module) in _PARAMETER_FREE_1LIP:
        return LayerBound(lipschitz=1.0, out_bound=x_bound)
    constants = _activation_constants(module)
    if constants is None:
        return None
    lip, slope, offset = constants
    return LayerBound(lipschitz=lip, out_bound=slope * x_bound + abs(offset) * math.sqrt(math.prod(in_shape)))


@dataclass(frozen=True)
class LayerSensitivity:
    """Per-example gradient bound of one layer (its trainable tensors together)."""

    name: str
    params: Tuple[nn.Parameter, ...]
    tensor_bounds: Tuple[float, ...]
    input_bound: float
    grad_out_bound: float

    @property
    def bound(self) -> float:
        """``g_d``: root-sum-square of the layer's tensor bounds."""
        return math.sqrt(sum(b * b for b in self.tensor_bounds))


@dataclass(frozen=True)
class BoundReport:
    """Result of one backpropagation for bounds."""

    layers: Tuple[LayerSensitivity, ...]
    input_bound: float
    output_bound: float
    loss_lipschitz: float
    gradient_capped: bool = False  # a layer clips the per-example gradient: no longer linear in the loss gradient

    @property
    def global_sensitivity(self) -> float:
        """``Delta = sqrt(sum_d g_d^2)``: sensitivity of the whole summed gradient."""
        return math.sqrt(sum(layer.bound**2 for layer in self.layers))

    def as_dict(self) -> Dict[str, float]:
        return {layer.name: layer.bound for layer in self.layers}


def _check_forward_matches_bounds(cls: type, name: str) -> None:
    """A subclass that changes ``forward`` but inherits ``layer_bound`` declares bounds for another function."""
    forward_owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)
    bound_owner = next(c for c in cls.__mro__ if "layer_bound" in c.__dict__)
    if bound_owner is BoundedModule or not issubclass(bound_owner, forward_owner):
        raise BoundError(f"layer '{name}' ({cls.__name__}) defines forward in {forward_owner.__name__} but its bounds "
                         f"in {bound_owner.__name__}: a layer that changes forward must declare its own layer_bound()")


def check_input_shape(input_shape: Any) -> Tuple[int, ...]:
    """The per-example input shape as a tuple of positive whole numbers (``(64,)``, ``(1, 28, 28)``), or a
    ``ValueError``: the bounds and the input guard read it, and a float or a bare number would be misread."""
    try:
        dims = tuple(input_shape)
    except TypeError:
        dims = None
    if not dims or any(not is_whole(d) or d < 1 for d in dims):
        raise ValueError(f"input_shape must be the per-example shape, a tuple of positive whole numbers such as "
                         f"(64,) or (1, 28, 28) (the batch dimension left out), got {input_shape!r}")
    return tuple(int(d) for d in dims)


class BoundEngine(DeclaredConstants):
    """Backpropagation for bounds over a model (spec §2).

    Construction validates the model once: every leaf must declare bounds,
    every trainable parameter must be covered, no module may be used twice.
    :meth:`compute` then gives certified per-layer bounds for the current
    weights; call it at every step (weights change).
    """

    # the input bound and the loss the bounds start from: a smaller input_bound set later would shrink every bound
    constants = ("model", "input_shape", "input_bound", "loss")

    def __init__(
        self,
        model: nn.Module,
        input_shape: Sequence[int],
        input_bound: float,
        loss: Any,
    ) -> None:
        """``loss``: the loss (anything with ``lipschitz``, checked against the model's output shape through
        its ``check_output_shape`` when it has one), or its Lipschitz constant ``L`` as a number."""
        if not (input_bound > 0 and math.isfinite(input_bound)):
            raise BoundError(
                f"input bound must be a positive finite number, got {input_bound}; "
                "add an InputNormClip layer or pass input_bound"
            )
        self.loss = loss if hasattr(loss, "lipschitz") else None
        self._fixed_lipschitz = None if self.loss is not None else float(loss)
        self.loss_lipschitz  # validates
        self.model = model
        self.input_shape = check_input_shape(input_shape)
        self.input_bound = float(input_bound)
        self._names = {id(m): n for n, m in model.named_modules()}
        self._leaves: List[nn.Module] = self._leaves_of(model)
        self._check_known_forwards()  # first: a parametrization names itself there, not as an uncovered parameter
        self._check_parameters_covered()
        self._in_shapes, self.output_shape = self._probe_shapes()
        check = getattr(self.loss, "check_output_shape", None)
        if check is not None:
            check(self.output_shape)
        self._declared = self._declared_constants()
        self._functions = FunctionNamespaces([type(m).__module__ for m in model.modules()])
        foreign = self._functions.foreign() or foreign_layer_method(model)
        if foreign is not None:
            raise BoundError(f"{foreign} is not torch's, clipless' or Python's own: a function replaced in the "
                             "namespaces the layers and the weights' certificates read, or on a layer's class, "
                             "changes every layer or certificate at once, past their bounds; remove the "
                             "replacement before make_private")

    @property
    def leaves(self) -> Tuple[nn.Module, ...]:
        """The layers the bounds are computed for, in forward order."""
        return tuple(self._leaves)

    @property
    def loss_lipschitz(self) -> float:
        """``L``, read from the loss at every use (a changed constant is never left behind)."""
        value = self.loss.lipschitz if self.loss is not None else self._fixed_lipschitz
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise BoundError(f"loss Lipschitz constant must be positive and finite, got {value}")
        return float(value)

    # -- validation -------------------------------------------------------
    def _collect_leaves(self, module: nn.Module, leaves: List[nn.Module],
                        undeclared: List[Tuple[str, nn.Module]]) -> None:
        residual = Residual
        name = self._names.get(id(module), "?") or "<model>"
        if isinstance(module, (nn.Sequential, residual)):
            base = nn.Sequential if isinstance(module, nn.Sequential) else residual
            if type(module).forward is not base.forward:
                raise BoundError(f"'{name}' ({type(module).__name__}) overrides the forward of {base.__name__}: the "
                                 "bound engine only knows the forward it analyses; use a plain container")
            if isinstance(module, nn.Sequential):
                for child in module:
                    self._collect_leaves(child, leaves, undeclared)
            else:
                self._collect_leaves(module.branch, leaves, undeclared)  # type: ignore[attr-defined]
                self._add_leaf(module, leaves)
            return
        if isinstance(module, BoundedModule):
            _check_forward_matches_bounds(type(module), name)
            self._add_leaf(module, leaves)
            return
        if type(module) in _PARAMETER_FREE_1LIP or _activation_constants(module) is not None:
            self._add_leaf(module, leaves)
            return
        undeclared.append((name, module))  # refused by _leaves_of, all at once

    def _leaves_of(self, model: nn.Module) -> List[nn.Module]:
        """The model's layers in forward order; one error names every layer without declared bounds."""
        leaves: List[nn.Module] = []
        undeclared: List[Tuple[str, nn.Module]] = []
        self._collect_leaves(model, leaves, undeclared)
        if undeclared:
            raise _undeclared_error(undeclared)
        return leaves

    def _add_leaf(self, module: nn.Module, leaves: List[nn.Module]) -> None:
        if any(m is module for m in leaves):
            raise BoundError(
                f"module '{self._names.get(id(module), '?')}' is used twice; shared weights "
                "are not supported by the bound engine"
            )
        leaves.append(module)

    def _check_known_forwards(self) -> None:
        """Hooks can change what a module computes or back-propagates: refuse every hook but the input guard."""
        if global_hooks_registered():
            raise BoundError("global module hooks are registered: they could change the outputs the bounds describe")
        for module in self.model.modules():
            hooks = module_hooks(module)
            name = self._names.get(id(module), "?") or "<model>"
            if hooks:
                raise BoundError(f"module '{name}' has hooks ({len(hooks)}) that may change its outputs or gradients; "
                                 "remove them before making the model private")
            if parametrize.is_parametrized(module):  # the layer then computes with f(stored tensor), not the tensor
                raise BoundError(f"module '{name}' has a parametrization (torch.nn.utils.parametrize) on "
                                 f"{', '.join(sorted(module.parametrizations))}: it computes with a function of its "
                                 "stored parameters that the bounds do not describe, and the projection would not "
                                 "reach the stored tensor; remove it (parametrize.remove_parametrizations)")
            redefined = redefined_call_path(module)
            if redefined:
                raise BoundError(f"module '{name}' ({type(module).__name__}) redefines nn.Module's {redefined}: the "
                                 "model would compute something other than the forward its bounds describe (a "
                                 "__call__ that scales the output passes every check a forward is given); define "
                                 "forward and layer_bound instead")
            replaced = replaced_forward(module)
            if replaced is None and isinstance(module, BoundedModule):
                # an unchecked bound in place of the class's certified one, a projection that moves the weights
                # inside the private step after its checks, or a load that writes its own certificate
                replaced = next((m for m in _BOUND_METHODS if m in vars(module)), None)
            if replaced is None:  # what a checkpoint saves of a module and how a resume puts it back
                replaced = next((m for m in _STATE_METHODS if m in vars(module)), None)
            if replaced is None and isinstance(module, PerStepMechanism):  # what it releases after each step
                replaced = next((m for m in ("update_", "keep_only_", "counting_paused") if m in vars(module)), None)
            if replaced:
                raise BoundError(f"module '{name}' ({type(module).__name__}) has its own {replaced} (set on the "
                                 "instance, e.g. module.forward = ..., module.layer_bound = ..., module.project_ = "
                                 "..., module.update_ = ... or module.compile()): the bounds describe its class's "
                                 "forward, and its bounds, projection and saved state are its class's; use a layer "
                                 "class that declares bounds for what it computes")

    def _check_same_layers(self) -> None:
        """The layers the bounds were set up for are still the model's, in the same places: a layer added,
        removed or replaced after construction (``model.insert``, ``model[2] = ...``) was never checked and
        would be read with another layer's bound."""
        names = {id(m): n for n, m in self.model.named_modules()}
        try:
            current = self._leaves_of(self.model)
        except BoundError as err:
            raise BoundError(f"the model changed after its bounds were set up: {err}") from err
        if len(current) != len(self._leaves) or any(a is not b for a, b in zip(current, self._leaves)) or any(
                names.get(id(m)) != self._names.get(id(m)) for m in current):
            raise BoundError("the model's layers changed after its bounds were set up (a layer added, removed, "
                             "replaced or moved): the new layers carry no certified bound; call make_private again "
                             "on the same PrivacyEngine")

    def _declared_constants(self) -> Tuple[Tuple[str, str, str, Any], ...]:
        """Every declared constant of this engine, the model's modules and the loss, read through the instances."""
        owners: List[Tuple[str, Any]] = [("the bound engine", self)]
        layers = [(f"module '{self._names.get(id(m), '?') or '<model>'}'", m) for m in self.model.modules()]
        owners += layers
        if isinstance(self.loss, nn.Module):
            owners += [(f"the loss's module '{n}'" if n else "the loss", m) for n, m in self.loss.named_modules()]
        elif self.loss is not None:
            owners.append(("the loss", self.loss))
        values = [(owner, type(obj).__name__, name, value) for owner, obj in owners
                  if isinstance(obj, DeclaredConstants) for name, value in obj.declared_values()]
        values += [(owner, type(obj).__name__, name, getattr(obj, name, None)) for owner, obj in owners
                   for name in _TORCH_SETTINGS.get(type(obj), ())]
        # the model's layers of one's own (the loss's state has its own check, the step guard's loss_state; a
        # per-step mechanism's state moves at every step by design, through its own noisy release)
        values += [(owner, type(obj).__name__, name, value) for owner, obj in layers
                   if not isinstance(obj, PerStepMechanism) and _defined_outside(obj)
                   for name, value in _plain_settings(obj)]
        # what each module's class computes with: a method assigned on the class (Layer.forward = ...) after the
        # bounds were set up changes every instance, past every instance-level check
        values += [(owner, type(obj).__name__, _CLASS_METHODS, tuple(getattr(type(obj), k, None)
                                                                     for k in _CLASS_METHODS))
                   for owner, obj in owners if isinstance(obj, nn.Module)]
        return tuple(values)

    def declared_change(self) -> Optional[str]:
        """Why the constants the bounds were set up with are no longer the ones the forward reads, or ``None``.

        Declared constants are read-only, but a write into the instance's ``__dict__`` gets past that guard and
        would leave a cached bound (a conv's norm, kept for unchanged weights) describing another layer; a torch
        activation's setting (``negative_slope``) is a plain attribute.  The step guard asks at every forward
        too: a value changed for the forward and put back before ``step()`` would pass a check at the step."""
        replaced = self._functions.change()
        if replaced is not None:
            return (f"{replaced} was replaced after the bounds were set up (a function assigned in its namespace, "
                    "e.g. torch.nn.functional.linear = ...): every layer that calls it now computes other than its "
                    "bound describes; put the original back")
        current = self._declared_constants()
        if current == self._declared:
            return None
        try:  # a layer replaced or parametrized reads as its constants changed: name what happened
            self._check_known_forwards()
            self._check_same_layers()
        except BoundError as err:
            return str(err)
        for before, now in zip(self._declared, current):
            if before != now:
                owner, cls, name, value = before
                if before[:3] != now[:3]:
                    return f"{owner} ({cls}) is now a {now[1]} with other constants than the bounds were set up for"
                if name == _CLASS_METHODS:
                    changed = [k for k, a, b in zip(_CLASS_METHODS, value, now[3]) if a is not b]
                    return (f"{owner} ({cls}): its class's {', '.join(changed)} changed after the bounds were set up "
                            f"(assigned on the class, e.g. {cls}.{changed[0]} = ...): the bounds describe the old "
                            "one; define a subclass with its own forward and layer_bound instead")
                return (f"{owner} ({cls}): its constant {name} changed from {value!r} to {now[3]!r} after the bounds "
                        f"were set up (a declared constant written past its read-only guard, a torch layer's "
                        f"setting, or a plain setting of a layer of one's own, which its forward reads as a "
                        f"constant: one set from a batch carries it into every later step): the bounds and noise "
                        f"plan describe the old value; build a new {cls} and make the model private again")
        return "the model's or the loss's declared constants changed after the bounds were set up"

    def _check_declared(self) -> None:
        why = self.declared_change()
        if why is not None:
            raise BoundError(why)

    def _check_parameters_covered(self) -> None:
        residual = Residual
        covered: Dict[int, str] = {}
        for leaf in self._leaves:
            if isinstance(leaf, residual):
                continue
            own = dict(leaf.named_parameters(recurse=False))
            if not isinstance(leaf, BoundedModule) and own:
                raise BoundError(f"layer '{self._names[id(leaf)]}' has parameters but no declared bounds")
            for p in own.values():
                if id(p) in covered:  # its gradient sums two layers' terms, bounded as separate blocks
                    raise BoundError(f"layers '{covered[id(p)]}' and '{self._names[id(leaf)]}' share a parameter: "
                                     "shared weights are not supported by the bound engine")
                covered[id(p)] = self._names[id(leaf)]
        for name, param in self.model.named_parameters():
            if param.requires_grad and id(param) not in covered:
                raise BoundError(f"trainable parameter '{name}' is not covered by any declared bound")

    def _probe_shapes(self) -> Tuple[Dict[int, Tuple[int, ...]], Tuple[int, ...]]:
        shapes: Dict[int, Tuple[int, ...]] = {}
        hooks = []
        for leaf in self._leaves:

            def hook(mod: nn.Module, args: Tuple[torch.Tensor, ...], store=shapes) -> None:
                store[id(mod)] = tuple(args[0].shape[1:])

            hooks.append(leaf.register_forward_pre_hook(hook))
        try:
            param = next(self.model.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            dtype = param.dtype if param is not None else torch.float32
            with torch.no_grad():
                out = self.model(torch.zeros((1,) + self.input_shape, device=device, dtype=dtype))
        except RuntimeError as exc:
            raise BoundError(f"model does not accept inputs of shape {self.input_shape}: {exc}") from exc
        finally:
            for h in hooks:
                h.remove()
        return shapes, tuple(out.shape[1:])

    # -- the engine -------------------------------------------------------
    def _leaf_bound(self, module: nn.Module, x_bound: float) -> LayerBound:
        key = (id(module), x_bound)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if isinstance(module, BoundedModule):
            lb = module.layer_bound(x_bound, self._in_shapes[id(module)])
        else:
            lb = torch_layer_bound(module, x_bound, self._in_shapes[id(module)])
            if lb is None:  # a setting changed since construction; no unknown layer is ever read as 1-Lipschitz
                raise BoundError(f"layer '{self._names[id(module)]}' ({module!r}) declares no bounds")
        for value in (lb.lipschitz, lb.out_bound, *lb.param_factors.values()):
            if not (value >= 0 and math.isfinite(value)):
                raise BoundError(f"layer '{self._names[id(module)]}' declared an invalid bound {value}")
        self._cache[key] = lb
        return lb

    def _out_bound(self, module: nn.Module, x_bound: float) -> float:
        if isinstance(module, nn.Sequential):
            for child in module:
                x_bound = self._out_bound(child, x_bound)
            return x_bound
        if isinstance(module, Residual):
            a, b = module.skip_weight, module.branch_weight  # type: ignore[attr-defined]
            return a * x_bound + b * self._out_bound(module.branch, x_bound)  # type: ignore[attr-defined]
        return self._leaf_bound(module, x_bound).out_bound

    def _backward(self, module: nn.Module, x_bound: float, g_out: float, out: List[LayerSensitivity]) -> float:
        """Record parameter bounds inside ``module``; return the bound on the input gradient."""
        if isinstance(module, nn.Sequential):
            inputs = []
            for child in module:
                inputs.append(x_bound)
                x_bound = self._out_bound(child, x_bound)
            for child, x_in in zip(reversed(list(module)), reversed(inputs)):
                g_out = self._backward(child, x_in, g_out, out)
            return g_out
        if isinstance(module, Residual):
            # y = a x + b h(x): G_in <= a G + (bound through h of b G)
            a, b = module.skip_weight, module.branch_weight  # type: ignore[attr-defined]
            return a * g_out + self._backward(module.branch, x_bound, b * g_out, out)  # type: ignore[attr-defined]
        lb = self._leaf_bound(module, x_bound)
        g_eff = min(g_out, lb.grad_cap)
        params, bounds = [], []
        for pname, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if pname not in lb.param_factors:
                raise BoundError(f"layer '{self._names[id(module)]}' declares no bound for parameter '{pname}'")
            params.append(param)
            factor = lb.param_factors[pname]
            bounds.append(g_eff * factor + UNDERFLOW_MARGIN if g_eff > 0 and factor > 0 else 0.0)
        if params:
            out.append(
                LayerSensitivity(
                    name=self._names[id(module)],
                    params=tuple(params),
                    tensor_bounds=tuple(bounds),
                    input_bound=x_bound,
                    grad_out_bound=g_eff,
                )
            )
        return lb.backward(g_out)

    def compute(self) -> BoundReport:
        """Certified per-layer per-example gradient bounds for the current weights."""
        self._check_known_forwards()  # hooks added after construction would change the analysed function
        self._check_same_layers()
        self._check_declared()
        self._cache: Dict[Tuple[int, float], LayerBound] = {}
        layers: List[LayerSensitivity] = []
        output_bound = self._out_bound(self.model, self.input_bound)
        self._backward(self.model, self.input_bound, self.loss_lipschitz, layers)
        layers.reverse()  # input-to-output order
        return BoundReport(
            layers=tuple(layers),
            input_bound=self.input_bound,
            output_bound=output_bound,
            loss_lipschitz=self.loss_lipschitz,
            gradient_capped=any(math.isfinite(lb.grad_cap) for lb in self._cache.values()),
        )

    def _lipschitz(self, module: nn.Module, x_bound: float) -> float:
        if isinstance(module, nn.Sequential):
            total = 1.0
            for child in module:
                total *= self._lipschitz(child, x_bound)
                x_bound = self._out_bound(child, x_bound)
            return total
        if isinstance(module, Residual):
            a, b = module.skip_weight, module.branch_weight  # type: ignore[attr-defined]
            return a + b * self._lipschitz(module.branch, x_bound)  # type: ignore[attr-defined]
        return self._leaf_bound(module, x_bound).lipschitz

    def lipschitz_constant(self) -> float:
        """Certified Lipschitz constant of the whole model (input -> logits), product rule."""
        self._check_declared()
        self._cache = {}
        return self._lipschitz(self.model, self.input_bound)

    def project_(self) -> None:
        """Project every bounded layer back into its feasible set."""
        for leaf in self._leaves:
            if isinstance(leaf, BoundedModule):
                leaf.project_()
