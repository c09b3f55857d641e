"""The local Compute Engine API's project-level resources: what ``bootstrap_gcp`` and preflight read and write.

Compute's ``projects`` get (project-wide quotas, with what the API's VMs
hold, and the common instance metadata) and setCommonInstanceMetadata (where
Ray's bootstrap puts its SSH key), the region's ``subnetworks``, ``networks``
and ``firewalls``; Resource Manager's project, IAM policy, the caller's
permissions (``testIamPermissions``) and the organization policies in effect
(``getEffectiveOrgPolicy``); IAM's service accounts (none until created);
Service Usage's enabled services. Each is a route handler of
:class:`launcher.lab.compute_api.ComputeAPI` over that API's state
(``metadata``, ``policy``, ``service_accounts``) and its world; None answers
404.

:func:`gate` answers first, as Google's front end does: 403 with reason
``accessNotConfigured`` when the request's API is not enabled in the world,
403 ``forbidden`` when the caller lacks a permission the request needs.
"""

from __future__ import annotations

import json
import urllib.parse

from launcher.lab.compute_rules import ApiError, Refusal
from launcher.lab.compute_world import API, quota_list

PROJECT_NUMBER = "1"
SERVICE_NAMES = {"compute": ("compute.googleapis.com", "Compute Engine API"),
                 "cloudresourcemanager": ("cloudresourcemanager.googleapis.com", "Cloud Resource Manager API"),
                 "iam": ("iam.googleapis.com", "Identity and Access Management (IAM) API"),
                 "serviceusage": ("serviceusage.googleapis.com", "Service Usage API")}


def gate(api, path: str, permissions: tuple[str, ...]) -> None:
    """Refuse a request whose API is disabled, or whose caller lacks one of ``permissions``, as Google does."""
    service, title = SERVICE_NAMES.get(path.strip("/").split("/", 1)[0], ("", ""))
    enabled = api.world.services
    if service and enabled is not None and service not in enabled:
        api.log("disabled", service, Refusal(403, "API disabled", f"{service} is not enabled"))
        raise ApiError(403, "accessNotConfigured", f"{title} has not been used in project {PROJECT_NUMBER} before "
                       f"or it is disabled. Enable it by visiting https://console.developers.google.com/apis/api/"
                       f"{service}/overview?project={PROJECT_NUMBER} then retry.")
    held = api.world.permissions
    missing = [p for p in permissions if held is not None and p not in held]
    if missing:
        resource = path.split("/v1/", 1)[-1]
        api.log("denied", missing[0], Refusal(403, "permission", f"no {missing[0]}"))
        raise ApiError(403, "forbidden", f"Required '{missing[0]}' permission for '{resource}'")


def get_project(api, body: dict, query: dict) -> dict:
    api.log("projects.get", api.project)
    return {"kind": "compute#project", "name": api.project, "id": PROJECT_NUMBER,
            "commonInstanceMetadata": api.metadata,
            "quotas": quota_list(api.world.project_quotas, api.held(None)),
            "selfLink": f"{API}/projects/{api.project}"}


def set_metadata(api, body: dict, query: dict) -> dict:
    said = body.get("fingerprint")
    if said is not None and said != api.metadata["fingerprint"]:  # changed since it was read
        api.log("projects.setCommonInstanceMetadata", "stale fingerprint", Refusal(412, "fingerprint", "stale"))
        raise ApiError(412, "conditionNotMet", "Supplied fingerprint does not match current metadata fingerprint.")
    api.log("projects.setCommonInstanceMetadata", ", ".join(i.get("key", "") for i in body.get("items", [])))
    op = api.finished("setCommonInstanceMetadata", None, api.project)
    api.metadata = {"kind": "compute#metadata", "fingerprint": op["id"], "items": list(body.get("items", []))}
    return op


def list_subnets(api, region: str, body: dict, query: dict) -> dict:
    api.log("subnetworks.list", region)
    return api.page("compute#subnetworkList", api.world.subnets(api.project, region), query)


def get_network(api, name: str, body: dict, query: dict) -> dict | None:
    api.log("networks.get", name)
    return api.world.network(api.project, name)


def list_firewalls(api, body: dict, query: dict) -> dict:
    api.log("firewalls.list", api.project)
    return api.page("compute#firewallList", api.world.rules(api.project), query)


def list_services(api, body: dict, query: dict) -> dict:
    """Service Usage's services.list; the filter ``state:ENABLED`` is the one read (the world lists only those)."""
    api.log("serviceusage.services.list", query.get("filter", ""))
    names = sorted(api.world.services if api.world.services is not None else
                   {name for name, _ in SERVICE_NAMES.values()} | {"storage.googleapis.com"})
    return {"services": [{"name": f"projects/{PROJECT_NUMBER}/services/{n}", "parent": f"projects/{PROJECT_NUMBER}",
                          "state": "ENABLED", "config": {"name": n}} for n in names]}


def test_permissions(api, body: dict, query: dict) -> dict:
    """Resource Manager's testIamPermissions: which of the asked permissions the caller has (needs none)."""
    asked = list(body.get("permissions") or [])
    held = api.world.permissions
    granted = [p for p in asked if held is None or p in held]
    api.log("cloudresourcemanager.projects.testIamPermissions", f"{len(granted)} of {len(asked)} held")
    return {"permissions": granted} if granted else {}


def effective_policy(api, body: dict, query: dict) -> dict:
    constraint = str(body.get("constraint", ""))
    api.log("cloudresourcemanager.projects.getEffectiveOrgPolicy", constraint)
    return {"constraint": constraint, "etag": "BwX", **api.world.org_policies.get(constraint, {})}


def create_project(api, body: dict, query: dict) -> dict:
    api.log("cloudresourcemanager.projects.create", str(body.get("projectId")),
            Refusal(409, "project exists", "the project exists; Ray asked to create it after a 403"))
    raise ApiError(409, "alreadyExists", "Requested entity already exists")


def crm_project(api, body: dict, query: dict) -> dict:
    api.log("cloudresourcemanager.projects.get", api.project)
    return {"projectId": api.project, "name": api.project, "projectNumber": PROJECT_NUMBER, "lifecycleState": "ACTIVE"}


def get_policy(api, body: dict, query: dict) -> dict:
    api.log("cloudresourcemanager.projects.getIamPolicy", api.project)
    return json.loads(json.dumps(api.policy))


def set_policy(api, body: dict, query: dict) -> dict:
    roles = [b.get("role", "") for b in (body.get("policy") or {}).get("bindings", [])]
    api.log("cloudresourcemanager.projects.setIamPolicy", ", ".join(roles))
    api.policy = dict(body.get("policy") or {})
    return api.policy


def delete_account(api, email: str, body: dict, query: dict) -> dict | None:
    email = urllib.parse.unquote(email)
    api.log("iam.serviceAccounts.delete", email)
    return {} if api.service_accounts.pop(email, None) is not None else None


def get_account(api, email: str, body: dict, query: dict) -> dict | None:
    email = urllib.parse.unquote(email)
    account = api.service_accounts.get(email)
    api.log("iam.serviceAccounts.get", email, None if account else Refusal(404, "not found", "none yet"))
    return account


def create_account(api, body: dict, query: dict) -> dict:
    email = f"{body.get('accountId')}@{api.project}.iam.gserviceaccount.com"
    api.log("iam.serviceAccounts.create", email)
    account = {"name": f"projects/{api.project}/serviceAccounts/{email}", "projectId": api.project,
               "email": email, **(body.get("serviceAccount") or {})}
    api.service_accounts[email] = account
    return account
