"""The ``ray up`` rehearsal: Ray's real GCP node provider against a local Compute Engine API.

:func:`rehearse` takes a Ray cluster file for GCP and does, in this process,
what ``ray up``, the autoscaler and ``ray down`` ask of Compute Engine:
Ray's ``bootstrap_gcp`` (project, service account and IAM roles, the SSH key
in the project's metadata, the subnet), the head, the min_workers of every
worker type (one VM of a type without min_workers, as the autoscaler would
launch on demand) with the node configs the file has, the node list, then
teardown as ``ray down`` does it; with ``cache_stopped_nodes`` (which stops
instead of deleting) a second ``ray up`` and ``ray down``, to show the stopped
VMs started again; then what ``launcher cluster down`` does after it (it
deletes the VMs ``ray down`` left stopped). The provider and the
Google API client are the real ones; only the server is local
(:class:`launcher.lab.compute_api.ComputeAPI`), and it checks every request
by Compute Engine's rules.

How the client finds the local server: Ray's provider builds its API clients
with ``googleapiclient.discovery.build`` from the discovery documents the
client ships. :func:`pointed_at` wraps that function, in this process and
only while the rehearsal runs, to add ``client_options={"api_endpoint": ...}``;
the rehearsal's copy of the file gets Ray's ``credentials_token`` credentials
(a placeholder token), so no Google credentials are read or needed. Ray's
bootstrap writes its SSH key pair under ``~/.ssh``: during the rehearsal HOME
is a temporary folder, removed afterwards.

Not rehearsed here: SSH to the VMs, the setup and ``ray start`` commands
(:mod:`launcher.lab.ray_up`, ``launcher cluster rehearse --up``, runs the real
``ray up`` over SSH to this machine for those); images, NVIDIA drivers, real
quotas and stock (only a real project shows them).

Before anything is sent, the file is read as preflight reads it offline: a
node_config whose ``scheduling`` is a list (Ray's own GCP examples write
``- preemptible: true``) stops the rehearsal with one line naming the node
type and the mapping to write, since Compute Engine refuses every insert of it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (NODE_KIND_HEAD, NODE_KIND_WORKER, STATUS_UNINITIALIZED, STATUS_UP_TO_DATE,
                                 TAG_RAY_LAUNCH_CONFIG, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME, TAG_RAY_NODE_STATUS,
                                 TAG_RAY_USER_NODE_TYPE)

from cluster.compute import SERVICE_PATHS, Compute, delete_left_disks, delete_left_vms
from cluster.config import is_gcp
from cluster.preflight import scheduling_check
from launcher import _deferred, _ray
from launcher.errors import UserError
from launcher.lab.compute_api import STOPPED, Call, ComputeAPI
from launcher.lab.compute_rules import Refusal
from launcher.lab.compute_world import World

# Where each Google API the provider builds lives on the local server (the paths Google's use).
SERVICES = SERVICE_PATHS
NOT_SENT = "(not sent)"  # the target of an insert Ray's provider refused to send
TOKEN = "rehearsal-token"  # sent as a bearer token to 127.0.0.1 only; not a credential
FIXES = {
    "instance name": "Ray names VMs ray-CLUSTER-worker-XXXXXXXX-compute: keep cluster_name to 35 characters "
                     "(launcher cluster config --name)",
    "disk type": "use a boot disk type the series takes (launcher cluster config --disk-type, or its default)",
    "built-in GPUs": "drop guestAccelerators from that node type: the machine type brings its GPUs",
    "accelerators only on N1": "attach GPUs to an n1-* type, or use a G2/A2/A3 type that has them built in",
    "accelerator type": "use a GPU Compute Engine offers (launcher cluster config --accelerator)",
    "N1 GPU shape": "use a smaller N1 type or another GPU count",
    "TERMINATE for GPUs": "set scheduling.onHostMaintenance: TERMINATE on every node type with a GPU",
    "Spot fields": "regenerate with launcher cluster config --provisioning spot [--termination-action STOP]",
    "Spot only": "regenerate with --provisioning spot, or use a type offered on demand",
    "quota": "ask for more quota (console: IAM & Admin > Quotas) or fewer or smaller nodes (--min-workers / "
             "--max-workers); --quota METRIC=N sets the rehearsal's limits",
    "permission": "grant the missing permission (launcher cluster preflight names the role and the gcloud command)",
    "API disabled": "gcloud services enable compute.googleapis.com iam.googleapis.com "
                    "cloudresourcemanager.googleapis.com",
    "machine type": "use a machine type Compute Engine has (e.g. n1-standard-8, g2-standard-8)",
    "label": "node type names become label values: lowercase letters, digits, '-' and '_'",
    "gVNIC": "set nicType: GVNIC on the node type's networkInterfaces",
    "zone": "set provider.availability_zone to a zone Compute Engine has (launcher cluster config --zone)",
    "scheduling": "write scheduling as one mapping, e.g. scheduling: {preemptible: true, onHostMaintenance: "
                  "TERMINATE}",
}


@dataclass
class Report:
    """What the rehearsal saw: every request, the inserts refused, and what was left at the end."""

    calls: list[Call] = field(default_factory=list)
    stopped_by_down: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # VMs, then disks

    @property
    def refused(self) -> list[Call]:
        """Requests Compute Engine would refuse for the file's sake (not a stock-out, which is the zone's, nor
        a stale fingerprint; an organization policy's 412 is, as the file's external IPs meet it)."""
        return [c for c in self.calls if c.refusal and (c.refusal.status not in (404, 409, 412, 503)
                                                         or c.refusal.rule == "org policy")]

    @property
    def stocked_out(self) -> list[Call]:
        return [c for c in self.calls if c.refusal and c.refusal.rule == "stock-out"]


def rehearse(config: dict, quotas: dict[str, float] | None = None, bootstrap: bool = True,
             say: Callable[[str], None] = print, stockout: tuple[str, ...] = (), world: World | None = None) -> Report:
    """Rehearse ``ray up`` / ``ray down`` of ``config`` (a Ray cluster file as a dict).

    Args:
        quotas: quota metric -> limit for the local API (``NVIDIA_T4_GPUS``, ``GPUS_ALL_REGIONS``).
        bootstrap: run Ray's ``bootstrap_gcp`` first, as ``ray up`` does.
        say: where the lines go, one per request and phase.
        stockout: machine types (``*``: every one) the zone has none of: their inserts fail as Compute
            Engine's do, after the request is taken, with ZONE_RESOURCE_POOL_EXHAUSTED.
        world: the project the local API answers for (default: the tables' world with ``quotas``).

    Raises:
        UserError: the file is not a GCP cluster file the rehearsal can read, or the cluster extra
            (Ray's GCP provider's Google API client) is not installed.
    """
    _deferred.require("cluster", "`launcher cluster rehearse`")
    config = _rehearsal_copy(config)
    provider_config = config["provider"]
    report = Report()
    world = world or World.with_limits(quotas or {}, provider_config["availability_zone"])
    world.stocked_out |= set(stockout)
    api = ComputeAPI(provider_config["project_id"], world)
    with api, pointed_at(api.url), _temporary_home(), _quiet_provider():
        say(f"rehearsing `ray up` of cluster {config['cluster_name']!r} (project {provider_config['project_id']}, "
            f"zone {provider_config['availability_zone']}) against a local Compute Engine API at {api.url}")
        phase = _Phases(api, report, say)
        if bootstrap:
            with phase("bootstrap (Ray's bootstrap_gcp, as `ray up` runs it)"):
                config = _ray.resolve("GCPNodeProvider").bootstrap_config(config)
        provider = _provider_class(config["provider"])(config["provider"], config["cluster_name"])
        _up(config, provider, phase)
        _ray_down(config, provider, phase)
        if config["provider"].get("cache_stopped_nodes"):
            say("`ray up` again (Ray's provider starts the VMs it stopped instead of creating new ones):")
            _up(config, provider, phase)
            _ray_down(config, provider, phase)
        report.stopped_by_down = sorted(n for n, i in api.instances.items() if i["status"] == STOPPED)
        _cluster_down(config, phase, report)
    report.calls = api.calls
    say(summary(report, api))
    return report


class _Phases:
    """Prints the requests each phase of the rehearsal made, as they come."""

    def __init__(self, api: ComputeAPI, report: Report, say: Callable[[str], None]) -> None:
        self.api, self.report, self.say, self.seen = api, report, say, 0
        self.failed = False  # the last phase ended with an error Ray raised

    @contextlib.contextmanager
    def __call__(self, title: str) -> Iterator[None]:
        self.say(title + ":")
        self.failed = False
        try:
            yield
        except AssertionError as exc:  # Ray's own check of a VM name's length, before any request
            self.api.calls.append(Call("insert", NOT_SENT, Refusal(400, "instance name", _name_assertion(exc))))
            self.failed = True
        except Exception:  # noqa: BLE001  the API refused a request, or its operation failed (in its calls): go on
            if not any(c.refusal for c in self.api.calls[self.seen:]):
                raise
            self.failed = True
        for call in self.api.calls[self.seen:]:
            self.say("  " + format_call(call))
        self.seen = len(self.api.calls)


def _name_assertion(exc: AssertionError) -> str:
    """Ray's provider asserts its name label leaves room for the VM name's suffix (55 characters)."""
    what = exc.args[0] if exc.args else None
    if isinstance(what, tuple) and len(what) == 2:
        return (f"Ray refused to name the VM before sending it: the name label '{what[0]}' is {what[1]} "
                "characters, Ray's GCP provider takes at most 55")
    return f"Ray refused to name the VM before sending it: {exc}"


def _up(config: dict, provider, phase: _Phases) -> None:
    head_type = config["head_node_type"]
    types = config["available_node_types"]
    with phase(f"head ({head_type}), as `ray up` creates it"):
        _create(provider, config, head_type, NODE_KIND_HEAD, 1)
    if phase.failed:  # `ray up` ends here
        return
    for name, node_type in types.items():
        if name == head_type or int(node_type.get("max_workers", config.get("max_workers", 0)) or 0) < 1:
            continue
        count = int(node_type.get("min_workers", 0) or 0) or 1
        why = "min_workers" if node_type.get("min_workers") else "one, as the autoscaler launches on demand"
        with phase(f"workers {name} x {count} ({why})"):
            _create(provider, config, name, NODE_KIND_WORKER, count)
    with phase("the node list `ray up` and the autoscaler read"):
        provider.non_terminated_nodes({})


def _create(provider, config: dict, type_name: str, kind: str, count: int) -> None:
    node_type = config["available_node_types"][type_name]
    node_config = copy.deepcopy(node_type["node_config"])
    role = "head" if kind == NODE_KIND_HEAD else "worker"
    tags = {TAG_RAY_NODE_NAME: f"ray-{config['cluster_name']}-{role}", TAG_RAY_NODE_KIND: kind,
            TAG_RAY_NODE_STATUS: STATUS_UNINITIALIZED, TAG_RAY_USER_NODE_TYPE: type_name,
            TAG_RAY_LAUNCH_CONFIG: hashlib.sha1(json.dumps(node_config, sort_keys=True).encode()).hexdigest()}
    created = provider.create_node_with_resources_and_labels(
        node_config, tags, count, node_type.get("resources", {}), node_type.get("labels", {}))
    for name in created or {}:  # the updater marks a node set up (here: at once, nothing runs on it)
        provider.set_node_tags(name, {TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE})


def _ray_down(config: dict, provider, phase: _Phases) -> None:
    stop = bool(config["provider"].get("cache_stopped_nodes"))
    with phase("`ray down`" + (" (cache_stopped_nodes: Ray's provider stops VMs instead of deleting them)"
                               if stop else "")):
        for kind in (NODE_KIND_WORKER, NODE_KIND_HEAD):
            nodes = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: kind})
            if nodes:
                provider.terminate_nodes(nodes)


def _cluster_down(config: dict, phase: _Phases, report: Report) -> None:
    with phase("`launcher cluster down` after it (deletes the VMs `ray down` left, stopped ones too)"):
        provider_config = config["provider"]
        compute = Compute(provider_config["project_id"], endpoint=phase.api.url)
        delete_left_vms(compute, provider_config["availability_zone"], config["cluster_name"])
        delete_left_disks(compute, provider_config["availability_zone"], config["cluster_name"])
    report.left = sorted(phase.api.instances) + sorted(phase.api.disks)


def format_call(call: Call) -> str:
    """One request as a line: verb, target, what it asked for, and accepted or refused (the rule)."""
    verdict, refusal = "accepted", call.refusal
    if refusal:
        verdict = (f"not found ({refusal.message})" if refusal.status == 404 else
                   f"taken, then its operation failed [{refusal.rule}]: {refusal.message}" if refusal.status == 503
                   else f"refused [{refusal.rule}]: {refusal.message}")
    detail = f"  {call.detail}" if call.detail else ""
    return f"{call.verb:<12} {call.target}{detail}  {verdict}"


def summary(report: Report, api: ComputeAPI) -> str:
    inserts = [c for c in report.calls if c.verb == "insert"]
    refused = report.refused
    lines = [f"summary: {len(report.calls)} requests; {len(inserts) - len([c for c in inserts if c.refusal])} "
             f"VM inserts accepted, {len(refused)} refused"]
    started = [c for c in report.calls if c.verb == "start" and not c.refusal]
    if started:
        lines.append(f"  the second `ray up` started {len(started)} stopped VM(s) instead of inserting new ones")
    if report.stopped_by_down:
        lines.append(f"  `ray down` stopped {len(report.stopped_by_down)} VM(s) instead of deleting them "
                     f"(cache_stopped_nodes); `launcher cluster down` deleted them")
    if report.stocked_out:
        lines.append(f"  stock-out: {len(report.stocked_out)} insert(s) taken, then failed with ZONE_RESOURCE_POOL_"
                     "EXHAUSTED (Ray's provider raised the operation's error); no VM was made for them")
    lines.append(f"  left in the API at the end: {', '.join(report.left) if report.left else 'nothing'}")
    if not (api.world.quotas or api.world.project_quotas):
        lines.append("  quotas: none set (a real project has them: rehearse yours with --quota "
                     "NVIDIA_L4_GPUS=8 --quota GPUS_ALL_REGIONS=8)")
    return "\n".join(lines)


def refusal_error(source: str, report: Report) -> UserError:
    """The one line the CLI ends with when Compute Engine would refuse a request of the file."""
    call = report.refused[0]
    first = call.refusal
    who = "Ray's GCP provider" if call.target == NOT_SENT else "Compute Engine"
    node = f" (node type {call.node_type})" if call.node_type else ""
    more = f" (and {len(report.refused) - 1} more)" if len(report.refused) > 1 else ""
    return UserError(f"{source}: {who} would refuse it: [{first.rule}] {first.message}{node}{more}",
                     first.fix or FIXES.get(first.rule, "regenerate the file with launcher cluster config"))


@contextlib.contextmanager
def pointed_at(url: str) -> Iterator[None]:
    """While inside, every Google API client this process builds talks to ``url`` (the local API).

    A test seam for the rehearsal only: the product's own paths never call it.
    """
    from googleapiclient import discovery

    real = discovery.build

    def build(service_name, version, *args, **kwargs):
        if service_name not in SERVICES:
            raise UserError(f"the rehearsal has no local {service_name} API",
                            "rehearse a cluster file without TPU node types")
        options = dict(kwargs.pop("client_options", None) or {})
        options["api_endpoint"] = f"{url}/{SERVICES[service_name]}"
        kwargs.pop("discoveryServiceUrl", None)  # the discovery document the client ships is used
        return real(service_name, version, *args, client_options=options, **kwargs)

    discovery.build = build
    try:
        yield
    finally:
        discovery.build = real


def _provider_class(provider: dict) -> type:
    """The provider the file names: Ray's GCP one, or this launcher's subclass of it (cluster.gcp_provider)."""
    if provider.get("type") == "external":
        from cluster.gcp_provider import Provider

        return Provider
    return _ray.resolve("GCPNodeProvider")


@contextlib.contextmanager
def _quiet_provider() -> Iterator[None]:
    """Ray's GCP provider logs every operation it waits for at INFO; the rehearsal prints its own lines."""
    provider = _ray.resolve("GCPNodeProvider")
    loggers = [logging.getLogger(provider.__module__.rpartition(".")[0]), logging.getLogger(NodeProvider.__module__)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _temporary_home() -> Iterator[None]:
    """Ray's bootstrap writes an SSH key pair to ~/.ssh: give it a folder that goes away."""
    old = os.environ.get("HOME")
    with tempfile.TemporaryDirectory(prefix="launcher-rehearsal-") as home:
        os.environ["HOME"] = home
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("HOME", None)
            else:
                os.environ["HOME"] = old


def _rehearsal_copy(config: dict) -> dict:
    """The file as the rehearsal runs it: checked, copied, with the placeholder token."""
    if not isinstance(config, dict):
        raise UserError("not a Ray cluster file (expected a mapping)", "write one with launcher cluster config")
    provider = config.get("provider") or {}
    if not is_gcp(provider):
        raise UserError(f"provider type {provider.get('type')!r}: the rehearsal runs Ray's GCP provider",
                        "rehearse a file from launcher cluster config (Ray's GCP provider: type gcp, or "
                        "cluster.gcp_provider.Provider)")
    for key in ("project_id", "availability_zone", "region"):
        if not provider.get(key):
            raise UserError(f"the cluster file's provider has no {key}", "add it, or regenerate the file")
    for key in ("cluster_name", "head_node_type", "available_node_types"):
        if not config.get(key):
            raise UserError(f"the cluster file has no {key}", "regenerate it with launcher cluster config")
    for name, node in config["available_node_types"].items():  # before anything is sent
        check = scheduling_check(name, (node or {}).get("node_config") or {})
        if check:
            raise UserError(check.what, check.fix)
    config = copy.deepcopy(config)
    config.setdefault("auth", {}).setdefault("ssh_user", "ubuntu")
    config["provider"]["gcp_credentials"] = {"type": "credentials_token", "credentials": TOKEN}
    return config
