"""The Compute Engine API as the launcher uses it (google-cloud-compute, REST transport).

Read-only look-ups for preflight (zones, machine and accelerator types,
regional and project-wide quotas, the project's metadata, images, the
region's subnets, networks and firewall rules), the preemption history of a
cluster's VMs (zone operations of type compute.instances.preempted), a
cluster's VMs and disks, and the writes that clean up after Ray: deleting
VMs and detached disks, and setting the project's metadata. Results are small
plain dataclasses, so callers and tests never touch protobuf types.

Credentials are Application Default Credentials. When ``LAUNCHER_COMPUTE_ENDPOINT``
is set (tests, or a private endpoint), every client talks to that URL with
anonymous credentials instead, each Google API under the path its own server
uses (:data:`SERVICE_PATHS`; :mod:`cluster.bootstrap` builds the others the
same way). Nothing here prints or stores a credential.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

from launcher import _deferred
from launcher.errors import Unreachable, UserError
from launcher.settings import COMPUTE_ENDPOINT as ENDPOINT_ENV

# Where each Google API's methods live under one endpoint: the path Google's own server puts before them
# (the discovery documents' servicePath; Compute's methods also start with it).
SERVICE_PATHS = {"compute": "compute/v1/", "cloudresourcemanager": "cloudresourcemanager/", "iam": "iam/",
                 "serviceusage": "serviceusage/"}
PREEMPTED = "compute.instances.preempted"
CLUSTER_LABEL = "ray-cluster-name"  # the label Ray's GCP provider puts on every VM of a cluster


@dataclass(frozen=True)
class Zone:
    name: str
    status: str  # UP or DOWN
    region: str  # short name


@dataclass(frozen=True)
class Quota:
    metric: str
    limit: float
    usage: float

    @property
    def free(self) -> float:
        return self.limit - self.usage


@dataclass(frozen=True)
class MachineInfo:
    cpus: int
    memory_mb: int


@dataclass(frozen=True)
class Project:
    """Project-wide quotas (GPUS_ALL_REGIONS among them) and the metadata every VM inherits."""

    quotas: dict[str, Quota]
    metadata: dict[str, str]
    fingerprint: str = ""


@dataclass(frozen=True)
class Instance:
    name: str
    status: str  # RUNNING, STOPPING, TERMINATED (stopped), ...
    machine_type: str = ""
    external_ips: tuple[str, ...] = ()
    disks: tuple[tuple[str, int, bool], ...] = ()  # (disk name, GB, auto-delete with the VM)
    cluster: str = ""


@dataclass(frozen=True)
class Disk:
    name: str
    size_gb: int
    type: str  # pd-balanced, ...
    users: tuple[str, ...]  # the VMs it is attached to


@dataclass(frozen=True)
class Subnet:
    name: str
    network: str
    cidr: str


@dataclass(frozen=True)
class Firewall:
    """An ingress or egress rule; ``allowed``/``denied`` are (protocol, ports) pairs (no ports: all)."""

    name: str
    network: str
    direction: str
    priority: int
    disabled: bool
    source_ranges: tuple[str, ...]
    source_tags: tuple[str, ...]
    target_tags: tuple[str, ...]
    target_accounts: tuple[str, ...]
    allowed: tuple[tuple[str, tuple[str, ...]], ...]
    denied: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Preemption:
    instance: str
    zone: str
    time: str  # RFC 3339, as Compute Engine reports it
    message: str


class Compute:
    """One project's Compute Engine API; each method returns None for a resource that does not exist."""

    def __init__(self, project: str, endpoint: str | None = None) -> None:
        _deferred.require("cluster", "Compute Engine's API (launcher cluster preflight, up, down, preemptions)")
        self.project = project
        self.endpoint = endpoint if endpoint is not None else os.environ.get(ENDPOINT_ENV) or None
        self._clients: dict[str, object] = {}

    def _client(self, name: str):
        """A cached google-cloud-compute client, e.g. name='ZonesClient'."""
        if name not in self._clients:
            from google.cloud import compute_v1

            cls = getattr(compute_v1, name)
            if self.endpoint:
                from google.auth.credentials import AnonymousCredentials

                self._clients[name] = cls(transport="rest", credentials=AnonymousCredentials(),
                                          client_options={"api_endpoint": self.endpoint})
            else:
                try:
                    self._clients[name] = cls(transport="rest")
                except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and friends
                    raise UserError(f"no Google Cloud credentials: {type(exc).__name__}",
                                    "run `gcloud auth application-default login` or set "
                                    "GOOGLE_APPLICATION_CREDENTIALS") from None
        return self._clients[name]

    def zone(self, zone: str) -> Zone | None:
        z = _or_none(lambda: self._client("ZonesClient").get(project=self.project, zone=zone))
        return None if z is None else Zone(z.name, z.status, z.region.rstrip("/").rsplit("/", 1)[-1])

    def machine_type(self, zone: str, machine_type: str) -> MachineInfo | None:
        """vCPUs and memory of a machine type in a zone, None when the zone does not offer it."""
        m = _or_none(lambda: self._client("MachineTypesClient").get(
            project=self.project, zone=zone, machine_type=machine_type))
        return None if m is None else MachineInfo(m.guest_cpus, m.memory_mb)

    def project_info(self) -> Project | None:
        """The project's own quotas and common instance metadata (None: no such project)."""
        p = _or_none(lambda: self._client("ProjectsClient").get(project=self.project))
        if p is None:
            return None
        quotas = {q.metric: Quota(q.metric, q.limit, q.usage) for q in p.quotas}
        return Project(quotas, {i.key: i.value for i in p.common_instance_metadata.items},
                       p.common_instance_metadata.fingerprint)

    def instances(self, zone: str, cluster: str) -> list[Instance]:
        """The VMs of a Ray cluster in a zone, whatever their status (stopped ones included)."""
        client = self._client("InstancesClient")
        request = {"project": self.project, "zone": zone, "filter": f"labels.{CLUSTER_LABEL} = {cluster}"}
        return [_instance(i) for i in _listed(lambda: list(client.list(request=request)))
                if i.labels.get(CLUSTER_LABEL) == cluster]  # the filter is the server's job; be sure anyway

    def ray_vms(self) -> list[Instance]:
        """Every VM of any Ray cluster in the project, every zone (``cluster`` says whose)."""
        pager = _or_none(lambda: self._client("InstancesClient").aggregated_list(
            request={"project": self.project, "filter": f"labels.{CLUSTER_LABEL}:*"}))
        return [_instance(i) for _, scoped in (pager or []) for i in scoped.instances if CLUSTER_LABEL in i.labels]

    def delete_instances(self, zone: str, names: list[str]) -> None:
        """Delete VMs (and their auto-delete disks): every request sent first, then each one waited for."""
        client, ops = self._client("InstancesClient"), []
        for name in names:
            ops.append(_or_none(lambda: client.delete_unary(project=self.project, zone=zone, instance=name)))
        self._wait(zone, ops)

    def delete_instance(self, zone: str, name: str) -> None:
        self.delete_instances(zone, [name])

    def _wait(self, zone: str, ops: list) -> None:
        """Wait for zone operations (Compute Engine's wait answers when done, or after 2 minutes)."""
        client = self._client("ZoneOperationsClient")
        for op in ops:
            while op is not None and op.status != op.Status.DONE:
                op = _or_none(lambda: client.wait(project=self.project, zone=zone, operation=op.name))
            if op is not None and op.error and op.error.errors:
                first = op.error.errors[0]
                raise UserError(f"Compute Engine could not finish {op.operation_type} of "
                                f"{op.target_link.rsplit('/', 1)[-1]}: {first.code}: {first.message}")

    def disks(self, zone: str, prefix: str) -> list[Disk]:
        """The zone's disks whose names start with ``prefix`` (Ray's VMs' boot disks carry the VM's name)."""
        client = self._client("DisksClient")
        found = _listed(lambda: list(client.list(request={"project": self.project, "zone": zone})))
        return [Disk(d.name, int(d.size_gb), d.type_.rsplit("/", 1)[-1], tuple(u.rsplit("/", 1)[-1] for u in d.users))
                for d in found if d.name.startswith(prefix)]

    def delete_disks(self, zone: str, names: list[str]) -> None:
        client = self._client("DisksClient")
        self._wait(zone, [_or_none(lambda: client.delete_unary(project=self.project, zone=zone, disk=n))
                          for n in names])

    def subnets(self, region: str) -> list[Subnet]:
        """The region's subnets of every network, in the order the API lists them (Ray takes the first)."""
        client = self._client("SubnetworksClient")
        found = _listed(lambda: list(client.list(project=self.project, region=region)))
        return [Subnet(s.name, s.network.rsplit("/", 1)[-1], s.ip_cidr_range) for s in found]

    def network_auto_mode(self, network: str) -> bool | None:
        """Whether a VPC network makes its own subnets (auto mode); None: no such network."""
        n = _or_none(lambda: self._client("NetworksClient").get(project=self.project, network=network))
        return None if n is None else bool(n.auto_create_subnetworks)

    def firewalls(self) -> list[Firewall]:
        found = _listed(lambda: list(self._client("FirewallsClient").list(project=self.project)))
        return [Firewall(f.name, f.network.rsplit("/", 1)[-1], f.direction or "INGRESS", int(f.priority or 1000),
                         bool(f.disabled), tuple(f.source_ranges), tuple(f.source_tags), tuple(f.target_tags),
                         tuple(f.target_service_accounts),
                         tuple((a.I_p_protocol, tuple(a.ports)) for a in f.allowed),
                         tuple((d.I_p_protocol, tuple(d.ports)) for d in f.denied)) for f in found]

    def set_metadata(self, items: dict[str, str], fingerprint: str) -> None:
        """Replace the project's common instance metadata (``fingerprint``: as read; a stale one is refused)."""
        from google.cloud import compute_v1

        body = compute_v1.Metadata(fingerprint=fingerprint, items=[compute_v1.Items(key=k, value=v)
                                                                   for k, v in items.items()])
        op = _or_none(lambda: self._client("ProjectsClient").set_common_instance_metadata_unary(
            project=self.project, metadata_resource=body))
        while op is not None and op.status != op.Status.DONE:
            op = _or_none(lambda: self._client("GlobalOperationsClient").wait(project=self.project,
                                                                             operation=op.name))

    def accelerator_max_cards(self, zone: str, accelerator: str) -> int | None:
        """The most GPUs of this type one VM may have, None when the zone does not offer it."""
        a = _or_none(lambda: self._client("AcceleratorTypesClient").get(
            project=self.project, zone=zone, accelerator_type=accelerator))
        return None if a is None else a.maximum_cards_per_instance

    def region_quotas(self, region: str) -> dict[str, Quota] | None:
        r = _or_none(lambda: self._client("RegionsClient").get(project=self.project, region=region))
        return None if r is None else {q.metric: Quota(q.metric, q.limit, q.usage) for q in r.quotas}

    def image(self, source_image: str) -> str | None:
        """Resolve projects/P/global/images/family/F (or .../images/NAME) to an image name."""
        project, family, name = parse_image(source_image)
        client = self._client("ImagesClient")
        if family:
            image = _or_none(lambda: client.get_from_family(project=project, family=family))
        else:
            image = _or_none(lambda: client.get(project=project, image=name))
        return None if image is None else image.name

    def preemptions(self, zone: str, name_prefix: str = "") -> list[Preemption]:
        """Preemptions in a zone (Compute keeps operations for a limited time), oldest first."""
        pager = self._client("ZoneOperationsClient").list(request={
            "project": self.project, "zone": zone, "filter": f'operationType = "{PREEMPTED}"'})
        found = []
        for op in pager:
            if op.operation_type != PREEMPTED:  # the filter is the server's job; be sure anyway
                continue
            instance = op.target_link.rstrip("/").rsplit("/", 1)[-1]
            if instance.startswith(name_prefix):
                found.append(Preemption(instance, zone, op.insert_time or op.start_time, op.status_message))
        return sorted(found, key=lambda p: _when(p.time))


