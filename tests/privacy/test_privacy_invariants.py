"""The guarantee holds by default, at every public entry point (the privacy-by-default findings).

For each entry point: epsilon after the run <= target; the noise drawn per parameter is the plan's;
two default runs on the same data release different weights (secret randomness); and nothing released
is computed from training data without noise (checked by training with learning rate 0 on neighbouring
datasets: then only an unnoised statistic of the data could tell them apart).
"""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction

import pytest
import torch
from torch import nn

import clipless as cl
from clipless.privacy.certified import BoundError
from clipless.privacy.modules import LayerBound
from clipless.privacy.calibration import BudgetExhaustedError, plan_noise
from clipless.train.checkpoint import load_checkpoint
from clipless.cli import main as cli_main
from clipless.privacy.randomness import secret_generator
from clipless.privacy.sampling import SAMPLING_BITS, poisson_threshold, realised_sample_rate
from helpers import capture_released, empty_batch_backward

SHAPE = (1, 4, 4)
TIMES = ("nonprivate_wall_time_s", "nonprivate_epoch_time_s")  # opt-in, labelled


def _data(n=64, classes=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return cl.ArrayDataset(torch.rand(n, *SHAPE, generator=gen), torch.randint(0, classes, (n,), generator=gen))


def _model(seed=0, clip=None):
    torch.manual_seed(seed)  # initialization: public
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=2.0)
    if clip is not None:
        model.append(clip)
    return model


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _strip_times(value):
    if isinstance(value, dict):
        return {k: _strip_times(v) for k, v in value.items() if k not in TIMES}
    if isinstance(value, list):
        return [_strip_times(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# Finding 1: the default randomness is secret
# --------------------------------------------------------------------------------------------------


def _mt_init_recurrence_holds(words):
    """A Mersenne Twister state made by manual_seed(s) follows w[i] = 1812433253 (w[i-1] ^ w[i-1] >> 30) + i."""
    return all(words[i] == (1812433253 * (words[i - 1] ^ (words[i - 1] >> 30)) + i) & 0xFFFFFFFF for i in range(1, 624))


def _mt_words(generator):
    state = bytes(generator.get_state()[24 : 24 + 8 * 624].tolist())
    return [w & 0xFFFFFFFF for w in struct.unpack("<624Q", state)]


def test_secret_generator_state_is_not_a_32_bit_seed():
    seeded = torch.Generator().manual_seed(2**40 + 7)
    assert _mt_init_recurrence_holds(_mt_words(seeded))  # torch keeps 32 bits of a seed: searchable
    assert torch.equal(torch.rand(4, generator=seeded), torch.rand(4, generator=torch.Generator().manual_seed(7)))
    a, b = secret_generator(), secret_generator()
    assert not _mt_init_recurrence_holds(_mt_words(a))  # 19,968 bits from os.urandom
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_a_secret_generator_is_never_duplicated():
    """Deep copies and pickled copies of a secret generator are fresh secret generators (a copied run must not
    replay the original's noise or batches); a seeded generator copies exactly (reproducible experiments)."""
    import copy
    import pickle

    gen = secret_generator()
    for duplicate in (copy.deepcopy(gen), pickle.loads(pickle.dumps(gen)), copy.deepcopy({"a": gen, "b": gen})["a"]):
        assert isinstance(duplicate, torch.Generator)
        assert not torch.equal(duplicate.get_state(), gen.get_state())
        assert not torch.equal(torch.rand(8, generator=duplicate), torch.rand(8, generator=gen))
    both = copy.deepcopy({"a": gen, "b": gen})
    assert both["a"] is both["b"]  # one copy per generator, shared where it was shared
    seeded = torch.Generator().manual_seed(3)
    assert torch.equal(copy.deepcopy(seeded).get_state(), seeded.get_state())


def test_noise_without_a_generator_is_not_the_global_stream():
    """The noise primitives given no generator draw from OS entropy: with torch's global seed fixed (public), two
    calls still differ (a gradient or count noised from the global stream could be denoised by replaying it)."""
    from clipless.privacy.noise import add_gaussian_noise_, noisy_count

    def noised():
        torch.manual_seed(0)
        p = nn.Parameter(torch.zeros(16))
        p.grad = torch.ones(16)
        add_gaussian_noise_([p], 1.0, 1.0, None)
        torch.manual_seed(0)
        return p.grad.clone(), noisy_count(3.0, 1.0, None)

    (g1, c1), (g2, c2) = noised(), noised()
    assert not torch.equal(g1, g2) and c1 != c2
    clip = cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=1.0)
    torch.manual_seed(0)
    first = clip.update_(10.0)
    torch.manual_seed(0)
    assert clip.update_(10.0) != first


def test_poisson_sampler_default_batches_differ_between_instances():
    first = [list(b) for b in cl.PoissonBatchSampler(1000, 0.1, steps_per_epoch=3)]
    second = [list(b) for b in cl.PoissonBatchSampler(1000, 0.1, steps_per_epoch=3)]
    assert first != second


def _engine_setup(**kw):
    model = kw.pop("module", None) or _model()
    engine = cl.PrivacyEngine("rdp")
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=_data(),
                loss=cl.TauCrossEntropy(4.0), noise_multiplier=1.0, input_shape=SHAPE, batch_size=8.0,
                external_batches=True)  # some tests step on batches built by hand
    args.update(kw)
    return (engine, *engine.make_private(**args))


def _one_epoch(model, opt, loader, loss):
    for x, y in loader:
        opt.zero_grad()
        loss.per_example(model(x), y).sum().backward()
        opt.step()
    return _weights(model)


def test_make_private_defaults_draw_different_batches_and_noise():
    _, m1, o1, l1 = _engine_setup()
    _, m2, o2, l2 = _engine_setup()
    assert [b[1].tolist() for b in l1] != [b[1].tolist() for b in l2]
    _, m1, o1, l1 = _engine_setup()  # fresh loaders: each step must release one new batch of its loader
    _, m2, o2, l2 = _engine_setup()
    loss = cl.TauCrossEntropy(4.0)
    assert not torch.equal(_one_epoch(m1, o1, l1, loss), _one_epoch(m2, o2, l2, loss))


def test_replay_attack_fails_on_default_runs():
    """The audit's attack: retrain with the public init seed on the same data and match the weights."""
    def run(**kw):
        model = _model()
        trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cl.TauCrossEntropy(4.0),
                                    _data(), input_shape=SHAPE, batch_size=8, delta=1e-3, epochs=1,
                                    target_epsilon=1.0, accountant="rdp", progress=False, log=None, **kw)
        return trainer.fit(), _weights(model)

    (released, w_released), (_, w_replayed) = run(), run()
    assert released.private and not torch.equal(w_released, w_replayed)
    (fixed, w_a), (_, w_b) = run(noise_seed=3), run(noise_seed=3)
    assert torch.equal(w_a, w_b)  # reproducible on request ...
    assert not fixed.private and "NOT private" in fixed.privacy_note  # ... and labelled


def _cli_train(tmp_path, name, *extra):
    out = tmp_path / name
    cli_main(["train", "--epochs", "1", "--batch-size", "256", "--hidden", "16", "--no-progress", "--accountant", "rdp",
              "--output-dir", str(out), *extra])
    return json.loads((out / "result.json").read_text()), load_checkpoint(out / "checkpoint.pt")


