"""Keras' ``model.fit`` on the TensorFlow session: what ``session.fit`` adds to a session.

:func:`hook` is the Keras callback through which ``model.fit`` drives the session (each step,
each epoch's start and end) and tells Keras where a resumed run stands (:class:`ResumeAt`, the
hook Keras' own ``BackupAndRestore`` uses). :func:`check_fit` and :func:`check_batched` refuse a
call the launcher cannot keep its promises for, in one line naming the user's. A compiled
model's metric variables (:func:`metric_variables`) are saved with a mid-epoch checkpoint, and
:func:`build_metrics` and :func:`assign_metrics` give them back when the epoch resumes, so the
epoch's figures cover all its steps. Used by :class:`launcher.worker.tf_session.TFSession`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from launcher.worker.loader import SessionError


def check_fit(model, kwargs: dict[str, Any], where: str) -> None:
    """A ``session.fit(model, ..., **kwargs)`` at ``where`` the session can run, or one line why not."""
    from workloads.tf_models import keras

    if not isinstance(model, keras().Model):
        raise SessionError(f"session.fit at {where}: {type(model).__name__} is not a Keras model (tf_keras, "
                           "the legacy tf.keras the launcher trains with)")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled_loss", None):
        raise SessionError(f"session.fit at {where}: the model is not compiled; call model.compile(optimizer=..., "
                           "loss=..., metrics=...) inside `with session.scope():` first")
    for callback in kwargs.get("callbacks") or []:
        if isinstance(callback, keras().callbacks.BackupAndRestore):
            raise SessionError(f"session.fit at {where}: drop BackupAndRestore: the launcher's checkpoints "
                               "resume model.fit at the exact step already (and keep-N, gs:// and notices)")
    for name, why in (("epochs", "the run's --epochs (or @training_function(epochs=...)) sets it"),
                      ("initial_epoch", "the launcher resumes where the run stopped"),
                      ("validation_split", "split the data yourself and pass validation_data")):
        if name in kwargs:
            raise SessionError(f"session.fit(..., {name}=...) at {where}: not taken: {why}")


def check_batched(model, element_spec, where: str) -> None:
    """A dataset of single examples would be taken for batches of rows: say so."""
    import tensorflow as tf

    inputs = getattr(model, "inputs", None)
    if not inputs:
        return
    first = element_spec[0] if isinstance(element_spec, tuple) else element_spec
    first = tf.nest.flatten(first)[0]
    if first.shape.rank is not None and first.shape.rank == len(inputs[0].shape) - 1:
        raise SessionError(f"session.fit at {where}: the dataset yields single examples of shape "
                           f"{tuple(first.shape)} where the model takes batches {tuple(inputs[0].shape)}; "
                           "add .batch(session.global_batch_size) to it")


def metric_variables(model) -> list:
    """The variables of a compiled model's metrics (none before they are built)."""
    return [v for m in model.metrics for v in m.variables] if model is not None else []


def build_metrics(model, element_spec, scope) -> str | None:
    """Create a compiled model's metric objects before ``model.fit`` runs, so that the
    interrupted epoch's saved values have variables to go to at its beginning (tf_keras
    creates them at the first train step, after the epoch has begun). A forward pass on
    zeros shaped like one batch (``element_spec``) tells Keras the outputs' shapes; the data
    stream itself is not touched (a seeded shuffle's order depends on how many iterators it
    made). Returns why not, or None."""
    import tensorflow as tf

    from workloads.tf_models import keras

    if metric_variables(model):
        return None
    try:
        def zeros(spec):  # one example of the batch, unknown sizes as 1
            dims = spec.shape.as_list()
            return tf.zeros([1, *[1 if d is None else d for d in dims[1:]]] if dims else [], spec.dtype)

        x, y, _ = keras().utils.unpack_x_y_sample_weight(tf.nest.map_structure(zeros, element_spec))
        with scope:
            predicted = model(x, training=False)
            # What the first train step would do, less the update: a metric variable
            # synchronised on read cannot be added to outside the replicas' context.
            model.compiled_loss.build(predicted)
            metrics = model.compiled_metrics
            conform = getattr(metrics, "_conform_to_outputs", None)
            metrics.build(predicted, conform(predicted, y) if conform else y)
    except Exception as exc:  # noqa: BLE001 - said by the caller; only the epoch's figures suffer
        return f"{type(exc).__name__}: {exc}"
    return None


def assign_metrics(model, arrays: list[np.ndarray]) -> str | None:
    """Give the model's metric variables the values saved with the checkpoint. Under a
    multi-worker strategy the saved value is the sum over the workers (a metric variable is
    synchronised on read), and TensorFlow's assign in the cross-replica context gives each
    replica its share of it, so that the sum read next is the saved one. Returns why not, or None."""
    variables = metric_variables(model)
    if len(variables) != len(arrays):
        return f"the checkpoint holds {len(arrays)} Keras metric values, the model has {len(variables)}"
    for var, value in zip(variables, arrays):
        var.assign(value)
    return None


def numbers(logs: dict[str, Any] | None) -> dict[str, float]:
    """Keras' logs (tensors or numbers) as floats, read now."""
    out = {}
    for name, value in (logs or {}).items():
        try:
            out[name] = float(np.asarray(value))
        except (TypeError, ValueError):
            continue
    return out


def results(model) -> dict[str, float]:
    """The model's metrics of the epoch so far, as Keras reports them at an epoch's end (its
    per-step logs are per-replica values summed under a multi-worker strategy)."""
    out: dict[str, Any] = {}
    for metric in model.metrics:
        result = metric.result()
        out.update(result if isinstance(result, dict) else {metric.name: result})
    return numbers(out)


def hook(session):
    """The Keras callback through which ``model.fit`` drives the session."""
    from workloads.tf_models import keras

    class LauncherHook(keras().callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._supports_tf_logs = True  # logs stay tensors: nothing read per step

        def on_train_begin(self, logs=None):
            # Where the resumed run stands; Keras asks after on_train_begin (its hook for
            # BackupAndRestore, a private attribute of the legacy tf.keras, which is frozen).
            self.model._training_state = ResumeAt(session.pos.epoch, session.pos.step_in_epoch)

        def on_train_end(self, logs=None):
            self.model._training_state = None

        def on_epoch_begin(self, epoch, logs=None):
            session._keras_epoch_begin()

        def on_train_batch_end(self, batch, logs=None):
            session._keras_step()

        def on_epoch_end(self, epoch, logs=None):
            session._keras_epoch_end(logs or {})

    return LauncherHook()


class ResumeAt:
    """What Keras' fit asks its training state: the epoch and the step to start at."""

    def __init__(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return self.epoch, self.step
