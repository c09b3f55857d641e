"""The `ray up` rehearsal (launcher.lab.rehearsal, launcher.lab.compute_api, launcher cluster rehearse).

Ray's real GCP node provider and bootstrap, through the real Google API
client, against the local Compute Engine API: every generated GPU family
rehearses clean and leaves nothing behind; hand-broken files are refused by
the rule they break, with exit 2 and one line. No Ray cluster is started (the
provider is plain Python). The rules read cluster/machines.py: a test changes
the table and the API's verdict changes with it.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.error
import urllib.request

import pytest
import yaml

from cluster import machines
from cluster.config import ray_cluster_config
from cluster.spec import ClusterSpec
from launcher.cli.main import main
from launcher.lab.compute_api import ComputeAPI
from launcher.lab.compute_filter import matches
from launcher.lab.rehearsal import rehearse

BASE = {"project": "my-project", "source_dir": "/home/me/launcher"}


def build(**values) -> dict:
    return ray_cluster_config(ClusterSpec.from_mapping({**BASE, **values}).validated(), "0.1.0")


def worker(config: dict) -> dict:
    return next(t for name, t in config["available_node_types"].items() if name != config["head_node_type"])


def quietly(config: dict, **kwargs):
    lines: list[str] = []
    report = rehearse(config, say=lines.append, **kwargs)
    return report, "\n".join(lines)


# name -> the spec, and the GPUs each worker insert must carry
FAMILIES = {
    "n1-t4": ({"worker_machine_type": "n1-standard-8", "accelerator_type": "nvidia-tesla-t4", "min_workers": 1},
              "1 x nvidia-tesla-t4"),
    "g2-standard-24": ({"worker_machine_type": "g2-standard-24", "min_workers": 2}, "2 x nvidia-l4 (built in)"),
    "a2-highgpu-1g": ({"worker_machine_type": "a2-highgpu-1g"}, "1 x nvidia-tesla-a100 (built in)"),
    "a3-highgpu-8g": ({"worker_machine_type": "a3-highgpu-8g"}, "8 x nvidia-h100-80gb (built in)"),
    "spot-stop": ({"accelerator_type": "nvidia-tesla-t4", "provisioning": "spot", "termination_action": "STOP",
                   "min_workers": 2}, "SPOT (on preemption: STOP)"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_gpu_family_rehearses_clean_and_leaves_nothing(family):
    values, gpus = FAMILIES[family]
    config = build(**values)
    report, out = quietly(config)
    assert report.refused == [], out
    inserts = [c for c in report.calls if c.verb == "insert"]
    workers = max(int(worker(config).get("min_workers") or 0), 1)
    assert len(inserts) == 1 + workers
    assert all(gpus in c.detail for c in inserts[1:]), out
    assert report.left == [] and "left in the API at the end: nothing" in out
    assert not any(c.refusal for c in report.calls if c.verb in ("delete", "stop", "setLabels")), out


def test_bootstrap_runs_as_ray_up_does():
    report, out = quietly(build(worker_machine_type="g2-standard-8"))
    verbs = [c.verb for c in report.calls]
    for call in ("cloudresourcemanager.projects.get", "iam.serviceAccounts.create",
                 "cloudresourcemanager.projects.setIamPolicy", "projects.setCommonInstanceMetadata",
                 "subnetworks.list"):
        assert call in verbs, out
    assert verbs.index("subnetworks.list") < verbs.index("insert")


def test_spot_with_stop_is_stopped_by_ray_down_then_deleted():
    config = build(accelerator_type="nvidia-tesla-t4", provisioning="spot", termination_action="STOP", min_workers=2)
    assert config["provider"]["cache_stopped_nodes"] is True
    report, out = quietly(config, bootstrap=False)
    assert len(report.stopped_by_down) == 3 and report.left == []
    verbs = [c.verb for c in report.calls]
    # `ray down` stops the three; a second `ray up` starts those same three (no new insert), and
    # `ray down` stops them again; `launcher cluster down` deletes them.
    assert (verbs.count("insert"), verbs.count("stop"), verbs.count("start"), verbs.count("delete")) == (3, 6, 3, 3)
    started = {c.target for c in report.calls if c.verb == "start"}
    assert started == set(report.stopped_by_down)
    assert "`ray down` stopped 3 VM(s) instead of deleting them" in out
    assert "the second `ray up` started 3 stopped VM(s)" in out


def g2_with_guest_accelerators(config):
    worker(config)["node_config"]["guestAccelerators"] = [{"acceleratorType": "nvidia-l4", "acceleratorCount": 2}]


def g2_on_pd_standard(config):
    disk = worker(config)["node_config"]["disks"][0]["initializeParams"]
    disk["diskType"] = "zones/us-central1-a/diskTypes/pd-standard"


def gpu_without_terminate(config):
    del worker(config)["node_config"]["scheduling"]["onHostMaintenance"]


def forty_character_name(config):
    config["cluster_name"] = "a-forty-character-cluster-name-abcdefghi"


def fifty_character_name(config):  # Ray's own check stops it before a request is sent
    config["cluster_name"] = "a-fifty-character-cluster-name-abcdefghijklmnopqrs"


def t4_on_n2(config):
    node = worker(config)["node_config"]
    node["machineType"] = "n2-standard-8"
    node["guestAccelerators"] = [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}]


def v100_on_too_many_vcpus(config):
    node = worker(config)["node_config"]
    node["machineType"] = "n1-standard-16"
    node["guestAccelerators"] = [{"acceleratorType": "nvidia-tesla-v100", "acceleratorCount": 1}]


BROKEN = [
    ("g2-standard-24", g2_with_guest_accelerators, {}, "built-in GPUs", "comes with 2 x nvidia-l4"),
    ("g2-standard-24", g2_on_pd_standard, {}, "disk type", "[pd-standard] disk type cannot be used"),
    ("n1-t4", gpu_without_terminate, {}, "TERMINATE for GPUs", "onHostMaintenance TERMINATE"),
    ("g2-standard-24", forty_character_name, {}, "instance name", "is 66 characters; the most is 63"),
    ("g2-standard-24", fifty_character_name, {}, "instance name", "Ray refused to name the VM"),
    ("n1-t4", t4_on_n2, {}, "accelerators only on N1", "attaches only to N1"),
    ("n1-t4", v100_on_too_many_vcpus, {}, "N1 GPU shape", "at most 12 vCPUs"),
    ("n1-t4", None, {"NVIDIA_T4_GPUS": 0}, "quota", "Quota 'NVIDIA_T4_GPUS' exceeded"),
    ("g2-standard-24", None, {"GPUS_ALL_REGIONS": 2}, "quota", "Quota 'GPUS_ALL_REGIONS' exceeded"),
    ("spot-stop", None, {"NVIDIA_T4_GPUS": 8, "PREEMPTIBLE_NVIDIA_T4_GPUS": 1}, "quota",
     "Quota 'PREEMPTIBLE_NVIDIA_T4_GPUS' exceeded"),
]


@pytest.mark.parametrize("family, breaks, quotas, rule, message", BROKEN,
                         ids=[b[1].__name__ if b[1] else f"quota-{list(b[2])[-1]}" for b in BROKEN])
def test_a_broken_file_is_refused_naming_the_rule(family, breaks, quotas, rule, message):
    config = build(**FAMILIES[family][0])
    if breaks:
        breaks(config)
    report, out = quietly(config, quotas=quotas, bootstrap=False)
    assert report.refused, out
    assert report.refused[0].refusal.rule == rule, out
    assert message in report.refused[0].refusal.message, out
    assert f"refused [{rule}]" in out
    assert report.left == []


def test_a_quota_counts_what_is_running_not_just_one_request():
    config = build(worker_machine_type="g2-standard-24", min_workers=2)  # 2 workers x 2 L4
    report, _ = quietly(config, quotas={"NVIDIA_L4_GPUS": 4}, bootstrap=False)
    assert report.refused == []
    report, out = quietly(config, quotas={"NVIDIA_L4_GPUS": 3}, bootstrap=False)
    assert [c.refusal.rule for c in report.refused] == ["quota"], out
    assert "(2 in use, 2 asked for)" in report.refused[0].refusal.message


def test_the_rules_are_the_machine_table(monkeypatch):
    config = build(worker_machine_type="g2-standard-24")
    g2_on_pd_standard(config)
    assert quietly(copy.deepcopy(config), bootstrap=False)[0].refused
    monkeypatch.setitem(machines.DISK_TYPES, "g2", ("pd-balanced", "pd-ssd", "pd-standard"))
    assert quietly(config, bootstrap=False)[0].refused == []


def test_a_refusal_is_compute_engines_error_body():
    body = {"name": "vm-1", "machineType": "zones/us-central1-a/machineTypes/g2-standard-8",
            "guestAccelerators": [{"acceleratorType": "nvidia-l4", "acceleratorCount": 1}]}
    with ComputeAPI("p") as api:
        request = urllib.request.Request(f"{api.url}/compute/v1/projects/p/zones/us-central1-a/instances",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
        error = json.loads(refused.value.read())["error"]
        assert error["code"] == 400 and "[rule: built-in GPUs]" in error["message"]
        assert error["errors"][0]["reason"] == "invalid"
        assert api.instances == {}


def test_the_client_is_pointed_back_after_the_rehearsal():
    from googleapiclient import discovery

    before = discovery.build
    quietly(build(), bootstrap=False)
    assert discovery.build is before


def test_filters_as_rays_provider_writes_them():
    vm = {"status": "RUNNING", "labels": {"ray-cluster-name": "c", "ray-node-kind": "worker"}}
    ray_filter = ("((labels.ray-node-kind = worker)) AND ((status = RUNNING) OR (status = STAGING)) "
                  "AND (labels.ray-cluster-name = c) AND (NOT labels.tpu_cores:*)")
    assert matches(ray_filter, vm)
    assert not matches(ray_filter.replace("= c)", "= d)"), vm)
    assert not matches("(status = TERMINATED) OR (status = SUSPENDED)", vm)
    assert matches("labels.ray-cluster-name = c", vm) and matches("", vm)


def test_cli_clean_and_refused(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(build(worker_machine_type="a2-highgpu-1g")))
    assert main(["cluster", "rehearse", str(good)]) == 0
    assert "0 refused" in capsys.readouterr().out

    broken = build(worker_machine_type="g2-standard-24")
    g2_on_pd_standard(broken)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(broken))
    assert main(["cluster", "rehearse", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad}: Compute Engine would refuse it: [disk type]")
    assert "Traceback" not in err[0]

    assert main(["cluster", "rehearse", str(good), "--quota", "lots"]) == 2
    assert "--quota lots: not METRIC=N" in capsys.readouterr().err
    not_gcp = tmp_path / "aws.yaml"
    not_gcp.write_text("cluster_name: x\nprovider: {type: aws}\n")
    assert main(["cluster", "rehearse", str(not_gcp)]) == 2
    assert "the rehearsal runs Ray's GCP provider" in capsys.readouterr().err


@pytest.mark.integration
def test_ray_up_over_ssh_trains_and_ray_down_leaves_nothing(gcs_emulator, bucket):
    """The real `ray up` over real SSH to a loopback sshd (the head VM is this machine): setup and
    start commands, a worker VM (a second sshd) that the head's autoscaler launches, sets up and
    starts, a 1-epoch run checkpointing to the emulator, `ray status`, `ray down`; nothing left."""
    import time

    import launcher
    from launcher._deferred import checkout
    from launcher.errors import UserError
    from launcher.lab.ray_up import RehearsalFailed, _check_worker_port, rehearse_up
    from launcher.lab.sshd import missing_tools

    missing = missing_tools()
    if missing:
        pytest.skip(f"the ray up rehearsal needs {', '.join(missing)} (CI installs openssh-server and rsync)")
    try:
        _check_worker_port()
        busy = ""
    except UserError as exc:  # a system sshd on every address: the head-only rehearsal still runs
        busy = exc.what
    config = ray_cluster_config(ClusterSpec.from_mapping({
        "project": "my-project", "cluster_name": "rehearse-up", "source_dir": checkout()}).validated(),
        launcher.__version__)
    lines: list[str] = []
    start = time.monotonic()
    try:
        report = rehearse_up(config, gcs_emulator.url, bucket, workers=2, say=lines.append, timeout_s=170,
                             join=not busy)
    except RehearsalFailed as exc:  # what the stage printed is the diagnosis: show it
        pytest.fail(f"{exc}\n" + "\n".join(lines), pytrace=False)
    took = time.monotonic() - start
    text = "\n".join(lines)
    assert report.job_status == "SUCCEEDED", text
    assert any("/checkpoint_" in name and name.endswith("/manifest.json") for name in report.checkpoints), text
    inserts = [c for c in report.calls if c.verb == "insert" and "-head-" in c.target]
    assert [c.refusal for c in inserts] == [None], text
    assert any(c.verb == "delete" and c.target == inserts[0].target for c in report.calls), text
    assert report.left == [] and report.ray_left == [], text
    assert "Node status" in text and "Active:" in text, text  # `ray status` from the head's autoscaler
    # the head's start commands started the worker setup guard on the session's autoscaler log
    assert re.search(r"setup guard \(~/launcher-setup-guard.log\): launcher setup-guard: following \S+/ray/session_"
                     r"[^/]+/logs/monitor.log; a node type is capped after 3 failed setups in a row", text), text
    assert took < 240, f"{took:.0f} s\n{text}"
    # every setup command the head ran was timed, in order, and none failed
    setup = config["setup_commands"] + config["head_setup_commands"]
    assert [c for c, _, _ in report.steps] == setup and all(rc == 0 for _, _, rc in report.steps), report.steps
    assert re.search(r"the head's setup commands took \d+\.\d s \(\d ran\)", text), text
    if busy:
        pytest.skip(f"the head's rehearsal passed; the worker VM's join was not rehearsed: {busy}")
    # one worker VM, launched by the head's (v2) autoscaler, set up over SSH, in `ray status`, deleted by ray down;
    # not replaced after its setup (cluster/gcp_provider.py: with Ray's own provider it was, twice)
    worker_type = next(t for t in config["available_node_types"] if t != config["head_node_type"])
    assert report.join == worker_type and report.joined_s is not None and report.worker_inserts() == 1, text
    workers = [c.target for c in report.calls if c.verb == "insert" and "-worker-" in c.target]
    assert any(c.verb == "delete" and c.target == workers[0] for c in report.calls), text
    # every setup command ran on the worker, the worker's own last (Ray's v2 merges the global setup_commands in
    # once more on the head, so they run twice there: idempotent ones)
    ran = [c for c, _, rc in report.worker_steps if rc == 0]
    assert len(ran) == len(report.worker_steps) and set(ran) == set(config["setup_commands"]) | set(
        config["worker_setup_commands"]) and ran[-len(config["worker_setup_commands"]):] == config[
        "worker_setup_commands"], text
    assert re.search(rf"^   \|  1 {worker_type}$", text.partition("Active:")[2], re.MULTILINE), text


def test_each_setup_step_is_timed_with_its_exit_status_kept(tmp_path):
    """The copy's commands, run by bash as Ray runs them: each one's time and exit status reach the
    steps file, and the command still ends with its own status."""
    import subprocess

    from launcher.lab.up_copy import read_steps, timed

    commands = ["sleep 0.3", "false || true; sh -c 'exit 3'", "echo done &"]
    ends = [subprocess.run(["bash", "-c", f"({timed(n, c)})"], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                           capture_output=True).returncode for n, c in enumerate(commands)]
    assert ends == [0, 3, 0]
    steps = read_steps(str(tmp_path), commands)
    assert [(c, rc) for c, _, rc in steps] == [(commands[0], 0), (commands[1], 3), (commands[2], 0)]
    assert 0.3 <= steps[0][1] < 5 and steps[1][1] < 1


def test_a_fresh_rehearsal_runs_every_install_from_this_machines_package_sources(tmp_path, monkeypatch):
    """--fresh-install: the head VM has no venv, so no install is skipped or only checked (the GPU and
    Horovod steps still are); pip's settings here reach uv as its own variables; a CPU torch index
    that does not answer is left out of the installs, one that answers is kept."""
    import http.server
    import threading

    from cluster import config as cluster_config
    from launcher.lab.sshd import LoopbackSSHD
    from launcher.lab.up_copy import package_sources, rehearsed_command, up_copy

    config = build(min_workers=2, accelerator_type="nvidia-tesla-t4")
    sshd = LoopbackSSHD(str(tmp_path), {"HOME": str(tmp_path)})
    ports = dict.fromkeys(("gcs", "object_manager", "dashboard", "client", "agent"), 1001)
    drop = (f" --extra-index-url {cluster_config.CPU_TORCH_INDEX}",)
    copy_, said = up_copy(config, sshd, ports, fresh=True, drop=drop)
    assert all(what == "ran" for c, what in said if "uv pip install" in c), said
    install = copy_["head_setup_commands"][0]
    assert "uv pip install" in install and "download.pytorch.org" not in install and "unsafe-best-match" in install
    assert rehearsed_command("timeout 300 bash -c 'until nvidia-smi; do sleep 5; done'", fresh=True)[1].startswith(
        "skipped")

    constraints = tmp_path / "constraints.txt"
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/a /opt/b")
    monkeypatch.setenv("PIP_CONSTRAINT", str(constraints))
    monkeypatch.setattr(cluster_config, "CPU_TORCH_INDEX", "http://127.0.0.1:9")  # the discard port: nothing answers
    sources = package_sources(probe_s=2)
    env = sources["env"]
    assert env["UV_FIND_LINKS"].split(",")[-2:] == ["/opt/a", "/opt/b"] and env["PIP_FIND_LINKS"] == "/opt/a /opt/b"
    assert env["UV_CONSTRAINT"].split()[-1] == str(constraints) and env["UV_PYTHON_DOWNLOADS"] == "never"
    assert sources["drop"] == (" --extra-index-url http://127.0.0.1:9",)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(cluster_config, "CPU_TORCH_INDEX", f"http://127.0.0.1:{server.server_port}")
        assert package_sources(probe_s=5)["drop"] == ()
    finally:
        server.shutdown()


def test_the_up_rehearsals_copy_says_what_it_skips(tmp_path):
    """The copy `ray up` runs: SSH through the loopback sshd, workers simulated, free ports for the head,
    and each setup command run, checked (pinned pip installs) or skipped with the reason."""
    from launcher.lab.up_copy import up_copy
    from launcher.lab.sshd import LoopbackSSHD

    sshd = LoopbackSSHD(str(tmp_path), {"HOME": str(tmp_path)})
    config = build(min_workers=2, accelerator_type="nvidia-tesla-t4")
    ports = {"gcs": 1001, "object_manager": 1002, "dashboard": 1003, "client": 1004, "agent": 1005}
    copy_, said = up_copy(config, sshd, ports)
    assert copy_["auth"] == {"ssh_user": sshd.user, "ssh_proxy_command": sshd.proxy_command}
    assert str(sshd.port) in sshd.proxy_command
    assert worker(copy_)["min_workers"] == 0 and worker(config)["min_workers"] == 2
    fate = dict(said)
    assert all(fate[c] == "ran" for c in config["setup_commands"])  # uv, the venv, .bashrc: their own checks
    install, version_check, google = config["head_setup_commands"]
    assert fate[install].startswith("skipped") and fate[version_check] == "ran"
    assert fate[google].startswith("checked only")
    assert ("pip install --dry-run --no-index google-api-python-client==2.202.0 google-auth-httplib2==0.4.4\n"
            in copy_["head_setup_commands"][2])
    start = next(c for c in copy_["head_start_ray_commands"] if "ray start" in c)
    assert "--port=1001" in start and "--object-manager-port=1002" in start and "--dashboard-port=1003" in start
    assert "--ray-client-server-port=1004" in start and "6379" not in start and "8076" not in start
    assert copy_["head_start_ray_commands"][0] == "ray stop"  # runs for real, inside sshd's PID namespace
    assert "worker_setup_commands" in copy_ and copy_["worker_setup_commands"] == config["worker_setup_commands"]


def test_the_loopback_api_makes_the_head_this_machine_and_installs_the_metadata_keys(tmp_path):
    from launcher.lab.ray_up import LoopbackAPI
    from launcher.lab.sshd import LoopbackSSHD, authorized_keys

    sshd = LoopbackSSHD(str(tmp_path), {"HOME": str(tmp_path)})
    api = LoopbackAPI("my-project", sshd)
    keys = f"ubuntu:ssh-rsa AAAA ubuntu\n{sshd.user}:ssh-rsa BBBB {sshd.user}"
    api.answer("POST", "/compute/v1/projects/my-project/setCommonInstanceMetadata", {},
               {"items": [{"key": "ssh-keys", "value": keys}]})
    assert open(sshd.keys_file).read() == "ssh-rsa BBBB " + sshd.user + "\n"
    assert authorized_keys([{"key": "ssh-keys", "value": keys}], "ubuntu") == ["ssh-rsa AAAA ubuntu"]
    zone = "/compute/v1/projects/my-project/zones/us-central1-a/instances"
    for name, kind in (("ray-x-head-1-compute", "head"), ("ray-x-worker-1-compute", "worker")):
        api.answer("POST", zone, {}, {"name": name, "machineType": "zones/us-central1-a/machineTypes/n1-standard-4",
                                      "labels": {"ray-node-type": kind}})
    nics = {n: i["networkInterfaces"][0] for n, i in api.instances.items()}
    assert nics["ray-x-head-1-compute"]["networkIP"] == "127.0.0.1"
    assert nics["ray-x-head-1-compute"]["accessConfigs"][0]["natIP"] == "127.0.0.1"
    assert nics["ray-x-worker-1-compute"]["networkIP"] != "127.0.0.1"  # a worker is never this machine


# -- issue 66, items 6 and 7a: files written the way Ray's own GCP examples write them ---------------

RAY_EXAMPLE = """\
cluster_name: rayexample
max_workers: 2
provider: {type: gcp, region: us-west1, availability_zone: us-west1-a, project_id: my-project}
auth: {ssh_user: ubuntu}
available_node_types:
  ray_head_default:
    resources: {CPU: 2}
    node_config:
      machineType: n1-standard-2
      disks:
        - boot: true
          autoDelete: true
          type: PERSISTENT
          initializeParams:
            diskSizeGb: 50
            sourceImage: projects/deeplearning-platform-release/global/images/family/common-cpu
  ray_worker_small:
    min_workers: 1
    resources: {CPU: 6}
    node_config:
      machineType: custom-6-16384
      disks:
        - boot: true
          autoDelete: true
          type: PERSISTENT
          initializeParams:
            diskSizeGb: 50
            sourceImage: projects/deeplearning-platform-release/global/images/family/common-cpu
      scheduling:
        - preemptible: true
        - onHostMaintenance: TERMINATE
