"""Gradient-synchronisation backends, by name: ``native`` (Ray Train's DDP and
MultiWorkerMirroredStrategy) and ``horovod`` (ring-allreduce over Gloo).

The interfaces are in :mod:`launcher.backends.base`; framework and backend
libraries are imported inside the methods that need them, so the registry is
cheap to import.
"""

from __future__ import annotations

from launcher.backends.base import Backend, TFComm, TorchComm
from launcher.backends.horovod import HorovodBackend, HorovodComm, HorovodTFComm
from launcher.backends.native import DDPComm, MirroredComm, NativeBackend
from workloads.registry import Registry

__all__ = ["Backend", "TFComm", "TorchComm", "DDPComm", "MirroredComm", "HorovodComm", "HorovodTFComm",
           "REGISTRY", "get"]

REGISTRY: Registry[Backend] = Registry("backend")
REGISTRY.register("native", NativeBackend())
REGISTRY.register("horovod", HorovodBackend())


def get(name: str) -> Backend:
    """The backend called ``name``; UnknownName lists the valid names."""
    return REGISTRY.get(name)
