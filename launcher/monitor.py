"""Carries Ray Train's reports from its controller to the launcher's driver.

Ray Train V2 calls user callbacks inside its controller actor, not in the
driver process. :class:`ReportForwarder` runs there and drops each report
(and each worker-group failure) into a :class:`Mailbox` actor; the driver
drains the mailbox to show progress and write the run log as training goes.
"""

from __future__ import annotations

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

    def __init__(self, mailbox) -> None:
        self.mailbox = mailbox

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self.mailbox.put.remote({
            "type": "report", "time": time.time(), "metrics": dict(metrics[0]),
            "checkpoint": checkpoint.path if checkpoint is not None else None,
        })

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        self.mailbox.put.remote({
            "type": "failure", "time": time.time(),
            "errors": {int(rank): f"{type(e).__name__}: {e}"[:2000] for rank, e in worker_exceptions.items()},
        })
