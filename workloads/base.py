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
    """One rank's share of a data split: inputs ``x`` (float32) and labels ``y`` (int64 classes,
    or float32 targets for a workload with a loss of its own)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} inputs but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The inputs and labels at ``idx`` (a batch, in that order)."""
        return self.x[idx], self.y[idx]


class DatasetSplit:
    """One rank's share of a map-style dataset, read item by item: for data that does not fit
    in memory. ``dataset[i]`` returns ``(input, label)`` (numpy arrays, torch tensors or
    numbers); ``len(dataset)`` is its size. A torch ``Dataset`` is one.

    The launcher picks the indices (a pure function of seed, epoch and rank), so a run
    resumed mid-epoch reads exactly the items it would have read.
    """

    def __init__(self, dataset: Any, indices: np.ndarray | None = None) -> None:
        self.dataset = dataset
        self.indices = np.arange(len(dataset)) if indices is None else np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        items = [self.dataset[int(i)] for i in self.indices[np.asarray(idx)]]
        if not items:
            return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
        x = np.stack([np.asarray(_numpy(item[0]), dtype=np.float32) for item in items])
        y = label_array(np.stack([np.asarray(_numpy(item[1])) for item in items]))
        return x, y


class ArraySplit:
    """One rank's share of arrays that stay where they are (an ``np.memmap`` of a file larger
    than memory): rows are read when a batch asks for them."""

    def __init__(self, x: np.ndarray, y: np.ndarray, indices: np.ndarray) -> None:
        self.x, self.y, self.indices = x, y, np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self.indices[np.asarray(idx)]
        return np.asarray(self.x[rows], dtype=np.float32), label_array(self.y[rows])


def label_array(y: Any) -> np.ndarray:
    """Labels as the loop takes them: integers (classes) as int64, real numbers (regression
    targets) as float32."""
    y = np.asarray(y)
    if y.dtype.kind in "fc":
        return np.ascontiguousarray(y, dtype=np.float32)
    return np.ascontiguousarray(y, dtype=np.int64)


