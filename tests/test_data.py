import gzip

import numpy as np
import pytest
import torch

from pyro_bdl.app import data


def test_digits_split_is_fixed_and_disjoint():
    a, b = data.load_digits(seed=0), data.load_digits(seed=0)
    assert torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape[1:] == (1, 8, 8) and a.num_classes == 10
    assert len(a.y_train) + len(a.y_test) == 1797
    assert 0.0 <= float(a.x_train.min()) and float(a.x_train.max()) <= 1.0
    c = data.load_digits(seed=1)
    assert not torch.equal(a.y_test, c.y_test)


def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_reader_on_a_synthetic_idx_folder(tmp_path, monkeypatch):
    folder = tmp_path / "mnist-test"
    folder.mkdir()
    images = np.random.default_rng(0).integers(0, 256, size=(30, 28, 28))
    labels = np.arange(30) % 10
    _write_idx(folder / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(folder / "t10k-labels-idx1-ubyte.gz", labels)
    monkeypatch.setenv("PYRO_BDL_DATA", str(tmp_path))
    ds = data.load_mnist(test_size=10)
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    recovered = sorted(torch.cat([ds.y_train, ds.y_test]).tolist())
    assert recovered == sorted(labels.tolist())


def test_uci_reader_standardises_with_training_statistics(tmp_path):
    folder = tmp_path / "uci" / "toy"
    folder.mkdir(parents=True)
    rows = np.random.default_rng(1).normal(size=(10, 3)) * [1.0, 5.0, 2.0] + [0.0, 3.0, 1.0]
    np.savetxt(folder / "data.txt", rows)
    (folder / "index_features.txt").write_text("0\n1\n")
    (folder / "index_target.txt").write_text("2\n")
    (folder / "index_train_0.txt").write_text("\n".join(map(str, range(7))))
    (folder / "index_test_0.txt").write_text("7\n8\n9\n")
    ds = data.load_uci("toy", tmp_path)
    assert ds.x_train.shape == (7, 2) and ds.y_test.shape == (3,)
    # Standardised in float32: a mean of 7 values of |z| < 2 carries ≤ 7 · 2 · 6e-8 ≈ 1e-6 (2e-8
    # measured).
    assert torch.allclose(ds.x_train.mean(0), torch.zeros(2), atol=1e-5)
    assert ds.info["y_mean"] == pytest.approx(rows[:7, 2].mean())


def test_missing_data_folder_errors_name_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("PYRO_BDL_DATA", raising=False)
    with pytest.raises(ValueError, match="PYRO_BDL_DATA"):
        data.load_mnist()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_mnist(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="'digits', 'mnist'"):
        data.load_dataset("cifar")


def _write_sst2(path, sentences=40, seed=0):
    # SST-2's shape: each sentence and spans of it, labelled; shared words across sentences so
    # that short spans recur inside other sentences.
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(30)]
    lines = ["label\tsentence"]
    for _ in range(sentences):
        sentence = list(rng.choice(words, size=int(rng.integers(4, 9))))
        for start in range(len(sentence)):
            for stop in range(start + 1, len(sentence) + 1, 2):
                lines.append(f"{int(rng.integers(2))}\t{' '.join(sentence[start:stop])}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sst2_splits_hold_no_substring_of_a_training_item_and_are_fixed(tmp_path):
    path = _write_sst2(tmp_path / "train.tsv")
    kw = dict(n_train=150, n_val=20, n_test=25, holdout_fraction=0.2)
    a = data.load_sst2(path, seed=0, **kw)
    assert (len(a.train[0]), len(a.validation[0]), len(a.test[0])) == (150, 20, 25)
    for texts in (a.validation[0], a.test[0]):
        assert not [t for t in texts if any(t in s for s in a.train[0])]
    assert not set(a.validation[0]) & set(a.test[0])
    assert set(a.train[1] + a.test[1]) <= {0, 1}
    assert data.load_sst2(tmp_path, seed=0, **kw) == a  # the folder finds train.tsv
    b = data.load_sst2(path, seed=1, **kw)
    assert b.test != a.test


def test_phrase_groups_point_to_the_longest_containing_phrase():
    phrases = ["a b c d", "b c", "c", "x c y", "x"]
    group = data.phrase_groups(phrases)
    assert group == [0, 0, 0, 3, 3]


def test_sst2_refuses_a_missing_file_and_too_many_items(tmp_path):
    with pytest.raises(FileNotFoundError, match="SST-2"):
        data.load_sst2(tmp_path / "none.tsv")
    path = _write_sst2(tmp_path / "train.tsv", sentences=5)
    with pytest.raises(ValueError, match="n_test=500"):
        data.load_sst2(path, n_train=10, n_val=2, n_test=500, holdout_fraction=0.3)
