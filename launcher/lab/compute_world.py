"""What the local Compute Engine API serves besides its VMs: a :class:`World` of plain data.

Zones and their status, the machine and accelerator types each zone offers,
quotas per region and for the project (limit and usage), images by family,
the zone operations Compute Engine keeps (preemptions among them), and the
page size of its lists; and what a real project answers before it creates
anything: which APIs are enabled, which permissions the caller has, its VPC
networks, subnets and firewall rules, the organization policies in effect,
and machine types out of stock. A test builds one, or changes the one an API
holds, as data. A field left None answers as a fresh project set up for Ray does
(every API enabled, every permission, the default VPC with its four firewall
rules), or from the tables the cluster file and preflight read: :mod:`cluster.zones` (every zone it knows, UP) and
:mod:`cluster.machines` (every machine type it accepts, every GPU Compute
Engine still offers, with the most one VM takes). vCPUs, memory and built-in
GPUs always come from :mod:`cluster.machines`, so the local API cannot
disagree with it.

Each read-only resource is answered here in Compute Engine's JSON
(``zones.get``, ``machineTypes.get``, ``acceleratorTypes.get``,
``regions.get``, ``images.getFromFamily``), or None where the world has no
such resource (:mod:`launcher.lab.compute_api` answers 404 for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from cluster import machines, zones
from cluster.quotas import PROJECT_WIDE
from launcher.errors import UserError
from launcher.lab.compute_rules import zone_region

API = "https://www.googleapis.com/compute/v1"
ALL = "0-65535"
# The default VPC's rules, as a new project has them (Compute Engine's "Pre-populated rules").
DEFAULT_RULES = (("default-allow-internal", ["10.128.0.0/9"], [("tcp", ALL), ("udp", ALL), ("icmp", None)]),
                 ("default-allow-ssh", ["0.0.0.0/0"], [("tcp", "22")]),
                 ("default-allow-rdp", ["0.0.0.0/0"], [("tcp", "3389")]),
                 ("default-allow-icmp", ["0.0.0.0/0"], [("icmp", None)]))


@dataclass
class World:
    """The project as the local API sees it; every field is plain data a test may change.

    Attributes:
        zones: zone -> ``UP`` or ``DOWN``; None: every zone :mod:`cluster.zones` knows, UP.
        machine_types: zone -> the machine types it offers; None: every type :mod:`cluster.machines` accepts.
        accelerators: zone -> GPU model -> the most one VM may have; None: each GPU of :mod:`cluster.machines`
            Compute Engine still offers, in every zone.
        quotas: region -> metric -> (limit, usage); a metric not listed has no limit.
        project_quotas: project-wide metric (GPUS_ALL_REGIONS) -> (limit, usage).
        images: image project -> family -> the newest image's name.
        operations: zone -> its operations, as Compute Engine lists them (see
            :func:`launcher.lab.compute_api.operation`); the API adds those it makes.
        page_size: the most items one page of a list holds (Compute Engine's default, 500).
        services: the enabled APIs (``compute.googleapis.com``, ...); None: every one.
        permissions: the caller's permissions on the project; None: every one.
        networks: network -> ``{"auto": bool, "subnets": {region: (subnet, cidr)}}``; None: the default
            VPC, auto mode, a subnet in every region :mod:`cluster.zones` knows (inside 10.128.0.0/9;
            us-central1's is 10.128.0.0/20, as Compute Engine's auto mode makes it).
        firewalls: the project's firewall rules as Compute Engine lists them (see :func:`firewall`);
            None: the default VPC's four.
        org_policies: constraint (``constraints/compute.requireOsLogin``) -> the effective policy
            (``{"booleanPolicy": {"enforced": True}}``, ``{"listPolicy": {"allValues": "DENY"}}``).
        stocked_out: machine types whose inserts fail with ZONE_RESOURCE_POOL_EXHAUSTED (``*``: all).
    """

    zones: dict[str, str] | None = None
    machine_types: dict[str, list[str]] | None = None
    accelerators: dict[str, dict[str, int]] | None = None
    quotas: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    project_quotas: dict[str, tuple[float, float]] = field(default_factory=dict)
    images: dict[str, dict[str, str]] = field(default_factory=dict)
    operations: dict[str, list[dict]] = field(default_factory=dict)
    page_size: int = 500
    services: set[str] | None = None
    permissions: set[str] | None = None
    networks: dict[str, dict] | None = None
    firewalls: list[dict] | None = None
    org_policies: dict[str, dict] = field(default_factory=dict)
    stocked_out: set[str] = field(default_factory=set)

    @classmethod
    def with_limits(cls, limits: Mapping[str, float], zone: str) -> "World":
        """The tables' world with quota ``limits`` (metric -> limit, none in use; the rehearsal's
        ``--quota``): the project-wide metrics (``*_ALL_REGIONS``) on the project, the others in the
        region of ``zone``, where Ray's provider creates every VM of the cluster."""
        project = {m: (float(v), 0.0) for m, v in limits.items() if m.endswith(PROJECT_WIDE)}
        regional = {m: (float(v), 0.0) for m, v in limits.items() if m not in project}
        return cls(quotas={zone_region(zone): regional} if regional else {}, project_quotas=project)

    # -- facts ------------------------------------------------------------------------------------------
    def zone_status(self, zone: str) -> str | None:
        """UP or DOWN, None for a zone the world does not have."""
        if self.zones is None:
            return None if zones.zone_problem(zone) else "UP"
        return self.zones.get(zone)

    def has_region(self, region: str) -> bool:
        if self.zones is None:
            return region in zones.REGIONS
        return bool(self.region_zones(region))

    def region_zones(self, region: str) -> list[str]:
        if self.zones is None:
            return zones.region_zones(region)
        return [z for z in self.zones if zone_region(z) == region]

    def limits(self, region: str | None) -> tuple[dict[str, float], dict[str, float]]:
        """(limit, usage) per metric that holds in ``region``: its own quotas and the project's."""
        table = {**(self.quotas.get(region, {}) if region else {}), **self.project_quotas}
        return {m: float(q[0]) for m, q in table.items()}, {m: float(q[1]) for m, q in table.items()}

    def vpcs(self) -> dict[str, dict]:
        if self.networks is not None:
            return self.networks
        known = {"us-central1": 128, "europe-west1": 132, "us-west1": 138, "asia-east1": 140, "us-east1": 142}
        return {"default": {"auto": True, "subnets": {r: ("default", f"10.{known.get(r, 190 + i)}.0.0/20")
                                                      for i, r in enumerate(sorted(zones.REGIONS))}}}

    def rules(self, project: str) -> list[dict]:
        if self.firewalls is not None:
            return self.firewalls
        return [firewall(project, name, "default", ranges, allowed) for name, ranges, allowed in DEFAULT_RULES]

    def out_of_stock(self, machine_type: str) -> bool:
        return bool({"*", machine_type} & self.stocked_out)

    def offers_machine(self, zone: str, machine_type: str) -> bool:
        if self.machine_types is None:
            return self.zone_status(zone) is not None and machines.machine_type_problem(machine_type) is None
        return machine_type in self.machine_types.get(zone, ())

    def most_gpus(self, zone: str, accelerator: str) -> int | None:
        """The most GPUs of this model one VM may have in ``zone``, None where it is not offered."""
        if self.accelerators is not None:
            return self.accelerators.get(zone, {}).get(accelerator)
        acc = machines.ACCELERATORS.get(accelerator)
        if self.zone_status(zone) is None or acc is None or acc.retired:
            return None
        counts = machines.N1_SHAPES.get(accelerator) or [
            m.gpus for m in machines.GPU_MACHINES.values() if m.accelerator == accelerator]
        return max(counts) if counts else None

    # -- resources, as Compute Engine's JSON ------------------------------------------------------------
    def zone(self, project: str, zone: str) -> dict | None:
        status = self.zone_status(zone)
        if status is None:
            return None
        return {"kind": "compute#zone", "id": "2000", "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
                "name": zone, "description": zone, "status": status,
                "region": f"{API}/projects/{project}/regions/{zone_region(zone)}",
                "selfLink": f"{API}/projects/{project}/zones/{zone}",
                "availableCpuPlatforms": ["Intel Cascade Lake", "AMD Milan"], "supportsPzs": False}

    def machine_type(self, project: str, zone: str, name: str) -> dict | None:
        if not self.offers_machine(zone, name):
            return None
        try:
            cpus = machines.machine_vcpus(name)
        except UserError:  # a type whose vCPUs the table cannot say: not served
            return None
        # N1 and shared-core types from the table; others: 4 GB per vCPU
        memory_gb = machines.machine_memory_gb(name) or cpus * 4
        shared = name in machines.SHARED_CORE
        return {"kind": "compute#machineType", "id": "3008", "name": name, "guestCpus": cpus,
                "memoryMb": int(memory_gb * 1024), "maximumPersistentDisks": 16 if shared else 128, "zone": zone,
                "isSharedCpu": shared, "description": f"{cpus} vCPUs, {memory_gb:g} GB RAM",
                "selfLink": f"{API}/projects/{project}/zones/{zone}/machineTypes/{name}"}

    def accelerator_type(self, project: str, zone: str, name: str) -> dict | None:
        most = self.most_gpus(zone, name)
        if most is None:
            return None
        return {"kind": "compute#acceleratorType", "id": "10002", "name": name,
                "description": name.replace("-", " ").title(), "maximumCardsPerInstance": most,
                "zone": f"{API}/projects/{project}/zones/{zone}",
                "selfLink": f"{API}/projects/{project}/zones/{zone}/acceleratorTypes/{name}"}

    def region(self, project: str, region: str, held: Mapping[str, float]) -> dict | None:
        """A region with its quotas; ``held`` adds what the API's own VMs use."""
        if not (self.has_region(region) or region in self.quotas):
            return None
        return {"kind": "compute#region", "id": "1000", "name": region, "status": "UP",
                "zones": [f"{API}/projects/{project}/zones/{z}" for z in self.region_zones(region)],
                "quotas": quota_list(self.quotas.get(region, {}), held),
                "selfLink": f"{API}/projects/{project}/regions/{region}"}

    def network(self, project: str, name: str) -> dict | None:
        vpc = self.vpcs().get(name)
        if vpc is None:
            return None
        return {"kind": "compute#network", "id": "4000", "name": name, "autoCreateSubnetworks": bool(vpc["auto"]),
                "subnetworks": [s["selfLink"] for r in vpc["subnets"] for s in self.subnets(project, r)
                                if s["network"].endswith(f"/networks/{name}")],
                "selfLink": f"{API}/projects/{project}/global/networks/{name}"}

    def subnets(self, project: str, region: str) -> list[dict]:
        """The region's subnets, of every network, in the order the networks are listed."""
        found = []
        for network, vpc in self.vpcs().items():
            if region in vpc["subnets"]:
                name, cidr = vpc["subnets"][region]
                found.append({"kind": "compute#subnetwork", "name": name, "ipCidrRange": cidr,
                              "network": f"{API}/projects/{project}/global/networks/{network}",
                              "region": f"{API}/projects/{project}/regions/{region}",
                              "selfLink": f"{API}/projects/{project}/regions/{region}/subnetworks/{name}"})
        return found

    def image(self, project: str, family: str) -> dict | None:
        """The newest image of ``family`` in image project ``project`` (deeplearning-platform-release)."""
        name = self.images.get(project, {}).get(family)
        if name is None:
            return None
        return {"kind": "compute#image", "id": "7001", "name": name, "family": family, "status": "READY",
                "diskSizeGb": "50", "sourceType": "RAW", "architecture": machines.image_architecture(family),
                "selfLink": f"{API}/projects/{project}/global/images/{name}"}


