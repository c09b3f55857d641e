"""A regression workload in the launcher's managed loop: scikit-learn's diabetes data.

442 patients, 10 standardised measurements each, and a number to predict: how far
the disease progressed a year later. Nothing here is a classifier: the workload
brings its own loss (mean squared error), its own metrics (MAE in the target's
units, R²), its own optimizer (AdamW) and a cosine learning-rate schedule; the
launcher's loop does the rest (resume, checkpoints, the preemption notice,
``--precision``, ``--grad-clip``, ``--grad-accumulation``). With ``--framework tensorflow``
the same workload trains a Keras model compiled with its own loss and metrics
(``tf_compile``)::

    launcher run --workload examples/diabetes_regression.py:DIABETES --workers 2
    launcher run --workload examples/diabetes_regression.py:DIABETES --workers 2 --framework tensorflow
    launcher tune --workload examples/diabetes_regression.py:DIABETES --config tune.yaml   # rank by r2

The data ships inside scikit-learn's wheel: nothing is downloaded.
"""

from __future__ import annotations

import functools

import numpy as np

import workloads
from workloads import Defaults, Param, Workload

TEST_EVERY = 5  # every 5th patient is held out


@functools.lru_cache(maxsize=1)
def _data() -> tuple[np.ndarray, np.ndarray, float, float]:
    """Features and standardised targets of all 442 patients, and the targets' mean and std."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    train = np.arange(len(y)) % TEST_EVERY != 0
    mean, std = float(y[train].mean()), float(y[train].std())
    x = (x - x[train].mean(0)) / x[train].std(0)
    return x.astype(np.float32), ((y - mean) / std).astype(np.float32), mean, std


class DiabetesRegression(Workload):
    def __init__(self) -> None:
        super().__init__(name="diabetes-regression", description="disease progression from 10 measurements "
                         "(scikit-learn's diabetes data; MSE loss, MAE and R² metrics)",
                         frameworks=("torch", "tensorflow"),
                         defaults=Defaults(epochs=40, batch_size=16, lr=0.003),
                         params=(Param("hidden", int, 32, "hidden units"),
                                 Param("weight_decay", float, 0.01, "AdamW's weight decay")))

    def load(self, data, split, rank, world_size, params):
        x, y, _, _ = _data()
        keep = (np.arange(len(y)) % TEST_EVERY != 0) if split == "train" else (np.arange(len(y)) % TEST_EVERY == 0)
        return workloads.shard(x[keep], y[keep], split, rank, world_size)

    def samples(self, data, split, params):
        n = len(_data()[1])
        return n - -(-n // TEST_EVERY) if split == "train" else -(-n // TEST_EVERY)

    def input_shape(self, params):
        return (10,)

    def torch_model(self, params):
        import torch.nn as nn

        return nn.Sequential(nn.Linear(10, params["hidden"]), nn.ReLU(), nn.Linear(params["hidden"], 1),
                             nn.Flatten(0))  # (N, 1) -> (N,): one prediction per patient

    def torch_loss(self, outputs, labels, params):
        import torch.nn.functional as F

        return F.mse_loss(outputs, labels)

    def torch_metrics(self, outputs, labels, params):
        _, _, _, std = _data()
        errors = outputs - labels
        spread = ((labels - labels.mean()) ** 2).sum()
        return {"loss": float((errors ** 2).mean()),
                "mae": float(errors.abs().mean()) * std,  # in the target's own units
                "r2": 1.0 - float((errors ** 2).sum() / spread)}

    def torch_optimizer(self, parameters, lr, params):
        import torch

        return torch.optim.AdamW(parameters, lr=lr, weight_decay=params["weight_decay"])

    def torch_scheduler(self, optimizer, total_steps, params):
        import torch

        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    # -- the same with TensorFlow (--framework tensorflow): a Keras model and its compile arguments
    def tf_model(self, params):
        k = workloads.keras()
        return k.Sequential([k.layers.Input((10,)), k.layers.Dense(params["hidden"], activation="relu"),
                             k.layers.Dense(1)])

    def tf_compile(self, params):
        return {"loss": "mse", "metrics": [mae, workloads.keras().metrics.R2Score(name="r2")]}


def mae(y_true, y_pred):
    """Mean absolute error in the target's own units (the model learns standardised targets)."""
    import tensorflow as tf

    return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1) * _data()[3]


DIABETES = DiabetesRegression()
