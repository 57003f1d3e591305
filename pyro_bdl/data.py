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

from pyro_bdl._validation import check_choice, check_finite

__all__ = [
    "DATASETS",
    "Dataset",
    "hold_out_classes",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_ood",
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
            "that holds the data (the folder with mnist-test/ and uci/ in it)."
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


def hold_out_classes(dataset: Dataset, classes) -> tuple[Dataset, torch.Tensor]:
    """Split a classification dataset into an in-distribution task and out-of-distribution inputs.

    The examples of ``classes`` (from the train *and* test splits, since the model never sees
    them) become the OOD inputs; the remaining classes are relabelled 0..K−1 in their original
    order, so the in-distribution task is an ordinary K-class problem. ``info["class_names"]``
    keeps the original label of each new class and ``info["held_out"]`` the held-out ones.

    Usage::

        digits, x_ood = hold_out_classes(load_digits(), [8, 9])   # train on 0-7, OOD = 8 and 9
    """
    if dataset.num_classes is None:
        raise ValueError(f"dataset {dataset.name!r} is a regression dataset; it has no classes.")
    held = sorted({int(c) for c in classes})
    if not held:
        raise ValueError("classes is empty; name at least one class to hold out, e.g. [8, 9].")
    bad = [c for c in held if not 0 <= c < dataset.num_classes]
    if bad:
        raise ValueError(f"classes to hold out must lie in [0, {dataset.num_classes}); got {bad}.")
    keep = [c for c in range(dataset.num_classes) if c not in held]
    if len(keep) < 2:
        raise ValueError(
            f"holding out {held} leaves {len(keep)} class(es); keep at least two to classify."
        )
    relabel = torch.full((dataset.num_classes,), -1, dtype=torch.long)
    relabel[keep] = torch.arange(len(keep))
    held_t = torch.tensor(held)

    def split(x: torch.Tensor, y: torch.Tensor):
        out = torch.isin(y, held_t)
        return x[~out], relabel[y[~out]], x[out]

    x_train, y_train, ood_train = split(dataset.x_train, dataset.y_train)
    x_test, y_test, ood_test = split(dataset.x_test, dataset.y_test)
    info = {**dataset.info, "class_names": keep, "held_out": held}
    name = f"{dataset.name}-without-{'-'.join(map(str, held))}"
    inside = Dataset(name, x_train, y_train, x_test, y_test, len(keep), info)
    return inside, torch.cat([ood_train, ood_test])


def load_ood(path: str | os.PathLike, input_shape: tuple[int, ...], *, dtype=torch.float32):
    """Out-of-distribution inputs from a file, reshaped to ``(n, *input_shape)``.

    Accepts ``.npy`` (one array), ``.npz`` (the array ``x``, or its only array) and ``.pt``
    (a tensor, or a dict with ``x``), with values already scaled like the training inputs
    (digits and MNIST use [0, 1]).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"OOD data file {str(path)!r} does not exist.")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        array = np.load(path, allow_pickle=False)
    elif suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.keys())
            if "x" not in names and len(names) != 1:
                raise ValueError(
                    f"{str(path)!r} holds arrays {names}; name the inputs 'x' or keep one array."
                )
            array = archive["x" if "x" in names else names[0]]
    elif suffix == ".pt":
        obj = torch.load(path, weights_only=True)
        if isinstance(obj, dict):
            if "x" not in obj:
                raise ValueError(f"{str(path)!r} holds keys {list(obj)}; expected a key 'x'.")
            obj = obj["x"]
        array = torch.as_tensor(obj).numpy()
    else:
        raise ValueError(
            f"OOD data file {str(path)!r} must end in .npy, .npz or .pt; got {suffix!r}."
        )
    x = torch.as_tensor(np.asarray(array, dtype=np.float64), dtype=dtype)
    per_row = int(np.prod(input_shape))
    if x.dim() == 0 or x.shape[0] == 0 or x[0].numel() != per_row:
        raise ValueError(
            f"OOD inputs in {str(path)!r} have shape {tuple(x.shape)}; expected (n, ...) with "
            f"{per_row} values per row to reshape to {tuple(input_shape)}."
        )
    check_finite(f"OOD inputs in {str(path)!r}", x)
    return x.reshape(-1, *input_shape)
