"""A preemption lab on one machine: a multi-node Ray cluster whose worker nodes can be
preempted the way GCE does it, with or without notice.

:class:`PreemptionLab` starts ``ray.cluster_utils.Cluster`` (a head without
CPUs, so workers land on the worker nodes) and, per worker node, a fake GCE
metadata server on loopback plus the real :class:`launcher.preemption.watcher.Watcher`
pointed at that node. :meth:`PreemptionLab.preempt` flips the node's metadata
to TRUE (the watcher drains the node), waits out the drain deadline, removes
the node and adds a replacement, as GCE and Ray's autoscaler would.
:meth:`PreemptionLab.kill` removes a node without notice. The chaos tests,
``launcher preemption demo`` and ``launcher bench preemption`` all use it.
Call the lab from the main thread: Ray's ``Cluster.add_node`` installs signal
handlers; the run goes in a background thread (:func:`run_in_background`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from launcher import _ray
from launcher.lab.metadata import FakeMetadataServer
from launcher.preemption.drain import node_drainer
from launcher.preemption.watcher import Watcher
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


class PreemptionLab:
    def __init__(self, nodes: int = 2, cpus_per_node: float = 1, notice_s: float = 8.0, margin_s: float = 2.0,
                 note: Callable[[str], None] = lambda text: None) -> None:
        self.size, self.cpus, self.notice_s, self.margin_s, self.note = nodes, cpus_per_node, notice_s, margin_s, note
        self.cluster = None
        self.nodes: list[LabNode] = []
        self.events: list[dict[str, Any]] = []  # what the lab did, with times

    # -- life -------------------------------------------------------------------------------
    def __enter__(self) -> "PreemptionLab":
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(self.size):
            self.add_node(wait=False)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
        return self

    def __exit__(self, *exc) -> None:
        import ray

        for n in self.nodes:
            self._stop_watcher(n)
        ray.shutdown()
        self.cluster.shutdown()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, wait: bool = True) -> LabNode:
        node = self.cluster.add_node(num_cpus=self.cpus)
        if wait:
            self.cluster.wait_for_nodes()
        metadata = FakeMetadataServer().start()
        stop = threading.Event()
        lab_node = LabNode(node, metadata, stop, threading.Thread())

        def log(text: str) -> None:
            lab_node.log.append(text)
            self.note(f"watcher on node {node.node_id[:8]}: {text}")

        drain = node_drainer(self.cluster.address, node.node_id, log)
        watcher = Watcher(metadata.host, drain, log, self.notice_s, self.margin_s, stop, poll_timeout_s=30)
        lab_node.thread = threading.Thread(target=watcher.run, name=f"watcher-{node.node_id[:6]}", daemon=True)
        lab_node.thread.start()
        self.nodes.append(lab_node)
        self._event("node added", lab_node)
        return lab_node

    def _stop_watcher(self, n: LabNode) -> None:
        n.stop.set()
        n.metadata.stop()
        n.thread.join(timeout=10)

    def _event(self, what: str, n: LabNode, **extra: Any) -> None:
        self.events.append({"event": what, "node": n.node_id, "time": time.time(), **extra})
        self.note(f"lab: {what}: node {n.node_id[:8]}")

    # -- chaos ------------------------------------------------------------------------------
    def notice(self, index: int = 0, timeout_s: float = 30.0) -> float:
        """GCE's notice for worker node ``index``; returns the drain deadline the watcher set (UNIX s)."""
        n = self.nodes[index]
        n.metadata.preempt()
        self._event("preemption notice", n)
        end = time.time() + timeout_s
        while time.time() < end:
            deadline_ms = _ray.global_state.get_draining_nodes().get(n.node_id)
            if deadline_ms:
                self._event("node draining", n, deadline=deadline_ms / 1000)
                return deadline_ms / 1000
            time.sleep(0.1)
        raise TimeoutError(f"node {n.node_id[:8]} was not drained within {timeout_s:g}s; watcher log: {n.log}")

    def preempt(self, index: int = 0, before_removal: Callable[[], None] | None = None) -> LabNode:
        """Notice, then the node is removed once the drain deadline has passed; a replacement joins."""
        deadline = self.notice(index)
        if before_removal is not None:
            before_removal()
        time.sleep(max(0.0, deadline - time.time()) + 0.5)
        return self.kill(index, announced=True)

    def kill(self, index: int = 0, announced: bool = False, replace: bool = True) -> LabNode | None:
        """Remove worker node ``index`` (without notice unless ``announced``) and add a
        replacement (unless not ``replace``: the cluster stays smaller)."""
        n = self.nodes.pop(index)
        self._stop_watcher(n)
        self.cluster.remove_node(n.node, allow_graceful=False)
        self._event("node removed" + ("" if announced else " without notice"), n)
        return self.add_node() if replace else None


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
