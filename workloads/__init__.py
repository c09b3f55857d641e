"""Framework-agnostic training workloads, by name: the built-in ones and the user's own.

``workloads.get("digits-mlp")`` returns a :class:`workloads.base.Workload`;
``workloads.get("path/to/my_workload.py:NAME")`` or ``get("package.module:NAME")``
imports a user's workload (:mod:`workloads.user`). The built-in workloads use
the same API a user writes against: :class:`Workload` with :class:`Defaults`,
:class:`Param` and :func:`shard`. Workloads never import the launcher, Ray or
any cloud library; building a model imports its framework only when it is called.
"""

from workloads.base import DataError, DatasetSplit, Defaults, Param, Split, Workload, shard
from workloads.cifar import CifarCNN
from workloads.function import TrainingFunction, training_function
from workloads.digits import DigitsMLP
from workloads.mnist import MNIST
from workloads.registry import Registry, UnknownName
from workloads.synthetic import SyntheticResNet
from workloads.tabular import Tabular
from workloads.tf_models import keras
from workloads.user import WorkloadError, is_reference, load_reference

REGISTRY: Registry[Workload] = Registry("workload")
for _w in (DigitsMLP(), MNIST("mlp"), MNIST("cnn"), CifarCNN(), SyntheticResNet(18), SyntheticResNet(50),
           Tabular()):
    REGISTRY.register(_w.name, _w)

DEFAULT = "digits-mlp"


def get(name: str) -> Workload:
    """The workload called ``name``, or the user's workload a ``FILE.py:NAME`` /
    ``module:NAME`` reference names.

    Raises:
        UnknownName: no built-in workload has that name (the message lists them).
        WorkloadError: the user's workload cannot be imported or lacks a part.
    """
    if is_reference(name):
        return load_reference(name)
    return REGISTRY.get(name)


def is_ray_train(name: str) -> bool:
    """Whether the workload ``name`` is a Ray Train function (``def f(config)``)."""
    from workloads.function import RAY_TRAIN

    return is_reference(name) and getattr(get(name), "kind", None) == RAY_TRAIN


def names() -> list[str]:
    return REGISTRY.names()


__all__ = ["DataError", "DatasetSplit", "Defaults", "Param", "Split", "Workload", "WorkloadError", "UnknownName",
           "REGISTRY", "DEFAULT", "TrainingFunction", "get", "is_ray_train", "keras", "names", "shard",
           "training_function"]
