"""The protocols through which layers and losses take part in the privacy analysis (spec §2, §3).

The core owns them and imports no concrete layer or loss: a leaf layer is a :class:`BoundedModule`
(declares :class:`LayerBound`), a leading :class:`InputClip` gives the input bound, a
:class:`Residual` is the one split/merge the engine knows, a :class:`PerStepMechanism` releases a
noisy batch statistic at every step (composed by the accountant), and a :class:`LipschitzLoss` has
a declared constant ``L`` w.r.t. its logits.  Declared constants are read-only after ``__init__``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Collection, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .certified import BoundError, DeclaredConstants, is_real
from .input_guard import tap_loss

__all__ = ["LayerBound", "DeclaredConstants", "BoundedModule", "project_all_", "InputClip", "Residual", "PerStepMechanism",
           "step_mechanisms", "LipschitzLoss"]


@dataclass(frozen=True)
class LayerBound:
    """What a leaf layer declares for input-norm bound ``X`` (spec §2 table).

    ``lipschitz``: ``l`` with ``||f(x) - f(x')|| <= l ||x - x'||``.
    ``out_bound``: bound on ``||f(x)||`` for ``||x|| <= X``.
    ``param_factors``: parameter name -> ``c`` with ``||grad_p l|| <= G_out * c``.
    ``grad_cap``: the layer clips the incoming per-example gradient to this norm
    (loss-gradient clipping); ``inf`` for ordinary layers.
    """

    lipschitz: float
    out_bound: float
    param_factors: Mapping[str, float] = field(default_factory=dict)
    grad_cap: float = math.inf

    def backward(self, g_out: float) -> float:
        """Bound on the gradient norm w.r.t. the layer input."""
        return self.lipschitz * min(g_out, self.grad_cap)


class BoundedModule(DeclaredConstants, nn.Module):
    """Base class of leaf layers that take part in the bound protocol."""

    def layer_bound(self, x_bound: float, in_shape: Tuple[int, ...]) -> LayerBound:
        """Bounds for an input of norm ``<= x_bound`` and per-example shape ``in_shape``."""
        raise NotImplementedError

    def project_(self) -> None:
        """Put the parameters back in the feasible set (after an optimizer step)."""


def project_all_(model: nn.Module) -> nn.Module:
    """Project every :class:`BoundedModule` of ``model`` into its feasible set (e.g. an average of feasible
    iterates, which need not be feasible itself); returns ``model``."""
    for m in model.modules():
        if isinstance(m, BoundedModule):
            m.project_()
    return model


class InputClip(BoundedModule):
    """A layer that maps every input into the ball of radius ``max_norm``: as the model's first layer, the bound
    engine takes the input bound ``X_0`` from it (no data-bound check needed)."""

    max_norm: float


class Residual(DeclaredConstants, nn.Module):
    """``y = a x + b h(x)`` (default ``(x + h(x))/2``); the bound engine treats it as split + merge.

    ``l <= a + b l_h``, ``X -> a X + b out_h(X)``, and parameters inside ``h``
    see the gradient bound ``b G``.
    """

    constants = ("skip_weight", "branch_weight")

    def __init__(self, branch: nn.Module, skip_weight: float = 0.5, branch_weight: float = 0.5) -> None:
        super().__init__()
        for name, weight in (("skip_weight", skip_weight), ("branch_weight", branch_weight)):
            # NaN passes a "< 0" test and would carry NaN bounds into the noise; inf has no finite bound
            if not is_real(weight) or not 0 <= weight < math.inf:
                raise ValueError(f"residual weights must be finite and non-negative, got {name}={weight!r}")
        self.branch = branch
        self.skip_weight, self.branch_weight = float(skip_weight), float(branch_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip_weight * x + self.branch_weight * self.branch(x)


class PerStepMechanism(BoundedModule):
    """A layer that releases, after every private step, a noisy statistic of the step's batch (e.g. a count of
    unclipped examples) with Gaussian noise of std ``count_noise_multiplier`` (add/remove sensitivity 1).

    The optimizer composes it into the step's ``sigma_eff`` and, after the step, calls :meth:`keep_only_` with
    the backward passes it released, then :meth:`update_`.
    """

    count_noise_multiplier: float

    def update_(self, expected_batch_size: float, generator: Optional[torch.Generator] = None,
                distributed: bool = False, secure: bool = False) -> float:
        """Release this step's noisy statistic and reset it (``distributed``: summed over the ranks and noised
        once, :func:`~clipless.privacy.noise.noisy_count`; ``secure``: its ``secure`` noise, asked for by a
        ``secure_noise`` optimizer, which refuses a mechanism whose ``update_`` lacks the flag)."""
        raise NotImplementedError

    def keep_only_(self, backward_passes: Collection[int]) -> None:
        """Keep what ``backward_passes`` (:func:`~clipless.privacy.input_guard.backward_pass_id`) added to the
        statistic and forget the rest: the optimizer passes those whose gradient the step releases, so that a
        backward whose gradient is not released (an input gradient, a pass cleared by ``zero_grad``) does not count
        an example a second time (sensitivity 2, not 1)."""
        raise NotImplementedError(f"{type(self).__name__} must keep its statistic per backward pass (keep_only_)")

    @contextlib.contextmanager
    def counting_paused(self) -> Iterator[None]:
        """Backward passes inside are diagnostics: they do not enter the statistic."""
        yield


def step_mechanisms(model: nn.Module) -> List[PerStepMechanism]:
    """The :class:`PerStepMechanism` layers of ``model`` (each adds a mechanism to every step)."""
    return [m for m in model.modules() if isinstance(m, PerStepMechanism)]


class LipschitzLoss(DeclaredConstants, nn.Module):
    """A per-example loss ``l(z, y)`` with ``||grad_z l|| <= lipschitz`` for all ``z, y``.

    ``lipschitz`` and the parameters it depends on are declared constants (set once, then read-only).
    :meth:`check_output_shape` refuses model outputs for which the constant does not hold.
    """

    lipschitz: float
    constants: Tuple[str, ...] = ("lipschitz", "reduction")

    def __init_subclass__(cls, **kwargs) -> None:
        # Every per_example, including a user subclass's, is watched by the private step's guard (clipless.privacy.input_guard).
        super().__init_subclass__(**kwargs)
        impl = cls.__dict__.get("per_example")
        if impl is not None and not getattr(impl, "_tapped", False):
            @functools.wraps(impl)
            def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return tap_loss(self, logits, lambda z: impl(self, z, target), target,
                                lambda z, t: impl(self, z, t))

            per_example._tapped = True  # type: ignore[attr-defined]
            cls.per_example = per_example  # type: ignore[method-assign]

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction = reduction

    def per_example(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_output_shape(self, shape: Tuple[int, ...]) -> None:
        """Refuse a per-example model output shape the loss (and its ``L``) is not defined for."""
        if len(shape) != 1 or shape[0] < 2:
            raise BoundError(f"{type(self).__name__} needs logits of shape (batch, classes >= 2); the model "
                             f"outputs per-example shape {tuple(shape)}")

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        values = self.per_example(logits, target)
        if self.reduction == "sum":
            return values.sum()
        if self.reduction == "mean":
            return values.mean()
        return values


