"""The TensorFlow session's training data: one resumable stream of this worker's batches.

:class:`EpochData` is what ``session.dataset(...)`` and ``session.fit(...)`` train on
(:mod:`launcher.worker.tf_session`). Arrays (``(x, y)``, a dict), a workload's split (the managed
loop's, read by ``take(indices)``) and a streamed shard set follow the run's global order
(:mod:`launcher.worker.order`: one order of (seed, epoch) over all samples, each global batch
split over the ranks, an :class:`~launcher.worker.order.EpochCursor` of the samples used), so a
run resumed on another number of workers goes on at the same sample. A batched
``tf.data.Dataset`` of the user's is one stream instead, repeated epoch after epoch, its position
a batch count; each worker takes its strided share of every global batch.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np

from launcher.worker.loader import SessionError, user_line
from launcher.worker.order import EpochCursor, GlobalOrder


class EpochData:
    """The training data as one resumable stream of this worker's batches (see the module docstring)."""

    def __init__(self, session: Any, data: Any, steps_per_epoch: int | None, batch_size: int | None,
                 shuffle: bool) -> None:
        import tensorflow as tf

        self.session = session
        self.cursor: EpochCursor | None = None  # the global order's (arrays, a split, a shard set)
        self.shards: Any = None
        self._take: Callable[[np.ndarray], tuple] | None = None  # this rank's rows at sample indices, flat
        self._example: Any = None  # one sample, structured as the batches are
        where = user_line()
        per_worker = max(1, int(batch_size or session.global_batch_size) // session.world)
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

            def take(mine):
                items = [tf.nest.flatten(tf.nest.map_structure(np.asarray, data[int(i)])) for i in mine]
                return tuple(np.stack(column) for column in zip(*items))

            source = self._in_order(len(data), shuffle, per_worker, tf.nest.map_structure(np.asarray, data[0]),
                                    take, data.permutation)
        elif isinstance(data, (tuple, list, dict, np.ndarray)):
            arrays = tf.nest.map_structure(np.asarray, tuple(data) if isinstance(data, list) else data)
            lengths = {len(a) for a in tf.nest.flatten(arrays)}
            if len(lengths) != 1:
                raise SessionError(f"training data at {where}: its arrays have different lengths "
                                   f"({', '.join(map(str, sorted(lengths)))}); give one row per sample in each")
            n = lengths.pop()
            if steps_per_epoch is None:
                flat = [np.asarray(a) for a in tf.nest.flatten(arrays)]
                source = self._in_order(n, shuffle, per_worker, tf.nest.pack_sequence_as(arrays, [a[0] for a in flat]),
                                        lambda mine: tuple(a[mine] for a in flat))
            else:  # a fixed number of batches per epoch: the arrays as a repeated, shuffled stream
                source = tf.data.Dataset.from_tensor_slices(arrays)
                if shuffle:
                    source = source.shuffle(n, seed=session.seed, reshuffle_each_iteration=True)
                source = source.batch(int(batch_size or session.global_batch_size))
        elif callable(getattr(data, "take", None)) and hasattr(data, "__len__"):
            # A workload's split (the managed loop): its rows read a batch at a time.
            x, y = data.take(np.arange(1))
            source = self._in_order(len(data), shuffle, per_worker, (x[0], y[0]), lambda mine: tuple(data.take(mine)))
        else:
            raise SessionError(f"training data at {where}: a {type(data).__name__} is neither a tf.data.Dataset nor "
                               "arrays; give a batched tf.data.Dataset or (x, y) arrays")
        if self.cursor is not None:
            steps_per_epoch = self.cursor.steps(0)
        else:
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
        if self.cursor is not None:
            self.per_worker_batch = self.cursor.order.batch_size
        else:
            first = tf.nest.flatten(source.element_spec)[0]
            global_batch = first.shape[0] if first.shape.rank else None
            self.per_worker_batch = max(1, int(global_batch or session.global_batch_size) // session.world)
        self._iterator = self._arrays = None  # this worker's batches, as tensors / as numpy arrays

    # -- the global order (arrays, a split, a shard set) -----------------------------------------
    def _in_order(self, n: int, shuffle: bool, per_worker: int, example: Any, take: Callable, permute=None):
        s = self.session
        self.cursor = EpochCursor(GlobalOrder(n, s.seed, shuffle, per_worker, permute=permute), s.world)
        self._example, self._take = example, take
        return self._ordered(0, 0)

    def cursor_at(self, pos: Any) -> int | None:
        """The samples of the epoch used at ``pos`` (global order only; None otherwise)."""
        return self.cursor.at(pos.epoch, pos.step_in_epoch) if self.cursor is not None else None

    def size_of(self, epoch: int, step: int) -> int:
        """This worker's samples in the epoch's batch ``step``."""
        return self.cursor.size_of(epoch, step) if self.cursor is not None else self.per_worker_batch

    def _rows(self, epoch: int, step: int) -> Iterator[tuple]:
        """This worker's batches from ``(epoch, step)`` on, epoch after epoch, in the global order,
        each as a flat tuple of arrays."""
        s, first = self.session, step
        while True:
            if self.shards is not None:
                self.shards.upcoming(self.cursor.rank_indices(epoch, first, s.rank))
            for gb in self.cursor.global_batches(epoch, first):
                yield self._take(GlobalOrder.share(gb, s.rank, s.world))
            epoch, first = epoch + 1, 0

    def _ordered(self, epoch: int, step: int):
        """:meth:`_rows` as a ``tf.data.Dataset`` of batches structured as the data is."""
        import tensorflow as tf

        example = self._example
        signature = tuple(tf.TensorSpec((None, *np.shape(a)), tf.as_dtype(np.asarray(a).dtype))
                          for a in tf.nest.flatten(example))
        ds = tf.data.Dataset.from_generator(lambda: self._rows(epoch, step), output_signature=signature)
        return ds.map(lambda *parts: tf.nest.pack_sequence_as(example, list(parts)))

    # -- streams ---------------------------------------------------------------------------------
    def stream(self, epoch: int, step: int):
        """This worker's batches from ``(epoch, step)`` on."""
        import tensorflow as tf

        if self.cursor is not None:
            ds = self._ordered(epoch, step)
        else:
            world, rank = self.session.world, self.session.rank
            ds = self.source.repeat() if self.repeats else self.source
            start = epoch * self.steps + step
            if start:
                ds = ds.skip(start)
            if world > 1:
                def share(*parts):
                    mine = tf.nest.map_structure(lambda t: GlobalOrder.share(t, rank, world), parts)
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
        """The batches left in the epoch under way (inside ``session.epochs()``), as tensors."""
        s = self.session
        if self._iterator is None and s._in_epochs:
            self._iterator = iter(self.for_keras(s.pos.epoch, s.pos.step_in_epoch))
        return self._counted(self._iterator, user_line())

    def arrays(self) -> Iterator[Any]:
        """The same batches as numpy arrays, read on this thread rather than through ``tf.data``
        (global order only): for a train step that takes them as they are, as the managed loop's
        does; a stream of a few small batches per step costs more than the step itself."""
        s = self.session
        if self._arrays is None and s._in_epochs:
            import tensorflow as tf

            rows = self._rows(s.pos.epoch, s.pos.step_in_epoch)
            self._arrays = (tf.nest.pack_sequence_as(self._example, list(flat)) for flat in rows)
        return self._counted(self._arrays, user_line())

    def _counted(self, batches: Iterator[Any] | None, where: str) -> Iterator[Any]:
        s = self.session
        if not s._in_epochs:
            raise SessionError(f"iterating the session's dataset at {where} outside "
                               "`for epoch in session.epochs():`; iterate it inside that loop")
        for _ in range(s.pos.step_in_epoch, self.steps):
            asked = time.perf_counter()
            batch = next(batches)
            s._data_wait += time.perf_counter() - asked
            s._samples += self.size_of(s.pos.epoch, s.pos.step_in_epoch)
            yield batch

    def __len__(self) -> int:
        return self.steps
