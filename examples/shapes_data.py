"""What the two example workloads share: their data (16x16 images of three shapes in one
.npz file) and a workload base class that reads it; each example adds its model.

`python examples/shapes_data.py DIR` writes DIR/shapes.npz (x_train, y_train, x_test,
y_test); the example workloads also write it themselves, under ~/.cache, when no --data
is given. Classes: 0 a square outline, 1 a filled disc, 2 an X. Position and size vary,
and there is pixel noise, so a model has something to learn. This module sits beside
the examples and travels with them to every node.
"""

import os
import sys

import numpy as np

import workloads

SIZE = 16
FILE = "shapes.npz"


def draw(kind: int, rng: np.random.Generator) -> np.ndarray:
    img = np.zeros((SIZE, SIZE), np.float32)
    r = int(rng.integers(3, 6))
    cy, cx = (int(v) for v in rng.integers(r, SIZE - r, 2))
    yy, xx = np.mgrid[:SIZE, :SIZE]
    if kind == 0:  # square outline
        inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
        img[inside & ~((abs(yy - cy) < r) & (abs(xx - cx) < r))] = 1.0
    elif kind == 1:  # filled disc
        img[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 1.0
    else:  # X
        for d in range(-r, r + 1):
            img[cy + d, cx + d] = img[cy + d, cx - d] = 1.0
    return np.clip(img + rng.normal(0, 0.2, img.shape), 0, 1).astype(np.float32)


def make(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = np.stack([draw(int(k), rng) for k in y])[:, None]  # channels first: (n, 1, 16, 16)
    return x, y.astype(np.int64)


def write(folder: str) -> str:
    """Write folder/shapes.npz (atomically: workers may race to it) and return its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, FILE)
    if not os.path.exists(path):
        (xtr, ytr), (xte, yte) = make(3000, 0), make(600, 1)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez_compressed(tmp, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
        os.replace(tmp, path)
    return path


def load(data: str | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The split's images and labels, from DATA/shapes.npz (or the cached copy when data is None)."""
    folder = data or os.path.join(os.path.expanduser("~"), ".cache", "launcher-examples")
    path = os.path.join(folder, FILE) if data else write(folder)
    with np.load(path) as f:
        return f[f"x_{split}"], f[f"y_{split}"]


class ShapesWorkload(workloads.Workload):
    """The data half of a shapes workload: this rank's shard of shapes.npz."""

    def load(self, data, split, rank, world_size, params):
        x, y = load(data, split)
        return workloads.shard(x, y, split, rank, world_size)

    def input_shape(self, params):
        return (1, SIZE, SIZE)  # channels first, in both frameworks

    def num_classes(self, params):
        return 3


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else "."))
