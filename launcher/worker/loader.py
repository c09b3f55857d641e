"""The training session's data loader: the user's map-style dataset in the launcher's order.

:class:`ResumableLoader` is a plain ``torch.utils.data.DataLoader`` driven by
:class:`BatchOrder`, a batch sampler in the run's order (:mod:`launcher.worker.order`: one
order over the whole data set, each global batch split over the ranks). The training loader
counts the batches it hands out; the samples they used (the cursor, counted by
:class:`~launcher.worker.order.EpochCursor`) are the position a checkpoint saves, and a resumed
epoch starts the sampler there. Errors a user's code causes here say where, in one line
(:func:`user_line`).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import numpy as np

from launcher.worker.order import EpochCursor, GlobalOrder

_LAUNCHER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP_DIRS = (_LAUNCHER_DIR, os.path.dirname(os.__file__))


class SessionError(RuntimeError):
    """A training function that uses the session wrongly: what, where in the user's file, how to fix."""


class CollateError(RuntimeError):
    """The loader could not make a batch of the dataset's items."""


def user_line(tb=None) -> str:
    """``file:line`` of the innermost frame in the user's code (outside the launcher, torch and
    the standard library): of a traceback when given, else of the current call stack."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()[:-1]
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_SKIP_DIRS) and "site-packages" not in path and not path.startswith("<"):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _to_device(batch: Any, device) -> Any:
    """Tensors anywhere in a batch (tuples, lists, dicts) moved to ``device``, asynchronously
    where the memory is pinned."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_to_device(v, device) for v in batch)
    if hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to_device(v, device) for v in batch))
    return batch


class BatchOrder:
    """A batch sampler over ``n`` items, starting at the batch the session says (a resumed
    position). The training loader of a whole dataset follows the run's :class:`GlobalOrder`
    (one order over all items; each global batch split over the ranks of the moment), so a
    run resumed on another number of workers continues at the same sample. A dataset that is
    this rank's share already (``shard`` False) is visited in an order drawn from (seed,
    epoch, rank). For evaluation (``train`` False) the shards cover every item once, in order."""

    def __init__(self, session: Any, n: int, batch_size: int, train: bool, shuffle: bool,
                 drop_last: bool, shard: bool = True, dataset: Any = None) -> None:
        from workloads.base import shard_indices

        self.session, self.batch_size, self.train, self.shuffle = session, batch_size, train, shuffle
        self.drop_last = drop_last
        # A streamed dataset (launcher.data.Shards) has an order of its own and is told what
        # this rank reads next, so that it fetches those shards ahead.
        streamed = dataset is not None and callable(getattr(dataset, "upcoming", None))
        self.plan = dataset.upcoming if streamed else None
        permute = dataset.permutation if streamed else None
        self.order = GlobalOrder(n, session.spec.seed, shuffle, batch_size, drop_last, permute) \
            if train and shard else None
        self.epoch_cursor = EpochCursor(self.order, session.world) if self.order is not None else None
        if self.order is None:
            self.indices = shard_indices(n, session.rank, session.world, equal=train) if shard else np.arange(n)
        # A sharded model (--strategy fsdp) gathers its weights in every forward pass, a collective:
        # an evaluation shard is cut into the same number of batches on every rank (a batch of a
        # shorter shard has one item fewer), so that every rank makes the same number of passes.
        self.even: list[np.ndarray] | None = None
        if not train and shard and getattr(session, "sharded", False):
            count = math.ceil(math.ceil(n / session.world) / batch_size)
            if len(self.indices) < count:
                raise SessionError(f"session.loader(..., train=False) at {user_line()}: {n} item(s) over "
                                   f"{session.world} workers in batches of {batch_size}: with --strategy fsdp every "
                                   "worker makes the same number of forward passes, and a worker would have an "
                                   "empty batch; give the evaluation set more items or a larger batch size")
            self.even = np.array_split(self.indices, count)
        self.start = 0     # the batch the next iteration starts at

    @property
    def is_global(self) -> bool:
        return self.order is not None

    def resume_at(self, batches: int, cursor: int | None) -> None:
        """A resumed epoch: ``batches`` steps done (in whatever layout), ``cursor`` samples used."""
        if self.epoch_cursor is not None:
            self.epoch_cursor.resume(self.session.pos.epoch, batches, cursor)

    def epoch_over(self) -> None:
        """An epoch ended (the global order's cursor counts each epoch from its start already; a
        sampler with a count of its own resets it here)."""

    def __len__(self) -> int:
        if self.epoch_cursor is not None:
            return self.epoch_cursor.steps(self.session.pos.epoch)
        if self.even is not None:
            return len(self.even)
        n = len(self.indices)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_length(self) -> int:
        """Batches in a whole epoch at this worker count."""
        return self.order.batches_left(0, self.session.world) if self.order is not None else len(self)

    def cursor_at(self, batch: int) -> int | None:
        """Samples of the epoch used once ``batch`` batches are done (global order only)."""
        return None if self.epoch_cursor is None else self.epoch_cursor.at(self.session.pos.epoch, batch)

    def __iter__(self) -> Iterator[list[int]]:
        s = self.session
        if self.epoch_cursor is not None:
            if self.plan is not None:
                self.plan(self.epoch_cursor.rank_indices(s.pos.epoch, self.start, s.rank))
            for gb in self.epoch_cursor.global_batches(s.pos.epoch, self.start):
                yield GlobalOrder.share(gb, s.rank, s.world).tolist()
            return
        if self.even is not None:
            yield from (b.tolist() for b in self.even[self.start:])
            return
        idx = self.indices
        if self.shuffle:  # a shard of the user's: its own order per (seed, epoch, rank)
            idx = idx[np.random.default_rng([s.spec.seed, s.pos.epoch, s.rank]).permutation(len(idx))]
        if self.plan is not None:
            self.plan(idx[self.start * self.batch_size:])
        for b in range(self.start, len(self)):
            yield idx[b * self.batch_size:(b + 1) * self.batch_size].tolist()

    def size_of(self, b: int) -> int:
        if self.epoch_cursor is not None:
            return self.epoch_cursor.size_of(self.session.pos.epoch, b)
        if self.even is not None:
            return len(self.even[b])
        return min(self.batch_size, len(self.indices) - b * self.batch_size)


