"""What a checkpoint folder and an exported model hold, per framework.

File names and the plain-array format shared by the training loops (which
write and restore checkpoints) and the export (which reads the final one).
Nothing here imports a framework.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

# torch: state dicts saved with torch.save, plus each rank's RNG state.
TORCH_MODEL_FILE = "model.pt"
TORCH_OPTIMIZER_FILE = "optimizer.pt"
# TensorFlow (launcher.worker.tf_session): every registered object's variables as plain arrays,
# readable without a distribution strategy, and which arrays are whose; each rank's running metrics.
TF_STATE_FILE = "tf_state.npz"
TF_INDEX_FILE = "tf_state.json"
TF_MODEL_FILE = "model.weights.npz"  # an exported model's weights


def torch_rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def tf_rank_file(rank: int) -> str:
    return f"tf_rank{rank}.npz"


def tf_model_arrays(directory: str) -> list[np.ndarray]:
    """The model's variables in a TensorFlow checkpoint folder, in the model's order."""
    with open(os.path.join(directory, TF_INDEX_FILE), encoding="utf-8") as f:
        index = json.load(f)
    lo, n = index["objects"][index["model"]]
    return load_arrays(os.path.join(directory, TF_STATE_FILE))[lo:lo + n]


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
