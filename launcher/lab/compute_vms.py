"""The local Compute Engine API's VMs: instances, their disks, and the operations that change them.

:class:`VMs` is the part of :class:`launcher.lab.compute_api.ComputeAPI` that
answers ``instances`` insert / list / aggregatedList / get / delete / stop /
start / setLabels, ``disks`` list / delete and ``zoneOperations`` list / get /
wait, over its ``instances``, ``disks`` and ``operations`` (resources as
Compute Engine returns them).

An insert is checked by Compute Engine's rules (:mod:`launcher.lab.compute_rules`)
against the quotas of the world and what the API's VMs and disks hold; a
refused one answers HTTP 400 (403 for a quota; 412, as Compute Engine answers it, for an external IP that
the organization policy ``compute.vmExternalIpAccess`` forbids) and creates nothing. An
accepted one is stored with the scheduling defaults Compute Engine fills in
(a Spot or preemptible VM that leaves out ``automaticRestart`` and
``onHostMaintenance`` gets false and TERMINATE), and each of its disks becomes
a disk resource: deleting the VM deletes those with ``autoDelete`` and leaves
the others (their size still counts against the disk quota). Operations are
done when made. A machine type the world has out of stock answers the insert
as Compute Engine does: the request is taken (HTTP 200), and its operation
ends with the error ``ZONE_RESOURCE_POOL_EXHAUSTED`` (which Ray's provider
raises after polling it), with no VM made.
"""

from __future__ import annotations

import json
from collections import Counter

from cluster.bootstrap import NO_EXTERNAL_IP, external_ip_forbidden
from cluster.quotas import external_addresses, project_wide, vm_usage
from launcher.lab import compute_rules
from launcher.lab.compute_filter import matches
from launcher.lab.compute_rules import ApiError, Refusal, last_part, zone_region
from launcher.lab.compute_project import PROJECT_NUMBER
from launcher.lab.compute_world import API

RUNNING, STOPPED = "RUNNING", "TERMINATED"  # Compute Engine calls a stopped VM TERMINATED
TIME = "2026-01-01T00:00:00.000-00:00"  # when the API's own operations ran
STOCKOUT = "ZONE_RESOURCE_POOL_EXHAUSTED"


