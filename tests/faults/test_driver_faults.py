"""Faults injected into real launches: the driver SIGKILLed mid-run.

Each case launches ``launcher run`` as its own process (a fresh local Ray),
injects the fault, then checks what the user would: the exit code, that no
process of that launch is left, and that the next launch of the same run
resumes from a complete checkpoint. (SIGINT and SIGTERM while training are
tests/test_train_local.py's signal test, which checks the same.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from launcher.storage import Storage, complete_checkpoints

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPOCHS = 3


def launch(storage: str, name: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher", "run", "--workers", "2", "--epochs", str(EPOCHS), "--storage", storage,
           "--name", name, "--json", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def family(pid: int) -> set[psutil.Process]:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def wait_for_checkpoint(storage: str, name: str, proc: subprocess.Popen, seen: set, timeout_s: float = 180):
    """Until the run has a complete checkpoint, noting the driver's descendants meanwhile."""
    end = time.time() + timeout_s
    while time.time() < end:
        seen |= family(proc.pid)
        if complete_checkpoints(Storage.resolve(storage), name):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


def alive(processes: set[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_sigkilled_driver_leaves_no_process_and_the_run_resumes(tmp_path):
    storage = str(tmp_path / "runs")
    proc = launch(storage, "killed", "--epochs", "30")
    seen: set[psutil.Process] = set()
    wait_for_checkpoint(storage, "killed", proc, seen)
    seen |= family(proc.pid)
    assert len(seen) >= 4, seen  # Ray's GCS, raylet, agents, the workers
    proc.kill()
    proc.communicate(timeout=30)
    killed = time.time()
    while alive(seen) and time.time() - killed < 30:
        time.sleep(0.5)
    left = alive(seen)
    assert not left, [(p.pid, p.name()) for p in left]
    took = time.time() - killed
    # The run goes on from the last complete checkpoint with the next launch.
    done = launch(storage, "killed", "--epochs", "2")
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["status"] == "succeeded" and summary["resumed_from"]["epoch"] >= 1, summary
    assert summary["epochs_completed"] == 2
    print(f"SIGKILL: {len(seen)} processes of the launch gone {took:.1f}s after the driver")
