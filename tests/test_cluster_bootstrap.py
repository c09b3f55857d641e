"""Issue 62: what Ray's bootstrap needs of a project, checked by preflight against the local API answering as
a real project would (disabled APIs, missing permissions, org policies, networks, firewall rules, quotas); the
local API's 403s, stock-outs and Spot defaults; nothing left billing after a failed `ray up` or `ray down`.

Fast tier: the local Compute API runs in this process (google-cloud-compute and google-api-python-client talk
to it over HTTP); no Ray cluster starts. `ray` itself is a stand-in script where a test needs `ray up` to fail.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import urllib.request

import pytest
import yaml

import launcher
from cluster.bootstrap import NO_EXTERNAL_IP, OS_LOGIN
from cluster.compute import Compute
from cluster.config import ray_cluster_config
from cluster.preflight import FAIL, WARN, run_checks
from cluster.spec import ClusterSpec
from launcher.cli import cluster as cli_cluster
from launcher._deferred import checkout
from launcher.cli.main import main
from launcher.errors import UserError
from launcher.lab.compute_api import ComputeAPI
from launcher.lab.compute_world import World, firewall
from test_cluster_preflight import PROJECT, by_status, cluster_file, fake, load  # noqa: F401  (fake: a fixture)

RAY_SA = f"ray-autoscaler-sa-v1@{PROJECT}.iam.gserviceaccount.com"
ZONE = "us-central1-a"


class AllBut(set):
    """The caller's permissions: every one except those listed."""

    def __contains__(self, permission) -> bool:
        return not super().__contains__(permission)


def checks_of(tmp_path, **values):
    return run_checks(load(cluster_file(tmp_path, **values)), Compute(PROJECT))


def failed(checks) -> list[tuple[str, str]]:
    return [(c.what, c.fix) for c in by_status(checks, FAIL)]


# -- preflight: what Ray's bootstrap needs -----------------------------------------------------------------

def test_a_project_with_every_problem_is_one_line_each_with_its_gcloud_fix(tmp_path, fake, capsys):
    fake.world.services = {"compute.googleapis.com", "cloudresourcemanager.googleapis.com",
                           "serviceusage.googleapis.com"}  # IAM is off
    fake.world.permissions = AllBut({"compute.instances.create", "compute.disks.create"})
    fake.world.org_policies = {OS_LOGIN: {"booleanPolicy": {"enforced": True}},
                               NO_EXTERNAL_IP: {"listPolicy": {"allValues": "DENY"}}}
    fake.world.firewalls = [firewall(PROJECT, "default-allow-icmp", "default", ["0.0.0.0/0"], [("icmp", None)])]
    fake.world.quotas["us-central1"].update({"SSD_TOTAL_GB": (500, 100), "IN_USE_ADDRESSES": (8, 6)})
    path = cluster_file(tmp_path, preset="standard-1", cluster_name="demo")
    assert main(["cluster", "preflight", path]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("  FAIL")]
    fixes = [line.strip() for line in out.splitlines() if line.strip().startswith("->")]
    assert len(fails) == len(fixes) == 8, out
    assert "  FAIL  IAM API is not enabled in project test-project: Ray's bootstrap and `ray up` call it" in out
    assert "-> gcloud services enable iam.googleapis.com --project test-project" in out
    assert ("FAIL  your account lacks compute.disks.create, compute.instances.create in project test-project: "
            "`ray up` creates, lists, labels and deletes the cluster's VMs") in out
    assert "-> gcloud projects add-iam-policy-binding test-project --member=user:$(gcloud config get-value " \
           "account) --role=roles/compute.admin" in out
    assert f"FAIL  an organization policy ({NO_EXTERNAL_IP}) forbids external IPs" in out
    assert f"FAIL  an organization policy ({OS_LOGIN}) requires OS Login" in out
    assert "-> gcloud resource-manager org-policies disable-enforce compute.requireOsLogin --project " \
           "test-project" in out
    assert "FAIL  firewall: no rule of network default lets SSH (tcp:22) reach the head" in out
    assert "-> gcloud compute firewall-rules create ray-ssh --project test-project --network default " \
           "--direction INGRESS --allow tcp:22 --source-ranges YOUR_IP/32" in out
    assert "FAIL  firewall: network default blocks tcp 6379, 8076, 10002, 19999, 33017 between the nodes" in out
    assert "-> gcloud compute firewall-rules create ray-internal --project test-project --network default " \
           "--direction INGRESS --allow tcp,udp,icmp --source-ranges 10.128.0.0/20" in out  # us-central1's subnet
    # 5 VMs x 100 GB pd-balanced; 5 external addresses
    assert "FAIL  quota SSD_TOTAL_GB in us-central1: the cluster needs 500, 400 free (limit 500, in use 100)" in out
    assert "FAIL  quota IN_USE_ADDRESSES in us-central1: the cluster needs 5, 2 free (limit 8, in use 6)" in out
    assert "cannot look up service account" in out  # IAM off: said once as a warning, not a traceback
    assert "Traceback" not in out and out.strip().endswith("preflight: 8 check(s) failed, 1 warning(s)")


