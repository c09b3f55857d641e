"""Asking for a preempted node's replacement as its notice comes, not once it is gone.

On Compute Engine a Spot VM's replacement is a new VM: Ray's autoscaler creates it, it
boots, runs the cluster file's set-up and ``ray start``, minutes for a GPU VM. Left alone,
the autoscaler starts on it only once the preempted node has left the cluster (the group's
demand is met by the draining node until then). :class:`Replacements` asks for one node's
worth of the group's resources per preempted rank as soon as the controller reports the
notice, so the new VM boots while the old one drains (GCE's 30 s notice, and the
checkpoint it allows). The request goes through the autoscaling coordinator that Ray
Train's own requests use (they add up there; a direct ``request_resources`` call would be
overwritten on the coordinator's next round), and it is withdrawn once the worker group
has restarted (the preempted node is gone: Ray Train's own request for the full group then
keeps the replacement coming) or the run ends. On a local Ray there is no autoscaler, and
nothing is asked.
"""

from __future__ import annotations

import logging
from typing import Callable

from launcher import _ray

EXPIRE_S = 900.0  # the coordinator forgets a request it is not told about again for this long

log = logging.getLogger(__name__)


class Replacements:
    def __init__(self, spec, enabled: bool, note: Callable[[str], None]) -> None:
        self.spec, self.enabled, self.note = spec, enabled, note
        self.asked = 0          # nodes' worth asked for and not yet withdrawn
        self._client = None

    def _coordinator(self):
        if self._client is None:
            self._client = _ray.DefaultAutoscalingCoordinator(f"launcher-replacement-{self.spec.name}")
        return self._client

    def on_notice(self, ranks: list[int]) -> None:
        """Ask for a replacement for each preempted rank's share of the group."""
        if not self.enabled or not ranks:
            return
        bundle = {"CPU": float(self.spec.cpus_per_worker)}
        if self.spec.gpus_per_worker:
            bundle["GPU"] = float(self.spec.gpus_per_worker)
        self.asked += len(ranks)
        try:
            self._coordinator().request_resources(resources=[dict(bundle) for _ in range(self.asked)],
                                                  expire_after_s=EXPIRE_S,
                                                  priority=_ray.ResourceRequestPriority.HIGH)
        except Exception as exc:  # noqa: BLE001 - the run goes on; Ray Train's own request still stands
            log.debug("replacement request failed", exc_info=True)
            self.note(f"could not ask the autoscaler for a replacement early ({type(exc).__name__}); it comes "
                      "once the preempted node is gone")
            return
        self.note(f"asked the autoscaler for {len(ranks)} replacement node(s) now, while the preempted one "
                  "drains")

    def withdraw(self) -> None:
        """The group restarted (or the run ended): Ray Train's own request covers the rest."""
        if self.asked and self._client is not None:
            try:
                self._client.cancel_request()
            except Exception:  # noqa: BLE001 - it expires by itself
                log.debug("withdrawing the replacement request failed", exc_info=True)
        self.asked = 0
