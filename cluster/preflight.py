"""Preflight: check a Ray cluster file against the real project before `ray up` spends minutes failing.

Works on any GCP cluster file (ours or hand-written): the zone exists and is
UP; every node type's machine type and accelerator exist in the zone with an
allowed GPU count; the region's quotas (CPUs per machine series, the GPU
model's quota, or its PREEMPTIBLE_ variant for Spot/preemptible nodes) cover
the head plus max workers; every boot image resolves; optionally the bucket
exists and sits in the cluster's region. Each check is a :class:`Check` that
says what to change when it is not ok.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from cluster.compute import Compute, Quota
from cluster.machines import BUNDLED_ACCELERATOR
from cluster.spec import ACCELERATORS, bundled_gpus, machine_series
from launcher.errors import UserError
from launcher.storage import gcs

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    status: str  # ok | warn | FAIL
    what: str
    fix: str = ""

    def line(self) -> str:
        return f"  {self.status:<4}  {self.what}" + (f"\n        -> {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class NodePlan:
    """One node type of the file: what one VM needs and how many there can be."""

    node_type: str
    machine_type: str
    count: int  # 1 for the head, max workers for a worker type
    accelerator: str | None
    gpus: int
    spot: bool  # Spot or preemptible
    image: str | None


def node_plans(config: dict[str, Any]) -> list[NodePlan]:
    """Read the node types of a Ray GCP cluster file."""
    types = config.get("available_node_types") or {}
    head = config.get("head_node_type")
    plans = []
    for name, node in types.items():
        nc = node.get("node_config") or {}
        machine = str(nc.get("machineType", "")).rsplit("/", 1)[-1]
        accelerator, gpus = _accelerator(nc, machine)
        sched = nc.get("scheduling") or {}
        if isinstance(sched, list):  # Ray's own examples write a list of one-key mappings
            sched = {k: v for item in sched for k, v in item.items()}
        spot = sched.get("provisioningModel") == "SPOT" or bool(sched.get("preemptible"))
        disks = nc.get("disks") or [{}]
        image = (disks[0].get("initializeParams") or {}).get("sourceImage")
        count = 1 if name == head else int(node.get("max_workers", config.get("max_workers", 0)))
        plans.append(NodePlan(name, machine, count, accelerator, gpus, spot, image))
    return plans


def _accelerator(node_config: dict[str, Any], machine: str) -> tuple[str | None, int]:
    for acc in node_config.get("guestAccelerators") or []:
        return str(acc.get("acceleratorType", "")).rsplit("/", 1)[-1], int(acc.get("acceleratorCount", 1))
    family = "-".join(machine.split("-")[:2])
    if family in BUNDLED_ACCELERATOR:
        return BUNDLED_ACCELERATOR[family], bundled_gpus(machine)
    return None, 0


def run_checks(config: dict[str, Any], compute: Compute, bucket: str | None = None,
               storage_client: Callable[[], Any] | None = None) -> list[Check]:
    """Every preflight check for a cluster file; the caller prints them and fails on any FAIL."""
    provider = config.get("provider") or {}
    if provider.get("type") != "gcp":
        raise UserError(f"the cluster file's provider is {provider.get('type')!r}, not gcp",
                        "preflight checks Compute Engine cluster files (launcher cluster config writes one)")
    zone, region = provider.get("availability_zone"), provider.get("region")
    if not zone or not region or not provider.get("project_id"):
        raise UserError("the cluster file's provider lacks project_id, region or availability_zone",
                        "regenerate it with `launcher cluster config`")
    checks = [_security(config)]
    z = compute.zone(zone)
    if z is None:
        checks.append(Check(FAIL, f"zone {zone} does not exist in project {compute.project}",
                            "set --zone to a zone of `gcloud compute zones list`"))
        return checks  # nothing else can be looked up in a zone that is not there
    if z.status != "UP":
        checks.append(Check(FAIL, f"zone {zone} is {z.status}", "pick another zone of the region (--zone)"))
    else:
        checks.append(Check(OK, f"zone {zone} is UP"))
    if z.region != region:
        checks.append(Check(FAIL, f"zone {zone} is in region {z.region}, the file says {region}",
                            f"set --region {z.region}"))
    plans = node_plans(config)
    cpus = _machine_checks(plans, compute, zone, checks)
    _accelerator_checks(plans, compute, zone, checks)
    _quota_checks(plans, cpus, compute, region, checks)
    _image_checks(plans, compute, checks)
    if bucket:
        checks.append(bucket_check(bucket, region, storage_client))
    return checks


def _security(config: dict[str, Any]) -> Check:
    start = " ".join(config.get("head_start_ray_commands") or [])
    if "--dashboard-host=0.0.0.0" in start or "--dashboard-host 0.0.0.0" in start:
        return Check(WARN, "the head starts Ray's dashboard and job API (no authentication) on 0.0.0.0",
                     "use --dashboard-host=127.0.0.1 and reach it with `ray dashboard cluster.yaml`")
    return Check(OK, "Ray's dashboard and job API listen on the head's loopback only")


def _machine_checks(plans: list[NodePlan], compute: Compute, zone: str, checks: list[Check]) -> dict[str, int]:
    cpus: dict[str, int] = {}
    for machine in sorted({p.machine_type for p in plans}):
        n = compute.machine_type_cpus(zone, machine)
        if n is None:
            checks.append(Check(FAIL, f"machine type {machine} is not offered in {zone}",
                                f"pick one of `gcloud compute machine-types list --zones {zone}` or another zone"))
        else:
            cpus[machine] = n
            checks.append(Check(OK, f"machine type {machine} ({n} vCPUs) is offered in {zone}"))
    return cpus


def _accelerator_checks(plans: list[NodePlan], compute: Compute, zone: str, checks: list[Check]) -> None:
    for p in plans:
        if not p.accelerator:
            continue
        most = compute.accelerator_max_cards(zone, p.accelerator)
        if most is None:
            checks.append(Check(FAIL, f"accelerator {p.accelerator} ({p.node_type}) is not offered in {zone}",
                                f"pick a zone that has it (`gcloud compute accelerator-types list "
                                f"--filter=name={p.accelerator}`) or another --accelerator"))
        elif p.gpus > most:
            checks.append(Check(FAIL, f"{p.gpus} x {p.accelerator} per VM ({p.node_type}): {zone} allows at most "
                                f"{most}", f"set --accelerator-count to {most} or less"))
        else:
            checks.append(Check(OK, f"accelerator {p.accelerator} x {p.gpus} ({p.node_type}) is offered in {zone}"))


def _quota_checks(plans: list[NodePlan], cpus: dict[str, int], compute: Compute, region: str,
                  checks: list[Check]) -> None:
    quotas = compute.region_quotas(region)
    if quotas is None:
        checks.append(Check(FAIL, f"region {region} does not exist", "fix --region / --zone"))
        return
    need: dict[str, int] = defaultdict(int)
    for p in plans:
        if p.machine_type in cpus:
            need[_metric(f"{machine_series(p.machine_type).upper()}_CPUS", "CPUS", p.spot, quotas)] += \
                cpus[p.machine_type] * p.count
        if p.accelerator and p.accelerator in ACCELERATORS:
            need[_metric(ACCELERATORS[p.accelerator].quota, None, p.spot, quotas)] += p.gpus * p.count
    for metric, amount in sorted(need.items()):
        q = quotas.get(metric, Quota(metric, 0.0, 0.0))
        if amount > q.free:
            checks.append(Check(FAIL, f"quota {metric} in {region}: the cluster needs {amount}, {q.free:g} free "
                                f"(limit {q.limit:g}, in use {q.usage:g})",
                                f"request more {metric} quota for {region} (IAM & Admin > Quotas) or lower "
                                "--max-workers / the machine or accelerator size"))
        else:
            checks.append(Check(OK, f"quota {metric} in {region}: needs {amount}, {q.free:g} free"))


def _metric(specific: str, general: str | None, spot: bool, quotas: dict[str, Quota]) -> str:
    """The quota a node draws on: per-series if the region lists one, PREEMPTIBLE_ for Spot where granted."""
    base = specific if specific in quotas or general is None else general
    if spot:
        # Compute Engine charges Spot/preemptible VMs to the PREEMPTIBLE_ quota when the project has one.
        for candidate in (f"PREEMPTIBLE_{base}", f"PREEMPTIBLE_{general}" if general else None):
            if candidate and candidate in quotas and quotas[candidate].limit > 0:
                return candidate
    return base


def _image_checks(plans: list[NodePlan], compute: Compute, checks: list[Check]) -> None:
    for image in sorted({p.image for p in plans if p.image}):
        try:
            name = compute.image(image)
        except UserError as exc:
            checks.append(Check(FAIL, str(exc.what), exc.fix or ""))
            continue
        if name is None:
            checks.append(Check(FAIL, f"image {image} does not resolve",
                                "pick a current family: gcloud compute images list --project "
                                "deeplearning-platform-release --no-standard-images"))
        else:
            checks.append(Check(OK, f"image {image.rsplit('/', 1)[-1]} resolves to {name}"))


def bucket_check(bucket_uri: str, region: str, storage_client: Callable[[], Any] | None = None) -> Check:
    """The bucket exists (fail otherwise) and is in the cluster's region (warn otherwise)."""
    path = gcs.parse_gs_uri(bucket_uri, "--bucket")
    client = (storage_client or gcs.client)()
    try:
        b = client.lookup_bucket(path.bucket)
    except Exception as exc:  # permission denied and friends: one line from launcher.storage.gcs
        err = gcs.explain(exc, path.uri, "read")
        return Check(FAIL, err.what, err.fix or "")
    if b is None:
        return Check(FAIL, f"bucket gs://{path.bucket} does not exist",
                     f"create it: gcloud storage buckets create gs://{path.bucket} --location {region}")
    location = (b.location or "").lower()
    if location == region.lower():
        return Check(OK, f"bucket gs://{path.bucket} is in {region}, the cluster's region")
    return Check(WARN, f"bucket gs://{path.bucket} is in {location.upper() or 'an unknown location'}, the cluster "
                 f"in {region}: cross-region reads and checkpoints are slower and pay egress",
                 f"use a bucket in {region} (gcloud storage buckets create gs://NAME --location {region})")


def format_checks(checks: list[Check]) -> str:
    failed = sum(c.status == FAIL for c in checks)
    warned = sum(c.status == WARN for c in checks)
    tail = (f"preflight: {failed} check(s) failed" if failed else "preflight: all checks passed") + \
        (f", {warned} warning(s)" if warned else "")
    return "\n".join([c.line() for c in checks] + [tail])
