"""What every session shares, whatever code trains: a worker's place in the run.

:class:`Session` holds the training position, the choice of the checkpoint to resume from
(:func:`checkpoint_to_resume`), reports to Ray Train with a checkpoint folder (its manifest
written last), the step checkpoints and the reaction to a preemption notice; the survivors'
checkpoint when a node goes is :class:`launcher.worker.salvage.SurvivorsCheckpoint`'s. Its clients save and restore their own state: the sessions a
training function gets (:class:`launcher.worker.usersession.UserSession`, under
:class:`~launcher.worker.session.TorchSession` and :class:`~launcher.worker.tf_session.TFSession`,
which also run the managed loops), and the boosting loop
(:class:`launcher.worker.xgb_loop.BoostingTraining`).

Every ``preemption_check_steps`` steps all ranks ask Ray Train whether a node
of theirs is being preempted (a barrier, so every rank asks at the same
steps). On a notice they checkpoint at once, then keep training while the
drain deadline is far enough off, and when it comes close (rank 0's clock
decides, so all ranks agree) they checkpoint once more and hold, training no
further: Ray Train stops the group at the deadline and restarts it from that
last checkpoint, so an announced preemption costs no training steps.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable

import numpy as np

from launcher import faultpoint
from launcher.spec import JobSpec
from launcher.storage import Storage
from launcher.storage.checkpoint import Manifest, complete_checkpoints, newest_complete, write_manifest
from launcher.worker import ranklog
from launcher.worker.timing import StepClock
from launcher.worker.salvage import SurvivorsCheckpoint
from launcher.worker.usage import Sampler

RESERVE_MIN_S = 1.5  # stop training at least this long before the drain deadline


@dataclasses.dataclass
class Position:
    epoch: int = 0           # completed epochs
    step_in_epoch: int = 0   # steps done in the epoch under way
    global_step: int = 0


def checkpoint_to_resume(config: dict[str, Any], storage, name: str) -> tuple[Any, str] | None:
    """(filesystem, path) of the newest complete checkpoint this worker group should resume from.

    Candidates: the checkpoint Ray Train offers (after a restart), the run's
    complete checkpoints in storage now (Ray's newest may be cut off, and the
    driver's list is from launch time) and those the driver found
    (``config["resume"]``). None when there is none.

    Raises:
        RuntimeError: Ray offered a checkpoint, but neither it nor any other is complete.
    """
    import ray.train

    found = [path for _, path in reversed(complete_checkpoints(storage, name))][:5]
    options = [(storage.fs, path) for path in found + list(config.get("resume", []))]
    offered = ray.train.get_checkpoint()
    if offered is not None:
        options.insert(0, (offered.filesystem, offered.path))
    chosen = newest_complete(options)
    if chosen is not None:
        return chosen[0], chosen[1]
    if offered is not None:
        raise RuntimeError(f"cannot resume: checkpoint {offered.path} is incomplete and no other is complete")
    return None


class Session(SurvivorsCheckpoint, abc.ABC):
    """One worker's place in a run, whatever code trains: the position, reports to Ray Train with
    a checkpoint, the choice of the checkpoint to resume from, and preemption notices (see the
    module docstring for its clients; each saves and restores its own state)."""

    def __init__(self, spec: JobSpec, comm) -> None:
        self.spec, self.comm = spec, comm
        self.rank, self.world = comm.rank, comm.world_size
        self.pos = Position()
        self.restored_from: dict[str, int] | None = None
        self.attempt = uuid.uuid4().hex[:12]
        self.steps_per_epoch = 0
        self.marks: dict[str, float] = {}  # start-up milestones, sent with the first report
        self.board = None  # the driver's ProgressBoard actor (rank 0 writes to it)
        self.start_step = 0
        self.noticed = False
        self.notices = True  # False where no notice can come (no preemption watcher): nothing to ask
        self.step_s = 0.0        # recent time per step, for the reserve before a drain deadline
        self.checkpoint_s = 0.0  # time the last checkpoint took
        # An epoch's end (evaluation, its checkpoint, the report) as the next step saw it, and when the
        # last step ended: a drain deadline must leave room for it when it comes before the next check.
        self.epoch_end_s = 0.0
        self._step_ended: float | None = None
        self._epoch_ended = False
        self.rank_nodes: list[int] = []  # each rank's node (node_key), for the salvage
        self.saved_step = -1     # the step of the last checkpoint this rank saw stored
        self.updated = False     # the model changed since the position was last counted
        self.background_save = False  # the checkpoint being saved is stored in the background
        self.model_note: str | None = None  # what the summary says of an exported model (weights only: why)
        self._checkpoint_dir = contextlib.ExitStack()  # keeps a restored checkpoint's folder while needed
        self._keep_checkpoint = False
        self.clock = StepClock()  # this rank's seconds per phase of the epoch under way
        self.usage: Sampler | None = None  # CPU, memory and GPU samples, sent with each report

    @abc.abstractmethod
    def restore(self, directory: str) -> None:
        """Load the state and position from a checkpoint folder (then call :meth:`restored`)."""

    @abc.abstractmethod
    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        """Write this rank's checkpoint files into ``directory`` (rank 0 last writes the manifest)."""

    @abc.abstractmethod
    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """Sum a float64 vector over all ranks."""

    def upload_fn(self) -> Callable | None:
        """A ``checkpoint_upload_fn`` for the background checkpoint just saved (None: Ray's own)."""
        return None

    def keep_checkpoint(self) -> None:
        """Called from :meth:`restore`: the folder is read later (as state is registered), so it
        stays until :meth:`release_checkpoint`."""
        self._keep_checkpoint = True

    def release_checkpoint(self) -> None:
        self._checkpoint_dir.close()

    @abc.abstractmethod
    def run(self, started: float, model_ready: float) -> None:
        """Train from the restored position to the end (``started``: when the worker started;
        ``model_ready``: when the model was, where it is built before the checkpoint is read)."""

    def start(self, config: dict[str, Any], started: float) -> None:
        """Read the newest complete checkpoint (:meth:`restore`), then train (:meth:`run`)."""
        import ray.train

        self.board = config.get("board")
        self.notices = config.get("notices", True)
        self.usage = Sampler().start()
        model_ready = time.time()
        chosen = checkpoint_to_resume(config, Storage.resolve(self.spec.storage), self.spec.name)
        try:
            if chosen is not None:
                checkpoint = ray.train.Checkpoint(chosen[1], filesystem=chosen[0])
                self.restore(self._checkpoint_dir.enter_context(checkpoint.as_directory()))
                if not self._keep_checkpoint:  # a sharded checkpoint is read as its state is registered
                    self.release_checkpoint()
            self.run(started, model_ready)
        finally:
            self.release_checkpoint()

    # -- position and checkpoints ----------------------------------------------------------
    def write_manifest(self, directory: str, metrics: dict[str, Any], others: dict[str, int] | None = None,
                       cursor: int | None = None, pos: Position | None = None) -> None:
        """The manifest of the checkpoint in ``directory`` (last: it marks the folder complete).
        ``others``: files the other ranks write into the same checkpoint, with their sizes;
        ``cursor``: mid-epoch, the samples of the epoch used in the global order; ``pos``: the
        position saved, where it is no longer the session's (a manifest written later)."""
        s, pos = self.spec, pos or self.pos
        write_manifest(directory, Manifest(
            epoch=pos.epoch, step_in_epoch=pos.step_in_epoch, global_step=pos.global_step,
            world_size=self.world, framework=s.framework, backend=s.backend, workload=s.workload,
            batch_size=s.batch_size, seed=s.seed, metrics=metrics, strategy=s.strategy,
            cursor=cursor if pos.step_in_epoch else None), others)

    def sizes_over_ranks(self, name_of: Any, size: int) -> dict[str, int]:
        """Each rank's file ``name_of(rank)`` and its size, on every rank (a collective)."""
        sizes = np.zeros(self.world, dtype=np.float64)
        sizes[self.rank] = size
        total = self.sum_over_ranks(sizes)
        return {name_of(r): int(total[r]) for r in range(self.world)}

    def restored(self, pos: Position, manifest) -> None:
        """Take the position of a restored checkpoint written by ``manifest``'s run (a session
        settles a mid-epoch position of another worker count or batch size itself)."""
        self.pos = pos
        self.start_step = pos.global_step
        self.restored_from = manifest.position

    def send(self, metrics: dict[str, Any], checkpoint: bool = True) -> None:
        """Report ``metrics`` (with the position) to Ray Train, with a checkpoint of this state
        unless ``checkpoint`` is False; rank 0 exports the model with the final one."""
        import ray.train

        metrics = {**metrics, "epoch": self.pos.epoch, "step_in_epoch": self.pos.step_in_epoch,
                   "global_step": self.pos.global_step, "world_size": self.world, "time": time.time(),
                   "attempt": self.attempt, "restored_from": self.restored_from,
                   "steps_per_epoch": self.steps_per_epoch}
        if self.marks:
            metrics["startup_marks"], self.marks = self.marks, {}
        if self.usage is not None:  # every rank's own samples: the driver's callback sees each rank's report
            metrics["usage"] = self.usage.take()
        if not checkpoint:
            ray.train.report(metrics)
            ranklog.store_now()
            return
        started = time.perf_counter()
        final = self.pos.epoch >= self.spec.epochs and not self.pos.step_in_epoch
        # In the background only where nothing waits on it: not the last checkpoint (the run's
        # result), not one taken on a preemption notice (it must be stored before the node goes).
        background = self.spec.checkpoint_upload == "async" and not final and metrics.get("kind") != "preemption"
        d = tempfile.mkdtemp(prefix="launcher-ckpt-")
        try:
            self.background_save = background
            self.save(d, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            if self.rank == 0 and final:
                faultpoint.pause("export")
                metrics["model"] = self.export_model(d)
                if self.model_note:
                    metrics["model_note"] = self.model_note
            elif self.rank == 0:
                faultpoint.pause("checkpoint")
            mode = ray.train.CheckpointUploadMode.ASYNC if background else ray.train.CheckpointUploadMode.SYNC
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                             checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=background,
                             checkpoint_upload_fn=self.upload_fn() if background else None)
            if not background:
                self.saved_step = self.pos.global_step
            ranklog.store_now()
        finally:
            if not background:  # Ray deletes a background upload's folder once it is stored
                shutil.rmtree(d, ignore_errors=True)
        self.checkpoint_s = time.perf_counter() - started

    def export_model(self, directory: str) -> str | None:
        """Rank 0, final checkpoint: export the model (:meth:`export`) to ``<run>/model/``, here
        where the framework is loaded, so the driver never imports it. None on failure: the
        driver then exports from the checkpoint."""
        try:
            return self.export(directory)
        except Exception as exc:  # the checkpoint is what matters; the export can be redone
            print(f"rank 0: exporting the model failed ({type(exc).__name__}: {exc}); "
                  "the driver will export it from the final checkpoint", flush=True)
            return None

    def export(self, directory: str) -> str:
        """A workload's model from ``directory`` (already holding its checkpoint files), as its
        framework exports it (:mod:`launcher.worker.export`); returns the model folder's URI."""
        from launcher.worker.export import export

        return export(self.spec, directory, Storage.resolve(self.spec.storage))

    # -- after each step ---------------------------------------------------------------------
    def after_step(self, step_started: float, *, boundary: bool = True, epoch_ends: bool = False,
                   values: Callable[[], dict[str, Any]] = dict) -> None:
        """Book-keeping after a step whose position is already counted: progress, preemption
        notices and step checkpoints. ``boundary``: an optimizer step happened (False while
        gradients accumulate: a checkpoint cannot hold them); ``epoch_ends``: the epoch's last
        step (its checkpoint follows at the epoch's end); ``values()``: the metrics a
        checkpoint taken now reports (called only then, so nothing is read per step)."""
        if "first_step" not in self.marks and "worker_ready" in self.marks:
            self.marks["first_step"] = time.time()
        self.note_progress()
        took = time.perf_counter() - step_started
        self.step_s = 0.9 * self.step_s + 0.1 * took if self.step_s else took
        if self._epoch_ended and self._step_ended is not None:  # the first step after an epoch's end
            self.epoch_end_s = max(0.0, step_started - self._step_ended)
        self._epoch_ended = epoch_ends
        asked = time.perf_counter()
        action = self.preemption_action() if boundary else None
        resize = not action and boundary and self.resize_asked()
        saving = time.perf_counter()
        self.clock.add("notice", saving - asked)
        if resize:
            # An elastic group about to grow: this checkpoint is where the larger group resumes.
            self.send({"kind": "resize", "held": 1, **values()})
            if self.rank == 0:
                self.board.checkpoint_taken.remote(self.pos.global_step)
            self.hold("the cluster has room for more workers")
        if action:
            self.send({"kind": "preemption", "notice": 1, "held": int(action == "hold"), **values()})
            if self.board is not None and self.rank == 0:
                self.board.notice_saved.remote(self.attempt, self.checkpoint_s)
            if action == "hold":
                self.hold()
        elif boundary and not epoch_ends and self.step_checkpoint_due():
            self.send({"kind": "step", **values()})
            self.step_checkpoint_taken()
            if self.rank == 0:
                faultpoint.pause("step-checkpoint")
        self.clock.add("checkpoint", time.perf_counter() - saving)
        self._step_ended = time.perf_counter()

    def step_checkpoint_due(self) -> bool:
        """Whether the step just counted ends with a checkpoint (``--checkpoint-every-steps``);
        the same answer on every rank, as the checkpoint is the group's."""
        every = self.spec.checkpoint_every_steps
        return bool(every) and self.pos.global_step % every == 0

    def step_checkpoint_taken(self) -> None:
        """After a step checkpoint, on every rank (the boosting loop spaces its next one here)."""

    # -- preemption -----------------------------------------------------------------------
    def note_progress(self) -> None:
        """Rank 0 tells the driver's board how far it got (fire and forget)."""
        if self.board is not None and self.rank == 0:
            self.board.step.remote(self.attempt, self.start_step, self.pos.global_step, time.time())

    def resize_asked(self) -> bool:
        """Every K steps in an elastic run, on every rank alike: whether the group is asked for a
        checkpoint before it grows (rank 0 reads the board, the others take its answer)."""
        k = self.spec.preemption_check_steps
        if not k or self.board is None or self.spec.min_workers is None or self.pos.global_step % k:
            return False
        import ray

        asked = 0.0
        if self.rank == 0:
            try:
                asked = float(ray.get(self.board.checkpoint_wanted.remote(), timeout=10) > self.world)
            except Exception:  # noqa: BLE001 - the board is the driver's; train on without it
                asked = 0.0
        if self.world == 1:
            return bool(asked)
        return bool(self.sum_over_ranks(np.array([asked], dtype=np.float64))[0] > 0)

    def preemption_action(self) -> str | None:
        """Every K steps, on every rank alike (Ray's barrier): None (train on), "checkpoint"
        (a notice just came and there is time to train on) or "hold" (checkpoint and stop)."""
        k = self.spec.preemption_check_steps
        if not k or not self.notices or self.pos.global_step % k:
            return None
        import ray.train

        info = ray.train.get_preemption_info()  # the same answer on every rank
        if info is None:
            return None
        first, self.noticed = not self.noticed, True
        if self._deadline_close(info.deadline_ms, k):
            return "hold"
        return "checkpoint" if first else None

    def _deadline_close(self, deadline_ms: int | None, k: int) -> bool:
        """Rank 0 decides whether the deadline is near (the ranks' clocks and timings differ);
        the others take its answer through an all-reduce."""
        close = 0.0
        if self.rank == 0:
            reserve = max(RESERVE_MIN_S, 2 * self.checkpoint_s + 2 * k * self.step_s)
            left = self.steps_per_epoch - self.pos.step_in_epoch
            if self.steps_per_epoch and left <= k:  # an epoch ends before the next check: its end too
                reserve += 2 * self.epoch_end_s
            close = float(deadline_ms is None or deadline_ms / 1000 - time.time() <= reserve)
        return bool(self.sum_over_ranks(np.array([close], dtype=np.float64))[0] > 0)

    def hold(self, why: str = "preemption notice") -> None:
        """Train no further: the checkpoint just taken is where the restarted group resumes,
        so any step taken now would be thrown away. Ray Train stops this worker at the
        drain deadline (or sooner, when the node goes), or when it resizes the group."""
        print(f"rank {self.rank}: {why}: training stops at step {self.pos.global_step}, "
              "waiting for Ray Train to restart the group", flush=True)
        while True:
            time.sleep(1.0)
