"""Datasets (embedded digits, MNIST IDX files, tabular .npz/.csv) and data-independent pre-processing.

Loaders read from a directory the caller names; nothing is downloaded.
Pre-processing here never looks at statistics of the data (spec §2: an input
bound computed from the training data is a privacy leak).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from ..privacy.certified import is_whole, whole_number

__all__ = [
    "ArrayDataset",
    "tensors_fingerprint",
    "check_held_out",
    "DataSplit",
    "load_digits",
    "load_mnist",
    "load_cifar10",
    "load_image_folder",
    "load_tabular",
    "load_dataset",
    "clip_norm",
    "normalize_to_sphere",
    "signed_log1p",
    "signed_sqrt",
    "COLOUR_SPACES",
    "convert_colour_space",
    "convert_split_colour_space",
    "input_norms",
    "check_finite",
    "read_idx",
    "write_idx",
    "load_idx_images",
]


def tensors_fingerprint(*tensors: torch.Tensor) -> str:
    """BLAKE2b of the tensors' dtypes, shapes and bytes, in order."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _base_records(data: Dataset) -> Tuple[Dataset, Optional[set]]:
    """The dataset under nested ``Subset`` views and the indices of it they select (``None``: all)."""
    indices: Optional[List[int]] = None
    while isinstance(data, Subset):
        chosen = [int(i) for i in data.indices]
        indices = chosen if indices is None else [chosen[i] for i in indices]
        data = data.dataset
    return data, None if indices is None else set(indices)


def check_held_out(train: Dataset, held_out: Optional[Dataset], what: str = "test_data") -> None:
    """Refuse held-out data that is the training data, or shares records with it through ``Subset`` views of one
    dataset: a score on it would be computed from training records without noise and published as a test score.

    Records equal in value but stored apart (a duplicate image in a real test split) are the held-out set's own.
    A ``DataLoader`` stands for its dataset.
    """
    if held_out is None:
        return
    train, held_out = (d.dataset if isinstance(d, DataLoader) else d for d in (train, held_out))
    if held_out is train:
        raise ValueError(f"{what} is the training data: its score would be released without noise; pass a "
                         "held-out split")
    for concat, other, training in ((held_out, train, False), (train, held_out, True)):
        if isinstance(concat, ConcatDataset):  # each part on its own (the training data as one part of it, say)
            for part in concat.datasets:
                check_held_out(part if training else other, other if training else part, what)
            return
    fingerprints = [getattr(d, "fingerprint", None) for d in (train, held_out)]
    if (all(callable(f) for f in fingerprints) and len(train) == len(held_out)  # type: ignore[arg-type]
            and fingerprints[0]() == fingerprints[1]()):  # type: ignore[misc]
        raise ValueError(f"{what} holds the same records as the training data, in the same order: pass a held-out "
                         "split")
    (base_a, rows_a), (base_b, rows_b) = _base_records(train), _base_records(held_out)
    if base_a is base_b:
        shared = len(rows_a & rows_b) if rows_a is not None and rows_b is not None else len(rows_a or rows_b or ())
        if shared or (rows_a is None and rows_b is None):
            raise ValueError(f"{what} shares {shared or 'all its'} records with the training data (Subset views "
                             "of one dataset): a score on them is not private; split the indices disjointly")
    elif rows_a is None and rows_b is None and _share_memory(base_a, base_b):
        raise ValueError(f"{what} holds records stored in the same memory as the training data's (a slice or view "
                         "of the training tensors, such as X[:300]): a score on them is not private; split the rows "
                         "disjointly (X[:n] to train, X[n:] held out)")


