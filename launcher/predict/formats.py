"""Model formats: how a model folder is loaded, what its instances look like, what it answers.

One registry for ``launcher predict`` and ``launcher serve``. A format turns instances
(as a JSON body or a data file holds them) into the model's input batch, runs the model
on a batch, and turns its outputs back into one prediction per instance:

========== ============================================ ==================================
format     the folder holds                             a prediction
========== ============================================ ==================================
workload   a run's ``model.pt2`` or ``saved_model/``,   a classifier's ``{"prediction",
           with ``model.json`` naming the workload      "scores"}``; otherwise the output
program    a torch training function's ``model.pt2``,   the output (several: by name)
           with ``model.json`` naming its inputs
keras      ``model.keras`` (a Keras training function)  the output (several: by name)
savedmodel ``saved_model.pb`` (TensorFlow, Vertex's     the output (several: by name)
           prebuilt container's format)
sklearn    ``model.joblib`` or ``model.pkl``            what ``model.predict`` gives
xgboost    ``model.bst``                                what ``Booster.predict`` gives (a
                                                        run's classifier: class and scores)
========== ============================================ ==================================

A batch is a dict of arrays, one per named input (``{"x": ...}`` for a model with one), so
requests batched together are joined and split by the same two functions whatever the model.
A model with several named inputs takes each instance as an object (``{"a": [...], "b": 3}``);
a model with one input takes it by that input's name too (``{"x": [...]}``: the name the V2
metadata gives an unnamed input), and a booster or estimator whose features have names, one
object of them per row, as Vertex AI's prebuilt containers take named inputs (:func:`by_name`);
a text input also takes Vertex's ``{"b64": ...}``. Bad instances raise ValueError saying
what was expected (the forms accepted), which the callers turn into a 400 or one line.
"""

from __future__ import annotations

import base64
import os
import pickle
from typing import Any, Callable

import joblib
import numpy as np

Batch = dict[str, np.ndarray]

# name -> (files that mark it, in the order they are looked for)
MARKERS: dict[str, tuple[str, ...]] = {
    "sklearn": ("model.joblib", "model.pkl"),
    "xgboost": ("model.bst",),
    "savedmodel": ("saved_model.pb",),
    "keras": ("model.keras",),
}
ACCEPTED = "model.joblib/model.pkl (scikit-learn), model.bst (XGBoost), saved_model.pb (TensorFlow), model.keras"


def detect(info: dict[str, Any], files: list[str]) -> str | None:
    """The format of a folder whose ``model.json`` says ``info`` (empty without one) and which
    holds ``files``; None when nothing here can be served."""
    if info.get("framework") == "xgboost" and "model.bst" in files:
        return "xgboost"
    if info.get("input_shape") is not None and info.get("workload") and info.get("kind") != "training function":
        return "workload"
    if info.get("inputs") and "model.pt2" in files:
        return "program"
    for name, marks in MARKERS.items():
        if any(m in files for m in marks):
            return name
    return None


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


def numeric(instances: Any, width: int | None, what: str) -> np.ndarray:
    """Instances of ``width`` numbers each (a tabular model's rows) as a float32 batch."""
    x = np.asarray(instances)
    if x.dtype.kind not in "iufb":
        if x.dtype == object:
            raise ValueError("instances must be rows of the same length, of numbers")
        raise ValueError(f"instances must be numbers, got {'text' if x.dtype.kind in 'US' else x.dtype}")
    if x.ndim == 1 and width == 1:
        x = x[:, None]  # a one-feature model's instances, each a number
    if x.ndim != 2 or (width is not None and x.shape[1] != width):
        shape = "x".join(map(str, x.shape[1:])) or "a single number"
        raise ValueError(f"each instance must be {width if width is not None else 'a row of'} numbers ({what}), "
                         f"got {shape}")
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("instances hold NaN or infinity")
    return x


class Loaded:
    """A model loaded from ``directory``; see the module's table for what each format takes."""

    format = ""
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


