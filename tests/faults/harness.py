"""A real `launcher run` process for fault tests: start it, watch its stderr and its
descendants, signal it at a moment, and check what it left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Launch:
    """``python -m launcher run --json ARGS`` in its own process (a fresh local Ray)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.cmd = [sys.executable, "-m", "launcher", "run", "--json", *args]
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.err: list[str] = []
        self.seen: set[psutil.Process] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.out = ""
        self.signalled_at = 0.0

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def note_family(self) -> None:
        try:
            self.seen |= set(psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, text: str, timeout_s: float = 240) -> None:
        """Until a stderr line holds ``text``, noting the launch's processes meanwhile."""
        end = time.time() + timeout_s
        while time.time() < end:
            self.note_family()
            if any(text in line for line in self.err):
                return
            assert self.proc.poll() is None, f"the launch ended before {text!r}:\n{self.stderr[-4000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} on stderr in {timeout_s:.0f}s:\n{self.stderr[-4000:]}")

    def wait_until(self, ready, timeout_s: float = 240) -> None:
        """Until ``ready()`` is true, noting the launch's processes meanwhile."""
        end = time.time() + timeout_s
        while time.time() < end:
            self.note_family()
            if ready():
                return
            assert self.proc.poll() is None, self.stderr[-4000:]
            time.sleep(0.2)
        raise AssertionError(f"not ready in {timeout_s:.0f}s:\n{self.stderr[-4000:]}")

    def signal(self, signum: int) -> None:
        self.note_family()
        self.signalled_at = time.time()
        self.proc.send_signal(signum)

    def finish(self, timeout_s: float = 300) -> int:
        """Wait for the exit; returns the exit code."""
        self.proc.wait(timeout=timeout_s)  # stdout holds the summary alone: it cannot fill the pipe
        self._reader.join(timeout=10)
        self.out = self.proc.stdout.read()
        return self.proc.returncode

    def summary(self) -> dict:
        """The --json summary: stdout's last line."""
        lines = [line for line in self.out.splitlines() if line.strip()]
        assert lines, f"no summary on stdout:\n{self.stderr[-4000:]}"
        return json.loads(lines[-1])

    def left(self, grace_s: float = 30) -> list[psutil.Process]:
        """Processes of this launch still running ``grace_s`` after it ended (Ray's own
        processes exit a little after the driver)."""
        end = time.time() + grace_s
        while True:
            running = [p for p in self.seen if _running(p)]
            if not running or time.time() > end:
                return running
            time.sleep(0.5)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
