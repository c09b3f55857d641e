"""What a user's training function drives, whatever its framework: the epochs, the steps,
the reported metrics, and running the function itself.

:class:`UserSession` is the framework-free half of the sessions a training function gets
(:class:`launcher.worker.session.TorchSession`, :class:`launcher.worker.tf_session.TFSession`):
the run's facts (rank, world size, hyper-parameters), ``epochs()`` / ``step()`` / ``report()``
with the epoch's metrics averaged over the ranks, and the checkpoints of
:class:`launcher.worker.loop.Session` at each epoch's end. A framework's session adds its
model, data and state files through the hooks below. A workload's managed loop is a training
function too (:func:`training_function`, :func:`workload_splits`), so it keeps every guarantee
a user's loop has.
"""

from __future__ import annotations

import abc
import gc
import math
import os
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

import workloads
from launcher.errors import LauncherError, Unreachable, UserError
from launcher.settings import DATA_CACHE_GB
from launcher.storage.datacache import local_data
from launcher.worker.loader import SessionError, user_line
from launcher.worker.loop import Session
from launcher.worker.timing import breakdown, own_row
from launcher.worker.usage import memory_report, peak_memory_mb


def unregistered_objects(kinds: tuple[type, ...], registered: Callable[[Any], bool]) -> list[Any]:
    """The objects alive in this process whose type is one of ``kinds`` (or a subclass of one)
    and that ``registered`` does not claim. One walk over the collector's objects, each type
    classified once: in a worker holding torch and Ray (~400 k objects) that is ~0.1 s, against
    ~0.4 s for an ``issubclass`` per object after a full collection. The collection (which drops
    an object only a reference cycle kept alive) runs only when the walk found something."""
    def walk() -> list[Any]:
        verdict: dict[type, bool] = {}
        found = []
        for obj in gc.get_objects():
            kind = type(obj)  # type(), not __class__: a proxy's __class__ can run code (and warn)
            is_one = verdict.get(kind)
            if is_one is None:
                is_one = verdict[kind] = issubclass(kind, kinds)
            if is_one and not registered(obj):
                found.append(obj)
        return found

    if not walk():
        return []
    gc.collect()  # objects the loop dropped are no state of the run
    return walk()


