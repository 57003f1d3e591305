"""Datasets for the ``pyro-bdl`` command, the benchmarks and the tutorials.

The default, scikit-learn's bundled ``load_digits`` (real 8×8 handwritten digits), ships inside an
installed package. Real data on disk (the MNIST test set, UCI regression) is read from a folder
given by argument or by the ``PYRO_BDL_DATA`` environment variable; nothing is downloaded.
Text (SST-2 sentiment phrases, :func:`load_sst2`) comes as lists of strings, to tokenize.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DATASETS",
    "DATA_ENV",
    "MNIST_FILES",
    "SST2_FILE",
    "Dataset",
    "TextSplits",
    "UCIFolder",
    "hold_out_classes",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_ood",
    "load_sst2",
    "load_uci",
    "phrase_groups",
    "resolve_data_dir",
    "uci_datasets",
    "uci_folder",
    "uci_root",
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
        source = "data_dir (--data-dir)" if data_dir is not None else f"${DATA_ENV}"
        raise FileNotFoundError(
            f"data folder {str(path)!r} (from {source}) does not exist; pass --data-dir or set "
            f"{DATA_ENV} to the folder that holds the data."
        )
    return path


def _split(n: int, test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    perm = np.random.default_rng(seed).permutation(n)
    return perm[test_size:], perm[:test_size]


def load_digits(
    *, seed: int = 0, test_fraction: float = 0.2, dtype: torch.dtype | None = None
) -> Dataset:
    """scikit-learn's 1,797 8×8 digits as ``(N, 1, 8, 8)`` in [0, 1]; a fixed seeded split."""
    import torch  # here, not at the top: `pyro-bdl --help` loads no torch

    dtype = dtype or torch.float32
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = torch.as_tensor(bunch.data / 16.0, dtype=dtype).reshape(-1, 1, 8, 8)
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    train, test = _split(len(y), round(test_fraction * len(y)), seed)
    return Dataset("digits", x[train], y[train], x[test], y[test], 10, {"split_seed": seed})


