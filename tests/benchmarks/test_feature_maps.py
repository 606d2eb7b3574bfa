"""The tabular benchmark's fixed feature maps read no record: each row's features depend on that row alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def tabular():
    sys.path.insert(0, str(BENCHMARKS))  # tabular.py imports report.py beside it
    try:
        spec = importlib.util.spec_from_file_location("tabular_benchmark", BENCHMARKS / "tabular.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.mark.parametrize("name", ["log1p", "sqrt", "rff"])
def test_a_rows_features_do_not_depend_on_the_other_rows(tabular, name):
    """A map fitted on the data (a scaler, a sampler whose weights depend on the rows) would carry statistics of the
    training records into every example's features, outside the privacy analysis."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 7, generator=gen) * 3
    other = torch.cat([x[:1], 100 * torch.randn(39, 7, generator=gen)])  # the first row among other records
    feature_map = tabular.FEATURE_MAPS[name]
    torch.testing.assert_close(feature_map(x)[:1], feature_map(other)[:1], rtol=0, atol=0)
    assert torch.equal(feature_map(x), feature_map(x))  # a public seed: the same map at every call
    if name == "rff":
        assert feature_map(x).shape == (40, 1024)
        assert float(feature_map(x).norm(dim=1).max()) <= 2 ** 0.5 + 1e-6
