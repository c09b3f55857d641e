"""Faults injected into real launches of the driver: Ctrl-C while Ray starts, storage
that stops taking writes.

Each case launches ``launcher run`` as its own process (a fresh local Ray),
injects the fault, then checks what the user would: the exit code, the summary,
that no process of that launch is left, and that the next launch of the same
run resumes from a complete checkpoint. (A signal at each moment of a launch:
test_signal_moments.py, which also SIGKILLs a driver and a worker and starts a second launch
of a running run.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from harness import Launch

from launcher.storage import Storage, complete_checkpoints

pytestmark = pytest.mark.integration


def has_checkpoint(storage: str, name: str):
    return lambda: bool(complete_checkpoints(Storage.resolve(storage), name))


def test_ctrl_c_while_ray_starts_stops_the_launch_at_once(storage):
    launch = Launch("--storage", storage, "--name", "early")
    launch.wait_for("starting a local Ray instance")
    time.sleep(0.5)  # inside ray.init
    launch.signal(signal.SIGINT)
    assert launch.finish(timeout_s=120) == 130, launch.stderr
    assert time.time() - launch.signalled_at < 30 and "epoch 1/" not in launch.stderr
    summary = launch.summary()
    assert summary["status"] == "cancelled" and summary["epochs_completed"] == 0, summary
    assert not os.path.exists(os.path.join(storage, "early", "launches.jsonl"))  # nothing was begun
    left = launch.left()
    assert not left, [(p.pid, p.name()) for p in left]


def _immutable(path: str, on: bool) -> bool:
    """chattr +i / -i (root may still not write into an immutable folder); False where unsupported."""
    return subprocess.run(["chattr", "+i" if on else "-i", path], capture_output=True).returncode == 0


def test_storage_that_stops_taking_writes_fails_the_run_with_a_summary(storage, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    if not _immutable(str(probe), True):
        pytest.skip("this filesystem has no immutable attribute (chattr +i)")
    _immutable(str(probe), False)
    args = ("--storage", storage, "--name", "ro")
    launch = Launch(*args, "--epochs", "300")
    run_dir = os.path.join(storage, "ro")
    try:
        launch.wait_until(has_checkpoint(storage, "ro"))
        assert _immutable(run_dir, True)
        code = launch.finish(timeout_s=240)
    finally:
        _immutable(run_dir, False)
        if launch.proc.poll() is None:
            launch.proc.kill()
    assert code == 1, launch.stderr[-3000:]
    s = launch.summary()  # a summary, whatever could not be written
    assert s["status"] == "failed" and s["error"].startswith("storage stopped taking writes: "), s
    assert f"error: {s['error']}" in launch.stderr  # said on stderr too, for the person watching
    assert not launch.left()
    done = s["epochs_completed"]
    again = Launch(*args, "--epochs", str(done + 1))
    assert again.finish() == 0, again.stderr[-3000:]  # writable again: it resumes
    resumed = again.summary()
    assert resumed["resumed_from"] is not None and resumed["epochs_completed"] == done + 1