class UserSession(Session):
    """The session a training function gets, less its framework (see the module docstring)."""

    def __init__(self, spec, comm, function: Any = None) -> None:
        super().__init__(spec, comm)
        self.function = function
        if getattr(spec, "data_cache_gb", None):  # what launcher.data.Shards made in this worker takes
            os.environ[DATA_CACHE_GB] = str(spec.data_cache_gb)
        self._carried: dict[str, Any] | None = None  # the interrupted epoch's metrics so far
        self._sums: dict[str, Any] = {}        # step metrics of the epoch under way, summed (on the device)
        self._counts: dict[str, int] = {}
        self._reported: dict[str, tuple[float, float]] = {}  # report(): value x weight, weight
        self._samples = 0
        self._data_wait = 0.0   # seconds of the epoch this rank waited for its next batch
        self._epoch_started = 0.0
        self._last_step_at: float | None = None
        self._steps_end: float | None = None  # the last step's book-keeping (checkpoint, notice) done
        self._step_started = 0.0
        self._in_epochs = False
        self.trained = False
        self.relay = None

    # -- what each framework provides --------------------------------------------------------
    @abc.abstractmethod
    def _begin(self) -> None:
        """Before the first step: the state registered and restored, the RNG streams set."""

    @abc.abstractmethod
    def weights_digest(self) -> str:
        """sha256 over the model's weights (the same on every rank after a step)."""

    @abc.abstractmethod
    def export_function(self, directory: str) -> str:
        """Rank 0, final checkpoint: a training function's model, as this session knows it (the
        user's classes are not the launcher's to build); returns the model folder's URI."""

    def export(self, directory: str) -> str:
        if isinstance(workloads.get(self.spec.workload), workloads.TrainingFunction):
            return self.export_function(directory)
        return super().export(directory)  # the managed loop's workload: its framework's export, with its classes

    def _as_metric(self, value: Any) -> Any:
        """A step metric as something that sums without reading the device (a number here)."""
        return float(value)

    def _epoch_ends(self) -> bool:
        """Whether the step just taken is the epoch's last (its checkpoint follows at the end)."""
        return False

    def unregistered(self) -> list[str]:
        """Training state the session can see that no checkpoint will hold, one phrase each."""
        return []

    def say_unregistered(self) -> None:
        """Before the first step: name the state a resumed run would lose (exact resume cannot
        fail without a word). The ranks agree on whether to report it (a report is collective in
        Ray Train); rank 0's words reach the driver, which shows them once."""
        lines = self.unregistered()
        anyone = self.sum_over_ranks(np.array([float(bool(lines))]))[0] > 0 if self.world > 1 else bool(lines)
        if not anyone:
            return
        note = ("a resumed run will not be exact: " + "; ".join(lines)) if lines else ""
        if note and self.rank == 0:
            print(f"rank 0: {note}", flush=True)
        self.send({"kind": "note", "notes": [note] if note and self.rank == 0 else []}, checkpoint=False)

    def _epoch_done(self) -> None:
        """An epoch ended: reset what counts batches within it."""

    # -- the run's facts -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.world

    @property
    def params(self) -> dict[str, Any]:
        """The run's ``--param``s (with the function's declared defaults)."""
        return dict(self.spec.params)

    @property
    def epochs_total(self) -> int:
        return int(self.spec.epochs)

    @property
    def batch_size(self) -> int:
        return int(self.spec.batch_size)

    @property
    def lr(self) -> float:
        return float(self.spec.lr)

    @property
    def seed(self) -> int:
        return int(self.spec.seed)

    @property
    def data(self) -> str | None:
        """``--data`` as a local path (a gs:// folder is this node's verified copy)."""
        return local_data(self.spec.data)

    @property
    def epoch(self) -> int:
        """The epoch under way (0-based), or the number completed between epochs."""
        return self.pos.epoch

    @property
    def global_step(self) -> int:
        return self.pos.global_step

    @property
    def step_in_epoch(self) -> int:
        return self.pos.step_in_epoch

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


    # -- the loop --------------------------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        """The epochs left to train (0-based), each ending with a checkpoint; the last one exports
        the model. On a resumed run the first is the interrupted one, its loader at the next batch."""
        self._begin()
        self._in_epochs = True
        try:
            while self.pos.epoch < self.spec.epochs:
                self._epoch_started = self._step_started = time.perf_counter()
                self._last_step_at = self._steps_end = None
                self.clock.reset()
                if self._carried:  # resumed mid-epoch: the epoch's metrics so far, as saved
                    c, self._carried = self._carried, None
                    self.take_epoch_so_far(c)
                yield self.pos.epoch
                self._end_epoch()
        finally:
            self._in_epochs = False
        if not self.trained:  # nothing was left: say where the run stands
            self.send({"kind": "done", **{n: v / w for n, (v, w) in self._reported.items() if w}}, checkpoint=False)
            self.trained = True

    def step(self, *, boundary: bool = True, **metrics: Any) -> None:
        """One optimizer step done; ``metrics`` (numbers or 0-d tensors, any names) are
        averaged over the epoch. May checkpoint: every ``--checkpoint-every-steps`` and at
        once on a preemption notice (all ranks at the same step). ``boundary=False``: a step
        whose gradients still accumulate (no checkpoint can hold them, so none is taken)."""
        if not self._in_epochs:
            raise SessionError(f"session.step() at {user_line()} outside `for epoch in session.epochs():`; "
                               "call it inside that loop, once per optimizer step")
        for name, value in metrics.items():
            value = self._as_metric(value)
            self._sums[name] = self._sums[name] + value if name in self._sums else value
            self._counts[name] = self._counts.get(name, 0) + 1
        self.pos.step_in_epoch += 1
        self.pos.global_step += 1
        self.updated, self.boundary = False, boundary  # the state is this position's (see salvage)
        self.trained = True
        self._last_step_at = time.perf_counter()
        self.after_step(self._step_started, boundary=boundary, epoch_ends=self._epoch_ends(),
                        values=self._step_values)
        self.clock.step_done()
        self._step_started = self._steps_end = time.perf_counter()

    def report(self, *, weight: float = 1.0, **named: Any) -> None:
        """``session.report(val_loss=..., perplexity=...)``: metrics of the epoch under way (any
        names; numbers or 0-d tensors). Each rank reports its own value; at the epoch's end they
        are averaged over the ranks, each counting ``weight`` (e.g. the number of samples the
        rank scored), and reported with the epoch's checkpoint."""
        for name, value in named.items():
            item = getattr(value, "item", None)
            self._reported[name] = (float(item() if callable(item) else value) * weight, float(weight))

    def _step_values(self) -> dict[str, float]:
        out = {name: float(total) / self._counts[name] for name, total in self._sums.items()}
        self._check_finite(out)
        return out

    def _check_finite(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            if "loss" in name and not math.isfinite(value):
                raise FloatingPointError(
                    f"training diverged: {name} is {value} in epoch {self.pos.epoch + 1} by step "
                    f"{self.pos.global_step} (no checkpoint was written from it); lower --lr (now "
                    f"{self.spec.lr:g})")

    def _end_epoch(self) -> None:
        """Average the epoch's metrics over the ranks, advance the position, checkpoint."""
        seconds = (self._last_step_at or time.perf_counter()) - self._epoch_started  # training, not evaluating
        steps = self._step_values()
        stepped, reported = sorted(steps), sorted(self._reported)
        vector = np.array([steps[n] for n in stepped] + [self._reported[n][0] for n in reported]
                          + [self._reported[n][1] for n in reported] + [self._samples], dtype=np.float64)
        # Each rank's own figures in its slot (the ranks' max, the straggler): input wait, memory,
        # and the time per phase (over the steps and their book-keeping: launcher.worker.timing).
        mine = [self._data_wait, *peak_memory_mb(),
                *own_row(self._data_wait, self.clock, (self._steps_end or time.perf_counter()) - self._epoch_started)]
        own = np.zeros((len(mine), self.world))
        own[:, self.rank] = mine
        total = self.sum_over_ranks(np.concatenate([vector, own.ravel()]))
        rows, total = total[len(vector):].reshape(len(mine), self.world), total[:len(vector)]
        waits, rss, gpu = rows[:3]
        k, r = len(stepped), len(reported)
        means = {n: float(total[i]) / self.world for i, n in enumerate(stepped)}
        means.update({n: float(total[k + i]) / max(float(total[k + r + i]), 1e-300) for i, n in enumerate(reported)})
        self._check_finite(means)
        samples = int(total[-1])
        self.pos.epoch, self.pos.step_in_epoch = self.pos.epoch + 1, 0
        self._epoch_done()
        last = self.pos.epoch == self.spec.epochs
        digest = self.weights_digest() if last else None  # on every rank: it may take collectives
        extra = {"weights_sha256": digest} if last and self.rank == 0 else {}
        self.send({"kind": "epoch", **means, "samples": samples, "train_time_s": seconds,
                   "samples_per_s": samples / seconds if seconds > 0 else 0.0, **data_wait(waits, seconds),
                   **breakdown(rows[3:]), **memory_report(rss, gpu), **extra})
        self._sums, self._counts, self._reported, self._samples = {}, {}, {}, 0
        self._data_wait = 0.0

    def take_epoch_so_far(self, c: dict[str, Any]) -> None:
        """Go on with an epoch's metrics so far as :meth:`_epoch_so_far` gave them (a checkpoint's,
        or a peer's that a replica was healed from)."""
        self._sums, self._counts = dict(c["sums"]), dict(c["counts"])
        self._reported = {n: tuple(v) for n, v in c["reported"].items()}
        self._samples = int(c["samples"])
        self._data_wait = float(c.get("data_wait", 0.0))
        self.clock.reset(c.get("phases"))
        self._epoch_started = time.perf_counter() - float(c["seconds"])

    def _epoch_so_far(self) -> dict[str, Any]:
        """The epoch's running metrics as plain numbers (read from the device now: a checkpoint)."""
        until = self._last_step_at or time.perf_counter()
        return {"sums": {k: float(v) for k, v in self._sums.items()}, "counts": dict(self._counts),
                "reported": dict(self._reported), "samples": self._samples, "data_wait": self._data_wait,
                "phases": self.clock.state(),
                "seconds": until - self._epoch_started if self._epoch_started else 0.0}

    def start(self, config: dict[str, Any], started: float) -> None:
        self.relay = config.get("mailbox")  # where a strategy that reports without Ray Train reports (ft)
        super().start(config, started)

    def run(self, started: float, model_ready: float) -> None:
        """Run the training function (the checkpoint is read: its state is restored as the
        function registers it)."""
        if self.rank == 0:
            self.marks["worker_start"] = started
        self.learn_nodes()
        self.run_function()

    def run_function(self) -> None:
        fn = self.function.fn
        try:
            fn(self)
        except (SessionError, FloatingPointError):
            raise
        except LauncherError as exc:  # bad input (exit 2) or a service down: its one line, where it came from
            where = user_line(sys.exc_info()[2])
            located = f"{fn.__name__}(session) at {where}: {exc.what}" if where != "?" else exc.what
            raise (UserError if exc.exit_code == UserError.exit_code else Unreachable)(located, exc.fix) from None
        except Exception as exc:
            if self.lost_peers(exc):
                self.hold("a node of the group went")  # never returns: Ray Train restarts the group
            where = user_line(sys.exc_info()[2])
            text = str(exc).strip().splitlines()
            raise RuntimeError(f"{type(exc).__name__} in {fn.__name__}(session) at {where}: "
                               f"{text[-1] if text else ''}") from exc
        if not self.trained:
            raise SessionError(f"{fn.__name__}(session) at {self.function.source} returned without training: "
                               "iterate `for epoch in session.epochs():` and call session.step() after each "
                               "optimizer step, so the launcher can checkpoint and report")
        if self.pos.epoch < self.spec.epochs:
            raise SessionError(f"{fn.__name__}(session) at {self.function.source} returned after epoch "
                               f"{self.pos.epoch} of {self.spec.epochs}: leave the `session.epochs()` loop "
                               "only when it ends")


def data_wait(waits: np.ndarray, seconds: float) -> dict[str, float]:
    """An epoch's input wait: the seconds the ranks waited for their next batch (their mean), and
    as a share of the epoch's training time, on average and for the rank that waited most."""
    if seconds <= 0 or not len(waits):
        return {}
    return {"data_wait_s": float(np.mean(waits)), "data_wait_fraction": float(np.mean(waits)) / seconds,
            "data_wait_max_fraction": float(np.max(waits)) / seconds}


def training_function(workload, loop: Callable[[Any, Any], None]):
    """The training function that trains ``workload`` with a framework's managed loop,
    ``loop(session, workload)``: what the session runs for a Workload, as it runs a user's function."""
    def managed_loop(session) -> None:
        loop(session, workload)

    managed_loop.fn, managed_loop.source = managed_loop, f"workload {workload.name} (the launcher's loop)"
    return managed_loop


def workload_splits(session, workload) -> tuple[Any, Any]:
    """A managed loop's data (gs:// data: this node's verified copy): the workload's whole training
    split on every rank, which the session's global order splits global batch by global batch over
    the ranks, so a run resumed on another worker count continues at its sample; and this rank's
    test shard."""
    data, params = local_data(session.spec.data), session.spec.params
    return workload.load(data, "train", 0, 1, params), workload.load(data, "test", session.rank, session.world, params)