def test_a_disabled_compute_api_ends_preflight_at_its_line(tmp_path, fake):
    fake.world.services = {"serviceusage.googleapis.com", "iam.googleapis.com",
                           "cloudresourcemanager.googleapis.com"}
    checks = checks_of(tmp_path)
    assert failed(checks) == [("Compute Engine API is not enabled in project test-project: Ray's bootstrap and "
                               "`ray up` call it", "gcloud services enable compute.googleapis.com --project "
                               "test-project")]
    assert not any("zone" in c.what for c in checks)  # nothing asked of an API that answers 403


def test_without_service_usage_rights_the_apis_are_a_warning(tmp_path, fake):
    fake.world.permissions = AllBut({"serviceusage.services.list"})
    checks = checks_of(tmp_path)
    assert [c.what.split(" (")[0] for c in by_status(checks, WARN)] == \
        ["cannot list the APIs enabled in project test-project"]
    assert failed(checks) == []


def test_a_project_resource_manager_cannot_read_is_one_fail(tmp_path, fake):
    """Ray's bootstrap takes a 403 from projects.get for 'no such project' and tries projects.create."""
    fake.world.services = {"serviceusage.googleapis.com", "compute.googleapis.com", "iam.googleapis.com"}
    whats = [w for w, _ in failed(checks_of(tmp_path))]
    assert "project test-project: the Cloud Resource Manager API is disabled; Ray's bootstrap takes that for 'no " \
           "such project' and tries to create one named test-project" in whats


def test_the_service_account_exists_or_may_be_made(tmp_path, fake):
    checks = checks_of(tmp_path)
    assert f"service account {RAY_SA} does not exist yet; `ray up` creates it" in [c.what for c in checks]
    fake.world.permissions = AllBut({"iam.serviceAccounts.create"})
    assert failed(checks_of(tmp_path))[0] == (
        f"service account {RAY_SA} does not exist, and your account may not create it",
        "gcloud iam service-accounts create ray-autoscaler-sa-v1 --project test-project (someone with "
        "roles/iam.serviceAccountAdmin)")
    # Once it exists with its four roles, neither creating it nor setting the IAM policy is needed.
    fake.service_accounts[RAY_SA] = {"email": RAY_SA, "projectId": PROJECT}
    fake.world.permissions = AllBut({"iam.serviceAccounts.create", "resourcemanager.projects.setIamPolicy"})
    roles = ["roles/storage.objectAdmin", "roles/compute.admin", "roles/iam.serviceAccountUser", "roles/iam.roleViewer"]
    fake.policy["bindings"] = [{"role": r, "members": [f"serviceAccount:{RAY_SA}"]} for r in roles[:3]]
    assert [w for w, _ in failed(checks_of(tmp_path))] == [
        "your account lacks resourcemanager.projects.setIamPolicy in project test-project: Ray's bootstrap binds "
        "ray-autoscaler-sa-v1's roles"]  # one role is not bound yet
    fake.policy["bindings"].append({"role": roles[3], "members": [f"serviceAccount:{RAY_SA}"]})
    checks = checks_of(tmp_path)
    assert failed(checks) == [] and f"service account {RAY_SA} exists" in [c.what for c in checks]


def test_a_nodes_own_service_account_must_exist(tmp_path, fake):
    mine = f"trainer@{PROJECT}.iam.gserviceaccount.com"
    assert failed(checks_of(tmp_path, service_account=mine))[0][0] == \
        f"node type n1-standard-8 runs as service account {mine}, which does not exist in project test-project"


