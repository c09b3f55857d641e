"""cluster.spec and cluster.config: presets, validation, and Ray cluster files that Ray's schema accepts."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from cluster.config import ray_cluster_config, to_yaml
from cluster.spec import CPU_IMAGE, GPU_IMAGE, PRESETS, ClusterSpec
from launcher.cli.main import main
from launcher.errors import UserError

VERSION = "0.1.0"
BASE = {"project": "my-project", "source_dir": "/home/me/launcher"}


def build(**values) -> dict:
    spec = ClusterSpec.from_mapping({**BASE, **values}).validated()
    return ray_cluster_config(spec, VERSION)


def ray_schema() -> dict:
    import ray.autoscaler

    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        return json.load(f)


VARIANTS = [{"preset": name} for name in PRESETS] + [
    {"preset": "standard-1", "accelerator_type": "nvidia-tesla-t4", "accelerator_count": 2,
     "provisioning": "spot", "termination_action": "STOP", "horovod": True},
    {"preset": "custom", "worker_machine_type": "g2-standard-8", "accelerator_type": "nvidia-l4",
     "provisioning": "preemptible", "network": "my-vpc", "subnetwork": "my-subnet", "scopes": ["cloud-platform"]},
]


@pytest.mark.parametrize("values", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values())[:40])
def test_every_preset_validates_against_rays_schema(values):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = build(**values)
    jsonschema.validate(config, ray_schema())
    validate_config(prepare_config(config))  # what `ray up` itself does with the file
    # The YAML text round-trips to the same file.
    spec = ClusterSpec.from_mapping({**BASE, **values}).validated()
    assert yaml.safe_load(to_yaml(config, spec, VERSION)) == config


def test_schema_check_can_fail():
    import jsonschema

    config = build(preset="basic")
    config["available_node_types"]["ray_head"]["resources"]["CPU"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, ray_schema())


def test_secure_by_default():
    config = build(preset="standard-1")
    text = yaml.safe_dump(config)
    assert "0.0.0.0" not in text
    assert any("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"])
    head = config["available_node_types"]["ray_head"]["node_config"]["serviceAccounts"][0]
    worker = config["available_node_types"]["n1-standard-8"]["node_config"]["serviceAccounts"][0]
    assert head["email"] == "ray-autoscaler-sa-v1@my-project.iam.gserviceaccount.com"
    assert not any(s.endswith("cloud-platform") for s in head["scopes"] + worker["scopes"])
    assert "https://www.googleapis.com/auth/devstorage.read_write" in worker["scopes"]
    assert "https://www.googleapis.com/auth/compute" in head["scopes"]  # the autoscaler creates VMs
    assert "https://www.googleapis.com/auth/compute" not in worker["scopes"]


def test_presets_match_the_scale_tiers():
    basic = build(preset="basic")
    assert list(basic["available_node_types"]) == ["ray_head"] and basic["max_workers"] == 0
    standard = build(preset="standard-1")
    workers = standard["available_node_types"]["n1-standard-8"]
    assert workers["min_workers"] == workers["max_workers"] == 4 and "GPU" not in workers["resources"]
    gpu = build(preset="basic-gpu")
    head = gpu["available_node_types"]["ray_head"]
    assert head["resources"] == {"CPU": 8, "GPU": 1}
    assert head["node_config"]["guestAccelerators"] == [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}]
    assert head["node_config"]["scheduling"] == {"onHostMaintenance": "TERMINATE"}
    assert head["node_config"]["disks"][0]["initializeParams"]["sourceImage"] == GPU_IMAGE


def test_spot_gpu_workers():
    config = build(preset="standard-1", accelerator_type="nvidia-tesla-t4", accelerator_count=2, provisioning="spot")
    worker = config["available_node_types"]["n1-standard-8-t4x2"]["node_config"]
    assert worker["scheduling"] == {"onHostMaintenance": "TERMINATE", "automaticRestart": False,
                                    "provisioningModel": "SPOT", "instanceTerminationAction": "DELETE"}
    assert worker["disks"][0]["initializeParams"]["sourceImage"] == GPU_IMAGE
    assert {"key": "install-nvidia-driver", "value": "True"} in worker["metadata"]["items"]
    head = config["available_node_types"]["ray_head"]["node_config"]
    assert "scheduling" not in head and "guestAccelerators" not in head  # the head is never Spot
    assert head["disks"][0]["initializeParams"]["sourceImage"] == CPU_IMAGE
    assert config["worker_start_ray_commands"][-1].startswith("nohup launcher preemption watch")
    assert not any("preemption watch" in c for c in config["head_start_ray_commands"])
    # GPU nodes install the CUDA torch wheels, the CPU head the small CPU ones.
    assert "download.pytorch.org/whl/cpu" in config["head_setup_commands"][0]
    assert "download.pytorch.org/whl/cpu" not in config["worker_setup_commands"][0]
    assert "cache_stopped_nodes" not in config["provider"]  # DELETE: a preempted VM is gone


def test_spot_workers_stopped_on_preemption_are_started_again():
    """STOP keeps a preempted Spot VM's disk; Ray's GCP provider then starts it again (its set-up
    done) before it creates a new VM. The file still passes Ray's own checks."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = build(preset="standard-1", provisioning="spot", termination_action="STOP")
    worker = config["available_node_types"]["n1-standard-8"]["node_config"]
    assert worker["scheduling"]["instanceTerminationAction"] == "STOP"
    assert config["provider"]["cache_stopped_nodes"] is True
    validate_config(prepare_config(config))  # what `ray up` itself does with the file
    assert config["worker_start_ray_commands"][-1].startswith("nohup launcher preemption watch")


