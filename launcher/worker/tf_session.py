"""The training session for TensorFlow: a Keras ``model.fit`` or a ``tf.GradientTape`` loop
with every guarantee of the launcher.

``--workload FILE.py:train --framework tensorflow`` where ``train(session)`` is the user's
code. For Keras, ``session.fit`` takes the place of ``model.fit``::

    def train(session):
        with session.scope():                      # MultiWorkerMirroredStrategy's, or none for Horovod
            model = build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10_000, seed=1)
        session.fit(model, data.batch(session.global_batch_size), validation_data=(x_val, y_val))

A custom loop iterates ``session.epochs()`` and ``session.dataset(...)`` and calls
``session.step(loss=...)`` after each optimizer step, as the torch session does, with the
model and optimizer registered (``session.register(model=model, optimizer=optimizer)``).

How a resumed run is exact: arrays given to :meth:`TFSession.fit` or :meth:`TFSession.dataset`
(``(x, y)``, a dict) follow the run's global order (:mod:`launcher.worker.order`: one order of
(seed, epoch) over all samples, each global batch split over the ranks, a cursor of the samples
used), so a run resumed on another number of workers goes on at the same sample. A batched
``tf.data.Dataset`` of the user's is one stream instead, repeated epoch after epoch
(``ds.repeat()``: a deterministic pipeline, e.g. a seeded ``shuffle``, yields the same batches
in every run), so a position is a batch count: a resumed run skips that many batches, and each
worker takes its strided share of every global batch (``batch[rank::world]``), so the
composition of each global batch does not depend on the backend. Its batches are cut for one
worker count, so a resume on another one redoes the interrupted epoch (and says so). One
``model.fit`` call, over one iterator of that stream, trains
the rest of the run: a seeded shuffle's order depends on how many iterators its dataset has
made, so a run makes one. Keras is told that the first epoch starts at the resumed step (the
hook its own ``BackupAndRestore`` uses). Keras' metrics of an interrupted epoch (their variables)
are saved with the checkpoint and restored when it resumes, so the epoch's figures cover all
its steps. A preemption notice is polled between steps (:class:`launcher.worker.loop.Session`):
all workers save at the same step, which is what TensorFlow's ``PreemptionCheckpointHandler``
does for MultiWorkerMirroredStrategy, and works for Horovod as well.

Checkpoints hold every registered object's variables as plain arrays (``tf_state.npz``,
readable without a strategy) and each rank's running metrics; the final one exports the
model in Keras' format (``model.keras``) with its weights (``model.weights.npz``).
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import shutil
import tempfile
import time
from typing import Any, Iterator

import numpy as np

from launcher.spec import JobSpec
from launcher.storage import Storage
from launcher.storage.checkpoint import read_manifest
from launcher.worker.formats import TF_MODEL_FILE, arrays_digest, load_arrays, save_arrays
from launcher.worker.loader import SessionError, user_line
from launcher.worker.loop import Position
from launcher.worker.order import GlobalOrder
from launcher.worker.usersession import UserSession

STATE_FILE = "tf_state.npz"        # every registered object's variables, rank 0's
INDEX_FILE = "tf_state.json"       # which arrays belong to which object, and the data position
KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"


def rank_file(rank: int) -> str:
    """Each rank's running metrics of the epoch under way (Keras' metric variables included)."""
    return f"tf_rank{rank}.npz"


def _variables(obj: Any) -> list:
    """The variables of a registered object (a Keras model, optimizer or metric, a tf.Module)."""
    found = getattr(obj, "variables", None)
    if callable(found):  # legacy optimizers: a method
        found = found()
    return list(found or [])


class TFSession(UserSession):
    """What a TensorFlow training function gets (see the module docstring)."""

    def __init__(self, spec: JobSpec, comm, function: Any = None) -> None:
        from workloads.tf_models import keras

        super().__init__(spec, comm, function)
        keras().utils.set_random_seed(spec.seed)  # the same initial weights on every rank
        self.objects: dict[str, Any] = {}
        self.model_name: str | None = None
        self._saved: dict[str, list[np.ndarray]] = {}   # arrays read from the checkpoint, until _begin
        self._metric_arrays: list[np.ndarray] | None = None  # Keras metrics of the interrupted epoch
        self._data: EpochData | None = None
        self._keras_model = None     # the model session.fit trains (its metrics are checkpointed)
        self._began = False
        self._model_arrays: list[np.ndarray] = []  # the model's variables as the last save read them
        self._stand_ins: dict[int, Any] = {}  # id of an optimizer given to optimizer() -> the one returned
        self._layout_changed = False  # the checkpoint resumed from had another worker count or batch size
        self._resume_cursor: int | None = None  # its cursor in the global order, mid-epoch

    # -- the run's facts -------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """``--batch-size`` (per worker) times the workers: the batch a dataset given to
        :meth:`fit` or :meth:`dataset` should yield."""
        return int(self.spec.batch_size) * self.world

    @property
    def strategy(self):
        """The ``tf.distribute`` strategy: MultiWorkerMirroredStrategy on the native backend,
        TensorFlow's default (no-op) one under Horovod."""
        import tensorflow as tf

        return getattr(self.comm, "strategy", None) or tf.distribute.get_strategy()

    def scope(self):
        """Create the model and optimizer inside this (the strategy's variable scope)."""
        return self.comm.scope()

    def optimizer(self, optimizer):
        """The optimizer as the backend steps it (Horovod's DistributedOptimizer, which averages
        the gradients; as it is under MultiWorkerMirroredStrategy). :meth:`fit` applies it."""
        wrapped = self.comm.keras_optimizer(optimizer)
        self._stand_ins[id(optimizer)] = wrapped
        return wrapped

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(self.comm.allreduce_sum(np.array(values, dtype=np.float64)), dtype=np.float64)

    # -- state ---------------------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Objects whose variables the checkpoints hold: the model (the first Keras model, or the
        one named ``model``), optimizers, anything with ``variables`` (a ``tf.Module``). On a
        resumed run each is restored before the first step (an optimizer is built first)."""
        from workloads.tf_models import keras

        for name, obj in objects.items():
            if getattr(obj, "variables", None) is None:
                raise SessionError(f"session.register({name}=...) at {user_line()}: a {type(obj).__name__} has no "
                                   "variables; register Keras models and optimizers or tf.Module objects")
            if name in self.objects and self.objects[name] is not obj:
                raise SessionError(f"session.register({name}=...) at {user_line()}: {name!r} is registered "
                                   "already; give each object its own name")
            if self._began:
                raise SessionError(f"session.register({name}=...) at {user_line()}: training has started; "
                                   "register everything before session.epochs() or session.fit()")
            if isinstance(obj, keras().Model) and (self.model_name is None or name == "model"):
                self.model_name = name
            self.objects[name] = obj

    def model(self):
        return self.objects[self.model_name]

    def unregistered(self) -> list[str]:
        """Keras optimizers alive in this process that no checkpoint holds (an optimizer given to
        :meth:`optimizer` counts as registered when what it returned is)."""
        from workloads.tf_models import keras

        kinds = tuple(k for k in (keras().optimizers.Optimizer,
                                  getattr(getattr(keras().optimizers, "legacy", None), "Optimizer", None)) if k)
        registered = {id(o) for o in self.objects.values()}
        gc.collect()
        found = {}
        for obj in gc.get_objects():
            if (issubclass(type(obj), kinds) and id(obj) not in registered
                    and id(self._stand_ins.get(id(obj))) not in registered):
                found[id(obj)] = (f"the optimizer {type(obj).__name__} is not registered (its slots and "
                                  "iteration count start afresh; session.register(optimizer=...) keeps it)")
        return sorted(found.values())

    def weights_digest(self) -> str:
        return arrays_digest([v.numpy() for v in self.model().weights])  # on every rank: see save()

    def _begin(self) -> None:
        """Before the first step: optimizers built, the checkpoint's arrays assigned, every rank
        holding rank 0's variables."""
        from workloads.tf_models import keras

        if self._began:
            return
        if self.model_name is None:
            raise SessionError(f"training started at {user_line()} before any Keras model was registered: call "
                               "session.register(model=model, optimizer=optimizer) first (session.fit does it)")
        model = self.model()
        optimizers = [o for o in self.objects.values() if isinstance(o, keras().optimizers.Optimizer)]
        with self.scope():
            for opt in optimizers:
                if not getattr(opt, "_built", False):  # its slots exist once built for the model
                    opt.build(model.trainable_variables)
        for name, arrays in self._saved.items():
            if name not in self.objects:
                raise SessionError(f"the checkpoint holds {name!r}, which this run did not register; register the "
                                   "same objects as the run that wrote it")
            variables = _variables(self.objects[name])
            if len(variables) != len(arrays):
                raise SessionError(f"the checkpoint holds {len(arrays)} variables for {name!r}, this run's has "
                                   f"{len(variables)}: the model or optimizer changed since; start a new run "
                                   "(--name) or restore the code that wrote it")
            for var, value in zip(variables, arrays):
                var.assign(value)
        self._saved = {}
        self.comm.after_restore(model, optimizers[0] if optimizers else None)
        self._began = True
        self.say_unregistered()
        if self.rank == 0 and "worker_ready" not in self.marks:
            self.marks["model_ready"] = self.marks["worker_ready"] = time.time()

    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        # Every rank reads every variable, in the same order: under a multi-worker strategy a
        # synchronised-on-read variable (Keras metrics, batch-norm statistics) is read by an
        # all-reduce, which one rank alone would wait on forever.
        values = {name: [v.numpy() for v in _variables(obj)] for name, obj in self.objects.items()}
        self._model_arrays = values[self.model_name]
        mine = os.path.join(directory, rank_file(self.rank))
        metric_arrays = [v.numpy() for v in self._keras_metric_variables()]
        np.savez(mine, epoch=np.array(json.dumps(self._epoch_so_far())),
                 **{f"m{i:04d}": a for i, a in enumerate(metric_arrays)})
        others = self.sizes_over_ranks(rank_file, os.path.getsize(mine))
        if self.rank != 0:
            return
        arrays, index = [], {}
        for name, got in values.items():
            index[name] = [len(arrays), len(got)]
            arrays.extend(got)
        save_arrays(os.path.join(directory, STATE_FILE), arrays)
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"objects": index, "model": self.model_name,
                       "steps_per_epoch": self.steps_per_epoch}, f)
        cursor = self._data.cursor_at(self.pos) if self._data is not None else None
        self.write_manifest(directory, metrics, others, cursor=cursor)

    def restore(self, directory: str) -> None:
        """Read the checkpoint's arrays; they are assigned when training begins."""
        manifest = read_manifest(directory)
        if manifest.framework != "tensorflow":
            raise SessionError(f"checkpoint {directory} was written by {manifest.framework}, not tensorflow: "
                               "start a new run (--name)")
        with open(os.path.join(directory, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
        arrays = load_arrays(os.path.join(directory, STATE_FILE))
        self._saved = {name: arrays[lo:lo + n] for name, (lo, n) in index["objects"].items()}
        self.restored(Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step), manifest,
                      across_layouts=True)  # settled once the data is known (_settle_position)
        same_layout = manifest.world_size == self.world and manifest.batch_size == self.spec.batch_size
        self._layout_changed, self._resume_cursor = not same_layout, manifest.cursor
        mine = os.path.join(directory, rank_file(self.rank))
        if same_layout and self.pos.step_in_epoch and os.path.isfile(mine):
            with np.load(mine) as f:
                self._carried = json.loads(str(f["epoch"]))
                self._metric_arrays = [f[k] for k in sorted(k for k in f.files if k.startswith("m"))]

    def _keras_metric_variables(self) -> list:
        model = self._keras_model
        return [v for m in model.metrics for v in m.variables] if model is not None else []

    def _build_keras_metrics(self, model) -> None:
        """Create a compiled model's metric objects before ``model.fit`` runs, so that the
        interrupted epoch's saved values have variables to go to at its beginning (tf_keras
        creates them at the first train step, after the epoch has begun). A forward pass on
        zeros shaped like one batch tells Keras the outputs' shapes; the data stream itself
        is not touched (a seeded shuffle's order depends on how many iterators it made)."""
        import tensorflow as tf

        if self._keras_metric_variables():
            return
        try:
            def zeros(spec):  # one example of the batch, unknown sizes as 1
                dims = spec.shape.as_list()
                return tf.zeros([1, *[1 if d is None else d for d in dims[1:]]] if dims else [], spec.dtype)

            batch = tf.nest.map_structure(zeros, self._data.source.element_spec)
            from workloads.tf_models import keras

            x, y, _ = keras().utils.unpack_x_y_sample_weight(batch)
            with self.scope():
                predicted = model(x, training=False)
                # What the first train step would do, less the update: a metric variable
                # synchronised on read cannot be added to outside the replicas' context.
                model.compiled_loss.build(predicted)
                metrics = model.compiled_metrics
                conform = getattr(metrics, "_conform_to_outputs", None)
                metrics.build(predicted, conform(predicted, y) if conform else y)
        except Exception as exc:  # noqa: BLE001 - say it, train on: only the epoch's figures suffer
            self._metric_arrays = None
            if self.rank == 0:
                print(f"rank 0: Keras' metrics could not be set up before model.fit ({type(exc).__name__}: {exc}); "
                      "the resumed epoch's metrics cover only the steps after the resume", flush=True)

    def _restore_keras_metrics(self, arrays: list[np.ndarray]) -> None:
        """Give the model's metric variables the values saved with the checkpoint. Under a
        multi-worker strategy the saved value is the sum over the workers (a metric variable is
        synchronised on read), and TensorFlow's assign in the cross-replica context gives each
        replica its share of it, so that the sum read next is the saved one."""
        variables = self._keras_metric_variables()
        if len(variables) != len(arrays):
            if self.rank == 0:
                print(f"rank 0: the checkpoint holds {len(arrays)} Keras metric values, the model has "
                      f"{len(variables)}; the resumed epoch's metrics cover only the steps after the resume",
                      flush=True)
            return
        for var, value in zip(variables, arrays):
            var.assign(value)

    def export_model(self, directory: str) -> str | None:
        """Rank 0, final checkpoint: the trained model in Keras' format and its weights, under
        ``<run>/model/`` (a subclassed model without ``get_config`` gets its weights only)."""
        # On a thread of its own, outside the strategy's scope (a thread-local): a copy of the
        # model made there has plain variables, where one made inside model.fit would create
        # mirrored variables by collectives that only this rank joins.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="launcher-export") as pool:
            return pool.submit(self._export).result()

    def _export(self) -> str | None:
        from launcher.worker.export import hook_fields
        from workloads.tf_models import keras, native_stderr_silenced

        storage = Storage.resolve(self.spec.storage)
        files = {TF_MODEL_FILE: "the weights: build the model as your function does, then "
                                "model.set_weights(list of arrays a0000, a0001, ... in order)"}
        try:
            with tempfile.TemporaryDirectory(prefix="launcher-export-") as d:
                save_arrays(os.path.join(d, TF_MODEL_FILE), self._model_arrays)
                try:
                    copy = keras().models.clone_model(self.model())
                    copy.set_weights(self._model_arrays)
                    copy.save(os.path.join(d, KERAS_FILE))
                    files[KERAS_FILE] = "tf_keras.models.load_model(p) (TF_USE_LEGACY_KERAS=1)"
                except Exception as exc:  # e.g. a subclassed model without get_config
                    print(f"rank 0: the model cannot be saved in Keras' format ({type(exc).__name__}: {exc}); "
                          "its weights are exported", flush=True)
                    shutil.rmtree(os.path.join(d, KERAS_FILE), ignore_errors=True)
                    copy = None
                if copy is not None:
                    try:  # what TensorFlow Serving and Vertex AI's prebuilt TensorFlow container load
                        with native_stderr_silenced():
                            copy.export(os.path.join(d, SAVED_MODEL_DIR))
                        files[SAVED_MODEL_DIR] = "TensorFlow SavedModel (model.export): its serving_default signature"
                    except Exception as exc:  # noqa: BLE001 - model.keras and the weights are what matters
                        print(f"rank 0: the model cannot be exported as a SavedModel ({type(exc).__name__}: {exc})",
                              flush=True)
                        shutil.rmtree(os.path.join(d, SAVED_MODEL_DIR), ignore_errors=True)
                with open(os.path.join(d, "model.json"), "w", encoding="utf-8") as f:
                    json.dump({"workload": self.spec.workload, "framework": "tensorflow", "kind": "training function",
                               "params": self.spec.params, **hook_fields(self.spec), "files": files}, f, indent=1)
                storage.upload_dir(d, self.spec.name, "model")
            return storage.uri_of(self.spec.name, "model")
        except Exception as exc:  # the checkpoint is what matters; say what failed
            print(f"rank 0: exporting the model failed ({type(exc).__name__}: {exc})", flush=True)
            return None

    # -- data ------------------------------------------------------------------------------
    def dataset(self, data: Any, *, steps_per_epoch: int | None = None, batch_size: int | None = None,
                shuffle: bool = True) -> "EpochData":
        """The training data, resumable at any step: ``data`` is a batched ``tf.data.Dataset`` of
        global batches (:attr:`global_batch_size`), or arrays (``(x, y)``, a dict) that the session
        shuffles (by the run's seed) and batches. Iterating the result inside
        ``session.epochs()`` yields this worker's share of each global batch left in the epoch."""
        if self._data is not None:
            raise SessionError(f"session.dataset(...) at {user_line()}: this session has its training data "
                               "already; give validation data to Keras or iterate it yourself")
        self._data = EpochData(self, data, steps_per_epoch, batch_size, shuffle)
        self.steps_per_epoch = self._data.steps
        self._settle_position()
        return self._data

    def _settle_position(self) -> None:
        """A checkpoint of another layout (worker count, batch size) resumed mid-epoch: data in the
        global order continues at the saved cursor, in this layout's steps; a batched dataset of the
        user's has no matching position, so its epoch is done again from the start."""
        pos = self.pos
        if self._data.order is not None and pos.step_in_epoch:
            cursor = self._resume_cursor
            if cursor is None:  # a checkpoint without one: the same layout's steps give it
                cursor = None if self._layout_changed else \
                    self._data.order.cursor_after(0, self.world, pos.step_in_epoch)
            if cursor is not None:
                pos.step_in_epoch = self._data.resume_epoch_at(pos.epoch, cursor)
                return
        if self._layout_changed and pos.step_in_epoch:
            if self.rank == 0:
                print(f"note: resumed on {self.world} workers from a checkpoint of another layout in the middle of "
                      f"epoch {pos.epoch + 1}: a batched tf.data.Dataset has no position there, so the epoch starts "
                      "again (give arrays to session.fit / session.dataset to go on at the same sample)", flush=True)
            pos.step_in_epoch = 0
            self._carried = None

    def _epoch_ends(self) -> bool:
        return bool(self.steps_per_epoch) and self.pos.step_in_epoch >= self.steps_per_epoch

    # -- Keras -----------------------------------------------------------------------------
    def fit(self, model, x: Any = None, y: Any = None, *, batch_size: int | None = None,
            steps_per_epoch: int | None = None, callbacks: list | None = None, verbose: Any = None,
            shuffle: bool = True, **kwargs: Any):
        """``model.fit`` with the launcher's epochs (``--epochs``), checkpoints, resume and
        preemption notices. ``x``: a batched ``tf.data.Dataset`` of global batches, or arrays
        (with ``y``; batched here by ``batch_size``, default :attr:`global_batch_size`). Other
        keyword arguments (``validation_data``, ``class_weight``, ...) go to ``model.fit``.
        Returns the History of the last ``model.fit`` call."""
        where = user_line()
        self._check_fit(model, {**kwargs, "callbacks": callbacks}, where)
        if self._data is not None:
            raise SessionError(f"session.fit at {where}: this session has training data from session.dataset() "
                               "already; give the data to session.fit alone")
        self.dataset(x if y is None else (x, y), steps_per_epoch=steps_per_epoch, batch_size=batch_size,
                     shuffle=shuffle)
        self._check_batched(model, where)
        if "model" not in self.objects and model not in self.objects.values():
            self.register(model=model)
        if self.comm.wraps_keras_optimizer and not self.comm.is_wrapped(model.optimizer):
            model.optimizer = self.optimizer(model.optimizer)  # Horovod: average the gradients
        if not any(o is model.optimizer for o in self.objects.values()):
            self.register(optimizer=model.optimizer)
        self._keras_model = model
        self._begin()
        if self._metric_arrays:
            self._build_keras_metrics(model)
        if verbose is None:
            verbose = 2 if self.rank == 0 else 0  # one line per epoch in the chief's log
        hook = _keras_hook(self)
        history = None
        if self.pos.epoch >= self.spec.epochs:
            self._nothing_left()
            return history
        n, first, skip = self.steps_per_epoch, self.pos.epoch, self.pos.step_in_epoch
        if skip >= n:
            # Checkpointed after the epoch's last step but before its end (a notice seen at that
            # step): Keras cannot run an epoch of no steps ("Empty logs"), so the run goes on at the
            # next epoch; that epoch's training is all done, only its end-of-epoch report is lost.
            self.pos.epoch, self.pos.step_in_epoch = first + 1, 0
            self._carried = None
            if self.pos.epoch >= self.spec.epochs:  # the run's last step: its final checkpoint and model
                digest = self.weights_digest()
                self.send({"kind": "epoch", **({"weights_sha256": digest} if self.rank == 0 else {})})
                self.trained = True
                return history
            first, skip = first + 1, 0
        # One model.fit for the rest of the run, over one iterator of the stream from the resumed
        # batch on; the interrupted epoch runs only its steps left (the hook tells Keras where
        # it stands, as Keras' own BackupAndRestore does).
        history = model.fit(self._data.for_keras(first, skip), epochs=self.spec.epochs, initial_epoch=first,
                            steps_per_epoch=n, callbacks=[hook, *(callbacks or [])], verbose=verbose, **kwargs)
        if self.pos.epoch != self.spec.epochs:
            raise SessionError(f"session.fit at {where}: model.fit stopped after epoch {self.pos.epoch} of "
                               f"{self.spec.epochs} (a callback set model.stop_training?); the launcher trains "
                               "--epochs epochs: lower --epochs instead")
        return history

    def _check_fit(self, model, kwargs: dict[str, Any], where: str) -> None:
        from workloads.tf_models import keras

        if not isinstance(model, keras().Model):
            raise SessionError(f"session.fit at {where}: {type(model).__name__} is not a Keras model (tf_keras, "
                               "the legacy tf.keras the launcher trains with)")
        if getattr(model, "optimizer", None) is None or not getattr(model, "compiled_loss", None):
            raise SessionError(f"session.fit at {where}: the model is not compiled; call model.compile(optimizer=..., "
                               "loss=..., metrics=...) inside `with session.scope():` first")
        from workloads.tf_models import keras

        for callback in kwargs.get("callbacks") or []:
            if isinstance(callback, keras().callbacks.BackupAndRestore):
                raise SessionError(f"session.fit at {where}: drop BackupAndRestore: the launcher's checkpoints "
                                   "resume model.fit at the exact step already (and keep-N, gs:// and notices)")
        for name, why in (("epochs", "the run's --epochs (or @training_function(epochs=...)) sets it"),
                          ("initial_epoch", "the launcher resumes where the run stopped"),
                          ("validation_split", "split the data yourself and pass validation_data")):
            if name in kwargs:
                raise SessionError(f"session.fit(..., {name}=...) at {where}: not taken: {why}")

    def _check_batched(self, model, where: str) -> None:
        """A dataset of single examples would be taken for batches of rows: say so."""
        import tensorflow as tf

        inputs = getattr(model, "inputs", None)
        if not inputs:
            return
        spec = self._data.source.element_spec
        first = spec[0] if isinstance(spec, tuple) else spec
        first = tf.nest.flatten(first)[0]
        want = len(inputs[0].shape)
        if first.shape.rank is not None and first.shape.rank == want - 1:
            raise SessionError(f"session.fit at {where}: the dataset yields single examples of shape "
                               f"{tuple(first.shape)} where the model takes batches {tuple(inputs[0].shape)}; "
                               "add .batch(session.global_batch_size) to it")

    def _nothing_left(self) -> None:
        self.send({"kind": "done"}, checkpoint=False)
        self.trained = True

    # -- the Keras hook's calls ---------------------------------------------------------------
    def _keras_epoch_begin(self) -> None:
        self._epoch_started = self._step_started = time.perf_counter()
        self._last_step_at = self._steps_end = None
        self.clock.reset()
        if self._carried:
            c, self._carried = self._carried, None
            self._samples = int(c["samples"])
            self.clock.reset(c.get("phases"))
            self._epoch_started -= float(c["seconds"])
            if self._metric_arrays:
                self._restore_keras_metrics(self._metric_arrays)
            self._metric_arrays = None

    def _keras_step(self) -> None:
        self.pos.step_in_epoch += 1
        self.pos.global_step += 1
        self.trained = True
        self._samples += self._data.size_of(self.pos.epoch, self.pos.step_in_epoch - 1)
        self._last_step_at = time.perf_counter()
        self.after_step(self._step_started, epoch_ends=self._epoch_ends(), values=self._keras_results)
        self._step_started = self._steps_end = time.perf_counter()

    def _keras_results(self) -> dict[str, float]:
        """The model's metrics of the epoch so far, as Keras reports them at an epoch's end (its
        per-step logs are per-replica values summed under a multi-worker strategy)."""
        out: dict[str, Any] = {}
        for metric in self._keras_model.metrics:
            result = metric.result()
            out.update(result if isinstance(result, dict) else {metric.name: result})
        return _numbers(out)

    def _keras_epoch_end(self, logs: dict[str, Any]) -> None:
        self._reported = {name: (value, 1.0) for name, value in _numbers(logs).items()}
        self._end_epoch()


def _numbers(logs: dict[str, Any] | None) -> dict[str, float]:
    """Keras' logs (tensors or numbers) as floats, read now."""
    out = {}
    for name, value in (logs or {}).items():
        try:
            out[name] = float(np.asarray(value))
        except (TypeError, ValueError):
            continue
    return out


def _keras_hook(session: TFSession):
    """The Keras callback through which ``model.fit`` drives the session."""
    from workloads.tf_models import keras

    class LauncherHook(keras().callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._supports_tf_logs = True  # logs stay tensors: nothing read per step

        def on_train_begin(self, logs=None):
            # Where the resumed run stands; Keras asks after on_train_begin (its hook for
            # BackupAndRestore, a private attribute of the legacy tf.keras, which is frozen).
            self.model._training_state = _ResumeAt(session.pos.epoch, session.pos.step_in_epoch)

        def on_train_end(self, logs=None):
            self.model._training_state = None

        def on_epoch_begin(self, epoch, logs=None):
            session._keras_epoch_begin()

        def on_train_batch_end(self, batch, logs=None):
            session._keras_step()

        def on_epoch_end(self, epoch, logs=None):
            session._keras_epoch_end(logs or {})

    return LauncherHook()


class _ResumeAt:
    """What Keras' fit asks its training state: the epoch and the step to start at."""

    def __init__(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return self.epoch, self.step


class EpochData:
    """The training data as one resumable stream of this worker's batches (see the module docstring):
    arrays in the run's global order, or the user's batched dataset repeated."""

    def __init__(self, session: TFSession, data: Any, steps_per_epoch: int | None, batch_size: int | None,
                 shuffle: bool) -> None:
        import tensorflow as tf

        self.session = session
        self.order: GlobalOrder | None = None
        self.arrays: Any = None
        self.shards: Any = None
        self.resumed: tuple[int, int, int] | None = None  # (epoch, its first step, cursor there) of a resume
        where = user_line()
        if isinstance(data, tf.data.Dataset):
            if batch_size is not None:
                raise SessionError(f"batch_size=... at {where} is for arrays: batch the dataset yourself "
                                   "(.batch(session.global_batch_size))")
            source = data
        elif callable(getattr(data, "upcoming", None)) and callable(getattr(data, "permutation", None)):
            # A streamed shard set (launcher.data.Shards): its own order, read sample by sample.
            if steps_per_epoch is not None:
                raise SessionError(f"steps_per_epoch=... at {where}: a shard set's epoch is all its samples; "
                                   "leave it out")
            self.shards = data
            per_worker = max(1, int(batch_size or session.global_batch_size) // session.world)
            self.order = GlobalOrder(len(data), session.seed, shuffle, per_worker, permute=data.permutation)
            steps_per_epoch = self.order.batches_left(0, session.world)
            source = self._ordered(0, 0)
        elif isinstance(data, (tuple, list, dict, np.ndarray)):
            arrays = tf.nest.map_structure(np.asarray, tuple(data) if isinstance(data, list) else data)
            lengths = {len(a) for a in tf.nest.flatten(arrays)}
            if len(lengths) != 1:
                raise SessionError(f"training data at {where}: its arrays have different lengths "
                                   f"({', '.join(map(str, sorted(lengths)))}); give one row per sample in each")
            per_worker = max(1, int(batch_size or session.global_batch_size) // session.world)
            if steps_per_epoch is None:
                self.arrays = arrays
                self.order = GlobalOrder(lengths.pop(), session.seed, shuffle, per_worker)
                steps_per_epoch = self.order.batches_left(0, session.world)
                source = self._ordered(0, 0)
            else:  # a fixed number of batches per epoch: the arrays as a repeated, shuffled stream
                n = lengths.pop()
                source = tf.data.Dataset.from_tensor_slices(arrays)
                if shuffle:
                    source = source.shuffle(n, seed=session.seed, reshuffle_each_iteration=True)
                source = source.batch(int(batch_size or session.global_batch_size))
        else:
            raise SessionError(f"training data at {where}: a {type(data).__name__} is neither a tf.data.Dataset nor "
                               "arrays; give a batched tf.data.Dataset or (x, y) arrays")
        if self.order is None:
            cardinality = int(source.cardinality())
            if steps_per_epoch is None:
                if cardinality < 0:
                    what = "infinite" if cardinality == tf.data.INFINITE_CARDINALITY else "unknown"
                    raise SessionError(f"training data at {where}: its length is {what}, so an epoch has no end; "
                                       "pass steps_per_epoch=N (global batches per epoch)")
                steps_per_epoch = cardinality
            self.repeats = cardinality != tf.data.INFINITE_CARDINALITY
        if steps_per_epoch < 1:
            raise SessionError(f"training data at {where}: an epoch has {steps_per_epoch} batches; give it data")
        self.source, self.steps = source, int(steps_per_epoch)
        first = tf.nest.flatten(source.element_spec)[0]
        global_batch = first.shape[0] if first.shape.rank else None
        if self.order is not None:
            self.per_worker_batch = self.order.batch_size
        else:
            self.per_worker_batch = max(1, int(global_batch or session.global_batch_size) // session.world)
        self._iterator = None

    # -- the global order (arrays) ---------------------------------------------------------------
    def resume_epoch_at(self, epoch: int, cursor: int) -> int:
        """Epoch ``epoch`` goes on at ``cursor`` samples of its order: returns the step (of this
        layout's epoch of :attr:`steps`) it stands at, so the epoch still ends at :attr:`steps`."""
        step = self.steps - self.order.batches_left(cursor, self.session.world)
        self.resumed = (epoch, step, cursor)
        return step

    def _cursor(self, epoch: int, step: int) -> int:
        world = self.session.world
        if self.resumed is not None and self.resumed[0] == epoch and step >= self.resumed[1]:
            return self.order.cursor_after(self.resumed[2], world, step - self.resumed[1])
        return self.order.cursor_after(0, world, step)

    def cursor_at(self, pos: Position) -> int | None:
        """The samples of the epoch used at ``pos`` (global order only; None otherwise)."""
        return self._cursor(pos.epoch, pos.step_in_epoch) if self.order is not None else None

    def size_of(self, epoch: int, step: int) -> int:
        """This worker's samples in the epoch's batch ``step``."""
        if self.order is None:
            return self.per_worker_batch
        return (self._cursor(epoch, step + 1) - self._cursor(epoch, step)) // self.session.world

    def _ordered(self, epoch: int, step: int):
        """This worker's batches of the arrays (or shard set) from ``(epoch, step)`` on, epoch
        after epoch, in the global order."""
        import tensorflow as tf

        s, start = self.session, self._cursor(epoch, step)
        if self.shards is not None:
            data = self.shards
            example = tf.nest.map_structure(np.asarray, data[0])
            structure = example

            def rows(mine):
                items = [tf.nest.flatten(tf.nest.map_structure(np.asarray, data[int(i)])) for i in mine]
                return tuple(np.stack(column) for column in zip(*items))
        else:
            structure = self.arrays
            flat = [np.asarray(a) for a in tf.nest.flatten(structure)]
            example = tf.nest.pack_sequence_as(structure, [a[0] for a in flat])

            def rows(mine):
                return tuple(a[mine] for a in flat)

        def batches():
            e, cursor = epoch, start
            while True:
                if self.shards is not None:
                    self.shards.upcoming(self.order.rank_indices(e, cursor, s.rank, s.world))
                for gb in self.order.global_batches(e, cursor, s.world):
                    yield rows(GlobalOrder.share(gb, s.rank, s.world))
                e, cursor = e + 1, 0

        signature = tuple(tf.TensorSpec((None, *np.shape(a)), tf.as_dtype(np.asarray(a).dtype))
                          for a in tf.nest.flatten(example))
        ds = tf.data.Dataset.from_generator(batches, output_signature=signature)
        return ds.map(lambda *parts: tf.nest.pack_sequence_as(structure, list(parts)))

    # -- streams ---------------------------------------------------------------------------------
    def stream(self, epoch: int, step: int):
        """This worker's batches from ``(epoch, step)`` on."""
        import tensorflow as tf

        if self.order is not None:
            ds = self._ordered(epoch, step)
        else:
            world, rank = self.session.world, self.session.rank
            ds = self.source.repeat() if self.repeats else self.source
            start = epoch * self.steps + step
            if start:
                ds = ds.skip(start)
            if world > 1:
                def share(*parts):
                    mine = tf.nest.map_structure(lambda t: t[rank::world], parts)
                    return mine if len(mine) > 1 else mine[0]

                ds = ds.map(share, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

    def for_keras(self, epoch: int, step: int):
        """What ``model.fit`` iterates: the stream, distributed as it is (no re-batching) under a
        multi-worker strategy."""
        strategy = self.session.strategy
        if self.session.world > 1 and hasattr(self.session.comm, "strategy"):
            return strategy.distribute_datasets_from_function(lambda _: self.stream(epoch, step))
        return self.stream(epoch, step)

    def __iter__(self) -> Iterator[Any]:
        """The batches left in the epoch under way (inside ``session.epochs()``)."""
        s = self.session
        if not s._in_epochs:
            raise SessionError(f"iterating the session's dataset at {user_line()} outside "
                               "`for epoch in session.epochs():`; iterate it inside that loop")
        if self._iterator is None:
            self._iterator = iter(self.for_keras(s.pos.epoch, s.pos.step_in_epoch))
        for _ in range(s.pos.step_in_epoch, self.steps):
            asked = time.perf_counter()
            batch = next(self._iterator)
            s._data_wait += time.perf_counter() - asked
            s._samples += self.size_of(s.pos.epoch, s.pos.step_in_epoch)
            yield batch

    def __len__(self) -> int:
        return self.steps
