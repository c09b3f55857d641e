"""The model and the data: an MLP on scikit-learn's 8x8 digits (shipped with scikit-learn)."""

import numpy as np
import torch
from sklearn.datasets import load_digits


def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test) as tensors: 80/20 split, pixels scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]
    return torch.from_numpy(x[train]), torch.from_numpy(y[train]), torch.from_numpy(x[test]), torch.from_numpy(y[test])


def build_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())