def test_cli_default_runs_are_private_and_differ(tmp_path, capsys):
    first, ckpt1 = _cli_train(tmp_path, "a")
    second, ckpt2 = _cli_train(tmp_path, "b")
    printed = capsys.readouterr().out
    assert first["private"] is True and first["randomness"] == "os-entropy"
    assert "private (noise and batches from OS entropy)" in printed
    assert not all(torch.equal(a, b) for a, b in zip(ckpt1["model"].values(), ckpt2["model"].values()))
    fixed, _ = _cli_train(tmp_path, "c", "--noise-seed", "5")
    assert fixed["private"] is False and "NOT PRIVATE" in capsys.readouterr().out


def test_pretrainer_and_pairs_default_randomness_differs():
    data = cl.load_digits()
    images = data.train.features[:64]

    def run():
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 8))
        trainer = cl.contrastive.ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1),
                                           cl.contrastive.AugmentedPairs(images, padding=1), batch_size=16, epochs=1, delta=1e-3,
                                           noise_multiplier=1.0, progress=False, log=None)
        result = trainer.fit()
        return result, _weights(encoder)

    (r1, w1), (_r2, w2) = run(), run()
    assert r1.private and not torch.equal(w1, w2)
    a, b = cl.contrastive.AugmentedPairs(images, padding=2), cl.contrastive.AugmentedPairs(images, padding=2)
    assert not torch.equal(a.gather(list(range(32)))[0], b.gather(list(range(32)))[0])


@pytest.mark.parametrize("extra", [{}, {"blur": 1.5, "pixel_noise": 0.2}])
def test_augmentations_of_a_record_do_not_depend_on_other_records(extra):
    images = torch.rand(6, 1, 8, 8)
    full = cl.contrastive.AugmentedPairs(images, padding=2, seed=1, **extra)
    without = cl.contrastive.AugmentedPairs(images[[0, 2, 3, 4, 5]], padding=2, seed=1, **extra)  # record 1 removed
    for _ in range(3):  # several draws, in different batch orders
        a = full.gather([5, 0, 1, 3])
        b = without.gather([4, 0, 2])
        assert torch.equal(a[0][[0, 1, 3]], b[0]) and torch.equal(a[1][[0, 1, 3]], b[1])


def test_dpsgd_baseline_noise_is_secret_by_default():
    pytest.importorskip("opacus")
    from clipless.train.baselines import standard_mlp, train_dpsgd

    def run(**kw):
        torch.manual_seed(0)
        model = standard_mlp(SHAPE, 3, hidden=[8])
        result = train_dpsgd(model, _data(), batch_size=16, epochs=1, delta=1e-3, max_grad_norm=1.0,
                             noise_multiplier=1.0, seed=0, progress=False, **kw)
        return result, _weights(model)

    (r1, w1), (_, w2) = run(), run()
    assert r1.private and not torch.equal(w1, w2)
    (r3, w3), (_, w4) = run(noise_seed=2), run(noise_seed=2)
    assert not r3.private and torch.equal(w3, w4)


# --------------------------------------------------------------------------------------------------
# Finding 2 and 11: nothing released is computed from training data without noise
# --------------------------------------------------------------------------------------------------


def _other_dataset(data):
    """Same size (so the same Poisson batches under one seed), every record changed: with lr = 0 the release
    must not move at all, and an unnoised statistic (a batch loss) moves for sure, not only when the one
    changed record of a neighbour happens to be sampled."""
    return cl.ArrayDataset(1.0 - data.features, (data.labels + 1) % 3)


def _bar_timing(text):
    """Whether a tqdm bar's output shows a rate or a time (``12.3it/s``, ``[00:01<00:00``)."""
    return any(mark in text for mark in ("it/s", "s/it", "[00:"))


def test_trainer_releases_nothing_unnoised(capsys):
    """lr = 0: the weights never move, so every released field must be the same on neighbouring data: the log lines,
    the progress bar and the result, wall-clock times included (they grow with the secret batch sizes: opt-in,
    labelled; the bar showed its rate and elapsed time by default)."""
    def release(data, **kw):
        model = _model()
        lines = []
        trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cl.TauCrossEntropy(4.0), data,
                                    input_shape=SHAPE, batch_size=16, delta=1e-3, epochs=2, target_epsilon=2.0,
                                    accountant="rdp", noise_seed=0, test_data=_data(32, seed=9), progress=True,
                                    log=lines.append, **kw)
        capsys.readouterr()
        result = trainer.fit().to_dict()
        return result, lines, capsys.readouterr().err

    data = _data()
    first = release(data)
    assert "epoch 1" in first[2] and not _bar_timing(first[2])
    assert first == release(_other_dataset(data))
    opted, lines, bar = release(data, log_train_stats=True)
    assert _bar_timing(bar)  # with the other timings, on request
    assert opted["nonprivate_wall_time_s"] > 0 and " nonprivate_epoch_time_s=" in lines[0]
    opted = _strip_times(opted)
    assert "nonprivate_train_loss" in opted["history"][0]  # only on request, and labelled
    assert opted != _strip_times(release(_other_dataset(data), log_train_stats=True)[0])  # (why it is opt-in)


def test_the_step_bar_prints_the_same_whatever_the_steps_take(monkeypatch, capsys):
    """The bar without timings still redrew only when 0.1 s had passed since its last print, so the states a job
    log kept told how long the steps took, which grows with the secret Poisson batch sizes: two neighbouring runs
    printed different bars (``test_trainer_releases_nothing_unnoised`` failed now and then). It now redraws at
    every step; the same steps at no time and at a second each print the same bar."""
    import tqdm.std

    from clipless.privacy.sampling import step_progress

    printed = []
    for seconds in (0.0, 1.0):
        clock = [0.0]

        def tick(clock=clock, seconds=seconds):
            clock[0] += seconds
            return clock[0]

        monkeypatch.setattr(tqdm.std, "time", tick)
        capsys.readouterr()
        for _ in step_progress(range(5), total=5, desc="epoch 1"):
            pass
        printed.append(capsys.readouterr().err)
    assert printed[0] == printed[1] and "3/5" in printed[0]


def test_pretrainer_releases_nothing_unnoised(capsys):
    images = torch.rand(64, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    other = torch.rand(64, 1, 6, 6, generator=torch.Generator().manual_seed(5))  # every pair changed

    def release(imgs, **kw):
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Flatten(), nn.Linear(36, 8))
        trainer = cl.contrastive.ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.0),
                                           cl.contrastive.AugmentedPairs(imgs, padding=1, seed=3), batch_size=16, epochs=2,
                                           delta=1e-3, target_epsilon=3.0, accountant="rdp", noise_seed=1,
                                           progress=True, log=None, **kw)
        capsys.readouterr()
        result = trainer.fit().to_dict()
        return result, capsys.readouterr().err

    first = release(images)
    assert "epoch 1" in first[1] and not _bar_timing(first[1])
    assert first == release(other)  # wall-clock time and progress bar included: opt-in, labelled
    opted, bar = release(images, log_train_stats=True)
    assert _bar_timing(bar)
    assert opted["nonprivate_wall_time_s"] > 0
    opted = _strip_times(opted)
    assert "nonprivate_clipped_fraction" in opted["history"][1]
    assert opted != _strip_times(release(other, log_train_stats=True)[0])


