"""Bad input gets a clear error, never a silent wrong epsilon."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import clipless as cl
from clipless.contrastive import ContrastivePretrainer
from clipless.privacy.bounds import BoundEngine
from clipless.privacy.certified import BoundError
from clipless.privacy.sampling import record_chunks
from clipless.train.checkpoint import load_checkpoint, save_checkpoint

SHAPE = (1, 4, 4)


def trainer_for(model, data, **kw):
    args = dict(input_shape=SHAPE, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0, progress=False, log=None)
    args.update(kw)
    return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(), data, **args)


@pytest.fixture
def data():
    torch.manual_seed(0)
    return cl.ArrayDataset(torch.rand(64, *SHAPE), torch.randint(0, 3, (64,)))


def test_nan_data_refused():
    x = torch.rand(10, *SHAPE)
    x[3, 0, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        cl.ArrayDataset(x, torch.zeros(10, dtype=torch.long))


def test_nan_input_at_training_time_refused(data):
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    trainer_for(model, data)
    x = torch.rand(2, *SHAPE)
    x[0, 0, 0, 0] = float("inf")
    with pytest.raises(BoundError, match="NaN or infinite"):
        model(x)


@pytest.mark.parametrize("delta", [1 / 64, "1e-3", True])
def test_delta_not_below_one_over_n_refused(data, delta):
    """The string "1e-3" died with "'<' not supported between instances of 'int' and 'str'"."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match="1/N"):
        trainer_for(model, data, delta=delta)


@pytest.mark.parametrize("bad", [nn.Linear(16, 3), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Softplus()])
def test_layer_without_declared_bounds_refused(bad, data):
    tail = [bad, cl.LipschitzLinear(16, 3)] if not isinstance(bad, nn.Linear) else [bad]
    model = nn.Sequential(cl.InputNormClip(1.0), nn.Flatten(), *tail)
    with pytest.raises(BoundError, match="declares no Lipschitz/gradient bounds"):
        trainer_for(model, data)


def test_every_layer_without_declared_bounds_is_named_at_once_with_its_replacement():
    """A model of torch layers is refused in one error that names each layer lacking bounds and what to use
    instead, and the model with those replacements is accepted: a user fixes every layer in one round."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Softplus(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Dropout(0.1), nn.LayerNorm(16), nn.Linear(16, 3))
    with pytest.raises(BoundError) as info:
        BoundEngine(model, SHAPE, 1.0, 1.0)
    message = str(info.value)
    assert message.startswith("7 layers declare no Lipschitz/gradient bounds")
    for name, layer, fix in [("0", "Conv2d", "LipschitzConv2d"), ("1", "BatchNorm2d", "remove it"),
                             ("2", "Softplus", "MaxMin"), ("3", "MaxPool2d", "L2NormPool2d"),
                             ("5", "Dropout", "remove it"), ("6", "LayerNorm", "LayerCentering"),
                             ("7", "Linear", "LipschitzLinear")]:
        assert f"'{name}' ({layer}: " in message and fix in message.split(f"'{name}' ({layer}: ")[1].split(")")[0]
    fixed = nn.Sequential(cl.LipschitzConv2d(1, 4, 3, padding=1), cl.MaxMin(), cl.L2NormPool2d(2), nn.Flatten(),
                          cl.LayerCentering(), cl.LipschitzLinear(16, 3))
    assert BoundEngine(fixed, SHAPE, 1.0, 1.0).compute().layers
    assert "clipless.to_lipschitz(model) replaces torch's Linear, Conv2d and pooling layers" in message
    with pytest.warns(UserWarning, match="by nn.Identity"):  # the converter does the rest but the activation
        converted = cl.to_lipschitz(model, drop_unbounded=True)
    with pytest.raises(BoundError, match=r"^layer '2' \(Softplus: use an activation with a certified constant"):
        BoundEngine(converted, SHAPE, 1.0, 1.0)
    many = nn.Sequential(*[nn.Linear(4, 4) for _ in range(11)])
    with pytest.raises(BoundError, match=r"11 layers declare .*'7' \(Linear: use LipschitzLinear\) and 3 more\)"):
        BoundEngine(many, (4,), 1.0, 1.0)


def test_parameter_without_bound_refused():
    class Sneaky(cl.BoundedModule):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.scale

        def layer_bound(self, x_bound, in_shape):
            return cl.LayerBound(1.0, x_bound)  # forgets the parameter

    model = nn.Sequential(nn.Flatten(), Sneaky(), cl.LipschitzLinear(16, 3))
    with pytest.raises(BoundError, match="declares no bound for parameter 'scale'"):
        BoundEngine(model, SHAPE, 1.0, 1.0).compute()


def test_shared_module_refused():
    layer = cl.LipschitzLinear(4, 4)
    with pytest.raises(BoundError, match="used twice"):
        BoundEngine(nn.Sequential(layer, cl.MaxMin(), layer), (4,), 1.0, 1.0)


def test_shape_mismatch_refused(data):
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    trainer_for(model, data)
    with pytest.raises(BoundError, match="per-example shape"):
        model(torch.rand(2, 1, 16))
    with pytest.raises(BoundError, match="does not accept inputs"):
        BoundEngine(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,)), (1, 5, 5), 1.0, 1.0)


def test_input_bound_violated_by_data_refused(data):
    """Refused by make_private (every in-memory record checked), before any step."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,))
    with pytest.raises(BoundError, match="the training data: a record has a norm above the declared input_bound 0.5"):
        trainer_for(model, data, input_bound=0.5)  # rand(1,4,4) has norm ~2.3


