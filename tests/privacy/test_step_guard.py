"""The private step owns its inputs: slips in the README loop never release an unaccounted gradient.

Each test is a slip a user of ``make_private`` can make; before the step guard each one released a
step (and the accountant counted it) whose gradient was not what the noise was calibrated for.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import pickle
import warnings

import pytest
import torch
from torch import nn

import clipless as cl
from clipless.privacy.calibration import BudgetExhaustedError
from clipless.privacy.certified import BoundError
from clipless.privacy.modules import BoundedModule, LayerBound
from helpers import capture_released, per_example_grads

SHAPE = (6,)


def _setup(lr=0.1, noise=1.0, loss=None, model=None, optimizer_cls=torch.optim.SGD, **kw):
    """A batch built by hand (the first 16 records): each test checks one slip on a fixed batch."""
    kw.setdefault("external_batches", True)
    model, opt, loss, engine, data, _ = _setup_with_loader(lr, noise, loss, model, optimizer_cls, **kw)
    return model, opt, loss, engine, data.features[:16], data.labels[:16]


def _setup_with_loader(lr=0.1, noise=1.0, loss=None, model=None, optimizer_cls=torch.optim.SGD, data_wrapper=None,
                       **kw):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, *SHAPE, generator=gen)
    x = x / x.norm(dim=1, keepdim=True)
    data = cl.ArrayDataset(x, torch.randint(0, 3, (96,), generator=gen))
    model = model or nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    loss = loss or cl.TauCrossEntropy(2.0)
    engine = cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=optimizer_cls(model.parameters(), lr=lr),
        data=data if data_wrapper is None else data_wrapper(data), loss=loss,
        noise_multiplier=noise, input_shape=SHAPE, batch_size=16.0, input_bound=1.0, **kw)
    return model, opt, loss, engine, data, loader


def _honest_steps_until(opt, loss, model, loader, wanted):
    """Honest steps on the loader's batches until one satisfies ``wanted(bx, by)`` (a Poisson batch's size is
    secret: a slip needs a few rows); that batch is drawn, not stepped."""
    for bx, by in loader:
        if wanted(bx, by):
            return bx, by
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
    raise AssertionError("the loader's epoch ended before the wanted batch")


def _refused(opt, engine, match, released=None):
    """The step raises a BoundError naming the slip and the fix; nothing is released or accounted, and the model
    holds the weights it last released (``released``, by default the weights as they are before the step)."""
    steps = engine.accountant.steps
    weights = released or [p.detach().clone() for p in opt.bound_engine.model.parameters()]
    with pytest.raises(BoundError, match=match) as info:
        opt.step()
    assert engine.accountant.steps == steps
    assert all(torch.equal(a, p) for a, p in zip(weights, opt.bound_engine.model.parameters()))
    return str(info.value)


@pytest.mark.parametrize("how", ["microbatches", "physical_batches", "two_forwards_one_backward", "save_on_cpu"])
def test_readme_loop_and_microbatches_are_accepted(how):
    """One Poisson batch backpropagated in pieces gives the same sum: in two backwards, or as two forwards in one
    backward (a weight's gradient then arrives in parts, which the weight's check sums as autograd does); torch's
    save_on_cpu gives the backward the forward's exact values."""
    model, opt, loss, engine, x, y = _setup(noise=1e-12)
    released = capture_released(opt)
    expected = [g.sum(0) / 16.0 for g in per_example_grads(model, loss, x, y)]
    if how == "microbatches":
        loss.per_example(model(x[:7]), y[:7]).sum().backward()
        loss.per_example(model(x[7:]), y[7:]).sum().backward()
    elif how == "physical_batches":
        for xs, ys in cl.physical_batches(x, y, 5):
            loss.per_example(model(xs), ys).sum().backward()
    elif how == "two_forwards_one_backward":
        (loss.per_example(model(x[:5]), y[:5]).sum() + loss.per_example(model(x[5:]), y[5:]).sum()).backward()
    else:
        with torch.autograd.graph.save_on_cpu():
            out = model(x)
        loss.per_example(out, y).sum().backward()
    opt.step()
    got = [released[0][id(p)] for p in model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
    assert engine.accountant.steps == 1


def test_physical_batches_are_views_of_parts_of_at_most_the_size():
    x, y = torch.arange(22.0).view(11, 2), torch.arange(11)
    parts = cl.physical_batches(x, y, 4)
    assert [len(ys) for _, ys in parts] == [4, 4, 3]
    assert torch.equal(torch.cat([xs for xs, _ in parts]), x) and torch.equal(torch.cat([ys for _, ys in parts]), y)
    assert all(xs.data_ptr() == x[4 * i].data_ptr() for i, (xs, _) in enumerate(parts))  # no copies
    for size in (None, 11, 50):
        (whole,) = cl.physical_batches(x, y, size)
        assert whole[0] is x and whole[1] is y
    empty = cl.physical_batches(x[:0], y[:0], 4)  # an empty Poisson batch is one (empty) step
    assert len(empty) == 1 and empty[0][0].shape == (0, 2)
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_physical_batch_size must be an integer >= 1"):
            cl.physical_batches(x, y, bad)


# Finding 1: a step needs a fresh forward/backward
def test_step_twice_or_without_backward_refused():
    model, opt, loss, engine, x, y = _setup()
    _refused(opt, engine, "no backward of the private model since the last step")
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    message = _refused(opt, engine, "no backward")
    assert "run loss.per_example(model(x), y).sum().backward()" in message


def test_the_loader_loop_releases_one_new_batch_per_step_empty_batches_included():
    model, opt, loss, engine, _, loader = _setup_with_loader(noise=1e-12, lr=0.0)
    released = capture_released(opt)
    sizes = []
    for epoch in range(2):  # a new iterator per epoch, as in the README loop
        for bx, by in loader:
            opt.zero_grad()
            loss.per_example(model(bx), by).sum().backward()
            opt.step()
            sizes.append(len(bx))
    assert engine.accountant.steps == len(sizes) == 2 * len(loader) == loader.batches_drawn == len(released)


@pytest.mark.parametrize("slip", ["same_batch_twice", "two_batches_one_step", "skip_a_batch"])
def test_each_step_must_release_exactly_one_new_batch_of_the_loader(slip):
    """The accountant composes one Poisson sample per step: a second step on one batch, or one step on the sum of
    several batches (inclusion rate about 2q, an example possibly counted twice), is not what it accounts."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    batches = iter(loader)
    bx, by = next(batches)
    loss.per_example(model(bx), by).sum().backward()
    if slip == "same_batch_twice":
        opt.step()
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        _refused(opt, engine, "no new batch was drawn from the private loader")
    elif slip == "two_batches_one_step":
        bx, by = next(batches)
        loss.per_example(model(bx), by).sum().backward()
        _refused(opt, engine, "2 batches were drawn from the private loader since the last step")
    else:
        opt.step()
        next(batches)  # a loop that skips a batch (an empty one, say) reveals its size by the missing step
        bx, by = next(batches)
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        message = _refused(opt, engine, "2 batches were drawn from the private loader since the last step")
        assert "empty batches included" in message


def test_the_loaders_count_of_drawn_batches_cannot_be_set():
    """``loader.batches_drawn += 1`` before each step let one batch be released by any number of steps, which the
    accountant composed as fresh Poisson samples (three steps on one batch ran).  The count, and the drawn batch's
    rows and digests that the step checks, are read-only."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    for name, value in (("batches_drawn", loader.batches_drawn + 1), ("last_batch_rows", 0),
                        ("last_batch_digests", [])):
        with pytest.raises(AttributeError, match="no setter"):
            setattr(loader, name, value)
    opt.zero_grad()
    loss.per_example(model(bx), by).sum().backward()
    _refused(opt, engine, "no new batch was drawn from the private loader")


def _doubling(collate):
    def doubled(items):
        xb, yb = collate(items)
        return torch.cat([xb, xb]), torch.cat([yb, yb])
    return doubled


@pytest.mark.parametrize("part", ["batch_sampler", "collate_fn", "dataset"])
def test_the_loaders_sampler_collate_and_dataset_cannot_be_swapped(part):
    """Written into the loader's ``__dict__`` (or plainly, for ``collate_fn``), a full-batch sampler released all 96
    records in one step that the accountant composed at q = 1/6, and a collate that repeats every row released
    each record of the batch twice: its digests were those of the batch handed out, so the repeated-rows check
    passed. The loader's parts are part of the optimizer's settings."""
    model, opt, loss, engine, data, loader = _setup_with_loader()
    swapped = {"batch_sampler": torch.utils.data.BatchSampler(range(len(data)), len(data), False),
               "collate_fn": _doubling(loader.collate_fn),
               "dataset": cl.ArrayDataset(data.features.clone(), data.labels.clone())}[part]
    loader.__dict__[part] = swapped
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    _refused(opt, engine, "the loader's sampler, collate or dataset")


@pytest.mark.parametrize("source", ["shuffled_dataloader", "hand_built"])
def test_a_batch_not_drawn_from_the_private_loader_is_refused(source):
    """A user's own ``DataLoader(data, batch_size=16, shuffle=True)`` samples without replacement at a fixed
    size; the accountant composes Poisson samples.  Before, its batches were released and accounted as Poisson
    ones (4 steps: epsilon 0.24 at delta 1e-5 on the digits, README loop, no warning)."""
    model, opt, loss, engine, data, loader = _setup_with_loader()
    if source == "shuffled_dataloader":
        bx, by = next(iter(torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)))
    else:
        bx, by = data.features[:16], data.labels[:16]
    loss.per_example(model(bx), by).sum().backward()
    message = _refused(opt, engine, "not drawn from the Poisson loader that make_private returned")
    assert "external_batches=True" in message
    # the returned loader's batches are accepted after the refusal (the refused step spent nothing)
    opt.zero_grad()
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def test_external_batches_lifts_only_the_never_drawn_check():
    """``external_batches=True``: a loop that draws its own Poisson batches steps on them; once it draws from
    the returned loader, each step must still release exactly one new batch of it."""
    model, opt, loss, engine, data, loader = _setup_with_loader(external_batches=True)
    for _ in range(2):
        opt.zero_grad()
        loss.per_example(model(data.features[:16]), data.labels[:16]).sum().backward()
        opt.step()
    assert engine.accountant.steps == 2
    bx, by = next(iter(loader))
    opt.zero_grad()
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    opt.zero_grad()
    loss.per_example(model(bx), by).sum().backward()
    _refused(opt, engine, "no new batch was drawn from the private loader")


@pytest.mark.parametrize("slip", ["duplicated_row", "augmented_copy_without_multiplicity"])
def test_more_rows_than_the_drawn_batch_refused(slip):
    """Each row's loss weighs 1: an example in two rows has twice the certified sensitivity."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    bx, by = next(iter(loader))
    drawn = len(bx)
    if slip == "duplicated_row":
        bx, by = torch.cat([bx, bx[:1]]), torch.cat([by, by[:1]])
    else:
        bx, by = torch.cat([bx, -bx]), torch.cat([by, by])
    loss.per_example(model(bx), by).sum().backward()
    message = _refused(opt, engine, "carried more rows of the private model's output than K = 1 times the batch")
    assert "augmentation_multiplicity" in message
    assert str(drawn) not in message and str(len(bx)) not in message  # a Poisson batch's size is secret


def test_augmented_copies_with_their_multiplicity_are_accepted_and_a_part_of_the_batch_refused():
    """Declared copies, K per drawn example, pass; copies of a part of the batch (its first rows: fewer rows than
    drawn, none counting twice) passed too, but which rows enter is then the loop's choice."""
    model, opt, loss, engine, _, loader = _setup_with_loader(augmentation_multiplicity=2)
    for rows in (None, 3):  # the whole batch, then its first 3 rows
        bx, by = next(b for b in loader if len(b[1]) > 3)
        bx, by = bx[:rows], by[:rows]
        opt.zero_grad()
        opt.derived_rows_(torch.cat([bx, -bx]))  # the copies the loop made, one per example and copy
        per_row = loss.per_example(model(torch.cat([bx, -bx])), torch.cat([by, by]))
        per_row.view(2, -1).mean(0).sum().backward()
        if rows is None:
            opt.step()
        else:
            _refused(opt, engine, "left out of the step's forwards")
    assert engine.accountant.steps == 1


