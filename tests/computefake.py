"""A small Compute Engine REST server on loopback for tests (there is no official emulator).

It answers the paths the real google-cloud-compute client calls with the
REST transport (zones, machine types, accelerator types, regions with quotas,
the project with its global quotas and metadata, images by family, zone
operations with a filter and paging, a zone's instances with a label filter,
and instance deletion), with JSON shaped like the real API's, and 404 errors
like Compute Engine's. The world it serves is plain data that each test can
change; machine facts it needs (built-in GPUs, vCPUs) come from the same
table the launcher uses, :mod:`cluster.machines`.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cluster import machines

API = "https://www.googleapis.com/compute/v1"
PROJECT = "test-project"
PAGE = 2  # operations per page, so the client's pager has to follow nextPageToken


def default_world() -> dict:
    t4, v100, l4 = "nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-l4"
    n1 = {"n1-standard-4": 4, "n1-standard-8": 8, "n1-standard-16": 16, "n1-highmem-8": 8}
    built_in = {m: machines.machine_vcpus(m) for m in ("g2-standard-8", "g2-standard-24", "a2-highgpu-1g")}
    return {
        "zones": {"us-central1-a": "UP", "us-central1-b": "DOWN", "us-central1-f": "UP", "europe-west4-a": "UP"},
        "machine_types": {"us-central1-a": {**n1, **built_in}, "us-central1-b": n1,
                          "us-central1-f": n1, "europe-west4-a": n1},
        "accelerators": {"us-central1-a": {t4: 4, v100: 8, l4: 8, "nvidia-tesla-a100": 16}, "us-central1-b": {t4: 4},
                         "us-central1-f": {t4: 4}, "europe-west4-a": {t4: 4, v100: 8}},
        "quotas": {
            "us-central1": [("CPUS", 96, 8), ("PREEMPTIBLE_CPUS", 0, 0), ("G2_CPUS", 48, 0), ("A2_CPUS", 24, 0),
                            ("NVIDIA_T4_GPUS", 16, 0), ("PREEMPTIBLE_NVIDIA_T4_GPUS", 4, 0),
                            ("NVIDIA_V100_GPUS", 8, 0), ("NVIDIA_L4_GPUS", 4, 0), ("NVIDIA_A100_GPUS", 2, 0),
                            ("INSTANCES", 1000, 3)],
            "europe-west4": [("CPUS", 48, 0), ("NVIDIA_T4_GPUS", 4, 0)],
        },
        # Project-wide: quotas (GPUS_ALL_REGIONS: 0 on a new project) and common instance metadata.
        "project": {"quotas": [("GPUS_ALL_REGIONS", 16, 0), ("CPUS_ALL_REGIONS", 200, 8)], "metadata": {}},
        # zone -> [(name, status, labels)]: the VMs `instances.list` finds.
        "instances": {},
        "images": {"deeplearning-platform-release": {
            "common-cpu": "common-cpu-v20261101-debian-11",
            "common-cu129-ubuntu-2204-nvidia-580": "common-cu129-v20261101-ubuntu-2204-nvidia-580"}},
        "operations": {"us-central1-a": []},
    }


def operation(zone: str, instance: str, when: str, kind: str = "compute.instances.preempted") -> dict:
    """A zone operation as Compute Engine lists it."""
    return {
        "kind": "compute#operation", "id": str(abs(hash((zone, instance, when))) % 10**18),
        "name": f"systemevent-{abs(hash(when)) % 10**12}-{instance[-6:]}", "zone": f"{API}/projects/{PROJECT}/zones/{zone}",
        "operationType": kind, "targetLink": f"{API}/projects/{PROJECT}/zones/{zone}/instances/{instance}",
        "targetId": "4242", "status": "DONE", "user": "system",
        "statusMessage": "Instance was preempted." if kind.endswith("preempted") else "",
        "progress": 100, "insertTime": when, "startTime": when, "endTime": when,
        "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}/operations/op-{instance}",
    }


class FakeCompute:
    """The server and its world; `requests` lists the paths the client asked for."""

    def __init__(self) -> None:
        self.world = default_world()
        self.requests: list[str] = []
        self.deleted: list[str] = []  # instances deleted, as zone/name
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeCompute":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                parsed = urllib.parse.urlparse(self.path)
                fake.requests.append(parsed.path)
                self._send(*fake.answer(parsed.path, urllib.parse.parse_qs(parsed.query)))

            def do_DELETE(self) -> None:  # noqa: N802
                parsed = urllib.parse.urlparse(self.path)
                fake.requests.append("DELETE " + parsed.path)
                self._send(*fake.delete(parsed.path))

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        return Handler

    def answer(self, path: str, query: dict) -> tuple[int, dict]:
        if path == f"/compute/v1/projects/{PROJECT}":
            return self._project()
        m = re.match(r"^/compute/v1/projects/([^/]+)/(.*)$", path)
        if not m or (m.group(1) != PROJECT and not m.group(2).startswith("global/images")):
            return _not_found(path)
        rest = m.group(2)
        for pattern, fn in (
            (r"^zones/([^/]+)$", self._zone),
            (r"^zones/([^/]+)/machineTypes/([^/]+)$", self._machine_type),
            (r"^zones/([^/]+)/acceleratorTypes/([^/]+)$", self._accelerator),
            (r"^regions/([^/]+)$", self._region),
            (r"^global/images/family/([^/]+)$", lambda family: self._image(m.group(1), family)),
            (r"^zones/([^/]+)/operations$", lambda zone: self._operations(zone, query)),
            (r"^zones/([^/]+)/instances$", lambda zone: self._instances(zone, query)),
        ):
            hit = re.match(pattern, rest)
            if hit:
                return fn(*hit.groups())
        return _not_found(path)

    def delete(self, path: str) -> tuple[int, dict]:
        m = re.match(rf"^/compute/v1/projects/{PROJECT}/zones/([^/]+)/instances/([^/]+)$", path)
        if not m:
            return _not_found(path)
        zone, name = m.groups()
        vms = self.world["instances"].get(zone, [])
        if not any(vm[0] == name for vm in vms):
            return _not_found(f"projects/{PROJECT}/zones/{zone}/instances/{name}")
        self.world["instances"][zone] = [vm for vm in vms if vm[0] != name]
        self.deleted.append(f"{zone}/{name}")
        link = f"{API}/projects/{PROJECT}/zones/{zone}"
        return 200, {"kind": "compute#operation", "id": "9001", "name": f"operation-delete-{name}",
                     "zone": link, "operationType": "delete", "targetLink": f"{link}/instances/{name}",
                     "status": "RUNNING", "progress": 0, "selfLink": f"{link}/operations/operation-delete-{name}"}

    def _project(self):
        p = self.world["project"]
        return 200, {"kind": "compute#project", "id": "4711", "name": PROJECT,
                     "quotas": [{"metric": q, "limit": float(lim), "usage": float(use)} for q, lim, use in p["quotas"]],
                     "commonInstanceMetadata": {"kind": "compute#metadata", "fingerprint": "abc=",
                                                "items": [{"key": k, "value": v} for k, v in p["metadata"].items()]},
                     "selfLink": f"{API}/projects/{PROJECT}"}

    def _instances(self, zone, query):
        if zone not in self.world["zones"]:
            return _not_found(f"projects/{PROJECT}/zones/{zone}")
        wanted = re.search(r"labels\.([\w-]+)\s*=\s*\"?([\w-]+)\"?", (query.get("filter") or [""])[0])
        items = [{"kind": "compute#instance", "id": str(1000 + i), "name": name, "status": status, "labels": labels,
                  "zone": f"{API}/projects/{PROJECT}/zones/{zone}",
                  "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}/instances/{name}"}
                 for i, (name, status, labels) in enumerate(self.world["instances"].get(zone, []))
                 if not wanted or labels.get(wanted.group(1)) == wanted.group(2)]
        return 200, {"kind": "compute#instanceList", "id": f"projects/{PROJECT}/zones/{zone}/instances",
                     "items": items, "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}/instances"}

    def _zone(self, zone):
        status = self.world["zones"].get(zone)
        if status is None:
            return _not_found(f"projects/{PROJECT}/zones/{zone}")
        region = zone.rsplit("-", 1)[0]
        return 200, {"kind": "compute#zone", "id": "2000", "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
                     "name": zone, "description": zone, "status": status,
                     "region": f"{API}/projects/{PROJECT}/regions/{region}",
                     "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}",
                     "availableCpuPlatforms": ["Intel Cascade Lake", "AMD Milan"], "supportsPzs": False}

    def _machine_type(self, zone, name):
        cpus = self.world["machine_types"].get(zone, {}).get(name)
        if cpus is None:
            return _not_found(f"projects/{PROJECT}/zones/{zone}/machineTypes/{name}")
        memory_gb = machines.machine_memory_gb(name) or cpus * 4  # N1 from the name; others: 4 GB per vCPU
        return 200, {"kind": "compute#machineType", "id": "3008", "name": name, "guestCpus": cpus,
                     "memoryMb": int(memory_gb * 1024), "maximumPersistentDisks": 128, "zone": zone,
                     "isSharedCpu": False, "description": f"{cpus} vCPUs, {cpus * 3.75:g} GB RAM",
                     "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}/machineTypes/{name}"}

    def _accelerator(self, zone, name):
        most = self.world["accelerators"].get(zone, {}).get(name)
        if most is None:
            return _not_found(f"projects/{PROJECT}/zones/{zone}/acceleratorTypes/{name}")
        return 200, {"kind": "compute#acceleratorType", "id": "10002", "name": name,
                     "description": name.replace("-", " ").title(), "maximumCardsPerInstance": most,
                     "zone": f"{API}/projects/{PROJECT}/zones/{zone}",
                     "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}/acceleratorTypes/{name}"}

    def _region(self, region):
        quotas = self.world["quotas"].get(region)
        if quotas is None:
            return _not_found(f"projects/{PROJECT}/regions/{region}")
        zones = [f"{API}/projects/{PROJECT}/zones/{z}" for z in self.world["zones"] if z.startswith(region + "-")]
        return 200, {"kind": "compute#region", "id": "1000", "name": region, "status": "UP", "zones": zones,
                     "quotas": [{"metric": q, "limit": float(lim), "usage": float(use)} for q, lim, use in quotas],
                     "selfLink": f"{API}/projects/{PROJECT}/regions/{region}"}

    def _image(self, project, family):
        name = self.world["images"].get(project, {}).get(family)
        if name is None:
            return _not_found(f"projects/{project}/global/images/family/{family}")
        return 200, {"kind": "compute#image", "id": "7001", "name": name, "family": family, "status": "READY",
                     "diskSizeGb": "50", "sourceType": "RAW", "architecture": "X86_64",
                     "selfLink": f"{API}/projects/{project}/global/images/{name}"}

    def _operations(self, zone, query):
        if zone not in self.world["zones"]:
            return _not_found(f"projects/{PROJECT}/zones/{zone}")
        ops = list(self.world["operations"].get(zone, []))
        wanted = re.search(r'operationType\s*=\s*"?([\w.]+)"?', (query.get("filter") or [""])[0])
        if wanted:
            ops = [o for o in ops if o["operationType"] == wanted.group(1)]
        start = int((query.get("pageToken") or ["0"])[0])
        body = {"kind": "compute#operationList", "id": f"projects/{PROJECT}/zones/{zone}/operations",
                "items": ops[start:start + PAGE],
                "selfLink": f"{API}/projects/{PROJECT}/zones/{zone}/operations"}
        if start + PAGE < len(ops):
            body["nextPageToken"] = str(start + PAGE)
        return 200, body


def _not_found(resource: str) -> tuple[int, dict]:
    message = f"The resource '{resource}' was not found"
    return 404, {"error": {"code": 404, "message": message,
                           "errors": [{"message": message, "domain": "global", "reason": "notFound"}]}}