def _share_memory(a: Dataset, b: Dataset) -> bool:
    """Whether two datasets' record tensors (``record_tensors()``) overlap in memory: views of one tensor whose
    byte ranges intersect.  Only contiguous views are compared, where an intersecting range means shared
    elements (``X[:n]`` and ``X[n:]`` share a storage, not an element)."""
    def ranges(data: Dataset) -> List[Tuple[int, int, int]]:
        tensors = getattr(data, "record_tensors", lambda: ())()
        return [(t.untyped_storage().data_ptr(), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                for t in tensors if t.numel() and t.is_contiguous()]

    return any(sa == sb and start_a < end_b and start_b < end_a
               for sa, start_a, end_a in ranges(a) for sb, start_b, end_b in ranges(b))


class ArrayDataset(Dataset):
    """In-memory ``(features, labels)`` dataset; batches are gathered in one indexing op."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        if features.shape[0] != labels.shape[0]:
            raise ValueError(f"{features.shape[0]} feature rows but {labels.shape[0]} labels")
        check_finite(features, "features")
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]

    def fingerprint(self) -> str:
        """A digest of the records (features, labels, order): a resume on other data or another split is refused."""
        return tensors_fingerprint(self.features, self.labels)

    def record_tensors(self) -> Tuple[torch.Tensor, ...]:
        """The tensors that hold the records (held-out data stored in the same memory is refused)."""
        return (self.features,)

    def in_memory_records(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every record, as the loader yields them: what ``make_private`` checks before any step."""
        return self.features, self.labels

    def gather(self, indices: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """A whole batch in one indexing operation (used by the Poisson loader)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.features[idx], self.labels[idx]

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.features.shape[1:])


@dataclass
class DataSplit:
    """A train/test pair.  ``coordinate_bound``: every input coordinate lies in ``[-b, b]`` by the loader's own
    construction (images: pixels in [0, 1]), so ``b sqrt(dim)`` is a data-independent input bound; ``None``
    (tabular files) when nothing bounds the data.

    ``num_classes`` is the label set's size, which the released model's output width and some losses' constants
    depend on: declared by the loader (the dataset's definition, the class folders) or, where ``None``, read from
    the held-out ``test`` part, never from the records trained on (a class that only one training record holds
    would show in the model whether that record was there).  Every label of both parts must lie in
    ``0 .. num_classes - 1``: checked here.
    """

    train: ArrayDataset
    test: ArrayDataset
    name: str
    coordinate_bound: Optional[float] = None
    num_classes: Optional[int] = None

    def __post_init__(self) -> None:
        declared = self.num_classes
        if declared is None:
            if len(self.test) == 0:
                raise ValueError(f"{self.name}: no held-out record to read the number of classes from; declare "
                                 "num_classes (the training labels cannot decide it privately)")
            declared = int(self.test.labels.max()) + 1
        declared = whole_number(declared, f"{self.name}: num_classes", 2)
        for part, ds in (("training", self.train), ("held-out", self.test)):
            labels = ds.labels
            if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
                raise ValueError(f"{self.name}: the {part} labels are {labels.dtype}; class labels are integers")
            if not labels.numel():
                continue
            if int(labels.min()) < 0:
                raise ValueError(f"{self.name}: {part} labels must be class indices from 0, got {int(labels.min())}")
            if int(labels.max()) >= declared:
                why = ("declared" if self.num_classes is not None else "read from the held-out labels: declare "
                       "num_classes (--num-classes) for a label set they do not show whole; it is never read from "
                       "the training labels, which would make the model's output width depend on the records "
                       "trained on")
                raise ValueError(f"{self.name}: {part} labels lie outside 0-{declared - 1} (num_classes = {declared}, "
                                 f"{why})")
        self.num_classes = int(declared)

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return self.train.input_shape


def check_finite(x: Union[torch.Tensor, np.ndarray], what: str = "data") -> None:
    """Raise if ``x`` holds NaN or infinite values (they would void every bound)."""
    t = torch.as_tensor(x)
    if t.is_floating_point() and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{what} contains {bad} NaN or infinite values; clean the data before private training")


def clip_norm(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every example (row) to norm ``<= max_norm``."""
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1).clamp_min(1e-12)
    factor = torch.clamp(max_norm / norms, max=1.0)
    return x * factor.reshape((-1,) + (1,) * (x.dim() - 1))


def normalize_to_sphere(x: torch.Tensor, radius: float = 1.0) -> torch.Tensor:
    """Scale every non-zero example to norm exactly ``radius`` (zero rows stay zero)."""
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1)
    factor = torch.where(norms > 0, radius / norms.clamp_min(1e-12), torch.zeros_like(norms))
    return x * factor.reshape((-1,) + (1,) * (x.dim() - 1))


def signed_log1p(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) log(1 + |x|)`` per feature: a fixed, data-independent squashing of heavy-tailed tabular features."""
    return torch.sign(x) * torch.log1p(x.abs())


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) sqrt(|x|)`` per feature (fixed, data-independent): the Hellinger map of histogram features.

    A row of proportions summing to one lands on the unit sphere, and small bins are spread out.
    """
    return torch.sign(x) * x.abs().sqrt()


COLOUR_SPACES = ("rgb", "hsv", "yuv", "grayscale")

# ITU-R BT.601 luma and chroma weights (YUV), the usual analogue definition.
_YUV = torch.tensor([[0.299, 0.587, 0.114], [-0.14713, -0.28886, 0.436], [0.615, -0.51499, -0.10001]])


def convert_colour_space(x: torch.Tensor, space: str) -> torch.Tensor:
    """Map RGB values in ``[0, 1]`` (channels on axis 1: ``(N, 3, ...)``) to ``space``, example by example.

    A fixed per-pixel map, so it is data-independent pre-processing (spec §3.3).
    It changes the distribution of input norms, hence how much an input-norm clip
    discards and how large the first layer's gradient bound is.  ``hsv`` has all
    three channels in ``[0, 1]`` (hue as a fraction of the turn); ``yuv`` is BT.601;
    ``grayscale`` keeps one channel (the luma ``Y``).
    """
    if space not in COLOUR_SPACES:
        raise ValueError(f"unknown colour space {space!r}; choose from {COLOUR_SPACES}")
    if x.dim() < 2 or x.shape[1] != 3:
        raise ValueError(f"expected RGB inputs with 3 channels on axis 1, got shape {tuple(x.shape)}")
    check_finite(x, "images")
    if space == "rgb":
        return x
    if space in ("yuv", "grayscale"):
        weights = _YUV.to(x) if space == "yuv" else _YUV[:1].to(x)
        return torch.einsum("oc,nc...->no...", weights, x).contiguous()
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    maxc, minc = x.max(dim=1).values, x.min(dim=1).values
    delta = maxc - minc
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    hue = torch.where(maxc == r, torch.remainder((g - b) / safe, 6.0),
                      torch.where(maxc == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    hue = torch.where(delta > 0, hue / 6.0, torch.zeros_like(hue))
    sat = torch.where(maxc > 0, delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc)), torch.zeros_like(maxc))
    return torch.stack((hue, sat, maxc), dim=1)


def convert_split_colour_space(split: "DataSplit", space: str) -> "DataSplit":
    """Both sides of ``split`` through :func:`convert_colour_space` (the same fixed map on every image)."""
    if space == "rgb":
        return split
    convert = lambda ds: ArrayDataset(convert_colour_space(ds.features, space), ds.labels)  # noqa: E731
    # HSV lies in [0, 1], YUV in [-0.615, 1]: the coordinate bound stays
    return dataclasses.replace(split, train=convert(split.train), test=convert(split.test),
                               name=f"{split.name}+{space}")


def input_norms(x: torch.Tensor) -> torch.Tensor:
    """Per-example L2 norms (what an input-norm clip compares with its radius)."""
    return torch.linalg.vector_norm(x.flatten(1).to(torch.float64), dim=1)


def _split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, stratify: bool = True
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    return train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y if stratify else None)


