"""Long end-to-end checks (``pytest -m slow``; CI's second stage)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mnist_benchmark_end_to_end(shared_data, tmp_path):
    out = tmp_path / "mnist.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mnist.py"), "--data-dir", str(shared_data / "mnist"),
                    "--epsilons", "1", "--out", str(out)], check=True, timeout=1200)
    row = json.loads(out.read_text())["rows"][0]
    assert row["epsilon"] <= 1.0
    # issue 18: >= 97.5% at epsilon 1 within 15 minutes on 2 cores (measured 97.89 +- 0.04 over 3 noise seeds)
    assert row["test_accuracy"] >= 0.975
    assert row["total_seconds"] < 15 * 60
