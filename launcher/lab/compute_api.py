"""A local Compute Engine API: a small real HTTP server on 127.0.0.1 for the ``ray up`` rehearsal.

It answers the REST calls Ray 2.60's GCP node provider and its bootstrap
(``bootstrap_gcp``) send through google-api-python-client, and the ones
``launcher cluster down`` sends through google-cloud-compute, at the same
paths as Google's servers (``/compute/v1/...``, ``/cloudresourcemanager/v1/...``,
``/iam/v1/...``):

- Compute: ``instances`` insert / list (with Ray's label and status filter) /
  get / delete / stop / start / setLabels (label fingerprints checked),
  ``zoneOperations`` get and wait, ``globalOperations`` get, ``projects`` get
  and setCommonInstanceMetadata, ``subnetworks`` list;
- Resource Manager: ``projects`` get, getIamPolicy, setIamPolicy;
- IAM: ``serviceAccounts`` get (404 until created) and create.

Instances live in memory. Each insert is checked by Compute Engine's rules
(:mod:`launcher.lab.compute_rules`, which reads :mod:`cluster.machines` and
:mod:`cluster.zones`); a refused one answers as Compute Engine does, HTTP 400
(403 for a quota) with an error body whose message names the rule, and
creates nothing. An accepted one is stored with the scheduling defaults
Compute Engine fills in (a preemptible VM without ``automaticRestart`` gets
false). Every call
is kept in :attr:`ComputeAPI.calls` for the rehearsal to print. Operations
are done as soon as they are made: the rehearsal checks requests, not timing.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from launcher.lab import compute_rules
from launcher.lab.compute_filter import matches
from launcher.lab.compute_rules import Gpus, Refusal

API = "https://www.googleapis.com/compute/v1"
RUNNING, STOPPED = "RUNNING", "TERMINATED"  # Compute Engine calls a stopped VM TERMINATED


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
    """The local API's state (instances, operations, project metadata, quotas) and its server.

    Args:
        project: the project id it answers for (any other gets 404, as a missing project would).
        quotas: quota metric -> limit (``NVIDIA_L4_GPUS``, ``GPUS_ALL_REGIONS``); others unlimited.
    """

    def __init__(self, project: str, quotas: dict[str, float] | None = None) -> None:
        self.project = project
        self.quotas = dict(quotas or {})
        self.instances: dict[str, dict] = {}
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
        threading.Thread(target=self._server.serve_forever, name="compute-api", daemon=True).start()
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
                    return handler(self, body=body, query=query, **{k: v for k, v in groups.items()
                                                                     if k != "project"})
        raise ApiError(404, "notFound", f"the local Compute API does not answer {method} {path}")

    def _log(self, verb: str, target: str = "", refusal: Refusal | None = None, detail: str = "",
             node_type: str = "") -> None:
        self.calls.append(Call(verb, target, refusal, detail, node_type))

    # -- instances ----------------------------------------------------------------------------------
    def insert(self, zone: str, body: dict, query: dict) -> dict:
        name = str(body.get("name", ""))
        if query.get("sourceInstanceTemplate"):
            refusal = Refusal(400, "instance template", "the rehearsal does not read instance templates")
        elif name in self.instances:
            refusal = Refusal(409, "instance name", f"The resource '{self._link(zone, name)}' already exists")
        else:
            refusal = compute_rules.check_insert(body, zone, *self._gpus_in_use(), quotas=self.quotas)
        self._log("insert", name, refusal, compute_rules.describe(body), compute_rules.node_type_of(body))
        if refusal:
            raise ApiError(refusal.status, "quotaExceeded" if refusal.rule == "quota" else "invalid",
                           f"{refusal.message} [rule: {refusal.rule}]")
        self.instances[name] = self._new_instance(zone, body)
        return self._operation("insert", zone, name)

    def _gpus_in_use(self) -> tuple[list[Gpus], list[str]]:
        """GPUs held by VMs that are not stopped (a stopped VM holds no GPU quota), and their regions."""
        held = [(compute_rules.gpus_of(i), compute_rules.zone_region(i["_zone"]))
                for i in self.instances.values() if i["status"] != STOPPED]
        held = [(g, r) for g, r in held if g]
        return [g for g, _ in held], [r for _, r in held]

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
                         "selfLink": f"{API}/{self._link(zone, body['name'])}", "_zone": zone})
        return instance

    def list_instances(self, zone: str, body: dict, query: dict) -> dict:
        found = [self._public(i) for i in self.instances.values()
                 if i["_zone"] == zone and matches(query.get("filter", ""), i)]
        wanted = "stopped VMs to reuse (cache_stopped_nodes)" if "TERMINATED" in query.get("filter", "") else ""
        self._log("list", f"{len(found)} found", detail=wanted)
        return {"kind": "compute#instanceList", "items": found} if found else {"kind": "compute#instanceList"}

    def get_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self._log("get", name)
        return self._public(self._instance(zone, name))

    def delete_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self._instance(zone, name, "delete")
        self._log("delete", name)
        del self.instances[name]
        return self._operation("delete", zone, name)

    def stop_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self._instance(zone, name, "stop")["status"] = STOPPED
        self._log("stop", name)
        return self._operation("stop", zone, name)

    def start_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        instance = self._instance(zone, name, "start")
        refusal = compute_rules.check_insert(
            {k: v for k, v in instance.items() if not k.startswith("_")}, zone,
            *self._gpus_in_use(), quotas=self.quotas) if instance["status"] == STOPPED else None
        self._log("start", name, refusal)
        if refusal:
            raise ApiError(refusal.status, "quotaExceeded", f"{refusal.message} [rule: {refusal.rule}]")
        instance["status"] = RUNNING
        return self._operation("start", zone, name)

    def set_labels(self, zone: str, name: str, body: dict, query: dict) -> dict:
        instance = self._instance(zone, name, "setLabels")
        if body.get("labelFingerprint") != instance["labelFingerprint"]:
            self._log("setLabels", name, Refusal(412, "label fingerprint", "stale fingerprint"))
            raise ApiError(412, "conditionNotMet",
                           "Labels fingerprint either invalid or resource labels have changed")
        refusal = compute_rules.check_insert({"name": name, "labels": body.get("labels") or {},
                                              "machineType": instance["machineType"]}, zone, [])
        self._log("setLabels", name, refusal if refusal and refusal.rule == "label" else None)
        if refusal and refusal.rule == "label":
            raise ApiError(400, "invalid", f"{refusal.message} [rule: label]")
        instance["labels"] = dict(body.get("labels") or {})
        instance["labelFingerprint"] = f"fp{next(self._ids)}"
        return self._operation("setLabels", zone, name)

    def _instance(self, zone: str, name: str, verb: str = "") -> dict:
        instance = self.instances.get(name)
        if instance is None or instance["_zone"] != zone:
            if verb:
                self._log(verb, name, Refusal(404, "not found", "no such instance"))
            raise ApiError(404, "notFound", f"The resource '{self._link(zone, name)}' was not found")
        return instance

    @staticmethod
    def _public(instance: dict) -> dict:
        return {k: v for k, v in instance.items() if not k.startswith("_")}

    def _link(self, zone: str, name: str) -> str:
        return f"projects/{self.project}/zones/{zone}/instances/{name}"

    # -- operations ---------------------------------------------------------------------------------
    def _operation(self, kind: str, zone: str | None, target: str) -> dict:
        where = f"zones/{zone}" if zone else "global"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": f"operation-{next(self._ids)}",
              "operationType": kind, "status": "DONE", "progress": 100,
              "targetLink": f"{API}/{self._link(zone, target)}" if zone else f"{API}/projects/{self.project}",
              "insertTime": "2026-01-01T00:00:00.000-00:00", "endTime": "2026-01-01T00:00:01.000-00:00"}
        op["selfLink"] = f"{API}/projects/{self.project}/{where}/operations/{op['name']}"
        if zone:
            op["zone"] = f"{API}/projects/{self.project}/zones/{zone}"
        return op

    def get_operation(self, name: str, body: dict, query: dict, zone: str | None = None) -> dict:
        # Every operation is done when made: answer DONE for any name, as a finished one would.
        return {"kind": "compute#operation", "name": name, "status": "DONE", "progress": 100}

    # -- project, subnets, IAM (what bootstrap_gcp reads and writes) --------------------------------
    def get_project(self, body: dict, query: dict) -> dict:
        self._log("projects.get", self.project)
        return {"kind": "compute#project", "name": self.project, "id": "1",
                "commonInstanceMetadata": self.metadata, "quotas": [
                    {"metric": m, "limit": float(v), "usage": 0.0} for m, v in self.quotas.items()
                    if m == compute_rules.ALL_REGIONS]}

    def set_metadata(self, body: dict, query: dict) -> dict:
        self._log("projects.setCommonInstanceMetadata", ", ".join(i.get("key", "") for i in body.get("items", [])))
        self.metadata = {"kind": "compute#metadata", "fingerprint": str(next(self._ids)),
                         "items": list(body.get("items", []))}
        return self._operation("setCommonInstanceMetadata", None, self.project)

    def list_subnets(self, region: str, body: dict, query: dict) -> dict:
        self._log("subnetworks.list", region)
        link = f"{API}/projects/{self.project}/regions/{region}/subnetworks/default"
        return {"kind": "compute#subnetworkList", "items": [{"name": "default", "selfLink": link, "region": region}]}

    def crm_project(self, body: dict, query: dict) -> dict:
        self._log("cloudresourcemanager.projects.get", self.project)
        return {"projectId": self.project, "name": self.project, "projectNumber": "1", "lifecycleState": "ACTIVE"}

    def get_policy(self, body: dict, query: dict) -> dict:
        self._log("cloudresourcemanager.projects.getIamPolicy", self.project)
        return json.loads(json.dumps(self.policy))

    def set_policy(self, body: dict, query: dict) -> dict:
        roles = [b.get("role", "") for b in (body.get("policy") or {}).get("bindings", [])]
        self._log("cloudresourcemanager.projects.setIamPolicy", ", ".join(roles))
        self.policy = dict(body.get("policy") or {})
        return self.policy

    def get_account(self, email: str, body: dict, query: dict) -> dict:
        email = urllib.parse.unquote(email)
        account = self.service_accounts.get(email)
        self._log("iam.serviceAccounts.get", email, None if account else Refusal(404, "not found", "none yet"))
        if account is None:
            raise ApiError(404, "notFound", f"Unknown service account {email}")
        return account

    def create_account(self, body: dict, query: dict) -> dict:
        email = f"{body.get('accountId')}@{self.project}.iam.gserviceaccount.com"
        self._log("iam.serviceAccounts.create", email)
        account = {"name": f"projects/{self.project}/serviceAccounts/{email}", "projectId": self.project,
                   "email": email, **(body.get("serviceAccount") or {})}
        self.service_accounts[email] = account
        return account


def _route(pattern: str) -> re.Pattern:
    names = {"project": r"(?P<project>[^/:]+)", "zone": r"(?P<zone>[^/]+)", "name": r"(?P<name>[^/]+)"}
    for key, regex in names.items():
        pattern = pattern.replace("{" + key + "}", regex)
    return re.compile("^/" + pattern + "$")


_ZONE = "compute/v1/projects/{project}/zones/{zone}"
ROUTES = [
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
    (_route("compute/v1/projects/{project}"), "GET", ComputeAPI.get_project),
    (_route("compute/v1/projects/{project}/setCommonInstanceMetadata"), "POST", ComputeAPI.set_metadata),
    (re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/regions/(?P<region>[^/]+)/subnetworks$"), "GET",
     ComputeAPI.list_subnets),
    (_route("cloudresourcemanager/v1/projects/{project}"), "GET", ComputeAPI.crm_project),
    (_route("cloudresourcemanager/v1/projects/{project}:getIamPolicy"), "POST", ComputeAPI.get_policy),
    (_route("cloudresourcemanager/v1/projects/{project}:setIamPolicy"), "POST", ComputeAPI.set_policy),
    (re.compile(r"^/iam/v1/projects/(?P<project>[^/]+)/serviceAccounts/(?P<email>[^/]+)$"), "GET",
     ComputeAPI.get_account),
    (_route("iam/v1/projects/{project}/serviceAccounts"), "POST", ComputeAPI.create_account),
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