def delete_left_vms(compute: Compute, zone: str, cluster: str) -> list[Instance]:
    """Delete every VM of a cluster still in the zone (run after `ray down`): the ones it stopped
    instead of deleting (cache_stopped_nodes), preempted ones Compute Engine stopped, and any it
    could not reach. Returns them, once Compute Engine has deleted them."""
    left = compute.instances(zone, cluster)
    compute.delete_instances(zone, [vm.name for vm in left])
    return left


def delete_left_disks(compute: Compute, zone: str, cluster: str) -> list[Disk]:
    """Delete the cluster's disks no VM uses (a VM deleted without its disk: ``autoDelete: false``).
    Ray names a cluster's VMs, and so their boot disks, ``ray-CLUSTER-...``. Returns them, deleted."""
    left = [d for d in compute.disks(zone, f"ray-{cluster}-") if not d.users]
    compute.delete_disks(zone, [d.name for d in left])
    return left


def _instance(i) -> Instance:
    ips = tuple(a.nat_i_p for nic in i.network_interfaces for a in nic.access_configs if a.nat_i_p)
    disks = tuple((d.source.rsplit("/", 1)[-1], int(d.disk_size_gb), bool(d.auto_delete)) for d in i.disks)
    return Instance(i.name, i.status, i.machine_type.rsplit("/", 1)[-1], ips, disks, i.labels.get(CLUSTER_LABEL, ""))


