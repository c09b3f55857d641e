"""Small, valid MNIST and CIFAR-10 files written by the tests themselves.

The images are scikit-learn's 8x8 digits scaled up (to 28x28 grey for MNIST,
32x32 RGB for CIFAR), so a model trained on them really can learn: tests can
assert accuracy, not just that something ran.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile

import numpy as np
from sklearn.datasets import load_digits


def digit_images(size: int, n: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ds = load_digits()
    idx = (np.arange(n) + offset) % len(ds.target)
    small = (ds.images[idx] * (255.0 / 16.0)).astype(np.uint8)  # (n, 8, 8)
    scale = size // 8
    big = np.kron(small, np.ones((scale, scale), dtype=np.uint8))
    pad = size - big.shape[1]
    big = np.pad(big, ((0, 0), (pad // 2, pad - pad // 2), (pad // 2, pad - pad // 2)))
    return big, ds.target[idx].astype(np.uint8)


def idx_bytes(arr: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_mnist_idx(folder: str, n_train: int = 1200, n_test: int = 300, gz: bool = False) -> str:
    os.makedirs(folder, exist_ok=True)
    xtr, ytr = digit_images(28, n_train)
    xte, yte = digit_images(28, n_test, offset=n_train)
    for name, arr in (("train-images-idx3-ubyte", xtr), ("train-labels-idx1-ubyte", ytr),
                      ("t10k-images-idx3-ubyte", xte), ("t10k-labels-idx1-ubyte", yte)):
        data = idx_bytes(arr)
        if gz:
            with gzip.open(os.path.join(folder, name + ".gz"), "wb") as f:
                f.write(data)
        else:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
    return folder


def write_mnist_npz(path: str, n_train: int = 600, n_test: int = 200) -> str:
    xtr, ytr = digit_images(28, n_train)
    xte, yte = digit_images(28, n_test, offset=n_train)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return path


def cifar_batch(n: int, offset: int) -> bytes:
    grey, labels = digit_images(32, n, offset)
    rgb = np.stack([grey, grey // 2, 255 - grey], axis=1).reshape(n, 3072)
    return pickle.dumps({b"batch_label": b"test", b"labels": [int(v) for v in labels],
                         b"data": rgb, b"filenames": [b"x.png"] * n})


def cifar_members(per_batch: int = 200, n_test: int = 200) -> dict[str, bytes]:
    members = {f"data_batch_{i}": cifar_batch(per_batch, i * per_batch) for i in range(1, 6)}
    members["test_batch"] = cifar_batch(n_test, 7 * per_batch)
    return members


def write_cifar_folder(parent: str, **kw) -> str:
    folder = os.path.join(parent, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    for name, raw in cifar_members(**kw).items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(raw)
    return folder


def write_cifar_tar(path: str, **kw) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, raw in cifar_members(**kw).items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path
