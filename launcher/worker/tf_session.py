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

How a resumed run is exact: the data (:mod:`launcher.worker.tf_data`) is one resumable stream
of this worker's batches. Arrays given to :meth:`TFSession.fit` or :meth:`TFSession.dataset`
follow the run's global order, counted by its one cursor, so a run resumed on another number of
workers goes on at the same sample; a batched ``tf.data.Dataset`` of the user's is repeated epoch
after epoch (a deterministic pipeline, e.g. a seeded ``shuffle``, yields the same batches in every
run), its position a batch count, and a resume on another worker count redoes the interrupted
epoch (and says so). One ``model.fit`` call, over one iterator of that stream, trains the rest
of the run: a seeded shuffle's order depends on how many iterators its dataset has made, so a
run makes one. Keras is told that the first epoch starts at the resumed step (the
hook its own ``BackupAndRestore`` uses). Keras' metrics of an interrupted epoch (their variables)
are saved with the checkpoint and restored when it resumes, so the epoch's figures cover all
its steps (:mod:`launcher.worker.tf_keras` holds these Keras parts). A preemption notice is polled between steps (:class:`launcher.worker.loop.Session`):
all workers save at the same step, which is what TensorFlow's ``PreemptionCheckpointHandler``
does for MultiWorkerMirroredStrategy, and works for Horovod as well.

A workload's managed loop (:mod:`launcher.worker.tf_loop`) is a training function on this
session too, so TensorFlow has one checkpoint layout: every registered object's variables as
plain arrays (``tf_state.npz``, readable without a strategy; ``tf_state.json`` says which are
whose) and each rank's running metrics. The final one exports the model
(:mod:`launcher.worker.export`: a workload's as a SavedModel, a function's in Keras' format too).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Any

import numpy as np

from launcher.spec import JobSpec
from launcher.storage import Storage
from launcher.storage.checkpoint import read_manifest
from launcher.worker.formats import TF_INDEX_FILE, TF_STATE_FILE, arrays_digest, load_arrays, save_arrays
from launcher.worker.formats import tf_rank_file as rank_file
from launcher.worker.loader import SessionError, user_line
from launcher.worker import tf_keras
from launcher.worker.loop import Position
from launcher.worker.tf_data import EpochData
from launcher.worker.usersession import UserSession, unregistered_objects


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
        found = {id(obj): (f"the optimizer {type(obj).__name__} is not registered (its slots and iteration "
                           "count start afresh; session.register(optimizer=...) keeps it)")
                 for obj in unregistered_objects(kinds, lambda o: id(o) in registered
                                                 or id(self._stand_ins.get(id(o))) in registered)}
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
        metric_arrays = [v.numpy() for v in tf_keras.metric_variables(self._keras_model)]
        np.savez(mine, epoch=np.array(json.dumps(self._epoch_so_far())),
                 **{f"m{i:04d}": a for i, a in enumerate(metric_arrays)})
        others = self.sizes_over_ranks(rank_file, os.path.getsize(mine))
        if self.rank != 0:
            return
        arrays, index = [], {}
        for name, got in values.items():
            index[name] = [len(arrays), len(got)]
            arrays.extend(got)
        save_arrays(os.path.join(directory, TF_STATE_FILE), arrays)
        with open(os.path.join(directory, TF_INDEX_FILE), "w", encoding="utf-8") as f:
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
        if not os.path.isfile(os.path.join(directory, TF_INDEX_FILE)):
            raise SessionError(f"checkpoint {directory} was written by an older launcher's TensorFlow loop, which "
                               "this one does not read: start a new run (--name)")
        with open(os.path.join(directory, TF_INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
        arrays = load_arrays(os.path.join(directory, TF_STATE_FILE))
        self._saved = {name: arrays[lo:lo + n] for name, (lo, n) in index["objects"].items()}
        # A mid-epoch position is settled once the data is known (_settle_position).
        self.restored(Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step), manifest)
        same_layout = manifest.world_size == self.world and manifest.batch_size == self.spec.batch_size
        self._layout_changed, self._resume_cursor = not same_layout, manifest.cursor
        mine = os.path.join(directory, rank_file(self.rank))
        if same_layout and self.pos.step_in_epoch and os.path.isfile(mine):
            with np.load(mine) as f:
                self._carried = json.loads(str(f["epoch"]))
                self._metric_arrays = [f[k] for k in sorted(k for k in f.files if k.startswith("m"))]

    def export(self, directory: str) -> str:
        # On a thread of its own, outside the strategy's scope (a thread-local): a copy of the
        # model made there has plain variables, where one made inside model.fit would create
        # mirrored variables by collectives that only this rank joins.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="launcher-export") as pool:
            return pool.submit(super().export, directory).result()

    def export_function(self, directory: str) -> str:
        """The trained model in Keras' format, as a SavedModel and its weights, under ``<run>/model/``
        (a subclassed model without ``get_config`` gets its weights only)."""
        from launcher.worker.export import export_keras

        return export_keras(self.spec, self.model(), self._model_arrays, Storage.resolve(self.spec.storage))

    # -- data ------------------------------------------------------------------------------
    def dataset(self, data: Any, *, steps_per_epoch: int | None = None, batch_size: int | None = None,
                shuffle: bool = True) -> EpochData:
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
        pos, cursor = self.pos, self._resume_cursor
        # Without a saved cursor, the same layout's steps give it.
        if self._data.cursor is not None and pos.step_in_epoch and (cursor is not None or not self._layout_changed):
            pos.step_in_epoch = self._data.cursor.resume(pos.epoch, None if cursor is not None else pos.step_in_epoch,
                                                         cursor)
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
        tf_keras.check_fit(model, {**kwargs, "callbacks": callbacks}, where)
        if self._data is not None:
            raise SessionError(f"session.fit at {where}: this session has training data from session.dataset() "
                               "already; give the data to session.fit alone")
        self.dataset(x if y is None else (x, y), steps_per_epoch=steps_per_epoch, batch_size=batch_size,
                     shuffle=shuffle)
        tf_keras.check_batched(model, self._data.source.element_spec, where)
        if "model" not in self.objects and model not in self.objects.values():
            self.register(model=model)
        if self.comm.wraps_keras_optimizer and not self.comm.is_wrapped(model.optimizer):
            model.optimizer = self.optimizer(model.optimizer)  # Horovod: average the gradients
        if not any(o is model.optimizer for o in self.objects.values()):
            self.register(optimizer=model.optimizer)
        self._keras_model = model
        self._begin()
        why = self._metric_arrays and tf_keras.build_metrics(model, self._data.source.element_spec, self.scope())
        if why:
            self._metrics_lost(f"Keras' metrics could not be set up before model.fit ({why})")
        if verbose is None:
            verbose = 2 if self.rank == 0 else 0  # one line per epoch in the chief's log
        hook = tf_keras.hook(self)
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
            why = tf_keras.assign_metrics(self._keras_model, self._metric_arrays) if self._metric_arrays else None
            if why:
                self._metrics_lost(why)
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
        return tf_keras.results(self._keras_model)

    def _keras_epoch_end(self, logs: dict[str, Any]) -> None:
        self._reported = {name: (value, 1.0) for name, value in tf_keras.numbers(logs).items()}
        self._end_epoch()

    def _metrics_lost(self, why: str) -> None:
        """The interrupted epoch's Keras metrics cannot be given back: say so (rank 0), train on."""
        self._metric_arrays = None
        if self.rank == 0:
            print(f"rank 0: {why}; the resumed epoch's metrics cover only the steps after the resume", flush=True)
