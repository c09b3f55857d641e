"""mnist-mlp and mnist-cnn: MNIST read from files the user provides.

Two layouts are accepted for ``--data``:

* a folder with the four IDX files as published (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``), each optionally gzipped (``.gz``); the
  ``train-images.idx3-ubyte`` spelling is accepted too;
* a single ``mnist.npz`` (the Keras layout: ``x_train``, ``y_train``,
  ``x_test``, ``y_test``), given as the file or a folder holding it.

IDX format: a big-endian header (two zero bytes, a type code, the number of
dimensions) followed by one big-endian uint32 per dimension, then the data.
Uncompressed files are memory-mapped, so a worker reads only the pages of its
own shard.
"""

from __future__ import annotations

import gzip
import os
import zipfile
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from workloads.base import DataError, Defaults, Split, Workload, as_batch, check_split_name, shard_indices

UBYTE = 0x08
MEAN, STD = 0.1307, 0.3081
FILES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
DATA_HELP = ("a folder with the four MNIST IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
             "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte; .gz or not) or an mnist.npz")


@dataclass(frozen=True)
class IdxHeader:
    path: str
    dims: tuple[int, ...]
    offset: int  # bytes before the data
    gzipped: bool


def _candidates(folder: str, base: str) -> list[str]:
    dotted = base.replace("-idx", ".idx")
    return [os.path.join(folder, n) for n in (base, base + ".gz", dotted, dotted + ".gz")]


def _find(folder: str, base: str) -> str:
    for path in _candidates(folder, base):
        if os.path.isfile(path):
            return path
    raise DataError(f"MNIST file {base}[.gz] not found in {folder}: expected {DATA_HELP}")


def read_idx_header(path: str) -> IdxHeader:
    """Parse and check an IDX header; the file size must match it exactly."""
    gz = path.endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0:
                raise DataError(f"{path} is not an IDX file (bad magic number): expected {DATA_HELP}")
            if head[2] != UBYTE:
                raise DataError(f"{path}: IDX type code 0x{head[2]:02x}, expected 0x08 (unsigned bytes)")
            ndim = head[3]
            raw = f.read(4 * ndim)
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"cannot read {path}: {exc}; re-download or re-extract the file") from None
    if len(raw) < 4 * ndim:
        raise DataError(f"{path} is truncated inside its IDX header")
    dims = struct.unpack(f">{ndim}I", raw)
    offset = 4 + 4 * ndim
    expected = offset + int(np.prod(dims))
    actual = _data_size(path, gz)
    if actual != expected:
        raise DataError(f"{path} holds {actual} bytes but its header {dims} says {expected}: "
                        "the file is truncated or corrupt; download it again")
    return IdxHeader(path, tuple(dims), offset, gz)


def _data_size(path: str, gz: bool) -> int:
    if not gz:
        return os.path.getsize(path)
    # A gzip member ends with the uncompressed size modulo 2**32: cheap to read.
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return struct.unpack("<I", f.read(4))[0]


def _read_idx(h: IdxHeader, idx: np.ndarray) -> np.ndarray:
    if h.gzipped:
        with gzip.open(h.path, "rb") as f:
            arr = np.frombuffer(f.read(), dtype=np.uint8, offset=h.offset).reshape(h.dims)
    else:
        arr = np.memmap(h.path, dtype=np.uint8, mode="r", offset=h.offset, shape=h.dims)
    return np.asarray(arr[idx])


def _array(arrays, key: str, path: str) -> np.ndarray:
    """One array of an .npz, or DataError: cut off, or of objects (never unpickled)."""
    try:
        value = arrays[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"cannot read {key} from {path} ({exc}); it must be a plain numeric array") from None
    if value.dtype.kind not in "uif":
        raise DataError(f"{path}: {key} is {value.dtype}, expected numbers")
    return value


def _npz_path(data: str) -> str | None:
    if data.endswith(".npz"):
        return data
    candidate = os.path.join(data, "mnist.npz")
    return candidate if os.path.isfile(candidate) else None


def _check_images_labels(images: tuple[int, ...], labels: tuple[int, ...], where: str) -> None:
    if len(images) != 3 or images[1:] != (28, 28):
        raise DataError(f"{where}: images have shape {images}, expected (N, 28, 28)")
    if len(labels) != 1 or labels[0] != images[0]:
        raise DataError(f"{where}: {images[0]} images but labels of shape {labels}")