def test_cli_pretrain_evaluates_on_the_test_split_only(tmp_path):
    out = tmp_path / "pre"
    cli_main(["pretrain", "--epochs", "1", "--batch-size", "128", "--hidden", "32", "--embedding-dim", "8",
              "--accountant", "rdp", "--no-progress", "--output-dir", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert result["private"] is True and "test split" in result["evaluation"]
    assert all("clipped" not in key for row in result["history"] for key in row)


# --------------------------------------------------------------------------------------------------
# Finding 3: one noise plan; every entry point within its target
# --------------------------------------------------------------------------------------------------

COMBOS = [
    dict(strategy="global"),
    dict(strategy="per_layer"),
    dict(strategy="per_layer", layer_noise_multipliers="energy"),
    dict(strategy="per_layer", layer_noise_multipliers={"2": 1.0, "4": 8.0}),
    dict(strategy="global", adaptive=True),
    dict(strategy="per_layer", layer_noise_multipliers={"2": 1.0, "4": 0.2}, adaptive=True),
]


def _clip(combo):
    return cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=3.0) if combo.get("adaptive") else None


# Every combination with RDP; PLD (slower to calibrate, same plan code) on the simplest and the richest one.
ENTRY_CASES = [(c, "rdp") for c in COMBOS] + [(COMBOS[0], "pld"), (COMBOS[-1], "pld")]


@pytest.mark.parametrize("combo, accountant", ENTRY_CASES,
                         ids=lambda c: c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()))
def test_make_private_with_epsilon_stays_within_target(combo, accountant):
    kw = {k: v for k, v in combo.items() if k != "adaptive"}
    model = _model(clip=_clip(combo))
    engine = cl.PrivacyEngine(accountant)
    model, opt, loader = engine.make_private_with_epsilon(
        target_epsilon=2.0, target_delta=1e-3, epochs=2, module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=_data(), loss=cl.TauCrossEntropy(4.0),
        input_shape=SHAPE, batch_size=8, **kw)
    loss = cl.TauCrossEntropy(4.0)
    for _ in range(2):
        _one_epoch(model, opt, loader, loss)
    eps = engine.get_epsilon(1e-3)
    assert 1.9 <= eps <= 2.0
    with pytest.raises(BudgetExhaustedError, match="budget"):  # a third epoch is refused, not released
        _one_epoch(model, opt, loader, loss)
    assert engine.get_epsilon(1e-3) == eps


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_trainer_stays_within_target(combo):
    kw = {k: v for k, v in combo.items() if k != "adaptive"}
    model = _model(clip=_clip(combo))
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cl.TauCrossEntropy(4.0), _data(),
                                input_shape=SHAPE, batch_size=8, delta=1e-3, epochs=2, target_epsilon=2.0,
                                accountant="rdp", progress=False, log=None, **kw)
    assert 1.9 <= trainer.fit().epsilon <= 2.0


def test_fixed_sigma_with_target_stops_at_the_budget_everywhere():
    model = _model()
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cl.TauCrossEntropy(4.0), _data(),
                                input_shape=SHAPE, batch_size=8, delta=1e-3, epochs=50, noise_multiplier=1.0,
                                target_epsilon=1.5, accountant="rdp", progress=False, log=None)
    result = trainer.fit()
    assert result.stopped_by_budget and result.epsilon <= 1.5
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))  # its own optimizer: one of other parameters is refused
    pre = cl.contrastive.ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1),
                                   cl.contrastive.GivenPairs(torch.rand(64, 1, 4, 4), torch.rand(64, 1, 4, 4)), batch_size=8,
                                   epochs=50, delta=1e-3, noise_multiplier=1.0, target_epsilon=1.5, accountant="rdp",
                                   progress=False, log=None)
    result = pre.fit()
    assert result.stopped_by_budget and result.epsilon <= 1.5 and result.steps < 50 * 8
    pytest.importorskip("opacus")
    from clipless.train.baselines import standard_mlp, train_dpsgd

    base = train_dpsgd(standard_mlp(SHAPE, 3, hidden=[8]), _data(), batch_size=8, epochs=50, delta=1e-3,
                       max_grad_norm=1.0, noise_multiplier=1.0, target_epsilon=1.5, accountant="rdp", progress=False)
    assert base.extra["stopped_by_budget"] and base.epsilon <= 1.5 and base.steps < 50 * len(_data()) // 8


@pytest.mark.parametrize("command", [["train", "--method", "dpsgd"], ["pretrain", "--method", "naive_dp"],
                                     ["pretrain", "--method", "logit_dp"], ["train"]])
def test_every_command_keeps_an_explicit_target_with_a_fixed_sigma(command, tmp_path):
    """``--epsilon 1 --noise-multiplier 0.5`` once ran ``train --method dpsgd`` and ``pretrain`` to epsilon 14: the two
    commands dropped the target whenever sigma was fixed.  Now every command stops at the target (here: refuses, as
    one step already passes it) and with a larger sigma stops early within it."""
    if "dpsgd" in command:
        pytest.importorskip("opacus")
    args = command + ["--epochs", "3", "--batch-size", "256", "--no-progress"]
    with pytest.raises(SystemExit, match="single step"):
        cli_main(args + ["--epsilon", "1", "--noise-multiplier", "0.5", "--output-dir", str(tmp_path / "a")])
    assert not (tmp_path / "a" / "result.json").exists()
    cli_main(args + ["--epsilon", "1", "--noise-multiplier", "3", "--epochs", "200",
                     "--output-dir", str(tmp_path / "b")])
    result = json.loads((tmp_path / "b" / "result.json").read_text())
    assert result["epsilon"] <= 1.0 and result["steps"] < 200 * 1437 // 256


def test_pretrainer_and_dpsgd_calibrate_within_target():
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    pre = cl.contrastive.ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1),
                                   cl.contrastive.GivenPairs(torch.rand(64, 1, 4, 4), torch.rand(64, 1, 4, 4)), batch_size=8,
                                   epochs=2, delta=1e-3, target_epsilon=2.0, accountant="rdp", progress=False, log=None)
    assert 1.9 <= pre.fit().epsilon <= 2.0
    pytest.importorskip("opacus")
    from clipless.train.baselines import standard_mlp, train_dpsgd

    result = train_dpsgd(standard_mlp(SHAPE, 3, hidden=[8]), _data(), batch_size=8, epochs=2, delta=1e-3,
                         max_grad_norm=1.0, target_epsilon=2.0, accountant="rdp", progress=False)
    assert 1.9 <= result.epsilon <= 2.0


def test_noise_drawn_per_parameter_is_the_plan():
    """Zero gradients: what is released is the noise alone; its std per layer is sigma_d * g_d / b."""
    model = _model(clip=cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=3.0))
    engine = cl.PrivacyEngine("rdp")
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data=_data(), loss=cl.TauCrossEntropy(),
        noise_multiplier=2.0, input_shape=SHAPE, batch_size=8.0, strategy="per_layer",
        layer_noise_multipliers={"2": 1.0, "4": 3.0}, external_batches=True)
    plan = opt.plan
    draws = {name: [] for name in plan.layer_sigmas}
    released = capture_released(opt)
    for _ in range(300):
        empty_batch_backward(model, cl.TauCrossEntropy(), SHAPE)
        opt.step()
        for layer in opt.last_report.layers:
            draws[layer.name].append(torch.cat([released[-1][id(p)].flatten() for p in layer.params]))
    for layer in opt.last_report.layers:
        expected = plan.layer_sigmas[layer.name] * layer.bound / 8.0
        assert torch.stack(draws[layer.name]).std().item() == pytest.approx(expected, rel=0.03)
    assert plan.layer_sigmas["4"] == pytest.approx(3 * plan.layer_sigmas["2"])  # relative weights
    assert cl.effective_noise_multiplier(list(plan.layer_sigmas.values())) == pytest.approx(2.0)
    assert plan.step_sigma == pytest.approx((2.0**-2 + 3.0**-2) ** -0.5)  # the count is composed in
    assert engine.accountant.history == [(plan.step_sigma, 8.0 / 64, 300)]


