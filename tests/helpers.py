"""Independent checks used by the bound tests: true per-example gradients and measured Lipschitz constants."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from clipless.privacy.bounds import BoundEngine, BoundReport
from clipless.nn.linear import LipschitzLinear
from clipless.nn.losses import TauCrossEntropy
from clipless.privacy.modules import LipschitzLoss
from clipless.diagnostics.tightness import per_example_gradient_norms
from clipless.data.datasets import write_idx

TOL = 1e-5  # float32 forward/backward rounding


def _project_ball(x: torch.Tensor, radius: float) -> torch.Tensor:
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1).clamp_min(1e-12)
    return x * torch.clamp(radius / norms, max=1.0).reshape((-1,) + (1,) * (x.dim() - 1))


def random_inputs(n: int, shape: Sequence[int], radius: float, gen: torch.Generator) -> torch.Tensor:
    """Inputs of norm exactly ``radius`` (the worst case for the bounds) and some smaller, some sparse."""
    x = torch.randn((n,) + tuple(shape), generator=gen)
    x[n // 3 : n // 2] = x[n // 3 : n // 2].abs()  # non-negative, like pixels
    x[n // 2 :: 3] *= (torch.rand((x[n // 2 :: 3].shape[0],) + (1,) * len(shape), generator=gen) < 0.2).float()
    norms = torch.linalg.vector_norm(x.reshape(n, -1), dim=1).clamp_min(1e-12)
    scale = torch.ones(n)
    scale[::4] = torch.rand(len(scale[::4]), generator=gen)
    return x * (radius * scale / norms).reshape((-1,) + (1,) * len(shape))


def worst_gradient_ratios(
    model: nn.Module,
    loss: LipschitzLoss,
    input_shape: Sequence[int],
    radius: float,
    num_classes: int,
    seed: int = 0,
    n_random: int = 24,
    n_adversarial: int = 3,
    ascent_steps: int = 25,
    report: BoundReport | None = None,
) -> Dict[str, float]:
    """Max over random and gradient-ascent inputs of (true per-example grad norm / engine bound), per layer."""
    gen = torch.Generator().manual_seed(seed)
    if report is None:
        report = BoundEngine(model, input_shape, radius, loss.lipschitz).compute()
    worst = {layer.name: 0.0 for layer in report.layers}

    def record(x: torch.Tensor, y: torch.Tensor) -> None:
        norms = per_example_gradient_norms(model, loss, x, y, report)
        for layer in report.layers:
            if layer.bound > 0:
                worst[layer.name] = max(worst[layer.name], float(norms[layer.name].max()) / layer.bound)
            else:
                assert float(norms[layer.name].max()) == 0.0

    x = random_inputs(n_random, input_shape, radius, gen)
    y = torch.randint(0, num_classes, (n_random,), generator=gen)
    record(x, y)
    params = [p for layer in report.layers for p in layer.params]
    for trial in range(n_adversarial):
        x = random_inputs(1, input_shape, radius, gen).requires_grad_(True)
        y = torch.randint(0, num_classes, (1,), generator=gen)
        opt = torch.optim.Adam([x], lr=0.05 * radius)
        for _ in range(ascent_steps):
            value = loss.per_example(model(x), y).sum()
            grads = torch.autograd.grad(value, params, create_graph=True)
            objective = sum((g**2).sum() for g in grads)
            opt.zero_grad()
            (-objective).backward()
            opt.step()
            with torch.no_grad():
                x.copy_(_project_ball(x, radius))
        record(x.detach(), y)
    return worst


def measured_lipschitz(
    f: Callable[[torch.Tensor], torch.Tensor],
    input_shape: Sequence[int],
    radius: float = 1.0,
    restarts: int = 4,
    steps: int = 60,
    seed: int = 0,
) -> float:
    """Lower bound on the Lipschitz constant of ``f``: power iteration on ``J^T J`` at random points (autograd)."""
    gen = torch.Generator().manual_seed(seed)
    best = 0.0
    for _ in range(restarts):
        x = random_inputs(1, input_shape, radius, gen)
        v = torch.randn_like(x)
        v /= v.norm()
        for _ in range(steps):
            _, jv = torch.autograd.functional.jvp(f, x, v)
            _, jtjv = torch.autograd.functional.vjp(f, x, jv)
            norm = jtjv.norm()
            if norm == 0:
                break
            v = jtjv / norm
        _, jv = torch.autograd.functional.jvp(f, x, v)
        best = max(best, float(jv.norm()))
        # finite differences catch non-smooth maps (sorting, norms) between linear pieces
        d = 1e-3 * radius * torch.randn(x.shape, generator=gen)
        with torch.no_grad():
            best = max(best, float((f(x + d) - f(x)).norm() / d.norm()))
    return best


def project_weights(model: nn.Module, engine: BoundEngine, scale: float, gen: torch.Generator) -> None:
    """'Trained' weights: a large random perturbation followed by the layer projections."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    engine.project_()


