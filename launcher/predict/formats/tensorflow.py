"""The TensorFlow formats: a SavedModel's serving signature (``saved_model.pb``, Vertex AI's
prebuilt container's format) and a Keras model (``model.keras``, what a Keras training
function exports); both take their inputs by name (:class:`~launcher.predict.formats.base.Named`).

TensorFlow is imported only when such a model loads, with the legacy tf.keras chosen
first and its native start-up noise kept off stderr (:func:`tensorflow`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from launcher.predict.formats.base import Batch, Named


def tensorflow():
    """TensorFlow, imported quietly with the legacy tf.keras chosen first."""
    from workloads.tf_models import keras, native_stderr_silenced

    with native_stderr_silenced():
        keras()  # the legacy tf.keras, before TensorFlow loads
        import tensorflow as tf
    return tf


def serving_signature(directory: str, name: str = "saved_model.pb"):
    """(the loaded SavedModel in ``directory``, its ``serving_default`` signature); the first must
    stay alive while the signature is called (it holds the variables)."""
    from workloads.tf_models import native_stderr_silenced

    tf = tensorflow()
    with native_stderr_silenced():
        loaded = tf.saved_model.load(directory)
    if "serving_default" not in loaded.signatures:
        raise ValueError(f"{name} has no serving_default signature to call")
    return loaded, loaded.signatures["serving_default"]


class SavedModel(Named):
    """A TensorFlow SavedModel's ``serving_default`` signature (``saved_model.pb``)."""

    format = "savedmodel"
    files = ("saved_model.pb",)

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        self.tf = tensorflow()
        self._loaded, self.fn = serving_signature(directory)
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
    files = ("model.keras",)

    def __init__(self, directory: str, info: dict[str, Any]) -> None:
        super().__init__(directory, info)
        tensorflow()
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