def _check_labels(labels: np.ndarray, where: str) -> None:
    """Labels are read whole on the driver (60,000 bytes) to catch a wrong file early."""
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{where}: MNIST labels must be 0..9, found {labels.min()}..{labels.max()}; "
                        "is this a labels file?")


class MNIST(Workload):
    def __init__(self, model: str) -> None:
        super().__init__(
            name=f"mnist-{model}",
            description=("MNIST with a 2-layer MLP" if model == "mlp"
                         else "MNIST with a 2-stage CNN"),
            defaults=Defaults(epochs=3, batch_size=64, lr=0.001, optimizer="adam"),
            data_help=DATA_HELP,
        )
        self.model = model

    # -- data -------------------------------------------------------------
    def check_data(self, data: str | None, params: Mapping[str, Any]) -> None:
        super().check_data(data, params)
        assert data is not None
        if not os.path.exists(data):
            raise DataError(f"--data {data} does not exist: expected {DATA_HELP}")
        npz = _npz_path(data)
        if npz:
            arrays = self._open_npz(npz)
            for split in ("train", "test"):
                x, y = _array(arrays, f"x_{split}", npz), _array(arrays, f"y_{split}", npz)
                _check_images_labels(x.shape, y.shape, npz)
                _check_labels(y, f"{npz}:y_{split}")
            return
        if not os.path.isdir(data):
            raise DataError(f"--data {data} is neither a folder nor an .npz file: expected {DATA_HELP}")
        for split in ("train", "test"):
            images, labels = self._headers(data, split)
            _check_images_labels(images.dims, labels.dims, f"{images.path} / {labels.path}")
            _check_labels(_read_idx(labels, slice(None)), labels.path)

    def _headers(self, folder: str, split: str) -> tuple[IdxHeader, IdxHeader]:
        return (read_idx_header(_find(folder, FILES[(split, "images")])),
                read_idx_header(_find(folder, FILES[(split, "labels")])))

    @staticmethod
    def _open_npz(path: str):
        try:
            arrays = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(f"cannot read {path} as an .npz file ({exc}); re-download or re-create it") from None
        missing = {"x_train", "y_train", "x_test", "y_test"} - set(arrays.files)
        if missing:
            raise DataError(f"{path} lacks arrays {sorted(missing)}: expected x_train, y_train, x_test, y_test")
        return arrays

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        check_split_name(split)
        assert data is not None
        npz = _npz_path(data)
        if npz:
            arrays = self._open_npz(npz)
            labels = _array(arrays, f"y_{split}", npz)
            idx = shard_indices(len(labels), rank, world_size, equal=(split == "train"))
            images, labels = _array(arrays, f"x_{split}", npz)[idx], labels[idx]
        else:
            hi, hl = self._headers(data, split)
            idx = shard_indices(hl.dims[0], rank, world_size, equal=(split == "train"))
            images, labels = _read_idx(hi, idx), _read_idx(hl, idx)
        _check_labels(labels, data)
        x = ((images.astype(np.float32) / 255.0 - MEAN) / STD)[:, None, :, :]
        return Split(x, labels.astype(np.int64))

    # -- models -------------------------------------------------------------
    def preprocess(self, x: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
        """Raw 0..255 pixels, (28, 28) images or rows of 784 -> scaled and normalised as in training."""
        x = np.asarray(x)
        if x.ndim == 3 and x.shape[1:] == (28, 28):
            x = x[:, None, :, :]
        x = as_batch(x, (1, 28, 28)).astype(np.float32) / 255.0
        return ((x - MEAN) / STD).astype(np.float32)

    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        return (1, 28, 28)

    def num_classes(self, params: Mapping[str, Any]) -> int:
        return 10

    def torch_model(self, params: Mapping[str, Any]):
        from workloads.torch_models import MLP, SmallCNN

        if self.model == "mlp":
            return MLP(28 * 28, (256, 128), 10)
        return SmallCNN(1, 28, (16, 32), 10)

    def tf_model(self, params: Mapping[str, Any]):
        from workloads.tf_models import mlp, small_cnn

        if self.model == "mlp":
            return mlp((1, 28, 28), (256, 128), 10)
        return small_cnn(1, 28, (16, 32), 10)