def quota_list(table: Mapping[str, tuple[float, float]], held: Mapping[str, float]) -> list[dict]:
    """Quotas as Compute Engine lists them, with ``held`` added to each metric's usage."""
    return [{"metric": m, "limit": float(limit), "usage": float(usage) + held.get(m, 0.0)}
            for m, (limit, usage) in table.items()]



def firewall(project: str, name: str, network: str, sources: list[str], allowed: list[tuple[str, str | None]],
             priority: int = 65534, denied: bool = False, targets: list[str] | None = None) -> dict:
    """An ingress firewall rule as Compute Engine lists it: ``allowed`` (or ``denied``) is (protocol,
    ports) pairs, ports like ``"22"`` or ``"0-65535"`` (None: every port); ``targets``: target tags."""
    rules = [{"IPProtocol": proto, **({"ports": [ports]} if ports else {})} for proto, ports in allowed]
    rule = {"kind": "compute#firewall", "name": name, "network": f"{API}/projects/{project}/global/networks/{network}",
            "direction": "INGRESS", "priority": priority, "sourceRanges": list(sources), "disabled": False,
            "denied" if denied else "allowed": rules, "selfLink": f"{API}/projects/{project}/global/firewalls/{name}"}
    if targets:
        rule["targetTags"] = list(targets)
    return rule
