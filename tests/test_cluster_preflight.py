"""cluster.compute and cluster.preflight with the real google-cloud-compute client (REST transport,
anonymous credentials) against the local Compute Engine API (launcher.lab.compute_api), and
`launcher cluster ...`."""

from __future__ import annotations

import itertools
import os
import stat
import sys

import pytest
import yaml

from cluster.compute import ENDPOINT_ENV, PREEMPTED, Compute
from cluster.config import ray_cluster_config
from cluster.preflight import FAIL, OK, WARN, node_plans, run_checks
from cluster.spec import ClusterSpec
from launcher.cli import cluster as cli_cluster
from launcher.cli.main import main
from launcher.lab import compute_api
from launcher.lab.compute_world import API, World

PROJECT = "test-project"
OPERATION_IDS = itertools.count(9000)


def project_world() -> World:
    """The project these tests check files against: a zone that is down, zones that lack some types and
    GPUs, a few quotas in use, two images, and lists two items a page (so the client's pager pages)."""
    t4, v100, l4 = "nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-l4"
    n1 = ["n1-standard-4", "n1-standard-8", "n1-standard-16", "n1-highmem-8"]
    return World(
        zones={"us-central1-a": "UP", "us-central1-b": "DOWN", "us-central1-f": "UP", "europe-west4-a": "UP"},
        machine_types={"us-central1-a": n1 + ["g2-standard-8", "g2-standard-24", "a2-highgpu-1g"],
                       "us-central1-b": n1, "us-central1-f": n1, "europe-west4-a": n1},
        accelerators={"us-central1-a": {t4: 4, v100: 8, l4: 8, "nvidia-tesla-a100": 16}, "us-central1-b": {t4: 4},
                      "us-central1-f": {t4: 4}, "europe-west4-a": {t4: 4, v100: 8}},
        quotas={
            "us-central1": {"CPUS": (96, 8), "PREEMPTIBLE_CPUS": (0, 0), "G2_CPUS": (48, 0), "A2_CPUS": (24, 0),
                            "NVIDIA_T4_GPUS": (16, 0), "PREEMPTIBLE_NVIDIA_T4_GPUS": (4, 0),
                            "NVIDIA_V100_GPUS": (8, 0), "NVIDIA_L4_GPUS": (4, 0), "NVIDIA_A100_GPUS": (2, 0),
                            "INSTANCES": (1000, 3), "SSD_TOTAL_GB": (4096, 100), "IN_USE_ADDRESSES": (8, 1)},
            "europe-west4": {"CPUS": (48, 0), "NVIDIA_T4_GPUS": (4, 0)},
        },
        project_quotas={"GPUS_ALL_REGIONS": (16, 0), "CPUS_ALL_REGIONS": (200, 8)},
        images={"deeplearning-platform-release": {
            "common-cpu": "common-cpu-v20261101-debian-11",
            "common-cu129-ubuntu-2204-nvidia-580": "common-cu129-v20261101-ubuntu-2204-nvidia-580"}},
        page_size=2)


class ProjectAPI(compute_api.ComputeAPI):
    """The local Compute API serving :func:`project_world`, keeping what these tests read back: the
    paths the client asked for (``DELETE path`` for a deletion) and the VMs deleted (``zone/name``)."""

    def __init__(self) -> None:
        super().__init__(PROJECT, project_world())
        self.requests: list[str] = []
        self.deleted: list[str] = []

    def answer(self, method: str, path: str, query: dict[str, str], body: dict) -> dict:
        self.requests.append(path if method == "GET" else f"{method} {path}")
        found = super().answer(method, path, query, body)
        if method == "DELETE" and "/instances/" in path:
            zone, name = path.split("/zones/", 1)[1].split("/instances/")
            self.deleted.append(f"{zone}/{name}")
        return found

    def add_vms(self, zone: str, vms: list[tuple[str, str, dict]]) -> None:
        """VMs (name, status, labels) already in the zone, as `instances.list` finds them."""
        for name, status, labels in vms:
            self.instances[name] = {"kind": "compute#instance", "name": name, "status": status, "labels": labels,
                                    "zone": f"{API}/projects/{PROJECT}/zones/{zone}"}


