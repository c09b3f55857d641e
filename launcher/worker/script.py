"""Script mode, worker side: run an unmodified training script as a subprocess of the worker.

:func:`script_worker` is Ray Train's training function in script mode (see
:mod:`launcher.driver.script`): it asks the backend for the environment a
script of that backend expects, starts ``python script ARGS`` with it, and
ships the script's output, line by line, to the driver's mailbox actor.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

FLUSH_S = 0.1           # how often a worker ships buffered output lines
MAX_BATCH = 500         # and at most this many per message


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the worker thread that started it ends
    (Ray killing a worker must not leave an orphaned training script holding the ring)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def script_worker(config: dict[str, Any]) -> None:
    """Ray Train's training function in script mode: run the script, stream its output."""
    import subprocess
    import tempfile

    import ray
    import ray.train

    from launcher import backends

    rank = ray.train.get_context().get_world_rank()
    sink = config["sink"]
    os.environ.update(config.get("env", {}))
    backend = backends.get(config["backend"])
    env = {**os.environ, **backend.script_env(config["framework"]), "PYTHONUNBUFFERED": "1"}
    path = config["script"]
    if not os.path.isfile(path):  # another machine: run the driver's copy
        fd, path = tempfile.mkstemp(prefix="launcher-script-", suffix=".py")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config["source"])
    cwd = config["cwd"] if os.path.isdir(config["cwd"]) else os.path.dirname(path)
    proc = subprocess.Popen([sys.executable, path, *config["args"]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                            preexec_fn=_die_with_parent)
    lines: list[str] = []
    lock = threading.Lock()

    def read() -> None:
        for raw in proc.stdout:
            with lock:
                lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pending = []

    def ship() -> None:
        with lock:
            batch, lines[:] = lines[:MAX_BATCH], lines[MAX_BATCH:]
        if batch:
            pending.append(sink.put.remote({"rank": rank, "lines": batch}))

    while proc.poll() is None:
        time.sleep(FLUSH_S)
        ship()
    reader.join()
    while lines:
        ship()
    status = proc.returncode
    ray.get(pending + [sink.put.remote({"rank": rank, "exit": status, "time": time.time()})])
    if status != 0:
        raise ScriptFailed(rank, status)


class ScriptFailed(RuntimeError):
    def __init__(self, rank: int, status: int) -> None:
        super().__init__(f"rank {rank}: the script exited with status {status}")
        self.rank, self.status = rank, status