def test_make_private_checks_every_in_memory_record_before_any_step():
    """In a loop of one's own too: a record the step would refuse is refused by make_private, not at whichever step
    first draws it.  Datasets that hold their records as tensors are checked from them (``in_memory_records()``,
    ``TensorDataset(x, y)``, a ``Subset`` of either); others are read once (next test), or, with
    ``check_records=False``, checked batch by batch by the step."""
    from torch.utils.data import Dataset, Subset, TensorDataset

    x = torch.rand(40, *SHAPE) / 4  # 16 pixels in [0, 1/4]: norms <= 1
    y = torch.randint(0, 3, (40,))
    far = x.clone()
    far[9] *= 8

    class Records(Dataset):  # a dataset of one's own that hands its records over
        def __init__(self, inputs, labels):
            self.inputs, self.labels = inputs, labels

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return self.inputs[i], self.labels[i]

        def in_memory_records(self):
            return self.inputs, self.labels

    class Streamed(Records):  # the same, without handing its records over
        in_memory_records = None

    def private(dataset, **kwargs):
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=None)
        return cl.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset,
            loss=cl.TauCrossEntropy(), noise_multiplier=1.0, input_shape=SHAPE, batch_size=8.0, input_bound=1.0,
            **kwargs)

    for dataset in (cl.ArrayDataset(far, y), TensorDataset(far, y), Subset(TensorDataset(far, y), range(5, 15)),
                    Records(far, y)):
        with pytest.raises(BoundError, match="the training data: a record has a norm above the declared input_bound"):
            private(dataset)
    with pytest.raises(ValueError, match=r"the training data: labels must be class indices in \[0, 3\)"):
        private(TensorDataset(x, y + 1))
    private(Subset(TensorDataset(far, y), range(10, 40)))  # the far record is not in it
    # not read ahead (check_records=False; every record far here, so that the first batch holds one): the step
    # refuses it
    model, optimizer, loader = private(Streamed(x * 8, y), check_records=False)
    with pytest.raises(BoundError, match="an input of the batch has a norm above"):
        for inputs, labels in loader:
            optimizer.zero_grad()
            cl.TauCrossEntropy().per_example(model(inputs), labels).sum().backward()
            optimizer.step()