def _repeated(bx, by, slip):
    """The batch with record 0 repeated in place of others: as many rows as drawn, one record several times."""
    idx = torch.arange(len(bx))
    idx[: len(bx) // 2] = 0
    if slip == "resampled_then_normalized":  # a row-wise transform after the resampling: no row equals a drawn one
        xs = bx[idx]
        return 0.5 * xs / xs.norm(dim=1, keepdim=True), by[idx]
    return bx[idx], by[idx]


@pytest.mark.parametrize("slip", ["resampled_by_index", "resampled_then_normalized", "in_two_micro_batches",
                                  "more_copies_than_the_multiplicity"])
def test_a_record_repeated_inside_the_batch_refused(slip):
    """Class balancing by index (``x[idx]``) keeps the row count but weighs a record once per copy: its gradient is
    that many times the certified per-example bound.  Caught by exact row digests of the forwards' inputs against
    the drawn batch (a random perturbation of each copy would hide them: the README says so)."""
    k = 2 if slip == "more_copies_than_the_multiplicity" else 1
    model, opt, loss, engine, _, loader = _setup_with_loader(augmentation_multiplicity=k)
    bx, by = next(iter(loader))
    while len(bx) < 4:  # a Poisson batch (secret sampling): repeats need a few rows
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
        bx, by = next(iter(loader))
    steps = engine.accountant.steps
    if slip == "in_two_micro_batches":  # record 0 in both micro-batches, rows as drawn
        loss.per_example(model(bx[:-1]), by[:-1]).sum().backward()
        loss.per_example(model(bx[:1]), by[:1]).sum().backward()
    elif slip == "more_copies_than_the_multiplicity":  # K = 2 rows per example, record 0 in half of the second
        xs, ys = _repeated(bx, by, "resampled_by_index")
        per_row = loss.per_example(model(torch.cat([bx, xs])), torch.cat([by, ys]))
        per_row.view(2, -1).mean(0).sum().backward()
    else:
        xs, ys = _repeated(bx, by, slip)
        loss.per_example(model(xs), ys).sum().backward()
    message = _refused(opt, engine, "entered the private model's forwards in more rows than K")
    assert "x[idx]" in message and engine.accountant.steps == steps


class _RecordsReadOneByOne(torch.utils.data.Dataset):
    """The same records, not in memory: make_private reads them once to check them."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


@pytest.mark.parametrize("slip", ["own_loader_zipped", "replaced_by_index", "micro_batch_from_the_dataset",
                                  "not_in_memory"])
def test_training_records_the_batch_does_not_hold_refused(slip):
    """Rows of the forwards that are training records the Poisson loader did not draw for this step: the batches of
    a DataLoader of one's own zipped with the private loader (which counts the steps), or a row replaced by a record
    taken from the dataset by index. Each such record is trained on at every such step, not at rate q. With no more
    rows than drawn and no row repeated, these steps were released; the records' digests (taken when make_private
    checks them, for data in memory or read) now tell them apart from transformed rows."""
    model, opt, loss, engine, data, loader = _setup_with_loader(
        data_wrapper=_RecordsReadOneByOne if slip == "not_in_memory" else None)
    bx, by = _honest_steps_until(opt, loss, model, loader, lambda bx, by: len(bx) >= 2)
    drawn = {tuple(r.tolist()) for r in bx}
    undrawn = [j for j in range(len(data)) if tuple(data.features[j].tolist()) not in drawn]
    opt.zero_grad()
    if slip == "own_loader_zipped":
        mine = torch.utils.data.DataLoader(data, batch_size=1, shuffle=True)
        x2, y2 = next(iter(mine))
        while tuple(x2[0].tolist()) in drawn:
            x2, y2 = next(iter(mine))
        loss.per_example(model(x2), y2).sum().backward()
    elif slip == "micro_batch_from_the_dataset":
        loss.per_example(model(bx[:-1]), by[:-1]).sum().backward()
        loss.per_example(model(data.features[undrawn[:1]]), data.labels[undrawn[:1]]).sum().backward()
    else:
        xs = bx.clone()
        xs[0] = data.features[undrawn[0]]
        loss.per_example(model(xs), by).sum().backward()
    message = _refused(opt, engine, "is a training record that the batch drawn from the private loader does not hold")
    assert "DataLoader of your own" in message


@pytest.mark.parametrize("slip", ["earlier_batch_again", "earlier_rows_mixed_in"])
def test_records_not_read_an_earlier_batchs_row_refused(slip):
    """With check_records=False the records are not read, so no digest of the training set tells an undrawn record
    from a transformed row: a batch kept and trained on again at a later step (or some of its rows mixed into the
    next batch) was released, each of its records trained on at more steps than the rate q says. The rows of every
    released batch are now remembered; a later step whose forwards see one that its own batch does not hold is
    refused. A plain loop over many steps is not (records drawn again in later batches included)."""
    model, opt, loss, engine, data, loader = _setup_with_loader(data_wrapper=_RecordsReadOneByOne,
                                                                check_records=False)
    kept = None
    epochs = (batch for _ in range(10) for batch in loader)  # six batches an epoch
    for step, (bx, by) in enumerate(epochs):
        if kept is not None and len(bx) >= 2 and step >= 12:
            held = {tuple(r.tolist()) for r in bx}
            if not all(tuple(r.tolist()) in held for r in kept[0]):
                break
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
        if len(bx) >= 2:
            kept = (bx, by)
    assert engine.accountant.steps >= 12  # the plain loop passed, many records drawn in several of its batches
    opt.zero_grad()
    if slip == "earlier_batch_again":
        n = min(len(bx), len(kept[0]))
        loss.per_example(model(kept[0][:n]), kept[1][:n]).sum().backward()
    else:
        xs = bx.clone()
        outside = [r for r in kept[0] if not any(torch.equal(r, b) for b in bx)]
        xs[0] = outside[0]
        loss.per_example(model(xs), by).sum().backward()
    _refused(opt, engine, "is a training record that the batch drawn from the private loader does not hold")


def test_declaring_more_derived_rows_than_the_drawn_copies_refused():
    """derived_rows_ exempts rows made from the drawn batch (augmented copies) from both row checks; declaring the
    whole dataset there (an augmentation of the wrong tensor, or a shortcut past the refusal above) let a step train
    on undrawn records. At most K rows per drawn example may be declared; K copies pass, in one call or several."""
    model, opt, loss, engine, data, loader = _setup_with_loader(augmentation_multiplicity=2)
    for bx, by in loader:
        if len(bx) >= 2:
            break
    opt.derived_rows_(torch.cat([bx, bx]))  # the trainer's K = 2 augmented copies: accepted
    with pytest.raises(BoundError, match="derived_rows_ was given more rows than K = 2 copies of the batch drawn"):
        opt.derived_rows_(bx[:1])
    bx, by = next(iter(loader))
    while len(bx) == 0 or len(bx) >= len(data) // 2:
        bx, by = next(iter(loader))
    opt.derived_rows_(bx)
    opt.derived_rows_(bx)  # two calls of one copy each
    with pytest.raises(BoundError, match="more rows than K = 2 copies"):
        opt.derived_rows_(data.features)


def _dataset_with_duplicate_records():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, *SHAPE, generator=gen)
    x = x / x.norm(dim=1, keepdim=True)
    return cl.ArrayDataset(torch.cat([x, x, x]), torch.randint(0, 3, (24,), generator=gen).repeat(3))


@pytest.mark.parametrize("how", ["permuted", "normalized", "duplicate_records_in_the_data",
                                 "duplicate_records_normalized", "identical_augmented_copies"])
def test_rows_repeated_no_more_than_the_batch_holds_them_are_accepted(how):
    """A permutation or a row-wise transform of the drawn batch, records the data holds several times (three equal
    records are three people), and K identical rows per example with augmentation_multiplicity=K all pass."""
    k = 2 if how == "identical_augmented_copies" else 1
    if how.startswith("duplicate_records"):
        torch.manual_seed(0)
        model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
        loss, engine = cl.TauCrossEntropy(2.0), cl.PrivacyEngine("rdp")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=_dataset_with_duplicate_records(),
            loss=loss, noise_multiplier=1.0, input_shape=SHAPE, batch_size=60.0, input_bound=1.0)
    else:
        model, opt, loss, engine, _, loader = _setup_with_loader(augmentation_multiplicity=k)
    for _ in range(3):
        bx, by = next(iter(loader))
        opt.zero_grad()
        if how == "permuted":
            perm = torch.randperm(len(bx))
            bx, by = bx[perm], by[perm]
        elif how in ("normalized", "duplicate_records_normalized"):
            bx = 0.5 * bx
            opt.derived_rows_(bx)  # a row-wise transform in the loop, declared
        if k == 2:
            loss.per_example(model(torch.cat([bx, bx])), torch.cat([by, by])).view(2, -1).mean(0).sum().backward()
        else:
            loss.per_example(model(bx), by).sum().backward()
        opt.step()
    assert engine.accountant.steps == 3


def _mixed(bx, how):
    """Rows of the drawn batch mixed across records by the loop, as many as drawn."""
    if how == "mixup":  # each row a convex combination of two records
        return 0.7 * bx + 0.3 * bx.roll(1, 0)
    if how == "batch_mean_subtracted":  # every row moves with every record
        return 0.5 * (bx - bx.mean(0, keepdim=True))  # halved: within the input bound
    if how == "one_row_mixed":  # one row of the batch mixed with another, the rest as drawn
        return torch.cat([0.5 * (bx[:1] + bx[1:2]), bx[1:]])
    return bx * (1 - 1e-6)  # a row-wise rescaling made without saying so: refused the same way


@pytest.mark.parametrize("how", ["mixup", "batch_mean_subtracted", "one_row_mixed", "undeclared_rescaling"])
def test_rows_mixed_from_several_records_refused(how):
    """A row mixed from two records (mixup in the loop) or a batch statistic subtracted from every row carries
    several records: removing one moves several rows' gradients, beyond the certified per-example bound. No digest
    tells a mixed row from a row-wise transform of one record, so every forward row must be a drawn row or one the
    loop declared with derived_rows_; a row made without saying so is refused, naming both fixes."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    bx, by = _honest_steps_until(opt, loss, model, loader, lambda bx, by: len(bx) >= 2)
    opt.zero_grad()
    loss.per_example(model(_mixed(bx, how)), by).sum().backward()
    message = _refused(opt, engine, "neither a row of the batch drawn from the private loader nor one declared")
    assert "mixup" in message and "__getitem__" in message and "derived_rows_" in message
    # declared, the same rows are the loop's own statement that each is made from one record, and pass
    for bx, by in loader:
        opt.zero_grad()
        x = _mixed(bx, how) if len(bx) >= 2 else bx
        opt.derived_rows_(x)
        loss.per_example(model(x), by).sum().backward()
        opt.step()
        break
    assert engine.accountant.steps >= 1


@pytest.mark.parametrize("how", ["shuffled", "rolled", "one_label_for_all", "one_row_relabelled"])
def test_labels_taken_from_other_records_refused(how):
    """A row's loss target is part of its record: labels shuffled apart from their inputs, or one record's label
    given to every row, put one record into several examples' losses (removing it moves each), beyond the
    per-example bound. Checked on (input, label) digest pairs against the drawn batch's."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    bx, by = _honest_steps_until(opt, loss, model, loader, lambda bx, by: len(bx) >= 2 and len(set(by.tolist())) >= 2)
    opt.zero_grad()
    first_other = int((by != by[0]).nonzero()[0])
    ys = {"shuffled": by.flip(0), "rolled": by.roll(1),
          "one_label_for_all": by[:1].expand_as(by).clone(),
          "one_row_relabelled": torch.cat([by[first_other:first_other + 1], by[1:]])}[how]
    if how in ("shuffled", "rolled") and torch.equal(ys, by):  # a batch whose labels read the same either way
        ys = torch.cat([by[first_other:first_other + 1], by[1:]])
    loss.per_example(model(bx), ys).sum().backward()
    message = _refused(opt, engine, "entered the loss with another label than its record's")
    assert "Dataset" in message and "derived_rows_" in message
    # the model's own predictions as targets (computed from each row alone) pass once declared with their rows
    bx, by = _honest_steps_until(opt, loss, model, loader, lambda bx, by: len(bx) >= 1)
    opt.zero_grad()
    with torch.no_grad():
        predicted = model(bx).argmax(1)
    opt.derived_rows_(bx)
    steps = engine.accountant.steps
    loss.per_example(model(bx), predicted).sum().backward()
    opt.step()
    assert engine.accountant.steps == steps + 1


@pytest.mark.parametrize("target", ["y rolled", "second column rolled", "y", "second column"])
def test_labels_of_a_batch_with_more_columns_are_checked_too(target):
    """A dataset of ``(x, y, g)`` records (a sample weight, a group): the label check applied only to batches of
    inputs and one label tensor, so ``y.roll(1)`` was released there.  Now a loss target may be any of the record's
    own columns, and a target taken from another record is refused."""
    groups = lambda d: torch.utils.data.TensorDataset(d.features, d.labels, (torch.arange(96) * 7) % 3)  # noqa: E731
    model, opt, loss, engine, _, loader = _setup_with_loader(data_wrapper=groups)
    for bx, by, bg in loader:
        if len(bx) >= 2 and len(set(by.tolist())) >= 2 and len(set(bg.tolist())) >= 2:
            break
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
    column = by if target.startswith("y") else bg
    targets = column.roll(1) if target.endswith("rolled") else column
    if target.endswith("rolled") and torch.equal(targets, column):  # a batch that reads the same rolled
        targets = column.flip(0) if not torch.equal(column.flip(0), column) else (column + 1) % 3
    opt.zero_grad()
    loss.per_example(model(bx), targets).sum().backward()
    if target.endswith("rolled"):
        _refused(opt, engine, "entered the loss with another label than its record's")
    else:  # each row's own column
        steps = engine.accountant.steps
        opt.step()
        assert engine.accountant.steps == steps + 1


@pytest.mark.parametrize("weights", ["own", "own in physical parts", "rolled", "normalized", "declared rows",
                                     "max, then own", "own, then max"])
def test_a_records_own_weight_passes_and_weights_from_other_records_are_refused(weights):
    """A sample weight in [0, 1] that is part of each record (``(x, y, w)``, ``(loss * w).sum()``) moves that
    record's gradient alone, within its bound: it was refused with the weights that depend on other examples, as
    they could not be told apart.  The step now pairs each row's weight with its input and accepts a weight that is
    its own record's column; a weight of another row, or normalized over the batch, is still refused."""
    column = lambda d: torch.utils.data.TensorDataset(  # noqa: E731
        d.features, d.labels, torch.rand(96, generator=torch.Generator().manual_seed(2)))
    model, opt, loss, engine, _, loader = _setup_with_loader(data_wrapper=column)
    for bx, by, bw in loader:
        if len(bx) >= 4:
            break
        opt.zero_grad()
        (loss.per_example(model(bx), by) * bw).sum().backward()
        opt.step()
    opt.zero_grad()
    if weights == "own in physical parts":
        for part in (slice(0, 2), slice(2, None)):
            (loss.per_example(model(bx[part]), by[part]) * bw[part]).sum().backward()
    else:
        w = {"rolled": bw.roll(1), "normalized": bw / bw.max()}.get(weights, bw)
        x = bx
        if weights == "declared rows":
            x = 0.5 * bx
            opt.derived_rows_(x)
        out = model(x)
        total = (loss.per_example(out, by) * w).sum()
        if "max" in weights:  # two losses on one output, each weighing rows unevenly: both are checked (the
            # second one's weights replaced the first's, so one order was released)
            top = 1e-3 * loss.per_example(out, by).max()  # small: each row's total weight stays below 1
            total = (top + total) if weights.startswith("max") else (total + top)
        total.backward()
    if weights.startswith("own") and "max" not in weights:
        steps = engine.accountant.steps
        opt.step()
        assert engine.accountant.steps == steps + 1
    else:
        message = _refused(opt, engine, "entered the backward with weights other than")
        assert "(loss.per_example(model(x), y) * w).sum()" in message


