"""The local Compute Engine API's project-level resources: what ``bootstrap_gcp`` and preflight read and write.

Compute's ``projects`` get (project-wide quotas, with the GPUs the API's VMs
hold, and the common instance metadata) and setCommonInstanceMetadata (where
Ray's bootstrap puts its SSH key), the region's ``subnetworks``, Resource
Manager's project and IAM policy, and IAM's service accounts (none until
created). Each is a route handler of :class:`launcher.lab.compute_api.ComputeAPI`
over that API's state (``metadata``, ``policy``, ``service_accounts``); None
answers 404.
"""

from __future__ import annotations

import json
import urllib.parse

from launcher.lab.compute_rules import Refusal
from launcher.lab.compute_world import API, quota_list


def get_project(api, body: dict, query: dict) -> dict:
    api.log("projects.get", api.project)
    return {"kind": "compute#project", "name": api.project, "id": "1", "commonInstanceMetadata": api.metadata,
            "quotas": quota_list(api.world.project_quotas, api.held(None)),
            "selfLink": f"{API}/projects/{api.project}"}


def set_metadata(api, body: dict, query: dict) -> dict:
    api.log("projects.setCommonInstanceMetadata", ", ".join(i.get("key", "") for i in body.get("items", [])))
    op = api.finished("setCommonInstanceMetadata", None, api.project)
    api.metadata = {"kind": "compute#metadata", "fingerprint": op["id"], "items": list(body.get("items", []))}
    return op


def list_subnets(api, region: str, body: dict, query: dict) -> dict:
    api.log("subnetworks.list", region)
    link = f"{API}/projects/{api.project}/regions/{region}/subnetworks/default"
    return {"kind": "compute#subnetworkList", "items": [{"name": "default", "selfLink": link, "region": region}]}


def crm_project(api, body: dict, query: dict) -> dict:
    api.log("cloudresourcemanager.projects.get", api.project)
    return {"projectId": api.project, "name": api.project, "projectNumber": "1", "lifecycleState": "ACTIVE"}


def get_policy(api, body: dict, query: dict) -> dict:
    api.log("cloudresourcemanager.projects.getIamPolicy", api.project)
    return json.loads(json.dumps(api.policy))


def set_policy(api, body: dict, query: dict) -> dict:
    roles = [b.get("role", "") for b in (body.get("policy") or {}).get("bindings", [])]
    api.log("cloudresourcemanager.projects.setIamPolicy", ", ".join(roles))
    api.policy = dict(body.get("policy") or {})
    return api.policy


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