def operation(zone: str, instance: str, when: str, kind: str = PREEMPTED) -> dict:
    """A zone operation as Compute Engine lists it (a preemption unless ``kind`` says otherwise)."""
    message = "Instance was preempted." if kind == PREEMPTED else ""
    return compute_api.operation(PROJECT, kind, zone, instance, next(OPERATION_IDS), when, message)


@pytest.fixture()
def fake(monkeypatch):
    with ProjectAPI() as api:
        monkeypatch.setenv(ENDPOINT_ENV, api.url)
        yield api


def cluster_file(tmp_path, **values) -> str:
    spec = ClusterSpec.from_mapping({"project": PROJECT, "source_dir": "/src", **values}).validated()
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(ray_cluster_config(spec, "0.1.0")))
    return str(path)


def checks_for(tmp_path, **values):
    with open(cluster_file(tmp_path, **values)) as f:
        config = yaml.safe_load(f)
    return run_checks(config, Compute(PROJECT))


def by_status(checks, status):
    return [c for c in checks if c.status == status]


def test_passing_preflight(tmp_path, fake, capsys):
    path = cluster_file(tmp_path, preset="standard-1", accelerator_type="nvidia-tesla-t4", accelerator_count=2)
    assert main(["cluster", "preflight", path]) == 0
    out = capsys.readouterr().out
    assert "zone us-central1-a is UP" in out
    assert "quota NVIDIA_T4_GPUS in us-central1: needs 8, 16 free" in out  # 4 workers x 2 GPUs
    assert "quota CPUS in us-central1: needs 36, 88 free" in out  # head 4 + 4 x 8 vCPUs
    assert "common-cu129-ubuntu-2204-nvidia-580 resolves to common-cu129-v20261101-ubuntu-2204-nvidia-580" in out
    assert out.strip().endswith("preflight: all checks passed")
    # The real client made the REST calls.
    assert f"/compute/v1/projects/{PROJECT}/zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4" in fake.requests
    assert f"/compute/v1/projects/{PROJECT}/regions/us-central1" in fake.requests


def test_missing_preemptible_gpu_quota_for_spot(tmp_path, fake, capsys):
    path = cluster_file(tmp_path, preset="custom", max_workers=2, accelerator_type="nvidia-tesla-t4",
                        accelerator_count=4, provisioning="spot")
    assert main(["cluster", "preflight", path]) == 1
    out = capsys.readouterr().out
    assert "FAIL  quota PREEMPTIBLE_NVIDIA_T4_GPUS in us-central1: the cluster needs 8, 4 free (limit 4, in use 0)" in out
    assert "request more PREEMPTIBLE_NVIDIA_T4_GPUS quota for us-central1" in out
    assert "preflight: 1 check(s) failed" in out
    # Spot CPUs fall back to the standard CPUS quota: the project has no PREEMPTIBLE_CPUS granted.
    assert "ok    quota CPUS in us-central1" in out


def test_accelerator_not_in_zone(tmp_path, fake):
    # --install: the user's own torch build may run on a V100 (which torch 2.13's wheels do not).
    checks = checks_for(tmp_path, zone="us-central1-f", accelerator_type="nvidia-tesla-v100", install="true")
    failed = by_status(checks, FAIL)
    assert [c.what for c in failed] == ["accelerator nvidia-tesla-v100 (n1-standard-8-v100x1) is not offered in us-central1-f"]
    assert "pick a zone that has it" in failed[0].fix


def test_too_many_gpus_per_vm(tmp_path, fake):
    # `launcher cluster config` refuses 8 x T4; a hand-edited file gets it past that.
    with open(cluster_file(tmp_path, accelerator_type="nvidia-tesla-t4", accelerator_count=4)) as f:
        config = yaml.safe_load(f)
    config["available_node_types"]["n1-standard-8-t4x4"]["node_config"]["guestAccelerators"][0]["acceleratorCount"] = 8
    assert [c.what for c in by_status(run_checks(config, Compute(PROJECT)), FAIL)] == [
        "8 x nvidia-tesla-t4 per VM (n1-standard-8-t4x4): us-central1-a allows at most 4",
        "n1-standard-8-t4x4: Compute Engine attaches 1, 2, 4 x nvidia-tesla-t4 to an N1 VM, not 8"]