def test_a_data_loaders_worker_settings_are_kept_and_its_own_collate_is_refused():
    """A ``DataLoader`` given to make_private keeps how its records are loaded (worker processes, pinned memory):
    dropping them silently made a dataset that decodes files in ``__getitem__`` load in one process.  Its batches
    become Poisson batches; a collate function of its own is refused, since it sees the whole batch and may mix
    records (mixup across the batch), which no per-example bound covers."""
    from torch.utils.data import DataLoader, Dataset

    class Files(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.full(SHAPE, 0.01 * (i % 7)), i % 3

    def private(data, **kwargs):
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=None)
        loss = cl.TauCrossEntropy()
        _, optimizer, loader = cl.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=loss,
            noise_multiplier=1.0, input_shape=SHAPE, input_bound=1.0, progress=False, **kwargs)
        return model, optimizer, loader, loss

    model, optimizer, loader, loss = private(DataLoader(Files(), batch_size=16, num_workers=2,
                                                        persistent_workers=True, shuffle=True))
    assert loader.num_workers == 2 and loader.persistent_workers and type(loader).__name__ == "PoissonDataLoader"
    for x, y in loader:  # batches loaded by the workers still pass the step's checks
        optimizer.zero_grad()
        loss.per_example(model(x), y).sum().backward()
        optimizer.step()
    assert optimizer.accountant.steps == 4  # one epoch: 4 Poisson batches at rate 16/64
    assert private(DataLoader(Files(), batch_size=16))[2].num_workers == 0
    assert private(loader, batch_size=16.0)[2].num_workers == 2  # a Poisson loader given again (made private again)

    def mixup(batch):
        x = torch.stack([b[0] for b in batch])
        return 0.5 * (x + x.flip(0)), torch.tensor([b[1] for b in batch])

    for collate in (mixup, lambda batch: torch.utils.data.default_collate(batch)):
        with pytest.raises(ValueError, match="the data loader has a collate_fn of its own .* may mix its records"):
            private(DataLoader(Files(), batch_size=16, collate_fn=collate))
    # a sampler that chooses records (a train part of one dataset, class weights, a shard) would be dropped, and the
    # records it leaves out (a validation part, say) trained on: refused; a plain or shuffled order chooses none
    from torch.utils.data import BatchSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    for sampler in (SubsetRandomSampler(range(48)), WeightedRandomSampler(torch.ones(64), 64),
                    DistributedSampler(Files(), num_replicas=2, rank=0)):
        with pytest.raises(ValueError, match=f"the data loader's {type(sampler).__name__} chooses the records its "
                                             "batches hold; make_private draws Poisson batches over every record"):
            private(DataLoader(Files(), batch_size=16, sampler=sampler))
    with pytest.raises(ValueError, match="the data loader's list chooses the records"):
        private(DataLoader(Files(), batch_sampler=[[0, 1], [2, 3]]), batch_size=16.0)
    with pytest.raises(ValueError, match="the data loader's SequentialSampler chooses the records"):
        private(DataLoader(Files(), batch_size=16, sampler=SequentialSampler(range(48))))  # the first 48 only
    private(DataLoader(Files(), batch_sampler=BatchSampler(SequentialSampler(range(64)), 16, False)), batch_size=16.0)
    private(DataLoader(Files(), batch_size=16, shuffle=True))


def test_the_read_of_the_records_shows_a_bar_on_a_terminal_only(capsys, monkeypatch):
    """The record check's read of a dataset not in memory can be long: a bar counts the records, shown where
    ``progress`` asks for it (by default, when stderr is a terminal), never for a dataset in memory."""
    from torch.utils.data import Dataset

    class Files(Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):
            return torch.full(SHAPE, 0.01), i % 3

    def private(dataset, **kwargs):
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=None)
        cl.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset,
            loss=cl.TauCrossEntropy(), noise_multiplier=1.0, input_shape=SHAPE, batch_size=8.0, input_bound=1.0,
            **kwargs)
        return capsys.readouterr().err

    assert "checking the records:   0%|          | 0/50" in private(Files(), progress=True)
    assert private(Files()) == "" and private(Files(), progress=False) == ""  # pytest's stderr is no terminal
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert "checking the records" in private(Files())
    assert private(cl.ArrayDataset(torch.full((50, *SHAPE), 0.01), torch.arange(50) % 3), progress=True) == ""


