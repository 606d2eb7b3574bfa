"""Scattering front-end: a fixed per-example map with a guaranteed output norm, and private training on it."""

from __future__ import annotations

import json

import pytest
import torch

import clipless as cl
from clipless.cli import main
from clipless.data.datasets import ArrayDataset, DataSplit
from clipless.data.features import ScatteringFeatures, scattering_split


def test_scattering_outputs_lie_on_the_sphere_for_any_image():
    phi = ScatteringFeatures((1, 28, 28), radius=1.5)
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.rand(8, 1, 28, 28, generator=gen),
        100 * torch.randn(4, 1, 28, 28, generator=gen),  # far outside the pixel range
        (torch.rand(4, 1, 28, 28, generator=gen) < 0.02).float(),  # nearly empty images
    ])
    norms = phi(x).norm(dim=1)
    assert torch.allclose(norms, torch.full_like(norms, 1.5), rtol=1e-5)
    assert phi(torch.zeros(1, 1, 28, 28)).norm() <= 1.5  # a constant image maps to 0, still inside the bound
    assert phi(x).shape[1] == phi.out_shape[0] == 81 * 7 * 7


def test_scattering_is_per_example_and_has_no_state():
    """One example's features do not depend on the rest of the batch (no batch statistics, nothing learned)."""
    phi = ScatteringFeatures((1, 28, 28))
    assert not list(phi.parameters())
    x = torch.rand(6, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    together = phi(x)
    alone = torch.cat([phi(x[i : i + 1]) for i in range(6)])
    assert torch.allclose(together, alone, atol=1e-6)
    assert torch.allclose(phi(x[:3]), together[:3], atol=1e-6)


def test_scattering_rejects_an_indivisible_group_count():
    with pytest.raises(ValueError, match="groups"):
        ScatteringFeatures((1, 28, 28), groups=10)


def test_private_linear_head_on_scattering_features_learns_mnist(shared_data):
    """Fast version of the issue-2 recipe: 10k training images, 3 epochs at epsilon 2."""
    full = cl.load_mnist(shared_data / "mnist")
    small = DataSplit(ArrayDataset(full.train.features[:10000], full.train.labels[:10000]),
                      ArrayDataset(full.test.features[:2000], full.test.labels[:2000]), "mnist-10k", num_classes=10)
    data = scattering_split(small)
    assert data.train.features.norm(dim=1).max() <= 1.0 + 1e-5
    torch.manual_seed(0)
    model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(), input_clip=1.0, projection="spectral")
    model.append(cl.LossGradientClip(0.25))
    trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), cl.TauCrossEntropy(64.0),
                                data.train, input_shape=data.input_shape, batch_size=1000, delta=1e-5, epochs=3,
                                target_epsilon=2.0, noise_seed=0, test_data=data.test, progress=False, log=None)
    result = trainer.fit()
    assert result.epsilon <= 2.0
    assert result.test_accuracy > 0.85


def test_cli_scattering_features_on_digits(tmp_path):
    out = tmp_path / "run"
    main(["train", "--features", "scattering", "--epochs", "2", "--tau", "32", "--loss-grad-clip", "0.25",
          "--output-dir", str(out), "--no-progress"])
    result = json.loads((out / "result.json").read_text())
    assert result["dataset"] == "digits+scattering" and result["epsilon"] <= 3.0
    with pytest.raises(SystemExit, match="mlp"):
        main(["train", "--features", "scattering", "--model", "cnn", "--output-dir", str(out), "--no-progress"])
