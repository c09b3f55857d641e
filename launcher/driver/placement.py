"""Machine types on a cluster: the nodes the ranks must run on, and the check that the cluster has them.

A spec's ``machine_type`` (the workers') and ``primary_machine_type`` (rank
0's) name Compute Engine machine types (:mod:`cluster.machines`). On a Ray
cluster they become a Ray Train label selector on the nodes' labels
``launcher/machine-type`` and ``launcher/accelerator``, which the cluster
files of ``launcher cluster config`` give every node. Ray Train gives bundle
*i* of its placement group the *i*-th selector of a list, and hands out world
ranks node by node starting with bundle 0's node, so rank 0 runs on a node
of the first selector's type (ray/train/v2/_internal/execution/worker_group/
worker_group.py: ``_create_placement_group``, ``_assign_worker_ranks``).

Before any worker starts, a machine type that no node of the cluster has
(alive, or a node type of the cluster file the autoscaler can start) is
refused; a local Ray the launcher runs has one kind of machine, so there the
machine types are only noted.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

from cluster import machine_types
from cluster.machine_types import MachineType
from launcher import schema
from launcher.errors import UserError

# The cluster file `ray up` leaves on the head (Ray Tune reads it there too): its node types,
# autoscaled ones included, are machine types the cluster can have without a node up now.
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"


def on_cluster(address: str | None) -> bool:
    """Whether a launch with this ``--address`` runs on a Ray cluster: an address (or
    RAY_ADDRESS), not a local Ray the launcher starts or its warm head."""
    return bool(address or os.environ.get("RAY_ADDRESS"))


def wanted(spec) -> tuple[MachineType | None, MachineType | None]:
    """(rank 0's machine type, the other ranks') of a validated spec; None: any node."""
    worker = machine_types.parse(spec.machine_type) if spec.machine_type else None
    primary = machine_types.parse(spec.primary_machine_type) if spec.primary_machine_type else worker
    return primary, worker


def label_selector(spec) -> dict[str, str] | list[dict[str, str]] | None:
    """Ray Train's ``ScalingConfig.label_selector`` for the spec's machine types on a cluster:
    one selector for every worker, or a list (one per worker, as long as ``spec.workers``)
    whose first entry is rank 0's. None when no machine type is set or the Ray is local."""
    primary, worker = wanted(spec)
    if primary is None or not on_cluster(spec.address):
        return None
    if primary == worker:
        return primary.labels
    return [primary.labels] + [worker.labels if worker else {} for _ in range(spec.workers - 1)]


def describe(spec) -> str:
    """'n1-standard-4 (primary) / n1-standard-8', as a note names them."""
    primary, worker = wanted(spec)
    if primary is None or primary == worker:
        return str(worker)
    return f"{primary} (primary)" + (f" / {worker}" if worker else "")


def check(spec, node_labels: Iterable[Mapping[str, str]], note: Callable[[str], None],
          config_path: str = BOOTSTRAP_CONFIG) -> None:
    """Before any worker starts: on a cluster, UserError for a machine type it has no node of
    (``node_labels``: the alive nodes' labels; the cluster file at ``config_path``, where there
    is one, adds its node types); on a local Ray, one line through ``note``."""
    primary, worker = wanted(spec)
    if primary is None:
        return
    types = "machine types" if worker and primary != worker else "machine type"
    if not on_cluster(spec.address):
        note(f"{types} {describe(spec)} noted: a local run places all ranks on this machine")
        return
    have = cluster_machine_types(node_labels, config_path)
    others = worker if spec.workers > 1 else None  # one worker is rank 0 alone
    for flag, asked in (("--primary-machine-type", primary if primary != worker else None),
                        ("--machine-type", others if primary != worker else worker)):
        if asked is not None and asked not in have:
            raise UserError(f"{flag} {asked}: the Ray cluster has no node of that machine type",
                            _what_it_has(have))


def cluster_machine_types(node_labels: Iterable[Mapping[str, str]], config_path: str = BOOTSTRAP_CONFIG
                          ) -> set[MachineType]:
    """The machine types of the alive nodes (their labels) and of the cluster file's node types."""
    have = {machine_types.from_labels(labels) for labels in node_labels}
    have |= {machine_types.from_labels(node.get("labels") or {}) for node in _file_node_types(config_path)}
    return {m for m in have if m is not None}


def _file_node_types(path: str) -> list[dict[str, Any]]:
    """The node types of a cluster file that can have nodes (none when there is no readable file)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return []
    try:
        config = schema.load_yaml(path, "cluster file")
    except UserError:
        return []  # not ours to judge: the alive nodes still count
    types = config.get("available_node_types") if isinstance(config, dict) else None
    if not isinstance(types, dict):
        return []
    head = config.get("head_node_type")
    return [node for name, node in types.items() if isinstance(node, dict)
            and (name == head or node.get("max_workers", 1) != 0)]


def _what_it_has(have: set[MachineType]) -> str:
    if not have:
        return ("none of its nodes has a launcher/machine-type label (the node types of `launcher cluster config` "
                "files have); drop the machine type, or start Ray with --labels launcher/machine-type=...,"
                "launcher/accelerator=...")
    return f"it has: {', '.join(str(m) for m in sorted(have))}"