def test_zone_down(tmp_path, fake):
    checks = checks_for(tmp_path, zone="us-central1-b")
    assert [(c.what, c.fix) for c in by_status(checks, FAIL)] == [
        ("zone us-central1-b is DOWN", "pick another zone of the region (--zone)")]


def test_unknown_zone_stops_early(tmp_path, fake):
    # `launcher cluster config --zone us-central1-z` refuses it offline; a hand-edited file gets it past that.
    with open(cluster_file(tmp_path)) as f:
        config = yaml.safe_load(f)
    config["provider"]["availability_zone"] = "us-central1-z"
    checks = run_checks(config, Compute(PROJECT))
    assert checks[-1].status == FAIL and "zone us-central1-z does not exist" in checks[-1].what
    assert not any("quota" in c.what for c in checks)


def test_machine_type_and_image_missing(tmp_path, fake):
    checks = checks_for(tmp_path, worker_machine_type="n1-standard-96",
                        image="projects/deeplearning-platform-release/global/images/family/common-cu999")
    failed = [c.what for c in by_status(checks, FAIL)]
    assert "machine type n1-standard-96 is not offered in us-central1-a" in failed
    assert "image projects/deeplearning-platform-release/global/images/family/common-cu999 does not resolve" in failed


def test_dashboard_on_all_interfaces_is_a_warning(tmp_path, fake):
    with open(cluster_file(tmp_path)) as f:
        config = yaml.safe_load(f)
    config["head_start_ray_commands"] = [c.replace("127.0.0.1", "0.0.0.0") for c in config["head_start_ray_commands"]]
    warned = by_status(run_checks(config, Compute(PROJECT)), WARN)
    assert len(warned) == 1 and "on 0.0.0.0" in warned[0].what


def test_node_plans_of_a_hand_written_file():
    config = {"head_node_type": "head", "max_workers": 3, "available_node_types": {
        "head": {"resources": {}, "node_config": {"machineType": "n1-standard-4"}},
        "gpu": {"resources": {}, "max_workers": 2, "node_config": {
            "machineType": "zones/us-central1-a/machineTypes/a2-highgpu-2g", "scheduling": [{"preemptible": True}]}}}}
    head, gpu = node_plans(config)
    assert (head.count, head.accelerator, head.spot) == (1, None, False)
    assert (gpu.machine_type, gpu.count, gpu.accelerator, gpu.gpus, gpu.spot) == (
        "a2-highgpu-2g", 2, "nvidia-tesla-a100", 2, True)


def test_a_list_scheduling_fails_offline():
    """Ray's own GCP examples write scheduling as a list; Ray sends it as is and Compute Engine refuses it."""
    from cluster.preflight import table_checks

    config = {"cluster_name": "c", "head_node_type": "head", "max_workers": 1, "available_node_types": {
        "head": {"node_config": {"machineType": "n1-standard-4"}},
        "spot": {"max_workers": 1, "node_config": {"machineType": "n1-standard-8", "scheduling": [
            {"preemptible": True}, {"onHostMaintenance": "TERMINATE"}]}}}}
    failed = by_status(table_checks(config, node_plans(config)), FAIL)
    assert [(c.what.split(":")[0], c.fix) for c in failed] == [
        ("node type spot", "write it as a mapping: scheduling: {preemptible: true, onHostMaintenance: TERMINATE}")]
    assert "Invalid value for field 'resource.scheduling'" in failed[0].what
    config["available_node_types"]["spot"]["node_config"]["scheduling"] = {"preemptible": True}
    assert by_status(table_checks(config, node_plans(config)), FAIL) == []