def _to_dataset(x: np.ndarray, y: np.ndarray, shape: Optional[Sequence[int]] = None) -> ArrayDataset:
    features = torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32)
    if shape is not None:
        features = features.reshape((-1,) + tuple(shape))
    return ArrayDataset(features, torch.as_tensor(np.asarray(y), dtype=torch.long))


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DataSplit:
    """scikit-learn's embedded 8x8 digits (1,797 images), pixels scaled to [0, 1], shape (1, 8, 8)."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = bunch.data.astype(np.float32) / 16.0
    xtr, xte, ytr, yte = _split(x, bunch.target, test_fraction, seed)
    return DataSplit(_to_dataset(xtr, ytr, (1, 8, 8)), _to_dataset(xte, yte, (1, 8, 8)), "digits", 1.0,
                     num_classes=10)


def write_idx(path: Union[str, Path], array: np.ndarray) -> None:
    """Write ``array`` as an unsigned-byte IDX file (gzip-compressed if ``path`` ends in ``.gz``): what
    :func:`read_idx` reads back, e.g. to run the IDX loaders on data of one's own."""
    data = np.asarray(array)
    if data.size and (data.min() < 0 or data.max() > 255):
        raise ValueError(f"IDX bytes hold 0-255, got values in [{data.min()}, {data.max()}]")
    header = bytes([0, 0, 0x08, data.ndim]) + struct.pack(">" + "I" * data.ndim, *data.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:  # type: ignore[operator]
        fh.write(header + data.astype(np.uint8).tobytes())


def read_idx(path: Union[str, Path]) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed), as used by MNIST."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:  # type: ignore[operator]
            raw = fh.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise ValueError(f"{path} is damaged ({err}); download it again") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file")
    dtype_code, ndim = raw[2], raw[3]
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if dtype_code not in dtypes:
        raise ValueError(f"{path}: unknown IDX type code {dtype_code:#x}")
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path} is cut short: its header declares {ndim} dimensions, the file ends first")
    dims = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtypes[dtype_code], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        declared = f"shape {tuple(dims)}" if ndim <= 4 else f"{ndim} dimensions"
        raise ValueError(f"{path}: its IDX header declares {declared} ({int(np.prod(dims))} values) but the file "
                         f"holds {data.size}: cut short, damaged, or not an IDX file; download it again")
    return data.reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    """``stem``, ``stem.gz`` or ``stem`` with ``.idx`` for ``-idx``; else the one file named ``*-stem[.gz]`` (the
    prefixed names of EMNIST-style releases, e.g. ``emnist-letters-train-images-idx3-ubyte.gz``)."""
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx") + ".gz"):
        if (directory / name).exists():
            return directory / name
    prefixed = sorted({*directory.glob(f"*-{stem}"), *directory.glob(f"*-{stem}.gz")})
    if len(prefixed) == 1:
        return prefixed[0]
    if prefixed:
        raise ValueError(f"{directory} holds several *-{stem} files ({', '.join(p.name for p in prefixed)}): keep one "
                         "dataset per directory")
    raise FileNotFoundError(f"no {stem}[.gz] in {directory}")