def test_preemptible_and_standard_workers():
    pre = build(preset="standard-1", provisioning="preemptible")
    sched = pre["available_node_types"]["n1-standard-8"]["node_config"]["scheduling"]
    assert sched == {"onHostMaintenance": "TERMINATE", "automaticRestart": False, "preemptible": True}
    assert any("preemption watch" in c for c in pre["worker_start_ray_commands"])
    std = build(preset="standard-1")
    assert "scheduling" not in std["available_node_types"]["n1-standard-8"]["node_config"]
    assert not any("preemption watch" in c for c in std["worker_start_ray_commands"])


def test_bundled_gpu_machine_types_take_no_guest_accelerators():
    config = build(worker_machine_type="g2-standard-8", accelerator_type="nvidia-l4")
    worker = config["available_node_types"]["g2-standard-8-l4x1"]
    assert worker["resources"] == {"CPU": 8, "GPU": 1} and "guestAccelerators" not in worker["node_config"]


def test_install_source_and_horovod():
    config = build(preset="standard-1", horovod=True)
    assert config["file_mounts"] == {"~/launcher": "/home/me/launcher"}
    assert {".venv", ".git", "/runs"} <= set(config["rsync_exclude"])
    for key in ("head_setup_commands", "worker_setup_commands"):
        commands = config[key]
        assert commands[0].endswith("pip install --quiet --extra-index-url https://download.pytorch.org/whl/cpu "
                                    "~/launcher")
        assert '"0.1.0"' in commands[1]  # the node checks it got this very version
        assert commands[2] == "cd ~/launcher && scripts/install-horovod"
    custom = build(preset="basic", install="pip install launcher==0.1.0", source_dir=None)
    assert custom["head_setup_commands"][0] == "pip install launcher==0.1.0" and custom["file_mounts"] == {}


def test_network_and_service_account():
    config = build(network="my-vpc", subnetwork="my-subnet", service_account="trainer@my-project.iam.gserviceaccount.com",
                   zone="europe-west4-a")
    nc = config["available_node_types"]["n1-standard-8"]["node_config"]
    assert nc["networkInterfaces"][0]["network"] == "projects/my-project/global/networks/my-vpc"
    assert nc["networkInterfaces"][0]["subnetwork"] == "projects/my-project/regions/europe-west4/subnetworks/my-subnet"
    assert nc["serviceAccounts"][0]["email"] == "trainer@my-project.iam.gserviceaccount.com"
    assert config["provider"] == {"type": "gcp", "region": "europe-west4", "availability_zone": "europe-west4-a",
                                  "project_id": "my-project"}