@pytest.mark.gcs
def test_bucket_region(tmp_path, fake, bucket, capsys):
    # The emulator's buckets are in EUROPE-WEST4.
    near = cluster_file(tmp_path, zone="europe-west4-a", max_workers=1, min_workers=1)
    assert main(["cluster", "preflight", near, "--bucket", f"gs://{bucket}/runs"]) == 0
    assert f"ok    bucket gs://{bucket} is in europe-west4, the cluster's region" in capsys.readouterr().out

    far = cluster_file(tmp_path, zone="us-central1-a", max_workers=1, min_workers=1)
    assert main(["cluster", "preflight", far, "--bucket", f"gs://{bucket}"]) == 0  # a warning does not fail
    out = capsys.readouterr().out
    assert f"warn  bucket gs://{bucket} is in EUROPE-WEST4, the cluster in us-central1" in out
    assert "use a bucket in us-central1" in out and "1 warning(s)" in out

    assert main(["cluster", "preflight", near, "--bucket", "gs://no-such-bucket-here"]) == 1
    assert "FAIL  bucket gs://no-such-bucket-here does not exist" in capsys.readouterr().out


def test_preemptions_of_a_cluster(fake, capsys):
    fake.world.operations["us-central1-a"] = [
        operation("us-central1-a", "ray-demo-worker-1a2b3c4d-compute", "2026-11-20T10:00:00.000-08:00"),
        operation("us-central1-a", "ray-demo-head-00aa11bb-compute", "2026-11-20T09:00:00.000-08:00",
                  kind="compute.instances.insert"),
        operation("us-central1-a", "ray-other-worker-99887766-compute", "2026-11-20T11:00:00.000-08:00"),
        operation("us-central1-a", "ray-demo-worker-5e6f7a8b-compute", "2026-11-20T17:30:00.000+00:00"),
    ]
    assert main(["cluster", "preemptions", "--project", PROJECT, "--zone", "us-central1-a", "--cluster", "demo"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "2 preemption(s) of cluster demo in us-central1-a:"
    # Oldest first, comparing instants across UTC offsets (17:30Z is before 10:00-08:00).
    assert lines[2].split() == ["2026-11-20T17:30:00.000+00:00", "ray-demo-worker-5e6f7a8b-compute"]
    assert lines[3].split() == ["2026-11-20T10:00:00.000-08:00", "ray-demo-worker-1a2b3c4d-compute"]
    assert main(["cluster", "preemptions", "--project", PROJECT, "--zone", "us-central1-a"]) == 0
    assert capsys.readouterr().out.startswith("3 preemption(s) of all VMs in us-central1-a:")
    assert main(["cluster", "preemptions", "--project", PROJECT, "--zone", "us-central1-f"]) == 0
    assert capsys.readouterr().out.startswith("no preemptions of all VMs in us-central1-f")


def fake_ray(tmp_path, monkeypatch) -> str:
    """A stand-in for the `ray` program that records its arguments (we never start real VMs in tests)."""
    log = tmp_path / "ray-calls.txt"
    script = tmp_path / "ray"
    script.write_text(f"#!{sys.executable}\nimport sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(cli_cluster, "_ray", lambda: str(script))
    return str(log)


def test_up_runs_preflight_then_ray_up(tmp_path, fake, monkeypatch, capsys):
    log = fake_ray(tmp_path, monkeypatch)
    good = cluster_file(tmp_path)
    assert main(["cluster", "up", good, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would run: launcher cluster preflight {good}" in out and f"up -y {good}" in out
    assert not os.path.exists(log)  # a dry run runs nothing
    assert main(["cluster", "up", good]) == 0
    assert "preflight: all checks passed" in capsys.readouterr().out
    assert open(log).read() == f"up -y {good}\n"
    assert main(["cluster", "down", good]) == 0
    assert open(log).read().splitlines()[-1] == f"down -y {good}"


def test_up_stops_on_a_failed_check(tmp_path, fake, monkeypatch, capsys):
    log = fake_ray(tmp_path, monkeypatch)
    bad = cluster_file(tmp_path, zone="us-central1-b")
    assert main(["cluster", "up", bad]) == 1
    captured = capsys.readouterr()
    assert "FAIL  zone us-central1-b is DOWN" in captured.out
    assert "not starting the cluster" in captured.err
    assert not os.path.exists(log)


def test_missing_cluster_file(tmp_path, capsys):
    assert main(["cluster", "preflight", str(tmp_path / "nope.yaml")]) == 2
    assert "cluster file" in capsys.readouterr().err


@pytest.mark.cloud
@pytest.mark.skipif(not (os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") and os.environ.get("LAUNCHER_TEST_PROJECT")),
                    reason="needs GOOGLE_APPLICATION_CREDENTIALS and LAUNCHER_TEST_PROJECT")
def test_live_project(monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    project = os.environ["LAUNCHER_TEST_PROJECT"]
    spec = ClusterSpec.from_mapping({"project": project, "preset": "basic", "install": "true"}).validated()
    checks = run_checks(ray_cluster_config(spec, "0.1.0"), Compute(project))
    assert any(c.status == OK and c.what == "zone us-central1-a is UP" for c in checks)
    assert any(c.status == OK and c.what.startswith("image common-cpu resolves") for c in checks)
    assert any(c.what.startswith("quota CPUS in us-central1") for c in checks)


# -- issue 43: what `ray up` would trip over, caught before it -------------------------------------------

def load(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def test_built_in_gpus_are_counted_in_the_quotas(tmp_path, fake):
    """g2-standard-24 has 2 x L4 and a2-highgpu-1g one A100, with no --accelerator and no guestAccelerators."""
    checks = checks_for(tmp_path, worker_machine_type="g2-standard-24", min_workers=1, max_workers=2)
    lines = [c.what for c in checks if c.status == OK]
    assert "quota NVIDIA_L4_GPUS in us-central1: needs 4, 4 free" in lines
    assert "quota G2_CPUS in us-central1: needs 48, 48 free" in lines
    assert "quota GPUS_ALL_REGIONS (project-wide): needs 4, 16 free" in lines
    assert "accelerator nvidia-l4 x 2 (g2-standard-24-l4x2) is offered in us-central1-a" in lines
    assert not by_status(checks, FAIL)
    more = checks_for(tmp_path, worker_machine_type="g2-standard-24", min_workers=1, max_workers=3)
    assert [c.what for c in by_status(more, FAIL)] == [
        "quota G2_CPUS in us-central1: the cluster needs 72, 48 free (limit 48, in use 0)",
        "quota NVIDIA_L4_GPUS in us-central1: the cluster needs 6, 4 free (limit 4, in use 0)"]
    a100 = checks_for(tmp_path, worker_machine_type="a2-highgpu-1g", min_workers=1, max_workers=3)
    assert "quota NVIDIA_A100_GPUS in us-central1: the cluster needs 3, 2 free (limit 2, in use 0)" in [
        c.what for c in by_status(a100, FAIL)]


def test_global_gpu_quota_of_a_new_project(tmp_path, fake, capsys):
    fake.world.project_quotas = {"GPUS_ALL_REGIONS": (0, 0)}
    path = cluster_file(tmp_path, preset="standard-1", accelerator_type="nvidia-tesla-t4")
    assert main(["cluster", "preflight", path]) == 1
    out = capsys.readouterr().out
    assert ("FAIL  quota GPUS_ALL_REGIONS (project-wide): the cluster needs 4 GPUs, 0 free (limit 0; new "
            "projects get 0)\n        -> request GPUS_ALL_REGIONS quota") in out
    assert f"/compute/v1/projects/{PROJECT}" in fake.requests  # projects.get, through the real client
    # A CPU cluster does not need it.
    assert not any("GPUS_ALL_REGIONS" in c.what for c in checks_for(tmp_path, preset="standard-1"))


def test_os_login(tmp_path, fake):
    fake.metadata["items"] = [{"key": "enable-oslogin", "value": "TRUE"}]
    config = load(cluster_file(tmp_path, preset="standard-1"))
    ok = [c for c in run_checks(config, Compute(PROJECT)) if "OS Login" in c.what]
    assert [(c.status, c.what) for c in ok] == [
        (OK, "no organization policy requires OS Login (constraints/compute.requireOsLogin)"),
        (OK, "OS Login is on in the project and off on the cluster's VMs (instance metadata wins over the "
             "project's)")]
    for node in config["available_node_types"].values():  # a hand-written file without the override
        node["node_config"].pop("metadata")
    failed = [c for c in by_status(run_checks(config, Compute(PROJECT)), FAIL) if c.what.startswith("OS Login")]
    assert len(failed) == 1 and failed[0].what.startswith(
        "OS Login is on for n1-standard-8, ray_head (project metadata enable-oslogin=TRUE): it ignores the SSH "
        "key Ray adds")
    assert "enable-oslogin: FALSE" in failed[0].fix
    fake.metadata["items"] = []
    assert any(c.status == OK and c.what == "OS Login is off: Ray's SSH key will be accepted"
               for c in run_checks(config, Compute(PROJECT)))


def test_hand_written_files_are_checked_against_the_machine_table(tmp_path, fake):
    config = load(cluster_file(tmp_path, worker_machine_type="g2-standard-8", min_workers=1, max_workers=1))
    worker = config["available_node_types"]["g2-standard-8-l4x1"]["node_config"]
    del worker["disks"][0]["initializeParams"]["diskType"]
    del worker["scheduling"]
    config["cluster_name"] = "a-cluster-name-that-is-too-long-for-ray"
    failed = [(c.what, c.fix) for c in by_status(run_checks(config, Compute(PROJECT)), FAIL)]
    assert failed == [
        ("cluster name 'a-cluster-name-that-is-too-long-for-ray' is 39 characters: Ray's VM names "
         "(ray-NAME-worker-XXXXXXXX-compute, 67 characters) pass Compute Engine's 63",
         "use a cluster_name of at most 35 characters"),
        ("g2-standard-8-l4x1: boot disk type pd-standard (the API's default: the file sets no diskType), which "
         "g2-standard-8 does not take (G2 takes pd-balanced, pd-ssd)",
         "set initializeParams.diskType to zones/ZONE/diskTypes/pd-balanced (launcher cluster config writes it)"),
        ("g2-standard-8-l4x1: a GPU VM without onHostMaintenance TERMINATE (GPUs cannot live-migrate, so Compute "
         "Engine refuses it)", "set scheduling.onHostMaintenance: TERMINATE in its node_config"),
    ]


def test_an_x86_image_on_an_arm_type_fails_offline_in_one_line(tmp_path, fake):
    config = load(cluster_file(tmp_path, min_workers=1, max_workers=1))
    config["available_node_types"]["n1-standard-8"]["node_config"]["machineType"] = "c4a-standard-8"
    failed = [(c.what, c.fix) for c in by_status(run_checks(config, Compute(PROJECT)), FAIL)
              if "Arm" in c.what]
    assert failed == [("n1-standard-8: c4a-standard-8 is an Arm (ARM64) machine type and image common-cpu is X86_64: "
                       "Compute Engine refuses to boot it", "use an x86-64 machine type (c4-standard-8, or another "
                       "series), or an arm64 image (its node_config's sourceImage)")]


def test_n1_gpu_shapes_and_old_gpus(tmp_path, fake):
    config = load(cluster_file(tmp_path, accelerator_type="nvidia-tesla-v100", install="true"))
    checks = run_checks(config, Compute(PROJECT))
    assert [c.what for c in by_status(checks, WARN)] == [
        "n1-standard-8-v100x1: nvidia-tesla-v100 (Volta, compute capability 7.0) cannot run torch 2.13.0's "
        "CUDA 13.0 wheels (they need 7.5, Turing, or newer)"]
    assert "n1-standard-8-v100x1: 1 x nvidia-tesla-v100 on n1-standard-8 is a shape N1 offers" in [
        c.what for c in checks if c.status == OK]
    # 1 x V100 allows at most 12 vCPUs: n1-standard-16 does not exist with it (the API's vCPUs count).
    config["available_node_types"]["n1-standard-8-v100x1"]["node_config"]["machineType"] = "n1-standard-16"
    assert [(c.what, c.fix) for c in by_status(run_checks(config, Compute(PROJECT)), FAIL)] == [
        ("n1-standard-8-v100x1: 1 x nvidia-tesla-v100 allows at most 12 vCPUs on N1, not 16",
         "use n1-standard-8 or smaller, or more GPUs")]


def test_cluster_down_deletes_the_vms_ray_down_left_stopped(tmp_path, fake, monkeypatch, capsys):
    """With cache_stopped_nodes (STOP) `ray down` stops VMs, and preempted workers are stopped by Compute
    Engine; `ray down` lists running VMs only. `launcher cluster down` deletes the cluster's leftovers."""
    log = fake_ray(tmp_path, monkeypatch)
    path = cluster_file(tmp_path, cluster_name="demo", provisioning="spot", termination_action="STOP")
    demo = {"ray-cluster-name": "demo"}
    fake.add_vms("us-central1-a", [
        ("ray-demo-head-00aa11bb-compute", "TERMINATED", demo),
        ("ray-demo-worker-1a2b3c4d-compute", "TERMINATED", demo),
        ("ray-other-worker-99887766-compute", "TERMINATED", {"ray-cluster-name": "other"}),
        ("my-own-vm", "RUNNING", {}),
    ])
    assert main(["cluster", "down", path, "--dry-run"]) == 0
    assert "would then delete the VMs labelled ray-cluster-name=demo in us-central1-a" in capsys.readouterr().out
    assert fake.deleted == [] and not os.path.exists(log)
    assert main(["cluster", "down", path]) == 0
    out = capsys.readouterr().out
    assert open(log).read() == f"down -y {path}\n"  # Ray's own teardown first
    assert fake.deleted == ["us-central1-a/ray-demo-head-00aa11bb-compute",
                            "us-central1-a/ray-demo-worker-1a2b3c4d-compute"]
    assert "deleted 2 VM(s) labelled ray-cluster-name=demo in us-central1-a that `ray down` left" in out
    assert "  ray-demo-worker-1a2b3c4d-compute (TERMINATED)" in out
    assert list(fake.instances) == ["ray-other-worker-99887766-compute", "my-own-vm"]
    assert main(["cluster", "down", path]) == 0
    assert "no VMs labelled ray-cluster-name=demo in us-central1-a left" in capsys.readouterr().out


def test_gpu_images_must_carry_a_driver_for_cuda_13(tmp_path, fake):
    config = load(cluster_file(tmp_path, preset="basic-gpu"))
    init = config["available_node_types"]["ray_head"]["node_config"]["disks"][0]["initializeParams"]
    assert not [c for c in run_checks(config, Compute(PROJECT)) if "driver" in c.what]  # the default: 580
    family = "projects/deeplearning-platform-release/global/images/family/"
    init["sourceImage"] = family + "common-cu124-debian-11-nvidia-550"
    assert [(c.status, c.what) for c in run_checks(config, Compute(PROJECT)) if "driver" in c.what] == [
        (FAIL, "ray_head: image common-cu124-debian-11-nvidia-550 carries the NVIDIA 550 driver; torch 2.13.0's "
               "CUDA 13.0 wheels need 580 or newer")]
    init["sourceImage"] = family + "common-cu121"
    assert [c.status for c in run_checks(config, Compute(PROJECT)) if "driver" in c.what] == [WARN]


def test_preflight_says_when_this_environment_cannot_run_rays_gcp_provider(monkeypatch):
    import importlib.util

    from cluster import preflight

    assert preflight._local_client_check().status == OK  # pyproject.toml pins it: the venv has it
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "googleapiclient"
                        else real(name, *a))
    check = preflight._local_client_check()
    assert (check.status, check.what) == (FAIL, "googleapiclient cannot be imported here, and Ray's GCP provider "
                                                "(`ray up`) imports it")


def test_cluster_down_says_when_it_cannot_look_for_left_vms(tmp_path, monkeypatch, capsys):
    log = fake_ray(tmp_path, monkeypatch)
    path = cluster_file(tmp_path, cluster_name="demo")
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:9")  # nothing listens there
    assert main(["cluster", "down", path]) == 0  # `ray down` itself succeeded
    assert open(log).read() == f"down -y {path}\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: could not look for VMs labelled ray-cluster-name=demo in us-central1-a left after "
                   "`ray down` (the Compute Engine API did not answer (ConnectionError)); check with: gcloud compute "
                   f"instances list --project {PROJECT} --filter labels.ray-cluster-name=demo"]

