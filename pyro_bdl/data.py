"""Datasets for the ``pyro-bdl`` command, the benchmarks and the tutorials.

The default, scikit-learn's bundled ``load_digits`` (real 8×8 handwritten digits), ships inside an
installed package. Real data on disk (the MNIST test set, UCI regression) is read from a folder
given by argument or by the ``PYRO_BDL_DATA`` environment variable; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pyro_bdl._validation import check_choice

__all__ = [
    "DATASETS",
    "Dataset",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_uci",
    "resolve_data_dir",
]

DATA_ENV = "PYRO_BDL_DATA"


@dataclass
class Dataset:
    """A fixed train/test split. ``num_classes`` is ``None`` for regression."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int | None
    info: dict = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def resolve_data_dir(data_dir: str | os.PathLike | None, subdir: str = "") -> Path:
    """``data_dir`` if given, else ``$PYRO_BDL_DATA``; with ``subdir`` appended when that exists."""
    root = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    if root is None:
        raise ValueError(
            f"no data folder given: pass data_dir (--data-dir) or set {DATA_ENV} to the folder "
            "that holds the data (for example ../shared/data)."
        )
    path = Path(root)
    if subdir and (path / subdir).is_dir():
        path = path / subdir
    if not path.is_dir():
        raise FileNotFoundError(f"data folder {str(path)!r} does not exist.")
    return path


def _split(n: int, test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    return perm[test_size:], perm[:test_size]


def load_digits(*, seed: int = 0, test_fraction: float = 0.2, dtype=torch.float32) -> Dataset:
    """scikit-learn's 1,797 8×8 digits as ``(N, 1, 8, 8)`` in [0, 1]; a fixed seeded split."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = torch.as_tensor(bunch.data / 16.0, dtype=dtype).reshape(-1, 1, 8, 8)
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    train, test = _split(len(y), round(test_fraction * len(y)), seed)
    return Dataset("digits", x[train], y[train], x[test], y[test], 10, {"split_seed": seed})


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist(
    data_dir=None, *, seed: int = 0, test_size: int = 2000, dtype=torch.float32
) -> Dataset:
    """The MNIST *test* set (10,000 digits) split 8,000 train / 2,000 test with a fixed seed.

    Reads ``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz`` from ``data_dir`` (or
    its ``mnist-test`` subfolder, or ``$PYRO_BDL_DATA``).
    """
    folder = resolve_data_dir(data_dir, "mnist-test")
    images = _read_idx(folder / "t10k-images-idx3-ubyte.gz")
    labels = _read_idx(folder / "t10k-labels-idx1-ubyte.gz")
    x = torch.as_tensor(images.astype(np.float32) / 255.0, dtype=dtype).unsqueeze(1)
    y = torch.as_tensor(labels.astype(np.int64))
    train, test = _split(len(y), test_size, seed)
    info = {"split_seed": seed, "note": "MNIST test set only, split 8k/2k"}
    return Dataset("mnist", x[train], y[train], x[test], y[test], 10, info)


def load_uci(name: str, data_dir=None, *, split: int = 0, dtype=torch.float32) -> Dataset:
    """One of the standard UCI regression splits, standardised with the training split's
    statistics; ``info`` holds ``y_mean``/``y_std`` to map predictions back to original units."""
    folder = resolve_data_dir(data_dir, "uci") / name
    if not folder.is_dir():
        raise FileNotFoundError(f"UCI dataset folder {str(folder)!r} does not exist.")
    data = np.loadtxt(folder / "data.txt")
    features = np.loadtxt(folder / "index_features.txt", dtype=int).reshape(-1)
    target = int(np.loadtxt(folder / "index_target.txt", dtype=int))
    train = np.loadtxt(folder / f"index_train_{split}.txt", dtype=int)
    test = np.loadtxt(folder / f"index_test_{split}.txt", dtype=int)
    x, y = data[:, features], data[:, target]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std[x_std == 0] = 1.0
    y_mean, y_std = y[train].mean(), y[train].std()

    def t(a):
        return torch.as_tensor(a, dtype=dtype)

    xs, ys = (x - x_mean) / x_std, (y - y_mean) / y_std
    info = {"split": split, "y_mean": float(y_mean), "y_std": float(y_std)}
    return Dataset(name, t(xs[train]), t(ys[train]), t(xs[test]), t(ys[test]), None, info)


#: The classification datasets ``pyro-bdl compare --dataset`` accepts.
DATASETS = ("digits", "mnist")


def load_dataset(name: str, data_dir=None, *, seed: int = 0) -> Dataset:
    """Load a classification dataset by name (``"digits"`` needs no files)."""
    check_choice("dataset", name, DATASETS)
    if name == "digits":
        return load_digits(seed=seed)
    return load_mnist(data_dir, seed=seed)