def load_idx_images(data_dir: Union[str, Path], name: str = "idx", image_shape: Optional[Tuple[int, int]] = None,
                    num_classes: Optional[int] = None) -> DataSplit:
    """Any grayscale image dataset in MNIST's IDX layout: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (``.gz`` or not; a common prefix such as
    ``emnist-letters-`` is allowed; ``test-`` for ``t10k-``).  Pixels in [0, 1], shape (1, H, W), labels integers
    from 0; ``image_shape``, when given, is checked.  ``num_classes``: the labels are ``0 .. num_classes - 1``;
    ``None`` reads it from the test labels, never from the training ones (:class:`DataSplit`)."""
    d = Path(data_dir)
    if not d.exists():
        raise FileNotFoundError(f"{name} directory {d} does not exist")
    if not d.is_dir():
        raise NotADirectoryError(f"{d} is a file; give the directory that holds the four IDX files (train and t10k "
                                 "images and labels)")
    parts = []
    for prefix in ("train", "t10k"):
        try:
            image_file = _find(d, f"{prefix}-images-idx3-ubyte")
            label_file = _find(d, f"{prefix}-labels-idx1-ubyte")
        except FileNotFoundError:
            if prefix != "t10k":
                raise
            image_file, label_file = _find(d, "test-images-idx3-ubyte"), _find(d, "test-labels-idx1-ubyte")
        images, labels = read_idx(image_file), read_idx(label_file)
        if images.ndim != 3 or (image_shape is not None and images.shape[1:] != tuple(image_shape)):
            want = f"{image_shape[0]} x {image_shape[1]}" if image_shape is not None else "N x H x W"
            raise ValueError(f"{image_file} holds images of shape {images.shape[1:]}, not {want}")
        if parts and images.shape[1:] != tuple(parts[0].input_shape[1:]):
            raise ValueError(f"{image_file} holds {images.shape[1:]} images, the training file "
                             f"{tuple(parts[0].input_shape[1:])}")
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError(f"{label_file} holds {labels.shape} labels for {images.shape[0]} images in {image_file}")
        if labels.dtype.kind == "f" and not np.array_equal(labels, np.round(labels)):
            raise ValueError(f"{label_file} holds non-integer labels (e.g. {labels[labels != np.round(labels)][0]}): "
                             "class labels are whole numbers")
        if labels.size and (labels.min() < 0 or (num_classes is not None and labels.max() >= num_classes)):
            bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
            allowed = f"0-{num_classes - 1}" if num_classes is not None else "0 and above"
            raise ValueError(f"{label_file} holds labels outside {allowed} (e.g. {bad}): the file is damaged or not "
                             + ("of the declared num_classes" if name == "idx" else f"{name}'s"))
        if images.dtype != np.uint8:  # the [0, 1] scale (and so the pixel input bound) assumes bytes
            raise ValueError(f"{image_file} holds {images.dtype} pixels; grayscale IDX images are unsigned bytes")
        parts.append(_to_dataset(images.astype(np.float32) / 255.0, labels.astype(np.int64), (1,) + images.shape[1:]))
    return DataSplit(parts[0], parts[1], name, 1.0, num_classes=num_classes)


