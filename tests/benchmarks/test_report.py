"""The benchmarks' shared writers (benchmarks/report.py) replace a result file at once: a run stopped while writing
leaves the earlier JSON, text or figure whole, and no temporary file."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("report", BENCHMARKS / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_write_that_fails_leaves_the_earlier_result_whole(report, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from clipless.train.checkpoint import CheckpointError

    out = tmp_path / "deep" / "result.json"
    report.write_json(out, {"rows": [1, 2]})
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    text, figure = tmp_path / "profile.txt", tmp_path / "plot.png"
    report.write_text(text, "first")
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    assert report.save_plot(fig, figure) == figure
    before = {p: p.read_bytes() for p in (out, text, figure)}

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        report.write_json(out, {"rows": list(range(10_000))})
    with pytest.raises(CheckpointError):
        report.write_text(text, "second " * 10_000)
    fig, ax = plt.subplots()
    ax.plot([1, 0])
    with pytest.raises(CheckpointError):
        report.save_plot(fig, figure)
    assert {p: p.read_bytes() for p in (out, text, figure)} == before
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["plot.png", "profile.txt", "result.json"]
