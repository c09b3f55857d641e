"""The training loader's batches under ``--strategy ft`` (:mod:`launcher.worker.ft`): each draw
forms the step's quorum first, then takes this replica's share of the step's global batch from
the run's one global order (:class:`launcher.worker.order.GlobalOrder`); a step's samples count
when it commits, whoever trained them, so every sample of an epoch is trained by exactly one
committed step whatever the quorum was."""

from __future__ import annotations

from typing import Any

import numpy as np

from launcher.worker.loader import BatchOrder
from launcher.worker.order import GlobalOrder


class QuorumOrder(BatchOrder):
    """The training loader's batches under ``ft`` (see the module docstring): each draw forms the
    step's quorum first, then takes this replica's share of the step's global batch."""

    def __init__(self, strategy: Any, *args: Any) -> None:
        """``strategy``: the run's :class:`launcher.worker.ft.FaultTolerant` (its quorums)."""
        super().__init__(*args)
        self.strategy = strategy
        self.cursor = 0     # samples of the epoch that committed steps trained
        self.pending = 0    # the global batch of the step under way, counted when it commits
        self.over = False   # the epoch's last step committed
        self.handed = 0     # batches handed out in the epoch (retried ones too), as the loader counts
        self._permutation: tuple[int, np.ndarray] | None = None

    def resume_at(self, batches: int, cursor: int | None) -> None:
        self.cursor = cursor if cursor is not None else self.order.cursor_after(0, self.strategy.replicas, batches)

    def epoch_over(self) -> None:
        self.cursor = self.pending = self.handed = 0
        self.over = False

    def __len__(self) -> int:
        """The loader's batches: those handed out, and once the epoch is over no more (what
        the session's end-of-epoch test reads); until then an estimate at the current quorum."""
        participants = self.strategy.participants or self.strategy.replicas
        return self.handed if self.over else self.handed + max(1, self.order.batches_left(self.cursor, participants))

    def epoch_length(self) -> int:
        return self.order.batches_left(0, self.strategy.replicas)

    def cursor_at(self, batch: int) -> int:
        return self.cursor

    def size_of(self, b: int) -> int:
        return 0  # a step's samples count when it commits (commit), whoever trained them

    def commit(self, participants: int) -> None:
        """The step under way committed: the cursor moves on by its global batch; the epoch is over
        when no global batch of this quorum's size is left (at most ``participants - 1`` samples,
        which wait for the next epoch's order, as in :mod:`launcher.worker.order`)."""
        self.cursor += self.pending
        self.session._samples += self.pending
        self.pending = 0
        self.over = self.cursor >= self.order.end(self.cursor, participants)

    def permutation(self, epoch: int) -> np.ndarray:
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, self.order.permutation(epoch))
        return self._permutation[1]

    def __iter__(self):
        s = self.session
        self.handed = self.start
        while not self.over:
            participants, rank = self.strategy.begin_step()  # may heal: position and cursor change
            end = self.order.end(self.cursor, participants)
            if self.cursor >= end:  # nothing left for a quorum this size (it grew at the epoch's end)
                self.over = True
                return
            span = self.order.batch_size * participants
            global_batch = self.permutation(s.pos.epoch)[self.cursor:min(self.cursor + span, end)]
            self.pending = len(global_batch)
            self.handed += 1
            yield GlobalOrder.share(global_batch, rank, participants).tolist()
