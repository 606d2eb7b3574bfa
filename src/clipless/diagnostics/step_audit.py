"""White-box audit of one private step (spec §9; Nasr et al. 2023, "Tight Auditing of DPML").

The library's own step runs many times on two neighbouring batches, D (the ``background`` records, empty
by default) and D' = D + one canary: the real :class:`~clipless.privacy.optimizer.DPOptimizer` with its
bound engine, step guard, input guard, noise plan and (for ``sample_rate < 1``) Poisson sampler.  The
auditor sees what the step releases (the noisy gradient handed to the inner optimizer) and projects it
on the canary's gradient, whitened by the planned noise of each layer: for a correct Gaussian step the
scores are ``N(0, 1)`` on D and ``N(mu, 1)`` on D' with ``mu <= 1 / sigma`` (equality when the canary
attains its bound).  Noise that is smaller than planned, or a bound below a true per-example gradient,
makes ``mu`` exceed what the accountant assumed, and the epsilon lower bound exceeds the claim.

The audited weights are the model's (a copy; the model is not changed) and the canary is crafted by
gradient ascent from random inputs: no training data enters the audit unless passed as ``background``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..privacy.accounting import PrivacyAccountant
from ..privacy.bounds import BoundEngine, BoundReport
from ..privacy.calibration import NoisePlan, plan_noise
from ..privacy.input_guard import InputGuard, paused_guards
from ..privacy.modules import LipschitzLoss, step_mechanisms
from ..privacy.optimizer import DPOptimizer
from ..privacy.privacy_engine import resolve_input_bound
from ..privacy.randomness import make_generator
from ..privacy.sampling import poisson_mask, poisson_threshold
from .audit_stats import AuditResult, gdp_epsilon, gdp_mu_bounds, threshold_epsilon_lower

__all__ = ["audit_step", "craft_canary", "miscalibrated", "claimed_step_epsilon"]


class _ReleaseRecorder(torch.optim.Optimizer):
    """An inner optimizer that keeps what the private step hands it (the released gradient) and moves nothing."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__(list(params), {})
        self.released: List[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.released = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                         for group in self.param_groups for p in group["params"]]


def miscalibrated(plan: NoisePlan, noise_scale: float) -> NoisePlan:
    """A deliberately wrong plan for audits: it draws ``noise_scale`` times the noise while the accountant
    keeps composing the original ``sigma_step`` (a calibration bug the auditor must catch)."""
    if not (noise_scale > 0 and math.isfinite(noise_scale)):
        raise ValueError(f"noise_scale must be positive and finite, got {noise_scale}")
    return dataclasses.replace(plan, layer_sigmas={k: v * noise_scale for k, v in plan.layer_sigmas.items()},
                               gradient_sigma=plan.gradient_sigma * noise_scale)


def claimed_step_epsilon(plan: NoisePlan, delta: float) -> float:
    """What the accountant states for one step of ``plan``."""
    accountant = PrivacyAccountant(plan.accountant)
    plan.account_step(accountant)
    return accountant.get_epsilon(delta)


def _per_example_gradient(model: nn.Module, loss: LipschitzLoss, x: torch.Tensor, y: torch.Tensor,
                          params: Sequence[nn.Parameter], create_graph: bool = False) -> Tuple[torch.Tensor, ...]:
    value = loss.per_example(model(x[None]), y[None]).sum()
    return torch.autograd.grad(value, params, create_graph=create_graph, allow_unused=True)


