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


@dataclass
class ReplicaGroups(TorchWorkers):
    """The Ray Train backend config of an ``ft`` run: no process group across workers (torchft
    forms one per quorum), a lighthouse, and replica groups of one worker."""

    min_replicas: int = 1

    @property
    def backend_cls(self):
        return _ReplicaGroupsBackend


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
