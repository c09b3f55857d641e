"""Unit tests for the workloads package: registry, shards, file formats, models."""

from __future__ import annotations

import gzip
import os
import re

import numpy as np
import pytest

import workloads
from datafiles import write_cifar_folder, write_cifar_tar, write_mnist_idx, write_mnist_npz
from workloads.base import shard_indices
from workloads.cifar import DATA_HELP as CIFAR_HELP


def test_registry_lists_all_workloads():
    assert workloads.names() == ["digits-mlp", "mnist-mlp", "mnist-cnn", "cifar10-cnn",
                                 "resnet18-synthetic", "resnet50-synthetic", "tabular"]
    with pytest.raises(workloads.UnknownName, match="valid: digits-mlp"):
        workloads.get("nope")


@pytest.mark.parametrize("n,world", [(10, 1), (10, 3), (1437, 2), (7, 4)])
def test_train_shards_disjoint_and_equal(n, world):
    shards = [shard_indices(n, r, world, equal=True) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    flat = np.concatenate(shards)
    assert len(flat) == len(set(flat.tolist())) == (n // world) * world


@pytest.mark.parametrize("n,world", [(10, 3), (360, 2), (5, 8)])
def test_test_shards_cover_everything_once(n, world):
    flat = np.concatenate([shard_indices(n, r, world, equal=False) for r in range(world)])
    assert sorted(flat.tolist()) == list(range(n))


def test_digits_split_is_fixed_and_disjoint():
    w = workloads.get("digits-mlp")
    a, b = (w.load(None, "train", r, 2, {}) for r in range(2))
    assert len(a) == len(b) == 719
    test = w.load(None, "test", 0, 1, {})
    assert len(test) == 359
    rows = {row.tobytes() for row in np.concatenate([a.x, b.x])}
    assert len(rows) > 1300  # shards differ (digits has few exact duplicates)
    assert a.x.dtype == np.float32 and a.x.max() <= 1.0


def test_digits_read_directly_equal_scikit_learns_loader():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from workloads import digits

    pixels, labels = digits._raw_digits()
    ds = load_digits()
    assert np.array_equal(pixels, ds.data) and np.array_equal(labels, ds.target)
    # ... and loading them in a fresh process does not import scikit-learn (~1 s per worker start).
    code = ("import sys, workloads; workloads.get('digits-mlp').load(None, 'train', 0, 1, {}); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_folder(tmp_path, gz):
    folder = write_mnist_idx(str(tmp_path / "mnist"), n_train=100, n_test=30, gz=gz)
    w = workloads.get("mnist-cnn")
    w.check_data(folder, {})
    s0, s1 = w.load(folder, "train", 0, 2, {}), w.load(folder, "train", 1, 2, {})
    assert s0.x.shape == (50, 1, 28, 28) and len(s1) == 50
    t = w.load(folder, "test", 0, 1, {})
    assert len(t) == 30 and set(t.y.tolist()) <= set(range(10))


def test_mnist_npz(tmp_path):
    path = write_mnist_npz(str(tmp_path / "mnist.npz"), n_train=40, n_test=10)
    w = workloads.get("mnist-mlp")
    w.check_data(path, {})
    w.check_data(str(tmp_path), {})  # a folder holding mnist.npz
    assert len(w.load(path, "train", 1, 4, {})) == 10


def test_mnist_errors_name_the_file(tmp_path):
    w = workloads.get("mnist-mlp")
    with pytest.raises(workloads.DataError, match="needs --data"):
        w.check_data(None, {})
    with pytest.raises(workloads.DataError, match="does not exist"):
        w.check_data(str(tmp_path / "nowhere"), {})
    folder = write_mnist_idx(str(tmp_path / "m"), n_train=20, n_test=10)
    os.remove(os.path.join(folder, "t10k-labels-idx1-ubyte"))
    with pytest.raises(workloads.DataError, match="t10k-labels-idx1-ubyte.*not found"):
        w.check_data(folder, {})
    folder = write_mnist_idx(str(tmp_path / "t"), n_train=20, n_test=10)
    path = os.path.join(folder, "train-images-idx3-ubyte")
    with open(path, "r+b") as f:
        f.truncate(500)
    with pytest.raises(workloads.DataError, match="train-images-idx3-ubyte holds 500 bytes.*truncated"):
        w.check_data(folder, {})
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 not an idx file at all")
    with pytest.raises(workloads.DataError, match="not an IDX file"):
        w.check_data(folder, {})


def test_mnist_truncated_gzip(tmp_path):
    folder = write_mnist_idx(str(tmp_path / "g"), n_train=20, n_test=10, gz=True)
    path = os.path.join(folder, "train-labels-idx1-ubyte.gz")
    with gzip.open(path, "wb") as f:
        f.write(b"\x00\x00\x08\x01\x00\x00\x00\x14" + b"\x01" * 5)  # header says 20 labels, 5 follow
    with pytest.raises(workloads.DataError, match="truncated or corrupt"):
        workloads.get("mnist-mlp").check_data(folder, {})


@pytest.mark.parametrize("kind", ["folder", "parent", "tar"])
def test_cifar_layouts(tmp_path, kind):
    if kind == "tar":
        data = write_cifar_tar(str(tmp_path / "cifar-10-python.tar.gz"), per_batch=20, n_test=10)
    else:
        folder = write_cifar_folder(str(tmp_path), per_batch=20, n_test=10)
        data = folder if kind == "folder" else str(tmp_path)
    w = workloads.get("cifar10-cnn")
    w.check_data(data, {})
    train = w.load(data, "train", 0, 2, {})
    assert train.x.shape == (50, 3, 32, 32) and train.x.dtype == np.float32
    assert len(w.load(data, "test", 0, 1, {})) == 10


def test_cifar_rejects_bad_and_hostile_pickles(tmp_path):
    folder = write_cifar_folder(str(tmp_path), per_batch=5, n_test=5)
    w = workloads.get("cifar10-cnn")
    with open(os.path.join(folder, "data_batch_3"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(workloads.DataError, match="data_batch_3 is not a CIFAR-10 python batch"):
        w.check_data(folder, {})

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    import pickle
    with open(os.path.join(folder, "data_batch_3"), "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(workloads.DataError, match="refusing to load"):
        w.check_data(folder, {})
    os.remove(os.path.join(folder, "test_batch"))
    with pytest.raises(workloads.DataError, match="test_batch not found"):
        w.load(folder, "test", 0, 1, {})
    assert "cifar-10-batches-py" in CIFAR_HELP


def test_synthetic_shards_and_models():
    import torch

    w = workloads.get("resnet18-synthetic")
    params = w.resolve_params({"image_size": "32", "num_samples": "10", "num_classes": "7"})
    train = w.load(None, "train", 1, 3, params)
    assert train.x.shape == (3, 3, 32, 32) and train.y.max() < 7
    model = w.torch_model(params)
    assert model(torch.from_numpy(train.x)).shape == (3, 7)


def test_resnet_parameter_counts_match_published():
    from workloads.torch_models import resnet18, resnet50

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(resnet18(1000)) == 11_689_512
    assert count(resnet50(1000)) == 25_557_032


def test_mnist_labels_out_of_range(tmp_path):
    from datafiles import idx_bytes

    folder = write_mnist_idx(str(tmp_path / "m"), n_train=20, n_test=10)
    with open(os.path.join(folder, "train-labels-idx1-ubyte"), "wb") as f:
        f.write(idx_bytes(np.full(20, 12, dtype=np.uint8)))
    with pytest.raises(workloads.DataError, match="train-labels-idx1-ubyte: MNIST labels must be 0..9, found 12..12"):
        workloads.get("mnist-cnn").check_data(folder, {})


@pytest.mark.parametrize("name,params", [
    ("digits-mlp", {}), ("mnist-mlp", {}), ("mnist-cnn", {}), ("cifar10-cnn", {}),
    ("resnet18-synthetic", {"image_size": "32", "num_classes": "1000"}),
    ("resnet50-synthetic", {"image_size": "32", "num_classes": "1000"}),
])
def test_tensorflow_model_matches_torch_model(name, params):
    """Same architecture in both frameworks: equal trainable parameter counts and output shapes
    on the same (channels-first) inputs."""
    import torch

    w = workloads.get(name)
    assert "tensorflow" in w.frameworks
    p = w.resolve_params(params)
    tf_model, torch_model = w.tf_model(p), w.torch_model(p)
    trainable = sum(int(np.prod(v.shape)) for v in tf_model.trainable_weights)
    assert trainable == sum(t.numel() for t in torch_model.parameters())
    x = np.random.default_rng(0).standard_normal((2, *w.input_shape(p))).astype(np.float32)
    assert tuple(tf_model(x).shape) == tuple(torch_model(torch.from_numpy(x)).shape) == (2, w.num_classes(p))


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "as an .npz file (File is not a zip file)"),
    ("objects", "cannot read x_train from"),
])
def test_a_damaged_mnist_npz_is_one_clear_error(tmp_path, damage, needle):
    x, y = np.zeros((10, 28, 28), np.uint8), np.zeros(10, np.int64)
    path = tmp_path / "mnist.npz"
    if damage == "objects":
        np.savez(path, x_train=np.array([1, "a"], dtype=object), y_train=y, x_test=x, y_test=y)
    else:
        np.savez(path, x_train=x, y_train=y, x_test=x, y_test=y)
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(workloads.DataError, match=re.escape(needle)):
        workloads.get("mnist-mlp").check_data(str(path), {})
