"""Framework-agnostic training workloads, by name.

``workloads.get("digits-mlp")`` returns a :class:`workloads.base.Workload`.
Workloads never import the launcher, Ray or any cloud library; building a
model imports its framework only when it is called.
"""

from workloads.base import DataError, Split, Workload
from workloads.cifar import CifarCNN
from workloads.digits import DigitsMLP
from workloads.mnist import MNIST
from workloads.registry import Registry, UnknownName
from workloads.synthetic import SyntheticResNet

REGISTRY: Registry[Workload] = Registry("workload")
for _w in (DigitsMLP(), MNIST("mlp"), MNIST("cnn"), CifarCNN(), SyntheticResNet(18), SyntheticResNet(50)):
    REGISTRY.register(_w.name, _w)

DEFAULT = "digits-mlp"


def get(name: str) -> Workload:
    """The workload called ``name``; UnknownName lists the valid names."""
    return REGISTRY.get(name)


def names() -> list[str]:
    return REGISTRY.names()


__all__ = ["DataError", "Split", "Workload", "UnknownName", "REGISTRY", "DEFAULT", "get", "names"]
