"""The Compute Engine API as the launcher uses it (google-cloud-compute, REST transport).

Read-only look-ups for preflight (zones, machine and accelerator types,
regional and project-wide quotas, the project's metadata, images), the
preemption history of a cluster's VMs (zone operations of type
compute.instances.preempted), and the one write: deleting the VMs of a cluster
that `ray down` left stopped. Results are small plain dataclasses, so callers
and tests never touch protobuf types.

Credentials are Application Default Credentials. When ``LAUNCHER_COMPUTE_ENDPOINT``
is set (tests, or a private endpoint), every client talks to that URL with
anonymous credentials instead. Nothing here prints or stores a credential.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

from launcher import _deferred
from launcher.errors import Unreachable, UserError

ENDPOINT_ENV = "LAUNCHER_COMPUTE_ENDPOINT"
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


@dataclass(frozen=True)
class Instance:
    name: str
    status: str  # RUNNING, STOPPING, TERMINATED (stopped), ...


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

    def machine_type_cpus(self, zone: str, machine_type: str) -> int | None:
        """vCPUs of a machine type in a zone, None when the zone does not offer it."""
        m = self.machine_type(zone, machine_type)
        return None if m is None else m.cpus

    def project_info(self) -> Project | None:
        """The project's own quotas and common instance metadata (None: no such project)."""
        p = _or_none(lambda: self._client("ProjectsClient").get(project=self.project))
        if p is None:
            return None
        quotas = {q.metric: Quota(q.metric, q.limit, q.usage) for q in p.quotas}
        return Project(quotas, {i.key: i.value for i in p.common_instance_metadata.items})

    def instances(self, zone: str, cluster: str) -> list[Instance]:
        """The VMs of a Ray cluster in a zone, whatever their status (stopped ones included)."""
        client = self._client("InstancesClient")
        request = {"project": self.project, "zone": zone, "filter": f"labels.{CLUSTER_LABEL} = {cluster}"}
        return [Instance(i.name, i.status) for i in _listed(lambda: list(client.list(request=request)))
                if i.labels.get(CLUSTER_LABEL) == cluster]  # the filter is the server's job; be sure anyway

    def delete_instance(self, zone: str, name: str) -> None:
        """Ask Compute Engine to delete a VM (and its auto-delete boot disk); does not wait."""
        _or_none(lambda: self._client("InstancesClient").delete_unary(
            project=self.project, zone=zone, instance=name))

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
    could not reach. Returns them; the deletions run on without waiting."""
    left = compute.instances(zone, cluster)
    for vm in left:
        compute.delete_instance(zone, vm.name)
    return left


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
        raise UserError(f"Compute Engine API: permission denied ({exc.message[:160]})",
                        "enable the Compute Engine API in the project and grant your account "
                        "roles/compute.viewer") from None
    except gexc.GoogleAPIError as exc:
        raise UserError(f"Compute Engine API error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    except OSError as exc:  # requests' ConnectionError and friends: no answer at all
        raise Unreachable(f"the Compute Engine API did not answer ({type(exc).__name__})",
                          "check the network (or LAUNCHER_COMPUTE_ENDPOINT, when set)") from None