def test_labels_as_drawn_in_another_integer_type_or_with_their_rows_permuted_are_accepted():
    """The label by value (a uint8 copy of int64 labels is the same label); inputs and labels permuted together;
    two equal inputs of the data with different labels may swap them (the same records); declared rows are the
    loop's word and keep any label."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    for i, (bx, by) in enumerate(loader):
        opt.zero_grad()
        perm = torch.randperm(len(bx))
        x, y = (bx, by.to(torch.uint8)) if i == 0 else (bx[perm], by[perm]) if i == 1 else (0.5 * bx, by.flip(0))
        if i == 2:
            opt.derived_rows_(x)
        loss.per_example(model(x), y).sum().backward()
        opt.step()
        if i == 2:
            break
    torch.manual_seed(0)
    model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    x = _dataset_with_duplicate_records().features[:24]
    data = cl.ArrayDataset(torch.cat([x, x]), torch.cat([torch.zeros(24), torch.ones(24)]).long())
    engine = cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=loss,
        noise_multiplier=1.0, input_shape=SHAPE, batch_size=40.0, input_bound=1.0)
    for bx, by in loader:  # each input twice in the data, with labels 0 and 1: swapping them keeps the records
        pairs = {}
        for j, row in enumerate(bx):
            pairs.setdefault(tuple(row.tolist()), []).append(j)
        y = by.clone()
        for rows in pairs.values():
            if len(rows) == 2:
                y[rows] = by[rows].flip(0)
        opt.zero_grad()
        loss.per_example(model(bx), y).sum().backward()
        opt.step()
        break
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("how", ["max", "trimmed", "softmax_weights", "first_rows_by_position"])
def test_loss_weights_that_depend_on_other_examples_refused(how):
    """Which example gets which weight may not depend on the others: under max(), a sum without the largest losses,
    softmax weights or a selection by position, one added record moves the weight (or the selection) onto another
    example, a change of up to twice the certified bound. Such weights differ between examples of one label (weights
    even within labels are refused too: next test)."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    def shared_labels(bx, by):  # every label at least twice, and one in both halves: the refusal is certain
        labels = by.tolist()
        half = len(labels) // 2
        return len(labels) >= 4 and min(labels.count(c) for c in labels) >= 2 and bool(
            set(labels[:half]) & set(labels[half:]))

    bx, by = _honest_steps_until(opt, loss, model, loader, shared_labels)
    opt.zero_grad()
    values = loss.per_example(model(bx), by)
    reduce = {"max": lambda v: v.max(), "trimmed": lambda v: v.sort()[0][:-1].sum(),
              "softmax_weights": lambda v: (v * torch.softmax(v.detach(), 0)).sum(),
              "first_rows_by_position": lambda v: v[: len(v) // 2].sum()}[how]
    reduce(values).backward()
    message = _refused(opt, engine, "entered the backward with weights other than")
    assert "sum()" in message


@pytest.mark.parametrize("how", ["scaled to zero", "halved", "class weights", "class-weighted mean",
                                 "mean of each part", "a part summed, a part scaled"])
def test_loss_weights_set_by_the_loop_are_refused_even_when_even_within_labels(how):
    """Weights equal within each label passed: the loop could set them from the batch it sees (a scale of 0 when a
    target record is in the batch, a label's weight from the batch's majority label, a mean weighted by the batch's
    class weights, which moves every weight when one record is added: up to twice the bound, or more), and no check
    can tell a constant from such a choice at the first step.  Only the sum's 1, the mean's 1/n over the step's rows
    and 1/K per augmented row are accepted, or each record's own weight column."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    bx, by = _honest_steps_until(opt, loss, model, loader, lambda bx, by: len(by) >= 4 and len(set(by.tolist())) > 1)
    opt.zero_grad()
    half = len(bx) // 2
    if how in ("mean of each part", "a part summed, a part scaled"):
        first = loss.per_example(model(bx[:half]), by[:half])
        second = loss.per_example(model(bx[half:]), by[half:])
        if how == "mean of each part":  # the step's rows are n, each part's mean weighs its rows 1/|part|
            (first.mean() + second.mean()).backward()
        else:  # one even weight per forward, but which rows get which is the loop's choice
            (first.sum() + 0.5 * second.sum()).backward()
    else:
        values = loss.per_example(model(bx), by)
        class_weights = torch.tensor([1.0, 0.25, 0.5])[by]
        {"scaled to zero": lambda: (0.0 * values.sum()), "halved": lambda: 0.5 * values.sum(),
         "class weights": lambda: (values * class_weights).sum(),
         "class-weighted mean": lambda: (values * class_weights).sum() / class_weights.sum()}[how]().backward()
    message = _refused(opt, engine, "entered the backward with weights other than")
    assert "a column of each record" in message and str(len(bx)) not in message
    for reduce in (lambda v: v.mean(), lambda v: v.sum(), lambda v: v.sum() / v.shape[0]):  # then these pass
        bx, by = next(iter(loader))
        opt.zero_grad()
        reduce(loss.per_example(model(bx), by)).backward()
        steps = engine.accountant.steps
        opt.step()
        assert engine.accountant.steps == steps + 1


def test_the_mean_moves_the_released_sum_by_at_most_the_bound_and_a_weighted_mean_by_more():
    """Why the mean passes and a class-weighted mean does not: with true per-example gradients from autograd,
    adding one record to a batch moves the mean's gradient by at most ``2C/(n+1) <= C``; with class weights
    normalized by the batch's sum of weights, a record of a heavy class added to a batch of light ones moves it by
    nearly ``2C``."""
    model, opt, loss, engine, data, _ = _setup_with_loader()
    grads = per_example_grads(model, loss, data.features[:40], data.labels[:40])
    flat = torch.cat([g.flatten(1) for g in grads], dim=1).double()
    bound = opt.bound_engine.compute().global_sensitivity
    assert float(flat.norm(dim=1).max()) <= bound * (1 + 1e-5)
    gen = torch.Generator().manual_seed(5)
    worst_mean = 0.0
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        rows = torch.randperm(40, generator=gen)[: n + 1]
        batch, added = flat[rows[:n]], flat[rows[n]]
        moved = (torch.cat([batch, added[None]]).mean(0) - batch.mean(0)).norm()
        worst_mean = max(worst_mean, float(moved) / bound)
    assert worst_mean <= 1.0
    light, heavy = flat[0], -flat[0]  # a light record alone, then a heavy one pointing the other way
    weights = torch.tensor([1e-3, 1.0], dtype=torch.float64)
    weighted = (weights[0] * light + weights[1] * heavy) / weights.sum()
    assert float((weighted - light).norm()) > 1.9 * float(light.norm())


@pytest.mark.parametrize("how", ["hardest half by a first pass", "the last part skipped",
                                 "rows of the batch's majority label", "a declared copy of half the rows",
                                 "a zero weight column instead", "fewer than K copies, averaged over all rows"])
def test_rows_left_out_of_the_step_by_the_loop_are_refused(how):
    """Hard example mining (a no-grad pass, then a forward of the rows with the largest losses) trained each chosen
    row once at weight 1 and passed, but which rows enter the step depends on the others: one added record can push
    another out, a change of up to twice the bound. Every drawn row must now enter a forward; filtering by a
    record's own values belongs in the Dataset or in a weight column of 0."""
    column = lambda d: torch.utils.data.TensorDataset(d.features, d.labels, torch.ones(96))  # noqa: E731
    k = 2 if how.startswith("fewer than K") else 1
    model, opt, loss, engine, _, loader = _setup_with_loader(data_wrapper=column, augmentation_multiplicity=k)
    for bx, by, bw in loader:
        if len(by) >= 4 and len(set(by.tolist())) > 1:
            break
        opt.zero_grad()
        per_row = loss.per_example(model(torch.cat([bx] * k)), torch.cat([by] * k))
        (per_row.view(k, -1).mean(0) if k > 1 else per_row).sum().backward()
        opt.step()
    opt.zero_grad()
    if k > 1:  # the second copy of half the rows only: the mean's 1/n then weighs a row count the loop chose
        x, y = torch.cat([bx, bx[: len(by) // 2]]), torch.cat([by, by[: len(by) // 2]])
        loss.per_example(model(x), y).mean().backward()
        _refused(opt, engine, "left out of the step's forwards")
        return
    if how == "hardest half by a first pass":
        with torch.no_grad():
            scores = loss.per_example(model(bx), by)
        rows = scores.argsort(descending=True)[: len(by) // 2]
    elif how == "the last part skipped":
        rows = torch.arange(len(by) - 1)
    elif how == "rows of the batch's majority label":
        rows = (by == by.mode().values).nonzero().flatten()
    if how == "a zero weight column instead":
        weights = bw.clone()
        weights[len(by) // 2:] = 0.0  # not the records' own column: refused as loss weights set by the loop
        (loss.per_example(model(bx), by) * weights).sum().backward()
        _refused(opt, engine, "entered the backward with weights other than")
        return
    elif how == "a declared copy of half the rows":  # rows the loop makes are its word, one per example at least
        rows = torch.arange(len(by) // 2)
        opt.derived_rows_(bx[rows] * 0.5)
        bx = bx.clone()
        bx[rows] *= 0.5
    loss.per_example(model(bx[rows]), by[rows]).sum().backward()
    message = _refused(opt, engine, "left out of the step's forwards")
    assert "Dataset" in message


class _ScaledLoss(cl.TauCrossEntropy):
    """A user's loss with an attribute the loop might set (from the batch, say)."""
    scale = 1.0

    def per_example(self, logits, target):
        return super().per_example(logits, target) * self.scale


@pytest.mark.parametrize("change", ["tau from the batch", "attribute set in the loop", "class attribute",
                                    "list edited in place", "another class", "an equal copy"])
def test_a_loss_other_than_the_declared_one_or_changed_since_is_refused(change):
    """A loss with the declared constant but another temperature passed (``TauCrossEntropy``'s constant is sqrt(2)
    at every tau), and so did a loss whose attribute the loop set: a temperature or scale set from the batch makes
    every example's loss depend on the others.  Every loss applied must now equal the one given to make_private
    (class, constants, attributes); an equal copy passes."""
    declared = _ScaledLoss(2.0)
    declared.factors = [1.0, 1.0]
    model, opt, loss, engine, _, loader = _setup_with_loader(loss=declared)
    bx, by = _honest_steps_until(opt, loss, model, loader, lambda bx, by: len(by) >= 2)
    opt.zero_grad()
    used = {"tau from the batch": lambda: _ScaledLoss(tau=0.5 + float((by == 1).float().mean())),
            "another class": lambda: cl.TauCrossEntropy(2.0), "an equal copy": lambda: copy.deepcopy(declared)}.get(
        change, lambda: declared)()
    if change == "attribute set in the loop":
        declared.scale = 0.5
    elif change == "class attribute":
        _ScaledLoss.scale = 0.5
    elif change == "list edited in place":
        declared.factors[1] = 0.5
    try:
        used.per_example(model(bx), by).sum().backward()
    finally:
        _ScaledLoss.scale = 1.0
    if change == "an equal copy":
        steps = engine.accountant.steps
        opt.step()
        assert engine.accountant.steps == steps + 1
    else:
        _refused(opt, engine, "another loss than the one given to make_private")


class _Coupled(cl.TauCrossEntropy):
    how = "centered"

    def per_example(self, logits, target):
        if self.how == "centered":  # the logits centred on the batch's mean
            return super().per_example(logits - logits.mean(0) + logits.mean(0).detach(), target)
        values = super().per_example(logits, target)
        if self.how == "normalized":  # each loss weighed by its share of the batch's largest
            return values * (values.detach() / values.detach().max())
        if self.how == "needs two rows":
            return values * float(len(values) > 1)
        if self.how == "one row raises":
            if len(values) < 2:
                raise ValueError("a batch of one")
            return values
        if self.how == "mixed with torch's cross entropy":
            return 0.5 * values + 0.5 * torch.nn.functional.cross_entropy(logits, target, reduction="none")
        return values if float(values.detach().sum()) >= 0 else -values  # a branch vmap cannot run: rows one at a time


@pytest.mark.parametrize("how", ["centered", "normalized", "needs two rows", "one row raises",
                                 "mixed with torch's cross entropy", "branch on a value"])
def test_a_custom_loss_whose_examples_depend_on_each_other_is_refused(how):
    """A user's ``per_example`` may compute from the whole batch (logits centred on the batch mean, losses
    normalized by the batch's): each example's gradient then depends on the others, which no bound covers.  The
    step recomputes a custom loss on each row alone and compares the gradients it sent; losses computed row by row
    pass, also where vmap cannot run them."""
    declared = _Coupled(1.0)
    declared.how = how
    model, opt, loss, engine, _, loader = _setup_with_loader(loss=declared)
    if how in ("mixed with torch's cross entropy", "branch on a value"):  # every step of an epoch released
        for bx, by in loader:
            opt.zero_grad()
            loss.per_example(model(bx), by).sum().backward()
            opt.step()
        assert engine.accountant.steps == len(loader)
        return
    bx, by = next(b for b in loader if len(b[1]) >= 2)
    opt.zero_grad()
    loss.per_example(model(bx), by).sum().backward()
    message = _refused(opt, engine, "couples the examples of a batch")
    assert "_Coupled" in message


class _CustomLayer(BoundedModule):
    """A parameter-free layer of a user's, 1-Lipschitz on each example alone."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "centered on the batch":
            return x - x.mean(0, keepdim=True) + x.mean(0, keepdim=True).detach()  # values kept, gradients coupled
        if self.how == "gated by the batch":
            return x * (x.detach().mean() > 0).to(x.dtype)
        if self.how == "scaled by the batch's size":
            return x / x.shape[0] ** 0.5
        return 0.5 * x  # "per example"

    def layer_bound(self, x_bound, in_shape):
        return LayerBound(lipschitz=1.0, out_bound=x_bound)


class _CustomSequential(nn.Sequential):
    """A user's container class (one that overrides the forward is refused by the bound engine)."""


@pytest.mark.parametrize("how", ["centered on the batch", "gated by the batch", "scaled by the batch's size",
                                 "per example", "a container"])
def test_a_custom_layer_whose_examples_depend_on_each_other_is_refused(how):
    """A layer class of the user's (a ``BoundedModule``) may read the whole batch (a batch mean subtracted, a gate
    or a scale set by a batch statistic): each example's gradient then depends on the others, beyond the certified
    bound, while its declared constants hold row by row.  With such classes in the model, the step recomputes some
    rows alone and the rest together and compares the gradient sum; layers that compute each row from itself
    pass."""
    first, second = cl.LipschitzLinear(6, 8), cl.LipschitzLinear(8, 3)
    if how == "a container":
        model = _CustomSequential(first, cl.MaxMin(), second)
    else:
        model = nn.Sequential(first, _CustomLayer(how), cl.MaxMin(), second)
    model, opt, loss, engine, _, loader = _setup_with_loader(model=model)
    honest = how in ("per example", "a container")
    for bx, by in loader:
        if len(by) < 2:
            continue
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        if honest:
            steps = engine.accountant.steps
            opt.step()
            assert engine.accountant.steps == steps + 1
            continue
        message = _refused(opt, engine, "couple the examples of a batch")
        assert "_CustomLayer" in message
        break


def test_row_digests_use_the_same_weights_on_every_device():
    """The loader digests its batch on the CPU and the step digests the forward's rows where they run: on a GPU the
    weights were drawn afresh per device, so no row of a CUDA forward ever matched the batch and the row checks
    (repeats, undrawn records) were blind there. Two device keys now share one draw (checked here with "cpu" and
    "cpu:0", two keys of one device; the products are exact integers, so the digests agree across devices)."""
    from clipless.privacy.input_guard import _digest_weights

    host = _digest_weights(17, 11, 3, torch.device("cpu"))
    other = _digest_weights(17, 11, 3, torch.device("cpu", 0))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(host, other))


@pytest.mark.parametrize("shape", [(3, 5), (3, 40, 40)])  # short rows: 32-bit words; long ones: 16-bit words
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.uint8, torch.int64, torch.bool])
def test_row_digests_depend_only_on_a_rows_bytes(dtype, shape):
    from clipless.privacy.input_guard import row_digests, rows_repeated

    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(40, *shape, generator=gen) * 3).to(dtype)
    digests = row_digests(rows)
    assert len(set(digests.tolist())) == len({tuple(r.flatten().tolist()) for r in rows})
    perm = torch.randperm(40, generator=gen)
    assert torch.equal(row_digests(rows[perm]), digests[perm])  # position and batch do not matter
    assert torch.equal(row_digests(torch.cat([rows[5:9], rows])[4:]), digests)
    assert not rows_repeated(row_digests(rows[perm]), [digests], 1)
    repeated = rows.clone()
    repeated[1] = repeated[0]
    unique_rows = len({tuple(r.flatten().tolist()) for r in rows}) == 40
    assert rows_repeated(row_digests(repeated), [digests], 1) == unique_rows
    assert not rows_repeated(row_digests(torch.cat([rows, rows])), [digests], 2)
    assert rows_repeated(row_digests(torch.cat([rows, rows, rows[:1]])), [digests], 2)
    edited = rows.clone()
    before = row_digests(edited)
    edited[0] = edited[1]  # in place: a digest kept for the tensor must not be reused
    assert row_digests(edited)[0] == before[1]


def test_rows_beyond_refuses_unknown_values_and_repeats_past_k_times_the_reference():
    from clipless.privacy.input_guard import rows_beyond

    ref = torch.tensor([5, 7, 7, -3])
    assert not rows_beyond(torch.tensor([7, 5, -3, 7]), ref, 1)  # the reference permuted
    assert not rows_beyond(torch.zeros(0, dtype=torch.long), ref, 1)
    assert rows_beyond(torch.tensor([5, 5]), ref, 1)  # 5 is there once
    assert not rows_beyond(torch.tensor([5, 5, 7, 7, 7, 7]), ref, 2)
    assert rows_beyond(torch.tensor([5, 5, 5]), ref, 2)
    assert rows_beyond(torch.tensor([6]), ref, 3)  # never there
    assert rows_beyond(torch.tensor([6]), torch.zeros(0, dtype=torch.long), 1)
    assert rows_beyond(torch.tensor([2**62]), ref, 1)  # past the reference's largest value


def test_a_float64_row_that_float32_holds_is_digested_as_its_float32_record():
    """A batch cast to a float64 model is the same records: each such row gets its float32 digest, row by row, so
    a part of a batch that mixes exact and inexact rows digests as the whole does; a row float32 cannot hold (or a
    NaN) keeps its own."""
    from clipless.privacy.input_guard import row_digests

    gen = torch.Generator().manual_seed(4)
    single = torch.randn(30, 5, generator=gen)
    assert torch.equal(row_digests(single.double()), row_digests(single))
    mixed = single.double()
    mixed[::3, 0] += 1e-12  # rows 0, 3, 6, ... no longer float32 values
    digests = row_digests(mixed)
    exact = torch.ones(30, dtype=torch.bool)
    exact[::3] = False
    assert torch.equal(digests[exact], row_digests(single)[exact])
    assert not torch.isin(digests[~exact], row_digests(single)).any()
    # parts: all exact, none exact, a mix
    assert torch.equal(row_digests(mixed[1:3].clone()), digests[1:3])
    assert torch.equal(row_digests(mixed[:1].clone()), digests[:1])
    assert torch.equal(row_digests(mixed[2:8].clone()), digests[2:8])
    nan = single.double()
    nan[0, 0] = float("nan")
    assert row_digests(nan)[0] != row_digests(single)[0]


def test_row_digests_are_exact_integer_sums():
    """Each form is a float64 product whose partial sums stay below 2^52: the digest of a row does not depend on
    the batch, its position or the summation order (rows with large, negative and subnormal values)."""
    from clipless.privacy.input_guard import row_digests

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(300, 3000, generator=gen) * torch.tensor([1e-40, 1.0, 3e38]).repeat(1000)
    x[:, ::7] *= -1
    digests = row_digests(x)
    one_by_one = torch.stack([row_digests(x[i:i + 1].clone())[0] for i in range(0, 300, 37)])
    assert torch.equal(one_by_one, digests[::37])
    assert len(set(digests.tolist())) == 300


@pytest.mark.parametrize("penalty", ["jacobian_of_another_forward", "input_gradient_of_another_forward",
                                     "input_gradient_of_the_same_forward"])
def test_second_derivative_penalties_refused(penalty):
    """A Jacobian or input-gradient penalty (``torch.autograd.grad(..., create_graph=True)``) sends the weights
    second derivatives of the model, which no certified bound covers; a small coefficient keeps the summed
    gradient under the sum check, so each path must be refused by what it is."""
    model, opt, loss, engine, x, y = _setup()
    x2 = x.clone().requires_grad_(True)
    out = model(x2)
    if penalty == "jacobian_of_another_forward":
        (gx,) = torch.autograd.grad(out.sum(), x2, create_graph=True)
        total = loss.per_example(model(x), y).sum() + 1e-3 * gx.pow(2).sum()
    else:
        value = loss.per_example(out, y).sum()
        (gx,) = torch.autograd.grad(value, x2, create_graph=True)
        total = (value if penalty.endswith("same_forward") else loss.per_example(model(x), y).sum()) \
            + 1e-3 * gx.pow(2).sum()
    total.backward()
    _refused(opt, engine, "backward of an earlier backward of the model|forward backpropagated twice")


def test_a_saved_state_cannot_roll_back_released_steps():
    """Before, opt.load_state_dict(state saved before a step) rewound the noise stream: the next step drew the
    first step's noise again (its release correlated 0.98 with the first one)."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    saved, accounted = opt.state_dict(), engine.accountant.state_dict()
    opt.load_state_dict(saved)  # nothing released yet: a resume
    engine.accountant.load_state_dict(accounted)
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    drawn = opt.generator.get_state()
    with pytest.raises(ValueError, match="already released 1 private step"):
        opt.load_state_dict(saved)
    with pytest.raises(ValueError, match="already released 1 private step"):
        engine.accountant.load_state_dict(accounted)
    assert torch.equal(opt.generator.get_state(), drawn) and engine.accountant.steps == 1


def test_a_resume_of_the_optimizer_alone_keeps_composing_its_steps():
    """Opacus-style resume: the model's and the optimizer's state saved, the accountant's forgotten.  Before, the
    fresh engine reported the epsilon of the new steps only; the optimizer's state now carries the history of the
    steps it came from, and loading it composes them."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    batches = iter(loader)
    for _ in range(2):
        opt.zero_grad()
        bx, by = next(batches)
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
    saved_model, saved_opt, epsilon = model.state_dict(), opt.state_dict(), engine.get_epsilon(1e-5)
    model, opt, loss, engine, _, loader = _setup_with_loader()  # a new process
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert engine.accountant.steps == 2 and engine.get_epsilon(1e-5) == epsilon
    # a state without the history (an older version) loads only into an accountant that holds the steps already
    old = {k: v for k, v in saved_opt.items() if k != "accountant"}
    model, opt, loss, engine, _, loader = _setup_with_loader()
    model.load_state_dict(saved_model)
    with pytest.raises(ValueError, match="records no accountant history"):
        opt.load_state_dict(old)
    engine.accountant.load_state_dict(saved_opt["accountant"])
    opt.load_state_dict(old)
    assert engine.accountant.steps == 2
    # another history than the accountant's own is a rollback of its steps
    _, other, _, other_engine, _, _ = _setup_with_loader()
    other_engine.accountant.step(1.0, 0.5)
    with pytest.raises(ValueError, match="optimizer's accountant has already released 1 private step"):
        other.load_state_dict(saved_opt)


def test_a_saved_optimizer_state_is_a_snapshot_and_a_loaded_one_stays_the_callers():
    """torch's ``state_dict`` holds the live momentum and its ``load_state_dict`` keeps the given tensors as the live
    state. A state saved after step 1 and kept in memory therefore moved with step 2 while its accountant history
    stayed at 1 step: a resume from it built on step 2's gradient without counting it. And a state loaded into one
    run moved with that run's steps, so a second resume from it took them in too (found by the random loops of
    test_loop_sequences.py: save, resume, step, resume from the same save)."""
    def momentum(o):
        return [o.original_optimizer.state[p]["momentum_buffer"].clone() for p in o.bound_engine.model.parameters()]

    def sgd(params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    model, opt, loss, engine, _, loader = _setup_with_loader(optimizer_cls=sgd)
    batches = iter(loader)

    def step(model, opt, batches):
        opt.zero_grad()
        bx, by = next(batches)
        loss.per_example(model(bx), by).sum().backward()
        opt.step()

    step(model, opt, batches)
    saved_model, saved, at_save = copy.deepcopy(model.state_dict()), opt.state_dict(), momentum(opt)
    step(model, opt, batches)
    assert engine.accountant.steps == 2 and not torch.equal(momentum(opt)[0], at_save[0])
    in_saved = lambda: [saved["optimizer"]["state"][i]["momentum_buffer"] for i in range(len(at_save))]
    assert all(torch.equal(a, b) for a, b in zip(in_saved(), at_save))  # the save's momentum, not step 2's
    for _ in range(2):  # two resumes from the one state kept in memory, each followed by a step
        model, opt, loss, engine, _, loader = _setup_with_loader(optimizer_cls=sgd)
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved)
        assert engine.accountant.steps == 1 and all(torch.equal(a, b) for a, b in zip(momentum(opt), at_save))
        step(model, opt, iter(loader))
        assert all(torch.equal(a, b) for a, b in zip(in_saved(), at_save))


@pytest.mark.parametrize("how", ["hand_update", "another_runs_model", "older_version"])
def test_a_resume_takes_only_the_model_its_state_released(how):
    """Loading an optimizer state took whatever the model held then as released: an update by hand from training
    records' gradient (no noise) made after make_private, then ``opt.load_state_dict(saved)``, and the next step
    went through with the update in the model, which the step released; so did the model of another run, whose
    steps this state's accountant does not hold.  The state now records digests of the model state it released;
    loading it into a model that holds anything else is refused, nothing loaded, and the change is put back at the
    next step.  Found by random sequences of loop actions (``tests/privacy/test_loop_sequences.py``)."""
    model, opt, loss, engine, data, loader = _setup_with_loader()
    saved = opt.state_dict()
    released = [p.detach().clone() for p in model.parameters()]
    if how == "hand_update":
        loss.per_example(model(data.features[:16]), data.labels[:16]).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        opt.zero_grad()
    elif how == "another_runs_model":
        other, other_opt, _, _, _, other_loader = _setup_with_loader()
        bx, by = next(iter(other_loader))
        loss.per_example(other(bx), by).sum().backward()
        other_opt.step()
        model.load_state_dict(other.state_dict())
    else:  # a state saved before the record: its model cannot be checked
        saved = {k: v for k, v in saved.items() if k != "released_state"}
    generator = opt.generator.get_state()
    match = ("saved by an older version" if how == "older_version" else
             r"the model does not hold the state this optimizer state released \(0\.weight")
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert torch.equal(opt.generator.get_state(), generator) and engine.accountant.steps == 0
    if how == "older_version":
        return
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    _refused(opt, engine, "weights of the private model changed outside the private step", released)


def test_a_resume_into_a_cast_model_is_accepted():
    """The record compares values, as the step's own check does: a model cast to float64 resumes."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    model, opt, loss, engine, _, loader = _setup_with_loader()
    model.load_state_dict(saved_model)
    model.double()
    opt.load_state_dict(saved_opt)
    assert engine.accountant.steps == 1
    bx, by = next(iter(loader))
    loss.per_example(model(bx.double()), by).sum().backward()
    opt.step()
    assert engine.accountant.steps == 2


@pytest.mark.parametrize("state", ["inner", None, [1], "no_generator"])
def test_a_state_that_is_not_a_private_optimizers_is_refused_clearly(state):
    """Before: the inner optimizer's own state_dict (a natural mistake on a resume) raised ``KeyError:
    'optimizer'``, None or a list an AttributeError, a state without the generator ``KeyError``.  Nothing is
    loaded."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    engine.accountant.step(1.0, 0.01)  # the history loaded first, as an older resume does
    saved = opt.state_dict()
    given = (opt.original_optimizer.state_dict() if state == "inner" else
             {k: v for k, v in saved.items() if k != "noise_generator"} if state == "no_generator" else state)
    with pytest.raises(ValueError, match="not a private optimizer's state: " + (
            "this is a torch optimizer's state_dict" if state == "inner" else "expected the dict")):
        opt.load_state_dict(given)
    assert engine.accountant.steps == 1
    with pytest.raises(ValueError, match="accountant state must contain"):
        cl.PrivacyAccountant("pld").load_state_dict(state)


def test_a_compiled_training_forward_is_refused_clearly():
    """``torch.compile(model)`` of the private model: before, its training forward died inside dynamo with
    "InternalTorchDynamoError: AttributeError: 'NoneType' object has no attribute 'is_nested'"; now a BoundError
    says why and what to do.  Nothing is accounted."""
    model, opt, loss, engine, x, y = _setup()
    compiled = torch.compile(model)
    with pytest.raises(BoundError, match="runs under torch.compile"):
        compiled(x)
    assert engine.accountant.steps == 0


@pytest.mark.parametrize("seeded", [False, True])
def test_forks_of_one_saved_state_draw_independent_secret_noise(seeded):
    """Two optimizers loading one saved state (two resumes of a checkpoint): before, both restored the secret
    noise stream and released the same noise on the same batch (lr 0: identical releases), so the difference of
    two forks' releases carried no noise.  A secret stream now stays fresh; a given (seeded) generator is still
    restored, for reproducible experiments."""
    def given():
        return {"noise_generator": torch.Generator().manual_seed(3)} if seeded else {}

    saved = _setup(lr=0.0, **given())[1].state_dict()
    assert (saved["noise_generator"] is None) is not seeded  # a secret stream's state is not even saved
    releases = []
    for _ in range(2):
        model, opt, loss, engine, x, y = _setup(lr=0.0, **given())
        opt.load_state_dict(saved)
        released = capture_released(opt)
        loss.per_example(model(x), y).sum().backward()
        opt.step()
        releases.append(torch.cat([g.flatten() for g in released[0].values()]))
    assert torch.equal(releases[0], releases[1]) is seeded


def test_a_fixed_seed_cannot_continue_a_secret_runs_state():
    secret = _setup()[1].state_dict()
    seeded = _setup(noise_generator=torch.Generator().manual_seed(3))[1]
    with pytest.raises(ValueError, match="holds no generator state .*resume without a fixed seed"):
        seeded.load_state_dict(secret)


@pytest.mark.parametrize("how", ["autocast_bfloat16", "half", "bfloat16"])
def test_reduced_precision_forwards_refused(how):
    """A bfloat16 autocast forward gave a per-example gradient 1.0006x its certified bound (256-256 MLP, 300
    examples at the input bound; float32 stays at 0.99991x: benchmarks/precision.py): before, accepted and released."""
    model, opt, loss, engine, x, y = _setup()
    with pytest.raises(BoundError, match="autocast" if how.startswith("autocast") else "float32 or float64"):
        if how == "autocast_bfloat16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
        else:
            dtype = torch.float16 if how == "half" else torch.bfloat16
            model.to(dtype)(x.to(dtype))
    model.float()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # evaluation may use it
        model(x)
    assert engine.accountant.steps == 0


@pytest.mark.parametrize("setting", ["matmul_precision_high", "mkldnn_matmul_bf16", "backends_tf32",
                                     "mkldnn_conv_bf16"])
def test_reduced_precision_products_refused(setting, monkeypatch, request):
    """TF32 or bfloat16 internals of float32 products round like bfloat16 autocast (8x finer for TF32), which went
    past the certified bound; cuDNN runs float32 convolutions in TF32 by default (benchmarks/precision.py --device
    cuda).  Each setting that lowers the products the model runs is refused before anything is released; a
    convolution setting does not concern a model without convolutions."""
    from clipless.privacy import certified

    mkldnn = torch.backends.mkldnn
    if setting == "matmul_precision_high":  # the setting itself (a replaced getter is refused by make_private)
        previous = torch.get_float32_matmul_precision()
        request.addfinalizer(functools.partial(torch.set_float32_matmul_precision, previous))
        torch.set_float32_matmul_precision("high")
    elif setting == "mkldnn_matmul_bf16":
        monkeypatch.setattr(mkldnn, "matmul", type("M", (), {"fp32_precision": "bf16"})())
    elif setting == "backends_tf32":  # the global setting reaches matmuls whose own levels say "none"
        monkeypatch.setattr(mkldnn, "matmul", type("M", (), {"fp32_precision": "none"})())
        monkeypatch.setattr(mkldnn, "fp32_precision", "none", raising=False)
        monkeypatch.setattr(torch.backends, "fp32_precision", "tf32", raising=False)
    else:
        monkeypatch.setattr(mkldnn, "conv", type("C", (), {"fp32_precision": "bf16"})())
    conv = setting == "mkldnn_conv_bf16"
    assert not (certified.ieee_convolutions if conv else certified.ieee_matmul)(torch.device("cpu"))
    if conv:
        shape = (1, 3, 3)
        x = torch.rand(16, *shape)
        x = x / x.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1)
        engine = cl.PrivacyEngine("rdp")
        model = nn.Sequential(cl.LipschitzConv2d(1, 2, 3, padding=1), nn.Flatten(), cl.LipschitzLinear(18, 3))
        model, opt, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data=cl.ArrayDataset(x, torch.randint(0, 3, (16,))), loss=cl.TauCrossEntropy(2.0), noise_multiplier=1.0,
            input_shape=shape, batch_size=4.0, input_bound=1.0, external_batches=True)
        match = "convolutions on cpu run in reduced precision"
    else:
        model, opt, loss, engine, x, y = _setup()
        match = "matrix products on cpu are set to reduced precision"
    with pytest.raises(BoundError, match=match):
        model(x)
    assert engine.accountant.steps == 0
    if conv:  # the same setting leaves a model without convolutions alone
        mlp, _, _, _, x6, _ = _setup()
        mlp(x6)


def test_backward_of_a_forward_from_before_the_step_refused():
    model, opt, loss, engine, x, y = _setup()
    # saved tensors are copied on mutation, so autograd's own version check stays silent
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        stale = model(x)
        loss.per_example(model(x), y).sum().backward()
        opt.step()
        loss.per_example(stale, y).sum().backward()
    _refused(opt, engine, "forward made before the last private step")


def test_same_forward_backpropagated_twice_refused():
    model, opt, loss, engine, x, y = _setup()
    value = loss.per_example(model(x), y).sum()
    value.backward(retain_graph=True)
    value.backward()
    _refused(opt, engine, "backpropagated twice")


# Finding 2: no zero_grad between steps
def test_missing_zero_grad_cannot_mix_batches():
    model, opt, loss, engine, x, y = _setup(noise=1e-12, lr=0.0)
    released = capture_released(opt)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    for bx, by in batches:  # the README loop without zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
        assert all(p.grad is None for p in model.parameters())  # cleared by the step
    second = [g.sum(0) / 16.0 for g in per_example_grads(model, loss, *batches[1])]
    assert all(torch.allclose(released[1][id(p)], s, atol=1e-6) for p, s in zip(model.parameters(), second))


# Finding 3: the loss is the clipless loss, summed, unscaled, and the only use of the output
def test_hand_scaled_loss_refused():
    model, opt, loss, engine, x, y = _setup()
    (loss.per_example(model(x), y).sum() * 10).backward()
    message = _refused(opt, engine, "weight above 1")
    assert "zero_grad" in message
    opt.zero_grad()  # then the corrected loop works
    loss.per_example(model(x), y).sum().backward()
    opt.step()


def test_mean_reduced_loss_warns_about_the_wasted_budget():
    """The warning used to show the largest weight, 1/|B| for a mean: the realised size of a Poisson batch, which is
    secret (the noisy sum is divided by the expected size for that reason), written to the logs without noise."""
    model, opt, loss, engine, x, y = _setup()
    with pytest.warns(UserWarning, match="wastes privacy budget") as caught:
        loss.per_example(model(x), y).mean().backward()
    shown = " ".join(str(w.message) for w in caught)
    assert f"{1 / len(x):.4g}" not in shown and str(len(x)) not in shown
    opt.step()  # not a privacy bug: a smaller gradient
    assert engine.accountant.steps == 1


def test_error_messages_of_the_step_do_not_show_the_batch_size_or_labels():
    """A Poisson batch's size and its records' labels are not written to logs by the step's errors either."""
    model, opt, loss, engine, x, y = _setup()
    n = len(x)
    out = model(x)
    for bad, labels in (("shape", y[:, None].repeat(1, 3)), ("count", y[:-1]), ("range", y + 50)):
        with pytest.raises(ValueError) as info:
            loss.per_example(out, labels)
        message = str(info.value)
        assert str(n) not in message and str(n - 1) not in message and str(int(labels.max())) not in message, bad
    with pytest.raises(ValueError) as info:
        cl.BinaryCrossEntropyWithTemperature().per_example(out, y)
    assert str(n) not in str(info.value)


@pytest.mark.parametrize("slip", ["torch_loss", "scaled_output", "output_used_twice", "sliced_output"])
def test_backward_not_from_the_clipless_loss_refused(slip):
    model, opt, loss, engine, x, y = _setup()
    out = model(x)
    if slip == "torch_loss":
        value = nn.functional.cross_entropy(out, y, reduction="sum")
    elif slip == "scaled_output":
        value = loss.per_example(out * 10, y).sum()
    elif slip == "output_used_twice":
        value = loss.per_example(out, y).sum() + 5 * out.square().sum()
    else:
        value = loss.per_example(out[:, :2], y.clamp(max=1)).sum()
    value.backward()
    _refused(opt, engine, "clipless loss")


def test_another_loss_refused_whatever_its_constant():
    """A loss with a smaller constant passed: the loop could choose it from the batch (one loss when a target
    record is in it, another otherwise), which makes each example's gradient depend on the others."""
    model, opt, loss, engine, x, y = _setup()  # bounds for TauCrossEntropy: L = sqrt(2)
    cl.MulticlassHinge(num_classes=3).per_example(model(x), y).sum().backward()  # L = sqrt(3/2)
    _refused(opt, engine, "another loss than the one given to make_private")
    opt.zero_grad()

    class Steep(cl.LipschitzLoss):
        lipschitz = 5.0

        def per_example(self, logits, target):
            return 5.0 * logits.gather(1, target[:, None]).squeeze(1)

    Steep().per_example(model(x), y).sum().backward()
    _refused(opt, engine, "another loss than the one given to make_private")


def test_loss_declaring_a_wrong_constant_is_caught_at_the_output():
    class Liar(cl.LipschitzLoss):
        lipschitz = 0.1  # the true gradient has norm 3

        def per_example(self, logits, target):
            return 3.0 * logits.gather(1, target[:, None]).squeeze(1)

    model, opt, loss, engine, x, y = _setup(loss=Liar())
    loss.per_example(model(x), y).sum().backward()
    message = _refused(opt, engine, r"loss gradient has a norm above the loss constant L = 0\.1")
    assert "3" not in message.split("L = 0.1")[1]  # the norm itself (3) is not shown: a statistic of a record


# Finding 4: the weights the noise is calibrated to are the weights of the forward
@pytest.mark.parametrize("how", ["in_place", "data"])
def test_weights_changed_between_forward_and_step_refused(how):
    model, opt, loss, engine, x, y = _setup()
    w = model[0].weight
    released = [p.detach().clone() for p in model.parameters()]  # x 5 / 5 need not give them back bit for bit
    if how == "in_place":
        with torch.no_grad():
            w.mul_(5)
        loss.per_example(model(x), y).sum().backward()
        with torch.no_grad():
            w.div_(5)
        _refused(opt, engine, "weights changed between the forward and the step", released)
    else:  # .data escapes autograd's version counter
        out = model(x)
        w.data.mul_(5)
        loss.per_example(out, y).sum().backward()
        w.data.div_(5)
        _refused(opt, engine, "weights changed between the forward and its backward", released)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_by_name(value):
    """A weight set to NaN or inf by hand was refused, but as 'gradient from outside its clipless loss'."""
    model, opt, loss, engine, x, y = _setup()
    with torch.no_grad():
        model[0].weight[0, 0] = value
    loss.per_example(model(x), y).sum().backward()
    with pytest.raises(BoundError, match="loss gradient at the private model's output is not finite"):
        opt.step()
    assert engine.accountant.steps == 0


def test_a_non_finite_weight_gradient_is_refused_by_name():
    """A layer whose derivative divides by zero (L2-norm pooling forced to eps = 0, at an all-zero window) was
    refused as 'a weight's gradient was changed between its backward and its accumulation'."""
    model = nn.Sequential(cl.LipschitzConv2d(1, 4, 3), cl.L2NormPool2d(2), nn.Flatten(), cl.LipschitzLinear(64, 3))
    object.__setattr__(model[1], "eps", 0.0)  # past the constructor's check, as a buggy custom layer would be
    x = torch.rand(16, 1, 8, 8)
    x[:, :, :4, :4] = 0
    x = x / x.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    engine, data = cl.PrivacyEngine("rdp"), cl.ArrayDataset(x, torch.zeros(16).long())
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
        loss=cl.TauCrossEntropy(2.0), noise_multiplier=1.0, input_shape=(1, 8, 8), batch_size=8.0, input_bound=1.0,
        external_batches=True)
    cl.TauCrossEntropy(2.0).per_example(model(x), torch.zeros(16).long()).sum().backward()
    with pytest.raises(BoundError, match="weight '0.weight' of the private model got a gradient that is not finite"):
        opt.step()
    assert engine.accountant.steps == 0


# Finding 5: eval-mode forwards in the private loop still check the input bound
def test_eval_mode_loop_with_inputs_above_the_bound_refused():
    model, opt, loss, engine, x, y = _setup()
    model.eval()
    with pytest.raises(BoundError, match="input_bound"):
        loss.per_example(model(5 * x), y).sum().backward()
    assert engine.accountant.steps == 0


# Gradients that did not come through the model's forward and loss
def test_layer_called_outside_the_model_refused():
    model, opt, loss, engine, x, y = _setup()
    loss.per_example(model(x), y).sum().backward()
    model[0](x).square().sum().backward()
    _refused(opt, engine, "layer '0' of the private model was called outside the model's forward")


def test_layer_called_outside_the_model_in_the_same_backward_refused():
    model, opt, loss, engine, x, y = _setup()
    (loss.per_example(model(x), y).sum() + model[0](x).square().sum()).backward()
    _refused(opt, engine, "outside the model's forward")


def test_weight_used_outside_the_model_in_another_backward_refused():
    model, opt, loss, engine, x, y = _setup()
    loss.per_example(model(x), y).sum().backward()
    nn.functional.linear(x, model[0].weight).square().sum().backward()
    _refused(opt, engine, r"a weight of the private model was used outside the model's forward \(linear\)")


@pytest.mark.parametrize("use", ["linear", "product", "transpose_matmul", "transpose_property",
                                 "matrix_transpose_property", "adjoint_property", "matrix_adjoint_property",
                                 "view_penalty", "einsum", "functional_call"])
def test_weight_used_outside_the_model_in_the_same_backward_refused(use):
    """A data-dependent use of a weight added to the private loss: the gradient is the loss's plus an
    unbounded term in the data; before the weights watched their operations this step was released."""
    model, opt, loss, engine, x, y = _setup()
    w = model[0].weight
    if use == "linear":
        extra = nn.functional.linear(x, w).square().sum()
    elif use == "product":
        extra = (w * x.sum()).sum()
    elif use == "transpose_matmul":
        extra = (x @ w.t()).sum()
    elif use == "transpose_property":  # a property getter, not a function call: W.T
        extra = (x @ w.T).sum()
    elif use == "matrix_transpose_property":
        extra = (x @ w.mT).sum()
    elif use == "adjoint_property":
        extra = (x @ w.H).sum()
    elif use == "matrix_adjoint_property":
        extra = (x @ w.mH).sum()
    elif use == "view_penalty":
        extra = (w.view(-1)[: x.shape[1]] * x[0]).sum()
    elif use == "einsum":
        extra = torch.einsum("ij,kj->", w, x)
    else:  # the model's forward again, on the same parameters, into another loss
        extra = torch.func.functional_call(model, dict(model.named_parameters()), (x,)).sum()
    (loss.per_example(model(x), y).sum() + extra).backward()
    _refused(opt, engine, "used outside the model's forward|did not come from a clipless loss")


def test_a_forward_that_reads_a_weight_through_its_transpose_property_steps():
    """``q.T @ q`` inside the forward (OrthogonalConv2d's projectors): the ``.T`` property is an operation on the
    weight like ``q.t()`` and passes through its gate; read as a plain attribute, its gradient did not, and every
    private step of a CNN with trained projectors (``conv="orthogonal"``) was refused."""
    torch.manual_seed(0)
    x = torch.rand(32, 1, 6, 6)
    x = x / x.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    model = nn.Sequential(cl.OrthogonalConv2d(1, 4), cl.MaxMin(), nn.Flatten(), cl.LipschitzLinear(144, 3))
    loss = cl.TauCrossEntropy(2.0)
    engine = cl.PrivacyEngine("rdp")
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data=cl.ArrayDataset(x, torch.arange(32) % 3), loss=loss, noise_multiplier=1.0, input_shape=(1, 6, 6),
        batch_size=8.0, input_bound=1.0, external_batches=True)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        loss.per_example(model(x[:8]), torch.arange(8) % 3).sum().backward()
        opt.step()
    assert engine.accountant.steps == 2
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


