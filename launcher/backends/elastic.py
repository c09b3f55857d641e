"""An elastic worker group that shrinks as soon as a node goes and grows back without losing a step.

Ray Train's elastic policy sizes the group from what its autoscaling coordinator (a detached
actor shared with Ray Data) says is reserved for the run. Two things make that view late on a
cluster whose nodes are preempted, both seen in the preemption lab:

* the coordinator refreshes its list of nodes every 20 s. A group restarted right after a node
  left was still sized for the old cluster; its placement group then waited for the missing
  node, i.e. for the replacement, which on Compute Engine takes minutes. Growing back waited
  up to 20 s too;
* it counts a draining node (one with a preemption notice) as usable, and Ray schedules
  nothing new on a draining node.

:class:`ElasticNow` asks the coordinator to look at the cluster again whenever it needs the
answer, and leaves the draining nodes out. It never shrinks a running group itself: a node
of the group that drains has had its notice, and the preemption path (a checkpoint, then the
restart at the drain deadline, sized by this policy on the nodes that remain) loses no step,
where a resize would stop the group before that checkpoint (seen in the lab).

Growing back means a restart: Ray Train stops the running group and starts a larger one from
the last checkpoint, throwing away the steps since. Where the run's workers take part
(``board``: the driver's :class:`launcher.driver.events.ProgressBoard`, and workers that
check it: the launcher's sessions), the policy first asks them for a checkpoint through the
board; they take it at their next preemption check, say so on the board and wait, and only
then is the group resized, so growing back costs no steps either. A group that does not
answer within :data:`CHECKPOINT_WAIT_S` is resized as Ray Train would have done it.
"""

from __future__ import annotations

import logging
import time

import ray

from launcher import _ray

CHECKPOINT_WAIT_S = 60.0   # how long a larger group waits for the running one's checkpoint
BOARD_POLL_S = 0.5         # how often the policy looks at the board while it waits
COORDINATOR_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


def usable(reserved: dict[str, dict[str, float]], draining: dict[str, int],
           nodes: list[dict] = ()) -> dict[str, dict[str, float]]:
    """The coordinator's reservation less the nodes that are draining (no new work goes there),
    each replaced by an alive node the reservation left out, if there is one (``nodes``: as
    ``ray.nodes()`` lists them). The coordinator reserves a draining node as readily as any
    other: with a replacement already up (an early request, a short boot) it reserved the
    draining node rather than the new one, and the group restarted one worker short (seen)."""
    kept = {node: resources for node, resources in reserved.items() if node not in draining}
    missing = len(reserved) - len(kept)
    for node in nodes:
        if missing <= 0:
            break
        name, resources = node.get("NodeID"), node.get("Resources") or {}
        hosts = resources.get("CPU", 0) > 0 or resources.get("GPU", 0) > 0  # not a head without CPUs
        if node.get("Alive") and hosts and name not in reserved and name not in draining:
            kept[name] = dict(resources)
            missing -= 1
    return kept


class ElasticNow(_ray.ElasticScalingPolicy):
    """Ray Train's elastic policy over a fresh view of the cluster, less its draining nodes, and a
    grow that waits for the running group's checkpoint (see the module docstring)."""

    def __init__(self, scaling_config, board=None) -> None:
        super().__init__(scaling_config)
        self.board = board
        self._grow = None            # a ResizeDecision waiting for the group's checkpoint
        self._grow_asked = 0.0       # when the group was asked for it
        self._board_polled = 0.0

    # -- the cluster as it is now ------------------------------------------------------------
    def _get_reserved_resources(self):  # listed in launcher._ray.OVERRIDDEN
        now = time.monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        reserved = None
        try:
            reserved = ray.get(self._autoscaling_coordinator.get_reserved_resources.remote(
                self._requester_id, recompute=True), timeout=COORDINATOR_TIMEOUT_S)
            draining = _ray.global_state.get_draining_nodes() or {}
            reserved = usable(reserved, draining, ray.nodes() if draining else [])
        except Exception:  # noqa: BLE001 - as Ray's policy: no answer, no resize this round
            log.warning("the autoscaling coordinator did not answer; the group keeps its size", exc_info=True)
            reserved = None
        self._latest_reserved_resources_query_time = time.monotonic()
        self._latest_reserved_resources = reserved
        return reserved

    # -- growing back after the running group's checkpoint -------------------------------------
    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        if self._grow is not None:
            return self._grow_when_saved()
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if not isinstance(decision, _ray.ResizeDecision):
            return decision
        if decision.num_workers < worker_group_state.num_workers:
            # A node of the group is draining: its notice goes through the preemption path (checkpoint,
            # then the restart at the deadline, on the nodes that remain), not a resize that would
            # stop the group before that checkpoint.
            return _ray.NoopDecision()
        if self.board is None:
            return decision
        try:
            asked = ray.get(self.board.ask_checkpoint.remote(decision.num_workers), timeout=COORDINATOR_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - grow as Ray Train would
            log.warning("could not ask the workers for a checkpoint before growing", exc_info=True)
            return decision
        if not asked:  # the running code does not take part: grow as Ray Train would
            return decision
        log.info("room for %d workers: asked the group for a checkpoint before growing",
                 decision.num_workers)
        self._grow, self._grow_asked = decision, time.monotonic()
        return _ray.NoopDecision()

    def _grow_when_saved(self):
        now = time.monotonic()
        if now - self._board_polled < BOARD_POLL_S:
            return _ray.NoopDecision()
        self._board_polled = now
        give_up = now - self._grow_asked >= CHECKPOINT_WAIT_S
        try:
            held = ray.get(self.board.checkpoint_held.remote(give_up), timeout=COORDINATOR_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - treat as not yet
            held = None
        if held is None and not give_up:
            return _ray.NoopDecision()
        decision, self._grow = self._grow, None
        if held is None:
            log.warning("the group did not checkpoint within %.0fs; growing without it", CHECKPOINT_WAIT_S)
        return decision

    def make_decision_for_non_running_worker_group(self):
        if self._grow is not None:  # the group stopped (a failure, a preemption) before it checkpointed
            self._grow = None
            self.board.checkpoint_held.remote(True)  # withdraw the request: the new group must not hold
        return super().make_decision_for_non_running_worker_group()
