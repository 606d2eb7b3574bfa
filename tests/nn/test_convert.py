"""``to_lipschitz``: a model of standard torch layers rebuilt from clipless layers, whose bounds then hold."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import clipless as cl
from helpers import CLASSES, check


def _cnn(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, (3, 3), stride=2, padding=1), nn.BatchNorm2d(8), nn.GELU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def test_standard_layers_become_their_clipless_counterparts_and_the_original_is_kept():
    model = _cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"'4' \(BatchNorm2d\), '8' \(Dropout\) by nn.Identity"):
        converted = cl.to_lipschitz(model, drop_unbounded=True)
    kinds = [type(m).__name__ for m in converted]
    assert kinds == ["LipschitzConv2d", "ReLU", "L2NormPool2d", "LipschitzConv2d", "Identity", "GELU",
                     "ScaledAvgPool2d", "Flatten", "Identity", "LipschitzLinear", "Tanh", "LipschitzLinear"]
    assert converted[3].stride == 2 and converted[3].padding == (1, 1) and converted[2].kernel_size == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the argument is not touched
    assert type(model[0]) is nn.Conv2d


@pytest.mark.parametrize("seed", [0, 1])
def test_the_converted_models_per_example_gradients_stay_within_their_bounds(seed):
    """Random and adversarial inputs, random and 'trained' (perturbed, projected) weights, true autograd norms."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = cl.to_lipschitz(_cnn(), drop_unbounded=True)
    check(converted, (1, 8, 8), radius=3.0, seed=seed)
    mlp = cl.to_lipschitz(nn.Sequential(nn.Flatten(), nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, CLASSES)),
                          activation="maxmin")
    assert isinstance(mlp[2], cl.MaxMin)
    check(mlp, (12,), radius=2.0, seed=seed)


def test_weights_are_copied_then_projected():
    torch.manual_seed(0)
    linear, conv = nn.Linear(6, 4), nn.Conv2d(2, 3, 3, padding=1)
    with torch.no_grad():
        conv.weight.mul_(0.01)  # below the unit norm: kept as they are by the spectral rescale
        conv.bias.mul_(0.01)
    model = nn.Sequential(conv, nn.Flatten(), linear)
    new = cl.to_lipschitz(model)
    u, _, vh = torch.linalg.svd(linear.weight.detach().double(), full_matrices=False)
    # Björck keeps the weight's orthonormal polar factor, the nearest orthonormal matrix to the copied one
    assert torch.allclose(new[2].weight.double(), u @ vh, atol=1e-5)
    assert torch.equal(new[0].weight, conv.weight) and torch.equal(new[0].bias, conv.bias)
    assert new[2].bias.norm() <= new[2].bias_bound * (1 + 1e-6)


def test_layers_it_cannot_convert_are_named_in_one_error():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Conv2d(4, 4, 3, dilation=2), nn.MaxPool2d(3, stride=2),
                          nn.Conv2d(4, 4, 4, padding="same"), nn.LayerNorm(4), nn.AvgPool2d(2, padding=1),
                          nn.Conv2d(4, 4, 3, padding_mode="reflect", padding=1), nn.Conv2d(4, 4, 3, stride=(1, 2)))
    with pytest.raises(ValueError) as info:
        cl.to_lipschitz(model)
    message = str(info.value)
    for name, why in (("0", "grouped or dilated"), ("1", "grouped or dilated"), ("2", "disjoint"),
                      ("3", "odd kernel"), ("4", "drop_unbounded=True"), ("5", "disjoint"), ("6", "reflect"),
                      ("7", "stride")):
        assert f"'{name}' (" in message and why in message, (name, message)
    with pytest.raises(ValueError, match="activation must be one of"):
        cl.to_lipschitz(model, activation="relu")
    with pytest.raises(TypeError, match="drop_unbounded"):
        cl.to_lipschitz(model, drop_unbounded="yes")


def test_nested_containers_and_a_single_layer_are_converted_and_the_rest_left_to_the_bound_engine():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(5, 4), nn.ReLU())

        def forward(self, x):
            return self.inner(x)

    new = cl.to_lipschitz(nn.Sequential(Block(), nn.Linear(4, 2)))
    assert isinstance(new[0].inner[0], cl.LipschitzLinear) and isinstance(new[1], cl.LipschitzLinear)
    assert isinstance(cl.to_lipschitz(nn.Linear(3, 2)), cl.LipschitzLinear)
    kept = cl.to_lipschitz(nn.Sequential(nn.Linear(3, 4), nn.PReLU()))
    assert type(kept[1]) is nn.PReLU  # no certified constant: make_private names it
    with pytest.raises(cl.BoundError, match="PReLU"):
        cl.BoundEngine(kept, (3,), 1.0, 1.0).compute()


def test_a_module_used_twice_is_converted_once_and_stays_shared():
    """``named_children`` lists a shared module once: its second place stayed an ``nn.Linear`` beside a converted
    first one. Every place now gets the one converted module, so the tie is kept and the bound engine names it."""
    shared = nn.Linear(4, 4)
    converted = cl.to_lipschitz(nn.Sequential(shared, nn.ReLU(), shared, nn.Sequential(shared)))
    assert isinstance(converted[0], cl.LipschitzLinear) and converted[0] is converted[2] is converted[3][0]
    with pytest.raises(cl.BoundError, match="used twice"):
        cl.BoundEngine(converted, (4,), 1.0, 1.0)


def test_a_converted_model_trains_privately():
    data = cl.load_digits()
    model = cl.to_lipschitz(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                            activation="maxmin")
    loss = cl.TauCrossEntropy(8.0)
    engine = cl.PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data.train, loss=loss,
        noise_multiplier=2.0, input_shape=data.input_shape, batch_size=64, input_bound=8.0)
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss.per_example(model(x), y).sum().backward()
        optimizer.step()
        if i == 1:
            break
    assert engine.accountant.steps == 2 and 0 < engine.get_epsilon(1e-5) < float("inf")


def test_export_takes_a_converted_model_back_to_standard_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GELU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8 * 2 * 2, CLASSES))
    converted = cl.to_lipschitz(model)
    exported = cl.export(converted, (1, 8, 8))
    assert [type(m).__name__ for m in exported] == ["Conv2d", "GELU", "LPPool2d", "Conv2d", "ReLU", "AvgPool2d",
                                                    "Flatten", "Linear"]
    x = torch.rand(6, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(exported(x), converted(x), atol=1e-4)