class _OpaqueProduct(torch.autograd.Function):
    """``sum(W x^T)`` as a custom autograd Function: its ``apply`` reports no operation to the watched weight."""

    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(x)
        ctx.rows = w.shape[0]
        return (w @ x.t()).sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.sum(0).expand(ctx.rows, -1), None


@pytest.mark.parametrize("same_backward", [True, False])
def test_weight_used_by_a_custom_autograd_function_outside_the_model_refused(same_backward):
    """No operation is reported for a custom Function's inputs; the weight's own hook still sees that its incoming
    gradient is not what the model's forward sent it (released before the gates)."""
    model, opt, loss, engine, x, y = _setup()
    w = model[0].weight
    if same_backward:
        (loss.per_example(model(x), y).sum() + _OpaqueProduct.apply(w, x)).backward()
    else:
        loss.per_example(model(x), y).sum().backward()
        _OpaqueProduct.apply(w, x).backward()
    _refused(opt, engine, "weight '0.weight' of the private model received gradient by a path outside the model's "
                          "forward|did not go through the private model's output")


def test_custom_function_diagnostics_keep_their_value_and_are_not_refused():
    model, opt, loss, engine, x, y = _setup()
    w = model[0].weight
    (got,) = torch.autograd.grad(_OpaqueProduct.apply(w, x), w)
    assert torch.equal(got, x.sum(0).expand(8, -1))
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def _scale(grad):
    return 100 * grad


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("hook", ["weight_hook", "output_hook", "saved_tensors", "global_pre_hook",
                                  "global_backward_hook", "layer_hook_removed_before_step"])