def _when(rfc3339: str) -> _dt.datetime:
    """Compute Engine's times carry their own UTC offsets: compare them as instants."""
    try:
        return _dt.datetime.fromisoformat(rfc3339).astimezone(_dt.timezone.utc)
    except ValueError:
        return _dt.datetime.max.replace(tzinfo=_dt.timezone.utc)


def parse_image(source_image: str) -> tuple[str, str | None, str | None]:
    """'projects/P/global/images/family/F' -> (P, F, None); '.../images/NAME' -> (P, None, NAME)."""
    parts = source_image.split("/")
    try:
        at = parts.index("projects")
        project = parts[at + 1]
        rest = parts[parts.index("images", at) + 1:]
    except (ValueError, IndexError):
        raise UserError(f"image {source_image!r} is not an image path",
                        "write projects/PROJECT/global/images/family/FAMILY or .../images/NAME") from None
    if len(rest) == 2 and rest[0] == "family":
        return project, rest[1], None
    if len(rest) == 1:
        return project, None, rest[0]
    raise UserError(f"image {source_image!r} is not an image path",
                    "write projects/PROJECT/global/images/family/FAMILY or .../images/NAME")


def _listed(call):
    """A listing: [] where the zone does not exist."""
    result = _or_none(call)
    return [] if result is None else result


def _or_none(call):
    """Run an API call; None for 404. Permission and other API errors become one clear line."""
    from google.api_core import exceptions as gexc

    try:
        return call()
    except gexc.NotFound:
        return None
    except (gexc.Forbidden, gexc.Unauthorized) as exc:
        if "has not been used in project" in exc.message or "it is disabled" in exc.message:
            raise UserError("the Compute Engine API is not enabled in the project",
                            "gcloud services enable compute.googleapis.com --project PROJECT") from None
        raise UserError(f"Compute Engine API: permission denied ({exc.message[:160]})",
                        "enable the Compute Engine API in the project and grant your account "
                        "roles/compute.viewer") from None
    except gexc.GoogleAPIError as exc:
        raise UserError(f"Compute Engine API error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    except OSError as exc:  # requests' ConnectionError and friends: no answer at all
        raise Unreachable(f"the Compute Engine API did not answer ({type(exc).__name__})",
                          "check the network (or LAUNCHER_COMPUTE_ENDPOINT, when set)") from None
