"""Replica groups for ``--strategy ft``: each Ray Train worker is a torchft replica group of its own.

Ray Train's controller, told that its backend has replica groups (``has_replica_groups``),
replaces a failed worker alone, in the same placement-group slot, while the others keep
their processes (Ray's own ``TorchftConfig`` does the same, but its module imports torch into
the driver and the controller). Who trains each step is torchft's business: a lighthouse on
the controller's node (the head) forms a quorum of the replicas that ask for one, and a
replica whose manager falls silent for :data:`HEARTBEAT_TIMEOUT_MS` is left out of the next.

The lighthouse runs in a Ray actor the backend starts once per run (the actor also holds
the start-up gathering and the end of the run, see :class:`Lighthouse`); each worker is told
its address and handle before its training function starts (:func:`lighthouse`). The worker
side of the strategy is :mod:`launcher.worker.ft`; its communicator here is one rank of one,
as torchft's replica group of one process is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend

from launcher import _ray
from launcher.backends.base import TorchComm
from launcher.backends.raytrain import TorchWorkers

# A replica whose manager sent no heartbeat for this long is out of the next quorum: what a
# graceful leave costs the others at most (its manager stops heartbeating when it shuts down),
# and, after a collective that failed, how long a lost replica is waited for.
HEARTBEAT_TIMEOUT_MS = 1500
# A live replica that is late to a quorum (writing a step checkpoint, say) is waited for this long
# before a step goes on without it (it then heals from a peer at the next step).
JOIN_TIMEOUT_MS = 10_000
QUORUM_TICK_MS = 50
# A run's first quorum waits this long for every replica to be ready, so it starts with all of
# them rather than with the first one ready (the others would then heal into it, one by one).
GATHER_TIMEOUT_S = 300.0


@ray.remote(num_cpus=0)
class Lighthouse:
    """torchft's lighthouse server, and what the run's replicas agree on outside a step: when the
    first replicas all start together (:meth:`gather`), and that training is over (:meth:`finish`,
    so that a replica that starts after the others are done does not train on alone)."""

    def __init__(self, min_replicas: int) -> None:
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
                                       quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        self.arrived: set[int] = set()
        self.open = asyncio.Event()
        self.done = False

    def address(self) -> str:
        """The server's address by this node's IP (its own names the host, which other nodes may not resolve)."""
        port = self.server.address().rsplit(":", 1)[1]
        return f"http://{ray.util.get_node_ip_address()}:{port}"

    async def gather(self, replica: int, replicas: int) -> None:
        """Return once every one of ``replicas`` has called (or :data:`GATHER_TIMEOUT_S` passed);
        at once for a replica that comes later (a replacement)."""
        self.arrived.add(replica)
        if len(self.arrived) >= replicas:
            self.open.set()
        try:
            await asyncio.wait_for(self.open.wait(), GATHER_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.open.set()

    def finish(self) -> None:
        self.done = True

    def finished(self) -> bool:
        return self.done


_HERE: dict[str, Any] = {}  # on a worker: the run's lighthouse, set by the backend before training starts


def _set_lighthouse(address: str, actor) -> None:
    _HERE.update(address=address, actor=actor)


def lighthouse() -> tuple[str, Any]:
    """On a worker: (the lighthouse's address, the :class:`Lighthouse` actor)."""
    return _HERE["address"], _HERE["actor"]


class _ReplicaGroupsBackend(Backend):
    """Starts the lighthouse with the first group and tells every worker (a replacement too) where it is."""

    has_replica_groups = True  # read by Ray Train's controller: replace a failed replica group alone

    def __init__(self) -> None:
        self.actor = None
        self.address = ""

    def on_start(self, worker_group, backend_config: "ReplicaGroups") -> None:
        if self.actor is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # On the controller's node (the driver's: the head), which outlives preempted workers.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.actor = Lighthouse.options(scheduling_strategy=here).remote(backend_config.min_replicas)
            self.address = ray.get(self.actor.address.remote())
        worker_group.execute(_set_lighthouse, self.address, self.actor)


class NodeMates(_ray.WorkerGroupCallback):
    """In Ray Train's controller: the replica groups of a lost node are replaced together.

    Ray Train 2.60 replaces failed replica groups one at a time, and before each replacement
    clears the results of every other active group: a group that died too (a node-mate) breaks
    that call, and the run ended with a controller error (seen in the lab: two replicas on a
    preempted node, whether or not the poll had shown the second one failed yet). So a poll
    that shows a failed worker marks its node-mates failed too, and when several groups are
    failing they are shut down here, before the controller replaces them (it replaces a shut
    down group as it does one that failed to start). A live node-mate of a worker whose own
    code failed is replaced as well (healed from a peer like any replacement)."""

    def __init__(self) -> None:
        self.group = None

    def after_worker_group_start(self, worker_group) -> None:
        self.group = worker_group

    def before_worker_group_shutdown(self, worker_group) -> None:
        self.group = None

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        failed = worker_group_status.errors
        if not failed or self.group is None:
            return
        nodes = [w.metadata.node_id for w in self.group.get_workers()]
        lost = {nodes[rank] for rank in failed if rank < len(nodes)}
        for rank, status in worker_group_status.worker_statuses.items():
            if status.error is None and rank < len(nodes) and nodes[rank] in lost:
                status.error = RuntimeError(f"rank {rank} is on the node of a failed rank ({nodes[rank]}): "
                                            "replaced with it")
        failing = worker_group_status.failing_replica_group_indices
        if len(failing) > 1 and failing != worker_group_status.all_replica_group_indices:
            groups = self.group.get_replica_groups()
            for index in sorted(failing):
                groups[index].shutdown()


@dataclass
class ReplicaGroups(TorchWorkers):
    """The Ray Train backend config of an ``ft`` run: no process group across workers (torchft
    forms one per quorum), a lighthouse, and replica groups of one worker."""

    min_replicas: int = 1

    @property
    def backend_cls(self):
        return _ReplicaGroupsBackend

    def callbacks(self) -> list:
        """What Ray Train's controller runs for this backend (see :class:`NodeMates`)."""
        return [NodeMates()]


class ReplicaComm(TorchComm):
    """A worker's communicator inside its own replica group: one rank of one. The session's sums
    over ranks are this replica's own; what crosses replicas goes through torchft's manager."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def device(self):
        import ray.train.torch

        return ray.train.torch.get_device()

    def allreduce_sum(self, tensor):
        return tensor