def test_plan_multipliers_cannot_be_edited_in_place():
    """An edited per-layer multiplier would change the noise drawn but not the accounted sigma_step."""
    import copy
    import pickle

    _, _, opt, _ = _engine_setup()
    plan = opt.plan
    name = next(iter(plan.layer_sigmas))
    with pytest.raises(TypeError):
        plan.layer_sigmas[name] = 0.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.gradient_sigma = 0.0  # type: ignore[misc]
    assert copy.deepcopy(plan) == plan and pickle.loads(pickle.dumps(plan)) == plan


def test_plan_refuses_fractional_epochs_and_bad_numbers():
    with pytest.raises(ValueError, match="whole number"):
        _engine_setup(noise_multiplier=None, target_epsilon=2.0, target_delta=1e-3, epochs=1.5)
    report = _engine_setup()[2].last_report
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="noise_multiplier"):
            plan_noise(report, sample_rate=0.1, accountant="rdp", noise_multiplier=bad)


def test_optimizer_refuses_parameters_added_after_make_private():
    _, model, opt, loader = _engine_setup()
    extra = nn.Parameter(torch.zeros(3))
    opt.original_optimizer.add_param_group({"params": [extra]})
    extra.grad = torch.ones(3)
    with pytest.raises(BoundError, match="does not cover"):
        opt.step()


# --------------------------------------------------------------------------------------------------
# Finding 4: resuming with another accountant
# --------------------------------------------------------------------------------------------------


def test_resume_with_another_accountant_refused(tmp_path):
    def trainer(accountant):
        model = _model()
        return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cl.TauCrossEntropy(4.0), _data(),
                                 input_shape=SHAPE, batch_size=8, delta=1e-3, epochs=2, noise_multiplier=1.0,
                                 accountant=accountant, progress=False, log=None)

    first = trainer("rdp")
    first.max_steps = first.steps_per_epoch  # interrupted halfway
    first.fit()
    first.save_checkpoint(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"'rdp' accountant but this run uses 'pld'"):
        trainer("pld").load_checkpoint(tmp_path / "ckpt.pt")


def _private_run(**plan):
    model = _model()
    engine = cl.PrivacyEngine()
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                             data=_data(), loss=cl.TauCrossEntropy(4.0), input_shape=SHAPE,
                                             batch_size=8, **plan)
    return engine, model, opt, loader


def _steps(model, opt, loader, count):
    for _, (x, y) in zip(range(count), loader):
        opt.zero_grad()
        cl.TauCrossEntropy(4.0).per_example(model(x), y).sum().backward()
        opt.step()


def test_a_budget_counted_in_steps_refuses_a_saved_history_of_another_mechanism():
    """A state saved at noise multiplier 0.6 loaded into a run planned for epsilon 3: its budget, counted in steps at
    its own multiplier, let it release steps up to its plan's count on top of the 30 loaded, which had spent
    epsilon 12.2 already (12.35 at the end, against the target 3)."""
    engine, model, opt, loader = _private_run(noise_multiplier=0.6)
    _steps(model, opt, loader, 6)
    saved_model, saved = model.state_dict(), opt.state_dict()
    plans = [dict(target_epsilon=3.0, target_delta=1e-3, epochs=4), dict(noise_multiplier=0.9, epochs=4)]
    for plan in plans:  # a target epsilon, and a given multiplier whose epochs are the budget
        engine, model, opt, _ = _private_run(**plan)
        model.load_state_dict(saved_model)
        with pytest.raises(ValueError, match="composed 6 step.* at noise multiplier 0.6 .* where every step of this"):
            opt.load_state_dict(saved)
        assert engine.accountant.steps == 0
    # the same plan resumes it; a multiplier without a budget composes both (the accountant reports their sum)
    engine, model, opt, loader = _private_run(noise_multiplier=0.6, epochs=4)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    assert engine.accountant.history == [(0.6, 8 / 64, 6)]
    engine, model, opt, loader = _private_run(noise_multiplier=2.0)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    _steps(model, opt, loader, 2)
    assert engine.accountant.history == [(0.6, 8 / 64, 6), (2.0, 8 / 64, 2)]


@pytest.mark.parametrize("edit", ["clear", "rebind", "dict", "count", "multiplier", "replace"])
def test_steps_taken_out_of_the_accountant_are_refused_and_put_back(edit):
    """``engine.accountant._history.clear()`` after 5 of a budget's 16 steps: 21 steps were released, the budget
    counting from 0 again, and epsilon was reported as 2.998 for a true 3.395 (target 3)."""
    from clipless.privacy.accounting import _Entry

    engine, model, opt, loader = _private_run(target_epsilon=3.0, target_delta=1e-3, epochs=2)
    _steps(model, opt, loader, 5)
    before = engine.accountant.history
    acc = engine.accountant
    if edit == "clear":  # the history is a tuple of frozen entries: nothing to clear or edit in place
        with pytest.raises(AttributeError):
            acc._history.clear()
        return
    if edit == "rebind":
        acc._history = ()
    elif edit == "dict":
        acc.__dict__["_history"] = acc._history[:0]
    elif edit == "count":
        object.__setattr__(acc._history[-1], "steps", 1)
    elif edit == "multiplier":
        object.__setattr__(acc._history[-1], "noise_multiplier", 50.0)
    else:
        acc._history = (_Entry(50.0, 0.125, 5),)
    assert engine.accountant.history != before
    with pytest.raises(BoundError, match="the accountant no longer holds the steps released so far"):
        _steps(model, opt, loader, 1)
    assert engine.accountant.history == before  # put back
    _steps(model, opt, loader, 1)  # and the run goes on from there
    assert engine.accountant.steps == 6


# --------------------------------------------------------------------------------------------------
# Finding 5: losses know their width; declared constants cannot be changed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", [cl.MulticlassHinge(2), cl.MulticlassKR(2), cl.MulticlassHKR(2)])
def test_multiclass_losses_refuse_another_width(loss):
    with pytest.raises(BoundError, match="declared for 2 classes"):
        _engine_setup(loss=loss)  # the model outputs 3 logits
    with pytest.raises(BoundError, match="declared for 2 classes"):
        loss.per_example(torch.randn(4, 10), torch.randint(0, 10, (4,)))


def test_wrong_width_would_have_broken_the_constant():
    """Why the check matters: the K=2 constant is far below the gradient norm on 10 logits."""
    z = torch.zeros(1, 10, requires_grad=True)
    cl.MulticlassKR(10).per_example(z, torch.tensor([0])).sum().backward()
    assert z.grad.norm() <= cl.MulticlassKR(10).lipschitz + 1e-6
    assert z.grad.norm() > 1.0  # vs L(K=2) = sqrt(2) * ... : 10 classes with K=2 weights reach 3.16
    assert cl.MulticlassKR(2).lipschitz == pytest.approx(math.sqrt(2))


def test_binary_loss_refuses_multiclass_outputs():
    with pytest.raises(BoundError, match="one logit per example"):
        _engine_setup(loss=cl.BinaryCrossEntropyWithTemperature())


