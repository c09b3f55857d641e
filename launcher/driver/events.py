"""Carries Ray Train's reports from its controller to the launcher's driver.

Ray Train V2 calls user callbacks inside its controller actor, not in the
driver process; the controller always runs on the driver's node. So the
:class:`ReportForwarder` callback appends each report (and each worker-group
failure) as a JSON line to a file the driver named, and the driver reads the
new lines to show progress and write the run log as training goes. That costs
no extra process. A driver connected through Ray Client (``ray://``) is not on
a Ray node; there the forwarder drops events into a :class:`Mailbox` actor, as the
replicas of a ``--strategy ft`` run do with their reports (they report without Ray Train,
whose report waits for every worker, a replica that left too).

:class:`StateForwarder` adds the controller's own view: a preemption notice
seen (PREEMPTING) and each restart with its cause: a preemption, a failure, or
a resize (an elastic run whose cluster grew or shrank under it: Ray Train
stops the group and starts one of the new size from the last checkpoint, often
before any worker's death is reported, so it costs steps like a failure).
:class:`ProgressBoard` is where rank 0 notes the last step it trained, so the
driver can tell how many steps a restart threw away;
:func:`launcher.driver.tracker.lost_work` turns that into steps and seconds lost
per restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Any

import ray
from ray.train import UserCallback

from launcher import _ray
from launcher.summary import Event, Failure, Preempting, Report, Restart, event_from_json, event_to_json


@ray.remote(num_cpus=0)
class Mailbox:
    """An append-only list of events; ``take`` hands out the ones not yet taken."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._groups: dict[str, dict[int, str]] = {}
        self._controller = None

    def put(self, event: dict[str, Any]) -> None:
        self._events.append(event)

    def take(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    # A script run's ranks meet here: every rank's address, per worker group, for CLUSTER_SPEC.
    def join(self, group: str, rank: int, address: str) -> None:
        self._groups.setdefault(group, {})[rank] = address

    def members(self, group: str) -> dict[int, str]:
        return dict(self._groups.get(group, {}))

    # The run's Ray Train controller (a handle), for :meth:`EventChannel.abort`.
    def hold(self, controller) -> None:
        self._controller = controller

    def controller(self):
        return self._controller


class ReportForwarder(UserCallback):
    """Forwards rank 0's metrics, the persisted checkpoint's path and failures."""

    def __init__(self, path: str | None = None, mailbox=None) -> None:
        self.path, self.mailbox = path, mailbox

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        first = {k: v for k, v in metrics[0].items() if k != "usage"}
        # Each rank's usage samples since its last report (launcher.worker.usage), by rank.
        usage = {str(rank): m["usage"] for rank, m in enumerate(metrics) if isinstance(m, dict) and m.get("usage")}
        if usage:
            first["usage_ranks"] = usage
        _send(self.path, self.mailbox, Report(time.time(), first, checkpoint.path if checkpoint is not None else None))

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        _send(self.path, self.mailbox, Failure(time.time(), {int(rank): f"{type(e).__name__}: {e}"[:2000]
                                                             for rank, e in worker_exceptions.items()}))


def _send(path: str | None, mailbox, event: Event) -> None:
    data = event_to_json(event)
    if mailbox is not None:
        mailbox.put.remote(data)
        return
    with open(path, "a", encoding="utf-8") as f:  # one write per line: readers see whole lines
        f.write(json.dumps(data, default=str) + "\n")


def restart_cause(error) -> str:
    """"preemption" when Ray Train charges ``error`` to the preemption budget, else "failure"."""
    try:
        return "preemption" if _ray.is_preemption_failure(error) else "failure"
    except Exception:  # noqa: BLE001 - a private helper; fall back to the exception's type
        return "preemption" if type(error).__name__ == "PreemptionError" else "failure"


class StateForwarder(_ray.ControllerCallback):
    """Forwards controller state changes that matter to the summary: notices and restarts;
    and, once, the controller's own handle, so the driver can abort the run gracefully when
    it cannot send itself SIGINT (a Ray Tune trial, which runs in a thread: see
    :meth:`EventChannel.abort`)."""

    def __init__(self, path: str | None = None, mailbox=None) -> None:
        self.path, self.mailbox = path, mailbox
        self._workers: int | None = None  # the size of the group last scheduled

    def after_controller_start(self, train_run_context) -> None:
        handle = ray.get_runtime_context().current_actor
        if self.mailbox is not None:
            self.mailbox.hold.remote(handle)
            return
        part = self.path + ".controller.part"
        with open(part, "wb") as f:
            f.write(ray.cloudpickle.dumps(handle))
        os.replace(part, self.path + ".controller")  # readers see the whole handle or none

    def after_controller_state_update(self, previous_state, current_state) -> None:
        kind, before = type(current_state).__name__, type(previous_state).__name__
        if kind == "PreemptingState" and before != kind:
            info = current_state.preemption_info
            _send(self.path, self.mailbox, Preempting(time.time(), info.deadline_ms, list(info.preempted_ranks)))
        elif kind in ("RestartingState", "ReschedulingState"):
            error = current_state.training_failed_error
            _send(self.path, self.mailbox, Restart(time.time(), restart_cause(error),
                                                   f"{type(error).__name__}: {error}"[:500]))
        elif kind == "ResizingState" and before == "RunningState":
            size = current_state.scaling_decision.num_workers
            _send(self.path, self.mailbox, Restart(
                time.time(), "resize", f"the cluster's free resources changed: {self._workers} -> {size} workers"))
        if kind == "SchedulingState":
            self._workers = current_state.scaling_decision.num_workers


@ray.remote(num_cpus=0)
class ProgressBoard:
    """Per worker-group attempt: the step it resumed from, and the last step it trained (rank 0's word)."""

    def __init__(self) -> None:
        self._attempts: dict[str, dict[str, float]] = {}
        self._checkpoint: dict[str, Any] | None = None  # an elastic policy's request (see below)

    def step(self, attempt: str, start_step: int, step: int, when: float) -> None:
        a = self._attempts.setdefault(attempt, {"start_step": start_step, "first_time": when})
        a["last_step"], a["last_time"] = step, when

    def notice_saved(self, attempt: str, seconds: float) -> None:
        """Rank 0 stored the checkpoint a preemption notice asked for, in ``seconds``."""
        a = self._attempts.get(attempt)
        if a is not None:
            a["notice_checkpoint_s"] = round(seconds, 3)

    def attempts(self) -> list[dict[str, float]]:
        """Attempts in the order they trained their first step."""
        return sorted(({"attempt": k, **v} for k, v in self._attempts.items()), key=lambda a: a["first_time"])

    # An elastic group about to grow: Ray Train's controller (launcher.backends.elastic) asks for a
    # checkpoint, rank 0 answers once it is stored and the ranks hold, then the group is resized.
    def ask_checkpoint(self, workers: int, recent_s: float = 30.0) -> bool:
        """Ask the group for a checkpoint before it grows to ``workers``. False (nothing asked) when
        no rank 0 has noted a step in ``recent_s``: code that does not take part (a training
        function on Ray's own API) would never answer."""
        now = time.time()
        if not any(now - a.get("last_time", 0.0) <= recent_s for a in self._attempts.values()):
            return False
        self._checkpoint = {"workers": workers, "asked": now, "held": None}
        return True

    def checkpoint_wanted(self) -> int:
        """The group size a checkpoint is asked for (0: none is)."""
        c = self._checkpoint
        return int(c["workers"]) if c is not None and c["held"] is None else 0

    def checkpoint_taken(self, step: int) -> None:
        if self._checkpoint is not None:
            self._checkpoint["held"] = step

    def checkpoint_held(self, give_up: bool = False) -> int | None:
        """The step the group checkpointed and holds at, or None; the request ends once answered
        (or given up)."""
        c = self._checkpoint
        held = c["held"] if c is not None else None
        if held is not None or give_up:
            self._checkpoint = None
        return held


def _on_this_node() -> dict[str, Any]:
    """Keep small bookkeeping actors on the driver's node, which outlives preempted workers."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if _ray.client_connected():
        return {}
    node = ray.get_runtime_context().get_node_id()
    # Hard affinity: a soft one was seen landing on a worker node that was then preempted.
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


class EventChannel:
    """The driver's end: ``forwarder`` goes into RunConfig, ``take`` returns new events."""

    def __init__(self, board: bool = True, relay: bool = False) -> None:
        # A Ray Client driver is on no Ray node; ``relay``: the workers put reports of their own
        # into the mailbox (--strategy ft, whose replicas report without Ray Train: mailbox()).
        client = _ray.client_connected()
        self._mailbox = Mailbox.options(**_on_this_node()).remote() if client or relay else None
        self._path: str | None = None
        self._offset = 0
        if self._mailbox is None:
            fd, self._path = tempfile.mkstemp(prefix="launcher-events-", suffix=".jsonl")
            os.close(fd)
        self.forwarder = ReportForwarder(self._path, self._mailbox)
        self.states = StateForwarder(self._path, self._mailbox)
        # Each actor is a worker process to start: a run that has no use for the board goes without.
        self.board = ProgressBoard.options(**_on_this_node()).remote() if board else None

    def mailbox(self):
        """The actor events go through (None: a file on this node), for workers that report to it."""
        return self._mailbox

    def take(self) -> list[Event]:
        if self._mailbox is not None:
            return [event_from_json(e) for e in ray.get(self._mailbox.take.remote())]
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # leave a line still being written for next time
        self._offset += end
        return [event_from_json(json.loads(line)) for line in data[:end].splitlines() if line.strip()]

    def attempts(self) -> list[dict[str, Any]]:
        """The board's attempts (dicts with "attempt", "start_step", "first_time", ...); none without a board."""
        if self.board is None:
            return []
        error = None
        for _ in range(3):  # a loaded machine can be slow to answer; accounting is worth a retry
            try:
                return ray.get(self.board.attempts.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - accounting only; never fail a finished run over it
                error = exc

        print(f"launcher: steps lost are unknown ({type(error).__name__}: {error})", file=sys.stderr)
        return []

    def controller(self):
        """The run's Ray Train controller (an actor handle), once it has started; else None."""
        if self._mailbox is not None:
            return ray.get(self._mailbox.controller.remote(), timeout=30)
        try:
            with open(self._path + ".controller", "rb") as f:
                return ray.cloudpickle.loads(f.read())
        except FileNotFoundError:
            return None

    def abort(self, timeout_s: float = 30.0) -> bool:
        """End the run as Ctrl-C does: Ray Train's controller stops the workers and gives their
        placement group back. For a driver that cannot send itself SIGINT: a Ray Tune trial
        (its function runs in a thread) that Tune stops. Without it, the trial's process ends and
        takes the controller along, but the workers' placement group stays reserved until the
        tuning process exits, and later trials wait for CPUs that never free up."""
        try:
            controller = self.controller()
            if controller is None:
                return False
            ray.get(controller.abort.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            pass  # abort() ends the controller's process: its reply may never come
        except Exception:  # noqa: BLE001 - best effort: the caller is shutting down either way
            return False
        return True

    def close(self) -> None:
        if self.board is not None:
            ray.kill(self.board)
        if self._path:
            os.remove(self._path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path + ".controller")
