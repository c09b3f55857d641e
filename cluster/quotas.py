"""What one VM counts against Compute Engine's quotas, read from its ``instances.insert`` body.

A Ray node_config is such a body (Ray adds the name and labels). While the VM
runs it holds, in its region: its vCPUs (the series' own metric, ``N2_CPUS``,
where the region lists one, else ``CPUS``), its GPUs (the model's metric,
``NVIDIA_L4_GPUS``, counting those an A2/A3/G2 type brings), both in their
``PREEMPTIBLE_`` variant for a Spot or preemptible VM where the project was
granted one; one ``IN_USE_ADDRESSES`` per external IPv4 address (an
``accessConfigs`` entry; a node_config without ``networkInterfaces`` gets Ray's
default interface, which has one), and ``INSTANCES``; project-wide,
``GPUS_ALL_REGIONS`` and ``CPUS_ALL_REGIONS``. Its disks hold their size in
``SSD_TOTAL_GB`` (pd-ssd, pd-balanced, pd-extreme) or ``DISKS_TOTAL_GB``
(pd-standard) whether it runs or is stopped: a stopped VM gives back
everything else. Hyperdisk has quotas of its own, not counted here.

Preflight sums this over the head and every worker a file allows; the
rehearsal's local Compute API refuses an insert that would pass a limit.
Source: Google's "Allocation quotas" page (cloud.google.com/compute/resource-usage), 2026.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

from cluster import machines
from launcher.errors import UserError

PROJECT_WIDE = "_ALL_REGIONS"  # how project-wide metrics end
SSD_DISKS = ("pd-ssd", "pd-balanced", "pd-extreme")
DISK_METRICS = ("SSD_TOTAL_GB", "DISKS_TOTAL_GB")  # held by a stopped VM too
# What a region always lists; a metric here that a region does not list is not checked.
OPTIONAL = (*DISK_METRICS, "IN_USE_ADDRESSES", "INSTANCES")


def metric(specific: str, general: str | None, preemptible: bool, quotas: Mapping[str, float]) -> str:
    """The metric a resource draws on: ``specific`` where the region lists it (or no ``general`` exists),
    and for Spot/preemptible VMs its ``PREEMPTIBLE_`` variant where the project has a limit above 0."""
    base = specific if specific in quotas or general is None else general
    if preemptible:
        for candidate in (f"PREEMPTIBLE_{base}", f"PREEMPTIBLE_{general}" if general else None):
            if candidate and quotas.get(candidate, 0) > 0:
                return candidate
    return base


def is_preemptible(node: Mapping) -> bool:
    scheduling = node.get("scheduling")
    if isinstance(scheduling, list):  # Ray's examples' shape: read it as one mapping
        scheduling = {k: v for item in scheduling if isinstance(item, Mapping) for k, v in item.items()}
    scheduling = scheduling if isinstance(scheduling, Mapping) else {}
    return bool(scheduling.get("preemptible")) or scheduling.get("provisioningModel") == "SPOT"


def gpus(node: Mapping) -> tuple[str | None, int]:
    """The GPU model and count of a VM: guestAccelerators, or the ones its machine type brings."""
    machine = _last(node.get("machineType", ""))
    for acc in node.get("guestAccelerators") or []:
        if isinstance(acc, Mapping):
            return _last(acc.get("acceleratorType", "")), int(acc.get("acceleratorCount", 1))
    if machines.bundled_accelerator(machine):
        return machines.bundled_accelerator(machine), machines.bundled_gpus(machine)
    return None, 0


def external_addresses(node: Mapping) -> int:
    """External IPv4 addresses a VM gets (Ray's default interface, when it names none, has one)."""
    nics = node.get("networkInterfaces")
    if not isinstance(nics, list):
        return 1
    return sum(len(nic.get("accessConfigs") or []) for nic in nics if isinstance(nic, Mapping))


def vm_usage(node: Mapping, quotas: Mapping[str, float], cpus: int | None = None, running: bool = True) -> Counter:
    """metric -> what one VM holds (``running=False``: a stopped VM, its disks only). ``cpus``: the
    machine type's vCPUs as the zone says (default: from :mod:`cluster.machines`, 0 when it cannot say)."""
    held: Counter = Counter()
    for disk in node.get("disks") or []:
        init = (disk.get("initializeParams") or {}) if isinstance(disk, Mapping) else {}
        size = float(init.get("diskSizeGb") or disk.get("diskSizeGb") or 10)
        kind = _last(init.get("diskType") or disk.get("diskType") or "pd-standard")
        if kind in SSD_DISKS:
            held["SSD_TOTAL_GB"] += size
        elif kind == "pd-standard":
            held["DISKS_TOTAL_GB"] += size
    if not running:
        return held
    machine, spot = _last(node.get("machineType", "")), is_preemptible(node)
    if cpus is None:
        try:
            cpus = machines.machine_vcpus(machine)
        except UserError:  # a shared-core type (e2-micro): not counted
            cpus = 0
    if cpus:
        held[metric(f"{machines.machine_series(machine).upper()}_CPUS", "CPUS", spot, quotas)] += cpus
        held["CPUS" + PROJECT_WIDE] += cpus
    model, count = gpus(node)
    if count and model in machines.ACCELERATORS:
        held[metric(machines.ACCELERATORS[model].quota, None, spot, quotas)] += count
        held["GPUS" + PROJECT_WIDE] += count
    held["IN_USE_ADDRESSES"] += external_addresses(node)
    held["INSTANCES"] += 1
    return held


def project_wide(name: str) -> bool:
    return name.endswith(PROJECT_WIDE)


def _last(url) -> str:
    return str(url).rstrip("/").rsplit("/", 1)[-1]
