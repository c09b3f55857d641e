"""``--strategy ft``: per-step fault tolerance with torchft, so a lost worker restarts no other.

Each Ray Train worker is a torchft *replica group* of one process (:mod:`launcher.backends.replicas`
starts the lighthouse and tells Ray Train's controller to replace a failed worker alone). Every
optimizer step is one torchft step: the replicas that ask for it form a *quorum* (the lighthouse
leaves out one whose manager fell silent), its gradients are averaged over the quorum, and the
step is *committed* on every replica whose collectives went through, or else retried.

What a step trains is the launcher's (:class:`~launcher.worker.ft_order.QuorumOrder`), not
torchft's sampler (which drops a missing replica's share): the step's global batch is the next
``batch_size x participants`` samples of the run's global order from the epoch's *cursor*, split over the replicas in the
quorum; the cursor moves on by those samples when the step commits, and a step that does not
commit is drawn again from the same cursor. Each replica keeps its batch size (``--batch-size``
is per replica): with fewer replicas a step trains fewer samples and an epoch takes more steps;
the gradient is still the mean over the step's samples, so the learning rate needs no change.

A replica that falls behind (a replacement, one left out of a step) is healed at its next
quorum from a peer: the registered state, the position, the cursor and the epoch's running
metrics (:meth:`FaultTolerant._state`). The quorum is formed synchronously at the draw of each
step's batch, so a healed replica trains that very step. A preemption notice for a replica's
own node makes it leave at its next step (after its step checkpoint, if it writes one): its
manager shuts down, the others' next quorum goes on without it once its heartbeat stops
(:data:`launcher.backends.replicas.HEARTBEAT_TIMEOUT_MS`), and it waits for its node to go.
One replica, rank 0 of the step's quorum, writes the step and epoch checkpoints to storage and
reports to the driver (through the run's mailbox: Ray Train's report would wait for every
worker). The random streams are seeded per step from (seed, step, rank in the quorum), so a
resumed or healed replica draws what an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
import types
from datetime import timedelta
from typing import Any

import numpy as np

from launcher import _ray
from launcher.storage import Storage
from launcher.storage.checkpoint import MANIFEST, Manifest, prune, write_manifest
from launcher.summary import Preempting, Report, event_to_json
from launcher.worker import ranklog, torch_rng
from launcher.worker.ft_order import QuorumOrder
from launcher.worker.loader import BatchOrder, SessionError, user_line
from launcher.worker.loop import Position
from launcher.worker.strategies import NothingLeft, Replicated

# A collective (a gradient allreduce, a heal's transfer) that a peer never joins gives up after
# this: what a replica lost without notice, whose host vanished, costs the others (a process
# killed on a live host breaks the connection at once). Longer than replicas' steps ever differ.
COLLECTIVE_TIMEOUT_S = 15
MANAGER_TIMEOUT_S = 60        # the manager's calls: the commit vote, a heal's checkpoint address
# A quorum short of --min-workers waits for replacements (minutes while a node boots), asking again
# this often: in between, whether the other replicas finished training (then this one is done).
QUORUM_POLL_S = 60
REPORT_TIMEOUT_S = 30
ATTEMPT = "replicas"          # the reports' attempt: the replicas are one group however they change
NOTICE_POLL_S = 1.0          # a replica reads its node's drain state at least this often (and every k steps)
LEAVE_MIN_S = 3.0            # a replica with notice leaves the quorum this long (and 2 steps) before its deadline


def _seed_step(seed: int, step: int, rank: int) -> None:
    """The random streams of a step: a function of the seed, the step and the rank in its quorum."""
    torch_rng.seed_all(int(np.random.default_rng([seed, step, rank, 0x7F7]).integers(2**62)))


def leave_now(deadline_ms: int | None, now: float, step_s: float) -> bool:
    """Whether a replica with notice leaves the quorum before its next step: when the drain
    deadline is unknown, or nearer than two of its recent steps and :data:`LEAVE_MIN_S`, so that
    it leaves on a step boundary before its node goes (a node gone mid-step would cost the others
    the process group's timeout). Until then a full quorum trains on."""
    if deadline_ms is None:
        return True
    return deadline_ms / 1000 - now <= LEAVE_MIN_S + 2 * step_s


def _comm_hook(manager, bucket):
    """torchft's DDP gradient hook, without its failure when the allreduce breaks (a peer lost
    mid-step, its process gone with its node): torchft notes the error, so the step will not
    commit, but leaves the work's future unset, and its own hook then fails an assertion inside
    ``backward()``, ending this replica too (seen in the lab: the survivor of a node removed
    without notice failed, and Ray Train's controller, replacing it, failed on the dead peer). Here
    the bucket goes back as it is; the step is drawn again under the next quorum."""
    import torch

    work = manager.allreduce(bucket.buffer())
    work.wait()
    reduced = getattr(work.get_future(), "_fut", None)
    if reduced is not None:
        return reduced
    kept = torch.futures.Future()
    kept.set_result(bucket.buffer())
    return kept


def _committing(strategy: "FaultTolerant"):
    """``optimizer.step`` under ``ft``: the update is applied only where the step commits."""
    def step(optimizer, *args: Any, **kwargs: Any):
        if not strategy.manager.should_commit():
            strategy.stepped(False)
            return None
        out = type(optimizer).step(optimizer, *args, **kwargs)
        strategy.stepped(True)
        return out

    return step


class FaultTolerant(Replicated):
    """``ft``: the whole model on every replica, kept in step by torchft (see the module docstring)."""

    name = "ft"
    requires_prepare = True

    def __init__(self, session) -> None:
        super().__init__(session)
        self.manager = None
        self.actor = None            # the run's Lighthouse actor
        self.store = None            # this replica group's TCPStore (torchft's manager needs one)
        self.order: QuorumOrder | None = None
        self.replica = 0             # this worker's slot in Ray Train's group: its replica id
        self.replicas = session.spec.workers
        self.participants = 0        # replicas in the quorum of the step under way
        self.quorum_rank: int | None = None
        self.quorum = None           # torchft's id of that quorum
        self.outcome: bool | None = None  # the step's optimizer step: committed, not committed, not yet
        self.leaving: str | None = None   # why this replica leaves at its next step
        self.deadline_ms: int | None = None  # its node's drain deadline, once noticed (0: none given)
        self.notice_polled = 0.0     # when this replica last read its node's drain state (monotonic)
        self.healed = False

    # -- setting up --------------------------------------------------------------------------
    def prepare(self, module, optimizer, blocks):
        import ray
        import ray.train
        import torch
        from torchft import DistributedDataParallel, Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        from launcher.backends.replicas import lighthouse

        s = self.session
        if optimizer is None:
            raise SessionError(f"session.prepare(model) at {user_line()}: --strategy ft commits each step through "
                               "the optimizer; give it too: model, optimizer = session.prepare(model, optimizer)")
        if self.manager is not None:
            raise SessionError(f"session.prepare(...) at {user_line()} a second time: --strategy ft keeps one "
                               "model in step; prepare it once")
        for name in ("torchft", "torchft_quorums", "torchft_commits"):  # a line per step otherwise; ours say changes
            logging.getLogger(name).setLevel(logging.WARNING)
        address, self.actor = lighthouse()
        self.replica = ray.train.get_context().get_world_rank()
        host = ray.util.get_node_ip_address()
        self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        collective = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        pg = (ProcessGroupNCCL if s.device.type == "cuda" else ProcessGroupGloo)(timeout=collective)
        ray.get(self.actor.gather.remote(self.replica, self.replicas))  # the first quorum then has everyone
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state,
            min_replica_size=s.spec.min_workers or s.spec.workers, use_async_quorum=False,
            timeout=timedelta(seconds=MANAGER_TIMEOUT_S), quorum_timeout=timedelta(seconds=QUORUM_POLL_S),
            rank=0, world_size=1, store_addr=host, store_port=self.store.port, lighthouse_addr=address,
            replica_id=f"replica_{self.replica:05d}", hostname=host, init_sync=False,
            checkpoint_transport=PGTransport(pg, timeout=collective, device=s.device))
        self.manager.load_state_dict({"step": s.pos.global_step, "batches_committed": 0})
        optimizer.step = types.MethodType(_committing(self), optimizer)
        ddp = type("FaultTolerantDDP", (DistributedDataParallel,), {"_comm_hook": staticmethod(_comm_hook)})
        return ddp(self.manager, module), optimizer

    def batch_order(self, *args: Any) -> BatchOrder:
        session, _, _, train, _, _, shard, _ = args
        if not train:
            return BatchOrder(*args)
        if not shard:
            raise SessionError(f"session.loader(..., shard=False) at {user_line()}: --strategy ft splits each step's "
                               "samples over the replicas of its quorum; give the whole dataset (shard=True)")
        self.order = QuorumOrder(self, *args)
        return self.order

    def loader_options(self, num_workers: int, prefetch: bool | None) -> bool:
        """A step's samples are known only once its quorum is: nothing may read batches ahead."""
        if num_workers:
            raise SessionError(f"session.loader(..., num_workers={num_workers}) at {user_line()}: with --strategy ft "
                               "a step's samples are chosen when its quorum forms, so no process may read ahead; "
                               "drop num_workers")
        return False

    # -- each step -----------------------------------------------------------------------------
    def begin_step(self) -> tuple[int, int]:
        """The quorum of the step about to be drawn: (replicas in it, this one's rank among them).
        A replica behind the others is healed here; one with notice leaves here instead."""
        import ray

        if self.leaving:
            self._leave()
        s = self.session
        first = self.quorum is None
        if first and ray.get(self.actor.finished.remote()):
            raise NothingLeft("the other replicas finished training before this one joined")
        started, self.outcome = time.perf_counter(), None
        self._start_quorum()  # synchronous: a heal has loaded the peer's state when it returns
        participants, rank = self.manager.num_participants(), self.manager.participating_rank()
        waited, before = time.perf_counter() - started, self.participants
        s.clock.add("sync", waited)  # waiting for the other replicas, inside the loader's draw:
        s._data_wait -= waited       # not the input's time
        if rank is None:
            raise RuntimeError("torchft left this replica out of a quorum it joined")
        quorum = getattr(self.manager, "_quorum_id", None)
        changed, self.quorum = quorum != self.quorum, quorum
        self.participants, self.quorum_rank = participants, rank
        if first and not self.healed and participants == 1 < self.replicas and ray.get(self.actor.finished.remote()):
            raise NothingLeft("the other replicas finished training while this one joined")
        if changed and not (first and not self.healed):
            self._quorum_changed(before, waited)
        self.healed = False
        _seed_step(s.spec.seed, s.pos.global_step, rank)
        return participants, rank

    def _start_quorum(self) -> None:
        """torchft's quorum, asked for again every :data:`QUORUM_POLL_S` while it cannot form, until
        the run's training is over (then this replica, a late replacement, has nothing left)."""
        import ray

        while True:
            try:
                self.manager.start_quorum()
                return
            except TimeoutError:
                if ray.get(self.actor.finished.remote()):
                    raise NothingLeft("the other replicas finished training while this one waited for a quorum") \
                        from None
                self.manager._quorum_future = None  # torchft keeps the timed-out quorum: ask for a new one

    def stepped(self, committed: bool) -> None:
        """The optimizer step of the step under way: committed (the cursor moves on) or not."""
        self.outcome = committed
        if committed and self.order is not None:
            self.order.commit(self.participants)

    def step_counts(self) -> bool:
        """Whether the step the loop just finished counts: not when its commit failed (its batch is
        drawn again at the next step, under a new quorum)."""
        outcome, self.outcome = self.outcome, None
        return outcome is not False

    def preemption_action(self, ask):
        """No barrier and no checkpoint: each replica watches its own node. One with notice tells
        the driver at once (the replacement node is asked for then), trains on in the full quorum
        while the drain deadline is far (checked against its own clock at every step from then on),
        and leaves the quorum when it comes close (the others hold the state)."""
        s, k = self.session, self.session.spec.preemption_check_steps
        if self.leaving or not k or not s.notices:
            return None
        if self.deadline_ms is None:
            # every k steps, and at least every NOTICE_POLL_S: the sooner the notice is seen, the
            # sooner the replacement node is asked for (a read of the node's drain state, no barrier)
            if s.pos.global_step % k and time.monotonic() - self.notice_polled < NOTICE_POLL_S:
                return None
            self.notice_polled = time.monotonic()
            import ray

            draining = _ray.global_state.get_draining_nodes() or {}
            node = ray.get_runtime_context().get_node_id()
            if node not in draining:
                return None
            self.deadline_ms = int(draining[node] or 0)
            s.noticed = True
            # Ray Train's own notice path is off for replica groups: the driver hears it from here,
            # and asks for the replacement node now rather than once this one is gone.
            self._tell_event(Preempting(time.time(), self.deadline_ms or None, [self.replica]))
        if leave_now(self.deadline_ms or None, time.time(), s.step_s):
            self.leaving = "its node has a preemption notice"
        return None

    def _leave(self) -> None:
        s = self.session
        print(f"replica {self.replica}: leaving the quorum after step {s.pos.global_step} ({self.leaving}); "
              "the other replicas train on, and Ray Train replaces this one once its node is gone", flush=True)
        self.close()
        while True:
            time.sleep(1.0)

    def close(self) -> None:
        """Leave torchft: the manager stops (and with it this replica's heartbeat)."""
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.shutdown(wait=False)

    def _quorum_changed(self, before: int, waited: float) -> None:
        s = self.session
        g = s.pos.global_step
        print(f"replica {self.replica}: quorum of {self.participants} replica(s) from step {g + 1} (was {before}; "
              f"{'healed from a peer, ' if self.healed else ''}the quorum took {waited:.2f} s)", flush=True)
        if self.writes():
            self._tell({"kind": "quorum", "global_step": g, "participants": self.participants, "before": before,
                        "quorum_s": round(waited, 3), "healed": int(self.healed), "time": time.time(),
                        "attempt": ATTEMPT})

    # -- what a healing replica receives -----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        s = self.session
        return {"objects": {name: obj.state_dict() for name, obj in s.objects.items()},
                "position": dataclasses.asdict(s.pos), "cursor": self.order.cursor if self.order else 0,
                "epoch": s._epoch_so_far(), "participants": self.participants}

    def _load(self, state: dict[str, Any]) -> None:
        s = self.session
        for name, obj in s.objects.items():
            obj.load_state_dict(state["objects"][name])
        s.pos = Position(**state["position"])
        if self.order is not None:
            self.order.cursor, self.order.over = int(state["cursor"]), False
        s.take_epoch_so_far(state["epoch"])
        self.participants, self.healed = int(state["participants"]), True

    # -- reports and checkpoints ---------------------------------------------------------------------
    def writes(self) -> bool:
        """Whether this replica writes the checkpoints and reports: rank 0 of the step's quorum
        (before any quorum, replica 0)."""
        return self.quorum_rank == 0 if self.quorum_rank is not None else self.replica == 0

    def send(self, metrics: dict[str, Any], checkpoint: bool) -> bool:
        s = self.session
        if not self.writes():
            return True
        final = s.pos.epoch >= s.spec.epochs and not s.pos.step_in_epoch
        metrics = {**metrics, "epoch": s.pos.epoch, "step_in_epoch": s.pos.step_in_epoch,
                   "global_step": s.pos.global_step, "world_size": self.participants or self.replicas,
                   "time": time.time(), "attempt": ATTEMPT, "restored_from": s.restored_from,
                   "steps_per_epoch": s.steps_per_epoch}
        if s.marks:
            metrics["startup_marks"], s.marks = s.marks, {}
        if s.usage is not None:
            metrics["usage_ranks"] = {str(self.replica): s.usage.take()}
        path = self._checkpoint(metrics, final) if checkpoint else None
        self._tell(metrics, path)
        ranklog.store_now()
        if final:
            import ray

            ray.get(self.actor.finish.remote(), timeout=REPORT_TIMEOUT_S)
        return True

    def _checkpoint(self, metrics: dict[str, Any], final: bool) -> str:
        """Write this replica's state as a checkpoint of the run (manifest last), export the model
        with the final one, keep --keep-checkpoints; returns its path in storage."""
        s = self.session
        started = time.perf_counter()
        d = tempfile.mkdtemp(prefix="launcher-ft-")
        try:
            loader = s.train_loader
            mid = s.pos.step_in_epoch > 0
            cursor = self.save_state(d, loader.batches if loader is not None and mid else 0,
                                     epoch=s._epoch_so_far() if mid else None)
            spec = s.spec
            numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            write_manifest(d, Manifest(
                epoch=s.pos.epoch, step_in_epoch=s.pos.step_in_epoch, global_step=s.pos.global_step,
                world_size=max(self.participants, 1), framework=spec.framework, backend=spec.backend,
                workload=spec.workload, batch_size=spec.batch_size, seed=spec.seed, metrics=numbers,
                strategy=spec.strategy, cursor=cursor if mid else None))
            if final:
                metrics["model"] = s.export_model(d)
            with open(os.path.join(d, MANIFEST), "rb") as f:
                manifest = f.read()
            os.remove(os.path.join(d, MANIFEST))
            storage = Storage.resolve(spec.storage)
            folder = f"checkpoint_{time.strftime('%Y-%m-%d_%H-%M-%S')}_ft_step{s.pos.global_step}"
            storage.upload_dir(d, spec.name, folder)
            storage.write_bytes(manifest, spec.name, folder, MANIFEST)  # last: the folder is complete
        finally:
            shutil.rmtree(d, ignore_errors=True)
        s.saved_step, s.checkpoint_s = s.pos.global_step, time.perf_counter() - started
        prune(storage, spec.name, max(spec.keep_checkpoints, 2))
        return storage.path(spec.name, folder)

    def _tell(self, metrics: dict[str, Any], checkpoint: str | None = None) -> None:
        """A report to the driver, through the run's mailbox."""
        self._tell_event(Report(time.time(), metrics, checkpoint))

    def _tell_event(self, event) -> None:
        """An event to the driver, through the run's mailbox (waited for: the driver may be
        reading its last events)."""
        import ray

        mailbox = self.session.relay
        if mailbox is None:
            return
        try:
            ray.get(mailbox.put.remote(event_to_json(event)), timeout=REPORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an event is bookkeeping: training goes on
            print(f"replica {self.replica}: {event.type} did not reach the driver ({type(exc).__name__}: {exc})",
                  flush=True)

    def rank_state(self, directory: str, manifest, info: dict[str, Any]) -> tuple[Any, Any]:
        """No RNG files (each step seeds its own streams); the epoch's metrics so far are in the state."""
        return None, info.get("epoch")