class VMs:
    """Instances, disks and operations; mixed into ComputeAPI, which holds the state and the log."""

    project: str
    instances: dict[str, dict]
    disks: dict[str, dict]
    operations: dict[str, dict]

    def insert(self, zone: str, body: dict, query: dict) -> dict:
        name = str(body.get("name", ""))
        if query.get("sourceInstanceTemplate"):
            refusal = Refusal(400, "instance template", "the rehearsal does not read instance templates")
        elif name in self.instances:
            refusal = Refusal(409, "instance name", f"The resource '{self._link(zone, name)}' already exists")
        else:
            refusal = self._check(body, zone) or self._org_policy(zone, body)
        stocked_out = None
        if refusal is None and self.world.out_of_stock(last_part(str(body.get("machineType", "")))):
            stocked_out = (f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources "
                           "available to fulfill the request.  Try a different zone, or try again later.")
        self.log("insert", name, refusal or (Refusal(503, "stock-out", f"{STOCKOUT}: {stocked_out}")
                                             if stocked_out else None),
                 compute_rules.describe(body), compute_rules.node_type_of(body))
        if refusal:
            reason = {"quota": "quotaExceeded", "org policy": "conditionNotMet"}.get(refusal.rule, "invalid")
            raise ApiError(refusal.status, reason, f"{refusal.message} [rule: {refusal.rule}]")
        if stocked_out:  # taken, then failed: nothing is made
            return self.finished("insert", zone, name, {"code": STOCKOUT, "message": stocked_out})
        self.instances[name] = self._new_instance(zone, body)
        return self.finished("insert", zone, name)

    def _check(self, body: dict, zone: str) -> Refusal | None:
        """Compute Engine's rules for a VM in ``zone``, against the quotas there and what is held."""
        region = zone_region(zone)
        limits, used = self.world.limits(region)
        return compute_rules.check_insert(body, zone, quotas=limits, used=Counter(used) + self.held(region))

    def _org_policy(self, zone: str, body: dict) -> Refusal | None:
        """An external IP the organization policy vmExternalIpAccess forbids: HTTP 412, in Compute Engine's words."""
        policy = self.world.org_policies.get(NO_EXTERNAL_IP, {}).get("listPolicy") or {}
        instance = self._link(zone, str(body.get("name", "")))
        if not external_addresses(body) or not external_ip_forbidden(policy, instance):
            return None
        return Refusal(412, "org policy", f"Constraint {NO_EXTERNAL_IP} violated for project {PROJECT_NUMBER}. Add "
                       f"instance {instance} to the constraint to use external IP with it.",
                       "an organization policy administrator must allow external IPs (gcloud resource-manager "
                       "org-policies delete compute.vmExternalIpAccess --project PROJECT): `ray up` reaches the head "
                       "on its external IP")

    def held(self, region: str | None) -> Counter[str]:
        """Quota the API's VMs and disks hold in ``region``, and project-wide (stopped VMs: their disks only)."""
        limits = self.world.limits(region)[0]
        held: Counter[str] = Counter()
        for i in self.instances.values():
            if i["status"] != STOPPED:
                for metric, n in vm_usage({**i, "disks": []}, limits).items():
                    if project_wide(metric) or zone_region(_zone_of(i)) == region:
                        held[metric] += n
        for d in self.disks.values():
            if zone_region(_zone_of(d)) == region:
                held.update(vm_usage({"disks": [{"diskSizeGb": d["sizeGb"], "diskType": d["type"]}]}, limits,
                                     running=False))
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
        link = f"{API}/{self._link(zone, body['name'])}"
        instance.update({"kind": "compute#instance", "id": str(1000 + n), "status": RUNNING,
                         "zone": f"{API}/projects/{self.project}/zones/{zone}", "networkInterfaces": nics,
                         "labels": dict(body.get("labels") or {}), "labelFingerprint": f"fp{n}",
                         "disks": self._make_disks(zone, body, link), "selfLink": link})
        return instance

    def _make_disks(self, zone: str, body: dict, user: str) -> list[dict]:
        """A disk resource for each disk the insert creates; the instance's attached-disk entries."""
        attached = []
        for index, disk in enumerate(body.get("disks") or []):
            init = disk.get("initializeParams") or {}
            name = init.get("diskName") or (body["name"] if disk.get("boot") else f"{body['name']}-{index}")
            where = f"{API}/projects/{self.project}/zones/{zone}"
            size = str(init.get("diskSizeGb") or 10)
            self.disks[name] = {"kind": "compute#disk", "name": name, "sizeGb": size, "zone": where,
                                "type": f"{where}/diskTypes/{last_part(str(init.get('diskType') or 'pd-standard'))}",
                                "users": [user], "labels": dict(init.get("labels") or {}), "status": "READY",
                                "selfLink": f"{where}/disks/{name}"}
            attached.append({"kind": "compute#attachedDisk", "index": index, "boot": bool(disk.get("boot")),
                             "autoDelete": bool(disk.get("autoDelete")), "deviceName": disk.get("deviceName") or name,
                             "type": "PERSISTENT", "mode": "READ_WRITE", "diskSizeGb": size,
                             "source": f"{where}/disks/{name}"})
        return attached

    def list_instances(self, zone: str, body: dict, query: dict) -> dict:
        # Any zone lists (none found in one Compute Engine lacks): the insert's zone rule says why it is wrong.
        found = [dict(i) for i in self.instances.values()
                 if _zone_of(i) == zone and matches(query.get("filter", ""), i)]
        wanted = "stopped VMs to reuse (cache_stopped_nodes)" if "TERMINATED" in query.get("filter", "") else ""
        self.log("list", f"{len(found)} found", detail=wanted)
        return self.page("compute#instanceList", found, query)

    def aggregated_instances(self, body: dict, query: dict) -> dict:
        """instances.aggregatedList: the project's VMs, every zone, keyed ``zones/ZONE``."""
        by_zone: dict[str, list] = {}
        for i in self.instances.values():
            if matches(query.get("filter", ""), i):
                by_zone.setdefault(f"zones/{_zone_of(i)}", []).append(dict(i))
        self.log("aggregatedList", f"{sum(map(len, by_zone.values()))} found")
        return {"kind": "compute#instanceAggregatedList", "items": {z: {"instances": v} for z, v in by_zone.items()}}

    def get_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self.log("get", name)
        return dict(self._instance(zone, name))

    def delete_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        instance = self._instance(zone, name, "delete")
        self.log("delete", name)
        for disk in instance.get("disks") or []:  # autoDelete disks go with it; the others stay, detached
            kept = self.disks.get(last_part(disk.get("source", "")))
            if kept is not None and disk.get("autoDelete"):
                del self.disks[kept["name"]]
            elif kept is not None:
                kept["users"] = [u for u in kept["users"] if u != instance["selfLink"]]
        del self.instances[name]
        return self.finished("delete", zone, name)

    def stop_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        self._instance(zone, name, "stop")["status"] = STOPPED
        self.log("stop", name)
        return self.finished("stop", zone, name)

    def start_instance(self, zone: str, name: str, body: dict, query: dict) -> dict:
        instance = self._instance(zone, name, "start")
        refusal = None
        if instance["status"] == STOPPED:  # its disks are held already: count the rest
            refusal = self._check({**instance, "disks": []}, zone)
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
                                              "machineType": instance["machineType"]}, zone)
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

    # -- disks ----------------------------------------------------------------------------------------
    def list_disks(self, zone: str, body: dict, query: dict) -> dict:
        found = [dict(d) for d in self.disks.values() if _zone_of(d) == zone and matches(query.get("filter", ""), d)]
        self.log("disks.list", f"{len(found)} found")
        return self.page("compute#diskList", found, query)

    def delete_disk(self, zone: str, name: str, body: dict, query: dict) -> dict:
        disk = self.disks.get(name)
        if disk is None or _zone_of(disk) != zone:
            raise ApiError(404, "notFound", f"The resource 'projects/{self.project}/zones/{zone}/disks/{name}' "
                           "was not found")
        if disk["users"]:
            self.log("disks.delete", name, Refusal(400, "disk in use", f"used by {last_part(disk['users'][0])}"))
            raise ApiError(400, "resourceInUseByAnotherResource", f"The disk resource '{disk['selfLink']}' is "
                           f"already being used by '{disk['users'][0]}'")
        self.log("disks.delete", name)
        del self.disks[name]
        return self.finished("delete", zone, name, resource="disks")

    # -- operations -----------------------------------------------------------------------------------
    def finished(self, kind: str, zone: str | None, target: str, error: dict | None = None,
                 resource: str = "instances") -> dict:
        """A new operation of ``kind`` on ``target``, done at once (with ``error``, failed); kept by name,
        and a zone's in the world's zone operations."""
        op = operation(self.project, kind, zone, target, next(self._ids), resource=resource)
        if error:
            op.update({"error": {"errors": [error]}, "httpErrorStatusCode": 503,
                       "httpErrorMessage": "SERVICE UNAVAILABLE"})
        self.operations[op["name"]] = op
        if zone:
            self.world.operations.setdefault(zone, []).append(op)
        return op

    def get_operation(self, name: str, body: dict, query: dict, zone: str | None = None) -> dict | None:
        return self.operations.get(name)

    def list_operations(self, zone: str, body: dict, query: dict) -> dict | None:
        if self.world.zone_status(zone) is None:
            return None
        found = [op for op in self.world.operations.get(zone, []) if matches(query.get("filter", ""), op)]
        self.log("zoneOperations.list", zone, detail=query.get("filter", ""))
        return self.page("compute#operationList", found, query)

    def page(self, kind: str, items: list[dict], query: dict) -> dict:
        """One page of a list, as Compute Engine gives it: ``nextPageToken`` while more follow."""
        size = min(self.world.page_size, int(query.get("maxResults") or self.world.page_size))
        start = int(query.get("pageToken") or 0)
        page = {"kind": kind, "items": items[start:start + size]} if items else {"kind": kind}
        if start + size < len(items):
            page["nextPageToken"] = str(start + size)
        return page


def operation(project: str, kind: str, zone: str | None, target: str, number: int, when: str = TIME,
              message: str = "", resource: str = "instances") -> dict:
    """A finished operation as Compute Engine lists it: of ``kind`` (``insert``, or a system event such as
    ``compute.instances.preempted``) on instance ``target`` of ``zone`` (None: on the project)."""
    where = f"zones/{zone}" if zone else "global"
    op = {"kind": "compute#operation", "id": str(number), "name": f"operation-{number}", "operationType": kind,
          "status": "DONE", "progress": 100, "statusMessage": message, "insertTime": when, "startTime": when,
          "endTime": when, "selfLink": f"{API}/projects/{project}/{where}/operations/operation-{number}",
          "targetLink": (f"{API}/projects/{project}/{where}/{resource}/{target}" if zone
                         else f"{API}/projects/{project}")}
    if zone:
        op["zone"] = f"{API}/projects/{project}/zones/{zone}"
    return op


def _zone_of(resource: dict) -> str:
    return last_part(str(resource.get("zone", "")))