@pytest.mark.parametrize("obj, name, value", [
    (cl.InputNormClip(1.0), "max_norm", 100.0),
    (cl.LossGradientClip(0.5), "max_norm", 10.0),
    (cl.AdaptiveLossGradientClip(1.0, count_noise_multiplier=3.0), "count_noise_multiplier", 0.01),
    (cl.CrossEntropyWithTemperature(2.0), "temperature", 0.01),
    (cl.TauCrossEntropy(4.0), "lipschitz", 0.1),
    (cl.KCosineSimilarity(), "floor", 1e-3),
    (cl.LayerCentering(), "dims", (0,)),
    (cl.Residual(nn.Identity()), "skip_weight", 5.0),
    (cl.LipschitzConv2d(1, 2), "stride", 3),
])
def test_declared_constants_are_read_only(obj, name, value):
    with pytest.raises(AttributeError, match="declared constant"):
        setattr(obj, name, value)


@pytest.mark.parametrize("weights", [(-0.5, 0.5), (0.5, -1.0), (float("nan"), 0.5), (0.5, float("nan")),
                                     (float("inf"), 0.5), (0.5, float("inf")), (True, 0.5), ("0.5", 0.5)])
def test_residual_weights_must_be_finite_and_non_negative(weights):
    """``y = a x + b h(x)`` is bounded with ``a`` and ``b`` as given: a negative weight would subtract from the
    gradient bound, and NaN slipped past a ``< 0`` test into NaN bounds and noise."""
    with pytest.raises(ValueError, match="residual weights"):
        cl.Residual(nn.Identity(), *weights)


def test_input_clip_radius_change_cannot_bypass_the_bound():
    _, model, opt, _ = _engine_setup()
    with pytest.raises(AttributeError, match="declared constant"):
        model[0].max_norm = 50.0


