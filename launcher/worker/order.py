"""The training data's sample order: one order over the whole data set, whatever the worker count.

An epoch visits the ``n`` samples in a permutation drawn from ``(seed, epoch)`` alone (or in
their own order, unshuffled). It is cut into *global batches* of ``batch_size x world``
samples, and each rank takes its strided share of every global batch (``batch[rank::world]``,
as the Keras session does), so a global batch holds the same samples on any backend. Where an
epoch stands is a *cursor*: the samples of the epoch consumed so far. A checkpoint saves it,
and a run resumed on another number of workers continues at the same sample, with global
batches of its own size: nothing repeated, nothing skipped.

Every rank takes the same number of samples from each global batch, as synchronous training
needs: an epoch's last global batch holds a multiple of ``world`` samples, so at most
``world - 1`` samples at the epoch's end wait for the next epoch's order (the same rule the
per-rank shards of :func:`workloads.base.shard_indices` follow). With ``drop_last`` the epoch
ends at its last full global batch.

:class:`EpochCursor` is the one count of where an epoch stands in that order, step by step, that
both sessions' loaders use (torch's :class:`launcher.worker.loader.BatchOrder`, TensorFlow's
:class:`launcher.worker.tf_data.EpochData`); a resumed epoch starts at its checkpoint's cursor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class GlobalOrder:
    """The order of ``n`` samples, epoch by epoch (see the module docstring)."""

    n: int
    seed: int
    shuffle: bool = True
    batch_size: int = 1      # per worker: a global batch is batch_size x world
    drop_last: bool = False
    # A dataset's own epoch order, ``permute(seed, epoch, shuffle)`` (a streamed shard set reads
    # shard after shard: launcher.data.Shards.permutation); a pure function of (seed, epoch) too.
    permute: Callable[[int, int, bool], np.ndarray] | None = dataclasses.field(default=None, compare=False)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of all ``n`` samples: a pure function of (seed, epoch)."""
        if self.permute is not None:
            return self.permute(self.seed, epoch, self.shuffle)
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch, 0x5A17]).permutation(self.n)

    def end(self, cursor: int, world: int) -> int:
        """Where an epoch continued from ``cursor`` on ``world`` workers ends."""
        left = max(0, self.n - cursor)
        span = self.batch_size * world
        usable = left // span * span if self.drop_last else left - left % world
        return cursor + usable

    def batches_left(self, cursor: int, world: int) -> int:
        """Global batches from ``cursor`` to the epoch's end on ``world`` workers."""
        return math.ceil((self.end(cursor, world) - cursor) / (self.batch_size * world))

    def cursor_after(self, cursor: int, world: int, batches: int) -> int:
        """The cursor ``batches`` global batches after ``cursor``."""
        return min(cursor + batches * self.batch_size * world, self.end(cursor, world))

    def global_batches(self, epoch: int, cursor: int, world: int) -> Iterator[np.ndarray]:
        """The epoch's global batches from ``cursor`` on, each the samples' indices."""
        order, span, end = self.permutation(epoch), self.batch_size * world, self.end(cursor, world)
        for start in range(cursor, end, span):
            yield order[start:min(start + span, end)]

    def rank_indices(self, epoch: int, cursor: int, rank: int, world: int) -> np.ndarray:
        """Every sample ``rank`` reads from ``cursor`` to the epoch's end, in order."""
        order, span, end = self.permutation(epoch), self.batch_size * world, self.end(cursor, world)
        mine = [GlobalOrder.share(order[start:min(start + span, end)], rank, world)
                for start in range(cursor, end, span)]
        return np.concatenate(mine) if mine else np.arange(0)

    @staticmethod
    def share(global_batch: np.ndarray, rank: int, world: int) -> np.ndarray:
        """Rank's share of a global batch: every world-th sample from its rank on."""
        return global_batch[rank::world]


class EpochCursor:
    """Where each epoch stands in ``order`` on ``world`` workers: the samples used (the cursor)
    once a step of it is done. An epoch starts at sample 0, but for the one a checkpoint resumed
    in the middle: it goes on at the checkpoint's cursor, written perhaps by another worker count
    or batch size, in global batches of this layout from there on."""

    def __init__(self, order: GlobalOrder, world: int) -> None:
        self.order, self.world = order, world
        self.resumed: tuple[int, int, int] | None = None  # (epoch, its step at the resume, cursor there)

    def resume(self, epoch: int, step: int | None, cursor: int | None = None) -> int:
        """``epoch`` goes on at step ``step`` with ``cursor`` samples of its order used (None: as
        many as ``step`` steps take in this layout). ``step`` None: the step that still ends the
        epoch at its whole length in this layout (an epoch of fixed steps, as Keras' fit runs
        it). Returns the step."""
        if cursor is None:
            cursor = self.order.cursor_after(0, self.world, step or 0)
        if step is None:
            step = self.order.batches_left(0, self.world) - self.order.batches_left(cursor, self.world)
        self.resumed = (epoch, step, cursor)
        return step

    def _start(self, epoch: int, step: int) -> tuple[int, int]:
        """(step, cursor) that ``epoch``'s step ``step`` is counted from."""
        r = self.resumed
        return (r[1], r[2]) if r is not None and r[0] == epoch and step >= r[1] else (0, 0)

    def at(self, epoch: int, step: int) -> int:
        """The samples of ``epoch`` used once ``step`` of its steps are done."""
        first, cursor = self._start(epoch, step)
        return self.order.cursor_after(cursor, self.world, step - first)

    def steps(self, epoch: int) -> int:
        """The steps of ``epoch`` in this layout (a resumed one: its steps before the resume and
        the global batches left after it)."""
        first, cursor = self._start(epoch, self.resumed[1] if self.resumed else 0)
        return first + self.order.batches_left(cursor, self.world)

    def size_of(self, epoch: int, step: int) -> int:
        """Each worker's samples in ``epoch``'s step ``step`` (0-based)."""
        return (self.at(epoch, step + 1) - self.at(epoch, step)) // self.world

    def global_batches(self, epoch: int, step: int) -> Iterator[np.ndarray]:
        """``epoch``'s global batches from its step ``step`` on."""
        return self.order.global_batches(epoch, self.at(epoch, step), self.world)

    def rank_indices(self, epoch: int, step: int, rank: int) -> np.ndarray:
        """Every sample ``rank`` reads in ``epoch`` from its step ``step`` on, in order."""
        return self.order.rank_indices(epoch, self.at(epoch, step), rank, self.world)
