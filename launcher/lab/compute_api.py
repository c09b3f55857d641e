"""A local Compute Engine API: a small real HTTP server on 127.0.0.1, for the ``ray up`` rehearsal and the tests.

It answers the REST calls Ray 2.60's GCP node provider and its bootstrap
(``bootstrap_gcp``) send through google-api-python-client, and the ones
preflight, ``launcher cluster down`` and ``launcher cluster preemptions``
send through google-cloud-compute, at the same paths as Google's servers
(``/compute/v1/...``, ``/cloudresourcemanager/v1/...``, ``/iam/v1/...``):

- Compute: ``instances`` insert / list (with a filter such as Ray's label and
  status one) / get / delete / stop / start / setLabels (label fingerprints
  checked), ``zoneOperations`` list (filter, pages) / get / wait,
  ``globalOperations`` get, ``projects`` get (quotas, metadata) and
  setCommonInstanceMetadata, ``subnetworks`` list, and the read-only
  ``zones``, ``machineTypes``, ``acceleratorTypes``, ``regions`` (quotas) and
  ``images`` getFromFamily, answered from the API's
  :class:`~launcher.lab.compute_world.World` (plain data a test may change;
  by default what :mod:`cluster.zones` and :mod:`cluster.machines` know);
- Resource Manager: ``projects`` get, getIamPolicy, setIamPolicy;
- IAM: ``serviceAccounts`` get (404 until created) and create.

The project-level handlers live in :mod:`launcher.lab.compute_project`, the
world's resources in :mod:`launcher.lab.compute_world`; this module holds the
server, the instances and the operations.

Instances live in memory (:attr:`ComputeAPI.instances`, resources as Compute
Engine returns them). Each insert is checked by Compute Engine's rules
(:mod:`launcher.lab.compute_rules`, which reads :mod:`cluster.machines` and
:mod:`cluster.zones`); a refused one answers as Compute Engine does, HTTP 400
(403 for a quota) with an error body whose message names the rule, and
creates nothing. An accepted one is stored with the scheduling defaults
Compute Engine fills in (a preemptible VM without ``automaticRestart`` gets
false); the GPUs of VMs that are not stopped count against the world's
quotas, and show in their usage. Every call is kept in
:attr:`ComputeAPI.calls` for the rehearsal to print. Operations are done as
soon as they are made (the rehearsal checks requests, not timing) and kept in
the world's zone operations.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from launcher.lab import compute_project
from launcher.lab import compute_rules
from launcher.lab.compute_filter import matches
from launcher.lab.compute_rules import ALL_REGIONS, Gpus, Refusal, last_part, quota_metric, zone_region
from launcher.lab.compute_world import API, World

RUNNING, STOPPED = "RUNNING", "TERMINATED"  # Compute Engine calls a stopped VM TERMINATED
TIME = "2026-01-01T00:00:00.000-00:00"  # when the API's own operations ran


@dataclass
class Call:
    """One request the API answered: what, on which resource, and the rule that refused it."""

    verb: str
    target: str = ""
    refusal: Refusal | None = None
    detail: str = ""
    node_type: str = ""  # the Ray node type an insert was for


class ApiError(Exception):
    """An error answer: HTTP status, reason and message, as Compute Engine's error body has them."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class ComputeAPI:
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
            for pattern, verb, handler in ROUTES:
                m = pattern.match(path)
                if m and method == verb:
                    groups = m.groupdict()
                    if groups.get("project", self.project) != self.project:
                        raise ApiError(404, "notFound", f"The resource 'projects/{groups['project']}' was not found")
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

    # -- instances ----------------------------------------------------------------------------------
    def insert(self, zone: str, body: dict, query: dict) -> dict:
        name = str(body.get("name", ""))
        if query.get("sourceInstanceTemplate"):
            refusal = Refusal(400, "instance template", "the rehearsal does not read instance templates")
        elif name in self.instances:
            refusal = Refusal(409, "instance name", f"The resource '{self._link(zone, name)}' already exists")
        else:
            refusal = self._check(body, zone)
        self.log("insert", name, refusal, compute_rules.describe(body), compute_rules.node_type_of(body))
        if refusal:
            raise ApiError(refusal.status, "quotaExceeded" if refusal.rule == "quota" else "invalid",
                           f"{refusal.message} [rule: {refusal.rule}]")
        self.instances[name] = self._new_instance(zone, body)
        return self.finished("insert", zone, name)

    def _gpus_in_use(self) -> tuple[list[Gpus], list[str]]:
        """GPUs held by VMs that are not stopped (a stopped VM holds no GPU quota), and their regions."""
        held = [(compute_rules.gpus_of(i), zone_region(_zone_of(i)))
                for i in self.instances.values() if i["status"] != STOPPED]
        held = [(g, r) for g, r in held if g]
        return [g for g, _ in held], [r for _, r in held]

    def _check(self, body: dict, zone: str) -> Refusal | None:
        """Compute Engine's rules for a VM in ``zone``, against the quotas there and the GPUs in use."""
        limits, used = self.world.limits(zone_region(zone))
        return compute_rules.check_insert(body, zone, *self._gpus_in_use(), quotas=limits, used=used)

    def held(self, region: str | None) -> Counter[str]:
        """Quota the API's VMs hold: their GPUs per metric in ``region``, and GPUS_ALL_REGIONS."""
        limits = self.world.limits(region)[0]
        held: Counter[str] = Counter()
        for gpus, where in zip(*self._gpus_in_use()):
            held[ALL_REGIONS] += gpus.count
            if where == region:
                held[quota_metric(gpus, limits)] += gpus.count
        return held

    def _new_instance(self, zone: str, body: dict) -> dict:
        n = next(self._ids)
        instance = json.loads(json.dumps(body))
        nics = instance.get("networkInterfaces") or [{"accessConfigs": [{"name": "External NAT",
                                                                          "type": "ONE_TO_ONE_NAT"}]}]
        for nic in nics:
            nic["networkIP"] = f"10.128.0.{n % 250 + 2}"
            for access in nic.get("accessConfigs", []):
                access["natIP"] = f"203.0.113.{n % 250 + 2}"  # TEST-NET-3: never a real address
        instance["scheduling"] = compute_rules.stored_scheduling(body)  # with the defaults GCE fills in
        instance.update({"kind": "compute#instance", "id": str(1000 + n), "status": RUNNING,
                         "zone": f"{API}/projects/{self.project}/zones/{zone}", "networkInterfaces": nics,
                         "labels": dict(body.get("labels") or {}), "labelFingerprint": f"fp{n}",
                         "selfLink": f"{API}/{self._link(zone, body['name'])}"})
        return instance

    def list_instances(self, zone: str, body: dict, query: dict) -> dict:
        # Any zone lists (none found in one Compute Engine lacks): the insert's zone rule says why it is wrong.
        found = [dict(i) for i in self.instances.values()
                 if _zone_of(i) == zone and matches(query.get("filter", ""), i)]
        wanted = "stopped VMs to reuse (cache_stopped_nodes)" if "TERMINATED" in query.get("filter", "") else ""
        self.log("list", f"{len(found)} found", detail=wanted)
        return self._page("compute#instanceList", found, query)

    def get_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self.log("get", name)
        return dict(self._instance(zone, name))

    def delete_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self._instance(zone, name, "delete")
        self.log("delete", name)
        del self.instances[name]
        return self.finished("delete", zone, name)

    def stop_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self._instance(zone, name, "stop")["status"] = STOPPED
        self.log("stop", name)
        return self.finished("stop", zone, name)

    def start_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        instance = self._instance(zone, name, "start")
        refusal = self._check(instance, zone) if instance["status"] == STOPPED else None
        self.log("start", name, refusal)
        if refusal:
            raise ApiError(refusal.status, "quotaExceeded", f"{refusal.message} [rule: {refusal.rule}]")
        instance["status"] = RUNNING
        return self.finished("start", zone, name)

    def set_labels(self, zone: str, name: str, body: dict, query: dict) -> dict:
        instance = self._instance(zone, name, "setLabels")
        if body.get("labelFingerprint") != instance["labelFingerprint"]:
            self.log("setLabels", name, Refusal(412, "label fingerprint", "stale fingerprint"))
            raise ApiError(412, "conditionNotMet",
                           "Labels fingerprint either invalid or resource labels have changed")
        refusal = compute_rules.check_insert({"name": name, "labels": body.get("labels") or {},
                                              "machineType": instance["machineType"]}, zone, [])
        self.log("setLabels", name, refusal if refusal and refusal.rule == "label" else None)
        if refusal and refusal.rule == "label":
            raise ApiError(400, "invalid", f"{refusal.message} [rule: label]")
        instance["labels"] = dict(body.get("labels") or {})
        instance["labelFingerprint"] = f"fp{next(self._ids)}"
        return self.finished("setLabels", zone, name)

    def _instance(self, zone: str, name: str, verb: str = "") -> dict:
        instance = self.instances.get(name)
        if instance is None or _zone_of(instance) != zone:
            if verb:
                self.log(verb, name, Refusal(404, "not found", "no such instance"))
            raise ApiError(404, "notFound", f"The resource '{self._link(zone, name)}' was not found")
        return instance

    def _link(self, zone: str, name: str) -> str:
        return f"projects/{self.project}/zones/{zone}/instances/{name}"

    # -- operations and lists -----------------------------------------------------------------------
    def finished(self, kind: str, zone: str | None, target: str) -> dict:
        """A new operation of ``kind`` on ``target``, done at once; a zone's is kept in the world."""
        op = operation(self.project, kind, zone, target, next(self._ids))
        if zone:
            self.world.operations.setdefault(zone, []).append(op)
        return op

    def get_operation(self, name: str, body: dict, query: dict, zone: str | None = None) -> dict:
        # Every operation is done when made: answer DONE for any name, as a finished one would.
        return {"kind": "compute#operation", "name": name, "status": "DONE", "progress": 100}

    def list_operations(self, zone: str, body: dict, query: dict) -> dict | None:
        if self.world.zone_status(zone) is None:
            return None
        found = [op for op in self.world.operations.get(zone, []) if matches(query.get("filter", ""), op)]
        self.log("zoneOperations.list", zone, detail=query.get("filter", ""))
        return self._page("compute#operationList", found, query)

    def _page(self, kind: str, items: list[dict], query: dict) -> dict:
        """One page of a list, as Compute Engine gives it: ``nextPageToken`` while more follow."""
        size = min(self.world.page_size, int(query.get("maxResults") or self.world.page_size))
        start = int(query.get("pageToken") or 0)
        page = {"kind": kind, "items": items[start:start + size]} if items else {"kind": kind}
        if start + size < len(items):
            page["nextPageToken"] = str(start + size)
        return page

    # -- the world's read-only resources -------------------------------------------------------------
    def get_region(self, region: str, body: dict, query: dict) -> dict | None:
        self.log("regions.get", region)
        return self.world.region(self.project, region, self.held(region))