class _Scaled(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 100


class _LoudLinear(cl.LipschitzLinear):
    def forward(self, x):
        return super().forward(x) * 100


def test_containers_and_layers_with_unknown_forwards_refused():
    with pytest.raises(BoundError, match="overrides the forward"):
        _engine_setup(module=_Scaled(*_model()))
    loud = nn.Sequential(cl.InputNormClip(2.0), nn.Flatten(), _LoudLinear(16, 3))
    with pytest.raises(BoundError, match="must declare its own layer_bound"):
        _engine_setup(module=loud)


class _CallScaled(cl.LipschitzLinear):
    """Forward and bounds are LipschitzLinear's; the call scales the output by 1.5."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 1.5


class _WeightScaled(cl.LipschitzLinear):
    """Every read of ``weight`` (forward's included) gives 1.5 times the stored, projected weight."""

    def __getattr__(self, name):
        value = super().__getattr__(name)
        return value * 1.5 if name == "weight" else value


class _SeqCallScaled(nn.Sequential):
    def _call_impl(self, *args, **kwargs):
        return super()._call_impl(*args, **kwargs) * 1.5


@pytest.mark.parametrize("edit, redefined", [
    (lambda m: m.__setitem__(2, _CallScaled(16, 8)), "__call__"),
    (lambda m: m.__setitem__(2, _WeightScaled(16, 8)), "__getattr__"),
    (lambda m: _SeqCallScaled(*m), "_call_impl"),
])
def test_layers_whose_class_redefines_the_call_path_refused(edit, redefined):
    """A subclass of a bounded layer (or container) that keeps forward and layer_bound but redefines nn.Module's
    __call__ (or _call_impl, or the attribute lookup that hands forward its weight) computes 1.5 times what its
    bounds describe. With the scaling on the first layer it ran: the summed-gradient check is only necessary and
    a 1.5x per-example gradient passed it on a real batch. Now refused by name, at make_private and at a step."""
    model = _model()
    edited = edit(model)
    model = edited if edited is not None else model
    with pytest.raises(BoundError, match=f"redefines nn.Module's {redefined}"):
        _engine_setup(module=model)
    if redefined == "__call__":  # the class swapped in after make_private
        _, model, opt, _ = _engine_setup()
        model[2].__class__ = _CallScaled
        with pytest.raises(BoundError, match="redefines nn.Module's __call__|now a _CallScaled"):
            empty_batch_backward(model, cl.TauCrossEntropy(4.0), SHAPE)
            opt.step()


def _scaled_forward(cls, factor=1.5):
    forward = cls.forward
    return lambda self, *args: forward(self, *args) * factor


def _one_step_released():
    """make_private goes through and a step on 8 records is released."""
    engine, model, opt, _ = _engine_setup()
    loss = cl.TauCrossEntropy(4.0)
    loss.per_example(model(_data().features[:8]), _data().labels[:8]).sum().backward()
    opt.step()
    assert engine.accountant.steps == 1


def _refused_at_make_private_then_put_back(monkeypatch, owner, name, value, match):
    """``owner.name = value()`` before make_private (a model built before it): refused with ``match``; put back,
    make_private goes through and a step is released."""
    original, model = vars(owner).get(name), _model()
    monkeypatch.setattr(owner, name, value(), raising=False)
    with pytest.raises(BoundError, match=match):
        _engine_setup(module=model)
    if original is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, original)
    _one_step_released()


_CLASS_REPLACEMENTS = [
    (cl.LipschitzLinear, "forward", lambda: _scaled_forward(cl.LipschitzLinear)),
    (cl.MaxMin, "forward", lambda: _scaled_forward(cl.MaxMin)),
    (nn.Sequential, "forward", lambda: _scaled_forward(nn.Sequential)),
    (cl.LipschitzLinear, "layer_bound", lambda: lambda self, x_bound, shape: LayerBound(0.5, 0.5 * x_bound)),
    (cl.LipschitzLinear, "project_", lambda: lambda self: None),
]


@pytest.mark.parametrize("cls, name, value", _CLASS_REPLACEMENTS)
def test_methods_replaced_on_a_layer_class_after_make_private_refused(monkeypatch, cls, name, value):
    """A method assigned on the class (``LipschitzLinear.forward = ...``) after make_private changes every instance
    past the instance-level checks: a 1.5x forward on the first layer passed the summed-gradient check (only
    necessary). The classes' methods are now compared at every forward and step with those the bounds were set up
    with. Here the batch is empty, so only that comparison can refuse."""
    _, model, opt, _ = _engine_setup()
    monkeypatch.setattr(cls, name, value())
    with pytest.raises(BoundError, match=f"its class's {name} changed after the bounds were set up"):
        empty_batch_backward(model, cl.TauCrossEntropy(4.0), SHAPE)
        opt.step()


@pytest.mark.parametrize("cls, name, value", _CLASS_REPLACEMENTS + [
    # a property on the class outranks nn.Module's lookup of the parameter: every forward reads 1.5 W
    (cl.LipschitzLinear, "weight", lambda: property(lambda self: 1.5 * self._parameters["weight"])),
])
def test_methods_replaced_on_a_layer_class_before_make_private_refused(monkeypatch, cls, name, value):
    """Assigned before make_private, a class's method was the one the later comparisons start from, so every
    instance computed with it at every released step. make_private now places the methods and properties of the
    model's torch and clipless layer classes (and of their torch and clipless bases) by their code's file; put back,
    make_private goes through."""
    _refused_at_make_private_then_put_back(monkeypatch, cls, name, value,
                                           f"{cls.__qualname__}.{name} \\(defined in .*\\) is not torch's")


def _scaled(fn, factor=1.5):
    return lambda *args, **kwargs: factor * fn(*args, **kwargs)


def _scaling_torch_function(cls, func, types, args=(), kwargs=None):
    """``torch.Tensor.__torch_function__`` with every F.linear 1.5x."""
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
    return out * 1.5 if func is torch.nn.functional.linear else out


def _scaled_functional():
    """A stand-in for ``torch.nn.functional`` whose ``linear`` is 1.5x."""
    import types

    fake = types.ModuleType("functional")
    fake.__dict__.update(vars(torch.nn.functional))
    fake.linear = _scaled(torch.nn.functional.linear)
    return fake


_REPLACEMENTS = [
    ("torch.nn.functional", "linear", lambda: _scaled(torch.nn.functional.linear)),
    ("clipless.nn.layers", "max_min", lambda: _scaled(__import__("clipless.nn.layers").nn.layers.max_min)),
    ("torch", "maximum", lambda: _scaled(torch.maximum)),
    ("torch.Tensor", "mm", lambda: _scaled(torch.Tensor.mm)),  # a method of torch's C base, shadowed
    ("clipless.nn.linear", "max", lambda: _scaled(max)),  # a builtin, shadowed in a layer's module
    ("clipless.privacy.certified", "certified_bjorck_step", lambda: lambda *a, **k: (a[0], 0.5)),
    ("clipless.nn.linear", "F", lambda: _scaled_functional()),  # the module a layer reads F.linear from
    ("torch.Tensor", "__torch_function__", lambda: classmethod(_scaling_torch_function)),  # not callable itself
]


@pytest.mark.parametrize("where, name, value", _REPLACEMENTS)
def test_functions_replaced_globally_after_make_private_refused(monkeypatch, where, name, value):
    """A function replaced in its namespace after make_private (``torch.nn.functional.linear = ...``) changes
    every layer that calls it, or the certificate of the weights' norms, past every check on the layers: a 1.5x
    ``F.linear`` released steps (the summed-gradient check sees only gross excess). The namespaces the layers and
    certificates read are now compared at every forward and step; put back, training goes on. Torch's lazily
    added attributes and plain values are not changes."""
    import importlib

    engine, model, opt, loader = _engine_setup()
    loss = cl.TauCrossEntropy(4.0)
    x, y = _data().features[:8], _data().labels[:8]
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    space = torch.Tensor if where == "torch.Tensor" else importlib.import_module(where)
    original = vars(space).get(name)
    monkeypatch.setattr(space, name, value(), raising=False)
    opt.zero_grad()
    with pytest.raises(BoundError, match=f"{where}.{name} was replaced after the bounds were set up"):
        loss.per_example(model(x), y).sum().backward()
        opt.step()
    if original is None:
        monkeypatch.delattr(space, name)
    else:
        monkeypatch.setattr(space, name, original)
    monkeypatch.setattr(torch, "_clipless_lazily_added", 1, raising=False)  # not a change
    monkeypatch.setattr(importlib.import_module("clipless.nn.layers"), "_a_plain_value", 2, raising=False)
    steps = engine.accountant.steps
    opt.zero_grad()
    loss.per_example(model(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == steps + 1





def test_a_default_dtype_set_during_a_run_is_not_a_replaced_function():
    """``torch.set_default_dtype`` rebinds ``torch.Storage`` to torch's storage class of that dtype: the step refused
    it as "torch.Storage was replaced". torch's own alias passes now; another value there is still a replacement."""
    engine, model, opt, _ = _engine_setup()
    loss = cl.TauCrossEntropy(4.0)
    x, y = _data().features[:8], _data().labels[:8]
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        for _ in range(2):
            opt.zero_grad()
            loss.per_example(model(x), y).sum().backward()
            opt.step()
    finally:
        torch.set_default_dtype(default)
    assert engine.accountant.steps == 2
    storage = torch.Storage
    try:
        torch.Storage = type("Storage", (), {})
        opt.zero_grad()
        with pytest.raises(BoundError, match="torch.Storage was replaced"):
            loss.per_example(model(x), y).sum().backward()
            opt.step()
    finally:
        torch.Storage = storage
def test_torchs_own_wrapper_of_manual_seed_at_its_first_optimizer_is_not_a_replacement():
    """torch replaces ``torch.manual_seed`` by a wrapper when dynamo is first imported, which the first
    ``torch.optim`` optimizer does. A bound engine set up before any optimizer (a bounds report, then training)
    refused every later forward with "torch.manual_seed was replaced"; the engine now imports dynamo before its
    snapshot. A fresh interpreter (this one imported dynamo long ago); a real replacement is still refused there."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, torch
        import clipless as cl
        from clipless.privacy.bounds import BoundEngine
        assert "torch._dynamo" not in sys.modules
        model = cl.lipschitz_mlp((4,), 3, hidden=(8,))
        engine = BoundEngine(model, (4,), 1.0, 1.0)
        torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer: dynamo wraps torch.manual_seed
        engine.compute()
        torch.manual_seed = lambda seed: None
        try:
            engine.compute()
        except cl.BoundError as err:
            assert "torch.manual_seed was replaced" in str(err), err
        else:
            raise AssertionError("a replaced torch.manual_seed was not seen")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]

def _wrapped(fn, factor=1.5):
    """``fn`` times ``factor`` under ``fn``'s own name and module (``functools.wraps``), through a partial, and
    through ``functools.lru_cache`` (a wrapper object of C)."""
    import functools

    def scaled(*args, factor=factor, **kwargs):
        return factor * fn(*args, **kwargs)

    return functools.wraps(fn)(scaled), functools.partial(scaled, factor=factor), functools.lru_cache(scaled)


@pytest.mark.parametrize("where, name, value", _REPLACEMENTS + [
    ("torch.nn.functional", "linear", lambda: _wrapped(torch.nn.functional.linear)[0]),
    ("torch.nn.functional", "linear", lambda: _wrapped(torch.nn.functional.linear)[1]),
    ("torch.nn.functional", "linear", lambda: _wrapped(torch.nn.functional.linear)[2]),
])
def test_functions_replaced_before_make_private_refused(monkeypatch, where, name, value):
    """Replaced before make_private, a function was the snapshot the later checks compare with, so every step was
    released with the 1.5x layers (or certificate). make_private now places every callable of the watched
    namespaces: a Python function by its code's file (``functools.wraps`` copies the name and module, not the
    code), a partial by what it calls, a callable object or a class by its class's module, a module by being the
    one imported under its name; outside torch, clipless and the standard library, it is refused. Put back, the
    same make_private goes through, and torch's own wrappers (``import torch._dynamo`` wraps ``torch.manual_seed``)
    are accepted."""
    import importlib

    import torch._dynamo  # noqa: F401  (its wrappers are torch's own)

    space = torch.Tensor if where == "torch.Tensor" else importlib.import_module(where)
    _refused_at_make_private_then_put_back(monkeypatch, space, name, value,
                                           f"{where}.{name} \\(.*\\) is not torch's, clipless' or Python's own")


def test_a_shells_additions_to_builtins_are_not_refused(monkeypatch):
    """IPython adds Python functions and objects to builtins (``display``, ``get_ipython``, an ``exit`` of its own),
    defined outside torch, clipless and the standard library: no layer reads them, and a notebook must be able to
    train. Only Python's own builtins are placed."""
    import builtins

    class ExitAutocall:  # IPython's exit: an object of a class defined in IPython
        def __call__(self):
            raise SystemExit

    monkeypatch.setattr(builtins, "display", lambda *objs: None, raising=False)
    monkeypatch.setattr(builtins, "get_ipython", ExitAutocall().__call__, raising=False)
    monkeypatch.setattr(builtins, "exit", ExitAutocall())
    _one_step_released()


def test_a_function_replaced_for_the_forward_only_is_refused(monkeypatch):
    """Replaced for the forward and put back before ``step()``: the forward's own check names it."""
    engine, model, opt, loader = _engine_setup()
    loss = cl.TauCrossEntropy(4.0)
    x, y = _data().features[:8], _data().labels[:8]
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", _scaled(linear))
    out = model(x)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    loss.per_example(out, y).sum().backward()
    with pytest.raises(BoundError, match="torch.nn.functional.linear was replaced"):
        opt.step()
    assert engine.accountant.steps == 0


def test_hooks_that_change_outputs_refused():
    model = _model()
    model[2].register_forward_hook(lambda m, a, out: out * 100)
    with pytest.raises(BoundError, match="hooks"):
        _engine_setup(module=model)
    _, model, opt, _ = _engine_setup()
    handle = model[2].register_forward_hook(lambda m, a, out: out * 100)
    empty_batch_backward(model, cl.TauCrossEntropy(4.0), SHAPE)
    with pytest.raises(BoundError, match="hooks"):
        opt.step()
    handle.remove()
    opt.zero_grad()
    empty_batch_backward(model, cl.TauCrossEntropy(4.0), SHAPE)
    opt.step()


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return self.factor * x


def _straight_through(module, factor):
    """The same values, ``factor`` times the gradient: ``y + (factor - 1) (y - y.detach())``."""
    forward = module.forward

    def amplified(*args):
        y = forward(*args)
        return y + (factor - 1) * (y - y.detach())
    module.forward = amplified


@pytest.mark.parametrize("edit", [
    lambda m: m.insert(3, nn.Sequential(_Scale(2.0))),  # a 2x layer, unchecked: released before
    lambda m: m.__setitem__(3, _Scale(2.0)),  # MaxMin replaced
    lambda m: m.__setitem__(3, cl.MaxMin()),  # another instance of a bounded layer
    lambda m: m.append(nn.Flatten()),  # even a harmless layer: the bounds were set up for the old list
    lambda m: _straight_through(m[3], 2.0),  # an instance-level forward: same values, 2x gradient
    lambda m: _straight_through(m, 2.0),
    lambda m: m[3].compile(),
    lambda m: setattr(m[2], "layer_bound", m[2].layer_bound),  # even the same bound, set on the instance
    lambda m: setattr(m[3], "layer_bound", lambda x_bound, shape: LayerBound(0.5, 0.5 * x_bound)),
])
def test_layers_changed_after_make_private_refused(edit):
    """The bounds are set up for the layers make_private saw. A 2x layer put in place of MaxMin or appended, or
    a 2x instance-level forward, was released before: the summed-gradient check (a necessary condition) let it
    through on a real batch. Here the batch is empty, so only the structural check can refuse."""
    _, model, opt, _ = _engine_setup()
    edit(model)
    with pytest.raises(BoundError, match="changed after its bounds|its own"):
        empty_batch_backward(model, cl.TauCrossEntropy(4.0), SHAPE)
        opt.step()


def _two_square_layers():
    torch.manual_seed(0)
    return nn.Sequential(cl.InputNormClip(1.0), cl.LipschitzLinear(8, 8), cl.MaxMin(), cl.LipschitzLinear(8, 8),
                         cl.MaxMin(), cl.LipschitzLinear(8, 3))


def _private(model):
    data = cl.ArrayDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    return cl.PrivacyEngine("rdp").make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                                data=data, loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                                input_shape=(8,), batch_size=8.0, external_batches=True)


def test_parameters_shared_between_layers_refused():
    """A weight tied between two layers has the sum of both layers' terms as its gradient, but was bounded and
    noised as two blocks (the second noise pass divided the gradient by b again: b^2 in all)."""
    model = _two_square_layers()
    model[3].weight = model[1].weight
    with pytest.raises(BoundError, match="share a parameter"):
        _private(model)


@pytest.mark.parametrize("edit", [
    lambda m: setattr(m[3], "weight", m[1].weight),  # tied after make_private
    lambda m: setattr(m[3], "weight", nn.Parameter(m[3].weight.detach().clone())),  # a new, unstepped weight
])
def test_parameters_replaced_or_tied_after_make_private_refused(edit):
    model, opt, loader = _private(_two_square_layers())
    edit(model)
    x, y = next(iter(loader))
    cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
    with pytest.raises(BoundError, match=r"at the private model's forward, the model's weights \(3.weight\) were "
                       "other tensors .* replaced or shared"):
        opt.step()
    assert opt.accountant.steps == 0



class _TimesTen(nn.Module):
    def forward(self, w):
        return 10.0 * w


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_parametrized_weight_is_refused_by_name(when):
    """``torch.nn.utils.parametrize`` makes a layer compute with ``f(stored tensor)``: a 10x weight here, which the
    projection (acting on a computed copy) never reaches. Refused before, but as an uncovered parameter, or after
    make_private as a frozen weight holding a gradient: now named for what it is, at make_private and at a step."""
    from torch.nn.utils import parametrize

    model = _two_square_layers()
    if when == "before":
        parametrize.register_parametrization(model[3], "weight", _TimesTen())
        with pytest.raises(BoundError, match="has a parametrization"):
            _private(model)
        return
    model, opt, loader = _private(model)
    parametrize.register_parametrization(model[3], "weight", _TimesTen())
    x, y = next(iter(loader))
    cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
    with pytest.raises(BoundError, match="has a parametrization"):
        opt.step()
    assert opt.accountant.steps == 0

def test_weight_frozen_between_backward_and_step_refused():
    """The frozen weight kept its summed gradient, got no noise (the bounds skip frozen weights) and the
    optimizer applied it: the raw gradient was released."""
    model, opt, loader = _private(_two_square_layers())
    released = capture_released(opt)
    batches = iter(loader)
    x, y = next(batches)
    cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
    model[1].weight.requires_grad_(False)
    with pytest.raises(BoundError, match="receives no noise"):
        opt.step()
    assert not released and opt.accountant.steps == 0
    # frozen before the forward: it gets no gradient and the step is released
    opt.zero_grad()
    x, y = next(batches)
    cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
    opt.step()
    assert len(released) == 1 and model[1].weight.grad is None and opt.accountant.steps == 1


def test_instance_forward_refused_at_make_private():
    model = _model()
    _straight_through(model[2], 2.0)
    with pytest.raises(BoundError, match="its own forward"):
        _engine_setup(module=model)


# --------------------------------------------------------------------------------------------------
# Finding 6: no layer acts on the batch axis
# --------------------------------------------------------------------------------------------------


def test_layer_centering_empty_dims_refused():
    with pytest.raises(ValueError, match=r"dims=\(\)"):
        cl.LayerCentering(dims=())
    with pytest.raises(ValueError, match="distinct"):
        cl.LayerCentering(dims=(1, 1))
    with pytest.raises(ValueError, match="batch axis"):
        cl.LayerCentering(dims=-2)(torch.randn(4, 3))  # -2 is the batch axis of 2-d inputs


def test_layer_axes_are_integers_not_bools_and_numpy_integers_are_kept_as_int():
    """``True`` reads as axis 1 wherever a bool passes for an int; numpy's integers are axes (stored as int)."""
    import numpy as np

    for bad in (True, (True,), 1.5, (1, 2.0), "1"):
        with pytest.raises(ValueError, match="distinct integers"):
            cl.LayerCentering(dims=bad)
    with pytest.raises(ValueError, match="dim must be an integer axis"):
        cl.MaxMin(dim=True)
    layer = cl.LayerCentering(dims=np.int64(1))
    assert layer.dims == (1,) and type(layer.dims[0]) is int
    x = torch.randn(4, 6)
    assert torch.equal(layer(x), cl.LayerCentering(dims=1)(x))
    assert type(cl.MaxMin(dim=np.int64(1)).dim) is int


def test_groupsort_on_a_negative_batch_axis_refused():
    with pytest.raises(ValueError, match="batch axis"):
        cl.MaxMin(dim=-2)(torch.randn(4, 6))


def test_centering_is_per_example():
    """The summed-batch gradient equals the sum of per-example gradients (no coupling)."""
    layer = nn.Sequential(cl.LipschitzLinear(5, 4), cl.LayerCentering(), cl.LipschitzLinear(4, 3))
    x = torch.randn(6, 5)
    layer(x).pow(2).sum().backward()
    summed = [p.grad.clone() for p in layer.parameters()]
    per = [torch.zeros_like(p) for p in layer.parameters()]
    for i in range(6):
        grads = torch.autograd.grad(layer(x[i : i + 1]).pow(2).sum(), list(layer.parameters()))
        per = [a + g for a, g in zip(per, grads)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(summed, per))


# --------------------------------------------------------------------------------------------------
# Finding 7: the input guard covers every forward that can reach a private step
# --------------------------------------------------------------------------------------------------


def test_eval_mode_forward_with_gradients_is_guarded():
    model = cl.lipschitz_mlp(SHAPE, 3, hidden=(8,), input_clip=None)
    engine = cl.PrivacyEngine("rdp")
    within = cl.ArrayDataset(_data().features / 4, _data().labels)  # 16 pixels in [0, 1/4]: norms <= 1
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=within, loss=cl.TauCrossEntropy(), noise_multiplier=1.0,
                                        input_shape=SHAPE, batch_size=8.0, input_bound=1.0, external_batches=True)
    big = torch.full((2, *SHAPE), 10.0)  # norm 40 > input_bound 1
    model.eval()
    with pytest.raises(BoundError, match="input_bound") as info:
        model(big)
    assert "40" not in str(info.value)  # error messages reach logs: a record's norm is not shown
    with torch.no_grad():
        model(big)  # evaluation without gradients cannot reach a step


