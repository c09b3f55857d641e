"""Compute Engine's rules for a VM, as the rehearsal's local Compute API applies them.

:func:`check_insert` reads an ``instances.insert`` body the way Compute
Engine does before it creates anything, and returns the first rule the body
breaks as a :class:`Refusal` (its HTTP status, a short rule name and a
message in Compute Engine's words), or None. Every hardware fact comes from
:mod:`cluster.machines`, the table the cluster file and preflight read, so the
rehearsal cannot agree with the cluster file by holding its own copy.

The rules: the zone (one :mod:`cluster.zones` knows), the body's shape
(``scheduling``, ``labels`` and ``metadata`` are objects, ``disks`` and the
like are lists: Ray's GCP examples write ``scheduling`` as a list, which
Compute Engine refuses), the VM name (at most 63 characters, GCE's pattern),
its labels, the machine type (one that exists: predefined sizes and custom
limits from :mod:`cluster.machines`; a series the table does not list
passes), guest accelerators (only on N1, only in the counts and vCPU/memory
shapes Compute Engine offers, never on a type with built-in GPUs),
onHostMaintenance TERMINATE for any VM with a GPU, the Spot/preemptible
scheduling fields, the boot disk type per machine series, gVNIC where a
series needs it, a boot image of the machine's architecture (no x86-64 image on an Arm type:
T2A, C4A, N4A), and quotas (what :mod:`cluster.quotas` says the VM holds: vCPUs,
GPUs, disk gigabytes, external addresses, per region and project-wide).

Like Compute Engine, a Spot or preemptible VM that leaves out
``automaticRestart`` and ``onHostMaintenance`` gets false and TERMINATE
(:func:`stored_scheduling` fills them into the stored instance); only an
explicit ``automaticRestart: true`` or ``MIGRATE`` is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping

from cluster import machines, quotas as quota_rules, zones
from cluster.preflight import scheduling_as_mapping

NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
# The JSON type Compute Engine's Instance resource has for the fields a body may get wrong.
SHAPES = {"scheduling": dict, "labels": dict, "metadata": dict, "disks": list, "guestAccelerators": list,
          "networkInterfaces": list, "serviceAccounts": list}


class ApiError(Exception):
    """An error answer: HTTP status, reason and message, as Google's error body has them."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class Refusal:
    """Why Compute Engine refuses a request: HTTP status, rule name, message."""

    status: int
    rule: str
    message: str
    fix: str = ""  # what to write instead, where the rule knows better than the rehearsal's general advice


