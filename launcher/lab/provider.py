"""The autoscaling lab's node provider: Ray's fake multi-node provider, with Compute Engine's delays.

Ray's autoscaler (its monitor process, started by the lab's head) loads this class by
name from the cluster config (``provider: {type: external, module: ...}``). It adds to
:class:`ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider`
what a Spot VM on GCE does and the fake does not:

* a node is ready only ``boot_s`` after the autoscaler asks for it (instance creation,
  boot, the cluster file's set-up commands and ``ray start``); meanwhile the
  autoscaler counts it as pending, as it does a VM being created;
* for ``stockout_s`` after a node is lost, creating one fails, as GCE answers
  ``ZONE_RESOURCE_POOL_EXHAUSTED`` when the zone has no Spot capacity; the autoscaler
  retries on its next round;
* a node whose processes were killed (the lab's preemption: the VM was deleted) drops
  out of the provider's list, so the autoscaler sees it gone and replaces it, as it
  does when ``instances.list`` stops returning a deleted VM.

What it did goes, one JSON line per event with its time, to ``events_file``: the lab
reads it back for its timeline.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from launcher import _ray

RAYLET = "raylet"  # ray_constants.PROCESS_TYPE_RAYLET: a node is gone when its raylet is
STOCKOUT_ERROR = "ZONE_RESOURCE_POOL_EXHAUSTED (the lab's stock-out: no Spot capacity in the zone)"


class LabProvider(_ray.FakeMultiNodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.boot_s = float(provider_config.get("boot_s", 0.0))
        self.stockout_s = float(provider_config.get("stockout_s", 0.0))
        self.events_file = provider_config.get("events_file")
        self.control_file = provider_config.get("control_file")  # the lab may change the delays
        self._stockout_until = 0.0
        self._log_lock = threading.Lock()

    def _event(self, what: str, **extra: Any) -> None:
        if not self.events_file:
            return
        with self._log_lock, open(self.events_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": what, "time": time.time(), **extra}) + "\n")

    def _delays(self) -> None:
        """boot_s and stockout_s as the lab last set them (its first nodes boot at once)."""
        if not self.control_file:
            return
        try:
            with open(self.control_file, encoding="utf-8") as f:
                control = json.load(f)
        except (OSError, ValueError):
            return
        self.boot_s = float(control.get("boot_s", self.boot_s))
        self.stockout_s = float(control.get("stockout_s", self.stockout_s))
        if not self.stockout_s:  # the stock-out is over
            self._stockout_until = 0.0

    def non_terminated_nodes(self, tag_filters):
        with self.lock:
            for node_id, entry in list(self._nodes.items()):
                node = entry.get("node")
                raylets = node.all_processes.get(RAYLET, []) if node is not None else []
                if raylets and all(p.process.poll() is not None for p in raylets):  # the VM was deleted
                    self._delays()
                    self._nodes.pop(node_id)
                    node.kill_all_processes(check_alive=False, allow_graceful=False)
                    self._stockout_until = time.time() + self.stockout_s
                    self._event("instance gone", node=node_id)
        return super().non_terminated_nodes(tag_filters)

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        asked = time.time()
        self._delays()
        if asked < self._stockout_until:
            self._event("create failed", reason="stock-out", until=self._stockout_until)
            time.sleep(min(2.0, self._stockout_until - asked))  # the API call itself takes a moment
            raise RuntimeError(STOCKOUT_ERROR)
        self._event("create", count=count, boot_s=self.boot_s)
        time.sleep(self.boot_s)  # creation, boot, set-up commands, ray start
        with self.lock:
            before = set(self._nodes)
        super().create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
        with self.lock:
            created = sorted(set(self._nodes) - before)
        self._event("node started", nodes=created, asked=asked)
