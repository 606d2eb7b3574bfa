"""``clipless epsilon``: a planned run's noise multiplier, steps and epsilon, as the training run plans them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import clipless as cl
from clipless.cli import main


def _plan(capsys, *argv):
    assert main(["epsilon", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _trainer(data, **kw):
    torch.manual_seed(0)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(16,))
    args = dict(input_shape=data.input_shape, batch_size=256, delta=1e-5, epochs=3, input_bound=8.0,
                test_data=data.test, progress=False, log=None)
    args.update(kw)
    return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(8.0),
                             data.train, **args)


@pytest.mark.parametrize("given", [
    dict(target_epsilon=3.0),
    dict(noise_multiplier=2.0, target_epsilon=None),
    dict(noise_multiplier=1.0, target_epsilon=3.0),  # the budget stops the run before its epochs end
    dict(target_epsilon=1.0, accountant="rdp"),
    dict(target_epsilon=2.0, strategy="per_layer", layer_noise_multipliers="energy"),
])
def test_the_command_plans_what_a_training_run_draws_and_spends(capsys, given) -> None:
    """Same sample rate, steps, noise multiplier and epsilon as a ``PrivateTrainer`` of the same settings, whose
    run is then taken to its end: the command's epsilon is the one the trained run reports."""
    data = cl.load_digits()
    trainer = _trainer(data, **given)
    argv = ["--records", str(len(data.train)), "--batch-size", "256", "--epochs", "3", "--delta", "1e-5"]
    if given.get("target_epsilon") is not None:
        argv += ["--epsilon", str(given["target_epsilon"])]
    if "noise_multiplier" in given:
        argv += ["--noise-multiplier", str(given["noise_multiplier"])]
    if "accountant" in given:
        argv += ["--accountant", given["accountant"]]
    plan = _plan(capsys, *argv)
    trained = trainer.optimizer.plan
    assert plan["sample_rate"] == trainer.sample_rate
    assert plan["planned_steps"] == 3 * trainer.steps_per_epoch
    assert plan["steps"] == min(plan["planned_steps"], trained.max_steps)
    assert plan["stopped_by_budget"] == trained.budget_limited
    # per-layer multipliers compose to the gradient's multiplier up to rounding
    assert math.isclose(plan["noise_multiplier"], trained.step_sigma, rel_tol=1e-12)
    result = trainer.fit()
    assert result.steps == plan["steps"]
    assert math.isclose(plan["epsilon"], result.epsilon, rel_tol=1e-9)
    if given.get("target_epsilon") is not None:
        assert plan["epsilon"] <= given["target_epsilon"]


def test_the_command_prints_one_line_with_the_budget_stop(capsys) -> None:
    assert main(["epsilon", "--records", "60000", "--batch-size", "256", "--epochs", "10", "--noise-multiplier",
                 "0.6", "--epsilon", "3"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert re.search(r"noise multiplier 0\.6000, epsilon 2\.99\d+ \(delta 1e-05, pld\) after (\d+) steps; the "
                     r"budget \(epsilon 3\) stops the run after \1 of its 2340 steps", line), line


@pytest.mark.parametrize("argv, match", [
    (["--records", "1000", "--batch-size", "100", "--epochs", "2"], "give --noise-multiplier .* or --epsilon"),
    (["--records", "1000", "--batch-size", "100", "--epochs", "2", "--epsilon", "1", "--delta", "1e-3"],
     r"delta=0.001 must satisfy 0 < delta < 1/N"),
    (["--records", "0", "--batch-size", "100", "--epochs", "2", "--epsilon", "1"], "--records: must be >= 1"),
    (["--records", "50", "--batch-size", "100", "--epochs", "2", "--epsilon", "1", "--delta", "1e-3"],
     r"batch_size .* must be a number in \(0, N=50\]"),
    (["--records", "1000", "--batch-size", "100", "--epochs", "0", "--epsilon", "1", "--delta", "1e-4"],
     "--epochs: must be >= 1"),
    (["--records", "1000", "--batch-size", "100", "--epochs", "1", "--epsilon", "nan", "--delta", "1e-4"],
     "--epsilon: must be finite"),
    (["--records", "1000", "--batch-size", "100", "--epochs", "1", "--noise-multiplier", "-1", "--delta", "1e-4"],
     "--noise-multiplier: must be > 0"),
    (["--records", "1000", "--batch-size", "100", "--epochs", "1", "--epsilon", "1", "--accountant", "gdp",
      "--delta", "1e-4"], "--accountant: must be one of pld, rdp"),
    (["--records", "1000", "--batch-size", "500", "--epochs", "1", "--noise-multiplier", "0.3", "--epsilon", "0.01",
      "--delta", "1e-4"], "a single step at sigma_eff=0.3 already exceeds epsilon=0.01"),
])
def test_bad_plans_are_refused_in_one_line(argv, match) -> None:
    with pytest.raises(SystemExit) as info:
        main(["epsilon", *argv])
    message = str(info.value.code)
    assert "\n" not in message and re.search(match, message), message
