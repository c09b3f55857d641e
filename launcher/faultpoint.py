"""Named moments where tests/faults can stop a launch (inert unless asked for).

``LAUNCHER_FAULT_PAUSE=POINT[:SECONDS]`` makes the process that reaches POINT
create the file ``LAUNCHER_FAULT_MARK`` names (workers' output does not reach
the driver's terminal), print ``fault point POINT reached`` on stderr, and wait
SECONDS (default 60), once per process, so a test can send its signal exactly
then rather than guess from timing. The points:

- ``workers-start``: every worker, before it joins the backend's process group;
- ``checkpoint``: rank 0, its first checkpoint of the launch written and about
  to be handed to Ray Train for upload;
- ``export``: rank 0, the final checkpoint written, before exporting the model;
- ``step-checkpoint``: rank 0, its first step checkpoint (``--checkpoint-every-steps``)
  of the launch reported to Ray Train: a stop now resumes from that mid-epoch step;
- ``setup``: the driver, inside the timed one-off set-up phase (where a first
  ``--backend horovod`` run builds Horovod): a slow set-up, for the start-up profile;
- ``tune-trials``: a ``launcher tune`` driver, at the end of Ray Tune's first step
  that leaves a trial made but not started: a signal now ends the search (once
  the pause is over) before that trial starts;
- ``shard-written``: ``launcher data shard``, its first shard in place (the set
  unfinished: no index yet).

Workers inherit the variable from a local Ray the launch starts itself.
"""

from __future__ import annotations

import os
import sys
import time

from launcher.settings import FAULT_MARK as MARK_ENV, FAULT_PAUSE as ENV

_reached: set[str] = set()


def pause(point: str) -> None:
    """Wait here if ``LAUNCHER_FAULT_PAUSE`` names ``point`` (the first time only)."""
    wanted = os.environ.get(ENV)
    if not wanted or point in _reached:
        return
    name, _, seconds = wanted.partition(":")
    if name != point:
        return
    _reached.add(point)
    if os.environ.get(MARK_ENV):
        with open(os.environ[MARK_ENV], "a", encoding="utf-8") as f:
            f.write(f"{point} {os.getpid()}\n")
    print(f"fault point {point} reached", file=sys.stderr, flush=True)
    time.sleep(float(seconds or 60))
