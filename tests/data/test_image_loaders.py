"""CIFAR-10 ("python version") and ImageFolder loaders, on small files the tests write in those formats."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from clipless.cli import main
from clipless.data.datasets import load_cifar10, load_dataset, load_image_folder


def _write_cifar(root, per_batch: int = 6, labels=None) -> np.ndarray:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        first = data if first is None else first
        batch = {b"batch_label": name.encode(), b"data": data,
                 b"labels": list(labels if labels is not None else rng.integers(0, 10, per_batch).tolist())}
        with open(root / name, "wb") as fh:
            pickle.dump(batch, fh)
    return first


def test_cifar10_python_version(tmp_path) -> None:
    first = _write_cifar(tmp_path / "cifar")
    data = load_cifar10(tmp_path / "cifar")
    assert data.input_shape == (3, 32, 32) and len(data.train) == 30 and len(data.test) == 6
    x, _ = data.train[0]
    # row-major 3072 bytes: 1024 red, 1024 green, 1024 blue values
    assert torch.allclose(x, torch.tensor(first[0].reshape(3, 32, 32) / 255.0, dtype=torch.float32))
    assert float(data.train.features.max()) <= 1.0 and float(data.train.features.min()) >= 0.0
    assert load_dataset("cifar10", tmp_path / "cifar").name == "cifar10"


def test_cifar10_refusals(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        load_cifar10(tmp_path)
    for labels in ([0, 1, 2, 3, 4, 11], [0, 1, 2, 3, 4, 1.5]):  # 1.5 was trained as class 1
        _write_cifar(tmp_path / "bad", labels=labels)
        with pytest.raises(ValueError, match="not integers 0-9"):
            load_cifar10(tmp_path / "bad")
    _write_cifar(tmp_path / "bad")
    with open(tmp_path / "bad" / "data_batch_2", "wb") as fh:  # pixels above 255 broke the [0, 1] scale
        pickle.dump({b"data": np.full((2, 3072), 1000, dtype=np.int16), b"labels": [0, 1]}, fh)
    with pytest.raises(ValueError, match="int16 pixels"):
        load_cifar10(tmp_path / "bad")

    class Evil:  # a pickle that would run code when loaded
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil"
    _write_cifar(evil)
    with open(evil / "data_batch_3", "wb") as fh:
        pickle.dump({b"data": Evil(), b"labels": [0]}, fh)
    with pytest.raises(ValueError, match="refused"):
        load_cifar10(evil)
    (evil / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="CIFAR-10"):
        load_cifar10(evil)


def _write_folder(root, classes=("cat", "dog"), per_class: int = 5, size=(12, 10), mode: str = "RGB") -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape = (size[0], size[1], 3) if mode == "RGB" else size
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(root / c / f"{i}.png")


def test_image_folder_split_and_given_split(tmp_path) -> None:
    _write_folder(tmp_path / "flat")
    data = load_image_folder(tmp_path / "flat", test_fraction=0.4, seed=0)
    assert data.input_shape == (3, 12, 10) and len(data.train) + len(data.test) == 10
    assert sorted(set(data.train.labels.tolist())) == [0, 1]  # stratified: both classes on each side
    grey = load_image_folder(tmp_path / "flat", colour=False)
    assert grey.input_shape == (1, 12, 10)
    _write_folder(tmp_path / "split" / "train", per_class=4)
    _write_folder(tmp_path / "split" / "test", per_class=2)
    given = load_image_folder(tmp_path / "split")
    assert len(given.train) == 8 and len(given.test) == 4


def test_image_folder_refusals(tmp_path) -> None:
    _write_folder(tmp_path / "one", classes=("only",))
    with pytest.raises(ValueError, match="at least 2"):
        load_image_folder(tmp_path / "one")
    _write_folder(tmp_path / "sizes", classes=("a",), size=(8, 8))
    _write_folder(tmp_path / "sizes", classes=("b",), size=(9, 9))
    with pytest.raises(ValueError, match="different sizes"):
        load_image_folder(tmp_path / "sizes")
    assert load_image_folder(tmp_path / "sizes", image_size=(8, 8)).input_shape == (3, 8, 8)
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "b").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "x.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        load_image_folder(tmp_path / "broken")


def test_cli_trains_on_an_image_folder(tmp_path) -> None:
    _write_folder(tmp_path / "imgs", per_class=40, size=(8, 8))
    out = tmp_path / "run"
    assert main(["train", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "imgs"), "--model", "cnn",
                 "--channels", "4", "--epochs", "2", "--batch-size", "16", "--delta", "1e-3", "--output-dir",
                 str(out), "--no-progress"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["dataset"] == "imagefolder" and result["epsilon"] <= 3.0 + 1e-9


def test_colour_recipe_runs_on_cifar_files(tmp_path) -> None:
    """configs/cifar10.yaml (colour map, scattering of each channel, linear head) trains on files in CIFAR-10's format,
    in every colour space, and stays within its epsilon."""
    from pathlib import Path

    pytest.importorskip("kymatio")
    recipe = Path(__file__).resolve().parents[2] / "configs" / "cifar10.yaml"
    _write_cifar(tmp_path / "cifar", per_batch=40)
    for space in ("yuv", "grayscale"):
        out = tmp_path / f"run-{space}"
        assert main(["train", "--config", str(recipe), "--data-dir", str(tmp_path / "cifar"), "--colour-space", space,
                     "--epochs", "1", "--batch-size", "16", "--delta", "1e-3", "--accountant", "rdp",
                     "--output-dir", str(out), "--no-progress"]) == 0
        result = json.loads((out / "result.json").read_text())
        assert result["dataset"] == f"cifar10+{space}+scattering" and result["epsilon"] <= 3.0 + 1e-9
        assert result["config"]["colour_space"] == space


def test_colour_space_conversions_keep_the_pixel_bound(tmp_path) -> None:
    """The CLI keeps the pixel bound sqrt(C H W) after a colour map: every coordinate of every space is in [-1, 1]."""
    from clipless.data.datasets import convert_colour_space

    corners = torch.tensor([[r, g, b] for r in (0.0, 1.0) for g in (0.0, 1.0) for b in (0.0, 1.0)])
    x = torch.cat([corners, torch.rand(2000, 3)]).reshape(-1, 3, 1, 1)
    for space in ("rgb", "hsv", "yuv", "grayscale"):
        assert float(convert_colour_space(x, space).abs().max()) <= 1.0


def test_colour_space_needs_rgb_images(tmp_path) -> None:
    with pytest.raises(SystemExit, match="needs RGB images"):
        main(["train", "--dataset", "digits", "--colour-space", "yuv", "--output-dir", str(tmp_path / "r"),
              "--no-progress"])
