"""Preflight for Ray's GCP bootstrap: what `ray up` asks of the project before its first VM, checked first.

Ray 2.60's ``bootstrap_gcp`` (``ray/autoscaler/_private/gcp/config.py``)
reads the project through Cloud Resource Manager (a 403 is taken as "no such
project", and it then tries ``projects.create``), creates the service account
``ray-autoscaler-sa-v1`` if it is missing and binds it four roles (with
``setIamPolicy`` on the project, only when a binding is missing), adds an SSH
key to the project's metadata, and puts every node that names no network on
the region's first subnet; then `ray up` creates the VMs as the caller. Here,
read-only, before any of that:

- the APIs it calls are enabled (Service Usage ``services.list``): compute,
  iam, cloudresourcemanager;
- the caller has the permissions it uses (Resource Manager
  ``testIamPermissions`` on the project, which needs none itself), those to
  create the account and bind its roles only where that is still to do;
- the service account exists, or may be created; a node's own service account
  exists;
- organization policies, where the caller may read them: one forbidding
  external IPs (Ray reaches the head on its external IP) or requiring OS
  Login (which ignores the key Ray puts in the project's metadata);
- the network, its subnets and firewall rules: :mod:`cluster.network`.

Each problem is one :class:`~cluster.preflight.Check` whose fix is the
``gcloud`` command that mends it. The Google clients are
google-api-python-client's, from the discovery documents it ships (the
library Ray's provider uses), pointed at ``LAUNCHER_COMPUTE_ENDPOINT`` when it
is set, as :class:`cluster.compute.Compute` is.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from cluster.checks import FAIL, OK, WARN, Check
from cluster.compute import ENDPOINT_ENV, SERVICE_PATHS
from cluster.quotas import external_addresses
from launcher.errors import Unreachable, UserError

RAY_ACCOUNT_ID = "ray-autoscaler-sa-v1"
RAY_ACCOUNT = RAY_ACCOUNT_ID + "@{project}.iam.gserviceaccount.com"
RAY_ROLES = ("roles/storage.objectAdmin", "roles/compute.admin", "roles/iam.serviceAccountUser",
             "roles/iam.roleViewer")
APIS = {"compute.googleapis.com": "Compute Engine", "iam.googleapis.com": "IAM",
        "cloudresourcemanager.googleapis.com": "Cloud Resource Manager"}
NO_EXTERNAL_IP = "constraints/compute.vmExternalIpAccess"
OS_LOGIN = "constraints/compute.requireOsLogin"
ME = "user:$(gcloud config get-value account)"


def external_ip_forbidden(list_policy: dict, instance: str | None = None) -> bool:
    """Whether an effective ``compute.vmExternalIpAccess`` list policy forbids an external IP on ``instance``
    (``projects/P/zones/Z/instances/NAME``; None: a VM whose name is not known in advance, as Ray's are).
    Compute Engine allows one only where the policy allows all values or lists the instance."""
    if list_policy.get("allValues") == "ALLOW":
        return False
    if list_policy.get("allValues") == "DENY":
        return True
    if instance is not None and instance in (list_policy.get("deniedValues") or []):
        return True
    return bool(list_policy.get("allowedValues")) and instance not in list_policy["allowedValues"]
# What `ray up` does with each permission; the predefined role to ask for, by permission prefix.
VM_WORK = "`ray up` creates, lists, labels and deletes the cluster's VMs"
PERMISSIONS = {
    "resourcemanager.projects.get": "Ray's bootstrap reads the project (and takes a 403 for 'no such project', "
                                    "then tries to create it)",
    "resourcemanager.projects.getIamPolicy": "Ray's bootstrap reads the project's IAM policy",
    "iam.serviceAccounts.get": f"Ray's bootstrap looks up {RAY_ACCOUNT_ID}",
    "compute.projects.get": "Ray's bootstrap reads the project's SSH keys",
    "iam.serviceAccounts.actAs": "the cluster's VMs run as a service account",
    **{f"compute.{p}": VM_WORK for p in (
        "instances.create", "instances.get", "instances.list", "instances.delete", "instances.setLabels",
        "instances.setMetadata", "instances.setServiceAccount", "disks.create", "subnetworks.use",
        "zoneOperations.get", "globalOperations.get")},
}
ROLE = {"iam.serviceAccounts.actAs": "roles/iam.serviceAccountUser", "resourcemanager.projects.get": "roles/browser",
        "iam": "roles/iam.serviceAccountAdmin", "resourcemanager": "roles/resourcemanager.projectIamAdmin",
        "compute": "roles/compute.admin"}


class Refused(Exception):
    """A Google API's error answer: HTTP status, reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message

    @property
    def disabled(self) -> bool:
        return self.reason in ("accessNotConfigured", "SERVICE_DISABLED") or "is disabled" in self.message


class ProjectApis:
    """Service Usage, Cloud Resource Manager and IAM for one project (google-api-python-client)."""

    def __init__(self, project: str, endpoint: str | None = None) -> None:
        self.project = project
        self.endpoint = endpoint if endpoint is not None else os.environ.get(ENDPOINT_ENV) or None
        self._built: dict[str, Any] = {}

    def _api(self, name: str, version: str = "v1"):
        if name not in self._built:
            from googleapiclient import discovery

            if self.endpoint:
                from google.auth.credentials import AnonymousCredentials

                credentials = AnonymousCredentials()
                options = {"api_endpoint": f"{self.endpoint}/{SERVICE_PATHS[name]}"}
            else:
                import google.auth

                try:
                    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
                except Exception as exc:  # DefaultCredentialsError and friends
                    raise UserError(f"no Google Cloud credentials: {type(exc).__name__}",
                                    "run `gcloud auth application-default login`") from None
                options = None
            self._built[name] = discovery.build(name, version, credentials=credentials, client_options=options,
                                                cache_discovery=False, static_discovery=True)
        return self._built[name]

    def _run(self, request) -> dict:
        from googleapiclient.errors import HttpError

        try:
            return request.execute(num_retries=2)
        except HttpError as exc:
            details = exc.error_details[0] if isinstance(exc.error_details, list) and exc.error_details else {}
            reason = details.get("reason", "") if isinstance(details, dict) else ""
            raise Refused(exc.resp.status, reason, str(exc.reason or "")[:300]) from None
        except OSError as exc:
            raise Unreachable(f"a Google API did not answer ({type(exc).__name__})",
                              "check the network (or LAUNCHER_COMPUTE_ENDPOINT, when set)") from None

    def enabled(self) -> set[str]:
        """The project's enabled APIs (``compute.googleapis.com``, ...)."""
        services, found, token = self._api("serviceusage").services(), set(), None
        while True:
            page = self._run(services.list(parent=f"projects/{self.project}", filter="state:ENABLED",
                                           pageSize=200, pageToken=token))
            found |= {s["name"].rsplit("/", 1)[-1] for s in page.get("services", [])}
            token = page.get("nextPageToken")
            if not token:
                return found

    def granted(self, permissions: list[str]) -> set[str]:
        request = self._api("cloudresourcemanager").projects().testIamPermissions(
            resource=self.project, body={"permissions": permissions})
        return set(self._run(request).get("permissions", []))

    def account(self, email: str) -> dict | None:
        try:
            return self._run(self._api("iam").projects().serviceAccounts().get(
                name=f"projects/{self.project}/serviceAccounts/{email}"))
        except Refused as exc:
            if exc.status == 404:
                return None
            raise

    def delete_account(self, email: str) -> None:
        self._run(self._api("iam").projects().serviceAccounts().delete(
            name=f"projects/{self.project}/serviceAccounts/{email}"))

    def policy(self) -> dict:
        return self._run(self._api("cloudresourcemanager").projects().getIamPolicy(
            resource=self.project, body={"options": {"requestedPolicyVersion": 3}}))

    def set_policy(self, policy: dict) -> None:
        self._run(self._api("cloudresourcemanager").projects().setIamPolicy(resource=self.project,
                                                                            body={"policy": policy}))

    def org_policy(self, constraint: str) -> dict:
        return self._run(self._api("cloudresourcemanager").projects().getEffectiveOrgPolicy(
            resource=f"projects/{self.project}", body={"constraint": constraint}))


def api_checks(apis: ProjectApis) -> list[Check]:
    """The APIs Ray calls are enabled; a FAIL for a disabled Compute Engine API ends preflight."""
    p = apis.project
    try:
        enabled = apis.enabled()
    except Refused as exc:
        return [Check(WARN, f"cannot list the APIs enabled in project {p} (Service Usage answered {exc.status}: "
                      f"{exc.message.split('. ')[0][:120]})",
                      f"see them with `gcloud services list --enabled --project {p}`; "
                      f"Ray needs {', '.join(APIS)}")]
    off = [s for s in APIS if s not in enabled]
    if not off:
        return [Check(OK, f"the {', '.join(APIS.values())} APIs are enabled in project {p}")]
    return [Check(FAIL, f"{' and '.join(APIS[s] for s in off)} API{'s are' if len(off) > 1 else ' is'} not enabled in "
                  f"project {p}: Ray's bootstrap and `ray up` call {'them' if len(off) > 1 else 'it'}",
                  f"gcloud services enable {' '.join(off)} --project {p}")]


def access_checks(config: dict[str, Any], apis: ProjectApis) -> list[Check]:
    """The caller's permissions for what Ray's bootstrap and `ray up` do, and the service accounts."""
    p, account = apis.project, RAY_ACCOUNT.format(project=apis.project)
    wanted = dict(PERMISSIONS)
    if "ssh_private_key" not in (config.get("auth") or {}):
        wanted["compute.projects.setCommonInstanceMetadata"] = "Ray's bootstrap adds its SSH key to the project"
    if not all("networkInterfaces" in (t.get("node_config") or {}) for t in config["available_node_types"].values()):
        wanted["compute.subnetworks.list"] = "Ray's bootstrap picks the region's first subnet"
    if any(_external(t.get("node_config") or {}) for t in config["available_node_types"].values()):
        wanted["compute.subnetworks.useExternalIp"] = "the cluster's VMs get external IPs"
    if (config.get("provider") or {}).get("cache_stopped_nodes"):
        wanted.update({"compute.instances.stop": VM_WORK, "compute.instances.start": VM_WORK})
    maybe = {"iam.serviceAccounts.create": f"Ray's bootstrap creates {RAY_ACCOUNT_ID}",
             "resourcemanager.projects.setIamPolicy": f"Ray's bootstrap binds {RAY_ACCOUNT_ID}'s roles"}
    try:
        granted = apis.granted(sorted({*wanted, *maybe}))
    except Refused as exc:
        what = "the Cloud Resource Manager API is disabled" if exc.disabled else \
            f"Cloud Resource Manager answers {exc.status} (no such project, or your account has no role in it)"
        return [Check(FAIL, f"project {p}: {what}; Ray's bootstrap takes that for 'no such project' and tries to "
                      f"create one named {p}", f"gcloud services enable cloudresourcemanager.googleapis.com "
                      f"--project {p}" if exc.disabled else "check the project id (`gcloud projects list`)")]
    try:
        checks, exists = _account_checks(config, apis, granted, account)
        bound = exists and _roles_bound(apis, granted, account)
    except Refused as exc:  # the IAM API is off (said above), or the policy cannot be read
        checks, exists, bound = [Check(WARN, f"cannot look up service account {account} ({exc.status}: "
                                       f"{exc.message.split('. ')[0][:120]})")], True, False
    if not exists:
        wanted["iam.serviceAccounts.create"] = maybe["iam.serviceAccounts.create"]
    if not bound:
        wanted["resourcemanager.projects.setIamPolicy"] = maybe["resourcemanager.projects.setIamPolicy"]
    missing: dict[str, list[str]] = defaultdict(list)
    for permission in sorted(wanted):
        if permission not in granted:
            missing[ROLE.get(permission) or ROLE[permission.split(".")[0]]].append(permission)
    for role, lacking in missing.items():
        more = f" and {len(lacking) - 2} more" if len(lacking) > 2 else ""
        checks.append(Check(FAIL, f"your account lacks {', '.join(lacking[:2])}{more} in project {p}: "
                            f"{wanted[lacking[0]]}", f"gcloud projects add-iam-policy-binding {p} --member={ME} "
                            f"--role={role}"))
    if not missing:
        checks.append(Check(OK, f"your account has the {len(wanted)} permissions Ray's bootstrap and `ray up` use"))
    return checks


def _account_checks(config: dict, apis: ProjectApis, granted: set[str], account: str) -> tuple[list[Check], bool]:
    """Ray's account exists or may be made; each node's own account exists. Returns (checks, Ray's exists)."""
    if "iam.serviceAccounts.get" not in granted:
        return [], True  # said with the missing permissions
    p, checks = apis.project, []
    exists = apis.account(account) is not None
    if exists:
        checks.append(Check(OK, f"service account {account} exists"))
    elif "iam.serviceAccounts.create" in granted:
        checks.append(Check(OK, f"service account {account} does not exist yet; `ray up` creates it"))
    else:
        checks.append(Check(FAIL, f"service account {account} does not exist, and your account may not create it",
                            f"gcloud iam service-accounts create {RAY_ACCOUNT_ID} --project {p} (someone with "
                            "roles/iam.serviceAccountAdmin)"))
    for email, node_type in sorted(_node_accounts(config).items()):
        if email != account and apis.account(email) is None:
            checks.append(Check(FAIL, f"node type {node_type} runs as service account {email}, which does not "
                                f"exist in project {p}", f"gcloud iam service-accounts create {email.split('@')[0]} "
                                f"--project {p}, or pass --service-account an existing one"))
    return checks, exists


def _roles_bound(apis: ProjectApis, granted: set[str], account: str) -> bool:
    """Whether Ray's account has its four roles already (then `ray up` need not set the IAM policy)."""
    if "resourcemanager.projects.getIamPolicy" not in granted:
        return False
    member = f"serviceAccount:{account}"
    bound = {b.get("role") for b in apis.policy().get("bindings", []) if member in b.get("members", [])}
    return set(RAY_ROLES) <= bound


def policy_checks(config: dict[str, Any], apis: ProjectApis) -> list[Check]:
    """Organization policies that break `ray up`: no external IPs (Ray's SSH goes to the head's external IP),
    OS Login required (it ignores Ray's key). Where the caller may not read them, one warning."""
    p, checks = apis.project, []
    try:
        external = apis.org_policy(NO_EXTERNAL_IP).get("listPolicy") or {}
        os_login = (apis.org_policy(OS_LOGIN).get("booleanPolicy") or {}).get("enforced", False)
    except Refused as exc:
        return [Check(WARN, f"cannot read project {p}'s organization policies ({exc.status}): one that forbids "
                      "external IPs or requires OS Login makes `ray up` fail, or wait 900 s for SSH",
                      f"gcloud resource-manager org-policies describe compute.requireOsLogin --effective --project {p}"
                      " (and compute.vmExternalIpAccess), or ask for roles/orgpolicy.policyViewer")]
    heads = [n for n, t in config["available_node_types"].items()
             if n == config.get("head_node_type") and _external(t.get("node_config") or {})]
    if heads and external_ip_forbidden(external):
        checks.append(Check(FAIL, f"an organization policy ({NO_EXTERNAL_IP}) forbids external IPs on project {p}'s "
                            "VMs: Compute Engine refuses the head, which Ray reaches over SSH on its external IP",
                            f"gcloud resource-manager org-policies delete compute.vmExternalIpAccess --project {p} "
                            "(an organization policy administrator; one set on the organization needs an exception)"))
    else:
        checks.append(Check(OK, f"no organization policy forbids the head's external IP ({NO_EXTERNAL_IP})"))
    if os_login:
        checks.append(Check(FAIL, f"an organization policy ({OS_LOGIN}) requires OS Login on project {p}'s VMs: it "
                            "ignores the SSH key Ray adds to the project, so `ray up` would wait 900 s for SSH",
                            "gcloud resource-manager org-policies disable-enforce compute.requireOsLogin "
                            f"--project {p} (an organization policy administrator)"))
    else:
        checks.append(Check(OK, f"no organization policy requires OS Login ({OS_LOGIN})"))
    return checks


def _node_accounts(config: dict) -> dict[str, str]:
    found = {}
    for name, node_type in config["available_node_types"].items():
        for sa in (node_type.get("node_config") or {}).get("serviceAccounts") or []:
            if sa.get("email") and sa["email"] != "default":
                found.setdefault(sa["email"], name)
    return found


def _external(node_config: dict) -> bool:
    return external_addresses(node_config) > 0