def test_make_private_reads_every_record_of_a_dataset_not_in_memory_before_any_step():
    """A dataset that hands over no tensors (records read from files, built in ``__getitem__``) is read once, in order,
    by make_private: a bad record anywhere in it is refused before any step, not at the step whose secret Poisson
    batch first holds it (a stop whose timing depends on the sampling and on that record).  The read goes through the
    loader's collate (and a dataset's ``gather``); a distributed rank reads its own shard."""
    from torch.utils.data import Dataset, Subset

    from clipless.privacy.sampling import record_chunks

    x = torch.rand(40, *SHAPE) / 4  # norms <= 1
    y = torch.randint(0, 3, (40,))
    reads = []

    class Files(Dataset):  # records made on each read, as from files
        def __init__(self, inputs, labels):
            self.inputs, self.labels = inputs, labels

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            reads.append(i)
            return self.inputs[i].clone(), int(self.labels[i])

    class Gathered(Files):
        def gather(self, indices):
            return self.inputs[indices].clone(), self.labels[indices].clone()

    def private(dataset, **kwargs):
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=None)
        return cl.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset,
            loss=cl.TauCrossEntropy(), noise_multiplier=1.0, input_shape=SHAPE, batch_size=8.0, input_bound=1.0,
            **kwargs)

    def changed(i, value=None, label=None):
        inputs, labels = x.clone(), y.clone()
        if value is not None:
            inputs[i] = value
        if label is not None:
            labels[i] = label
        return inputs, labels

    for kind in (Files, Gathered):
        far = kind(*changed(37, value=x[37] * 8))
        with pytest.raises(BoundError, match="the training data: a record has a norm above the declared input_bound"):
            private(far)
        with pytest.raises(BoundError, match="a record has a norm above"):
            private(Subset(far, range(30, 40)))
        private(Subset(far, range(0, 30)))  # the far record is not in it
        with pytest.raises(ValueError, match="the training data contains NaN or infinite values"):
            private(kind(*changed(21, value=torch.full(SHAPE, float("nan")))))
        with pytest.raises(ValueError, match=r"the training data: labels must be class indices in \[0, 3\)"):
            private(kind(*changed(39, label=3)))
        private(kind(x, y))
    reads.clear()
    private(Files(x, y))
    # each record read once, record 0 twice more: the two collates' templates of an empty batch
    assert sorted(set(reads)) == list(range(40)) and len(reads) == 42
    with pytest.raises(ValueError, match=r"per-example shape \(1, 4, 5\)"):
        private(Files(torch.rand(40, 1, 4, 5) / 8, y))
    # records the step's norms cannot take (8-bit pixels) or whose arithmetic no bound certifies: refused here, in
    # memory or not, not by torch's error at the first nonempty Poisson batch
    for dtype in (torch.uint8, torch.int64, torch.float16, torch.bfloat16):
        for dataset in (Files((x * 4).to(dtype), y), cl.ArrayDataset((x * 4).to(dtype), y)):
            with pytest.raises(ValueError, match=f"the training data: records of dtype {dtype}; the private step "
                                                 "takes float32 or float64 inputs"):
                private(dataset)
    # float64 records and a float32 model: refused by name here, not by torch's dtype error at the first batch
    for dataset in (Files(x.double(), y), cl.ArrayDataset(x.double(), y)):
        with pytest.raises(ValueError, match=r"the training data: records of dtype torch.float64, the model's weights "
                                             r"torch.float32, and the model's forward refuses them \(.*\); convert"):
            private(dataset)
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=None).double()
    for dataset in (Files(x.double(), y), Files(x, y)):  # a float64 model takes float64 records, not float32 ones
        try:
            cl.PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset,
                loss=cl.TauCrossEntropy(), noise_multiplier=1.0, input_shape=SHAPE, batch_size=8.0, input_bound=1.0)
            assert dataset.inputs.dtype == torch.float64
        except ValueError as err:
            assert dataset.inputs.dtype == torch.float32 and "the model's weights torch.float64" in str(err)
    # check_records=False: no read ahead; the step refuses the record when a batch holds it
    reads.clear()
    private(Files(*changed(37, value=x[37] * 8)), check_records=False)
    assert len(reads) <= 1
    # records that are not (input, label) pairs are left to the step, whose loop unpacks them
    triples = type("Triples", (Dataset,), {"__len__": lambda self: 3,
                                           "__getitem__": lambda self, i: (torch.zeros(2), 0, i)})()
    assert list(record_chunks(triples)) == []
    chunks = list(record_chunks(Files(x, y), indices=range(1, 40, 3), chunk=5))
    assert torch.equal(torch.cat([c[0] for c in chunks]), x[1::3]) and torch.equal(torch.cat([c[1] for c in chunks]),
                                                                                   y[1::3])


def test_the_input_bounds_tolerance_is_inside_the_certified_bound():
    """The data check admits norms up to input_bound (1 + 1e-6) (data normalized to the bound in float32); the bounds
    use that raised X_0, so an admitted input is never above the bound the noise was calibrated for, and one just
    above the tolerance is refused."""
    from clipless.privacy.input_guard import INPUT_BOUND_TOLERANCE

    x = torch.rand(8, *SHAPE, dtype=torch.float64)
    x = x / x.flatten(1).norm(dim=1).view(-1, 1, 1, 1)  # unit rows
    data = cl.ArrayDataset(x.float(), torch.randint(0, 3, (8,)))
    for clip in (None, 5.0):  # a plain model, and one whose InputNormClip is wider than the declared bound
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=clip).double()
        model, opt, _ = cl.PrivacyEngine("rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
            loss=cl.TauCrossEntropy(4.0), noise_multiplier=1.0, input_shape=SHAPE, batch_size=4.0, input_bound=1.0,
            external_batches=True)
        x0 = opt.bound_engine.input_bound
        assert x0 == 1.0 * (1 + INPUT_BOUND_TOLERANCE)
        admitted = x * (1 + 0.9 * INPUT_BOUND_TOLERANCE)
        model(admitted)  # admitted, and within X_0
        assert float(admitted.flatten(1).norm(dim=1).max()) <= x0
        with pytest.raises(BoundError, match="declared input_bound"):
            model(x * (1 + 2 * INPUT_BOUND_TOLERANCE))