def test_hooks_that_rescale_the_backward_refused(hook):
    """Public hook APIs that change what the backward computes, each one released 100x (or more) the bounded
    gradient before the guard checked them: weight hooks run before accumulation, output hooks after the
    guard's own, saved-tensor hooks and global module hooks rewrite the layers' values; a layer hook removed
    before ``step()`` is gone when the bound engine looks for it."""
    model, opt, loss, engine, x, y = _setup()
    w, undo = model[0].weight, []
    if hook == "weight_hook":
        w.register_hook(_scale)
    elif hook == "global_pre_hook":
        undo.append(nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: tuple(100 * a for a in args) if m is model[2] else None))
    elif hook == "global_backward_hook":
        undo.append(nn.modules.module.register_module_full_backward_pre_hook(
            lambda m, go: tuple(100 * g for g in go) if m is model[1] else None))
    elif hook == "layer_hook_removed_before_step":
        undo.append(model[1].register_forward_hook(lambda m, args, out: 100 * out))
    try:
        if hook == "saved_tensors":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: 100 * t if t.is_floating_point() else t,
                                                          lambda t: t):
                out = model(x)
        else:
            out = model(x)
        if hook == "output_hook":
            out.register_hook(_scale)
        loss.per_example(out, y).sum().backward()
    finally:
        for handle in undo:
            handle.remove()
    _refused(opt, engine, "hook|received gradient from outside its clipless loss")


