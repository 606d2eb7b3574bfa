"""Augmentation multiplicity (issue 18, item 5): K augmented rows per example, each loss weighted 1/K.

The per-example bound must still hold for the example's averaged gradient (checked against true per-example
gradients from autograd), the step guard must refuse K rows that together weigh more than one example, and
augmented rows must stay within the input bound.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import clipless as cl
from clipless.data import ImageAugmentation
from clipless.privacy.certified import BoundError
from clipless.privacy.optimizer import DPOptimizer

SHAPE = (1, 6, 6)
K = 3


@settings(max_examples=40, deadline=None)
@given(shift=st.integers(0, 4), flip=st.booleans(), seed=st.integers(0, 10_000), b=st.integers(0, 9))
def test_augmentations_never_increase_an_example_norm(shift, flip, seed, b) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 2, 5, 7, generator=g)
    out = ImageAugmentation(shift, flip)(x, g)
    assert out.shape == x.shape
    assert bool((out.flatten(1).norm(dim=1) <= x.flatten(1).norm(dim=1) * (1 + 1e-6)).all())
    if shift == 0 and not flip:
        assert torch.equal(out, x)


def test_augmentation_draws_from_its_generator_and_refuses_non_images() -> None:
    x = torch.randn(8, 1, 6, 6)
    a = ImageAugmentation(2, flip=True)
    first = a(x, torch.Generator().manual_seed(5))
    assert torch.equal(first, a(x, torch.Generator().manual_seed(5)))
    assert not torch.equal(first, a(x, torch.Generator().manual_seed(6)))
    with pytest.raises(ValueError, match="shape"):
        a(torch.randn(8, 36))
    with pytest.raises(ValueError, match="shift"):
        ImageAugmentation(-1)


def _setup(k=K, clip=None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, *SHAPE, generator=g)
    data = cl.ArrayDataset(x, torch.randint(0, 3, (64,), generator=g))
    layers = [nn.Flatten(), cl.LipschitzLinear(36, 16), cl.MaxMin(), cl.LipschitzLinear(16, 3)]
    if clip is not None:
        layers.append(clip)
    model = nn.Sequential(*layers)
    loss = cl.TauCrossEntropy(4.0)
    engine = cl.PrivacyEngine("rdp")
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=loss,
        noise_multiplier=1e-12, input_shape=SHAPE, batch_size=8.0, input_bound=6.0,
        augmentation_multiplicity=k, external_batches=True)
    return model, opt, loss, engine, x[:8], data.labels[:8]


def _rows(x, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([ImageAugmentation(2)(x, g) for _ in range(k)])


def test_the_mean_over_k_rows_is_released_and_each_example_gradient_is_within_the_bound() -> None:
    model, opt, loss, engine, x, y = _setup()
    rows = _rows(x)
    bound = opt.bound_engine.compute()
    params = list(model.parameters())
    index = {id(p): j for j, p in enumerate(params)}
    # true per-example gradients of the augmult objective: example i's mean over its K rows
    worst = 0.0
    for i in range(x.shape[0]):
        mine = rows[i::x.shape[0]]  # k-major layout: rows i, b + i, 2b + i
        grads = torch.autograd.grad(loss.per_example(model(mine), y[i].repeat(K)).mean(), params)
        for layer in bound.layers:
            norm = torch.sqrt(sum((grads[index[id(p)]] ** 2).sum() for p in layer.params))
            worst = max(worst, float(norm) / layer.bound)
    assert 0 < worst <= 1 + 1e-5
    opt.zero_grad()
    loss.per_example(model(rows), y.repeat(K)).view(K, -1).mean(0).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("objective", [
    lambda per: per.sum(),  # K rows of an example at weight 1 each: K times the per-example bound
    lambda per: per.view(K, -1).mean(0).sum() + per[0],  # one row weighted 1/K + 1
])
def test_rows_that_weigh_more_than_one_example_are_refused(objective) -> None:
    model, opt, loss, engine, x, y = _setup()
    opt.zero_grad()
    objective(loss.per_example(model(_rows(x)), y.repeat(K))).backward()
    with pytest.raises(BoundError, match="1/K"):
        opt.step()
    assert engine.accountant.steps == 0


def test_augmult_is_refused_with_adaptive_clipping_and_bad_values() -> None:
    clip = cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=5.0)
    with pytest.raises(ValueError, match="adaptive clipping"):
        _setup(clip=clip)
    for bad in (0, 1.5, -2):
        with pytest.raises(ValueError, match="augmentation_multiplicity"):
            _setup(k=bad)


def test_trainer_with_augmult_spends_the_same_budget_and_learns() -> None:
    torch.manual_seed(0)
    data = cl.load_digits(seed=0)
    runs = {}
    for k in (1, 2):
        torch.manual_seed(0)
        model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(64,))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = cl.PrivateTrainer(model, opt, cl.TauCrossEntropy(8.0), data.train, input_shape=data.input_shape,
                                    batch_size=256, delta=1e-5, epochs=6, target_epsilon=3.0, input_bound=8.0,
                                    noise_seed=0, test_data=data.test, progress=False, log=None,
                                    augmentation_multiplicity=k, augment=ImageAugmentation(1) if k > 1 else None)
        runs[k] = trainer.fit()
    assert runs[2].steps == runs[1].steps and runs[2].epsilon == runs[1].epsilon
    assert runs[2].test_accuracy > 0.3  # chance is 0.1


def test_trainer_refuses_augmult_on_vector_inputs_without_an_augment_function() -> None:
    x = torch.rand(32, 36)
    data = cl.ArrayDataset(x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (32,)))
    model = cl.lipschitz_mlp((36,), 3, hidden=(8,))
    with pytest.raises(ValueError, match="augment function"):
        cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(4.0), data,
                          input_shape=(36,), batch_size=8, delta=1e-5, epochs=1, noise_multiplier=1.0,
                          input_bound=1.0, progress=False, log=None, augmentation_multiplicity=2)


@pytest.mark.parametrize("k", [1, 2])
def test_trainer_augmented_rows_equal_to_an_undrawn_record_pass(k) -> None:
    """The step refuses a row equal to a training record the batch does not hold (a batch of another loader) and a
    row repeated more often than the batch holds it (x[idx]); the trainer's own augmented copies may look like
    either: here record 1, a single pixel at a corner, shifted off the image is the blank record 0, whether or not
    record 0 was drawn too. The trainer tells the optimizer which rows it derived from the batch, so every step of
    the run is released (before, a step with records 0 and 1 in the batch and record 1 shifted off was refused)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(16, *SHAPE, generator=gen)
    x = x / x.flatten(1).norm(dim=1)[:, None, None, None]
    x[0] = 0.0
    x[1] = 0.0
    x[1, 0, 0, 0] = 1.0
    data = cl.ArrayDataset(x, torch.randint(0, 3, (16,), generator=gen))
    torch.manual_seed(0)
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,))
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(4.0), data,
                                input_shape=SHAPE, batch_size=8, delta=1e-5, epochs=40, noise_multiplier=1.0,
                                target_epsilon=1e3, input_bound=1.0, progress=False, log=None,
                                augmentation_multiplicity=k, augment=ImageAugmentation(2))
    assert trainer.fit().steps == 80