def test_missing_input_bound_refused(data):
    with pytest.raises(BoundError, match="no input bound"):
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,)), data)


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_input_bound_is_refused_as_given(data, bound):
    """The tolerance was applied first: input_bound=-1 was refused as "got -1.000001"; the string "1" was read as
    1.0 and accepted."""
    with pytest.raises(BoundError, match=rf"input_bound must be a positive finite number .*got {bound!r}$"):
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,)), data, input_bound=bound)


def test_loss_without_lipschitz_constant_refused(data):
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(BoundError, match="declares no Lipschitz constant"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=data, loss=nn.CrossEntropyLoss(), noise_multiplier=1.0,
                                        input_shape=SHAPE, batch_size=8)


def test_resume_without_accountant_state_refused(data, tmp_path):
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    trainer = trainer_for(model, data)
    trainer.fit()
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path)
    state = load_checkpoint(path)
    del state["accountant"]
    save_checkpoint(state, path)
    fresh = trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), data)
    with pytest.raises(ValueError, match="no accountant state"):
        fresh.load_checkpoint(path)


def test_resume_with_other_privacy_config_refused(data, tmp_path):
    trainer = trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), data)
    trainer.fit()
    trainer.save_checkpoint(tmp_path / "c.pt")
    other = trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), data, noise_multiplier=0.5)
    with pytest.raises(ValueError, match="effective_noise_multiplier"):
        other.load_checkpoint(tmp_path / "c.pt")


def test_centering_over_batch_axis_refused():
    with pytest.raises(ValueError, match="batch axis"):
        cl.LayerCentering(dims=(0, 1))


def test_budget_too_small_for_one_step(data):
    with pytest.raises(ValueError, match="single step"):
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), data, noise_multiplier=0.05,
                    target_epsilon=0.01, accountant="rdp")


@pytest.mark.parametrize("width", [16, 784, 3969, 100_000])
def test_input_bound_check_is_exact_near_the_bound(width):
    """The float32 fast path of the data-bound check never lets an input above the bound through."""
    from clipless.privacy.input_guard import largest_norm as _largest_norm

    gen = torch.Generator().manual_seed(width)
    bound = 3.0
    for rel in (-1e-4, -1e-6, 0.0, 2e-6, 1e-5, 1e-3):
        x = torch.rand(8, width, generator=gen, dtype=torch.float64) + 1e-3
        x = x / x.norm(dim=1, keepdim=True) * bound * (1 + rel)
        x32 = x.float()
        exact = float(x32.double().norm(dim=1).max())
        got = _largest_norm(x32, bound)
        if exact > bound * (1 + 1e-6):
            assert got > bound * (1 + 1e-6)
        gamma = 2 * width * 2.0**-24  # the float32 path is only taken when this error cannot cross the bound
        assert abs(got - exact) <= gamma * exact + 1e-12
    x = torch.full((2, width), 1e-3)
    assert _largest_norm(x, bound) == pytest.approx(float(x.double().norm(dim=1).max()), rel=2 * width * 2.0**-24)


def test_nan_and_inf_inputs_refused_by_the_guard():
    model = cl.lipschitz_mlp((5,), 3, hidden=(4,), input_clip=1.0)
    engine = cl.PrivacyEngine()
    model, _, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      data=cl.ArrayDataset(torch.rand(20, 5), torch.randint(0, 3, (20,))),
                                      loss=cl.TauCrossEntropy(1.0), noise_multiplier=1.0, input_shape=(5,),
                                      batch_size=5)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.rand(4, 5)
        x[2, 3] = bad
        with pytest.raises(BoundError, match="NaN or infinite"):
            model(x)
    model(torch.full((2, 5), 3e38))  # finite entries whose sum overflows are still accepted


