"""benchmarks/speed.py builds a step for every method it times, and profile_step.py times the parts of one (a
benchmark that crashes measures nothing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def speed():
    sys.path.insert(0, str(BENCHMARKS))  # speed.py imports its sibling report.py
    try:
        spec = importlib.util.spec_from_file_location("speed", BENCHMARKS / "speed.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("method", ["lipschitz", "clipless", "unguarded", "secure", "standard", "opacus", "ghost"])
def test_every_method_builds_a_step_that_runs(speed, method, model):
    """The 'unguarded' stand-in for the step guard went out of date twice (a changed method signature, then the
    guard's settings the optimizer checks every step) and crashed the benchmark."""
    if method in ("opacus", "ghost"):
        pytest.importorskip("opacus", reason="the Opacus baselines need the optional opacus extra")
    torch.manual_seed(0)
    step = speed._build(method, model, 4, "cpu")
    for _ in range(2):
        step()
    assert set(speed.METHODS) == {"lipschitz", "clipless", "unguarded", "secure", "standard", "opacus", "ghost"}


def test_the_secure_method_draws_four_times_the_noise(speed, monkeypatch):
    """'secure' times the private step with secure_noise=True: four draws per weight where 'clipless' makes one."""
    from clipless.privacy import noise

    draws = []
    draw = noise._box_muller

    def counted(*args, **kwargs):
        draws.append(1)
        return draw(*args, **kwargs)

    counts = {}
    monkeypatch.setattr(noise, "_box_muller", counted)  # before make_private, which freezes the step's own code
    for method in ("clipless", "secure"):
        step = speed._build(method, "mlp", 4, "cpu")
        step()
        draws.clear()
        step()
        counts[method] = len(draws)
    assert counts["clipless"] == 3 and counts["secure"] == 12  # the MLP's three weights


def test_the_phases_of_a_step_are_timed_and_add_up(speed):
    """``profile_step.py --phases``: the parts of the private step add up to the step (the rest is what is left)."""
    spec = importlib.util.spec_from_file_location("profile_step", BENCHMARKS / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.phases("mlp", 4, "cpu", steps=3)
    private, plain = result["clipless_ms"], result["lipschitz_ms"]
    assert set(plain) == {"zero_grad", "forward", "backward", "adam", "projection", "total"}
    assert all(v > 0 for v in plain.values()) and all(v > 0 for k, v in private.items() if k != "step: the rest")
    parts = sum(v for k, v in private.items() if k.startswith("step: "))
    assert parts == pytest.approx(private["step"])
