"""The per-worker training loop for TensorFlow, shared by every TensorFlow backend.

:class:`TFTraining` is the TensorFlow half of :class:`launcher.worker.loop.Training`:
the backend's :class:`~launcher.backends.TFComm` joins the workers
(MultiWorkerMirroredStrategy or Horovod) and supplies the distributed train
step; this module builds the workload's tf.keras model and trains with the
same data order, batch semantics
(``batch_size`` per worker; the gradient is that of the mean loss over the
global batch), checkpoints and reports as the torch loop.

Checkpoints hold the model's weights (``model.weights.npz``: every variable,
batch-norm statistics included) and the optimizer's variables
(``optimizer.npz``) as plain arrays, so reading them needs no distribution
strategy, and the same manifest as torch checkpoints. Preemption notices are
handled as in the torch loop (:class:`launcher.worker.loop.Training`).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np

from launcher.backends.base import TFComm
from launcher.spec import JobSpec
from launcher.storage.checkpoint import read_manifest
from launcher.worker.formats import TF_MODEL_FILE as MODEL_FILE
from launcher.worker.formats import TF_OPTIMIZER_FILE as OPTIMIZER_FILE
from launcher.worker.formats import arrays_digest, load_arrays, save_arrays
from launcher.worker.loop import Position, Training

EVAL_BATCH = 512


def configure_tensorflow(threads: int) -> None:
    """Select the legacy tf.keras and size TensorFlow's thread pools; call before TF starts."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, threads)))
    except RuntimeError:  # already initialised (a second run in the same process)
        pass


def make_optimizer(name: str, lr: float):
    from workloads.tf_models import keras

    k = keras()
    if name == "sgd":
        return k.optimizers.SGD(learning_rate=lr, momentum=0.9)
    return k.optimizers.Adam(learning_rate=lr)


def _labels_like(y, outputs):
    """Labels shaped as the outputs where they lack their last axis of 1 (a regression's (N,)
    targets for (N, 1) predictions): Keras' losses and metrics would broadcast them to (N, N)."""
    import tensorflow as tf

    y = tf.convert_to_tensor(y)
    if y.shape.rank is not None and outputs.shape.rank == y.shape.rank + 1 and outputs.shape[-1] == 1:
        return tf.expand_dims(y, -1)
    return y


def per_example_loss(loss):
    """A Keras loss (a name, a function or a Loss object) as ``(y, outputs) -> loss per example``."""
    from workloads.tf_models import keras

    k = keras()
    if isinstance(loss, k.losses.Loss):
        config = {**loss.get_config(), "reduction": k.losses.Reduction.NONE}
        fn = type(loss).from_config(config)
    else:
        fn = k.losses.get(loss)

    def per_example(y, outputs):
        return fn(_labels_like(y, outputs), outputs)

    return per_example


def fresh_metrics(specs: list[Any]) -> dict[str, Any]:
    """New Keras metric objects (name -> Metric) for compile-style ``specs``; "accuracy" means
    the share of rows whose largest output is the label (class logits)."""
    from workloads.tf_models import keras

    k, out = keras(), {}
    for spec in specs:
        if spec in ("accuracy", "acc"):
            metric = k.metrics.SparseCategoricalAccuracy(name="accuracy")
        elif isinstance(spec, k.metrics.Metric):
            metric = type(spec).from_config(spec.get_config())
        else:
            fn = k.metrics.get(spec)
            metric = fn if isinstance(fn, k.metrics.Metric) else k.metrics.MeanMetricWrapper(
                fn, name=spec if isinstance(spec, str) else getattr(fn, "__name__", "metric"))
        out[metric.name] = metric
    return out


