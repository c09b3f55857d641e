"""What every model format shares: the batch, its JSON values, and the loaded model's interface.

A batch is a dict of arrays, one per named input (``{"x": ...}`` for a model with one),
so requests batched together are joined and split by the same two functions whatever
the model. :class:`Loaded` is a loaded model (instances in, a batch through the model,
one answer per row out); :class:`Named` is the part shared by the models whose inputs
have names (a SavedModel's signature, a Keras model, a torch training function's
program): one input takes instances as they are, several take an object each, and a
text input also takes Vertex's ``{"b64": ...}``.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]


def join(batches: list[Batch]) -> Batch:
    """Several requests' batches as one (same names, rows one after the other)."""
    if len(batches) == 1:
        return batches[0]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def split(out: Batch, sizes: list[int]) -> list[Batch]:
    """One model output back into each request's rows."""
    cuts = np.cumsum(sizes)[:-1]
    parts = {k: np.split(v, cuts) for k, v in out.items()}
    return [{k: parts[k][i] for k in out} for i in range(len(sizes))]


def rows(batch: Batch) -> int:
    """How many instances ``batch`` holds."""
    return len(next(iter(batch.values()))) if batch else 0


def plain(value: Any) -> Any:
    """A numpy value as JSON takes it (numbers, lists, text; bytes as text)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "S" or value.dtype.kind == "O":
            return [plain(v) for v in value]
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return plain(value.item())
    return value


def column(values: list) -> np.ndarray:
    """Predictions of any kind (text, numbers, lists, objects) as one column, a value per row."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _one_value(row: np.ndarray) -> Any:
    """A row of one output: a single number stays a number, else a (nested) list."""
    row = np.asarray(row)
    return plain(row.reshape(()) if row.size == 1 and row.ndim <= 1 else row)


class Loaded:
    """A model loaded from ``directory``; see :mod:`launcher.predict.formats` for what each format takes."""

    format = ""
    files: tuple[str, ...] = ()  # the files that mark a folder of this format
    classes: int | None = None  # a classifier's class count: its one output "y" holds each class's score

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        self.directory, self.info = directory, info

    def about(self) -> dict[str, Any]:
        """What ``/healthz`` says of the model: its format, inputs and outputs."""
        return {"format": self.format}

    def inputs(self, instances: Any) -> Batch:
        raise NotImplementedError

    def run(self, batch: Batch) -> Batch:
        raise NotImplementedError

    def answers(self, out: Batch) -> list[Any]:
        """One JSON-ready prediction per row of ``out``."""
        if self.classes:
            return classifier_answers(out["y"])
        names = list(out)
        if len(names) == 1:
            return [_one_value(row) for row in out[names[0]]]
        return [{k: _one_value(out[k][i]) for k in names} for i in range(rows(out))]

    def columns(self, out: Batch) -> dict[str, np.ndarray]:
        """The output columns of batch prediction (one per output; one output is ``prediction``;
        a classifier's: the class and the scores)."""
        if self.classes:
            return {"prediction": out["y"].argmax(axis=1).astype(np.int64),
                    "scores": np.round(out["y"].astype(np.float64), 7)}
        return {"prediction": next(iter(out.values()))} if len(out) == 1 else dict(out)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)


def classifier_answers(scores: np.ndarray) -> list[dict[str, Any]]:
    """AI Platform-style predictions of a classifier: the class and every class's score."""
    classes = scores.argmax(axis=1).tolist()
    rounded = np.round(scores.astype(np.float64), 7).tolist()
    return [{"prediction": c, "scores": row} for c, row in zip(classes, rounded)]


class Named(Loaded):
    """A TensorFlow model with named inputs and outputs (a SavedModel's serving signature or a
    Keras model): one input takes instances as they are, several take an object each."""

    specs: list[tuple[str, tuple, np.dtype]]  # (name, shape without the batch, dtype)

    def about(self) -> dict[str, Any]:
        return {"format": self.format, "inputs": [{"name": n, "shape": [d if d is not None else -1 for d in s],
                                                   "dtype": str(t)} for n, s, t in self.specs]}

    def inputs(self, instances: Any) -> Batch:
        if isinstance(instances, np.ndarray):
            instances = list(instances)
        if len(self.specs) == 1 and not (instances and isinstance(instances[0], dict)
                                         and self.specs[0][0] in instances[0]):
            name = self.specs[0][0]
            columns = {name: [self._value(i, name, v) for i, v in enumerate(instances)]}
        else:
            columns = {name: [] for name, _, _ in self.specs}
            for i, instance in enumerate(instances):
                if not isinstance(instance, dict):
                    names = ", ".join(columns)
                    raise ValueError(f"instances[{i}] must be an object with the inputs {names}")
                missing = [n for n in columns if n not in instance]
                if missing:
                    raise ValueError(f"instances[{i}] has no {missing[0]} (the model's inputs: {', '.join(columns)})")
                for name in columns:
                    columns[name].append(self._value(i, name, instance[name]))
        return {name: self._array(name, values) for name, values in columns.items()}

    def _value(self, i: int, name: str, value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"b64"} and isinstance(value["b64"], str):
                try:
                    return base64.b64decode(value["b64"], validate=True)
                except ValueError:
                    raise ValueError(f"instances[{i}] {name}: b64 is not base64") from None
            keys = ", ".join(f'"{k}"' for k in list(value)[:5]) or "no keys"
            whole = len(self.specs) == 1  # the instance itself: it may be given by the input's name
            raise ValueError(f"instances[{i}]{'' if whole else ' ' + name} is an object with {keys}: send "
                             + (f'each instance as the value of {name}, as {{"{name}": value}}' if whole
                                else f"{name}'s value") + ', or bytes as {"b64": ...}')
        return value

    def _array(self, name: str, values: list) -> np.ndarray:
        _, shape, dtype = next(s for s in self.specs if s[0] == name)
        try:
            array = np.asarray(values, dtype=object if dtype.kind in "SOU" else dtype)
        except (ValueError, TypeError):
            raise ValueError(f"{name} must be {dtype} values of shape {_shape(shape)}") from None
        if array.ndim != len(shape) + 1 or any(d is not None and d != a for d, a in zip(shape, array.shape[1:])):
            raise ValueError(f"each instance's {name} must have shape {_shape(shape)}, got "
                             f"{_shape(array.shape[1:])}")
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise ValueError(f"{name} holds NaN or infinity")
        return array


def _shape(shape) -> str:
    return "[" + ", ".join("any" if d is None else str(d) for d in shape) + "]" if len(shape) else "a single value"

