"""A local Compute Engine API: a small real HTTP server on 127.0.0.1, for the ``ray up`` rehearsal and the tests.

It answers the REST calls Ray 2.60's GCP node provider and its bootstrap
(``bootstrap_gcp``) send through google-api-python-client, and the ones
preflight, ``launcher cluster up`` / ``down`` and ``launcher cluster
preemptions`` send through google-cloud-compute and the API client, at the
same paths as Google's servers (``/compute/v1/...``,
``/cloudresourcemanager/v1/...``, ``/iam/v1/...``, ``/serviceusage/v1/...``):

- Compute: the VMs, their disks and operations (:mod:`launcher.lab.compute_vms`),
  ``projects`` get and setCommonInstanceMetadata, ``subnetworks`` list,
  ``networks`` get, ``firewalls`` list, and the read-only ``zones``,
  ``machineTypes``, ``acceleratorTypes``, ``regions`` (quotas) and ``images``
  getFromFamily, answered from the API's :class:`~launcher.lab.compute_world.World`
  (plain data a test may change; by default a project set up for Ray, and
  what :mod:`cluster.zones` and :mod:`cluster.machines` know);
- Resource Manager: ``projects`` get, create (409: it exists), getIamPolicy,
  setIamPolicy, testIamPermissions, getEffectiveOrgPolicy;
- IAM: ``serviceAccounts`` get (404 until created), create, delete;
- Service Usage: ``services`` list (the enabled ones).

Each route names the permissions a caller needs, as Google's documentation
lists them for the method; a request to an API the world has disabled, or
without one of those permissions, is answered 403 the way Google answers it
(:func:`launcher.lab.compute_project.gate`). The project-level handlers live in
:mod:`launcher.lab.compute_project`. Every call is kept in
:attr:`ComputeAPI.calls` for the rehearsal to print.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from launcher.lab import compute_project
from launcher.lab.compute_rules import ApiError, Refusal
from launcher.lab.compute_vms import RUNNING, STOPPED, VMs, operation  # noqa: F401  (re-exported)
from launcher.lab.compute_world import World


@dataclass
class Call:
    """One request the API answered: what, on which resource, and the rule that refused it."""

    verb: str
    target: str = ""
    refusal: Refusal | None = None
    detail: str = ""
    node_type: str = ""  # the Ray node type an insert was for


class ComputeAPI(VMs):
    """The local API's state (instances, project metadata, IAM, its world) and its server.

    Args:
        project: the project id it answers for (any other gets 404, as a missing project would).
        world: zones, machine and accelerator types, quotas, images and operations; by default the
            tables' world, without quotas (:meth:`World.with_limits` sets some).
    """

    def __init__(self, project: str, world: World | None = None) -> None:
        self.project = project
        self.world = world if world is not None else World()
        self.instances: dict[str, dict] = {}  # name -> the instance resource
        self.disks: dict[str, dict] = {}  # name -> the disk resource
        self.operations: dict[str, dict] = {}  # name -> the operation
        self.calls: list[Call] = []
        self.metadata: dict = {"kind": "compute#metadata", "fingerprint": "0", "items": []}
        self.service_accounts: dict[str, dict] = {}
        self.policy: dict = {"version": 1, "etag": "BwX", "bindings": []}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None

    # -- the server ---------------------------------------------------------------------------------
    def start(self) -> "ComputeAPI":
        api = self

        class Handler(_Handler):
            state = api

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="compute-api",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "ComputeAPI":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The server's root, e.g. ``http://127.0.0.1:40123`` (paths as Google's follow it)."""
        assert self._server, "start() the API first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- dispatch -----------------------------------------------------------------------------------
    def answer(self, method: str, path: str, query: dict[str, str], body: dict) -> dict:
        """The JSON answer to one request; raises :class:`ApiError` for an error answer."""
        with self._lock:
            for pattern, verb, handler, permissions in ROUTES:
                m = pattern.match(path)
                if m and method == verb:
                    groups = m.groupdict()
                    if groups.get("project", self.project) != self.project:
                        raise ApiError(404, "notFound", f"The resource 'projects/{groups['project']}' was not found")
                    compute_project.gate(self, path, permissions)
                    found = handler(self, body=body, query=query, **{k: v for k, v in groups.items()
                                                                      if k != "project"})
                    if found is None:  # a resource the world does not have
                        raise ApiError(404, "notFound", f"The resource '{path.split('/v1/', 1)[-1]}' was not found")
                    return found
        raise ApiError(404, "notFound", f"the local Compute API does not answer {method} {path}")

    def log(self, verb: str, target: str = "", refusal: Refusal | None = None, detail: str = "",
            node_type: str = "") -> None:
        """Keep one answered request in :attr:`calls`."""
        self.calls.append(Call(verb, target, refusal, detail, node_type))

    # -- the world's read-only resources -------------------------------------------------------------
    def get_region(self, region: str, body: dict, query: dict) -> dict | None:
        self.log("regions.get", region)
        return self.world.region(self.project, region, self.held(region))


