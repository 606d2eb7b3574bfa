"""Export for deployment (issue 18, item 8): standard torch layers computing the trained model's function."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import clipless as cl
from clipless.cli import main
from clipless.train.checkpoint import load_checkpoint


def _trained_like(model):
    """Weights moved off their initialization and projected again, as after training."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for m in model.modules():
        if hasattr(m, "project_"):
            m.project_()
    return model


@pytest.mark.parametrize("build, shape, atol", [
    (lambda: cl.lipschitz_mlp((1, 8, 8), 10, hidden=(32, 16)), (1, 8, 8), 1e-5),
    (lambda: cl.lipschitz_mlp((12,), 3, hidden=(8,), activation="groupsort2").append(cl.LossGradientClip(0.5)),
     (12,), 1e-5),
    (lambda: cl.lipschitz_cnn((1, 16, 16), 10, channels=(4, 8)), (1, 16, 16), 1e-4),  # LPPool: sqrt(eps) per output
    (lambda: cl.lipschitz_vgg((3, 8, 8), 5, channels=(4, 8)), (3, 8, 8), 1e-4),
])
def test_exported_model_has_only_standard_layers_and_the_same_outputs(build, shape, atol, tmp_path) -> None:
    torch.manual_seed(0)
    model = _trained_like(build())
    exported = cl.export(model, shape)
    assert all(type(m).__module__.startswith("torch.nn.modules") for m in exported.modules())
    x = torch.rand(32, *shape)
    with torch.no_grad():
        assert torch.allclose(exported(x), model(x), atol=atol, rtol=0)
    path = tmp_path / "model.pt2"
    batch = torch.export.Dim("batch", min=1)
    torch.export.save(torch.export.export(exported, (x[:2],), dynamic_shapes=({0: batch},)), str(path))
    # loadable where clipless cannot even be imported
    code = (f"import sys; sys.modules['clipless'] = None; import torch; "
            f"m = torch.export.load({str(path)!r}).module(); print(m(torch.zeros(3, *{tuple(shape)!r})).shape[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == exported(torch.zeros(1, *shape)).shape[1]


@settings(max_examples=30, deadline=None)
@given(pairs=st.integers(1, 8), seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3), conv=st.booleans())
def test_exported_pair_sort_equals_max_min(pairs, seed, scale, conv) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (2 * pairs, 3, 3) if conv else (2 * pairs,)
    x = scale * torch.randn(5, *shape, generator=g)
    x[0] = x[0].round()  # ties
    for layer in (cl.MaxMin(), cl.GroupSort(2)):
        exported = cl.export(torch.nn.Sequential(layer), shape)
        assert torch.allclose(exported(x), layer(x), rtol=1e-6, atol=1e-6 * scale)


def test_layers_without_a_standard_equivalent_are_refused_with_the_fix() -> None:
    clip = cl.lipschitz_cnn((1, 8, 8), 3, channels=(4,), input_clip=8.0)
    with pytest.raises(ValueError, match="inputs_within_bound=True"):
        cl.export(clip, (1, 8, 8))
    x = torch.rand(4, 1, 8, 8) / 8  # norm <= 1 < 8: the clip is the identity there
    with torch.no_grad():
        assert torch.allclose(cl.export(clip, (1, 8, 8), inputs_within_bound=True)(x), clip(x), atol=1e-4)
    with pytest.raises(ValueError, match="groups of 4"):
        cl.export(torch.nn.Sequential(cl.GroupSort(4)), (8,))
    with pytest.raises(ValueError, match="not sequential|cannot be exported"):
        cl.export(cl.lipschitz_resnet((1, 8, 8), 3, channels=(4,)), (1, 8, 8))


def test_cli_export_of_a_trained_run(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--batch-size", "256", "--hidden", "16", "--no-progress", "--accountant",
                 "rdp", "--features", "none", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert main(["export", "--output-dir", str(out)]) == 0
    # the export is a release: it states the run's epsilon and whether its randomness was secret
    epsilon = json.loads((out / "result.json").read_text())["epsilon"]
    printed = capsys.readouterr().out
    assert f"epsilon {epsilon:.3f} (delta 1e-05, rdp)" in printed and "private (noise and batches from OS" in printed
    model = torch.export.load(str(out / "model.pt2")).module()
    data = cl.load_digits()
    x = torch.stack([data.test[i][0] for i in range(len(data.test))])
    y = torch.tensor([int(data.test[i][1]) for i in range(len(data.test))])
    accuracy = float((model(x).argmax(1) == y).float().mean())
    assert accuracy == pytest.approx(json.loads((out / "result.json").read_text())["test_accuracy"], abs=1e-6)
    # the default run (scattering features into a linear head): the export takes the features, and agrees
    default = tmp_path / "default"
    assert main(["train", "--epochs", "1", "--no-progress", "--accountant", "rdp", "--noise-seed", "3",
                 "--output-dir", str(default)]) == 0
    capsys.readouterr()
    assert main(["export", "--output-dir", str(default)]) == 0
    assert "NOT PRIVATE: noise and sampling come from a fixed seed" in capsys.readouterr().out  # said nothing before
    with pytest.raises(SystemExit, match="cannot read checkpoint|checkpoint"):
        main(["export", "--output-dir", str(tmp_path / "missing")])
    # --out into a directory that does not exist yet creates it; --out naming a directory is refused
    nested = tmp_path / "new" / "deeper" / "m.pt2"
    assert main(["export", "--output-dir", str(out), "--out", str(nested)]) == 0
    assert torch.export.load(str(nested)).module()(x[:3]).shape == (3, 10)
    with pytest.raises(SystemExit, match="is a directory"):
        main(["export", "--output-dir", str(out), "--out", str(tmp_path)])
    # an earlier export is replaced; any other file (the run's own checkpoint, by a slip) is left whole
    assert main(["export", "--output-dir", str(out), "--out", str(nested)]) == 0
    for other in (out / "checkpoint.pt", out / "result.json"):
        before = other.read_bytes()
        with pytest.raises(SystemExit, match="exists and is not an earlier export"):
            main(["export", "--output-dir", str(out), "--out", str(other)])
        assert other.read_bytes() == before


def test_cli_run_with_iterate_averaging_reports_and_exports_the_average(tmp_path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--epochs", "2", "--batch-size", "256", "--hidden", "16", "--no-progress", "--accountant",
                 "rdp", "--features", "none", "--average-decay", "0.5", "--output-dir", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["average_decay"] == 0.5
    state = load_checkpoint(out / "checkpoint.pt")
    average, last = state["averaged_model"], state["model"]
    assert average is not None and any(not torch.equal(average[k], last[k]) for k in last if k in average)
    assert main(["export", "--output-dir", str(out)]) == 0
    model = torch.export.load(str(out / "model.pt2")).module()
    data = cl.load_digits()
    x = torch.stack([data.test[i][0] for i in range(len(data.test))])
    y = torch.tensor([int(data.test[i][1]) for i in range(len(data.test))])
    # the reported accuracy is the average's, and the export ships the average
    assert float((model(x).argmax(1) == y).float().mean()) == pytest.approx(result["test_accuracy"], abs=1e-6)