def test_org_policies_that_cannot_be_read_are_a_warning(tmp_path, fake):
    fake.world.permissions = AllBut({"orgpolicy.policy.get"})
    warned = [c for c in by_status(checks_of(tmp_path), WARN) if "organization policies" in c.what]
    assert len(warned) == 1 and "roles/orgpolicy.policyViewer" in warned[0].fix
    fake.world.permissions = None
    fake.world.org_policies = {NO_EXTERNAL_IP: {"listPolicy": {"allowedValues": ["projects/p/zones/z/instances/x"]}}}
    assert [w for w, _ in failed(checks_of(tmp_path))] == [
        f"an organization policy ({NO_EXTERNAL_IP}) forbids external IPs on project test-project's VMs: Compute "
        "Engine refuses the head, which Ray reaches over SSH on its external IP"]


# -- preflight: the network ---------------------------------------------------------------------------------

def test_a_custom_mode_network_needs_a_subnetwork(tmp_path, fake):
    fake.world.networks = {"default": {"auto": True, "subnets": {"us-central1": ("default", "10.128.0.0/20")}},
                           "corp": {"auto": False, "subnets": {"us-central1": ("corp-us", "10.8.0.0/20")}}}
    assert failed(checks_of(tmp_path, network="corp"))[0] == (
        "n1-standard-8, ray_head: network corp is a custom-mode VPC, and Compute Engine refuses a VM that names it "
        "without a subnetwork (us-central1's subnets of it: corp-us)",
        "launcher cluster config --network corp --subnetwork SUBNET")
    checks = checks_of(tmp_path, network="corp", subnetwork="corp-us")
    assert "every node lands on subnet corp-us of network corp in us-central1" in [c.what for c in checks]
    assert "firewall: no rule of network corp lets SSH" in " ".join(w for w, _ in failed(checks))  # a new VPC
    wrong = failed(checks_of(tmp_path, network="default", subnetwork="corp-us"))
    assert wrong[0][0] == "n1-standard-8, ray_head: subnetwork corp-us belongs to network corp, not default"
    assert failed(checks_of(tmp_path, subnetwork="nowhere"))[0][0] == \
        "n1-standard-8, ray_head: subnetwork nowhere does not exist in us-central1"


def test_rays_first_subnet_of_another_network_is_a_warning(tmp_path, fake):
    fake.world.networks = {"legacy": {"auto": False, "subnets": {"us-central1": ("old", "192.168.0.0/24")}},
                           "default": {"auto": True, "subnets": {"us-central1": ("default", "10.128.0.0/20")}}}
    warned = [c for c in by_status(checks_of(tmp_path), WARN) if "lands on" in c.what]
    assert warned[0].what.startswith("n1-standard-8, ray_head lands on old of network legacy, the first of "
                                     "us-central1's subnets")
    assert warned[0].fix == "name the one you want: launcher cluster config --subnetwork SUBNET"


def test_firewall_rules_are_read_as_compute_engine_applies_them(tmp_path, fake):
    rules = fake.world.rules(PROJECT)
    # A deny of SSH at a higher priority (a lower number) wins over default-allow-ssh.
    fake.world.firewalls = rules + [firewall(PROJECT, "no-ssh", "default", ["0.0.0.0/0"], [("tcp", "22")],
                                             priority=1000, denied=True)]
    assert "firewall: no rule of network default lets SSH" in failed(checks_of(tmp_path))[0][0]
    # SSH from one office range only: fine, and said.
    fake.world.firewalls = [r for r in rules if r["name"] != "default-allow-ssh"] + [
        firewall(PROJECT, "office-ssh", "default", ["198.51.100.0/24"], [("tcp", "22")], priority=900)]
    assert "firewall: SSH (tcp:22) reaches the head from 198.51.100.0/24 only (your address must be in it) " \
           "(rule office-ssh)" in [c.what for c in checks_of(tmp_path)]
    # A rule for tagged VMs only does not apply to the cluster's untagged nodes; IAP's range is not Ray's SSH.
    fake.world.firewalls = [r for r in rules if r["name"] != "default-allow-ssh"] + [
        firewall(PROJECT, "tagged", "default", ["0.0.0.0/0"], [("tcp", "22")], targets=["bastion"]),
        firewall(PROJECT, "iap", "default", ["35.235.240.0/20"], [("tcp", "22")])]
    assert "firewall: no rule of network default lets SSH" in failed(checks_of(tmp_path))[0][0]
    # Only Ray's two fixed ports between the nodes: the random ones are blocked.
    fake.world.firewalls = [r for r in rules if r["name"] != "default-allow-internal"] + [
        firewall(PROJECT, "ray-fixed", "default", ["10.128.0.0/9"], [("tcp", "6379"), ("tcp", "8076")])]
    assert failed(checks_of(tmp_path))[0][0].startswith("firewall: network default blocks tcp 10002, 19999, 33017 "
                                                        "between the nodes (10.128.0.0/20)")
    # A cluster without workers needs no rule between nodes.
    assert failed(checks_of(tmp_path, preset="basic")) == []


