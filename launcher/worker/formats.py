"""What a checkpoint folder and an exported model hold, per framework.

File names and the plain-array format shared by the training loops (which
write and restore checkpoints) and the export (which reads the final one).
Nothing here imports a framework.
"""

from __future__ import annotations

import hashlib

import numpy as np

# torch: state dicts saved with torch.save, plus each rank's RNG state.
TORCH_MODEL_FILE = "model.pt"
TORCH_OPTIMIZER_FILE = "optimizer.pt"
# TensorFlow: every variable as plain arrays, readable without a distribution strategy.
TF_MODEL_FILE = "model.weights.npz"
TF_OPTIMIZER_FILE = "optimizer.npz"


def torch_rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_arrays(path: str, arrays: list[np.ndarray]) -> None:
    np.savez(path, **{f"a{i:04d}": a for i, a in enumerate(arrays)})


def load_arrays(path: str) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"a{i:04d}"] for i in range(len(f.files))]


def arrays_digest(arrays: list[np.ndarray]) -> str:
    """sha256 over arrays (dtypes, shapes and bytes, in order)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