def _read(verb: str, resource: Callable[..., dict | None]) -> Callable[..., dict | None]:
    """A route to one of the world's read-only resources (``World.zone`` and the like), logged as ``verb``."""
    def handler(api: ComputeAPI, body: dict, query: dict, **names: str) -> dict | None:
        api.log(verb, "/".join(names.values()))
        return resource(api.world, api.project, **names)
    return handler


def _image(api: ComputeAPI, image_project: str, family: str, body: dict, query: dict) -> dict | None:
    api.log("images.getFromFamily", f"{image_project}/{family}")  # images of any project are public
    return api.world.image(image_project, family)


def _route(pattern: str) -> re.Pattern:
    names = {"project": r"(?P<project>[^/:]+)", "zone": r"(?P<zone>[^/]+)", "name": r"(?P<name>[^/]+)",
             "region": r"(?P<region>[^/]+)", "family": r"(?P<family>[^/]+)",
             "image_project": r"(?P<image_project>[^/]+)"}
    for key, regex in names.items():
        pattern = pattern.replace("{" + key + "}", regex)
    return re.compile("^/" + pattern + "$")


_ZONE = "compute/v1/projects/{project}/zones/{zone}"
_OP = r"^/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<name>[^/]+)"
_SA = r"^/iam/v1/projects/(?P<project>[^/]+)/serviceAccounts/(?P<email>[^/]+)$"
_CRM = "cloudresourcemanager/v1/projects"
# What instances.insert needs besides compute.instances.create (Compute Engine's IAM page lists them):
# the disks it makes, the subnet and its external address, the metadata, labels and service account it
# sets, and acting as that account.
INSERT = ("compute.instances.create", "compute.disks.create", "compute.subnetworks.use",
          "compute.subnetworks.useExternalIp", "compute.instances.setMetadata", "compute.instances.setLabels",
          "compute.instances.setServiceAccount", "iam.serviceAccounts.actAs")


def _c(name: str) -> tuple[str, ...]:
    return (f"compute.{name}",)


