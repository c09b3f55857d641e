"""One launch of a run at a time: the lock in the run's folder, local and on Cloud Storage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.runlock import LOCK, STALE_S, RunLock


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it now


@pytest.fixture(params=["local", "gcs"])
def storage(request, tmp_path):
    if request.param == "gcs":
        return Storage.resolve(f"gs://{request.getfixturevalue('bucket')}/runs")
    return Storage.resolve(str(tmp_path / "runs"))


def test_a_second_launch_is_refused_and_the_run_is_free_again_after_release(storage):
    first = RunLock(storage, "r")
    first.acquire()
    with pytest.raises(UserError, match=rf"run r is being trained by another launch \(pid \d+ on "
                                        rf"{socket.gethostname()}, since .*\); wait for it or stop it"):
        RunLock(storage, "r").acquire()
    first.release()
    assert storage.read_text("r", LOCK) is None
    second = RunLock(storage, "r")
    second.acquire()
    assert json.loads(storage.read_text("r", LOCK))["pid"] == second._record()["pid"]


@pytest.mark.parametrize("holder", [
    lambda: {"host": socket.gethostname(), "pid": dead_pid(), "since": 0, "heartbeat": time.time()},
    lambda: {"host": "elsewhere", "pid": 1, "since": 0, "heartbeat": time.time() - STALE_S - 1},
    lambda: None,  # cut off while written
], ids=["dead-pid", "old-beat", "torn"])
def test_stale_lock_taken_over(storage, holder):
    # A lock left by a launch that died: its pid gone here, its heartbeat too old, or cut off.
    value = holder()
    storage.write_text(json.dumps(value) if value else '{"host": "x", "p', "r", LOCK)
    lock = RunLock(storage, "r")
    lock.acquire()
    assert lock.held and json.loads(storage.read_text("r", LOCK))["host"] == socket.gethostname()


def test_a_live_lock_on_another_host_blocks(storage):
    storage.write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": 0, "heartbeat": time.time()}),
                       "r", LOCK)
    with pytest.raises(UserError, match="pid 1 on elsewhere"):
        RunLock(storage, "r").acquire()
