"""Carries Ray Train's reports from its controller to the launcher's driver.

Ray Train V2 calls user callbacks inside its controller actor, not in the
driver process; the controller always runs on the driver's node. So the
:class:`ReportForwarder` callback appends each report (and each worker-group
failure) as a JSON line to a file the driver named, and the driver reads the
new lines to show progress and write the run log as training goes. That costs
no extra process. A driver connected through Ray Client (``ray://``) is not on
a Ray node; there the forwarder drops events into a :class:`Mailbox` actor.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import ray
from ray.train import UserCallback


@ray.remote(num_cpus=0)
class Mailbox:
    """An append-only list of events; ``take`` hands out the ones not yet taken."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []

    def put(self, event: dict[str, Any]) -> None:
        self._events.append(event)

    def take(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


class ReportForwarder(UserCallback):
    """Forwards rank 0's metrics, the persisted checkpoint's path and failures."""

    def __init__(self, path: str | None = None, mailbox=None) -> None:
        self.path, self.mailbox = path, mailbox

    def _send(self, event: dict[str, Any]) -> None:
        if self.mailbox is not None:
            self.mailbox.put.remote(event)
            return
        with open(self.path, "a", encoding="utf-8") as f:  # one write per line: readers see whole lines
            f.write(json.dumps(event, default=str) + "\n")

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self._send({"type": "report", "time": time.time(), "metrics": dict(metrics[0]),
                    "checkpoint": checkpoint.path if checkpoint is not None else None})

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        self._send({"type": "failure", "time": time.time(),
                    "errors": {int(rank): f"{type(e).__name__}: {e}"[:2000]
                               for rank, e in worker_exceptions.items()}})


class EventChannel:
    """The driver's end: ``forwarder`` goes into RunConfig, ``take`` returns new events."""

    def __init__(self) -> None:
        from ray.util.client import ray as client_ray

        self._mailbox = Mailbox.remote() if client_ray.is_connected() else None
        self._path: str | None = None
        self._offset = 0
        if self._mailbox is None:
            fd, self._path = tempfile.mkstemp(prefix="launcher-events-", suffix=".jsonl")
            os.close(fd)
        self.forwarder = ReportForwarder(self._path, self._mailbox)

    def take(self) -> list[dict[str, Any]]:
        if self._mailbox is not None:
            return ray.get(self._mailbox.take.remote())
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # leave a line still being written for next time
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

    def close(self) -> None:
        if self._path:
            os.remove(self._path)