ROUTES = [  # (path, method, handler, the permissions it needs)
    (_route(_ZONE), "GET", _read("zones.get", World.zone), _c("zones.get")),
    (_route(_ZONE + "/machineTypes/{name}"), "GET", _read("machineTypes.get", World.machine_type),
     _c("machineTypes.get")),
    (_route(_ZONE + "/acceleratorTypes/{name}"), "GET", _read("acceleratorTypes.get", World.accelerator_type),
     _c("acceleratorTypes.get")),
    (_route("compute/v1/projects/{project}/regions/{region}"), "GET", ComputeAPI.get_region, _c("regions.get")),
    (_route("compute/v1/projects/{image_project}/global/images/family/{family}"), "GET", _image, ()),  # public
    (_route(_ZONE + "/operations"), "GET", ComputeAPI.list_operations, _c("zoneOperations.list")),
    (_route(_ZONE + "/instances"), "GET", ComputeAPI.list_instances, _c("instances.list")),
    (_route(_ZONE + "/instances"), "POST", ComputeAPI.insert, INSERT),
    (_route(_ZONE + "/instances/{name}"), "GET", ComputeAPI.get_instance, _c("instances.get")),
    (_route(_ZONE + "/instances/{name}"), "DELETE", ComputeAPI.delete_instance, _c("instances.delete")),
    (_route(_ZONE + "/instances/{name}/stop"), "POST", ComputeAPI.stop_instance, _c("instances.stop")),
    (_route(_ZONE + "/instances/{name}/start"), "POST", ComputeAPI.start_instance, _c("instances.start")),
    (_route(_ZONE + "/instances/{name}/setLabels"), "POST", ComputeAPI.set_labels, _c("instances.setLabels")),
    (_route("compute/v1/projects/{project}/aggregated/instances"), "GET", ComputeAPI.aggregated_instances,
     _c("instances.list")),
    (_route(_ZONE + "/disks"), "GET", ComputeAPI.list_disks, _c("disks.list")),
    (_route(_ZONE + "/disks/{name}"), "DELETE", ComputeAPI.delete_disk, _c("disks.delete")),
    (re.compile(_OP + r"(?:/wait)?$"), "GET", ComputeAPI.get_operation, _c("zoneOperations.get")),
    (re.compile(_OP + r"/wait$"), "POST", ComputeAPI.get_operation, _c("zoneOperations.get")),
    (_route("compute/v1/projects/{project}/global/operations/{name}"), "GET", ComputeAPI.get_operation,
     _c("globalOperations.get")),
    (_route("compute/v1/projects/{project}"), "GET", compute_project.get_project, _c("projects.get")),
    (_route("compute/v1/projects/{project}/setCommonInstanceMetadata"), "POST", compute_project.set_metadata,
     _c("projects.setCommonInstanceMetadata")),
    (_route("compute/v1/projects/{project}/regions/{region}/subnetworks"), "GET", compute_project.list_subnets,
     _c("subnetworks.list")),
    (_route("compute/v1/projects/{project}/global/networks/{name}"), "GET", compute_project.get_network,
     _c("networks.get")),
    (_route("compute/v1/projects/{project}/global/firewalls"), "GET", compute_project.list_firewalls,
     _c("firewalls.list")),
    (_route(_CRM + "/{project}"), "GET", compute_project.crm_project, ("resourcemanager.projects.get",)),
    (re.compile(r"^/cloudresourcemanager/v1/projects$"), "POST", compute_project.create_project,
     ("resourcemanager.projects.create",)),
    (_route(_CRM + "/{project}:getIamPolicy"), "POST", compute_project.get_policy,
     ("resourcemanager.projects.getIamPolicy",)),
    (_route(_CRM + "/{project}:setIamPolicy"), "POST", compute_project.set_policy,
     ("resourcemanager.projects.setIamPolicy",)),
    (_route(_CRM + "/{project}:testIamPermissions"), "POST", compute_project.test_permissions, ()),
    (_route(_CRM + "/{project}:getEffectiveOrgPolicy"), "POST", compute_project.effective_policy,
     ("orgpolicy.policy.get",)),
    (re.compile(_SA), "GET", compute_project.get_account, ("iam.serviceAccounts.get",)),
    (re.compile(_SA), "DELETE", compute_project.delete_account, ("iam.serviceAccounts.delete",)),
    (_route("iam/v1/projects/{project}/serviceAccounts"), "POST", compute_project.create_account,
     ("iam.serviceAccounts.create",)),
    (_route("serviceusage/v1/projects/{project}/services"), "GET", compute_project.list_services,
     ("serviceusage.services.list",)),
]


class _Handler(BaseHTTPRequestHandler):
    """Turns HTTP requests into :meth:`ComputeAPI.answer` calls, and errors into Google's error body."""

    state: ComputeAPI

    def _serve(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
            status, answer = 200, self.state.answer(method, parsed.path, query, body)
        except ApiError as exc:
            status, answer = exc.status, {"error": {"code": exc.status, "message": exc.message, "errors": [
                {"message": exc.message, "domain": "global", "reason": exc.reason}]}}
        except ValueError:
            status, answer = 400, {"error": {"code": 400, "message": "Invalid JSON payload received."}}
        except Exception as exc:  # noqa: BLE001  a bug here answers 500, not a dropped connection
            status, answer = 500, {"error": {"code": 500, "message": f"the local Compute API failed: {exc!r}"}}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def log_message(self, *args) -> None:  # the rehearsal prints its own lines
        pass
