"""Declared loss Lipschitz constants against gradient ascent on ``||grad_z l||`` (spec §3.1)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import clipless as cl

K = 5


def max_logit_gradient(loss: cl.LipschitzLoss, num_classes: int, binary: bool = False, seed: int = 0) -> float:
    """Max of ``||grad_z l(z, y)||`` over random restarts (many scales, every label) refined by gradient ascent."""
    gen = torch.Generator().manual_seed(seed)
    best = 0.0
    labels = [0, 1] if binary else list(range(num_classes))
    for scale in (0.01, 0.3, 1.0, 3.0, 10.0, 100.0):
        for y_val in labels:
            n = 64
            shape = (n,) if binary else (n, num_classes)
            z = (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
            y = torch.full((n,), y_val, dtype=torch.long)
            opt = torch.optim.Adam([z], lr=0.05 * scale)
            for _ in range(60):
                (g,) = torch.autograd.grad(loss.per_example(z, y).sum(), z, create_graph=True)
                norms = g.reshape(n, -1).norm(dim=1)
                best = max(best, float(norms.detach().max()))
                if not norms.requires_grad:  # linear loss: constant gradient
                    break
                opt.zero_grad()
                (-norms.sum()).backward()
                opt.step()
    return best


LOSSES = [
    (cl.TauCrossEntropy(tau=1.0), K, True),
    (cl.TauCrossEntropy(tau=20.0), K, True),
    (cl.CrossEntropyWithTemperature(temperature=0.5), K, True),
    (cl.MulticlassHinge(K, margin=1.0), K, True),
    (cl.MulticlassKR(K), K, True),
    (cl.MulticlassHKR(K, alpha=5.0), K, True),
    (cl.KCosineSimilarity(k_coef=2.0, x_min=0.5), K, True),
]


@pytest.mark.parametrize("loss,classes,tight", LOSSES, ids=lambda v: type(v).__name__ if hasattr(v, "lipschitz") else "")
def test_declared_loss_lipschitz_is_an_upper_bound(loss, classes, tight):
    worst = max_logit_gradient(loss, classes)
    assert worst <= loss.lipschitz * (1 + 1e-9), f"{type(loss).__name__}: {worst} > {loss.lipschitz}"
    if tight:  # the constant is not loose either: ascent gets close to it
        assert worst >= 0.9 * loss.lipschitz


def test_binary_cross_entropy_with_temperature():
    loss = cl.BinaryCrossEntropyWithTemperature(temperature=0.25)
    worst = max_logit_gradient(loss, 1, binary=True)
    assert worst <= loss.lipschitz * (1 + 1e-9)
    assert worst >= 0.9 * loss.lipschitz
    # labels in {-1, 1} and {0, 1} mean the same thing
    z = torch.randn(7)
    assert torch.allclose(loss.per_example(z, torch.tensor([1, 0, 1, 0, 1, 1, 0])),
                          loss.per_example(z, torch.tensor([1, -1, 1, -1, 1, 1, -1])))


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 12), st.floats(0.0, 20.0), st.integers(0, 10_000))
def test_hkr_constant_for_any_classes_and_alpha(num_classes, alpha, seed):
    loss = cl.MulticlassHKR(num_classes, alpha=alpha)
    gen = torch.Generator().manual_seed(seed)
    z = (10 * torch.randn(256, num_classes, generator=gen, dtype=torch.float64)).requires_grad_(True)
    y = torch.randint(0, num_classes, (256,), generator=gen)
    (g,) = torch.autograd.grad(loss.per_example(z, y).sum(), z)
    assert float(g.norm(dim=1).max()) <= loss.lipschitz * (1 + 1e-9)


def test_batch_normalised_kr_would_break_the_bound():
    """spec §6: KR normalised by the batch's class counts is not per-example bounded; ours is."""
    z = torch.zeros(8, 2, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1])

    def batch_kr(z, y):  # deel-lip style: mean over each class's members in the batch
        onehot = torch.nn.functional.one_hot(y, 2).double()
        pos = (onehot * z).sum(0) / onehot.sum(0)
        neg = ((1 - onehot) * z).sum(0) / (1 - onehot).sum(0)
        return -(pos - neg).sum()

    # As a sum of per-example losses (what the noise is calibrated for) it is b * batch_kr: the lone
    # class-0 example carries a gradient b times the per-example constant.
    (g,) = torch.autograd.grad(len(y) * batch_kr(z, y), z)
    assert float(g.norm(dim=1).max()) > 7 * cl.MulticlassKR(2).lipschitz
    (g,) = torch.autograd.grad(cl.MulticlassKR(2).per_example(z, y).sum(), z)
    assert float(g.norm(dim=1).max()) <= cl.MulticlassKR(2).lipschitz * (1 + 1e-12)


def test_losses_validate_shapes():
    with pytest.raises(ValueError, match="labels"):
        cl.TauCrossEntropy()(torch.zeros(4, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        cl.MulticlassHinge(3)(torch.zeros(4), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("loss", [cl.TauCrossEntropy(8.0), cl.CrossEntropyWithTemperature(), cl.MulticlassHinge(3),
                                  cl.MulticlassKR(3), cl.MulticlassHKR(3), cl.KCosineSimilarity()],
                         ids=lambda loss: type(loss).__name__)
@pytest.mark.parametrize("labels, match", [
    (torch.tensor([0.0, 1.0, 2.0, 1.0]), "expected integer class labels, got torch.float32"),
    (torch.tensor([True, False, True, True]), "expected integer class labels, got torch.bool"),
    (torch.tensor([0, 1, -1, 2]), r"class indices in \[0, 3\) .*; a label is outside that range$"),
    (torch.tensor([0, 1, 3, 2]), r"class indices in \[0, 3\) .*; a label is outside that range$"),
])
def test_multiclass_losses_refuse_labels_that_are_not_class_indices(loss, labels, match):
    """Float and boolean labels died in torch ("expected target dtype to be Long"), or, for KCosineSimilarity's
    gather, not at all for some; a negative or too large label was torch's IndexError naming one value (on CUDA a
    device-side assert).  Each is now a ValueError saying what a label must be, before the loss reads it."""
    with pytest.raises(ValueError, match=match):
        loss.per_example(torch.zeros(4, 3), labels)


def test_binary_cross_entropy_refuses_labels_other_than_0_1_or_minus_1():
    """A label 5 or 0.5 was read by its sign as the positive class, without a word."""
    loss = cl.BinaryCrossEntropyWithTemperature()
    for labels in (torch.tensor([0, 1, 5]), torch.tensor([0.0, 1.0, 0.5]), torch.tensor([-2, 1, 0])):
        with pytest.raises(ValueError, match="binary labels must be 0 or 1"):
            loss.per_example(torch.zeros(3), labels)
    loss.per_example(torch.zeros(3), torch.tensor([0.0, 1.0, -1.0]))  # float 0/1/-1 are the same labels


def test_reductions():
    loss = cl.TauCrossEntropy(tau=2.0, reduction="sum")
    z, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    assert torch.isclose(loss(z, y), loss.per_example(z, y).sum())
    assert math.isclose(cl.TauCrossEntropy(2.0)(z, y).item(), loss.per_example(z, y).mean().item(), rel_tol=1e-6)