# --------------------------------------------------------------------------------------------------
# Finding 8: Poisson sampling realises the accounted rate
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [10, 60_000, 3_000_000, 10_000_000])
def test_realised_rate_is_within_2_pow_minus_53_below_q(n):
    for q in (1.0 / n, 3.0 / n, 1e-5, 0.3, 1.0):
        realised = realised_sample_rate(q)
        assert Fraction(q) - Fraction(1, 2**SAMPLING_BITS) < realised <= Fraction(q)


def test_unrealisable_rate_refused():
    with pytest.raises(ValueError, match="cannot realise"):
        poisson_threshold(2.0**-60)
    with pytest.raises(ValueError, match="cannot realise"):
        cl.PoissonBatchSampler(10, 2.0**-60)


def test_sampler_hits_tiny_rates_float32_cannot():
    """q = 0.1 * 2^-24: float32 uniforms (resolution 2^-24) include a record with probability 2^-24, 10x q."""
    q, n, steps = 0.1 * 2.0**-24, 10_000_000, 40
    sampler = cl.PoissonBatchSampler(n, q, steps_per_epoch=steps, generator=torch.Generator().manual_seed(0))
    count = sum(len(b) for b in sampler)
    expected = q * n * steps  # 2.4; float32 sampling would give 23.8 on average
    assert count <= expected + 4 * math.sqrt(expected) + 3