head_node_type: ray_head_default
"""


def insert(api: ComputeAPI, body: dict, zone: str = "us-west1-a"):
    """POST an instances.insert to the local API as Google's client would: (HTTP status, answer)."""
    request = urllib.request.Request(f"{api.url}/compute/v1/projects/p/zones/{zone}/instances",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_rays_list_scheduling_is_one_line_naming_the_node_type(tmp_path, capsys):
    path = tmp_path / "ray-example.yaml"
    path.write_text(RAY_EXAMPLE)
    assert main(["cluster", "rehearse", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    assert err[0].startswith(f"error: {path}: node type ray_worker_small: scheduling is a list")
    assert "Invalid value for field 'resource.scheduling'" in err[0]
    assert err[0].endswith("write it as a mapping: scheduling: {preemptible: true, onHostMaintenance: TERMINATE}")
    assert "insert" not in captured.out  # found before anything was sent


def test_the_local_api_refuses_a_list_scheduling_as_compute_engine_does():
    body = {"name": "vm-1", "machineType": "zones/us-west1-a/machineTypes/n1-standard-2",
            "labels": {"ray-user-node-type": "ray_worker_small"},
            "scheduling": [{"preemptible": True}, {"onHostMaintenance": "TERMINATE"}]}
    with ComputeAPI("p") as api:
        status, answer = insert(api, body)
        assert status == 400 and answer["error"]["errors"][0]["reason"] == "invalid"
        assert answer["error"]["message"].startswith("Invalid value for field 'resource.scheduling': "
                                                     '[{"preemptible": true}, {"onHostMaintenance": "TERMINATE"}]')
        refusal = api.calls[-1].refusal
        assert (refusal.rule, api.calls[-1].node_type) == ("scheduling", "ray_worker_small")
        assert refusal.fix == ("write scheduling as one mapping: scheduling: {preemptible: true, onHostMaintenance: "
                               "TERMINATE} in node type ray_worker_small's node_config")
        assert api.instances == {}


def test_rays_example_with_scheduling_as_an_object_rehearses_clean():
    """custom-6-16384 is a real N1 custom type, and Compute Engine sets automaticRestart false itself
    for a preemptible VM that leaves it out."""
    config = yaml.safe_load(RAY_EXAMPLE)
    node = config["available_node_types"]["ray_worker_small"]["node_config"]
    node["scheduling"] = {"preemptible": True, "onHostMaintenance": "TERMINATE"}
    report, out = quietly(config, bootstrap=False)
    assert report.refused == [], out
    assert "custom-6-16384, pd-standard (default), preemptible  accepted" in out
    with ComputeAPI("p") as api:
        body = {"name": "vm-1", "machineType": "zones/us-west1-a/machineTypes/custom-6-16384",
                "scheduling": {"preemptible": True}}
        assert insert(api, body)[0] == 200
        assert api.instances["vm-1"]["scheduling"] == {"preemptible": True, "automaticRestart": False,
                                                       "onHostMaintenance": "TERMINATE"}  # as GCE stores it
        status, answer = insert(api, {**body, "name": "vm-2", "scheduling": {"preemptible": True,
                                                                              "automaticRestart": True}})
        assert status == 400 and "Scheduling must have preemptible be false when AutomaticRestart is true" in \
            answer["error"]["message"]


def unknown_zone(config):
    config["provider"]["availability_zone"] = "us-central1-z"


def n1_standard_7(config):
    worker(config)["node_config"]["machineType"] = "n1-standard-7"


def arm_worker(config):  # a real Arm type, and the file's x86-64 Deep Learning VM image
    worker(config)["node_config"]["machineType"] = "t2a-standard-8"


@pytest.mark.parametrize("breaks, rule, message, fix", [
    (unknown_zone, "zone", "Invalid value for field 'zone': 'us-central1-z'. Unknown zone.",
     "set provider.availability_zone to us-central1-f"),
    (arm_worker, "architecture", "Invalid resource usage: 'Requested boot disk architecture (X86_64) is not "
     "compatible with machine type architecture (ARM64).'", "use an x86-64 machine type (t2d-standard-8"),
    (n1_standard_7, "machine type", "Machine type with name 'n1-standard-7' does not exist in zone 'us-central1-a'",
     "did you mean n1-standard-8 or n1-standard-4?"),
])
def test_a_zone_or_machine_type_that_does_not_exist_is_refused(breaks, rule, message, fix, tmp_path, capsys):
    config = build(min_workers=1)
    breaks(config)
    report, out = quietly(copy.deepcopy(config), bootstrap=False)
    assert report.refused and report.refused[-1].refusal.rule == rule, out
    assert message in report.refused[-1].refusal.message
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["cluster", "rehearse", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"[{rule}] " in err[0] and message in err[0] and fix in err[0], err
    assert "(node type " in err[0]


def test_the_files_provider_reads_back_the_status_it_set_where_rays_own_reads_the_one_before():
    """Ray's GCP provider caches each node and `set_node_tags` refreshes that cache before writing, so
    `node_tags` right after returns the status before the write: the v2 autoscaler then takes a worker's
    finished setup for a failed one (its `ray up --worker` rehearsal replaced the worker twice). The
    cluster file's provider (cluster.gcp_provider) returns what was written. Both run against the local
    Compute Engine API."""
    from cluster.gcp_provider import Provider
    from launcher import _ray
    from launcher.lab.rehearsal import NODE_KIND_WORKER, _create, _rehearsal_copy, _temporary_home, pointed_at

    config = build(min_workers=1)
    assert config["provider"]["module"] == "cluster.gcp_provider.Provider"
    config = _rehearsal_copy(config)  # the placeholder token
    api = ComputeAPI(config["provider"]["project_id"])
    seen = {}
    with api, pointed_at(api.url), _temporary_home():
        config = Provider.bootstrap_config(config)
        for cls in (_ray.resolve("GCPNodeProvider"), Provider):
            provider = cls(config["provider"], config["cluster_name"])
            before = set(provider.non_terminated_nodes({}))
            _create(provider, config, "n1-standard-8", NODE_KIND_WORKER, 1)
            node = (set(provider.non_terminated_nodes({})) - before).pop()
            for status in ("setting-up", "up-to-date"):  # the updater's last two writes
                provider.set_node_tags(node, {"ray-node-status": status})
            seen[cls.__name__] = provider.node_tags(node)["ray-node-status"]
            assert api.instances[node]["labels"]["ray-node-status"] == "up-to-date"  # what Compute Engine holds
    assert seen == {"GCPNodeProvider": "setting-up", "Provider": "up-to-date"}


def test_a_shared_core_head_is_a_real_machine_type_the_local_api_serves():
    """e2-medium and the other shared-core types have no vCPU count in their names: the table knows them,
    the file gives Ray their vCPUs, and the local API serves them as Compute Engine does (isSharedCpu)."""
    from launcher.lab.compute_world import World

    assert machines.machine_vcpus("e2-medium") == 2 and machines.machine_memory_gb("e2-micro") == 1.0
    config = build(head_machine_type="e2-medium")
    assert config["available_node_types"]["ray_head"]["resources"]["CPU"] == 2
    report, out = quietly(config, bootstrap=False)
    assert report.left == [] and any(c.verb == "insert" and c.refusal is None for c in report.calls), out
    served = World.with_limits({}, "us-central1-a").machine_type("p", "us-central1-a", "e2-micro")
    assert (served["guestCpus"], served["memoryMb"], served["isSharedCpu"]) == (2, 1024, True)


def test_a_worker_rehearsal_says_in_one_line_when_port_22_of_its_address_is_taken():
    """The worker VM's sshd needs port 22 of 127.0.0.2 (the head's autoscaler dials port 22): held by
    another server, --worker stops before anything starts, with one line and what to do."""
    import socket

    from launcher.errors import UserError
    from launcher.lab.ray_up import WORKER_IP, _check_worker_port

    with socket.socket() as held:
        try:
            held.bind((WORKER_IP, 22))
        except OSError as exc:  # taken already (a system sshd) or not allowed: the check must say so too
            with pytest.raises(UserError, match="--worker needs port 22 of 127.0.0.2"):
                _check_worker_port()
            pytest.skip(f"port 22 of {WORKER_IP} could not be held for the test ({exc.strerror}); the refusal was checked")
        held.listen()
        with pytest.raises(UserError, match="--worker needs port 22 of 127.0.0.2") as refused:
            _check_worker_port()
        assert "rehearse without --worker" in refused.value.fix
    _check_worker_port()  # free again
