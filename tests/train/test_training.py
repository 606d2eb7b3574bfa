"""End to end: private training on real data, budget stop, checkpoint/resume, CLI."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml

import clipless as cl
from clipless.cli import main
from clipless.privacy.certified import BoundError
from helpers import write_fake_mnist
from clipless.train.checkpoint import fingerprint_key_path, load_checkpoint, save_checkpoint


def digits_trainer(epochs=4, seed=0, data_seed=0, **kw):
    """``seed`` fixes the noise and batches (None: OS entropy); the initialization is always seed 0;
    ``data_seed`` makes the train/test split."""
    torch.manual_seed(0)
    data = cl.load_digits(seed=data_seed)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(64, 64))
    args = dict(input_shape=data.input_shape, batch_size=256, delta=1e-5, epochs=epochs, target_epsilon=3.0,
                input_bound=8.0, noise_seed=seed, test_data=data.test, progress=False, log=None)
    args.update(kw)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return cl.PrivateTrainer(model, opt, cl.TauCrossEntropy(8.0), data.train, **args)


def test_test_data_that_is_the_training_data_refused():
    """Its per-epoch "test accuracy" would be computed from the training records without noise."""
    data = cl.load_digits()
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(8,))
    with pytest.raises(ValueError, match="test_data is the training data"):
        cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(8.0), data.train,
                          input_shape=data.input_shape, input_bound=8.0, batch_size=256, epochs=1, delta=1e-5,
                          target_epsilon=3.0, test_data=data.train, progress=False, log=None)
    with pytest.raises(ValueError, match="test_data holds the same records"):
        digits_trainer(test_data=cl.load_digits().train)  # a second load of the same split


def test_records_the_step_would_refuse_are_refused_before_any_step():
    """A record the private step refuses (a label outside the model's classes, a norm above the input bound, a NaN)
    used to stop the run at the step whose Poisson batch first held it: after a number of released steps that
    depends on that record (a checkpoint of them written), or never, when no batch drew it.  In-memory datasets are
    now checked whole by make_private (the training data) and the trainer (the held-out data), by the step's own
    rules."""
    from torch.utils.data import Subset, TensorDataset

    data = cl.load_digits()
    x, y = data.train.features, data.train.labels.clone()
    y[5] = 12
    far = x.clone()
    far[7] *= 3  # pixels in [0, 1]: norm up to 8, the bound; this record's is above it

    def build(train, test=None, loss=None, width=10, bound=8.0):
        torch.manual_seed(0)
        model = cl.lipschitz_mlp(data.input_shape, width, hidden=(8,))
        return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss or cl.TauCrossEntropy(8.0),
                                 train, input_shape=data.input_shape, input_bound=bound, batch_size=64, epochs=1,
                                 delta=1e-5, noise_multiplier=1.0, test_data=test, progress=False, log=None)

    for train in (cl.ArrayDataset(x, y), TensorDataset(x, y), Subset(cl.ArrayDataset(x, y), range(100))):
        with pytest.raises(ValueError, match=r"training data: labels must be class indices in \[0, 10\) .*outside"):
            build(train)
    with pytest.raises(ValueError, match=r"test_data: labels must be class indices"):
        build(data.train, TensorDataset(data.test.features, data.test.labels - 1))
    assert build(Subset(cl.ArrayDataset(x, y), range(6, 106))).steps == 0  # the bad record is not in it
    binary = (data.train.labels % 2).to(torch.long)
    build(cl.ArrayDataset(x, binary), loss=cl.BinaryCrossEntropyWithTemperature(), width=1)
    with pytest.raises(ValueError, match="the training data: binary labels must be 0 or 1"):
        build(cl.ArrayDataset(x, binary * 2), loss=cl.BinaryCrossEntropyWithTemperature(), width=1)
    # the data bound: the training records only (held-out data is evaluated without gradients)
    for train in (cl.ArrayDataset(far, data.train.labels), TensorDataset(far, data.train.labels)):
        with pytest.raises(BoundError, match="the training data: a record has a norm above the declared input_bound 8"):
            build(train)
    build(data.train, cl.ArrayDataset(far, data.train.labels))
    assert build(cl.ArrayDataset(far, data.train.labels), bound=24.0).steps == 0  # within a larger bound
    nan = x.clone()
    nan[3, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="the training data contains NaN or infinite values"):
        build(TensorDataset(nan, data.train.labels))
    with pytest.raises(ValueError, match=r"test_data: records of per-example shape \(64,\), the model's input_shape"):
        build(data.train, TensorDataset(data.test.features.flatten(1), data.test.labels))

    class Read(torch.utils.data.Dataset):  # no tensors handed over: read once by make_private
        def __len__(self):
            return len(far)

        def __getitem__(self, i):
            return far[i].clone(), int(data.train.labels[i])

    with pytest.raises(BoundError, match="the training data: a record has a norm above the declared input_bound 8"):
        build(Read())
    torch.manual_seed(0)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(8,))
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(8.0), Read(),
                                input_shape=data.input_shape, input_bound=8.0, batch_size=64, epochs=1, delta=1e-5,
                                noise_multiplier=1.0, progress=False, log=None, check_records=False)
    assert trainer.steps == 0  # not read ahead: the record is met when a batch holds it


def test_digits_private_training_learns_within_budget():
    trainer = digits_trainer(epochs=15)
    result = trainer.fit()
    assert result.epsilon <= 3.0
    assert result.epsilon > 2.9  # the calibrated sigma spends the budget
    assert result.test_accuracy > 0.5  # chance is 0.1
    assert result.sampling == "poisson" and result.randomness == "fixed-seed" and not result.private
    assert not result.stopped_by_budget  # the planned epochs fit the budget
    assert len(result.history) == 15


def test_training_stops_at_the_budget():
    trainer = digits_trainer(epochs=1000, target_epsilon=1.0, noise_multiplier=3.0, accountant="rdp")
    result = trainer.fit()
    assert result.stopped_by_budget
    assert result.epsilon <= 1.0
    assert cl.compute_epsilon(3.0, trainer.sample_rate, result.steps + 1, 1e-5, "rdp") > 1.0
    assert result.steps % len(trainer.loader)  # the budget ran out inside an epoch ...
    assert trainer.loader.batches_drawn == result.steps  # ... and no batch was drawn that no step released


def test_per_layer_strategy_composes_to_calibrated_sigma():
    trainer = digits_trainer(epochs=2, strategy="per_layer")
    sigmas = list(trainer.optimizer.layer_sigmas.values())
    assert len(sigmas) == 3
    assert cl.effective_noise_multiplier(sigmas) == pytest.approx(trainer.optimizer.effective_noise_multiplier)
    result = trainer.fit()
    assert result.epsilon <= 3.0


def test_a_trainer_that_released_steps_refuses_to_load_a_checkpoint(tmp_path):
    """Loading an earlier checkpoint into a trainer that has trained rolls its released steps back."""
    trainer = digits_trainer(epochs=2, checkpoint_path=tmp_path / "c.pt")
    trainer.fit()
    weights = [p.detach().clone() for p in trainer.module.parameters()]
    with pytest.raises(ValueError, match="this trainer has already released"):
        trainer.load_checkpoint(tmp_path / "c.pt")
    assert all(torch.equal(a, p) for a, p in zip(weights, trainer.module.parameters()))
    assert trainer.accountant.steps == trainer.steps


def test_a_new_trainer_never_writes_over_an_earlier_runs_checkpoint(tmp_path):
    """A fresh trainer whose checkpoint_path held an earlier run's checkpoint replaced it at the end of its first
    epoch.  It now refuses to start: load_checkpoint(path) continues that run, another path starts a new one.  A
    trainer that wrote the file itself, or resumed from it, goes on writing it."""
    from clipless.train.checkpoint import CheckpointError

    def trainer(path):
        return digits_trainer(epochs=3, checkpoint_path=path)

    path = tmp_path / "c.pt"
    first = trainer(path)
    planned, epoch = first.max_steps, len(first.loader)
    first.max_steps = epoch
    first.fit()
    first.max_steps = 2 * epoch  # the same trainer, trained further: its own file
    first.fit()
    written = path.read_bytes()
    fresh = trainer(path)
    with pytest.raises(CheckpointError, match="holds a file already .* load_checkpoint"):
        fresh.fit()
    assert path.read_bytes() == written and fresh.steps == 0 and fresh.accountant.steps == 0
    resumed = trainer(tmp_path / "." / "c.pt")  # the same file, spelt otherwise
    resumed.load_checkpoint(path)
    resumed.fit()
    assert resumed.steps == planned > first.steps and path.read_bytes() != written
    other = trainer(tmp_path / "other.pt")  # a path holding nothing: free
    other.max_steps = epoch
    other.fit()


def test_a_checkpoint_of_a_model_changed_after_its_last_step_is_refused(tmp_path):
    """Before, ``save_checkpoint`` saved whatever the model held: a hand update after ``fit()`` (a non-private
    fine-tuning step on the training data, say) went into the checkpoint, and from there into ``clipless export``,
    without noise.  Now it is refused, the released weights are put back and nothing is written."""
    trainer = digits_trainer(epochs=1)
    trainer.fit()
    released = [p.detach().clone() for p in trainer.module.parameters()]
    with torch.no_grad():
        next(trainer.module.parameters()).mul_(0.5)
    with pytest.raises(BoundError, match="weights of the private model changed outside the private step"):
        trainer.save_checkpoint(tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt").exists()
    assert all(torch.equal(a, p) for a, p in zip(released, trainer.module.parameters()))
    trainer.save_checkpoint(tmp_path / "ckpt.pt")  # the released model saves
    assert (tmp_path / "ckpt.pt").exists()


def test_a_checkpoint_of_the_other_trainer_is_refused_by_its_kind(tmp_path):
    """A pre-training checkpoint given to ``PrivateTrainer`` (or ``clipless train --resume`` / ``export``), or the
    reverse, was refused with a message about something else: a differing setting (``method=None``) or "written
    by an older version".  Now each names the kind of checkpoint it got and what resumes it, for checkpoints that
    record their kind and for earlier ones told apart by their weights; nothing is loaded."""
    from clipless.contrastive import AugmentedPairs, ContrastivePretrainer

    data = cl.load_digits()
    encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8))
    pretrainer = ContrastivePretrainer(encoder, torch.optim.Adam(encoder.parameters(), lr=1e-3),
                                       AugmentedPairs(data.train.features, 1, False), method="logit_dp",
                                       batch_size=128, epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False,
                                       log=None)
    pretrainer.fit()
    pretrainer.save_checkpoint(tmp_path / "pre" / "checkpoint.pt")
    trainer = digits_trainer(epochs=1)
    trainer.fit()
    trainer.save_checkpoint(tmp_path / "train.pt")
    assert load_checkpoint(tmp_path / "train.pt")["kind"] == "training"
    for name, kind in (("pre/checkpoint.pt", "pretraining"), ("train.pt", "training")):
        old = load_checkpoint(tmp_path / name)
        del old["kind"]  # as an earlier version wrote it
        save_checkpoint(old, tmp_path / f"old_{kind}.pt")
        shutil.copy(fingerprint_key_path(tmp_path / name), fingerprint_key_path(tmp_path / f"old_{kind}.pt"))
    fresh = digits_trainer(epochs=1)
    before = [p.detach().clone() for p in fresh.module.parameters()]
    for name in ("pre/checkpoint.pt", "old_pretraining.pt"):
        with pytest.raises(ValueError, match="is a contrastive pre-training checkpoint .*ContrastivePretrainer.*, "
                                             "not a private training checkpoint"):
            fresh.load_checkpoint(tmp_path / name)
    assert all(torch.equal(a, p) for a, p in zip(before, fresh.module.parameters())) and fresh.steps == 0
    for name in ("train.pt", "old_training.pt"):
        other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8))
        with pytest.raises(ValueError, match="is a private training checkpoint .*PrivateTrainer.*, not a contrastive"):
            ContrastivePretrainer(other, torch.optim.Adam(other.parameters()),
                                  AugmentedPairs(data.train.features, 1, False), method="logit_dp", batch_size=128,
                                  epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False,
                                  log=None).load_checkpoint(tmp_path / name)
    for command in (["train", "--resume", "--no-progress"], ["export"]):
        with pytest.raises(SystemExit, match="is a contrastive pre-training checkpoint"):
            main([*command, "--output-dir", str(tmp_path / "pre")])


def test_the_trainers_epsilon_and_label_settings_are_read_only():
    """``trainer.delta = 0.5`` made ``fit()`` report epsilon 0 for the same noise, and ``trainer.noise_seed =
    None`` labelled a seeded run "os-entropy": each is now refused."""
    trainer = digits_trainer(epochs=1)
    for name, value in [("delta", 0.5), ("noise_seed", None), ("target_epsilon", 100.0), ("sample_rate", 1e-9),
                        ("strategy", "per_layer")]:
        with pytest.raises(AttributeError, match=f"PrivateTrainer.{name} is a declared constant"):
            setattr(trainer, name, value)
    result = trainer.fit()
    assert result.delta == 1e-5 and result.randomness == "fixed-seed" and 2.9 < result.epsilon <= 3.0


@pytest.mark.parametrize("name, value", [("noise_seed", None), ("delta", 0.5)])
def test_the_trainers_label_settings_written_into_its_dict_are_refused(name, value, tmp_path):
    """``trainer.__dict__["noise_seed"] = None`` got past the read-only guard and the seeded run's result said
    "os-entropy"; ``delta`` likewise reported another run's epsilon. Reporting an epsilon and saving a checkpoint
    now compare them with the trainer's settings when built."""
    trainer = digits_trainer(epochs=1)
    trainer.__dict__[name] = value
    with pytest.raises(cl.BoundError, match=f"the trainer's {name} changed after it was built"):
        trainer.fit()
    with pytest.raises(cl.BoundError, match=f"the trainer's {name} changed"):
        trainer.save_checkpoint(tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt").exists()


@pytest.mark.parametrize("how", ["trainer", "engine"])
def test_a_privacy_engine_or_accountant_swapped_in_is_refused(how, tmp_path):
    """``trainer.privacy_engine = PrivacyEngine()`` (a plain attribute then) made ``epsilon()`` report 0.0 after a
    run that spent 2.0; an accountant written into the engine's ``__dict__`` did the same through
    ``PrivacyEngine.get_epsilon``. The engine is a declared constant of the trainer, and the engine checks its
    accountant before it reports or makes a model private."""
    trainer = digits_trainer(epochs=1)
    trainer.fit()
    if how == "trainer":
        with pytest.raises(AttributeError, match="declared constant"):
            trainer.privacy_engine = cl.PrivacyEngine()
        trainer.__dict__["privacy_engine"] = cl.PrivacyEngine()
        why = "the trainer's privacy_engine changed after it was built"
    else:
        trainer.privacy_engine.__dict__["accountant"] = cl.privacy.PrivacyAccountant("pld")
        why = "the privacy engine's accountant changed after it was built"
        with pytest.raises(cl.BoundError, match=why):
            trainer.privacy_engine.get_epsilon(1e-5)
    with pytest.raises(cl.BoundError, match=why):
        trainer.epsilon()
    with pytest.raises(cl.BoundError, match=why):
        trainer.save_checkpoint(tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_checkpoints_unlabelled_times_of_an_earlier_version_are_not_released_again(tmp_path):
    """Earlier versions recorded each epoch's time as ``epoch_time_s`` in the history a checkpoint keeps; the time
    grows with the secret Poisson batch sizes, so a resumed run drops it instead of releasing it in its result, and
    keeps the times of a run that asked for them (``nonprivate_epoch_time_s``)."""
    first = digits_trainer(epochs=2)
    first.max_steps = first.steps_per_epoch
    first.fit()
    first.save_checkpoint(tmp_path / "ckpt.pt")
    state = load_checkpoint(tmp_path / "ckpt.pt")
    state["history"] = [{**row, "epoch_time_s": 0.25, "nonprivate_epoch_time_s": 0.5} for row in state["history"]]
    save_checkpoint(state, tmp_path / "old.pt")
    shutil.copy(fingerprint_key_path(tmp_path / "ckpt.pt"), fingerprint_key_path(tmp_path / "old.pt"))
    resumed = digits_trainer(epochs=2)
    resumed.load_checkpoint(tmp_path / "old.pt")
    history = resumed.fit().history
    assert len(history) == 2 and all("epoch_time_s" not in row for row in history)
    assert history[0]["nonprivate_epoch_time_s"] == 0.5 and "nonprivate_epoch_time_s" not in history[1]


def test_a_learning_rate_schedule_steps_per_epoch_and_resumes_exactly(tmp_path):
    """``lr_scheduler`` (a torch scheduler of the private optimizer) steps after every epoch, is kept in the
    checkpoint, and a resumed run continues it: the same weights and learning rates as the uninterrupted run. A
    schedule on a metric (``ReduceLROnPlateau``) is refused, as is a resume with or without a schedule the checkpoint
    lacks or has."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, ReduceLROnPlateau

    cosine = lambda opt: CosineAnnealingLR(opt, T_max=4)  # noqa: E731
    straight = digits_trainer(epochs=4, lr_scheduler=cosine)
    rates = []
    straight.log = lambda line: rates.append(straight.optimizer.param_groups[0]["lr"])
    straight.fit()
    expected = [0.005 * (1 + math.cos(math.pi * t / 4)) for t in range(1, 5)]
    assert rates == pytest.approx(expected, abs=1e-12) and rates[-1] == pytest.approx(0.0, abs=1e-12)
    first = digits_trainer(epochs=4, lr_scheduler=cosine)
    first.max_steps = 2 * first.steps_per_epoch
    first.fit()
    first.save_checkpoint(tmp_path / "ckpt.pt")
    resumed = digits_trainer(epochs=4, lr_scheduler=cosine)
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected[1], abs=1e-12)
    resumed.fit()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="written by a run with a learning-rate schedule and this run has none"):
        digits_trainer(epochs=4).load_checkpoint(tmp_path / "ckpt.pt")
    plain = digits_trainer(epochs=4)
    plain.max_steps = plain.steps_per_epoch
    plain.fit()
    plain.save_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="written by a run without a learning-rate schedule and this run has one"):
        digits_trainer(epochs=4, lr_scheduler=cosine).load_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="ReduceLROnPlateau steps on a metric"):
        digits_trainer(epochs=1, lr_scheduler=ReduceLROnPlateau)
    with pytest.raises(ValueError, match="must return a torch learning-rate scheduler"):
        digits_trainer(epochs=1, lr_scheduler=lambda opt: 0.5)


def test_the_training_data_swapped_in_as_test_data_is_refused():
    """``trainer.test_data = train_data`` after construction (past ``check_held_out``) logged and saved a
    "test_accuracy" computed on the training records without noise. The data are declared constants now."""
    trainer = digits_trainer(epochs=1)
    with pytest.raises(AttributeError, match="declared constant"):
        trainer.test_data = trainer.train_data
    trainer.__dict__["test_data"] = trainer.train_data
    with pytest.raises(cl.BoundError, match="the trainer's test_data changed after it was built"):
        trainer.fit()
    assert trainer.steps == 0 and trainer.history == []


@pytest.mark.parametrize("size", [1, 50, 10_000])
def test_a_batch_in_physical_parts_releases_the_same_steps(size):
    """``max_physical_batch_size``: each Poisson batch goes forward and backward in parts (the step guard takes
    them as micro-batches of one batch) and is stepped once; with the same seeds the released weights, epsilon and
    steps are those of whole batches, and a tightness monitor still checks every due step."""
    whole = digits_trainer(epochs=2)
    whole.fit()
    monitor = cl.diagnostics.TightnessMonitor(every=3, sample=4)
    parts = digits_trainer(epochs=2, max_physical_batch_size=size, tightness_monitor=monitor)
    result = parts.fit()
    assert result.steps == whole.steps and result.epsilon == whole.epsilon()
    for a, b in zip(whole.model.parameters(), parts.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert monitor.worst and max(monitor.worst.values()) <= 1 + monitor.tol
    # K augmented copies of each example, made part by part: the step guard takes each part's rows as derived
    # from the drawn batch and each row's loss weight as 1/K
    augmented = digits_trainer(epochs=1, max_physical_batch_size=size, augmentation_multiplicity=2).fit()
    assert augmented.steps == parts.steps_per_epoch
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_physical_batch_size must be an integer >= 1"):
            digits_trainer(epochs=1, max_physical_batch_size=bad)


def test_an_adaptive_clip_counts_a_batch_in_parts_once():
    """The adaptive clip's noisy count of a step sums its parts' backward passes: with the same seeds a run in parts
    moves the clip norm and the weights as a run on whole batches does, at the same epsilon."""
    def run(size):
        torch.manual_seed(0)
        data = cl.load_digits()
        model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(32,), input_clip=None)
        model.append(cl.AdaptiveLossGradientClip(0.25, target_quantile=0.5, count_noise_multiplier=10.0))
        trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), cl.TauCrossEntropy(8.0),
                                    data.train, input_shape=data.input_shape, input_bound=8.0, batch_size=256,
                                    epochs=2, target_epsilon=3.0, delta=1e-5, noise_seed=3, progress=False, log=None,
                                    max_physical_batch_size=size)
        result = trainer.fit()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), result.epsilon, float(model[-1].clip_norm)

    whole, parts = run(None), run(40)
    torch.testing.assert_close(parts[0], whole[0], rtol=0, atol=1e-5)
    assert parts[1:] == whole[1:] and whole[2] != 0.25  # the clip moved, and by the same counts


def test_checkpoint_resume_continues_exactly(tmp_path):
    straight = digits_trainer(epochs=4)
    straight.fit()
    first = digits_trainer(epochs=4)
    first.max_steps = 2 * first.steps_per_epoch  # stop halfway, as an interrupted run would
    first.fit()
    first.save_checkpoint(tmp_path / "ckpt.pt")
    resumed = digits_trainer(epochs=4, seed=0)
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    assert resumed.accountant.steps == 2 * resumed.steps_per_epoch
    result = resumed.fit()
    assert result.steps == straight.steps
    assert result.epsilon == pytest.approx(straight.epsilon(), rel=1e-12)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    # a checkpoint whose accountant composed fewer steps than it released is refused before anything is loaded
    state = load_checkpoint(tmp_path / "ckpt.pt")
    state["steps"] += 3
    save_checkpoint(state, tmp_path / "short.pt")
    shutil.copy(fingerprint_key_path(tmp_path / "ckpt.pt"), fingerprint_key_path(tmp_path / "short.pt"))
    fresh = digits_trainer(epochs=4, seed=0)
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(ValueError, match="composed .* steps but the run records"):
        fresh.load_checkpoint(tmp_path / "short.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters())) and fresh.accountant.steps == 0
    # its steps composed at a larger noise multiplier or a smaller rate than the run's plan: a lower epsilon for the
    # same released steps (resumed, the run reported it)
    for edit in ((2.0, 1.0), (1.0, 0.5)):
        state = load_checkpoint(tmp_path / "ckpt.pt")
        for holder in (state["accountant"], state["optimizer"]["accountant"]):
            holder["history"] = [(s * edit[0], q * edit[1], k) for s, q, k in holder["history"]]
        save_checkpoint(state, tmp_path / "lower.pt")
        shutil.copy(fingerprint_key_path(tmp_path / "ckpt.pt"), fingerprint_key_path(tmp_path / "lower.pt"))
        with pytest.raises(ValueError, match="composed .* step.* at noise multiplier .* where every step of this run"):
            fresh.load_checkpoint(tmp_path / "lower.pt")
        assert fresh.accountant.steps == 0 and fresh.steps == 0
    # a checkpoint of another architecture is refused before any weight is copied (load_state_dict copies the
    # matching entries before it reports the others)
    state = load_checkpoint(tmp_path / "ckpt.pt")
    last = [k for k, v in state["model"].items() if isinstance(v, torch.Tensor)][-1]
    state["model"][last] = torch.zeros(state["model"][last].numel() + 1)
    save_checkpoint(state, tmp_path / "other.pt")
    shutil.copy(fingerprint_key_path(tmp_path / "ckpt.pt"), fingerprint_key_path(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="another model .*other shape"):
        fresh.load_checkpoint(tmp_path / "other.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))


def test_mnist_smoke(shared_data):
    data = cl.load_mnist(shared_data / "mnist")
    torch.manual_seed(0)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(128,), input_clip=8.0)
    trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-3), cl.TauCrossEntropy(8.0),
                                data.train, input_shape=data.input_shape, batch_size=2048, delta=1e-5, epochs=1,
                                target_epsilon=1.0, noise_seed=0, test_data=data.test, progress=False, log=None,
                                accountant="rdp")
    result = trainer.fit()
    assert result.epsilon <= 1.0
    assert result.test_accuracy > 0.7


def test_cli_with_flags_and_yaml(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"epochs": 2, "hidden": [32], "epsilon": 2.0, "accountant": "rdp"}))
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--output-dir", str(out), "--no-progress", "--batch-size", "128"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["epsilon"] <= 2.0 and result["config"]["epochs"] == 2 and result["config"]["batch_size"] == 128
    for key in ("test_accuracy", "epsilon", "delta", "noise_multiplier", "steps"):
        assert key in result
    # wall-clock times grow with the secret Poisson batch sizes: released only on request, labelled
    assert result["nonprivate_wall_time_s"] is None
    assert all("time" not in key for row in result["history"] for key in row)
    assert (out / "checkpoint.pt").exists()
    # resume from the finished run: no further steps, same epsilon
    assert main(["train", "--config", str(config), "--output-dir", str(out), "--no-progress", "--batch-size", "128",
                 "--resume"]) == 0
    again = json.loads((out / "result.json").read_text())
    assert again["steps"] == result["steps"] and again["epsilon"] == pytest.approx(result["epsilon"])


@pytest.mark.parametrize("seed", [None, 5])
def test_a_resume_draws_fresh_secret_randomness_and_continues_a_seeded_stream(tmp_path, seed):
    """Before, a secret run's OS-entropy generator states were restored from the checkpoint: the run continued
    after saving and a run resumed from that checkpoint were bit-identical, so two forks of one checkpoint (say
    with another --lr) shared their noise and batches, and the difference of their releases carried no noise.
    A secret run's resume now draws fresh noise and batches; a seeded run's resume continues the same draws."""
    run = digits_trainer(epochs=2, seed=seed)
    run.max_steps = run.steps_per_epoch
    run.fit()
    run.save_checkpoint(tmp_path / "ckpt.pt")
    run.max_steps = 2 * run.steps_per_epoch
    assert run.fit().private is (seed is None)
    resumed = digits_trainer(epochs=2, seed=seed)
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    result = resumed.fit()
    assert result.steps == run.steps and result.epsilon == pytest.approx(run.epsilon())
    same = all(torch.equal(a, b) for a, b in zip(run.model.parameters(), resumed.model.parameters()))
    assert same is (seed is not None)
    # A secret run's checkpoint holds no generator state: MT19937's state can be run backwards, so a saved one
    # would let whoever reads the checkpoint regenerate the noise and batches already drawn.
    assert (_generator_states(load_checkpoint(tmp_path / "ckpt.pt")) == 0) is (seed is None)


def test_a_checkpoint_alone_does_not_identify_its_training_records(tmp_path):
    """A checkpoint recorded a plain digest of the training records: anyone holding it could hash both
    neighbouring datasets and see which one was trained on.  The digest is now keyed by a secret kept in
    ``checkpoint.pt.key`` beside it; a resume needs both files, and a resume on other records is still refused."""
    import os

    run = digits_trainer(epochs=1)
    run.fit()
    run.save_checkpoint(tmp_path / "ckpt.pt")
    key_file = fingerprint_key_path(tmp_path / "ckpt.pt")
    assert len(key_file.read_bytes()) == 32 and os.stat(key_file).st_mode & 0o077 == 0  # owner-only
    saved = load_checkpoint(tmp_path / "ckpt.pt")["config"]
    plain = run.train_data.fingerprint()
    assert saved["train_data"] not in (plain, None) and plain not in repr(load_checkpoint(tmp_path / "ckpt.pt"))
    digits_trainer(epochs=1).load_checkpoint(tmp_path / "ckpt.pt")  # with its key: resumes
    key = key_file.read_bytes()
    run.save_checkpoint(tmp_path / "ckpt.pt")  # a key beside the path is kept: a failed write stays matched
    assert key_file.read_bytes() == key
    with pytest.raises(ValueError, match="train_data=.*resume with the same records"):  # another split
        digits_trainer(epochs=1, data_seed=1).load_checkpoint(tmp_path / "ckpt.pt")
    key_file.unlink()
    with pytest.raises(ValueError, match="its key file ckpt.pt.key is missing"):
        digits_trainer(epochs=1).load_checkpoint(tmp_path / "ckpt.pt")
    state = load_checkpoint(tmp_path / "ckpt.pt")  # an older version's checkpoint: plain digests, no key file
    state["config"].update(train_data=plain, test_data=run.test_data.fingerprint())
    save_checkpoint(state, tmp_path / "old.pt")
    digits_trainer(epochs=1).load_checkpoint(tmp_path / "old.pt")


def _generator_states(obj) -> int:
    """How many torch CPU generator states (uint8 tensors of that size) ``obj`` holds, at any depth."""
    if isinstance(obj, torch.Tensor):
        return int(obj.dtype == torch.uint8 and obj.numel() == torch.Generator().get_state().numel())
    if isinstance(obj, dict):
        return sum(_generator_states(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_generator_states(v) for v in obj)
    return 0


def _cli_run(out, *extra):
    return main(["train", "--epochs", "2", "--batch-size", "256", "--hidden", "16", "--epsilon", "2", "--no-progress",
                 "--accountant", "rdp", "--output-dir", str(out), *extra])


def test_readme_resume_command_restores_the_run_configuration(tmp_path, capsys):
    """`clipless train --output-dir DIR --resume` (the README's command) resumes the run as it was made, data
    directory included (a small MNIST-format directory: the real one took 4 minutes of scattering features)."""
    out = tmp_path / "run"
    data = write_fake_mnist(tmp_path / "mnist", train=600, test=100)
    assert _cli_run(out, "--dataset", "mnist", "--data-dir", str(data), "--batch-size", "128", "--epochs", "1") == 0
    first = json.loads((out / "result.json").read_text())
    assert main(["train", "--output-dir", str(out), "--resume", "--no-progress"]) == 0
    again = json.loads((out / "result.json").read_text())
    assert again["steps"] == first["steps"] and again["epsilon"] == pytest.approx(first["epsilon"])
    for key in ("batch_size", "hidden", "epsilon", "accountant", "epochs", "dataset", "data_dir"):
        assert again["config"][key] == first["config"][key]
    assert "resume: settings of" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, key", [("--epsilon", "1", "epsilon"), ("--seed", "3", "seed"),
                                              ("--accountant", "pld", "accountant"), ("--batch-size", "128",
                                                                                      "batch_size")])
def test_resume_refuses_a_privacy_or_data_split_change(tmp_path, flag, value, key):
    out = tmp_path / "run"
    assert _cli_run(out) == 0
    before = (out / "result.json").read_bytes(), (out / "checkpoint.pt").read_bytes()
    with pytest.raises(SystemExit, match=rf"other settings \({key}=.* -> .*\).*start a new run"):
        _cli_run(out, flag, value, "--resume")
    assert ((out / "result.json").read_bytes(), (out / "checkpoint.pt").read_bytes()) == before  # nothing lost


def test_resume_applies_a_harmless_setting_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli_run(out, "--epochs", "1") == 0
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--resume", "--lr", "0.005", "--no-progress"]) == 0
    assert "applied lr=0.005 (was 0.01)" in capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["config"]["lr"] == 0.005


def test_api_resume_on_another_split_refused(tmp_path):
    trainer = digits_trainer(epochs=1, seed=0)
    trainer.fit()
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="train_data=.*same records and train/test split"):
        digits_trainer(epochs=1, seed=0, data_seed=1).load_checkpoint(tmp_path / "ckpt.pt")


def test_data_loaders_are_taken_as_their_datasets_by_the_trainer_and_the_dpsgd_baseline():
    """``PrivateTrainer(test_data=DataLoader(...))`` and ``train_dpsgd(DataLoader(...))`` failed with ``'DataLoader'
    object is not subscriptable``. A loader now stands for its dataset (Poisson batches over the training one, its
    worker settings kept; the held-out one scored in batches of its own), and one of the training data as held-out
    data is still refused."""
    from torch.utils.data import DataLoader

    from clipless.train.baselines import standard_mlp, train_dpsgd

    shape = (1, 4, 4)
    train = cl.ArrayDataset(torch.rand(64, *shape) / 4, torch.randint(0, 3, (64,)))
    test = cl.ArrayDataset(torch.rand(32, *shape) / 4, torch.randint(0, 3, (32,)))
    model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(),
                                DataLoader(train, batch_size=8), input_shape=shape, batch_size=8, delta=1e-3,
                                epochs=1, noise_multiplier=1.0, progress=False, log=None,
                                test_data=DataLoader(test, batch_size=5))
    assert trainer.test_data is test and "test_accuracy" in trainer.fit().history[-1]
    # a training loader counts its records, not its batches: the trainer's rate is the accounted one (it was
    # 8 / len(loader) = 1, and one epoch of 8 steps was reported as 8 epochs)
    assert trainer.train_data is train and trainer.sample_rate == trainer.optimizer.sample_rate == 8 / 64
    assert trainer.accountant.steps == 8 and trainer.history[-1]["epoch"] == 1
    # ... and its records are held out from the test data: the training data as test data is refused (the shared
    # check reads a loader's dataset too, for any caller)
    from clipless.data.datasets import check_held_out

    for pair in ((DataLoader(train, batch_size=8), train), (train, DataLoader(train, batch_size=3))):
        with pytest.raises(ValueError, match="test_data is the training data"):
            check_held_out(*pair)
    model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
    with pytest.raises(ValueError, match="test_data"):
        cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(),
                          DataLoader(train, batch_size=8), input_shape=shape, batch_size=8, delta=1e-3, epochs=1,
                          noise_multiplier=1.0, progress=False, log=None, test_data=train)
    result = train_dpsgd(standard_mlp(shape, 3, hidden=[8]), DataLoader(train, batch_size=8, num_workers=2),
                         batch_size=8, epochs=1, delta=1e-3, max_grad_norm=1.0, noise_multiplier=1.0,
                         test_data=DataLoader(test, batch_size=5), progress=False)
    assert result.steps == 8 and 0 <= result.test_accuracy <= 1
    with pytest.raises(ValueError, match="held-out|training data"):
        train_dpsgd(standard_mlp(shape, 3, hidden=[8]), train, batch_size=8, epochs=1, delta=1e-3, max_grad_norm=1.0,
                    noise_multiplier=1.0, test_data=DataLoader(train, batch_size=5), progress=False)


def test_a_held_out_loaders_own_collate_is_not_refused():
    """Held-out data is scored in batches of its own: a test ``DataLoader``'s collate (refused for training data, which
    it could mix) is not used, so it is not refused either."""
    from torch.utils.data import DataLoader

    shape = (1, 4, 4)
    train = cl.ArrayDataset(torch.rand(64, *shape) / 4, torch.randint(0, 3, (64,)))
    test = cl.ArrayDataset(torch.rand(32, *shape) / 4, torch.randint(0, 3, (32,)))
    model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(), train,
                                input_shape=shape, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0,
                                progress=False, log=None, test_data=DataLoader(test, batch_size=5, collate_fn=list))
    assert trainer.test_data is test
    # a held-out loader whose sampler picks part of its dataset would have all of it scored: refused
    from torch.utils.data import SubsetRandomSampler

    with pytest.raises(ValueError, match="SubsetRandomSampler chooses the records its batches hold; held-out data is "
                                         "scored on every record"):
        cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(), train,
                          input_shape=shape, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0, progress=False,
                          log=None, test_data=DataLoader(test, batch_size=5, sampler=SubsetRandomSampler(range(8))))
    # evaluate reads a loader's own batches, so its sampler's part is what it scores
    part = DataLoader(test, batch_size=5, sampler=SubsetRandomSampler(range(8)))
    assert cl.evaluate(model, part) == cl.evaluate(model, torch.utils.data.Subset(test, range(8)))


def test_evaluate_reads_a_data_loader_as_it_batches():
    """``clipless.evaluate(model, DataLoader(...))`` failed with ``'DataLoader' object is not subscriptable``; it
    now scores the loader's batches as it yields them (its own collate included), as the dataset would score."""
    from torch.utils.data import DataLoader

    shape = (1, 4, 4)
    test = cl.ArrayDataset(torch.rand(33, *shape) / 4, torch.randint(0, 3, (33,)))
    model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
    loss = cl.TauCrossEntropy()
    expected = cl.evaluate(model, test, loss)
    for loader in (DataLoader(test, batch_size=5), DataLoader(test, batch_size=4, collate_fn=lambda b: (
            torch.stack([r[0] for r in b]), torch.tensor([int(r[1]) for r in b])))):
        got = cl.evaluate(model, loader, loss)
        assert got["accuracy"] == expected["accuracy"] and got["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_held_out_records_read_from_files_are_checked_before_any_step():
    """A test set that is not in memory was not checked: a NaN or a record of another shape stopped the run at the
    first evaluation, after an epoch of private steps, and a label out of range gave a silently wrong accuracy. It
    is read once when the run is built, as the training data is (``check_records=False`` skips both reads)."""
    from torch.utils.data import Dataset

    shape = (1, 4, 4)
    train = cl.ArrayDataset(torch.rand(64, *shape) / 4, torch.randint(0, 3, (64,)))

    class Files(Dataset):
        def __init__(self, inputs, labels):
            self.inputs, self.labels = inputs, labels

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return self.inputs[i].clone(), int(self.labels[i])

    def trainer(test_data, **kwargs):
        model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
        return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(), train,
                                 input_shape=shape, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0,
                                 progress=False, log=None, test_data=test_data, **kwargs)

    x, y = torch.rand(32, *shape) / 4, torch.randint(0, 3, (32,))
    nan, label = x.clone(), y.clone()
    nan[20, 0, 1, 2], label[30] = float("nan"), 3
    with pytest.raises(ValueError, match="test_data contains NaN or infinite values"):
        trainer(Files(nan, y))
    with pytest.raises(ValueError, match=r"test_data: labels must be class indices in \[0, 3\)"):
        trainer(Files(x, label))
    with pytest.raises(ValueError, match=r"test_data: records of per-example shape \(1, 5, 4\)"):
        trainer(Files(torch.rand(32, 1, 5, 4) / 4, y))
    assert trainer(Files(x, y)).fit().steps > 0
    trainer(Files(x, label), check_records=False)  # not read: the evaluation meets it


def test_held_out_records_the_model_cannot_take_are_refused_before_any_step(tmp_path):
    """Float64 test records with a float32 model passed the trainer's checks and failed with torch's "expected m1
    and m2 to have the same dtype" at the first epoch's evaluation, after that epoch's private steps (and its
    checkpoint); they are refused by name when the run is built, and the probe leaves the model's modes as they were."""
    shape = (1, 4, 4)
    train = cl.ArrayDataset(torch.rand(64, *shape) / 4, torch.randint(0, 3, (64,)))
    x, y = torch.rand(32, *shape) / 4, torch.randint(0, 3, (32,))
    model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
    checkpoint = tmp_path / "run.pt"

    def trainer(test_data):
        return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(), train,
                                 input_shape=shape, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0,
                                 progress=False, log=None, test_data=test_data, checkpoint_path=checkpoint)

    with pytest.raises(ValueError, match=r"test_data: records of dtype torch.float64, the model's weights "
                                         r"torch.float32, and the model's forward refuses them"):
        trainer(cl.ArrayDataset(x.double(), y))
    assert not checkpoint.exists() and model.training
    model[-1].eval()  # modes of its own are kept by the probe
    run = trainer(cl.ArrayDataset(x, y))
    assert not model[-1].training and model[0].training
    assert run.fit().steps > 0


def test_held_out_data_given_as_bare_tensors_is_refused_before_any_step():
    """``test_data=(x, y)`` (or a tensor) was accepted and failed at the first epoch's evaluation, after its private
    steps, with torch's "stack expects each tensor to be equal size"; it is refused by name when the run is built,
    by the trainer and the DP-SGD baseline alike."""
    from clipless.train.baselines import standard_mlp, train_dpsgd

    shape = (1, 4, 4)
    train = cl.ArrayDataset(torch.rand(64, *shape) / 4, torch.randint(0, 3, (64,)))
    x, y = torch.rand(32, *shape) / 4, torch.randint(0, 3, (32,))
    for bare, kind in (((x, y), "a tuple of tensors"), (x, "a tensor")):
        model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
        with pytest.raises(TypeError, match=f"map-style Dataset of \\(input, label\\) records, got {kind}: wrap"):
            cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(), train,
                              input_shape=shape, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0,
                              progress=False, log=None, test_data=bare)
        with pytest.raises(TypeError, match=f"got {kind}: wrap"):
            train_dpsgd(standard_mlp(shape, 3, hidden=[8]), train, batch_size=8, epochs=1, delta=1e-3,
                        max_grad_norm=1.0, noise_multiplier=1.0, test_data=bare, progress=False)