def craft_canary(model: nn.Module, loss: LipschitzLoss, input_shape: Sequence[int], x_bound: float,
                 steps: int = 60, restarts: int = 4, generator: Optional[torch.Generator] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """``(x, y, ||grad||)``: an input of norm ``x_bound`` and a label whose per-example gradient is as large as
    projected gradient ascent finds (the label is the least likely class at each start)."""
    params = [p for p in model.parameters() if p.requires_grad]
    best: Tuple[Optional[torch.Tensor], Optional[torch.Tensor], float] = (None, None, -1.0)
    radius = x_bound * (1 - 1e-6)  # on the bound, never above it after rounding

    def norm_of(x: torch.Tensor, y: torch.Tensor, graph: bool) -> torch.Tensor:
        grads = _per_example_gradient(model, loss, x, y, params, create_graph=graph)
        return sum((g.double() ** 2).sum() for g in grads if g is not None)  # type: ignore[return-value]

    for _ in range(restarts):
        x = torch.randn(tuple(input_shape), generator=generator)
        x = x * (radius / x.norm())
        with torch.no_grad():
            y = model(x[None]).reshape(-1).argmin().reshape(())
        step = 0.3 * radius
        for _ in range(steps):
            x = x.detach().requires_grad_(True)
            (gx,) = torch.autograd.grad(norm_of(x, y, True), x)
            with torch.no_grad():
                direction = gx / gx.norm().clamp_min(1e-30)
                x = x + step * direction
                x = x * (radius / x.norm().clamp_min(1e-30))
            step *= 0.97
        value = float(norm_of(x.detach(), y, False)) ** 0.5
        if value > best[2]:
            best = (x.detach(), y, value)
    assert best[0] is not None and best[1] is not None
    return best[0], best[1], best[2]


def _layer_stds(report: BoundReport, plan: NoisePlan) -> Dict[str, float]:
    """The noise standard deviation the plan states for each layer (global: ``sigma Delta``)."""
    if plan.strategy == "global":
        return {layer.name: plan.layer_sigmas[layer.name] * report.global_sensitivity for layer in report.layers}
    return {layer.name: plan.layer_sigmas[layer.name] * layer.bound for layer in report.layers}


def audit_step(
    model: nn.Module,
    loss: LipschitzLoss,
    *,
    input_shape: Sequence[int],
    noise_multiplier: float,
    input_bound: Optional[float] = None,
    sample_rate: float = 1.0,
    strategy: str = "global",
    layer_noise_multipliers: Any = None,
    accountant: str = "pld",
    delta: float = 1e-5,
    trials: int = 2000,
    confidence: float = 0.95,
    noise_scale: float = 1.0,
    canary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    background: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    noise_seed: Optional[int] = None,
    progress: bool = False,
) -> AuditResult:
    """Audit one private step of ``model`` (a copy) at ``noise_multiplier``: ``trials`` steps on D and as many on D'.

    ``sample_rate = 1`` audits the unsubsampled step (D' always holds the canary); below 1 every record,
    canary included, enters the batch with that probability through the library's Poisson sampler.  The
    claimed epsilon is the accountant's for one step of the plan.  ``epsilon_lower`` is the larger of the
    threshold test (assumption-free) and, for an unsubsampled step, the Gaussian-DP bound; each is taken at
    ``(1 + confidence) / 2`` so their maximum holds at ``confidence``.  ``noise_scale != 1`` draws that many
    times the planned noise while claiming the plan (a deliberate bug, to show that the audit catches it).
    Noise and sampling come from OS entropy unless ``noise_seed`` is given.
    """
    if trials < 8:
        raise ValueError(f"trials must be >= 8, got {trials}")
    if not (0 < sample_rate <= 1):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    model = copy.deepcopy(model)  # the audit restores weights after each step, on its own copy
    model.train()
    x0, data_bound = resolve_input_bound(model, input_bound)
    engine = BoundEngine(model, tuple(input_shape), x0, loss)
    report = engine.compute()
    plan = plan_noise(report, sample_rate=sample_rate, accountant=accountant, strategy=strategy,
                      layer_noise_multipliers=layer_noise_multipliers, noise_multiplier=noise_multiplier,
                      mechanism_sigmas=[m.count_noise_multiplier for m in step_mechanisms(model)])
    used = miscalibrated(plan, noise_scale) if noise_scale != 1.0 else plan
    bx = background[0] if background is not None else torch.zeros((0,) + tuple(input_shape))
    by = background[1] if background is not None else torch.zeros((0,), dtype=torch.long)
    params = [p for layer in report.layers for p in layer.params]
    recorder = _ReleaseRecorder(params)
    optimizer = DPOptimizer(recorder, engine, used, expected_batch_size=sample_rate * (len(bx) + 1),
                            accountant=PrivacyAccountant(accountant),
                            generator=make_generator(noise_seed, stream=2))
    # The audit measures what the declared constants release; the step's own check of the summed gradient
    # against them would refuse a canary beyond an understated bound before the audit could measure it.
    optimizer.audit_skip_sum_check_()
    InputGuard(model, tuple(input_shape), data_bound)
    sampler = make_generator(noise_seed, stream=1)
    crafted_norm = None
    with paused_guards(model):
        if canary is None:
            cx, cy, crafted_norm = craft_canary(model, loss, input_shape, x0,
                                                generator=make_generator(noise_seed, stream=3))
        else:
            cx, cy = canary
        report = engine.compute()  # the bounds of the audited weights
        g_c = _per_example_gradient(model, loss, cx, cy, params)
    stds = _layer_stds(report, plan)
    layer_of = {id(p): layer.name for layer in report.layers for p in layer.params}
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(g_c, params)]
    weights = [g / stds[layer_of[id(p)]] ** 2 for g, p in zip(grads, params)]
    # mu^2 = sum_d ||g_d||^2 / std_d^2 = <g, weights>: the planned shift of the whitened score
    mu_planned = math.sqrt(sum(float((g.double() * w.double()).sum()) for g, w in zip(grads, weights)))
    if mu_planned == 0:
        raise ValueError("the canary's gradient is zero: no step can reveal it (choose another canary)")
    canary_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    saved = copy.deepcopy(model.state_dict())
    threshold = poisson_threshold(sample_rate) if sample_rate < 1 else None
    scores: Dict[int, List[float]] = {0: [], 1: []}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * trials, desc="step audit", leave=False)
    for _ in range(trials):
        for world in (0, 1):  # interleaved, so both worlds see the same generator and weights history
            xs, ys = (torch.cat([bx, cx[None]]), torch.cat([by, cy.reshape(1)])) if world else (bx, by)
            if threshold is not None:
                keep = poisson_mask(len(xs), threshold, sampler)
                xs, ys = xs[keep], ys[keep]
            optimizer.zero_grad()
            loss.per_example(model(xs), ys).sum().backward()
            optimizer.step()
            with torch.no_grad():
                score = sum(float((r.double() * w.double()).sum()) for r, w in zip(recorder.released, weights))
            scores[world].append(score * optimizer.expected_batch_size / mu_planned)
            optimizer.restart_from_(saved)  # the next step starts from the audited weights again
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    out, inside = np.array(scores[0]), np.array(scores[1])
    half = (1.0 + confidence) / 2.0
    threshold_test = threshold_epsilon_lower(out, inside, delta, half)
    details: Dict[str, Any] = {
        "epsilon_lower_threshold_test": threshold_test["epsilon_lower"],
        "threshold_test": threshold_test,
        "sample_rate": sample_rate,
        "noise_multiplier": plan.gradient_sigma,
        "step_noise_multiplier": plan.step_sigma,
        "noise_scale": noise_scale,
        "strategy": strategy,
        "accountant": accountant,
        "global_sensitivity": report.global_sensitivity,
        "canary_gradient_norm": canary_norm,
        "canary_bound_ratio": canary_norm / report.global_sensitivity,
        "mu_planned": mu_planned,
        "canary": "crafted (projected gradient ascent on the per-example gradient norm)" if crafted_norm is not None
        else "given",
        "background_records": int(len(bx)),
    }
    epsilon_lower = threshold_test["epsilon_lower"]
    method = "threshold test, Clopper-Pearson"
    if sample_rate == 1.0:  # one Gaussian step: the scores are Gaussian with equal variance in both worlds
        mu_hat, mu_low = gdp_mu_bounds(out, inside, half)
        eps_gdp = gdp_epsilon(mu_low, delta)
        details.update({"mu_estimate": mu_hat, "mu_lower": mu_low, "epsilon_lower_gdp": eps_gdp,
                        "epsilon_estimate_gdp": gdp_epsilon(mu_hat, delta)})
        epsilon_lower = max(epsilon_lower, eps_gdp)
        method = "max of threshold test (Clopper-Pearson) and Gaussian-DP fit, each at (1 + confidence) / 2"
    return AuditResult(mode="step", epsilon_claimed=claimed_step_epsilon(plan, delta), epsilon_lower=epsilon_lower,
                       confidence=confidence, delta=delta, trials=trials, method=method, details=details,
                       scores_out=out, scores_in=inside)