def load_mnist(data_dir: Union[str, Path]) -> DataSplit:
    """MNIST (or any drop-in: Fashion-MNIST, KMNIST) from its four IDX files: 28 x 28, labels 0-9."""
    return load_idx_images(data_dir, "mnist", image_shape=(28, 28), num_classes=10)


class _ArrayUnpickler:
    """Unpickles CIFAR-10's "python version" batches allowing only what they hold (dicts, lists, bytes, numpy
    arrays): a pickle may otherwise run any code, and data directories come from outside."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("builtins", "bytes"), ("_codecs", "encode")}

    @classmethod
    def load(cls, path: Path) -> object:
        import pickle

        class Restricted(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> object:
                if (module, name) not in cls.ALLOWED:
                    raise ValueError(f"{path} asks to load {module}.{name}: not a CIFAR-10 batch (refused, a pickle "
                                     "can run code)")
                return super().find_class(module, name)

        with open(path, "rb") as fh:
            try:
                return Restricted(fh, encoding="bytes").load()
            except (pickle.UnpicklingError, EOFError) as err:
                raise ValueError(f"{path} is not a readable CIFAR-10 batch ({err})") from None


def _cifar_batch(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent} (CIFAR-10 python version: data_batch_1..5, "
                                "test_batch)")
    batch = _ArrayUnpickler.load(path)
    if not isinstance(batch, dict):
        raise ValueError(f"{path} does not hold a CIFAR-10 batch (a dict with data and labels)")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path} has no 'data' and 'labels' entries: not a CIFAR-10 batch")
    data, labels = np.asarray(data), np.asarray(labels)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
        raise ValueError(f"{path} holds data of shape {data.shape} and {labels.shape} labels; CIFAR-10 batches hold "
                         "N x 3072 bytes and N labels")
    if data.dtype != np.uint8:  # the [0, 1] scale (and so the pixel input bound) assumes bytes
        raise ValueError(f"{path} holds {data.dtype} pixels; CIFAR-10 batches hold unsigned bytes")
    if labels.size and (labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path} holds labels that are not integers 0-9 ({labels.dtype} in [{labels.min()}, "
                         f"{labels.max()}]): damaged or not CIFAR-10")
    return data.astype(np.float32).reshape(-1, 3, 32, 32) / 255.0, labels.astype(np.int64)


def load_cifar10(data_dir: Union[str, Path]) -> DataSplit:
    """CIFAR-10 from its "python version" directory (``data_batch_1`` ... ``data_batch_5``, ``test_batch``,
    pickled dicts); pixels in [0, 1], shape (3, 32, 32), the official train/test split."""
    d = Path(data_dir)
    if not d.is_dir():
        raise NotADirectoryError(f"{d} is not a directory holding CIFAR-10's data_batch_1..5 and test_batch")
    train = [_cifar_batch(d / f"data_batch_{i}") for i in range(1, 6)]
    test = _cifar_batch(d / "test_batch")
    x = np.concatenate([b[0] for b in train])
    y = np.concatenate([b[1] for b in train])
    return DataSplit(_to_dataset(x, y), _to_dataset(*test), "cifar10", 1.0, num_classes=10)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")


def _read_images(root: Path, classes: List[str], mode: str, size: Optional[Tuple[int, int]]
                 ) -> Tuple[np.ndarray, np.ndarray]:
    from ..extras import require

    image = require("PIL.Image", "images")
    xs, ys = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        for f in files:
            try:
                with image.open(f) as im:
                    im = im.convert(mode)
                    if size is not None and im.size != (size[1], size[0]):
                        im = im.resize((size[1], size[0]))
                    arr = np.asarray(im, dtype=np.float32) / 255.0
            except OSError as err:
                raise ValueError(f"{f} is not a readable image ({err})") from None
            xs.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    shapes = {x.shape for x in xs}
    if len(shapes) > 1:
        raise ValueError(f"the images under {root} have different sizes {sorted(shapes)[:3]}...: give image_size "
                         "(the CLI resizes nothing on its own)")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


def load_image_folder(data_dir: Union[str, Path], colour: bool = True, image_size: Optional[Tuple[int, int]] = None,
                      test_fraction: float = 0.2, seed: int = 0) -> DataSplit:
    """An ``ImageFolder``-style tree: ``root/<class>/<image>`` (class = folder name, in sorted order), or
    ``root/train/<class>/...`` and ``root/test/<class>/...`` for a given split (else a stratified split of
    ``test_fraction``, fixed by ``seed``).  Pixels in [0, 1]; RGB (3 channels) or grayscale (1)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise NotADirectoryError(f"{d} is not a directory of class folders")
    mode = "RGB" if colour else "L"
    split = (d / "train").is_dir() and (d / "test").is_dir()
    top = d / "train" if split else d
    classes = sorted(p.name for p in top.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ValueError(f"{top} holds {len(classes)} class folder(s); a classification needs at least 2")
    if split:
        test_classes = sorted(p.name for p in (d / "test").iterdir() if p.is_dir())
        if test_classes != classes:
            raise ValueError(f"{d}/train and {d}/test have different class folders ({classes} vs {test_classes})")
        (xtr, ytr), (xte, yte) = (_read_images(d / part, classes, mode, image_size) for part in ("train", "test"))
    else:
        x, y = _read_images(d, classes, mode, image_size)
        xtr, xte, ytr, yte = _split(x, y, test_fraction, seed)
    return DataSplit(_to_dataset(xtr, ytr), _to_dataset(xte, yte), "imagefolder", 1.0, num_classes=len(classes))


def load_tabular(
    path: Union[str, Path],
    test_fraction: float = 0.2,
    seed: int = 0,
    label_column: Union[int, str] = -1,
) -> DataSplit:
    """A tabular set: ``.npz`` with arrays ``X`` and ``y``, or ``.csv`` (header allowed; label column given).

    Split 80/20 stratified by default.  Features are not standardised here
    (standardising with data statistics is not data-independent).  The classes are the labels of the test part,
    numbered in sorted order; a label found in the training part only is refused.
    """
    p = Path(path)
    if p.suffix == ".npz":
        try:
            with np.load(p, allow_pickle=False) as arrays:
                found = {"X", "y"} <= set(arrays.files)
                if found:
                    x, y = arrays["X"].astype(np.float64), arrays["y"]
        except (OSError, EOFError, zipfile.BadZipFile, ValueError) as err:
            # numpy reads a file that is no zip archive as a pickle, and refuses it as one: its message says pickle
            raise ValueError(f"{p} is not a readable .npz file (a zip archive of numeric arrays X and y, "
                             f"{type(err).__name__})") from None
        if not found:
            raise ValueError(f"{p} must contain arrays 'X' and 'y'")
    elif p.suffix == ".csv":
        with open(p) as fh:
            header = fh.readline().strip().split(",")
        has_header = any(not _is_number(h) for h in header)
        if header == [""]:
            raise ValueError(f"{p} is empty")
        try:
            table = np.genfromtxt(p, delimiter=",", skip_header=1 if has_header else 0, dtype=np.float64)
        except ValueError as err:  # rows of different lengths
            raise ValueError(f"{p.name} is not a table of numbers with one row per record: "
                             f"{' '.join(str(err).split())[:160]}") from None
        table = np.atleast_2d(table)
        width = table.shape[1]
        if isinstance(label_column, str):
            if not has_header or label_column not in header:
                raise ValueError(f"{p.name} has no column named {label_column!r}" +
                                 (f" (its columns: {', '.join(header)})" if has_header else " (it has no header)"))
            col = header.index(label_column)
        elif not is_whole(label_column) or not -width <= label_column < width:
            raise ValueError(f"label_column must be a column name or an index in [-{width}, {width}) for the "
                             f"{width} columns of {p.name}, got {label_column!r}")
        else:
            col = int(label_column)
        y = table[:, col]
        x = np.delete(table, col % table.shape[1], axis=1)
    else:
        raise ValueError(f"unsupported tabular file {p} (use .npz with X, y or .csv)")
    if x.ndim != 2:
        raise ValueError(f"X of {p.name} must be 2-D (records x features), got shape {x.shape}")
    y = np.asarray(y)
    if y.shape != (x.shape[0],):
        raise ValueError(f"y of {p.name} must hold one label per record ({x.shape[0]}), got shape {y.shape}")
    check_finite(x, f"features of {p.name}")
    if y.dtype.kind not in "biuf":
        raise ValueError(f"labels of {p.name} must be integers, got {y.dtype} values such as {y.flat[0]!r}")
    if y.dtype.kind == "f":
        if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
            raise ValueError(f"labels of {p.name} must be integers")
    y = y.astype(np.int64)
    values, counts = np.unique(y, return_counts=True)
    if len(values) < 2:
        raise ValueError(f"{p.name} has a single class ({values.tolist()}): there is nothing to classify")
    if counts.min() < 2:
        raise ValueError(f"class {values[counts.argmin()]} of {p.name} has a single record: a stratified train/test "
                         "split needs at least two per class")
    xtr, xte, ytr, yte = _split(x.astype(np.float32), y, test_fraction, seed)
    # The classes (the model's output width) are those of the held-out part, never read from the records trained on.
    classes = np.unique(yte)
    unseen = np.setdiff1d(ytr, classes)
    if unseen.size:
        raise ValueError(f"label {unseen[0]} of {p.name} has no record in the held-out part of the split: the classes "
                         "are read from the held-out records (the training records must not decide the model's "
                         "output width); give that class more records or a larger test fraction")
    return DataSplit(_to_dataset(xtr, np.searchsorted(classes, ytr)), _to_dataset(xte, np.searchsorted(classes, yte)),
                     p.stem, num_classes=len(classes))


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def load_dataset(name: str, data_dir: Optional[Union[str, Path]] = None, seed: int = 0,
                 num_classes: Optional[int] = None) -> DataSplit:
    """``digits`` (embedded), ``mnist`` (directory of its IDX files), ``idx`` (any grayscale IDX images),
    ``cifar10`` (its python-version directory), ``imagefolder`` (a tree of class folders) or a tabular file.

    ``num_classes`` declares the classes of ``idx`` data (else read from its test labels); for the others, which
    declare their own, a given value must agree."""
    if num_classes is not None:
        num_classes = whole_number(num_classes, "num_classes", 2)
    if name == "idx":
        if data_dir is None:
            raise ValueError(f"{name} needs --data-dir, a directory holding the IDX files")
        return load_idx_images(data_dir, num_classes=num_classes)
    data = _load_declared(name, data_dir, seed)
    if num_classes is not None and num_classes != data.num_classes:
        raise ValueError(f"{data.name} has {data.num_classes} classes (by its definition, its class folders or the "
                         f"labels of a tabular file's held-out part), not the {num_classes} declared: leave "
                         "num_classes out, or use --dataset idx for IDX files with other labels")
    return data


def _load_declared(name: str, data_dir: Optional[Union[str, Path]], seed: int) -> DataSplit:
    if name == "digits":
        if data_dir is not None:  # a run "on the files there" would train on the embedded digits without a word
            raise ValueError(f"--data-dir {data_dir} would not be used: digits is embedded in clipless; name the "
                             "dataset of the files there (mnist, idx, cifar10, imagefolder or a .npz/.csv file)")
        return load_digits(seed=seed)
    if name in ("cifar10", "imagefolder"):
        if data_dir is None:
            raise ValueError(f"{name} needs --data-dir, the directory holding the images")
        return load_cifar10(data_dir) if name == "cifar10" else load_image_folder(data_dir, seed=seed)
    if name == "mnist":
        if data_dir is None:
            raise ValueError(f"{name} needs --data-dir, a directory holding the IDX files")
        return load_mnist(data_dir)
    candidate = Path(data_dir, name) if data_dir is not None else Path(name)
    if candidate.suffix in (".npz", ".csv") and candidate.exists():
        return load_tabular(candidate, seed=seed)
    raise ValueError(f"unknown dataset {name!r}: use 'digits', 'mnist', 'idx', 'cifar10', 'imagefolder' or a .npz/.csv "
                     "file" + (f" ({candidate} not found)" if candidate.suffix in (".npz", ".csv") else ""))