def test_the_trainer_gives_an_augment_function_of_ones_own_each_row_alone(monkeypatch) -> None:
    """``PrivateTrainer(augment=f)`` called ``f`` on the whole part of the batch and declared what it returned as
    copies of the drawn records: an ``f`` that mixed rows (mixup with the next row, a batch mean) passed, and one
    added record moved every example's gradient.  ``f`` of one's own now sees one row at a time, so each augmented
    row is a function of its own record; ``ImageAugmentation``, which shifts each row alone, still sees the batch."""
    x = torch.rand(32, 36)
    data = cl.ArrayDataset(x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (32,)))
    seen = []

    def mixup(rows: torch.Tensor, generator) -> torch.Tensor:
        seen.append(len(rows))
        return 0.5 * rows + 0.5 * rows.roll(1, 0)  # the next row's half, or the row itself when it is alone

    rows, keep = [], DPOptimizer.derived_rows_
    # recorded from before make_private: the step refuses its own code replaced after it
    monkeypatch.setattr(DPOptimizer, "derived_rows_", lambda self, xs: (rows.append(xs.clone()), keep(self, xs))[1])
    for augment in (mixup, ImageAugmentation(1)):
        torch.manual_seed(0)
        shape = (36,) if augment is mixup else (1, 6, 6)
        records = data if augment is mixup else cl.ArrayDataset(data.features.view(32, 1, 6, 6), data.labels)
        model = cl.lipschitz_mlp(shape, 3, hidden=(8,))
        trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(4.0),
                                    records, input_shape=shape, batch_size=8, delta=1e-5, epochs=2,
                                    noise_multiplier=1.0, input_bound=1.0, progress=False, log=None,
                                    augmentation_multiplicity=2, augment=augment)
        rows.clear()
        assert trainer.fit().steps == 8
        if augment is mixup:
            assert seen and set(seen) == {1}  # one row per call: nothing to mix with
            for xs in rows:  # the mix of a row with itself is the row: every augmented row is a drawn record
                assert all(bool((r == data.features).all(1).any()) for r in xs)