@pytest.mark.parametrize("values, message", [
    ({"preset": "large"}, "unknown preset 'large'; valid presets: basic, standard-1, basic-gpu, custom"),
    ({"zone": "us-central1"}, "zone 'us-central1' is not a zone name"),
    ({"zone": "us-central1-a", "region": "us-east1"}, "zone us-central1-a is not in region us-east1"),
    ({"accelerator_type": "nvidia-tesla-t5"}, "did you mean nvidia-tesla-t4?"),
    ({"accelerator_type": "nvidia-l4"}, "nvidia-l4 attaches to G2 machine types, not n1-standard-8"),
    ({"accelerator_type": "nvidia-tesla-t4", "accelerator_count": 3}, "must be 1, 2, 4 or 8"),
    ({"worker_machine_type": "a2-highgpu-2g", "accelerator_type": "nvidia-tesla-a100", "accelerator_count": 1},
     "a2-highgpu-2g comes with 2 x nvidia-tesla-a100, not 1"),
    ({"accelerator_count": 2}, "no accelerator type is given"),
    ({"provisioning": "spott"}, "unknown provisioning model 'spott'"),
    ({"preset": "basic", "provisioning": "spot"}, "applies to worker VMs, and this cluster has none"),
    ({"termination_action": "HIBERNATE", "provisioning": "spot"}, "unknown Spot termination action"),
    ({"min_workers": 3, "max_workers": 2}, "min_workers (3) is above max_workers (2)"),
    ({"cluster_name": "My_Cluster"}, "cluster name 'My_Cluster' is not valid"),
    ({"max_wokers": 3}, "unknown key 'max_wokers'; did you mean max_workers?"),
    ({"max_workers": "many"}, "max_workers must be an integer"),
    ({"horovod": "yes"}, "horovod must be true or false"),
    ({"disk_size_gb": 5}, "disk_size_gb is too small"),
    ({"head_machine_type": "big-machine"}, "vCPU count is known"),
])
def test_bad_specs_are_one_clear_error(values, message):
    with pytest.raises(UserError) as err:
        ClusterSpec.from_mapping({**BASE, **values}).validated()
    assert message in str(err.value)


def test_no_project_is_an_error():
    with pytest.raises(UserError, match="no Google Cloud project given"):
        ClusterSpec.from_mapping({"preset": "basic"}).validated()