# -- the local API answers as a real project ---------------------------------------------------------------

def test_the_local_api_refuses_as_google_does(tmp_path):
    world = World(services={"serviceusage.googleapis.com", "compute.googleapis.com"},
                  permissions=AllBut({"compute.zones.get"}))
    with ComputeAPI(PROJECT, world) as api:
        with pytest.raises(UserError, match=r"permission denied \(GET .*: Required 'compute.zones.get' permission"):
            Compute(PROJECT, endpoint=api.url).zone(ZONE)
        world.services.discard("compute.googleapis.com")
        with pytest.raises(UserError, match="the Compute Engine API is not enabled in the project"):
            Compute(PROJECT, endpoint=api.url).zone(ZONE)
        request = urllib.request.Request(f"{api.url}/iam/v1/projects/{PROJECT}/serviceAccounts/{RAY_SA}")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 403 and error["errors"][0]["reason"] == "accessNotConfigured"
        assert error["message"].startswith("Identity and Access Management (IAM) API has not been used in project")


def test_rays_provider_meets_the_403_preflight_warns_of(tmp_path):
    """What preflight says is missing is what the real Ray bootstrap and provider are refused."""
    from launcher.lab.rehearsal import rehearse

    config = load(cluster_file(tmp_path, preset="basic"))
    world = World(permissions=AllBut({"compute.instances.create"}))
    lines: list[str] = []
    report = rehearse(config, world=world, say=lines.append)
    assert [(c.verb, c.refusal.rule) for c in report.refused] == [("denied", "permission")], "\n".join(lines)
    assert not [c for c in report.calls if c.verb == "insert"] and report.left == []


def test_an_external_ip_an_org_policy_forbids_is_refused_as_compute_engine_does(tmp_path):
    """Preflight's FAIL for the policy is what Ray's provider meets: the head's insert, 412 conditionNotMet."""
    from launcher.lab.rehearsal import rehearse

    config = load(cluster_file(tmp_path, preset="basic"))
    world = World(org_policies={NO_EXTERNAL_IP: {"listPolicy": {"allValues": "DENY"}}})
    lines: list[str] = []
    report = rehearse(config, world=world, say=lines.append)
    [refused] = report.refused
    assert (refused.verb, refused.refusal.status, refused.refusal.rule) == ("insert", 412, "org policy")
    assert refused.refusal.message.startswith(f"Constraint {NO_EXTERNAL_IP} violated for project 1. Add instance "
                                              f"projects/{PROJECT}/zones/{ZONE}/instances/ray-")
    assert refused.refusal.message.endswith("to the constraint to use external IP with it.")
    assert report.left == []
    # an interface without accessConfigs has no external IP: the same policy lets it in
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    head["networkInterfaces"] = [{"network": f"projects/{PROJECT}/global/networks/default"}]
    assert rehearse(config, world=world, say=lines.append).refused == []


@pytest.mark.parametrize("policy, allowed", [
    ({}, True), ({"allValues": "ALLOW"}, True), ({"allValues": "DENY"}, False),
    ({"allowedValues": ["projects/p/zones/z/instances/vm"]}, True),
    ({"allowedValues": ["projects/p/zones/z/instances/other"]}, False),
    ({"deniedValues": ["projects/p/zones/z/instances/vm"]}, False),
])
def test_the_external_ip_policy_reads_as_compute_engine_applies_it(policy, allowed):
    from cluster.bootstrap import external_ip_forbidden

    assert external_ip_forbidden(policy, "projects/p/zones/z/instances/vm") is not allowed
    # a VM whose name nobody knows in advance (Ray's) is in no allow list, and in no deny list
    assert external_ip_forbidden(policy) is (policy.get("allValues") == "DENY" or "allowedValues" in policy)