class TFTraining(Training):
    """One worker's TensorFlow training state and the operations on it."""

    def __init__(self, spec: JobSpec, comm: TFComm) -> None:
        from workloads.tf_models import keras

        super().__init__(spec, comm)
        # Same initial weights on every rank and in every run of this seed: tf.keras's
        # unseeded initializers draw from Python's and NumPy's generators as well as TF's.
        keras().utils.set_random_seed(spec.seed)
        with comm.scope():
            self.model = self.workload.tf_model(spec.params)
            self.optimizer = make_optimizer(self.workload.defaults.optimizer, spec.lr)
            self.optimizer.build(self.model.trainable_variables)
        compiled = self.workload.tf_compile(spec.params)
        self.loss = per_example_loss(compiled["loss"])
        self.metric_specs = list(compiled.get("metrics") or [])
        self.step = None  # the backend's distributed train step (prepare)

    # -- checkpoints ------------------------------------------------------------------
    def restore(self, directory: str) -> None:
        manifest = read_manifest(directory)
        if manifest.framework != "tensorflow":
            raise RuntimeError(f"checkpoint {directory} was written by {manifest.framework}, not tensorflow")
        self.model.set_weights(load_arrays(os.path.join(directory, MODEL_FILE)))
        for var, value in zip(self.optimizer.variables, load_arrays(os.path.join(directory, OPTIMIZER_FILE))):
            var.assign(value)
        # With a cursor, a mid-epoch checkpoint of any worker count continues at its sample.
        self.restored(Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step), manifest,
                      across_layouts=manifest.cursor is not None)
        if self.pos.step_in_epoch:
            self.resume_epoch_at(self.pos.step_in_epoch, manifest.cursor)

    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        save_arrays(os.path.join(directory, MODEL_FILE), self.model.get_weights())
        save_arrays(os.path.join(directory, OPTIMIZER_FILE), [v.numpy() for v in self.optimizer.variables])
        self.write_manifest(directory, metrics, cursor=self.cursor_at(self.pos.step_in_epoch))

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        return self.comm.allreduce_sum(values)

    # -- training -----------------------------------------------------------------------
    def run_epoch(self) -> dict[str, float]:
        step = self.step
        loss_sum, count = 0.0, 0
        start = time.perf_counter()
        for i, idx in self.batches():
            step_started = time.perf_counter()
            value = float(step(*self.train.take(idx)))
            if not math.isfinite(value):
                raise self.diverged(value)
            loss_sum, count = loss_sum + value * len(idx), count + len(idx)
            self.stepped(i, value, step_started)
        seconds = time.perf_counter() - start
        totals = self.comm.allreduce_sum(np.array([loss_sum, count], dtype=np.float64))
        samples = int(totals[1])
        return {"train_loss": totals[0] / max(1.0, totals[1]), "samples": samples,
                "train_time_s": seconds, "samples_per_s": samples / seconds if seconds > 0 else 0.0}

    def evaluate(self) -> dict[str, float]:
        """The loss and the workload's metrics on the whole test split (each rank scores its
        shard; each figure is averaged over the ranks, weighted by shard size)."""
        metrics = fresh_metrics(self.metric_specs)
        loss_sum, count = 0.0, 0
        for lo in range(0, len(self.test), EVAL_BATCH):
            x, y = self.test.take(np.arange(lo, min(lo + EVAL_BATCH, len(self.test))))
            outputs = self.model(x, training=False)
            loss_sum += float(np.sum(self.loss(y, outputs).numpy()))
            count += len(y)
            for metric in metrics.values():
                metric.update_state(_labels_like(y, outputs), outputs)
        names = sorted(metrics)
        local = [loss_sum, count] + [float(metrics[n].result().numpy()) * count for n in names]
        totals = self.comm.allreduce_sum(np.array(local, dtype=np.float64))
        n = max(1.0, totals[1])
        return {"loss": totals[0] / n, **{name: totals[2 + i] / n for i, name in enumerate(names)}}

    def prepare(self) -> None:
        self.comm.after_restore(self.model, self.optimizer)
        self.step = self.comm.train_step(self.model, self.optimizer, self.loss)

    def weights_digest(self) -> str:
        return arrays_digest(self.model.get_weights())