def test_cli_refusal_writes_nothing(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(SystemExit, match="delta"):
        cli_main(["train", "--delta", "0.5", "--epochs", "1", "--no-progress", "--output-dir", str(out)])
    with pytest.raises(SystemExit, match="--epochs .*must be an integer, got 2.7"):
        cli_main(["train", "--config", str(_yaml(tmp_path)), "--no-progress", "--output-dir", str(out)])
    assert not out.exists()


def _yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 2.7\n")  # a fractional epoch count would overrun the planned budget
    return path


def test_a_model_trained_by_one_engine_is_refused_by_another():
    """A second PrivacyEngine made a trained private model private again with a fresh accountant, and reported the
    epsilon of its own steps only (5 steps: 3.57, where the model had released 10).  It is now refused; the same
    engine composes both phases, and a deep copy of the trained model carries its history (refused too)."""
    import copy

    data = cl.load_digits()
    shape = tuple(data.train[0][0].shape)
    loss = cl.TauCrossEntropy(8.0)
    model = cl.lipschitz_mlp(shape, 10, hidden=(16,), input_clip=8.0)

    def private(engine, m):
        return engine.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), data=data.train,
                                   loss=loss, noise_multiplier=1.0, input_shape=shape, batch_size=256.0,
                                   input_bound=8.0)

    first = cl.PrivacyEngine()
    fresh = cl.PrivacyEngine()
    private(fresh, model)  # made private by an engine that released nothing: another engine may take it over
    for _ in range(2):  # two phases through the first engine
        m, opt, loader = private(first, model)
        for _, (x, y) in zip(range(3), loader):
            opt.zero_grad()
            loss.per_example(m(x), y).sum().backward()
            opt.step()
    assert first.accountant.steps == 6
    for target in (model, copy.deepcopy(model)):
        with pytest.raises(ValueError, match="already released 6 private step"):
            private(cl.PrivacyEngine(), target)
    from clipless.contrastive import AugmentedPairs, ContrastivePretrainer

    encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 8))

    def pretrainer():
        return ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1),
                                     AugmentedPairs(data.train.features, 1, False), method="naive_dp",
                                     batch_size=512, epochs=1, delta=1e-5, noise_multiplier=1.0, progress=False,
                                     log=None)

    released = pretrainer().fit().steps
    with pytest.raises(ValueError, match=f"already released {released} private step"):
        pretrainer()


def test_a_target_epsilon_is_refused_on_an_accountant_with_history():
    """A target epsilon plans a run from its first step.  Through the same engine after released steps, the plan
    ignored them: after 2 steps at sigma 0.5 (epsilon 9.6), a target of 3 calibrated for 6 fresh steps allowed 4
    more, to a composed epsilon of 9.8.  Refused now; a fixed noise_multiplier goes on composing."""
    data = cl.load_digits()
    shape = tuple(data.train[0][0].shape)
    loss = cl.TauCrossEntropy(8.0)
    model = cl.lipschitz_mlp(shape, 10, hidden=(16,), input_clip=8.0)
    engine = cl.PrivacyEngine()
    kw = dict(module=model, data=data.train, loss=loss, input_shape=shape, batch_size=256.0, input_bound=8.0)
    m, opt, loader = engine.make_private(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.5,
                                         **kw)
    for _, (x, y) in zip(range(2), loader):
        opt.zero_grad()
        loss.per_example(m(x), y).sum().backward()
        opt.step()
    before = engine.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="already composed 2 step"):
        engine.make_private_with_epsilon(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), target_epsilon=3.0,
                                         target_delta=1e-5, epochs=1, **kw)
    m, opt, loader = engine.make_private(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                         **kw)
    x, y = next(iter(loader))
    loss.per_example(m(x), y).sum().backward()
    opt.step()
    assert engine.accountant.steps == 3 and engine.get_epsilon(1e-5) > before
