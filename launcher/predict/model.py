"""A run's exported model, loaded for prediction: find it, check it, run it on a batch.

Every run exports ``<run>/model/`` (see :mod:`launcher.worker.export`): a
``torch.export`` program or a TensorFlow SavedModel, and ``model.json`` (the
workload, its params, the input shape, the classes). :func:`locate` turns
``--model`` (a run folder or its model folder, local or ``gs://``) or
``--run NAME`` into the model folder, checked before any worker starts;
:class:`Model` loads it (a ``gs://`` folder is copied to a local temporary
folder first) and turns raw instances into class scores, with the
workload's own preprocessing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.uri import DEFAULT_STORAGE, normalize_storage

MODEL_DIR = "model"
DESCRIPTION = "model.json"


@dataclass(frozen=True)
class ModelRef:
    """Where a model folder is (a storage root and the parts under it) and what it holds."""

    storage_uri: str
    parts: tuple[str, ...]
    info: dict[str, Any]

    @property
    def uri(self) -> str:
        return Storage.resolve(self.storage_uri).uri_of(*self.parts)

    @property
    def framework(self) -> str:
        return self.info.get("framework", "torch")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.info["input_shape"])

    @property
    def num_classes(self) -> int:
        return int(self.info["num_classes"])


def locate(model: str | None = None, run: str | None = None, storage: str | None = None) -> ModelRef:
    """The model folder ``--model`` (a run folder or a model folder) or ``--run NAME`` names.

    Raises:
        UserError: nothing there, or no exported model in it (the run did not finish).
    """
    if bool(model) == bool(run):
        raise UserError("give the model with --model RUN_OR_MODEL_DIR or --run NAME (one of them)",
                        "for example --run digits_1, or --model runs/digits_1")
    if run:
        root, parts = normalize_storage(storage or DEFAULT_STORAGE), (run, MODEL_DIR)
        what = f"--run {run}"
    else:
        uri = normalize_storage(model.rstrip("/"))
        root, _, last = uri.rpartition("/")
        if not root or root == "gs:/":
            raise UserError(f"--model {model}: name a run's folder or its model folder", "for example runs/digits_1")
        parts = (last,)
        what = f"--model {model}"
    store = Storage.resolve(root)
    candidates = [parts] if run else [parts + (MODEL_DIR,), parts]
    for candidate in candidates:
        text = store.read_text(*candidate, DESCRIPTION)
        if text is not None:
            try:
                info = json.loads(text)
                if not isinstance(info, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise UserError(f"{store.uri_of(*candidate, DESCRIPTION)} is damaged",
                                "export the model again (run the run again with the same --name)") from None
            _check_servable(info, what, store.uri_of(*candidate))
            return ModelRef(root, candidate, info)
    where = store.uri_of(*parts)
    exists = store.exists(*parts)
    raise UserError(f"{what}: {'no exported model in ' + where if exists else 'nothing at ' + where}",
                    "a run exports its model to <run>/model/ when it finishes; check the name and --storage"
                    if exists or run else "check the path (a run's folder, e.g. runs/NAME)")


def _check_servable(info: dict[str, Any], what: str, where: str) -> None:
    """Predict and serve take classifiers with a known input shape (a built-in or managed-loop
    workload's export): any other model is one line here, before Ray starts."""
    files = ", ".join(sorted(info.get("files") or {})) or "its files"
    if info.get("framework") == "xgboost":
        raise UserError(f"{what}: {where} holds an XGBoost booster ({files}): predict and serve take the torch and "
                        "TensorFlow workloads' classifiers for now",
                        f"load {where}/model.bst with xgboost.Booster(model_file=...) and predict in your own code")
    if info.get("kind") == "training function" or "input_shape" not in info:
        raise UserError(f"{what}: {where} holds a training function's model ({files}), whose class is in your "
                        "code: predict and serve take the built-in and managed-loop workloads' classifiers",
                        f"load it as {where}/model.json says and predict in your own code")
    classes = info.get("num_classes")
    if not isinstance(classes, int) or classes < 2:
        raise UserError(f"{what}: {info.get('workload')} is not a classifier (its model.json names no classes): "
                        "predict and serve answer with class scores, which a regression does not have",
                        f"load {where} ({files}) in your own code to predict with it")


class Model:
    """A loaded model: ``scores(instances)`` -> (N, classes) probabilities."""

    def __init__(self, ref: ModelRef) -> None:
        import workloads

        self.ref = ref
        self.workload = workloads.get(ref.info["workload"])
        self.params = ref.info.get("params") or {}
        self._dir = self._local_copy()
        if ref.framework == "tensorflow":
            self._fn = self._load_tensorflow()
        else:
            self._fn = self._load_torch()

    def _local_copy(self) -> str:
        store = Storage.resolve(self.ref.storage_uri)
        if store.is_local:
            return store.path(*self.ref.parts)
        d = tempfile.mkdtemp(prefix="launcher-model-")
        store.download_dir(d, *self.ref.parts)
        self._tmp = d
        return d

    def _load_torch(self):
        import torch

        program = torch.export.load(os.path.join(self._dir, "model.pt2")).module()
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

        def run(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return torch.softmax(program(torch.from_numpy(x)), dim=1).numpy()
        return run

    def _load_tensorflow(self):
        from workloads.tf_models import keras

        from workloads.tf_models import native_stderr_silenced

        with native_stderr_silenced():
            keras()  # the legacy tf.keras, before TensorFlow loads
            import tensorflow as tf

            loaded = tf.saved_model.load(os.path.join(self._dir, "saved_model"))
        serve = loaded.signatures["serving_default"]

        def run(x: np.ndarray) -> np.ndarray:
            out = serve(x=tf.constant(x))
            logits = next(iter(out.values())).numpy()
            return tf.nn.softmax(logits, axis=1).numpy()
        return run

    def inputs(self, instances: Any) -> np.ndarray:
        """Raw instances -> the model's input batch; ValueError saying what was expected."""
        return self.workload.preprocess(np.asarray(instances), self.params)

    def scores(self, instances: Any) -> np.ndarray:
        return self.run(self.inputs(instances))

    def run(self, x: np.ndarray) -> np.ndarray:
        """Class probabilities for a batch already preprocessed (:meth:`inputs`)."""
        if not len(x):
            return np.zeros((0, self.ref.num_classes), np.float32)
        return np.asarray(self._fn(np.ascontiguousarray(x)), dtype=np.float32)

    def close(self) -> None:
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)


def predictions(scores: np.ndarray) -> list[dict[str, Any]]:
    """AI Platform-style predictions: the class and every class's score."""
    classes = scores.argmax(axis=1).tolist()
    rounded = np.round(scores.astype(np.float64), 7).tolist()
    return [{"prediction": c, "scores": row} for c, row in zip(classes, rounded)]
