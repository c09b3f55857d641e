"""Where the time goes before training: timestamps from the driver and rank 0, as phases.

The driver marks its milestones here (CLI entry, checks done, Ray ready, fit
returned, done); rank 0 marks its own (train function entered, ready to
train, first step done) and sends them with its first report. Marks are wall
clock times, so they compare across processes on one machine (on a cluster,
up to the clocks' skew).

A one-off set-up the launch waits for (a backend getting ready: the first
``--backend horovod`` run builds Horovod for minutes) is timed by
:func:`setup_phase`: it shows here as a phase of its own and is kept out of the
run's wall time, its progress lines' elapsed time and its throughput.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

from launcher import faultpoint

MARKS: dict[str, float] = {}
SETUP_PHASE = "checks: backend set-up (a first Horovod build)"
SETUP_SHOWN_S = 0.01

# (phase, from mark, to mark)
PHASES = (
    ("python start and imports", "process_start", "cli_main"),
    ("spec, storage and data checks", "cli_main", "checks_done"),
    (SETUP_PHASE, "setup_start", "setup_done"),
    ("Ray start or connect", "checks_done", "ray_ready"),
    ("controller and worker group start", "ray_ready", "worker_start"),
    ("worker setup (process group, data, model, restore)", "worker_start", "worker_ready"),
    ("worker setup: process group, data, model, optimizer", "worker_start", "model_ready"),
    ("worker setup: finding and restoring a checkpoint", "model_ready", "worker_ready"),
    ("first training step", "worker_ready", "first_step"),
    ("training", "first_step", "fit_returned"),
    ("export, run log and Ray shutdown", "fit_returned", "done"),
)


# Prefixes of the phases that are parts of the row above them (the table indents them).
SUBPHASES = ("worker setup: ", "checks: ")


def mark(name: str, when: float | None = None) -> None:
    """Record a milestone (the first time only)."""
    MARKS.setdefault(name, time.time() if when is None else when)


class SetupTimer:
    """The seconds one :func:`setup_phase` took (set when it ends)."""

    seconds: float = 0.0


@contextlib.contextmanager
def setup_phase() -> Iterator[SetupTimer]:
    """Time a one-off set-up (``backend.prepare``: building Horovod on first use) as its own phase.

    Its seconds go into the marks (``setup_start``, ``setup_done``: the start-up profile's
    set-up row) and into :func:`setup_seconds`, which the driver takes off the run's wall
    time: minutes of building are not minutes of training. The fault point ``setup``
    (``LAUNCHER_FAULT_PAUSE=setup:SECONDS``) waits inside it, as a slow set-up would."""
    timer = SetupTimer()
    started = time.time()
    try:
        faultpoint.pause("setup")
        yield timer
    finally:
        timer.seconds = time.time() - started
        if timer.seconds >= SETUP_SHOWN_S:  # a backend with nothing to set up has no row
            spent = setup_seconds()
            MARKS.setdefault("setup_start", started)
            MARKS["setup_done"] = MARKS["setup_start"] + spent + timer.seconds  # several set-ups: their sum


def setup_seconds(marks: dict[str, float] | None = None) -> float:
    """Seconds of one-off set-up timed by :func:`setup_phase` since the run began (0.0: none)."""
    marks = MARKS if marks is None else marks
    if "setup_start" in marks and "setup_done" in marks:
        return max(0.0, marks["setup_done"] - marks["setup_start"])
    return 0.0


def begin_cli() -> None:
    """Called first thing by the command line: the process's own start counts."""
    MARKS.clear()
    mark("process_start", process_start())
    mark("cli_main")


def begin_run() -> None:
    """Forget the marks of an earlier run in this process (tests, notebooks). The process's
    start and the command line's entry count only for the first run after :func:`begin_cli`:
    a second run in one process starts its checks when it is called."""
    keep = ("process_start", "cli_main") if "checks_done" not in MARKS else ()
    for key in list(MARKS):
        if key not in keep:
            del MARKS[key]
    mark("cli_main")


def process_start() -> float:
    """When this process started (the interpreter's own start-up counts too); Linux /proc."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Seconds per phase, for the phases whose two marks are known."""
    return {name: round(marks[b] - marks[a], 3) for name, a, b in PHASES if a in marks and b in marks}


def report(marks: dict[str, float]) -> dict:
    out = {"phases": phases(marks)}
    if "first_step" in marks and "process_start" in marks:
        out["time_to_first_step_s"] = round(marks["first_step"] - marks["process_start"], 3)
    return out


def format_table(rep: dict) -> str:
    lines = ["start-up profile:"]
    for name, seconds in rep["phases"].items():
        for parent in SUBPHASES:
            if name.startswith(parent):  # a part of the row above
                name = "  " + name[len(parent):]
        lines.append(f"  {name:<52} {seconds:8.2f} s")
    if "time_to_first_step_s" in rep:
        lines.append(f"  {'time to first step (from process start)':<52} {rep['time_to_first_step_s']:8.2f} s")
    return "\n".join(lines)