def last_part(url: str) -> str:
    """``zones/us-central1-a/machineTypes/n1-standard-8`` -> ``n1-standard-8``."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def check_insert(body: Mapping, zone: str, quotas: Mapping[str, float] | None = None,
                 used: Mapping[str, float] | None = None) -> Refusal | None:
    """The first rule ``body`` (an instances.insert body) breaks in ``zone``, or None.

    ``quotas`` maps a quota metric that holds in the zone's region or project-wide (CPUS,
    NVIDIA_L4_GPUS, GPUS_ALL_REGIONS) to its limit, a metric missing from it has no limit; ``used``
    is what the project holds of each now.
    """
    machine = last_part(str(body.get("machineType", "")))
    for check in (lambda: _zone(zone), lambda: _shape(body), lambda: _name(body), lambda: _labels(body),
                  lambda: _machine_type(machine, body, zone),
                  lambda: _accelerators(machine, body), lambda: _scheduling(machine, body),
                  lambda: _disks(machine, body, zone), lambda: _architecture(machine, body),
                  lambda: _network(machine, body)):
        refusal = check()
        if refusal:
            return refusal
    return _quota(body, zone_region(zone), quotas or {}, used or {})


def zone_region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def node_type_of(body: Mapping) -> str:
    """The Ray node type an insert is for (the label Ray's provider puts on its VMs), or ""."""
    labels = body.get("labels")
    return str(labels.get("ray-user-node-type", "")) if isinstance(labels, Mapping) else ""


def stored_scheduling(body: Mapping) -> dict:
    """The scheduling Compute Engine stores for an accepted insert: what the body says, with the
    defaults it fills in (a Spot/preemptible VM does not restart and is not migrated)."""
    scheduling = dict(_scheduling_of(body))
    preemptible = quota_rules.is_preemptible(body)
    scheduling.setdefault("automaticRestart", not preemptible)
    scheduling.setdefault("onHostMaintenance", "TERMINATE" if preemptible else "MIGRATE")
    return scheduling


def _scheduling_of(body: Mapping) -> Mapping:
    scheduling = body.get("scheduling")
    return scheduling if isinstance(scheduling, Mapping) else {}


def _items(body: Mapping, field: str) -> list[Mapping]:
    """The objects of a list field (none when the body has another shape: :func:`_shape` refuses it)."""
    value = body.get(field)
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _invalid(rule: str, field: str, message: str, fix: str = "") -> Refusal:
    return Refusal(400, rule, f"Invalid value for field 'resource.{field}': {message}", fix)


def _zone(zone: str) -> Refusal | None:
    problem = zones.zone_problem(zone)
    if problem is None:
        return None
    why, near = problem
    return Refusal(400, "zone", f"Invalid value for field 'zone': '{zone}'. Unknown zone.",
                   f"{why}; set provider.availability_zone to {' or '.join(near) or 'a zone Compute Engine has'} "
                   "(launcher cluster config --zone)")


def _shape(body: Mapping) -> Refusal | None:
    """Compute Engine reads the body by its Instance schema: an object where it wants a list, or a
    list where it wants an object (Ray's GCP examples' ``scheduling: [- preemptible: true]``), is refused."""
    for field, kind in SHAPES.items():
        value = body.get(field)
        if value is None or isinstance(value, kind):
            continue
        node = node_type_of(body)
        fix = (f"write scheduling as one mapping: scheduling: {scheduling_as_mapping(value)}"
               if field == "scheduling" else f"write {field} as {_kind(kind())}")
        return _invalid(field, field, f"{_json(value)}. '{field}' is {_kind(kind())}, not {_kind(value)}",
                        f"{fix} in node type {node}'s node_config" if node else fix)
    return None


def _kind(value: object) -> str:
    return {list: "a list", dict: "an object", str: "a string"}.get(type(value), type(value).__name__)


def _json(value: object) -> str:
    text = json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= 80 else text[:77] + "..."


def _name(body: Mapping) -> Refusal | None:
    name = str(body.get("name", ""))
    if len(name) > 63:
        return _invalid("instance name", "name", f"'{name}' is {len(name)} characters; the most is 63")
    if not NAME_RE.match(name):
        return _invalid("instance name", "name", f"'{name}'. Must be a match of regex '{NAME_RE.pattern[1:-1]}' "
                                                 "(lowercase letters, digits and hyphens, a letter first)")
    return None


def _labels(body: Mapping) -> Refusal | None:
    for key, value in (body.get("labels") or {}).items():
        if not (LABEL_RE.match(str(key)) and key and key[0].isalpha()) or not LABEL_RE.match(str(value)):
            return _invalid("label", f"labels.{key}",
                            f"'{value}'. Label keys and values take at most 63 lowercase letters, digits, "
                            "'-' and '_' (a key starts with a letter)")
    return None


def _machine_type(machine: str, body: Mapping, zone: str) -> Refusal | None:
    url = str(body.get("machineType", ""))
    if "/zones/" in "/" + url and f"zones/{zone}/" not in url:
        return _invalid("machine type", "machineType", f"'{url}' names another zone than the request's {zone}")
    problem = machines.machine_type_problem(machine)
    if problem:
        why, near = problem
        return _invalid("machine type", "machineType",
                        f"Machine type with name '{machine}' does not exist in zone '{zone}' ({why})",
                        (f"did you mean {' or '.join(near)}? " if near else "") + "set machineType to a type "
                        "Compute Engine has (launcher cluster config --head-machine-type / --worker-machine-type)")
    return None


def _accelerators(machine: str, body: Mapping) -> Refusal | None:
    guests = body.get("guestAccelerators") or []
    if not guests:
        return None
    if machine in machines.GPU_MACHINES:
        own = machines.GPU_MACHINES[machine]
        return _invalid("built-in GPUs", "guestAccelerators",
                        f"machine type {machine} comes with {own.gpus} x {own.accelerator}; "
                        "accelerator-optimized types take no guestAccelerators")
    for guest in guests:
        refusal = _one_accelerator(machine, last_part(str(guest.get("acceleratorType", ""))),
                                   int(guest.get("acceleratorCount", 0)))
        if refusal:
            return refusal
    return None


def _one_accelerator(machine: str, name: str, count: int) -> Refusal | None:
    acc = machines.ACCELERATORS.get(name)
    if acc is None or acc.retired or acc.bundled:
        why = acc.retired if acc and acc.retired else (
            f"{name} comes only built into {'/'.join(s.upper() for s in acc.series)} machine types"
            if acc else f"Accelerator type '{name}' does not exist")
        return _invalid("accelerator type", "guestAccelerators[0].acceleratorType", why)
    if machines.machine_series(machine) not in acc.series:
        return _invalid("accelerators only on N1", "guestAccelerators",
                        f"{name} attaches only to N1 machine types, not {machine}")
    problem = machines.n1_shape_problem(name, count, machines.machine_vcpus(machine),
                                        machines.machine_memory_gb(machine))
    if problem:
        return _invalid("N1 GPU shape", "guestAccelerators", problem)
    return None


def _scheduling(machine: str, body: Mapping) -> Refusal | None:
    scheduling = _scheduling_of(body)
    model = scheduling.get("provisioningModel", "STANDARD")
    preemptible = quota_rules.is_preemptible(body)
    if model not in ("STANDARD", "SPOT"):
        return _invalid("Spot fields", "scheduling.provisioningModel", f"'{model}' (STANDARD or SPOT)")
    action = scheduling.get("instanceTerminationAction")
    if action is not None and action not in ("STOP", "DELETE"):
        return _invalid("Spot fields", "scheduling.instanceTerminationAction", f"'{action}' (STOP or DELETE)")
    if action is not None and not preemptible and "maxRunDuration" not in scheduling:
        return _invalid("Spot fields", "scheduling.instanceTerminationAction",
                        "is set only for Spot VMs (provisioningModel SPOT) or with maxRunDuration")
    # Left out, Compute Engine sets them itself for Spot/preemptible VMs; said otherwise, it refuses.
    field = "preemptible" if scheduling.get("preemptible") else "provisioningModel"
    said = f"'{str(scheduling.get(field)).lower() if field == 'preemptible' else model}'"
    if preemptible and scheduling.get("automaticRestart", False) is not False:
        return _invalid("Spot fields", f"scheduling.{field}",
                        f"{said}. Scheduling must have preemptible be false when AutomaticRestart is true.")
    if preemptible and scheduling.get("onHostMaintenance", "TERMINATE") != "TERMINATE":
        return _invalid("Spot fields", f"scheduling.{field}",
                        f"{said}. Scheduling must have preemptible be false when OnHostMaintenance isn't TERMINATE.")
    gpu = machines.GPU_MACHINES.get(machine)
    if gpu and gpu.spot_only and not preemptible:
        return _invalid("Spot only", "scheduling.provisioningModel",
                        f"{machine} is offered only as a Spot VM (provisioningModel SPOT)")
    if quota_rules.gpus(body)[1] and stored_scheduling(body)["onHostMaintenance"] != "TERMINATE":
        return _invalid("TERMINATE for GPUs", "scheduling.onHostMaintenance",
                        "Instances with guest accelerators do not support live migration: "
                        "set onHostMaintenance TERMINATE")
    return None


def _disks(machine: str, body: Mapping, zone: str) -> Refusal | None:
    allowed = machines.disk_types(machine)
    for i, disk in enumerate(body.get("disks") or []):
        url = str((disk.get("initializeParams") or {}).get("diskType") or "pd-standard")
        if "/zones/" in "/" + url and f"zones/{zone}/" not in url:
            return _invalid("disk type", f"disks[{i}].initializeParams.diskType",
                            f"'{url}' names another zone than the request's {zone}")
        kind = last_part(url)
        if kind not in allowed:
            return _invalid("disk type", f"disks[{i}].initializeParams.diskType",
                            f"[{kind}] disk type cannot be used by [{machine}] machine type "
                            f"(it takes {', '.join(allowed)})")
    return None


def _architecture(machine: str, body: Mapping) -> Refusal | None:
    """An x86-64 image on an Arm machine type (T2A, C4A), or the reverse: the boot disk cannot boot."""
    for disk in _items(body, "disks"):
        image = str((disk.get("initializeParams") or {}).get("sourceImage") or "")
        if disk.get("boot") and image and machines.architecture_problem(machine, image):
            boot, arch = machines.image_architecture(image), machines.machine_architecture(machine)
            return Refusal(400, "architecture", f"Invalid resource usage: 'Requested boot disk architecture ({boot}) "
                           f"is not compatible with machine type architecture ({arch}).'",
                           machines.architecture_fix(machine, image))
    return None


def _network(machine: str, body: Mapping) -> Refusal | None:
    if machines.machine_series(machine) not in machines.GVNIC_SERIES:
        return None
    nics = body.get("networkInterfaces") or [{}]
    if any(nic.get("nicType") != "GVNIC" for nic in nics):
        return _invalid("gVNIC", "networkInterfaces[0].nicType",
                        f"{machine} needs the gVNIC network interface (nicType GVNIC)")
    return None


def _quota(body: Mapping, region: str, quotas: Mapping[str, float], used: Mapping[str, float]) -> Refusal | None:
    for name, asked in sorted(quota_rules.vm_usage(body, quotas).items()):
        if name in quotas and used.get(name, 0) + asked > quotas[name]:
            where = "globally" if quota_rules.project_wide(name) else f"in region {region}"
            return Refusal(403, "quota", f"Quota '{name}' exceeded. Limit: {float(quotas[name])} {where} "
                                         f"({used.get(name, 0):g} in use, {asked:g} asked for)")
    return None


def describe(body: dict) -> str:
    """What an insert asks for, in a few words: type, GPUs, boot disk, provisioning."""
    parts = [last_part(str(body.get("machineType", "?")))]
    model, count = quota_rules.gpus(body) if body.get("machineType") else (None, 0)
    if count:
        built_in = last_part(str(body.get("machineType"))) in machines.GPU_MACHINES
        parts.append(f"{count} x {model}" + (" (built in)" if built_in else ""))
    for disk in _items(body, "disks"):
        parts.append(last_part(str((disk.get("initializeParams") or {}).get("diskType") or "pd-standard (default)")))
    scheduling = _scheduling_of(body)
    if scheduling.get("provisioningModel") == "SPOT":
        parts.append(f"SPOT (on preemption: {scheduling.get('instanceTerminationAction', 'STOP')})")
    elif scheduling.get("preemptible"):
        parts.append("preemptible")
    return ", ".join(parts)
