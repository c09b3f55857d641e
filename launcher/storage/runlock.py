"""One launch of a run at a time: a lock file in the run's folder.

Two launches of the same ``--name`` would train into one folder and resume
each other's checkpoints. The launch that starts training creates
``<run>/launch.lock`` (atomically: ``O_EXCL`` on a local folder, a
create-only precondition on Cloud Storage) with its host, pid and a
heartbeat it refreshes while it trains; a second launch is refused with one
line saying who holds the run. A lock left by a driver that died is taken
over: on the same host when its pid is gone, from anywhere once its heartbeat
is older than :data:`STALE_S`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from launcher.errors import UserError
from launcher.storage.runlog import LOCK, RunRecord
from launcher.storage.runs import pid_alive
from launcher.storage.store import Storage

HEARTBEAT_S = 60.0     # how often a training launch refreshes its lock
STALE_S = 5 * 60.0     # a lock not refreshed for this long belongs to a dead driver


class RunLock:
    def __init__(self, storage: Storage, name: str) -> None:
        self.storage, self.name = storage, name
        self.reader = RunRecord(storage, name)
        self.held = False
        self._beat = 0.0

    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "heartbeat": now}

    def stale(self, holder: dict[str, Any], now: float | None = None) -> bool:
        """Whether ``holder``'s launch is gone: its pid on this host, or a heartbeat too old."""
        now = now or time.time()
        if holder.get("host") == socket.gethostname() and not pid_alive(int(holder.get("pid", 0))):
            return True
        return now - float(holder.get("heartbeat", 0)) > STALE_S

    def acquire(self) -> None:
        """Take the run, or UserError naming who has it."""
        for _ in range(2):  # the second try after removing a stale lock
            if self.storage.create_exclusive(json.dumps(self._record()), self.name, LOCK):
                self.held, self._beat = True, time.time()
                return
            holder = self.reader.lock()
            if holder is not None and not self.stale(holder):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
                raise UserError(f"run {self.name} is being trained by another launch (pid {holder.get('pid')} on "
                                f"{holder.get('host')}, since {since})",
                                "wait for it or stop it, or pass another --name; a lock left by a killed "
                                f"launch expires {STALE_S / 60:g} min after its last heartbeat")
            self.storage.remove_file(self.name, LOCK)
        raise UserError(f"run {self.name}: could not take its lock ({self.storage.uri_of(self.name, LOCK)})",
                        "another launch keeps taking it; try again")

    def refresh(self) -> None:
        """Renew the heartbeat, at most every HEARTBEAT_S (called often, e.g. by the pump)."""
        now = time.time()
        if self.held and now - self._beat >= HEARTBEAT_S:
            self._beat = now
            holder = self.reader.lock() or {}
            try:
                self.storage.write_text(json.dumps({**self._record(), "since": holder.get("since", now)}),
                                        self.name, LOCK)
            except OSError:
                pass  # the checkpoints fail too, and say so; the lock just ages

    def release(self) -> None:
        """Give the run back; a lock that cannot be removed (storage gone read-only) is left
        to go stale: the next launch on this host takes it over at once."""
        if self.held:
            self.held = False
            try:
                self.storage.remove_file(self.name, LOCK)
            except OSError:
                pass
