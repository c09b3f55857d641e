"""The workload interface: data shards and models, free of any launcher concern.

A workload is a named training problem. It knows how to check and load its
data (only the shard a given rank needs), which hyper-parameters suit it, and
how to build its model for each framework it supports. It knows nothing of
Ray, Horovod, storage or clusters: the launcher drives it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np


class DataError(ValueError):
    """Data files are missing or not in the expected format.

    The message names the file, what was expected and how to fix it, so the
    launcher can show it to the user as it is.
    """


@dataclass(frozen=True)
class Param:
    """A workload-specific parameter users may set with ``--param name=value``."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str


@dataclass(frozen=True)
class Split:
    """One rank's share of a data split: inputs ``x`` (float32) and labels ``y`` (int64)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} inputs but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)


def shard_indices(n: int, rank: int, world_size: int, *, equal: bool) -> np.ndarray:
    """Indices of rank's shard of ``n`` samples: every world_size-th sample.

    Shards are disjoint. With ``equal`` every rank gets exactly n // world_size
    samples (at most world_size - 1 samples are left out), which keeps the
    number of steps per epoch the same on every rank, as synchronous training
    requires. Without it the shards cover all samples (for evaluation).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    idx = np.arange(rank, n, world_size)
    if equal:
        idx = idx[: n // world_size]
    return idx


@dataclass(frozen=True)
class Defaults:
    """Hyper-parameters that train this workload well when the user sets none."""

    epochs: int
    batch_size: int
    lr: float
    optimizer: str = "adam"  # adam | sgd (SGD with momentum 0.9)


@dataclass
class Workload:
    """Base class of every workload; subclasses fill in the data and the models."""

    name: str
    description: str
    defaults: Defaults
    frameworks: tuple[str, ...] = ("torch", "tensorflow")
    data_help: str | None = None  # what --data must point at; None: needs no files
    params: tuple[Param, ...] = field(default_factory=tuple)

    @property
    def needs_data(self) -> bool:
        return self.data_help is not None

    # -- parameters -------------------------------------------------------
    def resolve_params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Return every parameter with defaults filled in and values converted.

        Raises:
            KeyError: a parameter this workload does not have (message lists them).
            ValueError: a value that does not convert to the parameter's type.
        """
        known = {p.name: p for p in self.params}
        out = {p.name: p.default for p in self.params}
        for key, value in given.items():
            if key not in known:
                valid = ", ".join(sorted(known)) or "none"
                raise KeyError(f"workload {self.name} has no parameter {key!r} (it has: {valid})")
            try:
                out[key] = known[key].type(value) if isinstance(value, str) else value
            except (TypeError, ValueError) as exc:
                raise ValueError(f"parameter {key}={value!r}: {exc}") from None
        return out

    # -- data ---------------------------------------------------------------
    def check_data(self, data: str | None, params: Mapping[str, Any]) -> None:
        """Raise DataError unless ``data`` holds what this workload reads.

        Cheap checks (files present, headers, sizes) that run on the driver
        before any worker starts.
        """
        if self.needs_data and not data:
            raise DataError(f"workload {self.name} needs --data: {self.data_help}")

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        """Load ``split`` ("train" or "test") for one rank.

        The train shard has the same length on every rank; the test shards
        together cover the whole test split exactly once.
        """
        raise NotImplementedError

    # -- models -------------------------------------------------------------
    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        raise NotImplementedError

    def num_classes(self, params: Mapping[str, Any]) -> int:
        raise NotImplementedError

    def torch_model(self, params: Mapping[str, Any]):
        """A fresh, randomly initialised torch.nn.Module producing class logits."""
        raise NotImplementedError

    def tf_model(self, params: Mapping[str, Any]):
        """A fresh tf.keras model (legacy Keras, see workloads.tf_models) producing class logits.

        It takes the same inputs as the torch model (channels-first images).
        """
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "frameworks": list(self.frameworks),
            "data": self.data_help or "none (built in)",
            "params": {p.name: {"default": p.default, "help": p.help} for p in self.params},
            "defaults": dataclasses.asdict(self.defaults),
        }


def take(x: np.ndarray, y: np.ndarray, split_kind: str, rank: int, world_size: int) -> Split:
    """Cut rank's shard out of a whole split (train shards equal, test shards covering)."""
    idx = shard_indices(len(y), rank, world_size, equal=(split_kind == "train"))
    return Split(np.ascontiguousarray(x[idx], dtype=np.float32), np.asarray(y[idx], dtype=np.int64))


def check_split_name(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