@pytest.mark.parametrize("batch_size", [True, "8", 0, 65, float("nan")])
def test_bad_expected_batch_size_refused_by_make_private_and_the_trainer(batch_size, data):
    """``batch_size=True`` read as 1 before (a boolean is an int in Python): q = 1/N was accounted silently."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match="batch_size|batch size"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=data, loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                        input_shape=SHAPE, batch_size=batch_size)
    with pytest.raises(ValueError, match="batch_size"):
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), data, batch_size=batch_size)


def test_empty_training_set_named() -> None:
    """An empty dataset read as a batch size outside (0, N=0]."""
    empty = cl.ArrayDataset(torch.rand(0, *SHAPE), torch.zeros(0, dtype=torch.long))
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match="training dataset is empty"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=empty, loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                        input_shape=SHAPE, batch_size=8.0)


def test_an_iterable_dataset_is_refused_by_name(data) -> None:
    """An IterableDataset died with "object of type ... has no len()"; Poisson sampling needs indices."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)

    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(TypeError, match="map-style Dataset with a length .*Stream"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=Stream(), loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                        input_shape=SHAPE, batch_size=8.0)
    with pytest.raises(TypeError, match="map-style Dataset"):
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), Stream())
    with pytest.raises(TypeError, match="map-style Dataset with a length .*Stream"):  # in a loader: the same refusal
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0),
                    torch.utils.data.DataLoader(Stream(), batch_size=8))


@pytest.mark.parametrize("shape", [16, None, (0, 4, 4), (1, 4.0, 4), (True, 4, 4), ()])
def test_a_bad_input_shape_is_refused_by_name(data, shape) -> None:
    """A bare number or None died with "'int' object is not iterable"; a float dimension was truncated by
    ``int()`` in the bounds and kept as given by the input guard (every batch then refused as another shape)."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match="input_shape must be the per-example shape"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=data, loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                        input_shape=shape, batch_size=8.0)
    with pytest.raises(ValueError, match="input_shape must be the per-example shape"):
        trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), data, input_shape=shape)


@pytest.mark.parametrize("given", ["tensor", "tuple"])
def test_tensors_given_as_the_dataset_are_refused_by_name(data, given) -> None:
    """``data=x`` died inside the loader with "gather(): argument 'dim' must be int"; ``data=(x, y)`` was read as a
    dataset of two records (and refused only as a batch size above N=2)."""
    x, y = data.features, data.labels
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(TypeError, match="wrap the tensors, e.g. clipless.ArrayDataset"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=x if given == "tensor" else (x, y), loss=cl.TauCrossEntropy(),
                                        noise_multiplier=1.0, input_shape=SHAPE, batch_size=1.0)


@pytest.mark.parametrize("setting", ["checkpoint_dir", "checkpoint_under_file", "average_decay", "multiplicity"])
def test_trainer_settings_of_the_wrong_kind_are_refused_before_training(data, setting, tmp_path) -> None:
    """A directory given as checkpoint_path trained a whole epoch, then died on the first write ("Is a directory");
    ``average_decay="0.9"`` died with "'<' not supported"; ``augmentation_multiplicity=True`` ran as K = 1."""
    (tmp_path / "file").write_text("")
    value = {"checkpoint_dir": ("checkpoint_path", tmp_path),
             "checkpoint_under_file": ("checkpoint_path", tmp_path / "file" / "c.pt"),
             "average_decay": ("average_decay", "0.9"), "multiplicity": ("augmentation_multiplicity", True)}[setting]
    match = {"checkpoint_dir": "is a directory", "checkpoint_under_file": "which is a file",
             "average_decay": "average_decay must be a number in", "multiplicity": "must be an integer >= 1"}[setting]
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match=match):
        trainer_for(model, data, **dict([value]))


@pytest.mark.parametrize("weights", [{"2": "2"}, {"2": True}, 3, ["2"], "bogus"])
def test_per_layer_weights_of_the_wrong_kind_are_refused(data, weights) -> None:
    """``float()`` read the string "2" and ``True`` as relative weights; a bare number died with "'int' object is
    not iterable"."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    names = [n for n, m in model.named_modules() if isinstance(m, cl.LipschitzLinear)]
    if isinstance(weights, dict):
        weights = {names[0]: next(iter(weights.values()))}
    with pytest.raises(ValueError, match="layer_noise_multipliers must be"):
        trainer_for(model, data, strategy="per_layer", layer_noise_multipliers=weights)


def _make_private(data, **kw):
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    return cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           data=data, loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                           input_shape=SHAPE, batch_size=8.0, **kw)


@pytest.mark.parametrize("name, value", [
    ("external_batches", "no"), ("external_batches", 1), ("check_records", "no"), ("check_records", 0),
    ("secure_noise", "yes"), ("distributed", "no"), ("progress", "no"), ("progress", 0.5)])
def test_a_switch_of_make_private_that_is_not_a_bool_is_refused(data, name, value) -> None:
    """``external_batches="no"`` (a truthy string) switched the batch check off without a word."""
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        _make_private(data, **{name: value})