@pytest.mark.parametrize("which", ["the_one_given_to_make_private", "a_second_optimizer"])
def test_an_optimizer_other_than_the_private_one_cannot_step_the_model(which):
    """``opt = SGD(...); model, dp_opt, loader = make_private(optimizer=opt, ...)`` then ``opt.step()``: the old
    name applied the gradient without noise (released before the step hook)."""
    model, opt, loss, engine, x, y = _setup()
    other = opt.original_optimizer if which == "the_one_given_to_make_private" else torch.optim.Adam(model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    loss.per_example(model(x), y).sum().backward()
    with pytest.raises(BoundError, match=r"\.step\(\) on the private model's parameters outside the private optimizer"):
        other.step()
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    opt.step()  # the private one still steps, and is accounted
    assert engine.accountant.steps == 1
    opt.guard.remove()  # an unguarded model is an ordinary one again
    loss.per_example(model(x), y).sum().backward()
    other.step()


@pytest.mark.parametrize("inner", [functools.partial(torch.optim.SGD, momentum=0.9), torch.optim.Adam])
def test_an_optimizer_that_already_stepped_is_refused(inner):
    """make_private took an optimizer whose state came from earlier steps: a warm-up step at learning rate 0 (the
    weights unchanged) left SGD's momentum holding the full data's gradient without noise, and every released step
    applied 0.9 times it (Adam's moments likewise).  Refused now, the model left as it was; a fresh optimizer runs."""
    torch.manual_seed(0)
    model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    x = torch.randn(96, *SHAPE)
    x, y = x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (96,))
    warm = inner(model.parameters(), lr=0.0)
    cl.TauCrossEntropy(2.0).per_example(model(x), y).sum().backward()
    warm.step()
    with pytest.raises(ValueError, match=f"the {type(warm).__name__} given to make_private holds state from earlier "
                                         r"steps \(momentum or moments of 2 parameter"):
        _setup_with_loader(model=model, optimizer_cls=lambda params, lr: warm)
    assert all(p.grad is not None for p in model.parameters())  # nothing of make_private ran on the model
    _, opt, loss, engine, _, loader = _setup_with_loader(model=model, optimizer_cls=inner)
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def test_an_optimizer_that_needs_a_closure_refused():
    """LBFGS evaluates the loss several times inside one step: each evaluation's gradient would move the weights
    without noise; before, the private step crashed half-way (after the noise was added)."""
    with pytest.raises(ValueError, match="LBFGS needs a closure in step"):
        _setup(model=None, optimizer_cls=torch.optim.LBFGS)


def test_a_backward_changed_inside_the_model_by_a_node_hook_refused():
    """A hook put by hand on an autograd node inside the model is not seen by any hook check; the summed
    gradient then exceeds what the certified per-example bounds allow for this batch (released before)."""
    model, opt, loss, engine, x, y = _setup()
    out = model(x)
    out.grad_fn.next_functions[0][0].register_prehook(lambda grads: tuple(100 * g for g in grads))
    loss.per_example(out, y).sum().backward()
    _refused(opt, engine, r"layer '0': the summed gradient has a norm above .*the backward was changed")


class _ScaleLinear(torch.overrides.TorchFunctionMode):
    """1.5x every F.linear: the kind of change a function mode can make to every layer at once."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 1.5 if func is torch.nn.functional.linear else out


class _ScaleProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """1.5x every matrix product, at the dispatcher (forward and backward alike)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 1.5 if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) else out


