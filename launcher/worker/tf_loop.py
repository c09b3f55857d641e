"""The managed TensorFlow loop: a Workload trained by the launcher, as one client of the TF session.

:func:`train_workload` is a training function like a user's GradientTape loop
(:mod:`launcher.worker.tf_session`): it builds the workload's tf.keras model and optimizer in the
backend's scope, registers them, and trains on the session's epochs, data and steps with the
backend's distributed train step (:meth:`launcher.backends.TFComm.train_step`:
MultiWorkerMirroredStrategy or Horovod). ``--batch-size`` is per worker; the gradient is that of
the mean loss over the global batch. The workload's training split follows the run's global
order (:mod:`launcher.worker.order`), so a resumed run goes on at its sample on any worker count;
after each epoch every rank scores its test shard with the workload's ``tf_compile`` loss and
metrics, averaged over the ranks by shard size. Checkpoints, resume, preemption notices, reports
and the export are the session's, so the managed loop and a user's loop keep one set of
guarantees, as the managed torch loop does (:mod:`launcher.worker.torch_loop`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from launcher.worker.usersession import workload_splits

EVAL_BATCH = 512


def train_workload(session, workload) -> None:
    """Train ``workload`` for the run's epochs with the TF session (see the module docstring)."""
    spec, params = session.spec, session.spec.params
    train, test = workload_splits(session, workload)
    with session.scope():
        model = workload.tf_model(params)
        optimizer = make_optimizer(workload.defaults.optimizer, spec.lr)
        optimizer.build(model.trainable_variables)
    compiled = workload.tf_compile(params)
    loss = per_example_loss(compiled["loss"])
    session.register(model=model, optimizer=optimizer)
    batches = session.dataset(train)
    step = session.comm.train_step(model, optimizer, loss)
    for _ in session.epochs():  # the first restores the registered state (rank 0's on every rank)
        for x, y in batches.arrays():  # numpy, as the backend's step takes them: no tf.data per batch
            session.step(train_loss=step(x, y))
        session.report(weight=len(test), **evaluate(model, loss, compiled.get("metrics") or [], test))


def evaluate(model, loss, metric_specs: list[Any], test) -> dict[str, float]:
    """The loss and the workload's metrics on this rank's test shard (the session averages them
    over the ranks, each counting its shard's size)."""
    metrics = fresh_metrics(metric_specs)
    loss_sum = 0.0
    for lo in range(0, len(test), EVAL_BATCH):
        x, y = test.take(np.arange(lo, min(lo + EVAL_BATCH, len(test))))
        outputs = model(x, training=False)
        loss_sum += float(np.sum(loss(y, outputs).numpy()))
        for metric in metrics.values():
            metric.update_state(_labels_like(y, outputs), outputs)
    return {"loss": loss_sum / max(1, len(test)),
            **{name: float(metric.result().numpy()) for name, metric in sorted(metrics.items())}}


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
