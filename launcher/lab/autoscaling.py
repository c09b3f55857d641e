"""A preemption lab whose replacements come from Ray's own autoscaler, as slowly as on GCE.

:class:`AutoscalingLab` starts a Ray head (no CPUs) whose autoscaler runs over
:class:`launcher.lab.provider.LabProvider`, the way ``ray.cluster_utils.AutoscalingCluster``
starts Ray's fake multi-node cluster, on a port of its own and without stopping any other
Ray on the machine. Its worker node type is the one ``launcher cluster config`` writes
(the name and labels of the worker machine type, ``min_workers`` the lab's size), with
the lab's CPUs per node in place of the VM's. Each worker node the autoscaler brings up
gets a fake GCE metadata server and the real watcher, as a Spot VM gets ``launcher
preemption watch``. :meth:`preempt` gives a node GCE's notice, waits out the drain deadline
and kills the node's processes: the VM is deleted. The lab does not add the replacement:
the autoscaler sees the node gone and asks the provider for one, which is ready
``boot_s`` later (and fails for ``stockout_s`` after each loss, if set).

Timeline: :attr:`events` (what the lab did) and :meth:`provider_events` (what the
autoscaler asked the provider for, and when each node was up).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import psutil

from cluster import config as cluster_config
from cluster.spec import ClusterSpec
from launcher import _ray
from launcher.driver.trainer import INTERRUPTED
from launcher.lab.chaos import LabNode, stop_background_runs
from launcher.lab.gcs_emulator import free_port
from launcher.lab.metadata import FakeMetadataServer
from launcher.preemption.drain import node_drainer
from launcher.preemption.watcher import Watcher
from launcher.settings import LAB_ID as LAB_ENV

# Ray checks each node's health every 3 s and sees it dead after 5 failed checks (~15 s for a
# node lost without notice). ``health_check_s`` shortens that period for a lab whose figures
# are not measured (the tests', as they shorten GCE's 30 s notice); the benchmark and the demo
# keep Ray's.
HEALTH_CHECK_ENV = "RAY_health_check_period_ms"
NODE_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"  # the fake provider's node id, which Ray takes as the node's
HEAD_TYPE = "ray.head.default"


class _NodeRef:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id


class AutoscalingLab:
    def __init__(self, nodes: int = 2, cpus_per_node: float = 1, notice_s: float = 8.0, margin_s: float = 2.0,
                 boot_s: float = 0.0, stockout_s: float = 0.0, spare: int = 1, cluster: ClusterSpec | None = None,
                 note: Callable[[str], None] = lambda text: None, health_check_s: float | None = None) -> None:
        self.size, self.cpus, self.notice_s, self.margin_s = nodes, cpus_per_node, notice_s, margin_s
        self.health_check_s = health_check_s
        self.boot_s, self.stockout_s, self.spare, self.note = boot_s, stockout_s, spare, note
        self.cluster = cluster or ClusterSpec(project="launcher-lab", provisioning="spot").validated()
        self.nodes: list[LabNode] = []
        self.events: list[dict[str, Any]] = []
        self.id = uuid.uuid4().hex[:12]
        # Everything of the lab on disk, Ray's session and its note of the current cluster included
        # (``ray start --temp-dir``): a plain ``ray.init()`` afterwards must not find the lab.
        self._dir = os.path.join(_short_temp_root(), f"launcher-lab-{self.id}")
        os.makedirs(self._dir, mode=0o700)
        self._events_file = os.path.join(self._dir, "provider-events.jsonl")
        self._control_file = os.path.join(self._dir, "control.json")
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._attacher: threading.Thread | None = None
        self.port = 0

    # -- the cluster file's worker type, on this machine ----------------------------------------
    def node_types(self) -> dict[str, Any]:
        """The autoscaler's node types: the generated cluster file's worker type (its name, labels
        and the lab's size as min_workers), with this machine's CPUs per node."""
        machine = cluster_config.machine_type(self.cluster, head=False)
        return {
            HEAD_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0},
            machine.node_type: {"resources": {"CPU": self.cpus}, "labels": machine.labels, "node_config": {},
                                "min_workers": self.size, "max_workers": self.size + self.spare},
        }

    def _config(self, gcs_address: str) -> dict[str, Any]:
        return {
            "cluster_name": f"launcher-lab-{self.id}", "max_workers": self.size + self.spare,
            "provider": {"type": "external", "module": "launcher.lab.provider.LabProvider",
                         "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": gcs_address,
                         "events_file": self._events_file, "control_file": self._control_file},
            "available_node_types": self.node_types(), "head_node_type": HEAD_TYPE, "auth": {},
            # A node above the lab's size (a spare the autoscaler launched) goes once idle for 12 s.
            "upscaling_speed": 1.0, "idle_timeout_minutes": 0.2, "docker": {}, "initialization_commands": [],
            "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
            "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
            "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
            "rsync_filter": [],
        }

    def set_delays(self, boot_s: float, stockout_s: float) -> None:
        """What the provider applies from its next node on (the first nodes boot at once)."""
        with open(self._control_file + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"boot_s": boot_s, "stockout_s": stockout_s}, f)
        os.replace(self._control_file + ".tmp", self._control_file)

    # -- life -------------------------------------------------------------------------------------
    def __enter__(self) -> "AutoscalingLab":
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.set_delays(0.0, 0.0)
        self.port = free_port()
        ip = _ray.node_ip_address()
        path = os.path.join(self._dir, "cluster.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self._config(f"{ip}:{self.port}"), f)
        # The lab's own cluster, on this machine only: Ray's token auth off (a `ray start` here would
        # otherwise take a token from ~/.ray that the fake provider's nodes do not send).
        env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", LAB_ENV: self.id,
               "RAY_AUTH_MODE": "disabled"}
        if self.health_check_s is not None:
            env[HEALTH_CHECK_ENV] = str(int(self.health_check_s * 1000))
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        try:
            subprocess.run([ray_cli, "start", "--head", f"--port={self.port}", "--num-cpus=0",
                            f"--autoscaling-config={path}", "--include-dashboard=false", "--disable-usage-stats",
                            f"--temp-dir={self._dir}"],
                           env=env, check=True, capture_output=True, text=True, timeout=120)
            self.note(f"lab: Ray head at {self.address}, its files in {self._dir} (removed when the lab stops)")
            ray.init(address=f"{ip}:{self.port}", log_to_driver=False, logging_level="ERROR")
            self._stop.clear()
            self._attacher = threading.Thread(target=self._attach_loop, name="lab-attach", daemon=True)
            self._attacher.start()
            self.wait_for_nodes(self.size, timeout_s=120)
        except BaseException:
            self.__exit__()
            raise
        self.set_delays(self.boot_s, self.stockout_s)
        return self

    def __exit__(self, *exc) -> None:
        """Stop every process of the lab and remove its files, a Ctrl-C meanwhile included (it
        is honoured once the lab is gone)."""
        import ray

        with _interrupts_held() as interrupted:
            self._stop.set()
            if self._attacher is not None:
                self._attacher.join(timeout=5)
            for n in list(self.nodes):
                self._stop_watcher(n)
            if stop_background_runs(INTERRUPTED):
                self.note("lab: stopped the run that was still going before shutting the cluster down")
            ray.shutdown()
            _kill(lambda env: env.get(LAB_ENV) == self.id)
            shutil.rmtree(self._dir, ignore_errors=True)
        if interrupted():
            raise KeyboardInterrupt

    @property
    def address(self) -> str:
        return f"{_ray.node_ip_address()}:{self.port}"

    # -- nodes ------------------------------------------------------------------------------------
    def _attach_loop(self) -> None:
        """Give every worker node that comes up a metadata server and a watcher."""
        import ray

        head = _ray.FAKE_HEAD_NODE_ID
        while not self._stop.wait(0.5):
            try:
                alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head]
            except Exception:  # noqa: BLE001 - the cluster is going away
                continue
            for node_id in alive:
                if node_id not in self._seen:
                    self._seen.add(node_id)
                    self._attach(node_id)

    def _attach(self, node_id: str) -> None:
        metadata = FakeMetadataServer().start()
        stop = threading.Event()
        lab_node = LabNode(_NodeRef(node_id), metadata, stop, threading.Thread(), name=self._name(node_id))

        def log(text: str) -> None:
            lab_node.log.append(text)
            self.note(f"watcher on {lab_node.name}: {text}")

        drain = node_drainer(self.address, node_id, log)
        watcher = Watcher(metadata.host, drain, log, self.notice_s, self.margin_s, stop, poll_timeout_s=30)
        lab_node.thread = threading.Thread(target=watcher.run, name=f"watcher-{node_id[:6]}", daemon=True)
        lab_node.thread.start()
        with self._lock:
            self.nodes.append(lab_node)
        self._event("node added", lab_node)

    def _name(self, node_id: str) -> str:
        """'worker N': the provider numbers its nodes in the order it starts them (the last digits
        of their fake ids), so a replacement has a new number; any other id, by arrival."""
        tail = node_id.lstrip("f")
        return f"worker {int(tail)}" if tail.isdigit() else f"worker {len(self._seen)}"

    def wait_for_nodes(self, count: int, timeout_s: float = 300) -> None:
        end = time.time() + timeout_s
        while time.time() < end:
            with self._lock:
                if len(self.nodes) >= count:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the lab's autoscaler brought {len(self.nodes)} of {count} worker nodes within "
                           f"{timeout_s:g}s; provider log: {self.provider_events()[-5:]}")

    def _stop_watcher(self, n: LabNode) -> None:
        n.stop.set()
        n.metadata.stop()
        n.thread.join(timeout=10)

    def _event(self, what: str, n: LabNode, **extra: Any) -> None:
        self.events.append({"event": what, "node": n.node_id, "time": time.time(), **extra})
        self.note(f"lab: {what}: {n.label}")

    def provider_events(self) -> list[dict[str, Any]]:
        """What the autoscaler asked the provider for, and when (see launcher.lab.provider)."""
        try:
            with open(self._events_file, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    # -- chaos --------------------------------------------------------------------------------------
    def busy_first(self) -> None:
        """Order :attr:`nodes` so that those running work come first (in the order they joined):
        ``preempt(0)`` then hits a node of the run, not a spare the autoscaler brought for an
        early replacement request that is still idle."""
        try:
            free = _ray.global_state.available_resources_per_node()
        except Exception:  # noqa: BLE001 - keep the order as it is
            return
        with self._lock:
            self.nodes.sort(key=lambda n: free.get(n.node_id, {}).get("CPU", 0) >= self.cpus)

    def notice(self, index: int = 0, timeout_s: float = 30.0) -> float:
        """GCE's notice for worker node ``index`` (busy nodes first); returns the drain deadline the
        watcher set (UNIX s)."""
        self.busy_first()
        n = self.nodes[index]
        noticed = time.time()
        n.metadata.preempt()
        self._event("preemption notice", n)
        end = noticed + timeout_s
        while time.time() < end:
            deadline_ms = _ray.global_state.get_draining_nodes().get(n.node_id)
            if deadline_ms:
                self._event("node draining", n, deadline=deadline_ms / 1000)
                return deadline_ms / 1000
            if any(line.startswith("drained Ray node") for line in n.log):
                # Drained, and already gone from the draining list: an idle node leaves at once.
                deadline = noticed + self.notice_s - self.margin_s
                self._event("node draining", n, deadline=deadline)
                return deadline
            time.sleep(0.1)
        raise TimeoutError(f"{n.label} was not drained within {timeout_s:g}s; watcher log: {n.log}")

    def preempt(self, index: int = 0, before_removal: Callable[[], None] | None = None) -> LabNode:
        """Notice, then the node is deleted once the drain deadline has passed; the autoscaler
        brings its replacement."""
        deadline = self.notice(index)
        if before_removal is not None:
            before_removal()
        time.sleep(max(0.0, deadline - time.time()) + 0.5)
        return self.kill(index, announced=True)

    def kill(self, index: int = 0, announced: bool = False) -> LabNode:
        """Delete worker node ``index`` (busy nodes first; without notice unless ``announced``):
        its processes are killed, and the autoscaler sees the VM gone."""
        if not announced:
            self.busy_first()
        with self._lock:
            n = self.nodes.pop(index)
        self._stop_watcher(n)
        _kill(lambda env: env.get(NODE_ENV) == n.node_id and env.get(LAB_ENV) == self.id)
        self._event("node removed" + ("" if announced else " without notice"), n)
        return n


def _short_temp_root() -> str:
    """Where the lab keeps its files: the temp folder, or /tmp where that path is long. Ray's
    sockets live under the session folder, and a Unix socket's path may not pass 107 bytes
    (macOS's temp folder is about 50; Ray itself defaults to /tmp/ray for that reason)."""
    root = tempfile.gettempdir()
    return root if len(root) <= 20 or not os.path.isdir("/tmp") else "/tmp"


@contextlib.contextmanager
def _interrupts_held() -> Iterator[Callable[[], bool]]:
    """Meanwhile a Ctrl-C is noted instead of raised (in the main thread), so a second Ctrl-C
    does not cut the clean-up short; the caller raises it afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    seen = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: seen.set())
    try:
        yield seen.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def _kill(match: Callable[[dict[str, str]], bool]) -> int:
    """SIGKILL every process of this user whose environment ``match``es; returns how many.

    They are all stopped (SIGSTOP) before any is killed, as a deleted VM's processes vanish
    together: killed one by one, a node's agent saw its raylet die first and published Ray's
    "Raylet is terminated. Termination is unexpected" with 20 lines of log to the demo's output."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if match(proc.environ()):
                proc.send_signal(signal.SIGSTOP)
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    for proc in found:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            proc.send_signal(signal.SIGKILL)
    return len(found)