class _Scaled(torch.Tensor):
    """An input whose class scales every F.linear by 1.5 and keeps its class through the forward."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            out = out * 1.5
        return out.as_subclass(cls) if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("how", ["function mode", "dispatch mode", "dispatch mode, backward only", "input subclass"])
def test_torch_modes_and_overriding_input_subclasses_refused(how):
    """A torch function or dispatch mode sees every operation of the forward (or the backward) and may return other
    values; 1.5x on the products released steps past the certified bound, unseen by every hook check (the summed
    gradient check sees only gross excess). A tensor subclass with its own ``__torch_function__`` as input does the
    same from inside the batch. ``torch.device(...)``, which only places new tensors, is accepted."""
    model, opt, loss, engine, x, y = _setup()
    if how == "function mode":
        with _ScaleLinear():
            out = model(x)
        loss.per_example(out, y).sum().backward()
    elif how == "dispatch mode":
        with _ScaleProducts():
            out = model(x)
        loss.per_example(out, y).sum().backward()
    elif how == "dispatch mode, backward only":
        total = loss.per_example(model(x), y).sum()
        with _ScaleProducts():
            total.backward()
    else:
        loss.per_example(model(x.as_subclass(_Scaled)), y).sum().backward()
    message = "the input was a _Scaled" if how == "input subclass" else "a torch function or dispatch mode"
    _refused(opt, engine, message)
    opt.zero_grad()
    with torch.device("cpu"):
        loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("how", ["data", "numpy", "storage"])
def test_an_input_batch_changed_past_autograd_after_the_forward_refused(how):
    """The first layer saves its input for the backward. Changed in place after the forward where autograd's version
    counters do not see it (``x.data``, a NumPy view, the storage), the backward used rows 1.5x those the forward
    checked against the input bound, and the step released them: the sum check sees only gross excess."""
    model, opt, loss, engine, x, y = _setup()
    x = x.clone()
    out = model(x)
    if how == "data":
        x.data.mul_(1.5)
    elif how == "numpy":
        x.numpy()[:] *= 1.5
    else:
        torch.tensor([], dtype=x.dtype).set_(x.untyped_storage()).mul_(1.5)  # another tensor on its storage
    loss.per_example(out, y).sum().backward()
    _refused(opt, engine, "the forward's input batch was changed in place after the forward")
    opt.zero_grad()
    x.data.div_(1.5)  # as the batch was: accepted
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("when", ["before the forward", "before the step"])
def test_the_sum_check_switched_off_by_hand_is_refused(when):
    """``opt.guard.sum_check = False`` was a plain attribute: with it, the node hook above released a gradient 100
    times its certified bound.  Only the white-box step audit switches it off, through its own method."""
    model, opt, loss, engine, x, y = _setup()
    if when == "before the forward":
        opt.guard.sum_check = False
    out = model(x)
    out.grad_fn.next_functions[0][0].register_prehook(lambda grads: tuple(100 * g for g in grads))
    loss.per_example(out, y).sum().backward()
    opt.guard.sum_check = False
    _refused(opt, engine, "the step guard's settings changed after make_private")


def test_the_weights_the_guard_compares_cannot_be_swapped_out():
    """With ``opt.guard.params = []`` the weights were no longer compared between a forward and the step: a weight
    doubled for the forward and put back before the step released a per-example gradient of 2.75 against the
    certified 1.41 (the sum check passed on this batch)."""
    model, opt, loss, engine, x, y = _setup()
    opt.guard.params = ()
    weight = model[2].weight
    weight.data.mul_(2)
    loss.per_example(model(x), y).sum().backward()
    weight.data.div_(2)
    _refused(opt, engine, "the step guard's settings changed after make_private")


@pytest.mark.parametrize("how", ["handle", "hook dict"])
def test_the_input_guard_taken_off_the_model_is_refused(how):
    """``engine.guard.remove()`` (a public method then) took the data-bound, precision and compile checks off the
    model: a record of norm 5 against the input bound 1 released a per-example gradient of 6.87 against the
    certified 1.41 (the sum check passed on that batch)."""
    model, opt, loss, engine, x, y = _setup()
    if how == "handle":
        engine.guard.handle.remove()
    else:
        del model._forward_pre_hooks[engine.guard.handle.id]
    x = x.clone()
    x[0] *= 5
    loss.per_example(model(x), y).sum().backward()
    _refused(opt, engine, "the input guard's bound or hook, or the step guard's settings changed")


class _UnderDeclaredLinear(cl.LipschitzLinear):
    """Declares a per-example gradient bound 100 times too small: a wrong constant."""

    def layer_bound(self, x_bound, in_shape):
        declared = super().layer_bound(x_bound, in_shape)
        return dataclasses.replace(declared, param_factors={k: v / 100 for k, v in declared.param_factors.items()})


def test_a_layer_declaring_a_too_small_bound_is_caught_by_the_sum_check():
    model = nn.Sequential(_UnderDeclaredLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    model, opt, loss, engine, x, y = _setup(model=model)
    loss.per_example(model(x), y).sum().backward()
    _refused(opt, engine, "layer '0': the summed gradient has a norm above .* or the layer declares a wrong bound")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_sum_check_never_refuses_an_honest_step_even_at_the_bound(seed, clip):
    """The necessary condition holds for honest steps: random widths and batches, inputs on the bound, and a
    canary crafted to attain its per-example bound alone (mass 1: the check is then tight); with a loss-gradient
    clip the rows are counted instead of weighted."""
    from clipless.diagnostics.step_audit import craft_canary

    gen = torch.Generator().manual_seed(seed)
    width = 2 * int(torch.randint(1, 12, (1,), generator=gen))
    layers = [cl.LipschitzLinear(6, width), cl.MaxMin(), cl.LipschitzLinear(width, 3)]
    model = nn.Sequential(*(layers + ([cl.LossGradientClip(clip)] if clip else [])))
    with torch.no_grad():  # weights away from the projection's fixed point
        for p in model.parameters():
            p.normal_(generator=gen)
    model, opt, loss, engine, x, y = _setup(model=model, noise=1e-12)
    for batch in (1, 7, 16):
        xb = torch.randn(batch, *SHAPE, generator=gen)
        xb = xb / xb.norm(dim=1, keepdim=True) * (1 - 1e-6)
        loss.per_example(model(xb), torch.randint(0, 3, (batch,), generator=gen)).sum().backward()
        opt.step()
    with cl.privacy.input_guard.paused_guards(model):
        cx, cy, _ = craft_canary(model, loss, SHAPE, 1.0, steps=30, restarts=2, generator=gen)
    loss.per_example(model(cx[None]), cy.reshape(1)).sum().backward()
    opt.step()
    assert engine.accountant.steps == 4


def test_weights_read_outside_the_model_without_a_backward_through_them_are_not_refused():
    """Reading weights (norms, copies, logging, a penalty never backpropagated, torch.autograd.grad) is fine."""
    model, opt, loss, engine, x, y = _setup()
    w = model[0].weight
    with torch.no_grad():
        _ = w.norm(), w.t() @ w, w.clone()
    _ = w.detach().abs().max(), w.sum(), w.norm()  # with grad, but no backward goes through them
    torch.autograd.grad((w * x.sum()).sum(), w)  # does not accumulate into .grad: not a step
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1
    assert type(w) is not nn.Parameter and isinstance(w, nn.Parameter) and type(w.detach()) is torch.Tensor


def test_watched_parameters_copy_pickle_and_detach_as_plain_parameters():
    model, opt, loss, engine, x, y = _setup()
    twin = copy.deepcopy(model)
    assert all(type(p) is nn.Parameter for p in twin.parameters())
    w = model[0].weight
    loaded = pickle.loads(pickle.dumps(w))
    assert type(loaded) is nn.Parameter and torch.equal(loaded, w) and loaded.requires_grad
    assert all(type(v) is torch.Tensor for v in model.state_dict().values() if isinstance(v, torch.Tensor))
    opt.guard.remove()  # a removed guard gives the parameters back as plain ones
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_torch_save_of_the_whole_private_model_saves_an_ordinary_model(tmp_path):
    """``torch.save(model)`` (the whole module pickled, a common way to keep a model) died with "Can't pickle local
    object 'DPOptimizer.__init__.<locals>.<lambda>'": the model's hooks pickled the step guard, whose state holds
    the batches' digests and un-noised gradients.  The hooks now pickle as inert stand-ins, as in a deep copy:
    the file holds the weights (and their certified bounds) only, and loads as an ordinary model."""
    model, opt, loss, engine, x, y = _setup()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(type(p) is nn.Parameter for p in loaded.parameters())
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
    hooks = [h for m in loaded.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for h in d.values()]
    assert hooks and all(type(h).__name__ == "_Detached" for h in hooks)
    nn.functional.cross_entropy(loaded(x), y).backward()  # no guard on the loaded copy
    loss.per_example(model(x), y).sum().backward()  # the original stays guarded and private
    opt.step()
    assert engine.accountant.steps == 2


@pytest.mark.parametrize("edit", ["replace", "scale", "data_scale_then_backward"])
def test_gradient_set_or_edited_by_hand_refused(edit):
    model, opt, loss, engine, x, y = _setup()
    loss.per_example(model(x), y).sum().backward()
    w = model[2].weight
    if edit == "replace":
        w.grad = 100 * torch.ones_like(w)
    elif edit == "scale":
        w.grad.mul_(10)
    else:
        w.grad.add_(1.0)
    _refused(opt, engine, "set or scaled by hand")


def test_diagnostic_autograd_between_steps_is_not_refused():
    """torch.autograd.grad (saliency, per-example norms) does not touch .grad: nothing to refuse."""
    model, opt, loss, engine, x, y = _setup()
    xi = x[:2].clone().requires_grad_(True)
    torch.autograd.grad(nn.functional.cross_entropy(model(xi), y[:2]), xi)
    cl.diagnostics.tightness(model, loss, x[:3], y[:3], opt.bound_engine.compute())
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def test_a_deep_copy_is_an_ordinary_model():
    model, opt, loss, engine, x, y = _setup()
    twin = copy.deepcopy(model)
    nn.functional.cross_entropy(twin(x), y).backward()  # no guard on the copy
    twin[0](x).sum().backward()
    loss.per_example(model(x), y).sum().backward()
    opt.step()


def test_trainer_with_tightness_monitor_and_averaging_runs_guarded():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, *SHAPE, generator=gen)
    data = cl.ArrayDataset(x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (64,), generator=gen))
    model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trainer's sum reduction never triggers the mean warning
        trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cl.TauCrossEntropy(2.0),
                                    data, input_shape=SHAPE, input_bound=1.0, batch_size=8, delta=1e-3, epochs=2,
                                    noise_multiplier=1.0, accountant="rdp", progress=False, log=None,
                                    average_decay=0.9, tightness_monitor=cl.diagnostics.TightnessMonitor(every=2, sample=2))
        result = trainer.fit()
    assert result.steps == 16


class _BatchSum(cl.privacy.BoundedModule):
    """A 1-Lipschitz identity that keeps the sum of every training batch in a buffer (no noise); or in a frozen
    parameter, a plain attribute, or a plain dict attribute (``kept``)."""

    def __init__(self, width: int, kept: str = "buffer") -> None:
        super().__init__()
        if kept == "frozen_parameter":  # the same state kept as a parameter the optimizer does not step
            self.total = nn.Parameter(torch.zeros(width), requires_grad=False)
        elif kept == "plain":  # not registered: state_dict leaves it out, a pickle and every later forward do not
            self.total = torch.zeros(width)
        elif kept == "plain_in_dict":
            self.sums = {"total": torch.zeros(width)}
        else:
            self.register_buffer("total", torch.zeros(width))

    def layer_bound(self, x_bound, in_shape):
        return cl.privacy.LayerBound(lipschitz=1.0, out_bound=x_bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                (self.sums["total"] if hasattr(self, "sums") else self.total).add_(x.sum(0))
        return x


@pytest.mark.parametrize("kept", ["buffer", "frozen_parameter", "plain", "plain_in_dict"])
def test_a_buffer_changed_by_the_forward_is_refused_and_put_back(kept):
    """A layer's buffer (or frozen parameter) updated by the forward, as a running statistic, held an un-noised sum
    of the batch, released with the model's state_dict, and the step went through.  Now the step is refused and
    the state restored; state set by hand between steps is refused the same way.  So is such state kept in a plain
    attribute (a tensor, or one in a dict), which passed after the buffers' fix: state_dict leaves it out, but every
    later forward reads it and a pickle of the model releases it."""
    model = nn.Sequential(_BatchSum(6, kept), cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    name = "0.sums[total]" if kept == "plain_in_dict" else "0.total"
    model, opt, loss, engine, x, y = _setup(model=model)
    loss.per_example(model(x), y).sum().backward()
    trained = [p.detach().clone() for p in model.parameters() if p.requires_grad]

    def refused():  # as _refused, but the changed state itself is put back, so it differs from before the step
        # changed by the forward: seen at the step; by hand before the forward: seen at the forward already
        with pytest.raises(BoundError, match=r"(buffers or frozen parameters (of the private model changed|\(0.total\) "
                                             r"were not as the last private step released)|keep as plain attributes)"
                           ) as info:
            opt.step()
        total = model[0].sums["total"] if kept == "plain_in_dict" else model[0].total
        assert engine.accountant.steps == steps and torch.equal(total, torch.zeros(6))
        assert all(torch.equal(a, p) for a, p in zip(trained, (p for p in model.parameters() if p.requires_grad)))
        return str(info.value)

    steps = engine.accountant.steps
    assert name in refused()
    opt.zero_grad()  # the refusal (seen at the backward) says to run the batch again
    model[0].eval()  # the buffer stays as released: the step goes through
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1
    opt.zero_grad()
    (model[0].sums["total"] if kept == "plain_in_dict" else model[0].total).fill_(1.0)
    loss.per_example(model(x), y).sum().backward()
    steps, trained = engine.accountant.steps, [p.detach().clone() for p in model.parameters() if p.requires_grad]
    refused()


class _PlainSettings(cl.privacy.BoundedModule):
    """A layer of one's own with a plain setting its forward reads (``x * min(scale, 1)``: 1-Lipschitz for any
    scale), and one it writes (``seen``, the batch's size, a secret of the Poisson sampling)."""

    def __init__(self, record_size: str = "") -> None:
        super().__init__()
        self.scale, self.record_size, self.seen, self.sizes = 1.0, record_size, 0, []

    def layer_bound(self, x_bound, in_shape):
        return cl.privacy.LayerBound(lipschitz=1.0, out_bound=x_bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.record_size == "set":
            self.seen = len(x)
        elif self.record_size == "appended":  # a list changed in place
            self.sizes.append(len(x))
        return x * min(self.scale, 1.0)


@pytest.mark.parametrize("how", ["set by the loop", "set by the forward", "appended by the forward"])
def test_a_plain_setting_of_a_layer_of_ones_own_changed_after_make_private_is_refused(how):
    """A layer of one's own declares the constants it likes; a plain number it reads (a scale the loop set from a
    batch's statistic) or writes (the batch's size, or a list of them) passed, carrying that batch into every later
    step without noise.  Its plain settings are now held to their values at make_private, like torch layers'."""
    mode = {"set by the forward": "set", "appended by the forward": "appended"}.get(how, "")
    model = nn.Sequential(_PlainSettings(mode), cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    match = ("module '0' \\(_PlainSettings\\): its constant (scale|seen|sizes) changed .* a plain setting of a layer "
             "of one's own")
    if how == "appended by the forward":  # the forwards of make_private's own probes append already
        with pytest.raises(BoundError, match=match):
            _setup_with_loader(model=model)
        return
    model, opt, loss, engine, data, loader = _setup_with_loader(model=model)
    x, y = next(iter(loader))
    if how == "set by the loop":
        model[0].scale = float(x.abs().mean())  # a statistic of the drawn batch, no noise
    with pytest.raises(BoundError, match=match):
        loss.per_example(model(x), y).sum().backward()
        opt.step()
    assert engine.accountant.steps == 0


@pytest.mark.parametrize("how", ["by_hand", "data", "load_state_dict"])
def test_weights_changed_between_steps_are_refused_and_put_back(how):
    """A weight changed outside the private step before the next forward (a hand-written update from a batch's
    gradient, an assignment to ``.data``, a ``load_state_dict`` after the optimizer's) went into the model without
    noise and the next step went through, so the model released it.  Refused now, the released weights put back."""
    model, opt, loss, engine, x, y = _setup()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    released = [p.detach().clone() for p in model.parameters()]
    loss.per_example(model(x), y).sum().backward()
    update = {name: -0.1 * p.grad for name, p in model.named_parameters()}  # the batch's gradient, no noise
    opt.zero_grad()
    if how == "by_hand":
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(update[name])
    elif how == "data":
        model[0].weight.data = model[0].weight.data + update["0.weight"]
    else:
        model.load_state_dict({name: t + update[name] if name in update else t
                               for name, t in model.state_dict().items()})
    loss.per_example(model(x), y).sum().backward()
    with pytest.raises(BoundError, match="weights of the private model changed outside the private step") as info:
        opt.step()
    assert "0.weight" in str(info.value) and engine.accountant.steps == 1
    assert all(torch.equal(a, p) for a, p in zip(released, model.parameters()))
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()  # from the released weights, the loop goes on
    opt.step()
    assert engine.accountant.steps == 2


@pytest.mark.parametrize("release", ["state_dict", "pickle", "state_dict_of_a_container"])
@pytest.mark.parametrize("how", ["by_hand", "load_state_dict"])
def test_weights_changed_after_the_last_step_are_refused_when_the_model_is_saved(how, release):
    """A last update by hand after the loop (or weights loaded from elsewhere) was written by
    ``torch.save(model.state_dict())`` or ``torch.save(model)`` without a word: no step came after it to refuse it.
    The model's state_dict and pickle now refuse a model that is not as the last step released it, and put that
    back; a deep copy is an ordinary model, which post-processing may change."""
    import io

    model, opt, loss, engine, x, y = _setup()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    released = [p.detach().clone() for p in model.parameters()]
    for name in ("state_dict", "pickle"):  # as released: both pass
        torch.save(model.state_dict() if name == "state_dict" else model, io.BytesIO())
    edited = copy.deepcopy(model)
    loss.per_example(model(x), y).sum().backward()
    with torch.no_grad():
        if how == "by_hand":
            for p in model.parameters():
                p -= 0.1 * p.grad  # the batch's gradient, no noise
        else:
            model.load_state_dict({k: v + 0.1 if isinstance(v, torch.Tensor) else v
                                   for k, v in copy.deepcopy(model).state_dict().items()})
    with pytest.raises(BoundError, match="model.state_dict.. or a pickle of the model: weights of the private model "
                                         "changed outside the private step") as info:
        if release == "state_dict":
            model.state_dict()
        elif release == "pickle":
            torch.save(model, io.BytesIO())
        else:
            nn.ModuleDict({"net": model}).state_dict()
    assert "0.weight" in str(info.value) and "copy.deepcopy(model)" in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(released, model.parameters()))  # put back
    torch.save(model.state_dict(), io.BytesIO())
    with torch.no_grad():  # a deep copy is an ordinary model: pruning it is post-processing of the release
        edited[0].weight[edited[0].weight.abs() < 0.1] = 0
    torch.save(edited.state_dict(), io.BytesIO())
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()  # the loop goes on from the released weights
    opt.step()
    assert engine.accountant.steps == 2


@pytest.mark.parametrize("how", ["by_hand", "data", "numpy", "inner_load_state_dict", "replaced_mapping",
                                 "unhooked_inner_step"])
def test_the_inner_optimizers_state_changed_between_steps_is_refused_and_put_back(how):
    """The momentum or moments changed outside the private step (a batch's gradient without noise added by hand,
    through ``.data`` or a NumPy view, or the state of an optimizer that stepped without noise loaded into the inner
    one): every later released step applied it, the weights untouched so no check saw it.  Refused now, the state
    as the last step left it put back, and the loop goes on.  With torch's optimizer hooks cleared, the inner
    optimizer stepped the batch's gradient itself: the weights were put back, its moments kept the gradient."""
    inner = torch.optim.Adam if how in ("data", "inner_load_state_dict", "unhooked_inner_step") else functools.partial(
        torch.optim.SGD, momentum=0.9)
    model, opt, loss, engine, x, y = _setup(optimizer_cls=inner)
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    key = "exp_avg" if isinstance(opt.original_optimizer, torch.optim.Adam) else "momentum_buffer"
    left = {id(p): opt.state[p][key].clone() for p in model.parameters()}
    released = [p.detach().clone() for p in model.parameters()]
    loss.per_example(model(x), y).sum().backward()
    raw = {id(p): p.grad.clone() for p in model.parameters()}  # the batch's gradient, no noise
    opt.zero_grad()
    first = next(model.parameters())
    if how == "by_hand":
        opt.state[first][key].add_(raw[id(first)])
    elif how == "data":
        opt.state[first][key].data = opt.state[first][key].data + raw[id(first)]
    elif how == "numpy":
        opt.state[first][key].numpy()[...] += raw[id(first)].numpy()
    elif how == "unhooked_inner_step":
        hooks = importlib.import_module("torch.optim.optimizer")._global_optimizer_pre_hooks
        kept = dict(hooks)
        hooks.clear()  # the hook that refuses a step of the model's parameters outside the private optimizer
        try:
            for p in model.parameters():
                p.grad = raw[id(p)]
            opt.original_optimizer.step()
        finally:
            hooks.update(kept)
        opt.zero_grad()
    else:
        twin = copy.deepcopy(model)  # an ordinary model: an optimizer of its own may step it
        plain = inner(twin.parameters(), lr=0.0)
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = raw[id(p)]
        plain.step()
        if how == "inner_load_state_dict":
            opt.original_optimizer.load_state_dict(plain.state_dict())
        else:
            opt.original_optimizer.state = {p: plain.state[q] for p, q in zip(model.parameters(), twin.parameters())}
    loss.per_example(model(x), y).sum().backward()
    message = _refused(opt, engine, r"changed outside the private step since its last release", released)
    assert "momentum or moments of 0.weight" in message and engine.accountant.steps == 1
    assert all(torch.equal(opt.state[p][key], left[id(p)]) for p in model.parameters())
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 2


def test_a_changed_inner_state_cannot_be_saved_for_a_resume():
    """Momentum written by hand, then a checkpoint: the saved state held it, and a resume took the loaded state as
    released, so the resumed run applied the written gradient at every step.  The save is refused now, the state
    put back; saved again, the checkpoint holds what the last step left."""
    model, opt, loss, engine, x, y = _setup(optimizer_cls=functools.partial(torch.optim.SGD, momentum=0.9))
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    first = next(model.parameters())
    left = opt.state[first]["momentum_buffer"].clone()
    opt.state[first]["momentum_buffer"].add_(1.0)
    with pytest.raises(BoundError, match=r"momentum or moments of 0\.weight\) changed outside the private step"):
        opt.state_dict()
    assert torch.equal(opt.state[first]["momentum_buffer"], left)
    saved = copy.deepcopy(opt.state_dict())
    assert torch.equal(saved["optimizer"]["state"][0]["momentum_buffer"], left)


def test_the_inner_optimizers_own_steps_and_a_schedule_are_accepted():
    """What may change between steps without a refusal: the learning rate (a schedule: post-processing), and the
    state each private step leaves, over several steps and through a resume of the private optimizer."""
    model, opt, loss, engine, x, y = _setup(optimizer_cls=torch.optim.Adam)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        loss.per_example(model(x), y).sum().backward()
        opt.step()
        schedule.step()
    assert engine.accountant.steps == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    model2, opt2, loss2, engine2, _, _ = _setup(optimizer_cls=torch.optim.Adam)
    model2.load_state_dict(weights)
    opt2.load_state_dict(saved)
    loss2.per_example(model2(x), y).sum().backward()
    opt2.step()
    assert engine2.accountant.steps == 4


def test_a_refused_step_leaves_the_released_weights_whichever_check_refuses_it():
    """A hand update from one batch's gradient, then a step refused for another slip (two batches drawn): the
    refusal named the slip, and the updated weights stayed in the model, where the next save would release them.
    Any refusal now puts the released state back."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    batches = iter(loader)
    bx, by = next(batches)
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    released = [p.detach().clone() for p in model.parameters()]
    bx, by = next(batches)
    loss.per_example(model(bx), by).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
    opt.zero_grad()
    bx, by = next(batches)
    loss.per_example(model(bx), by).sum().backward()
    _refused(opt, engine, "2 batches were drawn", released)


def test_a_step_past_the_budget_puts_the_released_weights_back():
    """The budget's refusal ran before the step's other checks and outside the restore: a hand update made after
    the last allowed step stayed in the model (whose next save released it).  It is put back like any refusal."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, *SHAPE, generator=gen)
    data = cl.ArrayDataset(x / x.norm(dim=1, keepdim=True), torch.randint(0, 3, (96,), generator=gen))
    model = nn.Sequential(cl.LipschitzLinear(6, 8), cl.MaxMin(), cl.LipschitzLinear(8, 3))
    loss, engine = cl.TauCrossEntropy(2.0), cl.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=loss,
        target_epsilon=50.0, target_delta=1e-5, epochs=1, input_shape=SHAPE, batch_size=16.0, input_bound=1.0)
    for bx, by in loader:
        opt.zero_grad()
        loss.per_example(model(bx), by).sum().backward()
        opt.step()
    steps, released = engine.accountant.steps, [p.detach().clone() for p in model.parameters()]
    bx, by = next(iter(loader))
    loss.per_example(model(bx), by).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
    with pytest.raises(BudgetExhaustedError, match=r"allows \d+ steps and all were taken"):
        opt.step()
    assert engine.accountant.steps == steps
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), released))


