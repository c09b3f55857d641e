"""digits-mlp: scikit-learn's bundled 8x8 handwritten digits and an MLP.

The data ship inside scikit-learn's wheel (1,797 images, 10 classes), so this
workload needs no download and no files: it is the launcher's embedded default.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from workloads.base import Defaults, Split, Workload, as_batch, check_split_name, take

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # fixed: the train/test split never depends on the run's seed


def _shipped_csv() -> str | None:
    """Path of the digits file inside the installed scikit-learn, found without importing it."""
    found = importlib.util.find_spec("sklearn")
    for folder in (found.submodule_search_locations or []) if found else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels as float64, labels): what sklearn.datasets.load_digits returns.

    Importing scikit-learn takes ~1.2 s of CPU and every worker pays it on every
    (re)start, so the file it ships (one row per image: 64 pixels, then the label)
    is read directly; scikit-learn's loader is the fallback if the file moved.
    """
    path = _shipped_csv()
    if path is not None:
        try:
            table = np.loadtxt(path, delimiter=",")
        except ValueError:  # a layout this code does not know: let scikit-learn read it
            table = None
        if table is not None and table.ndim == 2 and table.shape[1] == 65 and set(np.unique(table[:, -1])) <= set(
                range(10)):
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    ds = load_digits()
    return ds.data, ds.target


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    pixels, labels = _raw_digits()
    x = (pixels / 16.0).astype(np.float32)  # pixel values are 0..16
    y = labels.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = int(round(len(y) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


class DigitsMLP(Workload):
    def __init__(self) -> None:
        super().__init__(
            name="digits-mlp",
            description="scikit-learn's 8x8 digits (1,438 train / 359 test) with a 2-layer MLP",
            defaults=Defaults(epochs=10, batch_size=32, lr=0.002, optimizer="adam"),
        )

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        check_split_name(split)
        xtr, ytr, xte, yte = _digits()
        x, y = (xtr, ytr) if split == "train" else (xte, yte)
        return take(x, y, split, rank, world_size)

    def preprocess(self, x: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
        """Raw pixel values 0..16 (scikit-learn's load_digits().data), as training scales them."""
        return (as_batch(x, (64,)) / 16.0).astype(np.float32)

    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        return (64,)

    def num_classes(self, params: Mapping[str, Any]) -> int:
        return 10

    def torch_model(self, params: Mapping[str, Any]):
        from workloads.torch_models import MLP

        return MLP(64, (128, 64), 10)

    def tf_model(self, params: Mapping[str, Any]):
        from workloads.tf_models import mlp

        return mlp((64,), (128, 64), 10)
