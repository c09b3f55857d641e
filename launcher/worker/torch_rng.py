"""A torch rank's random streams (torch's, CUDA's, NumPy's and Python's): seeded alike on every
rank, saved with each checkpoint and set back on resume (:class:`launcher.worker.session.TorchSession`)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np

from launcher.worker.formats import torch_rng_file


def states() -> dict[str, Any]:
    import torch

    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_states(states: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        np.random.set_state(states["numpy"])
        random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def seed_all(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def save(directory: str, rank: int, epoch_so_far: dict[str, Any]) -> str:
    """Write ``rank``'s streams and its share of the epoch's metrics into its file of ``directory``."""
    import torch

    path = os.path.join(directory, torch_rng_file(rank))
    torch.save({"rng": states(), "epoch": epoch_so_far}, path)
    return path