def test_cli_config_from_flags_and_spec_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("CLOUDSDK_CORE_PROJECT", raising=False)
    spec_file = tmp_path / "cluster-spec.yaml"
    spec_file.write_text("preset: standard-1\nzone: europe-west4-a\nmax_workers: 6\naccelerator_type: nvidia-tesla-t4\n")
    assert main(["cluster", "config", "--spec", str(spec_file), "--project", "p1", "--min-workers", "2",
                 "--provisioning", "spot"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    worker = config["available_node_types"]["n1-standard-8-t4x1"]
    assert (worker["min_workers"], worker["max_workers"]) == (2, 6)
    assert config["provider"]["availability_zone"] == "europe-west4-a"
    assert worker["node_config"]["scheduling"]["provisioningModel"] == "SPOT"
    # Run from this checkout, the project source is what every node installs.
    assert config["file_mounts"]["~/launcher"] == os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    spec_file.write_text("preset: standard-1\nmax_wokers: 3\n")
    assert main(["cluster", "config", "--spec", str(spec_file), "--project", "p1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {spec_file}: unknown key 'max_wokers'; did you mean max_workers?"]
    assert main(["cluster", "config", "--preset", "basic"]) == 2
    assert "no Google Cloud project given" in capsys.readouterr().err


def test_cluster_package_never_imports_workloads():
    import subprocess
    import sys

    code = ("import sys, cluster.config, cluster.preflight, cluster.compute, launcher.cli.cluster; "
            "sys.exit('workloads' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0


def test_node_types_are_named_and_labelled_after_their_machine_type():
    gpu = build(preset="standard-1", accelerator_type="nvidia-tesla-t4", accelerator_count=2)
    assert list(gpu["available_node_types"]) == ["ray_head", "n1-standard-8-t4x2"]
    assert gpu["available_node_types"]["n1-standard-8-t4x2"]["labels"] == {
        "launcher/machine-type": "n1-standard-8", "launcher/accelerator": "nvidia-tesla-t4x2"}
    assert gpu["available_node_types"]["ray_head"]["labels"] == {
        "launcher/machine-type": "n1-standard-4", "launcher/accelerator": "none"}
    cpu = build(preset="standard-1")
    assert list(cpu["available_node_types"]) == ["ray_head", "n1-standard-8"]
    assert cpu["available_node_types"]["n1-standard-8"]["labels"] == {
        "launcher/machine-type": "n1-standard-8", "launcher/accelerator": "none"}
    # A GPU head (no workers) says it has its GPU; an A2 type its own A100s.
    assert build(preset="basic-gpu")["available_node_types"]["ray_head"]["labels"]["launcher/accelerator"] == \
        "nvidia-tesla-t4x1"
    a2 = build(worker_machine_type="a2-highgpu-2g", accelerator_type="nvidia-tesla-a100")
    assert a2["available_node_types"]["a2-highgpu-2g-a100x2"]["labels"]["launcher/accelerator"] == \
        "nvidia-tesla-a100x2"
    # Every label is one Ray accepts at `ray start` (RAY_OVERRIDE_LABELS).
    from ray._private.label_utils import validate_node_label_syntax, validate_node_labels

    for config in (gpu, cpu, a2):
        for node in config["available_node_types"].values():
            validate_node_labels(node["labels"])
            validate_node_label_syntax(node["labels"])


@pytest.mark.parametrize("text, canonical, node_type", [
    ("n1-standard-8", "n1-standard-8", "n1-standard-8"),
    ("n1-standard-8+nvidia-tesla-t4", "n1-standard-8+nvidia-tesla-t4x1", "n1-standard-8-t4x1"),
    ("N1-STANDARD-16+NVIDIA_TESLA_V100x4", "n1-standard-16+nvidia-tesla-v100x4", "n1-standard-16-v100x4"),
    ("g2-standard-8", "g2-standard-8+nvidia-l4x1", "g2-standard-8-l4x1"),
    ("a2-highgpu-2g+nvidia-tesla-a100", "a2-highgpu-2g+nvidia-tesla-a100x2", "a2-highgpu-2g-a100x2"),
])
def test_machine_types_are_spelled_one_way(text, canonical, node_type):
    from cluster import machines

    parsed = machines.parse(text)
    assert (str(parsed), parsed.node_type) == (canonical, node_type)
    assert machines.from_labels(parsed.labels) == parsed  # what a labelled node says it is


@pytest.mark.parametrize("text, message", [
    ("n1 standard", "'n1 standard' is not a Compute Engine machine type"),
    ("n1-standard-8+nvidia-tesla-t5", "unknown accelerator 'nvidia-tesla-t5'; did you mean nvidia-tesla-t4?"),
    ("n1-standard-8+nvidia-l4", "nvidia-l4 attaches to G2 machine types, not n1-standard-8"),
    ("n1-standard-8+nvidia-tesla-t4x3", "3 x nvidia-tesla-t4 per VM"),
    ("a2-highgpu-2g+nvidia-tesla-a100x1", "a2-highgpu-2g comes with 2 x nvidia-tesla-a100; write "
                                          "a2-highgpu-2g+nvidia-tesla-a100x2, or just a2-highgpu-2g"),
])
def test_bad_machine_types_are_one_clear_error(text, message):
    from cluster import machines

    with pytest.raises(UserError) as err:
        machines.parse(text, "--machine-type")
    assert message in str(err.value) and str(err.value).startswith(f"--machine-type {text}: ")
