"""Ray Train V2 BackendConfig/Backend pair for Horovod over Gloo.

Ray 2.60 dropped HorovodTrainer from Train V2, and V1's HorovodConfig cannot
drive a V2 worker group (it reads ``worker_group.workers``). This pair is
written against the V2 worker-group API (``get_workers``,
``execute_single_async``). When Ray Train starts a worker group (in its
controller, on the driver's node), :class:`HorovodRayBackend` starts Horovod's
Gloo rendezvous server there and writes each worker's ``HOROVOD_*`` variables
(rank, size, local and cross rank and size from the node each worker really
landed on) into that worker process's ``os.environ``: ``hvd.init()`` in the
worker then joins one ring, and so does a script subprocess the worker starts
(script mode), since it inherits the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ray.train.backend import Backend, BackendConfig


# -- placement: pure ----------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """One worker's place in the Horovod ring (the fields of Horovod's SlotInfo)."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def env(self) -> dict[str, str]:
        return {
            "HOROVOD_HOSTNAME": self.hostname,
            "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def plan_slots(nodes: list[str]) -> list[Slot]:
    """Ring positions for workers whose world rank i runs on node ``nodes[i]``.

    Local rank: the worker's index among the workers on its node, in rank order.
    Cross rank: the index of its node among the nodes that have a worker with
    that local rank (Horovod's "cross" communicator links equal local ranks).
    """
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    local_rank = {r: ranks.index(r) for ranks in by_node.values() for r in ranks}
    cross_members: dict[int, list[int]] = {}
    for rank in range(len(nodes)):  # rank order, so node order follows the first rank on each node
        cross_members.setdefault(local_rank[rank], []).append(rank)
    return [
        Slot(hostname=node, rank=rank, size=len(nodes),
             local_rank=local_rank[rank], local_size=len(by_node[node]),
             cross_rank=cross_members[local_rank[rank]].index(rank),
             cross_size=len(cross_members[local_rank[rank]]))
        for rank, node in enumerate(nodes)
    ]


# -- the Ray Train backend -------------------------------------------------------------

@dataclass
class HorovodConfig(BackendConfig):
    """Horovod settings that the controller applies to every worker.

    Args:
        timeout_s: how long Gloo waits for every rank at the rendezvous.
        fusion_threshold_bytes: Horovod's tensor-fusion buffer (None: its default, 128 MiB).
        extra_env: more variables for every worker (e.g. HOROVOD_LOG_LEVEL).
    """

    timeout_s: int = 300
    fusion_threshold_bytes: int | None = None
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def backend_cls(self):
        return HorovodRayBackend

    def common_env(self, rendezvous_addr: str, rendezvous_port: int) -> dict[str, str]:
        env = {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(self.timeout_s),
        }
        if self.fusion_threshold_bytes is not None:
            env["HOROVOD_FUSION_THRESHOLD"] = str(self.fusion_threshold_bytes)
        env.update(self.extra_env)
        return env


class HorovodRayBackend(Backend):
    """Starts the Gloo rendezvous and gives each worker its HOROVOD_* environment.

    Ray Train V2 calls on_start for every new worker group (also after a
    restart), so a previous rendezvous server is stopped first.
    """

    share_cuda_visible_devices = True

    def __init__(self) -> None:
        self._server = None

    def on_start(self, worker_group, backend_config: HorovodConfig) -> None:
        import ray
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        self._stop_server()
        workers = worker_group.get_workers()  # ordered by world rank
        slots = plan_slots([w.metadata.node_id for w in workers])
        server = RendezvousServer(verbose=0)
        port = server.start()
        server.init([SlotInfo(**dataclasses.asdict(s)) for s in slots])
        self._server = server
        common = backend_config.common_env(ray.util.get_node_ip_address(), port)
        ray.get([worker_group.execute_single_async(rank, apply_worker_env, {**common, **slot.env()})
                 for rank, slot in enumerate(slots)])

    def on_shutdown(self, worker_group, backend_config: HorovodConfig) -> None:
        self._stop_server()

    def _stop_server(self) -> None:
        if self._server is not None:
            try:
                self._server.stop()
            finally:
                self._server = None


def apply_worker_env(env: dict[str, str]) -> dict[str, str]:
    """Runs in each worker: set the ring variables, plus the network interface that
    carries this node's Ray address (a hostname can resolve to 127.0.1.1 on Debian,
    which other machines cannot reach)."""
    import ray

    env = dict(env)
    iface = interface_for(ray.util.get_node_ip_address())
    if iface and "HOROVOD_GLOO_IFACE" not in env:
        env["HOROVOD_GLOO_IFACE"] = iface
    os.environ.update(env)
    return env


def interface_for(ip: str) -> str | None:
    """The name of the local network interface holding ``ip``, if any."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None
