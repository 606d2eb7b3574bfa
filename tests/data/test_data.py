"""Dataset loaders and data-independent pre-processing."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import clipless as cl
from clipless.data.datasets import (ArrayDataset, DataSplit, check_held_out, clip_norm, normalize_to_sphere,
                                     read_idx, signed_log1p, signed_sqrt, write_idx)


def test_digits_embedded():
    data = cl.load_digits()
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert len(data.train) + len(data.test) == 1797
    assert float(data.train.features.max()) <= 1.0 and float(data.train.features.min()) >= 0.0


def test_mnist_from_directory(shared_data):
    data = cl.load_mnist(shared_data / "mnist")
    assert len(data.train) == 60000 and len(data.test) == 10000
    assert data.input_shape == (1, 28, 28)
    assert set(data.train.labels.unique().tolist()) == set(range(10))
    norms = data.train.features.flatten(1).norm(dim=1)
    assert float(norms.max()) <= 28.0  # pixels in [0, 1]


def test_mnist_missing_directory():
    with pytest.raises(FileNotFoundError):
        cl.load_mnist("/nonexistent/mnist")


def test_read_idx_roundtrip(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(bytes([0, 0, 0x08, 3]) + struct.pack(">III", 2, 3, 4) + arr.tobytes())
    assert np.array_equal(read_idx(path), arr)
    for name in ("y-idx3-ubyte.gz", "y-idx3-ubyte"):
        write_idx(tmp_path / name, arr)
        assert np.array_equal(read_idx(tmp_path / name), arr)
    with pytest.raises(ValueError, match="0-255"):
        write_idx(tmp_path / "z.gz", np.array([256]))
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as fh:
        fh.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match=r"declares shape \(10,\) \(10 values\) but the file holds 3: cut short"):
        read_idx(bad)
    garbage = tmp_path / "garbage.idx"  # a header of 153 dimensions read from random bytes: "expected 0 values"
    garbage.write_bytes(bytes([0, 0, 0x09, 153]) + bytes(range(256)) * 3)
    with pytest.raises(ValueError, match="declares 153 dimensions .* not an IDX file"):
        read_idx(garbage)
    cut = tmp_path / "cut.idx"
    cut.write_bytes(bytes([0, 0, 0x08, 3]) + struct.pack(">I", 10))  # a struct.error before
    with pytest.raises(ValueError, match="cut short"):
        read_idx(cut)


def test_idx_labels_must_be_whole_numbers(tmp_path):
    """Float IDX labels were truncated to integers (1.5 trained as class 1, NaN as whatever the cast gave)."""
    from clipless.data import load_idx_images

    for prefix in ("train", "t10k"):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", np.zeros((3, 4, 4)))
    for labels, ok in (([0, 1.5, 2], False), ([0, float("nan"), 2], False), ([0, 1, 2], True)):
        for prefix in ("train", "t10k"):
            (tmp_path / f"{prefix}-labels-idx1-ubyte").write_bytes(
                bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 3) + np.array(labels, dtype=">f4").tobytes())
        if ok:
            assert load_idx_images(tmp_path).train.labels.tolist() == labels
        else:
            with pytest.raises(ValueError, match="non-integer labels"):
                load_idx_images(tmp_path)


def test_tabular_npz_and_csv(shared_data, tmp_path):
    data = cl.load_tabular(shared_data / "adbench" / "47_yeast.npz")
    total = len(data.train) + len(data.test)
    assert abs(len(data.test) / total - 0.2) < 0.01
    assert data.num_classes == 2
    # stratified: same anomaly rate in both parts
    assert abs(float(data.train.labels.float().mean()) - float(data.test.labels.float().mean())) < 0.02
    csv = tmp_path / "t.csv"
    rows = "\n".join(f"{i},{i * 0.5},{i % 2}" for i in range(50))
    csv.write_text("a,b,label\n" + rows + "\n")
    d2 = cl.load_tabular(csv, label_column="label")
    assert d2.input_shape == (2,) and len(d2.train) == 40
    assert cl.load_tabular(csv, label_column=-1).input_shape == (2,)


@pytest.mark.parametrize("column, match", [("foo", "no column named 'foo'"), (3, r"index in \[-3, 3\)"),
                                           (-4, r"index in \[-3, 3\)"), (True, "got True")])
def test_tabular_label_column_refused_by_name(tmp_path, column, match):
    """A bad label column failed with "'foo' is not in list" or an IndexError; True read as column 1."""
    csv = tmp_path / "t.csv"
    csv.write_text("a,b,label\n" + "\n".join(f"{i},{i * 0.5},{i % 2}" for i in range(20)) + "\n")
    with pytest.raises(ValueError, match=match):
        cl.load_tabular(csv, label_column=column)


@pytest.mark.parametrize("name, write, match", [
    ("notzip.npz", lambda p: p.write_bytes(b"not a zip"), r"not a readable \.npz file"),  # numpy spoke of pickles
    ("objects.npz", lambda p: np.savez(p, X=np.array([[1, None]], dtype=object), y=np.array([0])),
     r"not a readable \.npz file"),
    ("text.npz", lambda p: np.savez(p, X=np.random.rand(20, 2), y=np.array(list("ab") * 10)),
     "labels of text.npz must be integers, got <U1"),  # "invalid literal for int()", naming no file
    ("empty.csv", lambda p: p.write_text(""), "empty.csv is empty"),
    ("ragged.csv", lambda p: p.write_text("a,b,label\n" + "1,2,0\n1,2\n" * 10),
     "ragged.csv is not a table of numbers with one row per record: .*Line #3"),
])
def test_a_malformed_tabular_file_is_refused_by_name(tmp_path, name, write, match):
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError, match=match):
        cl.load_tabular(path)


def test_tabular_nan_refused(tmp_path):
    path = tmp_path / "nan.npz"
    x = np.random.rand(20, 3)
    x[2, 1] = np.nan
    np.savez(path, X=x, y=np.arange(20) % 2)
    with pytest.raises(ValueError, match="NaN"):
        cl.load_tabular(path)


def test_preprocessing_is_per_example():
    x = torch.randn(5, 3, 2) * 10
    x[0] = 0
    clipped = clip_norm(x, 2.0)
    assert float(clipped.flatten(1).norm(dim=1).max()) <= 2.0 + 1e-6
    sphere = normalize_to_sphere(x, 3.0)
    norms = sphere.flatten(1).norm(dim=1)
    assert norms[0] == 0 and torch.allclose(norms[1:], torch.full((4,), 3.0))
    # one example's output does not depend on the others (no batch statistics)
    assert torch.equal(clip_norm(x[2:3], 2.0), clipped[2:3])


def test_tabular_feature_maps_are_fixed_and_per_feature():
    x = torch.tensor([[-4.0, 0.0, 0.25], [9.0, -0.01, 1.0]], dtype=torch.float64)
    assert signed_sqrt(x).tolist() == [[-2.0, 0.0, 0.5], [3.0, -0.1, 1.0]]
    assert torch.allclose(signed_log1p(x), torch.sign(x) * torch.log(1 + x.abs()))
    # a histogram (non-negative, summing to one) lands on the unit sphere under the Hellinger map
    hist = torch.distributions.Dirichlet(torch.full((27,), 0.3)).sample((50,)).double()
    assert torch.allclose(signed_sqrt(hist).norm(dim=1), torch.ones(50, dtype=torch.float64))


def test_dataset_name_errors():
    with pytest.raises(ValueError, match="--data-dir"):
        cl.load_dataset("mnist")
    with pytest.raises(ValueError, match="unknown dataset"):
        cl.load_dataset("cifar")


def test_colour_spaces_match_independent_formulas():
    import colorsys

    from clipless.data.datasets import convert_colour_space

    x = torch.rand(20, 3, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[0] = 0.5  # grey: hue and saturation 0
    x[1] = 0.0  # black
    hsv, yuv, grey = (convert_colour_space(x, s) for s in ("hsv", "yuv", "grayscale"))
    for n in range(20):
        for i in range(3):
            for j in range(2):
                r, g, b = x[n, :, i, j].tolist()
                assert hsv[n, :, i, j].tolist() == pytest.approx(colorsys.rgb_to_hsv(r, g, b), abs=1e-12)
                y = 0.299 * r + 0.587 * g + 0.114 * b
                expected = [y, 0.492111 * (b - y), 0.877283 * (r - y)]  # BT.601 U, V from their definitions
                assert yuv[n, :, i, j].tolist() == pytest.approx(expected, abs=1e-4)  # published 5-digit weights
                assert float(grey[n, 0, i, j]) == pytest.approx(y)
    assert torch.equal(convert_colour_space(x, "rgb"), x)
    assert grey.shape == (20, 1, 3, 2)


def test_colour_space_errors():
    from clipless.data.datasets import convert_colour_space

    with pytest.raises(ValueError, match="3 channels"):
        convert_colour_space(torch.rand(4, 1, 8, 8), "hsv")
    with pytest.raises(ValueError, match="unknown colour space"):
        convert_colour_space(torch.rand(4, 3, 8, 8), "lab")
    bad = torch.rand(4, 3, 8, 8)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        convert_colour_space(bad, "yuv")


def test_input_norms_and_histogram_figure(tmp_path):
    from clipless.data.datasets import input_norms
    from clipless.diagnostics.plots import plot_norm_histograms

    x = torch.rand(50, 3, 4, 4)
    norms = input_norms(x)
    assert torch.allclose(norms, x.flatten(1).double().norm(dim=1))
    path = plot_norm_histograms({"rgb": norms}, tmp_path / "h.png", clip=2.0)
    assert path.stat().st_size > 1000


def test_any_idx_image_dataset(tmp_path):
    """Fashion-MNIST-style drop-ins load as mnist; other sizes, more classes, prefixed names (EMNIST) as idx."""
    from clipless.data import load_idx_images

    rng = np.random.default_rng(0)
    d = tmp_path / "emnist"
    d.mkdir()
    for prefix, n in (("train", 30), ("test", 27)):  # the held-out labels show every class (they set the count)
        write_idx(d / f"emnist-letters-{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 20, 24)))
        write_idx(d / f"emnist-letters-{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 27)
    data = cl.load_dataset("idx", d)
    assert data.name == "idx" and data.input_shape == (1, 20, 24) and data.num_classes == 27
    assert float(data.train.features.max()) <= 1.0 and len(data.test) == 27
    with pytest.raises(ValueError, match=r"not 28 x 28"):
        cl.load_mnist(d)
    with pytest.raises(ValueError, match=r"labels outside 0-9 \(e.g. 26\)"):
        load_idx_images(d, "mnist", num_classes=10)
    write_idx(d / "other-train-images-idx3-ubyte.gz", rng.integers(0, 256, (3, 20, 24)))
    with pytest.raises(ValueError, match="several"):
        cl.load_dataset("idx", d)


def test_held_out_data_stored_in_the_training_tensors_memory_is_refused():
    """Held-out data made as a view of the training tensors (``ArrayDataset(X[:300], y[:300])`` beside a training
    set of all of ``X``) passed: neither a ``Subset`` nor the same records in the same order.  Its score was
    computed from training records and released without noise.  Views that share memory are now refused, for
    the trainer's test data and the pre-trainer's held-out pairs; disjoint views of one tensor still pass."""
    from clipless.contrastive import AugmentedPairs, GivenPairs

    data = cl.load_digits()
    X, y = data.train.features, data.train.labels
    check_held_out(cl.ArrayDataset(X[:1000], y[:1000]), cl.ArrayDataset(X[1000:], y[1000:]))  # disjoint
    check_held_out(data.train, cl.ArrayDataset(X[:300].clone(), y[:300].clone()))  # stored apart: its own
    check_held_out(AugmentedPairs(X[:1000], 1, False), AugmentedPairs(X[1000:], 1, False))
    for train, held_out in [
        (data.train, cl.ArrayDataset(X[:300], y[:300])),
        (data.train, cl.ArrayDataset(X[700:], y[700:])),
        (cl.ArrayDataset(X[:1000], y[:1000]), cl.ArrayDataset(X[999:], y[999:])),  # one shared row
        (AugmentedPairs(X, 1, False), AugmentedPairs(X[:300], 1, False)),
        (GivenPairs(X, X.flip(-1)), GivenPairs(X[5:10], X[5:10].flip(-1))),
    ]:
        with pytest.raises(ValueError, match="stored in the same memory as the training data"):
            check_held_out(train, held_out)


def test_held_out_data_that_shares_training_records_refused():
    """A score on held-out data is released without noise: data that is, copies or overlaps the training records
    (through Subset views of one dataset) is refused; disjoint splits and the real test split pass."""
    from torch.utils.data import ConcatDataset, Subset, random_split

    data = cl.load_digits()
    fit, validation = random_split(data.train, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
    check_held_out(fit, validation)
    check_held_out(data.train, data.test)
    check_held_out(Subset(data.train, [0, 1]), Subset(Subset(data.train, [5, 6, 7]), [1]))
    check_held_out(ConcatDataset([fit, data.test]), ConcatDataset([validation]))
    copy = cl.ArrayDataset(data.train.features.clone(), data.train.labels.clone())
    for train, held_out, match in [
        (data.train, data.train, "is the training data"),
        (data.train, copy, "same records"),
        (fit, Subset(data.train, [fit.indices[3], validation.indices[0]]), "shares 1 records"),
        (Subset(data.train, [0, 1, 2]), Subset(Subset(data.train, [9, 2]), [1]), "shares 1 records"),
        (data.train, validation, "shares 287 records"),
        # the training data as one part of a ConcatDataset, on either side (not looked into before)
        (data.train, ConcatDataset([data.test, data.train]), "is the training data"),
        (ConcatDataset([data.train, data.test]), Subset(data.train, [4]), "shares 1 records"),
        (data.train, ConcatDataset([data.test, ConcatDataset([validation, data.test])]), "shares 287 records"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_held_out(train, held_out)


def _idx_dir(directory, train_labels, test_labels, seed=0):
    directory.mkdir()
    rng = np.random.default_rng(seed)
    for prefix, labels in (("train", train_labels), ("t10k", test_labels)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (len(labels), 4, 4)).astype(np.uint8))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte", np.asarray(labels, dtype=np.uint8))
    return directory


def test_the_number_of_classes_never_comes_from_the_training_labels(tmp_path):
    """The released model's output width (and a hinge or KR loss's constant) depends on the number of classes: read
    from the training labels, a class that one training record alone holds would show whether it was trained on
    (the model of D has one more output than that of D without it).  It is declared, or read from the held-out
    labels, and a training label outside it is refused."""
    held_out = [0, 1, 2, 0, 1, 2]
    with_it = _idx_dir(tmp_path / "with", [0, 1, 2, 0, 1, 2, 3], held_out)  # label 3: one training record
    without = _idx_dir(tmp_path / "without", [0, 1, 2, 0, 1, 2], held_out)
    assert cl.load_dataset("idx", without).num_classes == 3
    with pytest.raises(ValueError, match=r"training labels lie outside 0-2 .*declare num_classes"):
        cl.load_dataset("idx", with_it)
    # declared: the same count with and without the record
    assert {cl.load_dataset("idx", d, num_classes=4).num_classes for d in (with_it, without)} == {4}
    with pytest.raises(ValueError, match=r"labels outside 0-2 \(e.g. 3\): .* not of the declared num_classes"):
        cl.load_dataset("idx", with_it, num_classes=3)
    with pytest.raises(ValueError, match=r"digits has 10 classes .* not the 12 declared"):
        cl.load_dataset("digits", num_classes=12)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        cl.load_dataset("idx", without, num_classes=True)
    # the split type itself, and splits derived from a declared one
    x = torch.zeros(4, 2)
    part = lambda labels: ArrayDataset(x[: len(labels)], torch.tensor(labels))  # noqa: E731
    assert DataSplit(part([0, 5]), part([0, 1]), "s", num_classes=6).num_classes == 6
    with pytest.raises(ValueError, match="training labels lie outside 0-1"):
        DataSplit(part([0, 5]), part([0, 1]), "s")
    with pytest.raises(ValueError, match=r"held-out labels lie outside 0-5 \(num_classes = 6, declared\)"):
        DataSplit(part([0, 1]), part([0, 6]), "s", num_classes=6)
    with pytest.raises(ValueError, match="labels are torch.float32"):
        DataSplit(ArrayDataset(x[:2], torch.tensor([0.0, 1.0])), part([0, 1]), "s")
    digits = cl.load_digits()
    assert digits.num_classes == 10
    assert cl.data.datasets.convert_split_colour_space(digits, "rgb").num_classes == 10
    assert not hasattr(digits.train, "num_classes")  # no per-part count that reads the training labels


def test_tabular_classes_are_those_of_the_held_out_part(tmp_path):
    """A tabular file's labels are renumbered by the classes of the held-out part of the split; a label that only
    training records hold is refused (its count would come from them)."""
    rng = np.random.default_rng(0)
    y = np.array([7] * 20 + [3] * 20 + [9] * 2)
    path = tmp_path / "t.npz"
    np.savez(path, X=rng.normal(size=(len(y), 3)), y=y)
    data = cl.load_tabular(path, test_fraction=0.5)
    assert data.num_classes == 3 and sorted(set(data.test.labels.tolist())) == [0, 1, 2]
    with pytest.raises(ValueError, match="label 9 of t.npz has no record in the held-out part"):
        cl.load_tabular(path, test_fraction=0.1)  # 10% of 2 records of class 9: none held out


@settings(max_examples=60, deadline=None)
@given(train=st.lists(st.integers(0, 9), min_size=1, max_size=30), test=st.lists(st.integers(0, 9), min_size=1,
       max_size=10), removed=st.integers(0, 29), declared=st.one_of(st.none(), st.integers(2, 12)))
def test_the_number_of_classes_is_the_same_for_neighbouring_training_sets(train, test, removed, declared):
    """Whatever the labels: adding or removing one training record never changes ``num_classes`` (it may only turn
    a refusal into a split or back: a label outside the classes is refused, not counted)."""
    def split(labels):
        part = lambda ys: ArrayDataset(torch.zeros(len(ys), 2), torch.tensor(ys, dtype=torch.long))  # noqa: E731
        try:
            return DataSplit(part(labels), part(test), "s", num_classes=declared).num_classes
        except ValueError:
            return None
    full, neighbour = split(train), split(train[:removed] + train[removed + 1:])
    expected = declared if declared is not None else max(test) + 1
    assert {full, neighbour} - {None} <= {expected}