def test_a_stock_out_fails_the_operation_and_leaves_nothing(tmp_path, capsys):
    path = tmp_path / "g2.yaml"
    path.write_text(yaml.safe_dump(load(cluster_file(tmp_path, worker_machine_type="g2-standard-8",
                                                     min_workers=1))))
    assert main(["cluster", "rehearse", str(path), "--stockout", "g2-standard-8"]) == 0
    out = capsys.readouterr().out
    assert "refused [stock-out]" not in out and "taken, then its operation failed [stock-out]: " \
        "ZONE_RESOURCE_POOL_EXHAUSTED: The zone 'projects/test-project/zones/us-central1-a' does not have enough " \
        "resources available" in out
    assert "stock-out: 1 insert(s) taken, then failed" in out and "left in the API at the end: nothing" in out
    assert "delete       ray-launcher-head-" in out  # `ray down` took the head away
    assert main(["cluster", "rehearse", str(path), "--stockout", "all"]) == 0
    assert "workers g2-standard-8" not in capsys.readouterr().out  # `ray up` ends at the head's failure
    assert main(["cluster", "rehearse", str(path), "--fail-head-setup"]) == 2
    assert "--fail-head-setup needs --up" in capsys.readouterr().err
    assert main(["cluster", "rehearse", str(path), "--fresh-install"]) == 2
    assert "--fresh-install needs --up" in capsys.readouterr().err