def test_making_a_model_private_again_retires_the_earlier_optimizer():
    """Before, the earlier optimizer's guard stayed on the model (its hooks watched every forward), a step of it
    was refused as "the backward ... did not come from a clipless loss", and that refusal put its own older released
    state back into the model, so the new optimizer's next step was refused in turn.  Now the earlier guard
    leaves the model and its step is refused by name, leaving the model alone."""
    model, opt, loss, engine, _, loader = _setup_with_loader()
    batches = iter(loader)
    bx, by = next(batches)
    loss.per_example(model(bx), by).sum().backward()
    opt.step()
    model, again, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=loader.dataset, loss=loss,
        noise_multiplier=1.0, input_shape=SHAPE, batch_size=16.0, input_bound=1.0)
    hooks = [h for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for h in d.values()]
    assert not any(getattr(h, "guard", None) is opt.guard for h in hooks)
    batches = iter(loader)
    bx, by = next(batches)
    loss.per_example(model(bx), by).sum().backward()
    released = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BoundError, match="this private optimizer was replaced"):
        opt.step()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), released))
    again.step()
    assert engine.accountant.steps == 2


def test_a_cast_of_the_model_between_steps_is_no_change():
    """``model.double()`` after ``make_private`` changes no value: the released state is compared in the new dtype."""
    model, opt, loss, engine, x, y = _setup()
    model.double()
    for _ in range(2):
        opt.zero_grad()
        loss.per_example(model(x.double()), y).sum().backward()
        opt.step()
    assert engine.accountant.steps == 2 and model[0].weight.dtype == torch.float64
