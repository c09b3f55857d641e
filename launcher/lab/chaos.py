"""What the preemption lab (:mod:`launcher.lab.autoscaling`) shares with its users: a lab node
(its fake metadata server and watcher) and a run in a background thread of this process
(:func:`run_in_background`), so the chaos stays in the main thread. The chaos tests,
``launcher preemption demo`` and ``launcher bench preemption`` use them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from launcher.lab.metadata import FakeMetadataServer
from launcher.storage import Storage
from launcher.storage.checkpoint import complete_checkpoints


@dataclass
class LabNode:
    node: Any                      # ray._private.node.Node
    metadata: FakeMetadataServer
    stop: threading.Event
    thread: threading.Thread
    log: list[str] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        return self.node.node_id


def run_in_background(spec, note: Callable[[str], None] | None = None) -> "BackgroundRun":
    return BackgroundRun(spec, note).start()


class BackgroundRun:
    """``launcher.driver.run(spec)`` in a thread of this process (connected to the lab's cluster)."""

    def __init__(self, spec, note=None) -> None:
        self.spec, self.note = spec, note
        self.summary = None  # the RunSummary, once the run ends
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="launcher-run", daemon=True)

    def start(self) -> "BackgroundRun":
        self._thread.start()
        return self

    def _run(self) -> None:
        from launcher.driver import launch

        try:
            self.summary = launch.run(self.spec, show_progress=self.note is not None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of wait()
            self.error = exc

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