class Workload(Loaded):
    """A run's export: a torch program or a SavedModel, fed through the workload's own
    preprocessing; a classifier answers with softmax scores and the class."""

    format = "workload"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        import workloads

        super().__init__(directory, info)
        self.workload = workloads.get(info["workload"])
        self.params = info.get("params") or {}
        self.classes = info.get("num_classes") if isinstance(info.get("num_classes"), int) else None
        self.shape = tuple(int(d) for d in info["input_shape"])
        self._fn = self._tensorflow() if info.get("framework") == "tensorflow" else self._torch()

    def _torch(self) -> Callable[[np.ndarray], np.ndarray]:
        import torch

        program = torch.export.load(self.path("model.pt2")).module()
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

        def run(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return program(torch.from_numpy(x)).numpy()
        return run

    def _tensorflow(self) -> Callable[[np.ndarray], np.ndarray]:
        from workloads.tf_models import keras, native_stderr_silenced

        with native_stderr_silenced():
            keras()  # the legacy tf.keras, before TensorFlow loads
            import tensorflow as tf

            serve = tf.saved_model.load(self.path("saved_model")).signatures["serving_default"]

        def run(x: np.ndarray) -> np.ndarray:
            return next(iter(serve(x=tf.constant(x)).values())).numpy()
        return run

    def about(self) -> dict[str, Any]:
        return {"format": self.format, "workload": self.info.get("workload"), "framework":
                self.info.get("framework", "torch"), "input_shape": list(self.shape), "classes": self.classes}

    def inputs(self, instances: Any) -> Batch:
        array = _checked(by_name(instances))
        x = self.workload.preprocess(array, self.params)
        if not np.all(np.isfinite(x)):
            raise ValueError("instances hold NaN or infinity")
        return {"x": np.ascontiguousarray(x)}

    def run(self, batch: Batch) -> Batch:
        x = batch["x"]
        if not len(x):
            return {"y": np.zeros((0, self.classes or 1), np.float32)}
        y = np.asarray(self._fn(x), dtype=np.float32)
        if self.classes:
            y = np.exp(y - y.max(axis=1, keepdims=True))
            y /= y.sum(axis=1, keepdims=True)
        return {"y": y}


INPUT = "x"  # the name a model with one unnamed input has in the V2 metadata (launcher.predict.protocols)


def by_name(instances: Any, features: list[str] | None = None) -> Any:
    """Instances sent as objects keyed by the model's input, as Vertex AI's prebuilt containers
    take them: ``{"x": value}`` (the name ``GET /v2/models/NAME`` gives a model's one input) or,
    where the model's features have names (a booster or an estimator fitted on a table), one
    ``{feature: number, ...}`` per row. Returns the instances as the plain values the format
    reads; anything that is not an object passes as it is.

    Raises:
        ValueError: an object that is neither: the line names its keys and the accepted forms.
    """
    if not isinstance(instances, list) or not any(isinstance(i, dict) for i in instances):
        return instances
    out = []
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            out.append(instance)
        elif set(instance) == {INPUT}:
            out.append(instance[INPUT])
        elif features and set(instance) == set(features):
            out.append([instance[f] for f in features])
        else:
            keys = ", ".join(f'"{k}"' for k in list(instance)[:5]) or "no keys"
            raise ValueError(f"instances[{i}] is an object with {keys}: {accepted_forms(features)}")
    return out


def accepted_forms(features: list[str] | None = None) -> str:
    """What the 400 of a model without named inputs lists: the instance forms it takes."""
    forms = f'send each instance as its numbers ([...]), or as {{"{INPUT}": [...]}}'
    if features:
        shown = ", ".join(f'"{f}": ...' for f in features[:3]) + (", ..." if len(features) > 3 else "")
        forms += f" or {{{shown}}} by its {len(features)} features' names"
    return forms


def _not_a_number(instances: list) -> str | None:
    """Which element of ``instances`` is neither a number nor a list, said in one line (None
    when all are). Strings are left to the workload's own check, which names the type."""
    stack: list[tuple[str, Any]] = [(f"instances[{i}]", v) for i, v in reversed(list(enumerate(instances)))]
    while stack:
        where, value = stack.pop()
        if value is None or isinstance(value, (dict, bool)):
            kind = "null" if value is None else ("an object" if isinstance(value, dict) else "true/false")
            return f"{where} is {kind}, not a number"
        if isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def _checked(instances: Any) -> np.ndarray:
    """Instances that should be numbers as one array; ValueError naming the first element that
    is not one (null, an object, true/false). Text is left to the format's own check."""
    array = _array(instances)
    if array.dtype.kind not in "iuf" and isinstance(instances, list):
        odd = _not_a_number(instances)  # walked only when not all numbers
        if odd:
            raise ValueError(odd)
    return array


def _array(instances: Any) -> np.ndarray:
    """The instances as one array; ragged lists become an object array (refused later)."""
    try:
        return np.asarray(instances)
    except ValueError:
        return np.asarray(instances, dtype=object)


class Sklearn(Loaded):
    """scikit-learn's ``model.joblib`` / ``model.pkl`` (an estimator or a pipeline), as Vertex
    AI's prebuilt container loads it: unpickled, so only a model you trust."""

    format = "sklearn"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        name = next(m for m in MARKERS["sklearn"] if os.path.exists(self.path(m)))
        if name.endswith(".joblib"):
            self.model = joblib.load(self.path(name))
        else:
            with open(self.path(name), "rb") as f:
                self.model = pickle.load(f)  # noqa: S301 - the user's own model, as Vertex loads it
        if not callable(getattr(self.model, "predict", None)):
            raise ValueError(f"{name} holds a {type(self.model).__name__}, which has no predict method")
        self.width = getattr(self.model, "n_features_in_", None)

    def about(self) -> dict[str, Any]:
        return {"format": self.format, "estimator": type(self.model).__name__, "features": self.width}

    def inputs(self, instances: Any) -> Batch:
        features = getattr(self.model, "feature_names_in_", None)
        instances = by_name(instances, [str(f) for f in features] if features is not None else None)
        array = _array(instances)
        if array.dtype.kind in "US" and array.ndim == 1:
            return {"x": array}  # a text pipeline's documents
        return {"x": numeric(_checked(instances), self.width, f"the {type(self.model).__name__}'s features")}

    def run(self, batch: Batch) -> Batch:
        return {"y": np.asarray(self.model.predict(batch["x"]))}


class XGBoost(Loaded):
    """XGBoost's ``model.bst``: a booster over rows of features. A run's classifier (its
    ``model.json`` names the classes) answers with the class and the scores."""

    format = "xgboost"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        import xgboost as xgb

        super().__init__(directory, info)
        self.booster = xgb.Booster()
        with open(self.path("model.bst"), "rb") as f:  # bytes: XGBoost guesses the format from them, silently
            self.booster.load_model(bytearray(f.read()))
        self.width = self.booster.num_features()
        self.objective = info.get("objective") or ""
        classes = info.get("num_classes")
        self.classes = classes if isinstance(classes, int) and classes >= 2 and (
            self.objective.startswith("binary:logistic") or self.objective == "multi:softprob") else None

    def about(self) -> dict[str, Any]:
        return {"format": self.format, "features": self.width, "objective": self.objective or None,
                "classes": self.classes}

    def inputs(self, instances: Any) -> Batch:
        instances = by_name(instances, self.booster.feature_names)
        return {"x": numeric(_checked(instances), self.width, "the booster's features")}

    def run(self, batch: Batch) -> Batch:
        import xgboost as xgb

        matrix = xgb.DMatrix(batch["x"], feature_names=self.booster.feature_names)
        y = np.asarray(self.booster.predict(matrix), dtype=np.float32)
        if self.classes and y.ndim == 1:  # binary: the positive class's probability
            y = np.stack([1 - y, y], axis=1)
        return {"y": y}


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


def _tensorflow():
    from workloads.tf_models import keras, native_stderr_silenced

    with native_stderr_silenced():
        keras()  # the legacy tf.keras, before TensorFlow loads
        import tensorflow as tf
    return tf


class SavedModel(Named):
    """A TensorFlow SavedModel's ``serving_default`` signature (``saved_model.pb``)."""

    format = "savedmodel"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        tf = self.tf = _tensorflow()
        from workloads.tf_models import native_stderr_silenced

        with native_stderr_silenced():
            loaded = tf.saved_model.load(directory)
        if "serving_default" not in loaded.signatures:
            raise ValueError("saved_model.pb has no serving_default signature to call")
        self._loaded = loaded  # the signature needs its variables alive
        self.fn = loaded.signatures["serving_default"]
        _, named = self.fn.structured_input_signature
        self.specs = [(n, tuple(s.shape[1:]), np.dtype(s.dtype.as_numpy_dtype)) for n, s in sorted(named.items())]

    def run(self, batch: Batch) -> Batch:
        tf = self.tf
        args = {n: tf.constant(batch[n], dtype=next(t for m, _, t in self.specs if m == n)
                               if batch[n].dtype != object else tf.string) for n in batch}
        return {k: v.numpy() for k, v in sorted(self.fn(**args).items())}


class Keras(Named):
    """A Keras model saved as ``model.keras`` (what a Keras training function exports)."""

    format = "keras"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        _tensorflow()
        from workloads.tf_models import keras, native_stderr_silenced

        with native_stderr_silenced():
            self.model = keras().models.load_model(self.path("model.keras"), compile=False)
        self.specs = [(t.name.split(":")[0], tuple(t.shape[1:]), np.dtype(t.dtype.as_numpy_dtype))
                      for t in self.model.inputs]
        self.outputs = list(self.model.output_names)

    def run(self, batch: Batch) -> Batch:
        x = [batch[n] for n, _, _ in self.specs]
        y = self.model(x[0] if len(x) == 1 else x, training=False)
        ys = y if isinstance(y, (list, tuple)) else [y]
        return {name: np.asarray(v) for name, v in zip(self.outputs, ys)}


class Program(Named):
    """A torch training function's ``torch.export`` program, its inputs as ``model.json``
    describes them (the names of its forward's arguments)."""

    format = "program"

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        import torch

        super().__init__(directory, info)
        self.torch = torch
        self.module = torch.export.load(self.path("model.pt2")).module()
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        self.specs = [(i["name"], tuple(None if d < 0 else d for d in i["shape"][1:]), np.dtype(i["dtype"]))
                      for i in info["inputs"]]
        self.keywords = {i["name"] for i in info["inputs"] if i.get("keyword")}
        self.outputs = [o["name"] for o in info.get("outputs") or [{"name": "output"}]]

    def run(self, batch: Batch) -> Batch:
        torch = self.torch
        tensors = {n: torch.from_numpy(np.ascontiguousarray(batch[n])) for n, _, _ in self.specs}
        with torch.no_grad():
            y = self.module(*[t for n, t in tensors.items() if n not in self.keywords],
                            **{n: t for n, t in tensors.items() if n in self.keywords})
        ys = list(y.values()) if isinstance(y, dict) else list(y) if isinstance(y, (list, tuple)) else [y]
        return {name: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                for name, v in zip(self.outputs, ys)}


FORMATS: dict[str, type[Loaded]] = {"workload": Workload, "program": Program, "sklearn": Sklearn, "xgboost": XGBoost,
                                     "savedmodel": SavedModel, "keras": Keras}


def load(name: str, directory: str, info: dict[str, Any]) -> Loaded:
    return FORMATS[name](directory, info)
