"""A shard set as a dataset of the training session: streamed, in the run's global order.

``Shards("gs://bucket/imagenet-shards", transform=decode)`` is a map-style dataset
(``len``, ``[i]``) that :meth:`session.loader` (torch) and :meth:`session.fit` /
:meth:`session.dataset` (Keras, TensorFlow) take like any other. What it adds:

- **Its epoch order** (:meth:`Shards.permutation`), a pure function of (seed, epoch) that
  reads shards one after another: the shards in an order drawn from (seed, epoch), and
  the samples inside a window of ``window`` consecutive samples of that sequence shuffled
  (a bounded shuffle buffer, drawn from (seed, epoch) too). The session's global order
  (:mod:`launcher.worker.order`) cuts it into global batches and keeps the cursor, so a
  streamed run resumes mid-epoch exactly, on any number of workers.
- **Streaming**: shards are fetched ahead of use into the node's cache
  (:mod:`launcher.data.cache`), which stays within ``--data-cache-gb``; a rank keeps the
  few shards of its current window decoded in memory.

Every rank reads every shard of the epoch (each global batch is split over the ranks by
stride), and the ranks of a node share the cache, so a node downloads each shard about once
per epoch. Shard your data so that the shards are shuffled already (``launcher data shard``
writes samples in a shuffled order unless told not to): the window mixes neighbouring
samples only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
from typing import Any, Callable, Iterable

import numpy as np

from launcher.data.cache import ShardCache, limit_bytes, shards_held
from launcher.data.formats import read_shard
from launcher.data.index import ShardIndex
from launcher.errors import UserError

PREFETCH_SHARDS = 4   # shards fetched ahead of the one being read, per rank
FETCHERS = 4          # downloads at once, per rank


class Shards:
    """A shard set (see the module docstring). ``transform(sample)`` turns a stored sample
    (a dict: a parquet row, a JSON line, a WebDataset sample's members) into what training
    takes (e.g. ``(image_tensor, label)``). ``window``: samples shuffled together (default:
    about two shards' worth). ``cache_gb``: the node's cache limit (default the run's
    ``--data-cache-gb``)."""

    def __init__(self, uri: str, transform: Callable[[Any], Any] | None = None, *, window: int | None = None,
                 cache_gb: float | None = None) -> None:
        self.uri = uri
        self.index = ShardIndex.load(uri)
        self.transform = transform
        counts = [s.samples for s in self.index.shards]
        mean = max(1, self.index.samples // max(1, len(counts)))
        self.window = int(window) if window else 2 * mean
        if self.window < 1:
            raise ValueError(f"window must be >= 1 sample, got {window}")
        self.cache_gb = cache_gb
        self._offsets = self.index.offsets()
        # Shards one window can touch, plus the one being started: the decoded ones kept.
        self._keep = max(2, math.ceil(self.window / max(1, min(counts or [1]))) + 2)
        self._local: _Reader | None = None

    def __len__(self) -> int:
        return self.index.samples

    def __getitem__(self, i: int) -> Any:
        sample = self._reader().sample(int(i))
        return self.transform(sample) if self.transform is not None else sample

    def __getstate__(self) -> dict:  # a DataLoader worker process gets its own reader
        state = dict(self.__dict__)
        state["_local"] = None
        return state

    def _reader(self) -> "_Reader":
        if self._local is None:
            self._local = _Reader(self)
        return self._local

    # -- the order ---------------------------------------------------------------------------
    def permutation(self, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        """The epoch's order of all samples: shards in an order of (seed, epoch), the samples of
        each window of :attr:`window` consecutive ones shuffled (see the module docstring)."""
        offsets = self._offsets
        shards = np.arange(len(self.index.shards))
        if shuffle:
            shards = np.random.default_rng([seed, epoch, 0x5A4D]).permutation(shards)
        order = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in shards]) if len(shards) else \
            np.arange(0)
        if shuffle:
            rng = np.random.default_rng([seed, epoch, 0x3B1F])
            for start in range(0, len(order), self.window):
                block = order[start:start + self.window]
                order[start:start + self.window] = block[rng.permutation(len(block))]
        return order

    def shard_of(self, i: int) -> int:
        return int(np.searchsorted(self._offsets, i, side="right") - 1)

    def upcoming(self, indices: Iterable[int]) -> None:
        """The samples this rank reads next, in order: their shards are fetched ahead and each
        is released once read past (the session's loader calls it at each epoch's start)."""
        self._reader().plan(indices)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None


class _Reader:
    """One process's view of a shard set: its cache, the decoded shards in memory, and the
    prefetch of the shards its plan reads next."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self.cache = ShardCache(shards.index, limit_bytes(shards.cache_gb))
        if not self.cache.local:
            # A window's shards are read at once, and the next one is needed before they are done.
            spans = shards_held(shards.window, shards.index)
            largest = sorted((s.bytes for s in shards.index.shards), reverse=True)[:spans]
            if sum(largest) > self.cache.limit:
                raise UserError(
                    f"the data cache's limit ({self.cache.limit / 2**20:,.3g} MiB) cannot hold the {len(largest)} "
                    f"shards of {shards.index.uri} a window of {shards.window:,} samples reads at once "
                    f"({sum(largest) / 2**20:,.3g} MiB)",
                    "raise --data-cache-gb, or pass Shards(..., window=N) with a smaller N")
        self.decoded: collections.OrderedDict[int, list] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(FETCHERS, thread_name_prefix="launcher-shards")
        self.sequence: list[int] = []   # the planned shards, in order of first use
        self.place: dict[int, int] = {}  # planned shard -> its place in the sequence
        self.last_use: dict[int, int] = {}  # planned shard -> the last planned read of it
        self.reads = 0                  # reads since the plan
        self.current = 0                # the place of the furthest shard read so far
        self.pinned: set[int] = set()   # shards this process reads now (pinned in the cache)
        self.ahead: set[int] = set()    # shards it fetched ahead of use
        self.fetching: dict[int, concurrent.futures.Future] = {}

    def plan(self, indices: Iterable[int]) -> None:
        idx = np.fromiter(indices, dtype=np.int64)
        shard_ids = np.searchsorted(self.shards._offsets, idx, side="right") - 1
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for position, s in enumerate(shard_ids.tolist()):
            first.setdefault(s, position)
            last[s] = position
        with self.lock:
            self.sequence = sorted(first, key=first.get)
            self.place = {s: k for k, s in enumerate(self.sequence)}
            self.last_use, self.reads, self.current = last, 0, 0
            released = [s for s in self.pinned | self.ahead if s not in last]
            self.pinned -= set(released)
            self.ahead -= set(released)
        self.cache.unpin(released)
        self._prefetch()

    def _prefetch(self) -> None:
        """Fetch the planned shards from the one being read to PREFETCH_SHARDS after it (each
        call tries again those that found no room in the cache before)."""
        with self.lock:
            ahead = self.sequence[self.current:self.current + 1 + PREFETCH_SHARDS]
            wanted = [s for s in ahead if s not in self.fetching and s not in self.decoded
                      and not ((s in self.ahead or s in self.pinned) and self.cache.present(s))]
            for s in wanted:
                self.fetching[s] = self.pool.submit(self._fetch_ahead, s)

    def _fetch_ahead(self, s: int) -> None:
        try:
            if self.cache.fetch(s, wait=False):
                with self.lock:
                    self.ahead.add(s)
        finally:
            with self.lock:
                self.fetching.pop(s, None)

    def sample(self, i: int) -> Any:
        s = self.shards.shard_of(i)
        with self.lock:
            samples = self.decoded.get(s)
            if samples is not None:
                self.decoded.move_to_end(s)
            future = self.fetching.get(s)
        if samples is None:
            if future is not None:
                future.result()
            path = self.cache.get(s)
            with self.lock:
                self.pinned.add(s)
                self.ahead.discard(s)
            samples = read_shard(self.shards.index.kind, path, self.shards.index.fields)
            dropped = []
            with self.lock:
                self.decoded[s] = samples
                while len(self.decoded) > self.shards._keep:
                    dropped.append(self.decoded.popitem(last=False)[0])
                if not self.last_use:  # no plan (a DataLoader worker process): done with what it dropped
                    self.pinned -= set(dropped)
                    self.ahead -= set(dropped)
                else:
                    dropped = []
            self.cache.unpin(dropped)
        self._count_read(s)
        return samples[i - int(self.shards._offsets[s])]

    def _count_read(self, s: int) -> None:
        done, moved = [], False
        with self.lock:
            if self.last_use:
                self.reads += 1
                place = self.place.get(s, self.current)
                moved, self.current = place > self.current, max(self.current, place)
                if self.reads > self.last_use.get(s, -1) and s in self.pinned:
                    # Its last planned read: its file may go (its samples stay decoded a while).
                    self.pinned.discard(s)
                    self.ahead.discard(s)
                    done.append(s)
        if done:
            self.cache.unpin(done)
        if done or moved:
            self._prefetch()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            pinned, self.pinned, self.ahead = list(self.pinned | self.ahead), set(), set()
        self.cache.unpin(pinned)