@pytest.mark.parametrize("name", ["noise_generator", "sampling_generator"])
@pytest.mark.parametrize("value", [1, "secret", torch.tensor(1), torch.Generator().get_state()])
def test_a_generator_that_is_not_a_torch_generator_is_refused_by_name(data, name, value) -> None:
    """An int given as a generator failed inside torch at the first draw, naming neither the setting nor the fix."""
    with pytest.raises(TypeError, match=f"{name} must be a torch.Generator, or None"):
        _make_private(data, **{name: value})
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        cl.PoissonBatchSampler(10, 0.5, generator=value)


@pytest.mark.parametrize("value", ["no", "false", 1, None])
def test_the_opt_in_to_statistics_without_noise_must_be_a_bool(data, value) -> None:
    """``log_train_stats="no"`` read as True: the run logged and saved training statistics without noise."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match="log_train_stats must be True or False"):
        trainer_for(model, data, log_train_stats=value)
    pairs = torch.utils.data.TensorDataset(torch.rand(16, 4), torch.rand(16, 4))
    encoder = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="log_train_stats must be True or False"):
        ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1), pairs, batch_size=4.0,
                              epochs=1, delta=1e-3, noise_multiplier=1.0, progress=False, log=None,
                              log_train_stats=value)


@pytest.mark.parametrize("setting, value, error, match", [
    ("device", "foo", ValueError, "device must name a torch device"),
    ("device", 3.5, ValueError, "device must name a torch device"),
    ("log", 3, TypeError, "log must be a function or None"),
    ("augment", "shift", TypeError, "augment must be a function or None"),
    ("lr_scheduler", 0.1, TypeError, "lr_scheduler must be a function or None"),
    ("tightness_monitor", 3, TypeError, "tightness_monitor must be a TightnessMonitor or None"),
])
def test_trainer_settings_read_at_the_first_batch_are_refused_when_given(data, setting, value, error, match) -> None:
    """A device typo or a non-callable hook failed inside the first batch, after the records were read and checked
    and the noise planned ("Expected one of cpu, cuda, ..." from torch, "'int' object has no attribute 'due'")."""
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    kw = {setting: value, **({"augmentation_multiplicity": 2} if setting == "augment" else {})}
    with pytest.raises(error, match=match):
        trainer_for(model, data, **kw)


_ONCE = torch.utils.data
_REPEATED = {  # each holds a record more than once: (index, times) reported
    "subset with repeated indices": (lambda d: _ONCE.Subset(d, list(range(64)) + [5, 5]), 5, 3),
    "the data concatenated twice": (lambda d: _ONCE.ConcatDataset([d, d]), 0, 2),
    "the data and a subset of it": (lambda d: _ONCE.ConcatDataset([d, _ONCE.Subset(d, [7, 9])]), 7, 2),
    "a subset of a concatenation": (lambda d: _ONCE.Subset(_ONCE.ConcatDataset([d, d]), [*range(16), 64 + 3]), 3, 2),
    "a negative index": (lambda d: _ONCE.Subset(d, [*range(16), 2 - 64]), 2, 2),
}


@pytest.mark.parametrize("how", sorted(_REPEATED))
def test_training_data_that_holds_a_record_more_than_once_is_refused(data, how) -> None:
    """Oversampling by repeated indices (a Subset, a ConcatDataset of the data and its minority class) passed: each
    copy is drawn on its own, so that record's privacy was that of several records, outside the reported epsilon."""
    build, index, times = _REPEATED[how]
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match=f"holds record {index} of its ArrayDataset {times} times"):
        trainer_for(model, build(data))
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match=f"holds record {index} of its ArrayDataset {times} times"):
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=_ONCE.DataLoader(build(data)), loss=cl.TauCrossEntropy(),
                                        noise_multiplier=1.0, input_shape=SHAPE, batch_size=8, input_bound=4.0)
    pairs = cl.ArrayDataset(torch.rand(64, 4), torch.rand(64, 4))
    encoder = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match=f"the training pairs holds record {index} of its ArrayDataset {times}"):
        ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1), build(pairs), batch_size=4.0,
                              epochs=1, delta=1e-3, noise_multiplier=1.0, progress=False, log=None)


class _Records(torch.utils.data.Dataset):
    """A dataset of one's own (read record by record): ``entry(i)`` is its ``i``-th ``(input, label)``."""

    def __init__(self, size, entry):
        self.size, self.entry = size, entry

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return self.entry(i)


