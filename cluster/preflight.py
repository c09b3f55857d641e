"""Preflight: check a Ray cluster file against the real project before `ray up` spends minutes failing.

Works on any GCP cluster file (ours or hand-written). From the file and the
machine table (:mod:`cluster.machines`) alone: Ray's VM names fit Compute
Engine's 63 characters; each node_config's ``scheduling`` is one mapping
(Ray's GCP examples write a list of one-key mappings, Ray sends it as is, and
Compute Engine refuses the insert); GPU nodes have onHostMaintenance TERMINATE (Spot
and preemptible ones get it from Compute Engine when they leave it out); each boot
disk's type is one its machine series takes (no diskType means pd-standard,
which G2 and A3 refuse); N1 GPU shapes exist (GPU count, vCPUs and memory per
GPU model); Spot-only types are Spot; each boot image is of its machine's architecture (no x86-64 image on
an Arm type); the pinned torch runs on the GPUs (a
warning otherwise). From the project: the zone exists and is UP; every node
type's machine type and accelerator exist in the zone with an allowed GPU
count; the region's quotas (vCPUs per machine series, the GPU model's quota,
or their PREEMPTIBLE_ variants for Spot/preemptible nodes, SSD_TOTAL_GB,
IN_USE_ADDRESSES: what :mod:`cluster.quotas` counts) and the project-wide
GPUS_ALL_REGIONS and CPUS_ALL_REGIONS cover the head plus max workers; OS
Login, which locks Ray's SSH key out, is off on the cluster's VMs; every boot
image resolves; optionally the bucket exists and sits in the cluster's
region. Before those, what Ray's bootstrap needs of the project
(:mod:`cluster.bootstrap`: enabled APIs, the caller's permissions, the service
account, organization policies) and, after them, the network
(:mod:`cluster.network`: subnets, firewall rules). Each check is a
:class:`~cluster.checks.Check` that says what is wrong and what to change.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster import bootstrap, machines, quotas as quota_rules
from cluster.checks import FAIL, OK, WARN, Check
from cluster.config import is_gcp
from cluster.compute import Compute, MachineInfo, Project, Quota
from cluster.machines import ACCELERATORS, bundled_accelerator, bundled_gpus, machine_series
from cluster.network import network_checks
from cluster.spec import MAX_NAME, VM_NAME_EXTRA
from launcher import _deferred
from launcher.errors import UserError
from launcher.storage import gcs

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
    disk_type: str | None = None  # None: the API's default, pd-standard
    on_host_maintenance: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    node_config: dict = field(default_factory=dict, compare=False, repr=False)


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
        init = ((nc.get("disks") or [{}])[0].get("initializeParams") or {})
        disk_type = str(init["diskType"]).rsplit("/", 1)[-1] if init.get("diskType") else None
        items = (nc.get("metadata") or {}).get("items") or []
        metadata = tuple((str(i.get("key")), str(i.get("value"))) for i in items)
        count = 1 if name == head else int(node.get("max_workers", config.get("max_workers", 0)))
        plans.append(NodePlan(name, machine, count, accelerator, gpus, spot, init.get("sourceImage"), disk_type,
                              sched.get("onHostMaintenance"), metadata, nc))
    return plans


def _accelerator(node_config: dict[str, Any], machine: str) -> tuple[str | None, int]:
    for acc in node_config.get("guestAccelerators") or []:
        return str(acc.get("acceleratorType", "")).rsplit("/", 1)[-1], int(acc.get("acceleratorCount", 1))
    if bundled_accelerator(machine):  # A2/A3/A4/G2: the machine table says how many
        return bundled_accelerator(machine), bundled_gpus(machine)
    return None, 0


def run_checks(config: dict[str, Any], compute: Compute, bucket: str | None = None,
               storage_client: Callable[[], Any] | None = None,
               apis: bootstrap.ProjectApis | None = None) -> list[Check]:
    """Every preflight check for a cluster file; the caller prints them and fails on any FAIL.
    ``apis``: Service Usage, Resource Manager and IAM (default: for the compute's project and endpoint)."""
    provider = config.get("provider") or {}
    if not is_gcp(provider):
        raise UserError(f"the cluster file's provider is {provider.get('type')!r}, not gcp",
                        "preflight checks Compute Engine cluster files (launcher cluster config writes one)")
    zone, region = provider.get("availability_zone"), provider.get("region")
    if not zone or not region or not provider.get("project_id"):
        raise UserError("the cluster file's provider lacks project_id, region or availability_zone",
                        "regenerate it with `launcher cluster config`")
    plans = node_plans(config)
    checks = [_security(config), *table_checks(config, plans)]
    if checks[1].status != FAIL:  # the Google API client imports: ask what Ray's bootstrap will need
        apis = apis or bootstrap.ProjectApis(compute.project, compute.endpoint)
        checks += bootstrap.api_checks(apis)
        if checks[-1].status == FAIL and "Compute Engine" in checks[-1].what:
            return checks  # every other answer would be the same 403
        checks += bootstrap.access_checks(config, apis) + bootstrap.policy_checks(config, apis)
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
    infos = _machine_checks(plans, compute, zone, checks)
    _accelerator_checks(plans, compute, zone, checks)
    _n1_shape_checks(plans, infos, checks)
    project = _project_checks(plans, compute, checks)
    if project is not None:
        _quota_checks(plans, {m: i.cpus for m, i in infos.items()}, compute, region, project, checks)
    _image_checks(plans, compute, checks)
    checks += network_checks(config, compute, region)
    if bucket:
        checks.append(bucket_check(bucket, region, storage_client))
    return checks


def _security(config: dict[str, Any]) -> Check:
    start = " ".join(config.get("head_start_ray_commands") or [])
    if "--dashboard-host=0.0.0.0" in start or "--dashboard-host 0.0.0.0" in start:
        return Check(WARN, "the head starts Ray's dashboard and job API (no authentication) on 0.0.0.0",
                     "use --dashboard-host=127.0.0.1 and reach it with `ray dashboard cluster.yaml`")
    return Check(OK, "Ray's dashboard and job API listen on the head's loopback only")


def _machine_checks(plans: list[NodePlan], compute: Compute, zone: str,
                    checks: list[Check]) -> dict[str, MachineInfo]:
    infos: dict[str, MachineInfo] = {}
    for machine in sorted({p.machine_type for p in plans}):
        info = compute.machine_type(zone, machine)
        if info is None:
            checks.append(Check(FAIL, f"machine type {machine} is not offered in {zone}",
                                f"pick one of `gcloud compute machine-types list --zones {zone}` or another zone"))
        else:
            infos[machine] = info
            checks.append(Check(OK, f"machine type {machine} ({info.cpus} vCPUs) is offered in {zone}"))
    return infos


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


def table_checks(config: dict[str, Any], plans: list[NodePlan]) -> list[Check]:
    """What the file and the machine table alone can tell, before any API call."""
    checks = [_local_client_check(), _name_check(str(config.get("cluster_name", "")))]
    for name, node in (config.get("available_node_types") or {}).items():
        check = scheduling_check(name, (node or {}).get("node_config") or {})
        checks += [check] if check else []
    for p in plans:
        checks += _node_table_checks(p)
    return checks


def scheduling_check(node_type: str, node_config: dict[str, Any]) -> Check | None:
    """A FAIL when a node_config's ``scheduling`` is not one mapping, as in Ray's own GCP examples
    (``- preemptible: true``): Ray's provider sends node_config to Compute Engine as is, and its
    Instance resource takes ``scheduling`` as an object, so every insert of the node type is refused."""
    value = node_config.get("scheduling")
    if value is None or isinstance(value, dict):
        return None
    shape = "a list (as Ray's GCP examples write it)" if isinstance(value, list) else f"a {type(value).__name__}"
    return Check(FAIL, f"node type {node_type}: scheduling is {shape}, and Compute Engine takes one object: Ray "
                 "sends node_config as is, so the insert would be refused (Invalid value for field "
                 "'resource.scheduling')", f"write it as a mapping: scheduling: {scheduling_as_mapping(value)}")


def scheduling_as_mapping(value: Any) -> str:
    """``[{preemptible: true}, {onHostMaintenance: TERMINATE}]`` as the one YAML mapping Compute Engine
    takes, in flow style: ``{preemptible: true, onHostMaintenance: TERMINATE}``."""
    import yaml

    merged: dict[str, Any] = {}
    for item in value if isinstance(value, list) else []:
        merged.update(item if isinstance(item, dict) else {})
    merged = merged or {"preemptible": True, "onHostMaintenance": "TERMINATE"}  # an example when nothing reads
    return yaml.safe_dump(merged, default_flow_style=True, sort_keys=False, width=1000).strip()


def _local_client_check() -> Check:
    """`ray up` runs Ray's GCP provider here, and it imports the Google API client."""
    missing = [m for m in ("googleapiclient", "google_auth_httplib2") if importlib.util.find_spec(m) is None]
    if missing:
        return Check(FAIL, f"{', '.join(missing)} cannot be imported here, and Ray's GCP provider (`ray up`) "
                     "imports it", f"install the launcher's cluster extra: {_deferred.install_command('cluster')}")
    return Check(OK, "Ray's GCP provider can import the Google API client here")


def _name_check(name: str) -> Check:
    if len(name) > MAX_NAME:
        return Check(FAIL, f"cluster name {name!r} is {len(name)} characters: Ray's VM names "
                     f"(ray-NAME-worker-XXXXXXXX-compute, {len(name) + VM_NAME_EXTRA} characters) pass Compute "
                     "Engine's 63", f"use a cluster_name of at most {MAX_NAME} characters")
    return Check(OK, f"Ray's VM names for cluster {name!r} fit Compute Engine's 63 characters")


def _node_table_checks(p: NodePlan) -> list[Check]:
    checks = []
    allowed = machines.disk_types(p.machine_type)
    disk = p.disk_type or "pd-standard"
    if disk not in allowed:
        said = disk if p.disk_type else "pd-standard (the API's default: the file sets no diskType)"
        checks.append(Check(FAIL, f"{p.node_type}: boot disk type {said}, which {p.machine_type} does not take "
                            f"({machine_series(p.machine_type).upper()} takes {', '.join(allowed)})",
                            f"set initializeParams.diskType to zones/ZONE/diskTypes/{allowed[0]} "
                            "(launcher cluster config writes it)"))
    if p.gpus and p.on_host_maintenance != "TERMINATE" and not (p.spot and p.on_host_maintenance is None):
        checks.append(Check(FAIL, f"{p.node_type}: a GPU VM without onHostMaintenance TERMINATE (GPUs cannot "
                            "live-migrate, so Compute Engine refuses it)",
                            "set scheduling.onHostMaintenance: TERMINATE in its node_config"))
    built_in = machines.GPU_MACHINES.get(p.machine_type)
    if built_in and built_in.spot_only and not p.spot:
        checks.append(Check(FAIL, f"{p.node_type}: {p.machine_type} is offered only as Spot (or flex-start) VMs",
                            "make the node type Spot (scheduling.provisioningModel: SPOT) or use a3-highgpu-8g"))
    if p.gpus and p.image:
        checks += _driver_check(p)
    if p.image and machines.architecture_problem(p.machine_type, p.image):
        checks.append(Check(FAIL, f"{p.node_type}: {machines.architecture_problem(p.machine_type, p.image)}",
                            f"{machines.architecture_fix(p.machine_type, p.image)} (its node_config's sourceImage)"))
    acc = ACCELERATORS.get(p.accelerator or "")
    if acc and not acc.torch_runs:
        checks.append(Check(WARN, f"{p.node_type}: {acc.name} ({acc.generation}) cannot run torch "
                            f"{machines.TORCH_VERSION}'s CUDA {machines.TORCH_CUDA} wheels (they need 7.5, Turing, "
                            "or newer)", "use nvidia-tesla-t4 or a G2/A2/A3 machine type, or install a torch "
                            "build for this GPU in the setup commands"))
    return checks


def _driver_check(p: NodePlan) -> list[Check]:
    """torch's CUDA wheels need a driver branch at least MIN_DRIVER; Deep Learning VM image names say theirs."""
    driver, image = machines.image_driver(p.image or ""), (p.image or "").rsplit("/", 1)[-1]
    need = f"torch {machines.TORCH_VERSION}'s CUDA {machines.TORCH_CUDA} wheels need {machines.MIN_DRIVER} or newer"
    if driver is None:
        return [Check(WARN, f"{p.node_type}: image {image} does not say which NVIDIA driver it carries; {need}",
                      f"use an image family ending in -nvidia-{machines.MIN_DRIVER} (launcher cluster config's "
                      "default), or check `nvidia-smi` on a node")]
    if driver < machines.MIN_DRIVER:
        return [Check(FAIL, f"{p.node_type}: image {image} carries the NVIDIA {driver} driver; {need}",
                      f"use an image family ending in -nvidia-{machines.MIN_DRIVER}")]
    return []


def _n1_shape_checks(plans: list[NodePlan], infos: dict[str, MachineInfo], checks: list[Check]) -> None:
    for p in plans:
        info = infos.get(p.machine_type)
        if not p.accelerator or p.accelerator not in machines.N1_SHAPES or info is None:
            continue
        problem = machines.n1_shape_problem(p.accelerator, p.gpus, info.cpus, info.memory_mb / 1024)
        if problem:
            fix = (f"use {machines.n1_largest_type(p.accelerator, p.gpus)} or smaller, or more GPUs"
                   if p.gpus in machines.N1_SHAPES[p.accelerator] else "use a GPU count Compute Engine offers")
            checks.append(Check(FAIL, f"{p.node_type}: {problem}", fix))
        else:
            checks.append(Check(OK, f"{p.node_type}: {p.gpus} x {p.accelerator} on {p.machine_type} is a shape "
                                "N1 offers"))


def _project_checks(plans: list[NodePlan], compute: Compute, checks: list[Check]) -> Project | None:
    """The project's own answer (its quotas and metadata), and OS Login in its metadata."""
    project = compute.project_info()
    if project is None:
        checks.append(Check(FAIL, f"project {compute.project} cannot be read", "check --project / project_id"))
        return None
    checks.append(_os_login_check(plans, project.metadata))
    return project


def _os_login_check(plans: list[NodePlan], project_metadata: dict[str, str]) -> Check:
    in_project = project_metadata.get("enable-oslogin", "").upper() == "TRUE"
    on = [p.node_type for p in plans
          if dict(p.metadata).get("enable-oslogin", "TRUE" if in_project else "FALSE").upper() == "TRUE"]
    if on:
        return Check(FAIL, f"OS Login is on for {', '.join(on)} ({'project' if in_project else 'instance'} "
                     "metadata enable-oslogin=TRUE): it ignores the SSH key Ray adds to the project's metadata, "
                     "so `ray up` would wait for SSH forever",
                     "add the metadata item enable-oslogin: FALSE to each node_config (launcher cluster config "
                     "does), or turn it off in the project's metadata")
    if in_project:
        return Check(OK, "OS Login is on in the project and off on the cluster's VMs (instance metadata wins over "
                     "the project's)")
    return Check(OK, "OS Login is off: Ray's SSH key will be accepted")


HINTS = {"CPUS": "a smaller machine type", "GPUS": "fewer GPUs per VM", "TOTAL_GB": "a smaller --disk-size-gb",
         "ADDRESSES": "fewer nodes (each has an external IP)", "INSTANCES": "fewer nodes"}


def _quota_checks(plans: list[NodePlan], cpus: dict[str, int], compute: Compute, region: str, project: Project,
                  checks: list[Check]) -> None:
    """What the head and every worker the file allows hold at once (:mod:`cluster.quotas`), against the
    region's and the project's quotas."""
    quotas = compute.region_quotas(region)
    if quotas is None:
        checks.append(Check(FAIL, f"region {region} does not exist", "fix --region / --zone"))
        return
    limits = {m: q.limit for m, q in {**quotas, **project.quotas}.items()}
    need: Counter = Counter()
    for p in plans:
        for metric, amount in quota_rules.vm_usage(p.node_config, limits, cpus.get(p.machine_type)).items():
            need[metric] += amount * p.count
    for metric, amount in sorted(need.items()):
        wide = quota_rules.project_wide(metric)
        q = (project.quotas if wide else quotas).get(metric)
        if q is None and (wide or metric in quota_rules.OPTIONAL):
            continue  # not listed: no such limit in this project
        q = q or Quota(metric, 0.0, 0.0)
        where = "(project-wide)" if wide else f"in {region}"
        if amount <= q.free:
            checks.append(Check(OK, f"quota {metric} {where}: needs {amount:g}, {q.free:g} free"))
        elif metric == "GPUS_ALL_REGIONS":
            checks.append(Check(FAIL, f"quota GPUS_ALL_REGIONS (project-wide): the cluster needs {amount:g} GPUs, "
                                f"{q.free:g} free (limit {q.limit:g}; new projects get 0)",
                                "request GPUS_ALL_REGIONS quota (IAM & Admin > Quotas, metric 'GPUs (all "
                                "regions)') or lower --max-workers"))
        else:
            hint = next((h for key, h in HINTS.items() if key in metric), "smaller nodes")
            checks.append(Check(FAIL, f"quota {metric} {where}: the cluster needs {amount:g}, {q.free:g} free "
                                f"(limit {q.limit:g}, in use {q.usage:g})",
                                f"request more {metric} quota {'' if wide else f'for {region} '}(IAM & Admin > "
                                f"Quotas) or lower --max-workers / {hint}"))


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
