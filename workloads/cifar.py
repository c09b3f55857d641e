"""cifar10-cnn: CIFAR-10 from the "python version" files the user provides.

``--data`` is the extracted ``cifar-10-batches-py`` folder (or a folder that
contains it) or the ``cifar-10-python.tar.gz`` archive itself. Each batch file
is a pickled dict with ``data`` (N x 3072 uint8, channel-major 32x32 images)
and ``labels`` (N ints 0..9). Pickles are read with an unpickler that builds
only plain containers and NumPy arrays, so a hostile file cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from typing import Any, Mapping

import numpy as np

from workloads.base import DataError, Defaults, Split, Workload, as_batch, check_split_name, take

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
FOLDER = "cifar-10-batches-py"
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)[:, None, None]
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)[:, None, None]
DATA_HELP = ("the CIFAR-10 python version: the extracted cifar-10-batches-py folder "
             "(data_batch_1..5, test_batch) or cifar-10-python.tar.gz")

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _parse_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        obj = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means a bad file
        raise DataError(f"{where} is not a CIFAR-10 python batch ({exc}); expected {DATA_HELP}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where} holds a {type(obj).__name__}, expected a dict with data and labels")
    obj = {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}
    if "data" not in obj or "labels" not in obj:
        raise DataError(f"{where} lacks 'data' or 'labels' (keys: {sorted(obj)})")
    data = np.asarray(obj["data"])
    labels = np.asarray(obj["labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8:
        raise DataError(f"{where}: data is {data.dtype}{list(data.shape)}, expected uint8[N, 3072]")
    if len(labels) != len(data):
        raise DataError(f"{where}: {len(data)} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{where}: labels must be 0..9, found {labels.min()}..{labels.max()}")
    return data, labels


def _read_batches(data: str, names: tuple[str, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    if not os.path.exists(data):
        raise DataError(f"--data {data} does not exist: expected {DATA_HELP}")
    if os.path.isfile(data):
        return _read_from_tar(data, names)
    folder = os.path.join(data, FOLDER) if os.path.isdir(os.path.join(data, FOLDER)) else data
    out = []
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise DataError(f"CIFAR-10 batch {name} not found in {folder}: expected {DATA_HELP}")
        with open(path, "rb") as f:
            out.append(_parse_batch(f.read(), path))
    return out


def _read_from_tar(path: str, names: tuple[str, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    try:
        with tarfile.open(path, "r:*") as tar:
            members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
            out = []
            for name in names:
                if name not in members:
                    raise DataError(f"{path} has no member {name}: expected {DATA_HELP}")
                raw = tar.extractfile(members[name]).read()
                out.append(_parse_batch(raw, f"{path}:{members[name].name}"))
            return out
    except (tarfile.TarError, OSError, EOFError) as exc:
        why = "not a tar archive, plain or gzip-compressed" if isinstance(exc, tarfile.ReadError) else \
            (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise DataError(f"cannot read {path} as a tar archive ({why}); expected {DATA_HELP}") from None


class CifarCNN(Workload):
    def __init__(self) -> None:
        super().__init__(
            name="cifar10-cnn",
            description="CIFAR-10 with a 3-stage CNN",
            defaults=Defaults(epochs=5, batch_size=64, lr=0.001, optimizer="adam"),
            data_help=DATA_HELP,
        )

    def check_data(self, data: str | None, params: Mapping[str, Any]) -> None:
        super().check_data(data, params)
        assert data is not None
        _read_batches(data, TRAIN_BATCHES + (TEST_BATCH,))

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        check_split_name(split)
        assert data is not None
        batches = _read_batches(data, TRAIN_BATCHES if split == "train" else (TEST_BATCH,))
        raw = np.concatenate([b[0] for b in batches])
        labels = np.concatenate([b[1] for b in batches])
        shard = take(raw, labels, split, rank, world_size)
        x = shard.x.reshape(-1, 3, 32, 32) / 255.0
        return Split(((x - MEAN) / STD).astype(np.float32), shard.y)

    def preprocess(self, x: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
        """Raw 0..255 pixels: CIFAR's own rows of 3072 (channels first), (3, 32, 32), or
        height-width-channels images (32, 32, 3) -> scaled and normalised as in training."""
        x = np.asarray(x)
        if x.ndim == 4 and x.shape[1:] == (32, 32, 3):
            x = x.transpose(0, 3, 1, 2)
        x = as_batch(x, (3, 32, 32)) / 255.0
        return ((x - MEAN) / STD).astype(np.float32)

    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        return (3, 32, 32)

    def num_classes(self, params: Mapping[str, Any]) -> int:
        return 10

    def torch_model(self, params: Mapping[str, Any]):
        from workloads.torch_models import SmallCNN

        return SmallCNN(3, 32, (32, 64, 128), 10, hidden=256)

    def tf_model(self, params: Mapping[str, Any]):
        from workloads.tf_models import small_cnn

        return small_cnn(3, 32, (32, 64, 128), 10, hidden=256)
