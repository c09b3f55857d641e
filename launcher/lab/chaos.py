"""What the preemption lab (:mod:`launcher.lab.autoscaling`) shares with its users: a lab node
(its fake metadata server and watcher) and a run in a background thread of this process
(:func:`run_in_background`), so the chaos stays in the main thread. The chaos tests,
``launcher preemption demo`` and ``launcher bench preemption`` use them.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from launcher.driver.script import ProgramRun
from launcher.driver.trainer import stop_running
from launcher.lab.metadata import FakeMetadataServer
from launcher.preemption.drain import short_node_id
from launcher.storage import Storage
from launcher.storage.checkpoint import complete_checkpoints


@dataclass
class LabNode:
    node: Any                      # ray._private.node.Node
    metadata: FakeMetadataServer
    stop: threading.Event
    thread: threading.Thread
    log: list[str] = field(default_factory=list)
    name: str = ""                 # what the lab calls it in its lines ("worker 2")

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def label(self) -> str:
        """Its name and its Ray node id, short: 'worker 2 (Ray node ffff...00002)'."""
        short = short_node_id(self.node_id)
        return f"{self.name} (Ray node {short})" if self.name else f"Ray node {short}"


_LIVE: set["BackgroundRun"] = set()  # runs whose thread has not ended
_LIVE_LOCK = threading.Lock()


def stop_background_runs(reason: str, timeout_s: float = 90.0) -> int:
    """End every background run of this process as Ctrl-C would, and wait for their threads;
    returns how many were running. Call it before ``ray.shutdown()``: a thread that still uses Ray
    once its core worker is shut down ends the whole process (exit status 1)."""
    with _LIVE_LOCK:
        live = [run for run in _LIVE if run.running]
    end = time.time() + timeout_s
    for run in live:
        run.stop(reason, max(1.0, end - time.time()))
    return len(live)


def run_in_background(spec, note: Callable[[str], None] | None = None, program=None,
                      program_args: list[str] | None = None, job_dir: bool = True,
                      out: TextIO | None = None) -> "BackgroundRun":
    return BackgroundRun(spec, note, program, program_args, job_dir, out).start()


class BackgroundRun:
    """A run in a thread of this process (connected to the lab's cluster): ``launcher.driver.run(spec)``,
    or, given a ``program`` (a --script or --package), that program with ``program_args``."""

    def __init__(self, spec, note=None, program=None, program_args: list[str] | None = None,
                 job_dir: bool = True, out: TextIO | None = None) -> None:
        self.spec, self.note = spec, note
        self.program, self.program_args, self.job_dir = program, list(program_args or []), job_dir
        self.out = out  # a program's lines and progress (default: stderr)
        self.summary = None  # the RunSummary, once the run ends
        self.exit_code: int | None = None  # a program's exit status
        self.error: BaseException | None = None
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="launcher-run", daemon=True)

    def start(self) -> "BackgroundRun":
        self.started = time.time()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._thread.start()
        return self

    def stop(self, reason: str, timeout_s: float = 90.0) -> bool:
        """Abort the run as Ctrl-C would (its status CANCELLED, ``reason`` its error) and wait for
        its thread; True once it has ended. A run still starting is aborted once its fit begins."""
        end = time.time() + timeout_s
        while self.running and time.time() < end:
            stop_running(reason, timeout_s=max(1.0, end - time.time()))
            self._thread.join(0.2)
        return not self.running

    def _run(self) -> None:
        try:
            from launcher.driver import launch

            if self.program is None:
                self.summary = launch.run(self.spec, show_progress=self.note is not None)
            else:
                job = ProgramRun(self.program, tuple(self.program_args), job_dir=self.job_dir)
                self.summary = launch.run(self.spec, job, out=self.out or sys.stderr, progress_out=self.out)
                self.exit_code = self.summary.exit_status
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of wait()
            self.error = exc
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float = 600):
        """The run's RunSummary (or its exception, raised here)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"run {self.spec.name} did not finish within {timeout_s:g}s")
        if self.error is not None:
            raise self.error
        return self.summary

    def wait_for_training(self, after_s: float, timeout_s: float = 600) -> None:
        """Wait until the run has gone on for ``after_s`` seconds since its launch (a program keeps
        its checkpoints to itself, so there is none to wait for)."""
        end = time.time() + timeout_s
        while time.time() < end and self.running:
            if time.time() - self.started >= after_s:
                return
            time.sleep(0.2)
        if not self.running:
            raise RuntimeError(f"run {self.spec.name} ended before the preemption: {self.summary or self.error}")

    def wait_for_checkpoint(self, predicate: Callable[[Any], bool], timeout_s: float = 180) -> Any:
        """The newest complete checkpoint's manifest once one satisfies ``predicate``."""
        storage = Storage.resolve(self.spec.storage)
        end = time.time() + timeout_s
        while time.time() < end:
            found = complete_checkpoints(storage, self.spec.name)
            for manifest, path in reversed(found):
                if predicate(manifest):
                    return manifest, path
            if not self.running:
                raise RuntimeError(f"run {self.spec.name} ended before the checkpoint came: "
                                   f"{self.summary or self.error}")
            time.sleep(0.1)
        raise TimeoutError(f"no checkpoint of run {self.spec.name} matched within {timeout_s:g}s")