def exact_linear_operator_norm(apply: Callable[[torch.Tensor], torch.Tensor], shape: Tuple[int, ...]) -> float:
    """Spectral norm of a linear map, from its dense matrix (small shapes only)."""
    n = math.prod(shape)
    eye = torch.eye(n, dtype=torch.float64).reshape((n,) + tuple(shape))
    with torch.no_grad():
        cols = apply(eye).reshape(n, -1)
    return float(torch.linalg.matrix_norm(cols, ord=2))


CLASSES = 4


def head(width: int, bias: bool = False) -> list:
    return [nn.Flatten(), LipschitzLinear(width, CLASSES, bias=bias)]


def check(model: nn.Module, shape, radius: float = 2.0, seed: int = 0, loss=None, trained: bool = True) -> dict:
    """True per-example gradient norms never exceed the engine's bounds (random + trained weights)."""
    torch.manual_seed(seed)
    loss = loss or TauCrossEntropy(tau=4.0)
    engine = BoundEngine(model, shape, radius, loss.lipschitz)
    engine.project_()
    results = {}
    for phase in ("random", "trained") if trained else ("random",):
        if phase == "trained":
            project_weights(model, engine, 0.5, torch.Generator().manual_seed(seed + 7))
        worst = worst_gradient_ratios(model, loss, shape, radius, CLASSES, seed=seed, report=engine.compute())
        for name, ratio in worst.items():
            assert ratio <= 1 + TOL, f"{phase} weights: layer {name} gradient {ratio:.6f} x its bound"
        results[phase] = worst
    return results


def empty_batch_backward(model, loss, input_shape):
    """The forward/backward of an empty Poisson batch: the next private step releases pure noise."""
    x = torch.zeros((0, *input_shape))
    loss.per_example(model(x), torch.zeros(0, dtype=torch.long)).sum().backward()


def capture_released(dp_optimizer):
    """A list that receives, at every private step, the gradients the inner optimizer is given (noisy, / b)."""
    released = []
    params = dict(dp_optimizer.bound_engine.model.named_parameters())
    dp_optimizer.register_release_hook(lambda grads: released.append({id(params[n]): g for n, g in grads.items()}))
    return released


def small_private_run(optimizer_cls=torch.optim.SGD, before_private=None):
    """A private run of a 6-8-3 Lipschitz MLP on 96 unit-norm records (expected batch 16, rdp accountant), as
    ``(model, optimizer, loss, engine, loader)``; ``before_private(optimizer)`` runs on the inner optimizer before
    ``make_private`` (a hook, a scheduler)."""
    import clipless as cl

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=gen)
    data = cl.ArrayDataset(x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (96,), generator=gen))
    model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    if before_private is not None:
        before_private(optimizer)
    loss = cl.TauCrossEntropy(2.0)
    engine = cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(module=model, optimizer=optimizer, data=data, loss=loss,
                                             noise_multiplier=1.0, input_shape=(6,), batch_size=16.0,
                                             input_bound=1.0)
    return model, opt, loss, engine, loader


def next_batch_backward(model, loss, loader):
    """The backward of the loader's next batch (16 rows expected of 96: one is empty with chance 3e-8); returns
    copies of the raw gradients, by parameter."""
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    return {p: p.grad.detach().clone() for p in model.parameters()}


def honest_steps(model, opt, loss, loader, n=1):
    for _ in range(n):
        opt.zero_grad()
        next_batch_backward(model, loss, loader)
        opt.step()


def per_example_grads(model, loss, x, y):
    """True per-example gradients from autograd, one example at a time: a list over ``model.parameters()``
    of tensors of shape ``(batch, *param.shape)``."""
    params = list(model.parameters())
    rows = [torch.autograd.grad(loss.per_example(model(x[i : i + 1]), y[i : i + 1]).sum(), params)
            for i in range(x.shape[0])]
    return [torch.stack([row[j] for row in rows]) for j in range(len(params))]


def write_fake_mnist(directory: Path, labels_max: int = 9, train: int = 40, test: int = 20) -> Path:
    """An MNIST directory (the four IDX files) of random images: what ``--dataset mnist --data-dir`` reads."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        labels = rng.integers(0, 10, n)
        labels[0] = labels_max
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory
