"""Issue 62: worker setup failures are bounded (cluster.setup_guard, `launcher cluster setup-guard`).

Ray's own instance manager (the v2 autoscaler's, which `ray up` runs) makes the log lines: instances are
driven through Ray's status transitions and Ray logs each, with the monitor's format, into a Ray session's
``logs/monitor.log`` laid out as on a head. The guard caps the node type in a bootstrap file as Ray writes
it (JSON), and Ray's own AutoscalingConfig reads the capped file. No Ray cluster starts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
from ray.autoscaler.v2.instance_manager.instance_manager import InstanceManager
from ray.autoscaler.v2.instance_manager.instance_storage import InstanceStorage
from ray.autoscaler.v2.instance_manager.storage import InMemoryStorage
from ray.core.generated.instance_manager_pb2 import Instance, InstanceUpdateEvent, UpdateInstanceManagerStateRequest

from cluster.config import ray_cluster_config
from cluster.setup_guard import SetupGuard, session_log
from cluster.spec import ClusterSpec

GPU = "n1-standard-8-t4x1"
MONITOR_FORMAT = "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"  # the monitor's


class Autoscaler:
    """Ray's InstanceManager, logging into ``log`` as the head's monitor does."""

    def __init__(self, log: str) -> None:
        self.manager = InstanceManager(InstanceStorage("demo", InMemoryStorage()), [])
        self.version = 0
        self.handler = logging.FileHandler(log)
        self.handler.setFormatter(logging.Formatter(MONITOR_FORMAT))
        self.logger = logging.getLogger("ray.autoscaler.v2.instance_manager.instance_manager")
        self.logger.addHandler(self.handler)
        self.level, self.logger.level = self.logger.level, logging.INFO

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.handler.close()

    def _update(self, instance: str, status, **fields) -> None:
        reply = self.manager.update_instance_manager_state(UpdateInstanceManagerStateRequest(
            expected_version=self.version, updates=[InstanceUpdateEvent(instance_id=instance,
                                                                        new_instance_status=status, **fields)]))
        assert reply.version > self.version, reply  # Ray refused the transition
        self.version = reply.version

    def launch(self, instance: str, kind: str, setup_ok: bool) -> None:
        """One worker VM, from the scheduler's request to Ray running on it, or to its failed setup."""
        self._update(instance, Instance.QUEUED, upsert=True, instance_type=kind,
                     details=f"queuing new instance of {kind} from scheduler")
        self._update(instance, Instance.REQUESTED, launch_request_id=f"launch-{instance}", instance_type=kind)
        self._update(instance, Instance.ALLOCATED, cloud_instance_id=f"ray-demo-worker-{instance}-compute",
                     node_kind=2, instance_type=kind)
        self._update(instance, Instance.RAY_INSTALLING)
        if setup_ok:
            self._update(instance, Instance.RAY_RUNNING, ray_node_id=f"node-{instance}")
        else:
            self._update(instance, Instance.RAY_INSTALL_FAILED,
                         details="failed to install ray with errors: Ray installation failed with unexpected "
                                 "status: update-failed")


@pytest.fixture()
def head_node(tmp_path):
    """A head's Ray session folder (RAY_TMPDIR=tmp_path) and its bootstrap file, as `ray up` writes it."""
    session = tmp_path / "ray" / "session_2026-11-28_00-00-00_1"
    (session / "logs").mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(session)
    spec = ClusterSpec.from_mapping({"project": "p", "source_dir": "/src", "cluster_name": "demo",
                                     "accelerator_type": "nvidia-tesla-t4", "min_workers": 2,
                                     "max_workers": 4}).validated()
    config = tmp_path / "ray_bootstrap_config.yaml"
    config.write_text(json.dumps(ray_cluster_config(spec, "0.1.0")))
    autoscaler = Autoscaler(str(session / "logs" / "monitor.log"))
    yield tmp_path, config, autoscaler
    autoscaler.close()


def test_the_head_stops_launching_a_type_whose_setups_keep_failing(head_node):
    tmp_path, config, autoscaler = head_node
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    guard = subprocess.Popen([sys.executable, "-m", "launcher", "cluster", "setup-guard", "--max-failures", "3",
                              "--config", str(config)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        autoscaler.launch("w1", GPU, setup_ok=True)
        for n in range(2, 5):  # w2, w3, w4: Ray replaced each failed one with a new VM
            autoscaler.launch(f"w{n}", GPU, setup_ok=False)
        deadline = time.time() + 60
        while json.loads(config.read_text())["available_node_types"][GPU]["max_workers"] != 1:
            assert time.time() < deadline and guard.poll() is None, "the guard did not cap the node type"
            time.sleep(0.2)
        # Ray restarts on the head (the next `ray up`): a new session, and this guard ends
        new = tmp_path / "ray" / "session_2026-11-28_01-00-00_2"
        new.mkdir()
        (tmp_path / "ray" / "session_latest").unlink()
        (tmp_path / "ray" / "session_latest").symlink_to(new)
        out, _ = guard.communicate(timeout=60)
    finally:
        guard.kill()
    assert guard.returncode == 0, out
    capped = json.loads(config.read_text())["available_node_types"][GPU]
    assert (capped["min_workers"], capped["max_workers"]) == (1, 1)  # w1 keeps running
    # Ray reads the capped file as the head's autoscaler does (FileConfigReader): no more of that type
    read = AutoscalingConfig(json.loads(config.read_text()), skip_content_hash=True)
    [node_type] = [t for name, t in read.get_node_type_configs().items() if name == GPU]
    assert (node_type.min_worker_nodes, node_type.max_worker_nodes) == (1, 1)
    lines = out.strip().splitlines()
    assert lines[0].startswith("launcher setup-guard: following ") and lines[0].endswith(
        "session_2026-11-28_00-00-00_1/logs/monitor.log; a node type is capped after 3 failed setups in a row")
    assert lines[1:] == [
        f"launcher setup-guard: the setup of 3 {GPU} VMs in a row failed (ray-demo-worker-w2-compute, "
        "ray-demo-worker-w3-compute, ray-demo-worker-w4-compute; the last: failed to install ray with errors: Ray "
        "installation failed with unexpected status: update-failed); Ray would go on replacing each with a new billed "
        f"VM, so the head launches no more of them (max_workers 4 -> 1 in {config}). Fix the setup commands, then "
        "`launcher cluster up` again (or `launcher cluster down`)."]


def test_a_setup_that_succeeds_in_between_starts_the_count_again(head_node):
    tmp_path, config, autoscaler = head_node
    for name, ok in (("w1", False), ("w2", False), ("w3", True), ("w4", False), ("w5", False)):
        autoscaler.launch(name, GPU, setup_ok=ok)
    said: list[str] = []
    guard = SetupGuard(str(config), limit=3, say=said.append)
    with open(session_log(str(tmp_path))) as f:
        for line in f:
            guard.feed(line)
    assert guard.failed == {GPU: ["ray-demo-worker-w4-compute", "ray-demo-worker-w5-compute"]} and said == []
    assert json.loads(config.read_text())["available_node_types"][GPU]["max_workers"] == 4
    autoscaler.launch("w6", GPU, setup_ok=False)
    with open(session_log(str(tmp_path))) as f:
        for line in f.readlines()[-6:]:  # the new VM's lines
            guard.feed(line)
    assert len(said) == 1 and "the setup of 3 " in said[0]
    assert json.loads(config.read_text())["available_node_types"][GPU]["max_workers"] == 1  # w3 is up


def test_the_cluster_file_starts_the_guard_on_the_head_only_where_there_are_workers():
    def start(**values) -> list[str]:
        spec = ClusterSpec.from_mapping({"project": "p", "source_dir": "/src", **values}).validated()
        return ray_cluster_config(spec, "0.1.0")["head_start_ray_commands"]

    assert start()[-1] == ("nohup launcher cluster setup-guard --max-failures 3 < /dev/null "
                           ">> ~/launcher-setup-guard.log 2>&1 &")
    assert start(max_setup_failures=5)[-1].startswith("nohup launcher cluster setup-guard --max-failures 5 ")
    assert not [c for c in start(max_setup_failures=0) + start(preset="basic") if "setup-guard" in c]