def test_the_client_waits_for_an_operation_and_says_its_error():
    world = World(stocked_out={"n1-standard-4"})
    with ComputeAPI(PROJECT, world) as api:
        body = {"name": "vm-1", "machineType": f"zones/{ZONE}/machineTypes/n1-standard-4"}
        op = api.answer("POST", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances", {}, body)
        assert op["error"]["errors"][0]["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED" and api.instances == {}
        answer = api.answer("GET", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/operations/{op['name']}", {}, {})
        assert answer["httpErrorStatusCode"] == 503 and answer["status"] == "DONE"


def test_spot_scheduling_is_filled_in_by_compute_engine_not_asked_of_the_client(tmp_path, fake):
    body = {"name": "spot-1", "machineType": f"zones/{ZONE}/machineTypes/n1-standard-8",
            "guestAccelerators": [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}],
            "scheduling": {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE"}}
    fake.answer("POST", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances", {}, body)
    assert fake.instances["spot-1"]["scheduling"] == {
        "provisioningModel": "SPOT", "instanceTerminationAction": "DELETE", "automaticRestart": False,
        "onHostMaintenance": "TERMINATE"}
    config = load(cluster_file(tmp_path, accelerator_type="nvidia-tesla-t4", provisioning="spot"))
    for node in config["available_node_types"].values():
        node["node_config"].get("scheduling", {}).pop("onHostMaintenance", None)
        node["node_config"].get("scheduling", {}).pop("automaticRestart", None)
    assert not [c for c in by_status(run_checks(config, Compute(PROJECT)), FAIL) if "TERMINATE" in c.what]


def test_quotas_count_what_the_apis_vms_hold():
    world = World.with_limits({"IN_USE_ADDRESSES": 1, "SSD_TOTAL_GB": 150}, ZONE)
    vm = {"machineType": f"zones/{ZONE}/machineTypes/n1-standard-4", "networkInterfaces": [
        {"accessConfigs": [{"type": "ONE_TO_ONE_NAT"}]}], "disks": [{"boot": True, "initializeParams": {
            "diskSizeGb": 100, "diskType": f"zones/{ZONE}/diskTypes/pd-balanced"}}]}
    with ComputeAPI(PROJECT, world) as api:
        insert = f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances"
        api.answer("POST", insert, {}, {**vm, "name": "vm-1"})
        with pytest.raises(Exception, match=r"Quota 'IN_USE_ADDRESSES' exceeded. Limit: 1.0 in region us-central1 "
                                            r"\(1 in use, 1 asked for\)"):
            api.answer("POST", insert, {}, {**vm, "name": "vm-2"})
        api.answer("POST", f"{insert}/vm-1/stop", {}, {})  # a stopped VM gives back its address, not its disk
        with pytest.raises(Exception, match=r"Quota 'SSD_TOTAL_GB' exceeded. Limit: 150.0 in region us-central1 "
                                            r"\(100 in use, 100 asked for\)"):
            api.answer("POST", insert, {}, {**vm, "name": "vm-2"})


# -- nothing left billing ---------------------------------------------------------------------------------

HEAD = {"name": "ray-demo-head-0badf00d-compute", "machineType": f"zones/{ZONE}/machineTypes/n1-standard-4",
        "labels": {"ray-cluster-name": "demo", "ray-node-kind": "head"},
        "networkInterfaces": [{"accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}],
        "disks": [{"boot": True, "autoDelete": True, "initializeParams": {
            "diskSizeGb": 100, "diskType": f"zones/{ZONE}/diskTypes/pd-balanced"}}]}


def failing_ray_up(tmp_path, monkeypatch) -> None:
    """A stand-in `ray` whose `up` creates the head through the API, as Ray's provider does, then fails (as a
    head setup does); `down` does nothing."""
    script = tmp_path / "ray"
    script.write_text(f"""#!{sys.executable}
import json, os, sys, urllib.request
if sys.argv[1] == "up":
    url = os.environ["LAUNCHER_COMPUTE_ENDPOINT"] + "/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances"
    urllib.request.urlopen(urllib.request.Request(url, data={json.dumps(HEAD)!r}.encode(),
                                                  method="POST", headers={{"Content-Type": "application/json"}}))
    print("Failed to setup head node.")
    sys.exit(1)
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(cli_cluster, "_ray", lambda: str(script))


def test_a_failed_ray_up_deletes_what_it_made_and_only_that(tmp_path, fake, monkeypatch, capsys):
    failing_ray_up(tmp_path, monkeypatch)
    fake.add_vms(ZONE, [("ray-demo-worker-00000001-compute", "RUNNING", {"ray-cluster-name": "demo"})])
    path = cluster_file(tmp_path, cluster_name="demo")
    assert main(["cluster", "up", path, "--skip-preflight"]) == 1
    out = capsys.readouterr().out
    assert "left as they were (there before `ray up`): ray-demo-worker-00000001-compute" in out
    assert "`ray up` failed: deleting the 1 VM(s) it made (--keep-on-failure keeps them):" in out
    assert "  ray-demo-head-0badf00d-compute: n1-standard-4, RUNNING (bills by the second); disk " \
           "ray-demo-head-0badf00d-compute 100 GB, external IP 203.0.113." in out
    assert fake.deleted == [f"{ZONE}/ray-demo-head-0badf00d-compute"] and fake.disks == {}
    assert list(fake.instances) == ["ray-demo-worker-00000001-compute"]


def test_a_failed_ray_up_kept_says_what_bills_and_how_to_delete_it(tmp_path, fake, monkeypatch, capsys):
    failing_ray_up(tmp_path, monkeypatch)
    path = cluster_file(tmp_path, cluster_name="demo")
    assert main(["cluster", "up", path, "--skip-preflight", "--keep-on-failure"]) == 1
    out = capsys.readouterr().out
    assert "`ray up` failed; kept what it made (--keep-on-failure), billing until deleted:" in out
    assert f"delete it all: launcher cluster down {path}" in out
    assert f"or: gcloud compute instances delete ray-demo-head-0badf00d-compute --zone {ZONE} --project " \
           f"{PROJECT} --quiet" in out
    assert fake.deleted == [] and "ray-demo-head-0badf00d-compute" in fake.instances
    assert main(["cluster", "down", path]) == 0  # and it does
    assert fake.instances == {} and fake.disks == {}


def test_cluster_down_deletes_disks_no_vm_uses(tmp_path, fake, monkeypatch, capsys):
    failing_ray_up(tmp_path, monkeypatch)
    kept_disk = {**HEAD, "disks": [{**HEAD["disks"][0], "autoDelete": False}]}
    fake.answer("POST", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances", {}, kept_disk)
    fake.answer("DELETE", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances/{HEAD['name']}", {}, {})
    assert list(fake.disks) == [HEAD["name"]]  # autoDelete false: the disk outlives its VM, and bills
    assert main(["cluster", "down", cluster_file(tmp_path, cluster_name="demo")]) == 0
    assert f"deleted 1 disk(s) of cluster demo that no VM used: {HEAD['name']} (100 GB pd-balanced)" in \
        capsys.readouterr().out
    assert fake.disks == {}


def test_cluster_down_purge_removes_rays_key_and_account_once_no_cluster_is_left(tmp_path, fake, monkeypatch,
                                                                                   capsys):
    failing_ray_up(tmp_path, monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path))
    key = tmp_path / ".ssh" / f"ray-autoscaler_gcp_us-central1_{PROJECT}_ubuntu_0"
    key.parent.mkdir()
    key.write_text("PRIVATE")
    (tmp_path / ".ssh" / (key.name + ".pub")).write_text("ssh-rsa AAAAours")
    fake.metadata["items"] = [{"key": "ssh-keys", "value": "ubuntu:ssh-rsa AAAAours ubuntu\nalice:ssh-rsa AAAAhers "
                                                           "alice"}, {"key": "enable-oslogin", "value": "FALSE"}]
    fake.service_accounts[RAY_SA] = {"email": RAY_SA}
    fake.policy["bindings"] = [{"role": "roles/compute.admin", "members": [f"serviceAccount:{RAY_SA}", "user:a@b.c"]},
                               {"role": "roles/iam.roleViewer", "members": [f"serviceAccount:{RAY_SA}"]}]
    fake.add_vms("us-east1-b", [("ray-other-head-1-compute", "RUNNING", {"ray-cluster-name": "other"})])
    path = cluster_file(tmp_path, cluster_name="demo")
    assert main(["cluster", "down", path, "--purge"]) == 1
    assert "Ray cluster VMs still use them: ray-other-head-1-compute (cluster other)" in capsys.readouterr().out
    assert RAY_SA in fake.service_accounts and key.exists()
    del fake.instances["ray-other-head-1-compute"]
    assert main(["cluster", "down", path, "--purge"]) == 0
    out = capsys.readouterr().out
    assert f"removed 1 SSH key(s) of Ray's from project {PROJECT}'s metadata" in out
    assert f"deleted service account {RAY_SA}" in out and "roles/compute.admin, roles/iam.roleViewer" in out
    assert {i["key"]: i["value"] for i in fake.metadata["items"]} == {
        "ssh-keys": "alice:ssh-rsa AAAAhers alice", "enable-oslogin": "FALSE"}
    assert fake.policy["bindings"] == [{"role": "roles/compute.admin", "members": ["user:a@b.c"]}]
    assert fake.service_accounts == {} and not key.exists() and not os.path.exists(str(key) + ".pub")


@pytest.mark.integration
@pytest.mark.parametrize("inject", [{"fail_head_setup": True}, {"stockout": ("n1-standard-4",)}],
                         ids=["head-setup-fails", "stock-out"])
def test_a_failed_launcher_cluster_up_leaves_nothing_in_the_api(inject, gcs_emulator):
    """`launcher cluster rehearse --up` with a failure injected: the real `ray up` over SSH fails (the head's
    setup exits 1, or the head's insert operation fails with ZONE_RESOURCE_POOL_EXHAUSTED), and `launcher
    cluster up` deletes what it made: no VM, no disk left in the local API."""
    from launcher.lab.ray_up import rehearse_up
    from launcher.lab.sshd import missing_tools

    missing = missing_tools()
    if missing:
        pytest.skip(f"the ray up rehearsal needs {', '.join(missing)} (CI installs openssh-server and rsync)")
    config = ray_cluster_config(ClusterSpec.from_mapping({
        "project": "my-project", "cluster_name": "rehearse-fail", "source_dir": checkout()}).validated(),
        launcher.__version__)
    lines: list[str] = []
    # no run starts, so the bucket is never written
    report = rehearse_up(config, gcs_emulator.url, "no-run", say=lines.append, timeout_s=170, **inject)
    text = "\n".join(lines)
    assert report.ok and report.failed_as_injected and report.left == [] and report.ray_left == [], text
    inserts = [c for c in report.calls if c.verb == "insert"]
    assert len(inserts) == 1 and "-head-" in inserts[0].target, text
    if "stockout" in inject:
        assert inserts[0].refusal.rule == "stock-out" and "left no VM of cluster rehearse-fail" in text, text
        assert not [c for c in report.calls if c.verb == "delete"]
    else:
        assert inserts[0].refusal is None and "rehearsal: the injected head setup failure" in text, text
        assert [c.target for c in report.calls if c.verb == "delete"] == [inserts[0].target], text
        assert "`ray up` failed: deleting the 1 VM(s) it made" in text, text