def _read_idx(path: Path) -> np.ndarray:
    """The array in a gzipped IDX file of unsigned bytes (MNIST's format); a file that is not
    one, or holds fewer bytes than its header promises, raises ``ValueError`` naming it."""
    import numpy as np

    fix = (
        "a damaged or partial download leaves such a file: download it again, or pass "
        "--data-dir a folder with intact files"
    )
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:  # EOFError: a truncated gzip stream
        raise ValueError(f"{str(path)!r} is not a readable gzip file ({err}); {fix}.") from None
    ndim = raw[3] if len(raw) >= 4 else 0
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    size = len(raw) - 4 - 4 * ndim
    if raw[:3] != bytes([0, 0, 8]) or ndim == 0 or size != int(np.prod(dims)):
        raise ValueError(
            f"{str(path)!r} is not an IDX file of bytes with the {size} values its header "
            f"promises (dims {dims}); {fix}."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


#: The files :func:`load_mnist` reads: the MNIST test set's images and labels.
MNIST_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def load_mnist(
    data_dir=None, *, seed: int = 0, test_size: int = 2000, dtype: torch.dtype | None = None
) -> Dataset:
    """The MNIST *test* set (10,000 digits) split 8,000 train / 2,000 test with a fixed seed.

    Reads ``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz`` from ``data_dir`` (or
    its ``mnist-test`` subfolder, or ``$PYRO_BDL_DATA``).
    """
    import numpy as np  # here, not at the top: `pyro-bdl --help` loads neither
    import torch

    dtype = dtype or torch.float32
    folder = resolve_data_dir(data_dir, "mnist-test")
    missing = [name for name in MNIST_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"MNIST folder {str(folder)!r} has no {' or '.join(missing)}; put the MNIST test-set "
            f"files {' and '.join(MNIST_FILES)} there (or in its mnist-test/ subfolder), or point "
            f"--data-dir or ${DATA_ENV} at the folder that holds them."
        )
    images, labels = (_read_idx(folder / name) for name in MNIST_FILES)
    x = torch.as_tensor(images.astype(np.float32) / 255.0, dtype=dtype).unsqueeze(1)
    y = torch.as_tensor(labels.astype(np.int64))
    train, test = _split(len(y), test_size, seed)
    info = {"split_seed": seed, "note": "MNIST test set only, split 8k/2k"}
    return Dataset("mnist", x[train], y[train], x[test], y[test], 10, info)


#: The files every folder in the standard UCI split format holds (besides the split files).
UCI_FILES = ("data.txt", "index_features.txt", "index_target.txt")
#: The hidden width of the protocol when a folder has no ``n_hidden.txt``.
UCI_DEFAULT_HIDDEN = 50


@dataclass(frozen=True)
class UCIFolder:
    """What a folder in the standard UCI split format declares, before any split is read.

    ``n_splits`` comes from ``n_splits.txt`` (else the number of consecutive
    ``index_train_K.txt``/``index_test_K.txt`` pairs from K = 0) and ``n_hidden`` from
    ``n_hidden.txt`` (else 50). ``n_epochs.txt``, ``dropout_rates.txt`` and ``tau_values.txt``
    (MC dropout's own training settings, shipped with the same folders) are not read.
    """

    name: str
    path: Path
    n_splits: int
    n_hidden: int

    def split_files(self, split: int) -> tuple[Path, Path]:
        return self.path / f"index_train_{split}.txt", self.path / f"index_test_{split}.txt"


def uci_root(data_dir=None) -> Path:
    """The folder that holds the UCI dataset folders: ``data_dir`` (or ``$PYRO_BDL_DATA``), or
    its ``uci`` subfolder when it has one."""
    return resolve_data_dir(data_dir, "uci")


def _files_of(folder: Path) -> Path:
    """``folder``, or its ``data`` subfolder where the files sit there (the layout of the
    MC-dropout code's ``UCI_Datasets/NAME/data/``)."""
    inner = folder / "data"
    return (
        inner if not (folder / "data.txt").is_file() and (inner / "data.txt").is_file() else folder
    )


def uci_datasets(data_dir=None) -> list[str]:
    """The names of the folders under :func:`uci_root` that hold a ``data.txt`` (in them or in
    their ``data`` subfolder), sorted."""
    root = uci_root(data_dir)
    return sorted(p.name for p in root.iterdir() if (_files_of(p) / "data.txt").is_file())


def _read_int(path: Path) -> int:
    text = path.read_text().split()
    try:
        (value,) = text
        number = int(float(value))
        if number != float(value) or number < 1:
            raise ValueError
    except (ValueError, OverflowError):
        raise ValueError(
            f"{str(path)!r} must hold one positive integer; it holds {' '.join(text)[:40]!r}."
        ) from None
    return number


def uci_folder(name: str, data_dir=None) -> UCIFolder:
    """Check that ``name`` is a folder in the standard UCI split format and read what it declares.

    The files sit in ``name`` itself or in its ``data`` subfolder (the MC-dropout code's layout).
    Raises ``FileNotFoundError`` listing the dataset folders found when ``name`` is not one of
    them, and naming the missing file when the folder lacks one of :data:`UCI_FILES` or the split
    files of split 0.
    """
    root = uci_root(data_dir)
    path = root / name
    if not path.is_dir():
        found = uci_datasets(data_dir)
        raise FileNotFoundError(
            f"no UCI dataset folder {name!r} under {str(root)!r}; the folders there are "
            f"{found if found else 'none'} (a dataset folder holds data.txt, index_features.txt, "
            "index_target.txt and index_train_K.txt/index_test_K.txt per split K)."
        )
    path = _files_of(path)
    for file in (*UCI_FILES, "index_train_0.txt", "index_test_0.txt"):
        if not (path / file).is_file():
            raise FileNotFoundError(
                f"UCI dataset folder {str(path)!r} has no {file}; the standard split format needs "
                f"{', '.join(UCI_FILES)} and index_train_K.txt/index_test_K.txt for each split K."
            )
    if (path / "n_splits.txt").is_file():
        n_splits = _read_int(path / "n_splits.txt")
    else:
        n_splits = 0
        while all(f.is_file() for f in UCIFolder(name, path, 0, 0).split_files(n_splits)):
            n_splits += 1
    hidden_file = path / "n_hidden.txt"
    n_hidden = _read_int(hidden_file) if hidden_file.is_file() else UCI_DEFAULT_HIDDEN
    return UCIFolder(name, path, n_splits, n_hidden)


def _check_indices(path: Path, indices: np.ndarray, size: int, what: str) -> None:
    if indices.size == 0 or indices.min() < 0 or indices.max() >= size:
        raise ValueError(
            f"{str(path)!r} must list 0-based {what} indices in [0, {size}); got "
            f"{indices.size} indices in [{indices.min(initial=0)}, {indices.max(initial=0)}]."
        )


def load_uci(
    name: str, data_dir=None, *, split: int = 0, dtype: torch.dtype | None = None
) -> Dataset:
    """Split ``split`` of the dataset folder ``name`` in the standard UCI split format,
    standardised with the training split's statistics; ``info`` holds ``y_mean``/``y_std`` to map
    predictions back to original units, and ``n_hidden`` and ``n_splits`` (see :class:`UCIFolder`).
    """
    import numpy as np  # here, not at the top: `pyro-bdl --help` loads neither
    import torch

    dtype = dtype or torch.float32
    spec = uci_folder(name, data_dir)
    folder = spec.path
    if not 0 <= split < spec.n_splits:
        raise ValueError(
            f"split must lie in [0, {spec.n_splits}) for UCI dataset {name!r}; got {split}. Pass "
            f"a split index below {spec.n_splits}."
        )
    train_file, test_file = spec.split_files(split)
    for file in (train_file, test_file):
        if not file.is_file():
            raise FileNotFoundError(
                f"UCI dataset folder {str(folder)!r} has no {file.name} (split {split} of "
                f"{spec.n_splits})."
            )
    data = np.loadtxt(folder / "data.txt", ndmin=2)
    features = np.loadtxt(folder / "index_features.txt", dtype=int, ndmin=1)
    target = np.loadtxt(folder / "index_target.txt", dtype=int, ndmin=1)
    train = np.loadtxt(train_file, dtype=int, ndmin=1)
    test = np.loadtxt(test_file, dtype=int, ndmin=1)
    rows, columns = data.shape
    _check_indices(folder / "index_features.txt", features, columns, "column")
    _check_indices(folder / "index_target.txt", target, columns, "column")
    if target.size != 1:
        raise ValueError(
            f"{str(folder / 'index_target.txt')!r} must name one target column; got "
            f"{target.tolist()}. Write the one target column's index in it."
        )
    _check_indices(train_file, train, rows, "row")
    _check_indices(test_file, test, rows, "row")
    x, y = data[:, features], data[:, int(target[0])]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std[x_std == 0] = 1.0
    y_mean, y_std = y[train].mean(), y[train].std()

    def t(a):
        return torch.as_tensor(a, dtype=dtype)

    xs, ys = (x - x_mean) / x_std, (y - y_mean) / y_std
    info = {
        "split": split,
        "y_mean": float(y_mean),
        "y_std": float(y_std),
        "n_hidden": spec.n_hidden,
        "n_splits": spec.n_splits,
    }
    return Dataset(name, t(xs[train]), t(ys[train]), t(xs[test]), t(ys[test]), None, info)


#: The classification datasets ``pyro-bdl compare --dataset`` accepts.
DATASETS = ("digits", "mnist")


def load_dataset(name: str, data_dir=None, *, seed: int = 0) -> Dataset:
    """Load a classification dataset by name (``"digits"`` needs no files)."""
    from pyro_bdl._validation import check_choice

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
    import torch

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


def load_ood(
    path: str | os.PathLike, input_shape: tuple[int, ...], *, dtype: torch.dtype | None = None
):
    """Out-of-distribution inputs from a file, reshaped to ``(n, *input_shape)``.

    Accepts ``.npy`` (one array), ``.npz`` (the array ``x``, or its only array) and ``.pt``
    (a tensor, or a dict with ``x``), with values already scaled like the training inputs
    (digits and MNIST use [0, 1]).
    """
    import numpy as np  # here, not at the top: `pyro-bdl --help` loads neither
    import torch

    dtype = dtype or torch.float32
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
    from pyro_bdl._validation import check_finite

    check_finite(f"OOD inputs in {str(path)!r}", x)
    return x.reshape(-1, *input_shape)


@dataclass
class TextSplits:
    """Train/validation/test splits of labelled sentences (texts and integer labels)."""

    name: str
    train: tuple[list[str], list[int]]
    validation: tuple[list[str], list[int]]
    test: tuple[list[str], list[int]]
    num_classes: int
    info: dict = field(default_factory=dict)


#: The file :func:`load_sst2` reads (GLUE's SST-2 training phrases, ``label<TAB>sentence``).
SST2_FILE = "train.tsv"


def _read_sst2(path: Path) -> dict[str, int]:
    """Each distinct phrase with its label (the first one where a phrase repeats)."""
    phrases: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header[:2] != ["label", "sentence"]:
            raise ValueError(
                f"{str(path)!r} must start with the header 'label<TAB>sentence' (GLUE's SST-2 "
                f"train.tsv); got {header!r}."
            )
        for number, line in enumerate(f, start=2):
            label, _, text = line.rstrip("\n").partition("\t")
            if label not in ("0", "1"):
                raise ValueError(
                    f"{str(path)!r} line {number}: label must be 0 or 1; got {label!r}. Pass "
                    "GLUE's SST-2 train.tsv as it is distributed."
                )
            text = text.strip()
            if text:
                phrases.setdefault(text, int(label))
    return phrases


def phrase_groups(phrases: list[str]) -> list[int]:
    """For each phrase, the index (into ``phrases``) of the longest phrase containing it.

    SST-2's phrases are spans of a few thousand sentences; a group is one root phrase (contained
    in no longer one) with the phrases found inside it. A phrase is looked for only in the roots
    holding its rarest word, so a phrase inside a root but not on word boundaries starts its own
    group (the split's final check still keeps it out of the other splits' way).
    """
    order = sorted(range(len(phrases)), key=lambda i: (-len(phrases[i]), phrases[i]))
    postings: dict[str, list[int]] = {}
    group = [0] * len(phrases)
    for i in order:
        text, words = phrases[i], set(phrases[i].split())
        rarest = min(words, key=lambda w: len(postings.get(w, ())))
        root = next((r for r in postings.get(rarest, ()) if text in phrases[r]), None)
        if root is None:
            root = i
            for word in words:
                postings.setdefault(word, []).append(i)
        group[i] = root
    return group


def load_sst2(
    path: str | os.PathLike | None = None,
    *,
    n_train: int = 2000,
    n_val: int = 500,
    n_test: int = 1000,
    seed: int = 0,
    holdout_fraction: float = 0.1,
) -> TextSplits:
    """SST-2 phrases split so that no validation or test item is a substring of a training item.

    The phrases are grouped by the longest phrase containing them (:func:`phrase_groups`); the
    groups, in a seeded order, go ``holdout_fraction`` each to test and validation and the rest
    to training, and ``n_*`` items are drawn from each split's phrases. A validation or test
    phrase that still occurs inside a drawn training item (a common span such as "the film"
    found in another sentence) is skipped. The same file and arguments give the same splits.

    :param path: SST-2's ``train.tsv`` (``label<TAB>sentence``) or its folder; default
        ``$PYRO_BDL_DATA/sst2/train.tsv``.
    :returns: a :class:`TextSplits` of texts and 0/1 labels; ``info`` counts the groups and the
        skipped phrases.
    """
    import numpy as np

    from pyro_bdl._validation import check_positive_int

    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        check_positive_int(name, value)
    if not 0.0 < holdout_fraction < 0.5:
        raise ValueError(
            f"holdout_fraction must lie in (0, 0.5); got {holdout_fraction!r}. Pass for example "
            "0.1."
        )
    file = Path(path) if path is not None else resolve_data_dir(None, "sst2")
    if file.is_dir():
        file = file / SST2_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"SST-2 file {str(file)!r} does not exist; pass the path of GLUE's SST-2 train.tsv "
            f"or set {DATA_ENV} to a folder holding sst2/{SST2_FILE}."
        )
    labels = _read_sst2(file)
    phrases = sorted(labels)
    group = phrase_groups(phrases)
    roots = sorted(set(group))
    rng = np.random.default_rng(seed)
    shuffled = [roots[i] for i in rng.permutation(len(roots))]
    cut = max(1, round(holdout_fraction * len(roots)))
    split_of = {r: 0 for r in shuffled[: 2 * cut]}
    split_of.update({r: 1 for r in shuffled[cut : 2 * cut]})  # 0: test, 1: validation
    pools: list[list[int]] = [[], [], []]
    for i, root in enumerate(group):
        pools[split_of.get(root, 2)].append(i)
    pools = [[pool[j] for j in rng.permutation(len(pool))] for pool in pools]
    if len(pools[2]) < n_train:
        raise ValueError(
            f"n_train={n_train} exceeds the {len(pools[2])} training phrases; lower n_train or "
            "holdout_fraction."
        )
    train = pools[2][:n_train]
    seen = "\n".join(phrases[i] for i in train)
    held: list[list[int]] = []
    skipped: list[int] = []
    for pool, want, name in ((pools[1], n_val, "n_val"), (pools[0], n_test, "n_test")):
        kept: list[int] = []
        for i in pool:
            if len(kept) == want:
                break
            if phrases[i] in seen:
                continue
            kept.append(i)
        if len(kept) < want:
            raise ValueError(
                f"{name}={want} exceeds the {len(kept)} usable phrases of that split; lower it "
                "or raise holdout_fraction."
            )
        skipped.append(pool.index(kept[-1]) + 1 - want)
        held.append(kept)

    def take(idx: list[int]) -> tuple[list[str], list[int]]:
        return [phrases[i] for i in idx], [labels[phrases[i]] for i in idx]

    info = {
        "file": str(file),
        "seed": seed,
        "phrases": len(phrases),
        "groups": len(roots),
        "groups_per_split": {"test": cut, "validation": cut, "train": len(roots) - 2 * cut},
        "skipped_as_substrings": {"validation": skipped[0], "test": skipped[1]},
    }
    return TextSplits("sst2", take(train), take(held[0]), take(held[1]), 2, info)