def _numpy(value: Any) -> Any:
    """A torch tensor (on any device) as numpy; anything else as it is."""
    detach = getattr(value, "detach", None)
    return detach().cpu().numpy() if callable(detach) else value


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
    data_optional: bool = False  # reads --data when given, and has data of its own without it

    @property
    def needs_data(self) -> bool:
        return self.data_help is not None and not self.data_optional

    @property
    def reads_data(self) -> bool:
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

    def samples(self, data: str | None, split: str, params: Mapping[str, Any]) -> int | None:
        """How many samples ``split`` holds, when that is cheap to know (None: unknown).
        The launcher refuses a run with more workers than training samples up front."""
        return None

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        """Load ``split`` ("train" or "test") for one rank.

        The train shard has the same length on every rank; the test shards
        together cover the whole test split exactly once.
        """
        raise NotImplementedError

    # -- models -------------------------------------------------------------
    def preprocess(self, x: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
        """Instances as a user sends them for prediction (raw, as the data files hold them)
        -> the model's input batch, float32 of shape (N, *input_shape). The default: the
        values as they are, each instance flat or already shaped."""
        return as_batch(x, self.input_shape(params))

    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        raise NotImplementedError

    def num_classes(self, params: Mapping[str, Any]) -> int:
        raise NotImplementedError

    def torch_model(self, params: Mapping[str, Any]):
        """A fresh, randomly initialised torch.nn.Module producing class logits (or, with a
        loss of your own, whatever that loss takes)."""
        raise NotImplementedError

    # -- how the managed torch loop trains it (the defaults make a classifier) --------------
    def torch_loss(self, outputs, labels, params: Mapping[str, Any]):
        """The training loss of a batch: a scalar tensor. Default: cross-entropy of class logits.
        Override it (e.g. ``F.mse_loss``) and the workload is no longer a classifier: its labels
        may be any numbers, and it needs no ``num_classes``."""
        import torch.nn.functional as F

        return F.cross_entropy(outputs, labels)

    def torch_metrics(self, outputs, labels, params: Mapping[str, Any]) -> dict[str, float]:
        """Metrics of one rank's whole test shard (its outputs and labels, concatenated): name ->
        number. The launcher averages each over the ranks, weighted by shard size, and reports it
        after every epoch; ``launcher tune`` may rank by any of them. Default: loss and accuracy."""
        out = {"loss": float(self.torch_loss(outputs, labels, params))}
        if self.is_classifier:
            out["accuracy"] = int((outputs.argmax(1) == labels).sum()) / max(1, len(labels))
        return out

    def torch_optimizer(self, parameters, lr: float, params: Mapping[str, Any]):
        """The optimizer over ``parameters`` at learning rate ``lr``. Default: by
        ``defaults.optimizer``, Adam or SGD with momentum 0.9."""
        import torch

        if self.defaults.optimizer == "sgd":
            return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
        return torch.optim.Adam(parameters, lr=lr)

    def torch_scheduler(self, optimizer, total_steps: int, params: Mapping[str, Any]):
        """A learning-rate scheduler stepped after every optimizer step (``total_steps`` in the
        run), or None (the default: a fixed learning rate). Its state is checkpointed."""
        return None

    @property
    def is_classifier(self) -> bool:
        """Whether the labels are classes (the default loss); a workload with its own loss is not."""
        return type(self).torch_loss is Workload.torch_loss and type(self).tf_compile is Workload.tf_compile

    def tf_compile(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The Keras compile arguments of the TensorFlow model: ``loss`` (a Keras loss: a name, a
        function ``(y_true, y_pred)`` or a ``Loss``) and ``metrics`` (Keras metrics: names,
        functions or ``Metric`` objects), reported on the test split after every epoch (each
        rank scores its shard; averaged over the ranks by shard size) with the loss as ``loss``.
        Default: cross-entropy of class logits and accuracy. Override it and the workload is no
        longer a classifier (its labels may be any numbers)."""
        from workloads.tf_models import keras

        return {"loss": keras().losses.SparseCategoricalCrossentropy(from_logits=True), "metrics": ["accuracy"]}

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
            "data": self.data_help or "no files needed",
            "params": {p.name: {"default": p.default, "help": p.help} for p in self.params},
            "defaults": dataclasses.asdict(self.defaults),
        }


def take(x: np.ndarray, y: np.ndarray, split_kind: str, rank: int, world_size: int) -> Split:
    """Cut rank's shard out of a whole split (train shards equal, test shards covering)."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} inputs but {len(y)} labels in the {split_kind} split")
    idx = shard_indices(len(y), rank, world_size, equal=(split_kind == "train"))
    return Split(np.ascontiguousarray(x[idx], dtype=np.float32), label_array(y[idx]))


def shard(x: Any, y: Any, split: str, rank: int, world_size: int) -> "Split | DatasetSplit":
    """This rank's shard of a whole split, for a workload's ``load``.

    ``x`` and ``y``: inputs and integer labels as arrays (an ``np.memmap`` stays on
    disk, its rows read batch by batch); or ``x`` a map-style
    dataset (``dataset[i] -> (input, label)``, e.g. a torch Dataset) and ``y``
    None, read item by item. Train shards have equal lengths on every rank
    (synchronous training needs the same number of steps); test shards cover
    every sample once.
    """
    check_split_name(split)
    if y is None:
        return DatasetSplit(x, shard_indices(len(x), rank, world_size, equal=(split == "train")))
    if isinstance(x, np.memmap):  # larger than memory: read rows as batches need them
        if len(x) != len(y):
            raise ValueError(f"{len(x)} inputs but {len(y)} labels in the {split} split")
        return ArraySplit(x, np.asarray(y), shard_indices(len(y), rank, world_size, equal=(split == "train")))
    return take(np.asarray(x), np.asarray(y), split, rank, world_size)


def check_split_name(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")


def as_batch(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` as float32 of shape (N, *shape): each instance flat (N, prod(shape)) or already
    shaped. ValueError, naming the shape expected, for anything else."""
    x = np.asarray(x)
    if x.dtype.kind in "USO":
        what = "text" if x.dtype.kind in "US" else "lists of different lengths, or mixed types"
        raise ValueError(f"instances must be numbers, got {what}")
    if x.dtype.kind not in "uifb":
        raise ValueError(f"instances must be numbers, got {x.dtype}")
    size = int(np.prod(shape))
    if x.ndim >= 1 and tuple(x.shape[1:]) == tuple(shape):
        return x.astype(np.float32, copy=False)
    if x.ndim == 2 and x.shape[1] == size:
        return x.reshape(len(x), *shape).astype(np.float32, copy=False)
    raise ValueError(f"each instance must have shape {list(shape)} (or {size} numbers), got "
                     f"{list(x.shape[1:])}")