class _CheckedCollate:
    """The user's collate function (or torch's default), failing with a CollateError that says
    which items could not be batched."""

    def __init__(self, collate: Callable | None, dataset: Any) -> None:
        from torch.utils.data import default_collate

        self.collate, self.custom = collate or default_collate, collate is not None
        self.what = type(dataset).__name__

    def __call__(self, items: list) -> Any:
        try:
            return self.collate(items)
        except Exception as exc:  # noqa: BLE001 - whatever the collate raises on these items
            first = items[0] if items else None
            shape = type(first).__name__
            raise CollateError(
                f"{'your collate_fn' if self.custom else 'the default collate'} cannot batch the items of "
                f"{self.what} (each a {shape}): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                "; give items of one shape and type (tensors, numbers, or tuples/dicts of them), or pass "
                "session.loader(..., collate_fn=YOUR_FUNCTION)") from None


class ResumableLoader:
    """A DataLoader over the user's dataset in the launcher's order; the training loader
    counts the batches it hands out, which is the position a checkpoint saves."""

    def __init__(self, session: Any, dataset: Any, order: BatchOrder, *, collate_fn, num_workers: int,
                 pin_memory: bool, to_device: bool, prefetch: bool = False, **kwargs: Any) -> None:
        import torch

        self.session, self.order, self.to_device, self.prefetch = session, order, to_device, prefetch
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=order, collate_fn=_CheckedCollate(collate_fn, dataset), num_workers=num_workers,
            pin_memory=pin_memory, **kwargs)
        self.batches = 0  # training loader: batches handed out in the epoch under way

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[Any]:
        import torch

        s = self.session
        if self.order.train:
            self.batches = s._loader_start(self)
        self.order.start = self.batches if self.order.train else 0
        # Worker processes are seeded from the loader's generator, not the global RNG: drawing
        # from the global one at each iter() would shift the training RNG stream on a resume.
        self.loader.generator = torch.Generator().manual_seed(
            int(np.random.default_rng([s.spec.seed, s.pos.epoch, s.rank, 7]).integers(2**62)))
        device = s.device if self.to_device and s.device.type != "cpu" else None
        batches = _Prefetched(self.loader, device) if self.prefetch else (
            _to_device(b, device) if device is not None else b for b in self.loader)
        batches = iter(batches)
        try:
            while True:
                asked = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if self.order.train:  # counted when handed over: what the training code has seen
                    s._data_wait += time.perf_counter() - asked  # the input's share of the step
                    s._samples += self.order.size_of(self.batches)
                    self.batches += 1
                yield batch
        except CollateError as exc:
            raise SessionError(f"{str(exc).splitlines()[0]} (loader made at {self.made_at})") from None
        finally:
            if isinstance(batches, _Prefetched):
                batches.close()

    made_at = "?"


class _Prefetched:
    """The loader's batches, read (and on a GPU copied to it, on a stream of their own) by a
    thread one or two batches ahead, so the next batch is ready while the current one trains."""

    DEPTH = 2
    _END = object()

    def __init__(self, loader: Any, device: Any) -> None:
        import torch

        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.queue: queue.Queue = queue.Queue(self.DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="launcher-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        import torch

        try:
            for batch in self.loader:
                event = None
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        batch = _to_device(batch, self.device)
                        event = torch.cuda.Event()
                        event.record(self.stream)
                elif self.device is not None:
                    batch = _to_device(batch, self.device)
                if not self._put((batch, event)):
                    return
        except BaseException as exc:  # noqa: BLE001 - raised again where the batches are taken
            self._put((exc, "error"))
            return
        self._put((self._END, None))

    def __iter__(self) -> Iterator[Any]:
        import torch

        while True:
            batch, event = self.queue.get()
            if batch is self._END:
                return
            if event == "error":
                raise batch
            if event is not None:  # the copy finished before the batch is used, and its memory is kept
                event.wait(torch.cuda.current_stream(self.device))
                _record_stream(batch, torch.cuda.current_stream(self.device))
            yield batch

    def close(self) -> None:
        self.stop.set()


def _record_stream(batch: Any, stream: Any) -> None:
    """Tell CUDA's caching allocator that ``stream`` uses the batch's tensors (they were allocated
    on the copy stream)."""
    import torch

    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for value in batch.values():
            _record_stream(value, stream)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _record_stream(value, stream)