def test_a_dataset_of_ones_own_that_hands_out_one_record_for_two_indices_is_refused(data) -> None:
    """Oversampling inside a Dataset of one's own passed where a Subset with repeated indices was refused: a list
    holding one record's tensor twice, or an index list naming one row of a tensor twice.  The same tensor (or the
    same view of it, while it lives) for two indices is one record held twice; records copied afresh at each read
    cannot be told from records equal in value and are accepted, as such records are."""
    x, y = data.features, data.labels
    listed = [(x[i].clone(), int(y[i])) for i in range(64)]
    listed += [listed[5]] * 2  # record 5 three times, the same tensor object
    rows = [*range(64), 9]  # row 9 of x twice, as two views of it
    for dataset, first, second in ((_Records(66, listed.__getitem__), 5, 64),
                                   (_Records(65, lambda i: (x[rows[i]], int(y[rows[i]]))), 9, 64)):
        for make in (lambda d: trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0), d),
                     lambda d: trainer_for(cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0),
                                           _ONCE.Subset(d, list(range(len(d)))))):
            with pytest.raises(ValueError, match=f"holds one record twice, at indices {first} and {second}"):
                make(dataset)
    fresh = [_Records(65, lambda i: (x[rows[i]].clone(), int(y[rows[i]]))),  # copies: equal values, stored apart
             _Records(64, lambda i: (x[i], int(y[i]))),  # honest views of one tensor
             _Records(64, lambda i: (torch.from_numpy(x[i].numpy().copy()), int(y[i])))]
    for dataset in fresh:
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
        assert trainer_for(model, dataset).fit().steps > 0
    views_a, views_b = torch.rand(64, 4), torch.rand(64, 4)
    pairs = [(views_a[i], views_b[i]) for i in range(64)] + [(views_a[3], views_b[3])]  # pair 3 twice
    encoder = nn.Sequential(nn.Linear(4, 3))
    shifted = _Records(64, lambda i: (views_a[i], views_a[(i + 1) % 64]))  # a positive taken from the next pair
    itself = _Records(64, lambda i: (views_a[i], views_a[i]))  # a record with itself: one pair, one record
    for made, indices in ((_Records(65, pairs.__getitem__), "3 and 64"), (shifted, "0 and 1"), (itself, None)):
        def build():
            return ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1), made,
                                         batch_size=4.0, epochs=1, delta=1e-3, noise_multiplier=1.0, progress=False,
                                         log=None)
        if indices is None:
            build()
            continue
        with pytest.raises(ValueError, match=f"the training pairs holds one record twice, at indices {indices}"):
            build()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["view", "object", "copy", "flat view"]), st.integers(0, 5)),
                min_size=1, max_size=24), st.integers(1, 7))
def test_one_record_for_two_indices_is_refused_exactly_when_an_input_repeats(entries, chunk) -> None:
    """Random datasets of one's own, each entry a record's row handed out as a view of a shared tensor, as one of a
    few shared tensor objects, as a copy made afresh at each read (whose freed memory a later copy may reuse, in
    chunks of any size), or as a slice of the tensor's flat view: refused exactly when one view or one object is handed
    out for two indices (a row viewed through a flat view of the tensor is the same row), never for copies or for views
    of different rows."""
    base = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    objects = [base[i].clone() for i in range(6)]

    def record(i):
        kind, row = entries[i]
        x = {"view": lambda: base[row], "object": lambda: objects[row], "copy": lambda: base[row].clone(),
             "flat view": lambda: base.view(-1)[4 * row:4 * row + 4]}[kind]()
        return x, 0

    shared = [("view" if kind == "flat view" else kind, row) for kind, row in entries if kind != "copy"]
    repeated = len(shared) != len(set(shared))
    dataset = _Records(len(entries), record)
    if repeated:
        with pytest.raises(ValueError, match="holds one record twice, at indices"):
            list(record_chunks(dataset, chunk=chunk, each_once="the training data"))
    else:
        chunks = record_chunks(dataset, chunk=chunk, each_once="the training data")
        assert sum(len(y) for _, y in chunks) == len(entries)


def test_training_data_of_disjoint_parts_or_equal_values_stored_apart_is_accepted(data) -> None:
    """Disjoint Subsets of one dataset, and records equal in value but stored apart (two datasets), are distinct."""
    for parts in (_ONCE.ConcatDataset([_ONCE.Subset(data, range(0, 32)), _ONCE.Subset(data, range(32, 64))]),
                  _ONCE.ConcatDataset([data, cl.ArrayDataset(data.features.clone(), data.labels.clone())]),
                  _ONCE.Subset(data, [*range(16), -1])):
        model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=1.0)
        assert trainer_for(model, parts).fit().steps > 0
