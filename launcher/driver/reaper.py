"""Stop what a launch's local Ray left running when the driver dies without cleaning up.

A driver that is SIGKILLed (or killed by the OOM killer) never calls
``ray.shutdown()``: Ray's GCS and raylet notice, but the agents the raylet
started (dashboard agent, runtime-env agent) and stray workers live on for a
minute or two. :class:`Reaper` starts a small watcher process beside a local
Ray: it keeps a list of the driver's descendants (pid and start time, so a
reused pid is never touched) and, when the pipe from the driver closes without
the word ``done``, sends them SIGTERM and, 3 s later, SIGKILL.

Run as ``python -m launcher.driver.reaper PID``; it imports nothing heavy.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

# The driver's descendants are looked up every POLL_S at first, then less and less often, up
# to every POLL_MAX_S: a local Ray's long-lived processes (GCS, raylet, agents) all start in
# its first seconds, and what they start later (workers, a restarted group) is found from
# them when the reaper acts. A full /proc scan every 0.5 s took 0.3-0.4 % of a core all run long.
POLL_S = 0.5
POLL_MAX_S = 5.0
GRACE_S = 3.0


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) for every process we can read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Every live descendant of ``roots`` (not the roots): pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out and child not in roots:
                out[child] = table[child][1]
                todo.append(child)
    return out


def reap(known: dict[int, int]) -> int:
    """SIGTERM, then SIGKILL, the known processes (and their descendants) still alive; returns how many."""
    table = process_table()
    alive = {pid: start for pid, start in known.items() if table.get(pid, (0, -1))[1] == start}
    alive.update(descendants(set(alive), table))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        table = process_table()
        left = [pid for pid, start in alive.items() if table.get(pid, (0, -1))[1] == start]
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM and left:
            end = time.time() + GRACE_S
            while time.time() < end and any(table.get(p, (0, -1))[1] == alive[p] for p in left):
                time.sleep(0.1)
                table = process_table()
    return len(alive)


def watch(driver: int) -> int:
    known: dict[int, int] = {}
    poll = POLL_S
    while True:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], poll)
        poll = min(POLL_MAX_S, poll * 1.5)
        if ready:
            data = os.read(sys.stdin.fileno(), 64)
            if data.startswith(b"done"):
                return 0
            if not data:
                break  # the driver is gone
        known.update(descendants({driver}, process_table()))
    known.pop(os.getpid(), None)
    reaped = reap(known)
    if reaped:
        print(f"launcher: the driver (pid {driver}) died; stopped {reaped} process(es) of its local Ray",
              file=sys.stderr, flush=True)
    return 0


class Reaper:
    """The driver's end: start before the local Ray starts, :meth:`done` after it is shut down."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def start(self) -> "Reaper":
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "launcher.driver.reaper", str(os.getpid())],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          start_new_session=True)  # a Ctrl-C to our group is not for it
        except OSError:
            self._proc = None  # only a safety net: a run goes on without it
        return self

    def done(self) -> None:
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(b"done\n")
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._proc = None


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1])))
