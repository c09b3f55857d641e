"""The training data's global sample order (launcher/worker/order.py), the one cursor over it
(EpochCursor, which both sessions' loaders count with) and the torch session's batch sampler
(launcher/worker/loader.py BatchOrder): one order per epoch whatever the worker count, each
global batch split over the ranks, and a cursor that a run resumed on another worker count
continues from, with nothing repeated and nothing skipped. No Ray."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from launcher.worker.loader import BatchOrder
from launcher.worker.order import EpochCursor, GlobalOrder


def _session(rank: int, world: int, epoch: int = 0, seed: int = 5):
    return types.SimpleNamespace(rank=rank, world=world, spec=types.SimpleNamespace(seed=seed),
                                 pos=types.SimpleNamespace(epoch=epoch))


def _epoch_on(order: GlobalOrder, epoch: int, world: int, cursor: int = 0) -> list[list[np.ndarray]]:
    """Each global batch from ``cursor`` as the ranks take it."""
    return [[GlobalOrder.share(gb, r, world) for r in range(world)]
            for gb in order.global_batches(epoch, cursor, world)]


@pytest.mark.parametrize("n,batch,world", [(100, 8, 3), (64, 4, 2), (37, 5, 4), (10, 32, 2)])
def test_an_epoch_visits_every_sample_once_in_equal_shares(n, batch, world):
    order = GlobalOrder(n, seed=1, batch_size=batch)
    batches = _epoch_on(order, 0, world)
    seen = np.concatenate([share for shares in batches for share in shares])
    assert sorted(seen.tolist()) == sorted(order.permutation(0)[:n - n % world].tolist())
    assert len(set(seen.tolist())) == len(seen)  # nothing twice
    for shares in batches:  # every rank takes as many samples from each global batch
        assert len({len(s) for s in shares}) == 1 and len(shares[0]) >= 1
    # As many steps as the per-rank shards gave (workloads.base.shard_indices, equal=True).
    assert order.batches_left(0, world) == len(batches) == math.ceil((n // world) / batch)
    dropping = GlobalOrder(n, seed=1, batch_size=batch, drop_last=True)
    assert dropping.batches_left(0, world) == (n // world) // batch


def test_the_order_is_the_seeds_and_epochs_alone():
    order = GlobalOrder(50, seed=3, batch_size=4)
    assert np.array_equal(order.permutation(2), GlobalOrder(50, seed=3, batch_size=9).permutation(2))
    assert not np.array_equal(order.permutation(0), order.permutation(1))
    assert not np.array_equal(order.permutation(0), GlobalOrder(50, seed=4).permutation(0))
    assert np.array_equal(GlobalOrder(7, seed=3, shuffle=False).permutation(4), np.arange(7))
    # Split over 1, 2 or 4 workers, the global batches are the same samples in the same order.
    one, four = _epoch_on(order, 0, 1), _epoch_on(GlobalOrder(50, seed=3, batch_size=1), 0, 4)
    assert np.array_equal(np.concatenate([s[0] for s in one])[:48],
                          np.concatenate([np.stack(shares, 1).ravel() for shares in four]))


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (4, 2), (1, 2)])
def test_a_resume_on_another_worker_count_repeats_and_skips_nothing(before, after):
    n, batch = 101, 4
    order = GlobalOrder(n, seed=9, batch_size=batch)
    done = 5  # global batches trained on `before` workers
    first = [s for shares in _epoch_on(order, 1, before)[:done] for s in shares]
    cursor = order.cursor_after(0, before, done)
    rest = [s for shares in _epoch_on(order, 1, after, cursor) for s in shares]
    seen = np.concatenate(first + rest).tolist()
    assert len(seen) == len(set(seen))  # nothing repeated
    left_out = n - len(seen)  # only the tail that does not split evenly over `after` workers
    assert left_out == (n - cursor) % after
    assert seen == [] or set(seen) <= set(range(n))
    assert np.array_equal(np.sort(seen), np.sort(order.permutation(1)[:n - left_out]))


def test_the_cursor_counts_a_resumed_epoch_from_its_checkpoint_and_every_other_from_its_start():
    order = GlobalOrder(90, seed=5, batch_size=4)
    two = EpochCursor(order, 2)
    assert two.steps(0) == math.ceil(45 / 4) and two.at(0, 4) == 32 and two.size_of(0, 4) == 4
    assert two.at(0, two.steps(0)) == 90 and two.size_of(0, 11) == 1  # the last global batch: 1 sample each
    # Resumed on 1 worker at the 4 steps and the 32 samples 2 workers did (torch's count: the steps
    # done, then this layout's global batches for the samples left).
    alone = EpochCursor(order, 1)
    assert alone.resume(3, 4, 32) == 4
    assert alone.steps(3) == 4 + math.ceil(58 / 4) and alone.at(3, 5) == 36 and alone.size_of(3, 4) == 4
    assert np.array_equal(np.concatenate(list(alone.global_batches(3, 4))), order.permutation(3)[32:])
    assert np.array_equal(alone.rank_indices(3, 4, 0), order.permutation(3)[32:])
    assert alone.steps(4) == math.ceil(90 / 4) and alone.at(4, 2) == 8  # the next epoch starts at 0
    assert alone.at(3, 2) == 8  # and steps before the resume count from the epoch's start
    # Keras' count: the step that still ends the epoch at its whole length in this layout.
    fixed = EpochCursor(order, 1)
    step = fixed.resume(3, None, 32)
    assert step == math.ceil(90 / 4) - math.ceil(58 / 4) and fixed.at(3, step) == 32
    assert fixed.steps(3) == math.ceil(90 / 4)
    # A checkpoint without a cursor, same layout: as many samples as its steps take here.
    same = EpochCursor(order, 2)
    assert same.resume(1, 3) == 3 and same.at(1, 3) == 24 and same.steps(1) == two.steps(1)


def test_the_sampler_resumed_at_its_batch_gives_the_rest_of_the_epoch():
    """Same worker count: the resumed sampler's batches are the uninterrupted one's tail; at
    another count it continues from the saved cursor."""
    for rank in range(2):
        whole = BatchOrder(_session(rank, 2, epoch=3), 90, 4, train=True, shuffle=True, drop_last=False)
        full = list(whole)
        assert len(full) == len(whole) == whole.epoch_length() == math.ceil(45 / 4)
        resumed = BatchOrder(_session(rank, 2, epoch=3), 90, 4, train=True, shuffle=True, drop_last=False)
        resumed.resume_at(4, None)  # a checkpoint without a cursor, same layout
        resumed.start = 4
        assert list(resumed) == full[4:] and len(resumed) == len(full)
        assert resumed.cursor_at(4) == 32 and resumed.size_of(4) == 4
    cursor = BatchOrder(_session(0, 2, epoch=3), 90, 4, True, True, False).cursor_at(4)
    alone = BatchOrder(_session(0, 1, epoch=3), 90, 4, train=True, shuffle=True, drop_last=False)
    alone.resume_at(4, cursor)
    alone.start = 4
    rest = [i for b in alone for i in b]
    first = [i for r in range(2) for b in list(BatchOrder(_session(r, 2, epoch=3), 90, 4, True, True, False))[:4]
             for i in b]
    assert sorted(first + rest) == list(range(90))
    assert len(alone) == 4 + math.ceil((90 - 32) / 4)


def test_evaluation_and_presharded_loaders_keep_their_shards():
    evaluation = [i for r in range(3) for b in BatchOrder(_session(r, 3), 10, 4, train=False, shuffle=False,
                                                          drop_last=False) for i in b]
    assert sorted(evaluation) == list(range(10))
    mine = BatchOrder(_session(1, 2), 12, 4, train=True, shuffle=True, drop_last=False, shard=False)
    assert not mine.is_global and sorted(i for b in mine for i in b) == list(range(12))