def operation(project: str, kind: str, zone: str | None, target: str, number: int, when: str = TIME,
              message: str = "") -> dict:
    """A finished operation as Compute Engine lists it: of ``kind`` (``insert``, or a system event such as
    ``compute.instances.preempted``) on instance ``target`` of ``zone`` (None: on the project)."""
    where = f"zones/{zone}" if zone else "global"
    op = {"kind": "compute#operation", "id": str(number), "name": f"operation-{number}", "operationType": kind,
          "status": "DONE", "progress": 100, "statusMessage": message, "insertTime": when, "startTime": when,
          "endTime": when, "selfLink": f"{API}/projects/{project}/{where}/operations/operation-{number}",
          "targetLink": f"{API}/projects/{project}/{where}/instances/{target}" if zone else f"{API}/projects/{project}"}
    if zone:
        op["zone"] = f"{API}/projects/{project}/zones/{zone}"
    return op


def _zone_of(instance: dict) -> str:
    return last_part(str(instance.get("zone", "")))


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
ROUTES = [
    (_route(_ZONE), "GET", _read("zones.get", World.zone)),
    (_route(_ZONE + "/machineTypes/{name}"), "GET", _read("machineTypes.get", World.machine_type)),
    (_route(_ZONE + "/acceleratorTypes/{name}"), "GET", _read("acceleratorTypes.get", World.accelerator_type)),
    (_route("compute/v1/projects/{project}/regions/{region}"), "GET", ComputeAPI.get_region),
    (_route("compute/v1/projects/{image_project}/global/images/family/{family}"), "GET", _image),
    (_route(_ZONE + "/operations"), "GET", ComputeAPI.list_operations),
    (_route(_ZONE + "/instances"), "GET", ComputeAPI.list_instances),
    (_route(_ZONE + "/instances"), "POST", ComputeAPI.insert),
    (_route(_ZONE + "/instances/{name}"), "GET", ComputeAPI.get_instance),
    (_route(_ZONE + "/instances/{name}"), "DELETE", ComputeAPI.delete_instance),
    (_route(_ZONE + "/instances/{name}/stop"), "POST", ComputeAPI.stop_instance),
    (_route(_ZONE + "/instances/{name}/start"), "POST", ComputeAPI.start_instance),
    (_route(_ZONE + "/instances/{name}/setLabels"), "POST", ComputeAPI.set_labels),
    (re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<name>[^/]+)"
                r"(?:/wait)?$"), "GET", ComputeAPI.get_operation),
    (re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<name>[^/]+)"
                r"/wait$"), "POST", ComputeAPI.get_operation),
    (_route("compute/v1/projects/{project}/global/operations/{name}"), "GET", ComputeAPI.get_operation),
    (_route("compute/v1/projects/{project}"), "GET", compute_project.get_project),
    (_route("compute/v1/projects/{project}/setCommonInstanceMetadata"), "POST", compute_project.set_metadata),
    (re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/regions/(?P<region>[^/]+)/subnetworks$"), "GET",
     compute_project.list_subnets),
    (_route("cloudresourcemanager/v1/projects/{project}"), "GET", compute_project.crm_project),
    (_route("cloudresourcemanager/v1/projects/{project}:getIamPolicy"), "POST", compute_project.get_policy),
    (_route("cloudresourcemanager/v1/projects/{project}:setIamPolicy"), "POST", compute_project.set_policy),
    (re.compile(r"^/iam/v1/projects/(?P<project>[^/]+)/serviceAccounts/(?P<email>[^/]+)$"), "GET",
     compute_project.get_account),
    (_route("iam/v1/projects/{project}/serviceAccounts"), "POST", compute_project.create_account),
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
