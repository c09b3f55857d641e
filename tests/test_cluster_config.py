"""cluster.spec and cluster.config: presets, validation, and Ray cluster files that Ray's schema accepts."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from cluster.config import TORCH_NCCL, UV_PIP, ray_cluster_config, to_yaml
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
    assert config["worker_setup_commands"][0].startswith("timeout 300 bash -c 'until nvidia-smi")
    assert config["worker_setup_commands"][1] == f"{UV_PIP} ~/launcher"
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
        # Horovod's build needs TensorFlow: the horovod extra
        # uv, with pip's rule for two indexes (the best match), so numpy and others still come from PyPI
        assert commands[0] == (f"{UV_PIP} --index-strategy unsafe-best-match --extra-index-url "
                               "https://download.pytorch.org/whl/cpu ~/launcher'[horovod]'")
        assert '"0.1.0"' in commands[1]  # the node checks it got this very version
        # Horovod's build needs cmake 3 and a compiler, installed first; CPU nodes build with Gloo only.
        assert commands[-2].endswith("install -y cmake g++") and "apt-get" in commands[-2]
        assert commands[-1].startswith("cd ~/launcher && HOROVOD_BUILD_JOBS=$(python -c ")
        assert commands[-1].endswith(") scripts/install-horovod")
    custom = build(preset="basic", install="pip install launcher==0.1.0", source_dir=None)
    assert custom["head_setup_commands"][0] == "pip install launcher==0.1.0" and custom["file_mounts"] == {}


def test_nodes_install_the_core_and_the_extras_the_spec_names(tmp_path):
    import subprocess

    assert build(preset="standard-1")["worker_setup_commands"][0].endswith(" ~/launcher")  # the core alone
    config = build(preset="standard-1", extras="xgboost,tensorflow", horovod=True)
    install = config["worker_setup_commands"][0]
    assert install.endswith(" ~/launcher'[horovod,tensorflow,xgboost]'")
    # The shell expands ~ and leaves the brackets to pip (unquoted, they are a glob).
    (tmp_path / "launcherh").mkdir()  # a file the glob [horovod,...] would match
    said = subprocess.run(["bash", "-c", "echo " + install.split(" ")[-1]], env={"HOME": str(tmp_path)},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert said == f"{tmp_path}/launcher[horovod,tensorflow,xgboost]"
    with pytest.raises(UserError, match=r"--extras: unknown extra 'tensorfow' \(did you mean tensorflow\?\); "
                                        r"valid: tensorflow, xgboost, horovod, tune, mlflow, cluster, lab, torchft, all"):
        build(extras="tensorfow")
    with pytest.raises(UserError, match="--install replaces that install"):
        build(extras="mlflow", install="pip install launcher==0.1.0", source_dir=None)


def _fake_site(tmp_path, torch_requires: list[str], libnccl: bool = True):
    """A site-packages folder as a GPU node's venv has it: torch's metadata, and the nvidia-nccl wheel's files."""
    site = tmp_path / "site"
    info = site / "torch-2.13.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n"
                                         + "".join(f"Requires-Dist: {r}\n" for r in torch_requires))
    nccl = site / "nvidia" / "nccl"  # a namespace package, as the NVIDIA wheels install it
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    if libnccl:
        (nccl / "lib" / "libnccl.so.2").write_text("")
    return site


def _stand_ins(tmp_path) -> str:
    """uv (~/.local/bin/uv) and scripts/install-horovod that print what they were given; returns the PATH to run
    with."""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    uv = tmp_path / ".local" / "bin" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text("#!/bin/sh\necho \"uv $*\"\n")
    script = tmp_path / "launcher" / "scripts" / "install-horovod"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\nenv | grep '^HOROVOD_' | sort\n")
    for path in (uv, script):
        path.chmod(0o755)
    return f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin"


def _run(command: str, tmp_path, site, path: str):
    import subprocess

    return subprocess.run(["bash", "-c", command], env={"HOME": str(tmp_path), "PATH": path, "PYTHONPATH": str(site)},
                          capture_output=True, text=True)


@pytest.mark.parametrize("values, capability", [
    ({"accelerator_type": "nvidia-tesla-t4"}, "75"), ({"worker_machine_type": "g2-standard-8"}, "89"),
    ({"worker_machine_type": "a2-highgpu-1g"}, "80"), ({"worker_machine_type": "a3-highgpu-8g"}, "90")])
def test_horovod_on_gpu_nodes_builds_with_the_nccl_wheel_for_the_nodes_gpu(tmp_path, values, capability):
    """The GPU build recipe's commands run in bash against a venv laid out as a GPU node's, with stand-ins for uv
    and scripts/install-horovod that print what they are given (benchmarks/gpu_horovod_nccl.sh runs the real
    build on a GPU)."""
    config = build(preset="standard-1", horovod=True, **values)
    worker, head = config["worker_setup_commands"], config["head_setup_commands"]
    assert worker[-2].endswith("install -y cmake g++") and "apt-get" in worker[-2]  # before the build
    assert head[-1].startswith("cd ~/launcher && HOROVOD_BUILD_JOBS=$(") and "NCCL" not in head[-1]  # CPU: Gloo
    site = _fake_site(tmp_path, ["nvidia-nccl-cu13==2.29.7; platform_system == \"Linux\"", "filelock"])
    path = _stand_ins(tmp_path)
    # torch's own NCCL wheel is put back last, over xgboost's or TensorFlow's nvidia-nccl-cu12
    assert worker[-3] == TORCH_NCCL
    done = _run(worker[-3], tmp_path, site, path)
    assert done.stdout.strip() == (f"uv pip install --quiet --python {tmp_path}/launcher-venv/bin/python --no-deps "
                                   "--reinstall nvidia-nccl-cu13==2.29.7")
    done = _run(worker[-1], tmp_path, site, path)
    assert done.returncode == 0, done.stderr
    nccl = site / "nvidia" / "nccl"
    said = dict(line.split("=", 1) for line in done.stdout.split())
    jobs = said.pop("HOROVOD_BUILD_JOBS")
    assert said == {"HOROVOD_GPU": "CUDA", "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED",
                    "HOROVOD_NCCL_HOME": str(nccl), "HOROVOD_NCCL_INCLUDE": f"{nccl}/include",
                    "HOROVOD_NCCL_LIB": f"{nccl}/lib", "HOROVOD_CUDA_HOME": "/usr/local/cuda",
                    "HOROVOD_BUILD_CUDA_CC_LIST": capability}
    assert 1 <= int(jobs) <= os.cpu_count()
    # FindNCCL's shared library name, beside the wheel's real one
    assert os.readlink(nccl / "lib" / "libnccl.so") == "libnccl.so.2"
    assert head[-3:] == build(preset="standard-1", horovod=True)["head_setup_commands"][-3:]  # the CPU head's own


def test_a_gpu_node_without_the_nccl_wheel_stops_with_one_line_and_torch_without_it_installs_nothing(tmp_path):
    worker = build(preset="standard-1", horovod=True, accelerator_type="nvidia-tesla-t4")["worker_setup_commands"]
    site = _fake_site(tmp_path, ["filelock"], libnccl=False)
    path = _stand_ins(tmp_path)
    assert _run(worker[-3], tmp_path, site, path).stdout == ""  # a torch that names no NCCL wheel
    done = _run(worker[-1], tmp_path, site, path)
    assert done.returncode != 0 and "HOROVOD_" not in done.stdout
    assert done.stderr.strip() == "no NCCL wheel (nvidia-nccl) in the venv; torch's CUDA build brings one"


def test_torchs_nccl_is_put_back_where_another_extra_brings_its_own():
    def has_it(**values) -> bool:
        return TORCH_NCCL in build(**values)["worker_setup_commands"]

    assert has_it(accelerator_type="nvidia-tesla-t4", extras="xgboost")  # xgboost pulls nvidia-nccl-cu12
    assert has_it(accelerator_type="nvidia-tesla-t4", extras="all")
    assert not has_it(accelerator_type="nvidia-tesla-t4", extras="mlflow")
    assert not has_it(extras="xgboost")  # CPU workers: no NCCL at all


def test_network_and_service_account():
    config = build(network="my-vpc", subnetwork="my-subnet", service_account="trainer@my-project.iam.gserviceaccount.com",
                   zone="europe-west4-a")
    nc = config["available_node_types"]["n1-standard-8"]["node_config"]
    assert nc["networkInterfaces"][0]["network"] == "projects/my-project/global/networks/my-vpc"
    assert nc["networkInterfaces"][0]["subnetwork"] == "projects/my-project/regions/europe-west4/subnetworks/my-subnet"
    assert nc["serviceAccounts"][0]["email"] == "trainer@my-project.iam.gserviceaccount.com"
    # Ray's GCP provider with its label cache kept current (cluster/gcp_provider.py), named as an external one
    assert config["provider"] == {"type": "external", "module": "cluster.gcp_provider.Provider",
                                  "region": "europe-west4", "availability_zone": "europe-west4-a",
                                  "project_id": "my-project"}


@pytest.mark.parametrize("values, message", [
    ({"preset": "large"}, "unknown preset 'large'; valid presets: basic, standard-1, basic-gpu, custom"),
    ({"zone": "us-central1"}, "zone 'us-central1' is not a zone name"),
    ({"zone": "us-central1-a", "region": "us-east1"}, "zone us-central1-a is not in region us-east1"),
    ({"accelerator_type": "nvidia-tesla-t5"}, "did you mean nvidia-tesla-t4?"),
    ({"accelerator_type": "nvidia-l4"}, "nvidia-l4 attaches to G2 machine types, not n1-standard-8"),
    ({"accelerator_type": "nvidia-tesla-t4", "accelerator_count": 3}, "must be 1, 2 or 4 for nvidia-tesla-t4"),
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
    from cluster import machine_types

    parsed = machine_types.parse(text)
    assert (str(parsed), parsed.node_type) == (canonical, node_type)
    assert machine_types.from_labels(parsed.labels) == parsed  # what a labelled node says it is


@pytest.mark.parametrize("text, message", [
    ("n1 standard", "'n1 standard' is not a Compute Engine machine type"),
    ("n1-standard-8+nvidia-tesla-t5", "unknown accelerator 'nvidia-tesla-t5'; did you mean nvidia-tesla-t4?"),
    ("n1-standard-8+nvidia-l4", "nvidia-l4 attaches to G2 machine types, not n1-standard-8"),
    ("n1-standard-8+nvidia-tesla-t4x3", "3 x nvidia-tesla-t4 per VM"),
    ("a2-highgpu-2g+nvidia-tesla-a100x1", "a2-highgpu-2g comes with 2 x nvidia-tesla-a100; write "
                                          "a2-highgpu-2g+nvidia-tesla-a100x2, or just a2-highgpu-2g"),
])
def test_bad_machine_types_are_one_clear_error(text, message):
    from cluster import machine_types

    with pytest.raises(UserError) as err:
        machine_types.parse(text, "--machine-type")
    assert message in str(err.value) and str(err.value).startswith(f"--machine-type {text}: ")


# -- issue 43: clusters that come up the first time ---------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_type(config: dict) -> tuple[str, dict]:
    return next((name, node) for name, node in config["available_node_types"].items() if name != "ray_head")


def checked(config: dict) -> dict:
    """The file as `ray up` would take it: Ray's JSON schema and its own validation."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    jsonschema.validate(config, ray_schema())
    validate_config(prepare_config(config))
    return config


# machine type -> node type, Ray resources, boot disk type, gVNIC
GPU_FAMILIES = [
    ("g2-standard-8", "g2-standard-8-l4x1", {"CPU": 8, "GPU": 1}, "pd-balanced", False),
    ("g2-standard-24", "g2-standard-24-l4x2", {"CPU": 24, "GPU": 2}, "pd-balanced", False),
    ("g2-standard-48", "g2-standard-48-l4x4", {"CPU": 48, "GPU": 4}, "pd-balanced", False),
    ("a2-highgpu-1g", "a2-highgpu-1g-a100x1", {"CPU": 12, "GPU": 1}, "pd-balanced", False),
    ("a2-megagpu-16g", "a2-megagpu-16g-a100x16", {"CPU": 96, "GPU": 16}, "pd-balanced", False),
    ("a2-ultragpu-2g", "a2-ultragpu-2g-a100-80gbx2", {"CPU": 24, "GPU": 2}, "pd-balanced", False),
    ("a3-highgpu-8g", "a3-highgpu-8g-h100-80gbx8", {"CPU": 208, "GPU": 8}, "pd-balanced", True),
    ("a3-megagpu-8g", "a3-megagpu-8g-h100-mega-80gbx8", {"CPU": 208, "GPU": 8}, "pd-balanced", True),
    ("a3-ultragpu-8g", "a3-ultragpu-8g-h200-141gbx8", {"CPU": 224, "GPU": 8}, "hyperdisk-balanced", True),
    ("a4-highgpu-8g", "a4-highgpu-8g-b200x8", {"CPU": 224, "GPU": 8}, "hyperdisk-balanced", True),
]


@pytest.mark.parametrize("machine, node_type, resources, disk, gvnic", GPU_FAMILIES, ids=lambda v: str(v))
def test_machine_types_with_built_in_gpus_need_no_accelerator_flag(machine, node_type, resources, disk, gvnic):
    config = checked(build(worker_machine_type=machine))
    name, node = worker_type(config)
    nc = node["node_config"]
    assert (name, node["resources"]) == (node_type, resources)
    assert nc["scheduling"] == {"onHostMaintenance": "TERMINATE"}  # GPU VMs cannot live-migrate
    assert "guestAccelerators" not in nc  # the machine type brings them
    init = nc["disks"][0]["initializeParams"]
    assert init["sourceImage"] == GPU_IMAGE and init["diskType"] == f"zones/us-central1-a/diskTypes/{disk}"
    assert {"key": "install-nvidia-driver", "value": "True"} in nc["metadata"]["items"]
    assert config["worker_setup_commands"][0].startswith("timeout 300 bash -c 'until nvidia-smi")
    assert "whl/cpu" not in " ".join(config["worker_setup_commands"])  # CUDA torch wheels
    from cluster import machine_types

    # A run's --machine-type g2-standard-24 (its GPUs implied) finds this node type by its labels.
    assert node["labels"] == machine_types.parse(machine).labels
    assert node["labels"]["launcher/accelerator"].endswith(f"x{resources['GPU']}")
    nic = (nc.get("networkInterfaces") or [{}])[0]
    assert (nic.get("nicType") == "GVNIC") == gvnic
    # The CPU head keeps a CPU image and a balanced disk.
    head = config["available_node_types"]["ray_head"]["node_config"]
    assert head["disks"][0]["initializeParams"]["diskType"].endswith("/pd-balanced")
    assert head["disks"][0]["initializeParams"]["sourceImage"] == CPU_IMAGE


def test_a_gpu_head_of_a_built_in_type_and_the_cli(capsys):
    head = build(preset="basic", head_machine_type="g2-standard-24")["available_node_types"]["ray_head"]
    assert head["resources"] == {"CPU": 24, "GPU": 2}
    assert head["node_config"]["scheduling"] == {"onHostMaintenance": "TERMINATE"}
    assert main(["cluster", "config", "--worker-machine-type", "a2-highgpu-1g", "--project", "p"]) == 0
    name, node = worker_type(yaml.safe_load(capsys.readouterr().out))
    assert (name, node["resources"]) == ("a2-highgpu-1g-a100x1", {"CPU": 12, "GPU": 1})
    assert main(["cluster", "config", "--worker-machine-type", "a2-highgpu-3g", "--project", "p"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: machine type 'a2-highgpu-3g' is not a known A2 type; valid: a2-highgpu-1g, "
                   "a2-highgpu-2g, a2-highgpu-4g, a2-highgpu-8g"]


def test_every_node_has_a_boot_disk_type_its_series_takes():
    assert build()["available_node_types"]["n1-standard-8"]["node_config"]["disks"][0]["initializeParams"][
        "diskType"] == "zones/us-central1-a/diskTypes/pd-balanced"
    ssd = build(disk_type="pd-ssd", worker_machine_type="g2-standard-8")
    for node in ssd["available_node_types"].values():
        assert node["node_config"]["disks"][0]["initializeParams"]["diskType"].endswith("/pd-ssd")
    c4 = checked(build(head_machine_type="c4-standard-8", worker_machine_type="n2-standard-8"))
    assert c4["available_node_types"]["ray_head"]["node_config"]["disks"][0]["initializeParams"][
        "diskType"].endswith("/hyperdisk-balanced")
    assert c4["available_node_types"]["n2-standard-8"]["node_config"]["disks"][0]["initializeParams"][
        "diskType"].endswith("/pd-balanced")


@pytest.mark.parametrize("values, message", [
    ({"worker_machine_type": "g2-standard-8", "disk_type": "pd-standard"},
     "boot disk type pd-standard is not offered for g2-standard-8 (G2 takes pd-balanced, pd-ssd); "
     "set --disk-type pd-balanced, or leave it out"),
    ({"worker_machine_type": "a3-highgpu-8g", "disk_type": "pd-standard"}, "not offered for a3-highgpu-8g"),
    ({"worker_machine_type": "a3-ultragpu-8g", "disk_type": "pd-balanced"},
     "not offered for a3-ultragpu-8g (A3 takes hyperdisk-balanced)"),
    ({"head_machine_type": "c4-standard-8", "disk_type": "pd-ssd"}, "not offered for c4-standard-8"),
    # torch 2.13's CUDA 13 wheels have no kernels for GPUs older than Turing.
    ({"accelerator_type": "nvidia-tesla-v100"},
     "nvidia-tesla-v100 (Volta, compute capability 7.0) cannot run torch 2.13.0: its CUDA 13.0 wheels need "
     "compute capability 7.5 (Turing) or newer; use nvidia-tesla-t4"),
    ({"accelerator_type": "nvidia-tesla-p100"}, "nvidia-tesla-p100 (Pascal, compute capability 6.0) cannot run"),
    ({"accelerator_type": "nvidia-tesla-p4"}, "nvidia-tesla-p4 (Pascal, compute capability 6.1) cannot run"),
    ({"accelerator_type": "nvidia-tesla-k80"}, "Compute Engine ended K80 support"),
    ({"accelerator_type": "nvidia-tesla-t4",
      "image": "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-nvidia-550"},
     "carries the NVIDIA 550 driver, and torch 2.13.0's CUDA 13.0 wheels need 580 or newer"),
    # N1 shapes: GPU count and vCPU/memory limits per GPU model.
    ({"accelerator_type": "nvidia-tesla-t4", "accelerator_count": 8}, "must be 1, 2 or 4 for nvidia-tesla-t4, got 8"),
    ({"accelerator_type": "nvidia-tesla-p100", "accelerator_count": 8, "install": "true"},
     "must be 1, 2 or 4 for nvidia-tesla-p100"),
    ({"accelerator_type": "nvidia-tesla-v100", "worker_machine_type": "n1-standard-16", "install": "true"},
     "n1-standard-16 with 1 x nvidia-tesla-v100: 1 x nvidia-tesla-v100 allows at most 12 vCPUs on N1, not 16; "
     "set --worker-machine-type to n1-standard-8 or smaller"),
    ({"accelerator_type": "nvidia-tesla-t4", "worker_machine_type": "n1-standard-64"},
     "1 x nvidia-tesla-t4 allows at most 48 vCPUs on N1, not 64"),
    ({"accelerator_type": "nvidia-tesla-v100", "worker_machine_type": "custom-8-81920-ext", "install": "true"},
     "1 x nvidia-tesla-v100 allows at most 78 GB of memory on N1, not 80"),
    # Ray's VM names must fit Compute Engine's 63 characters.
    ({"cluster_name": "a" * 36}, f"cluster name '{'a' * 36}' is 36 characters: Ray names the worker VMs "
     f"ray-{'a' * 36}-worker-XXXXXXXX-compute (64 characters) and Compute Engine refuses names over 63; "
     "use a --name of at most 35 characters"),
    ({"worker_machine_type": "a3-highgpu-1g"}, "a3-highgpu-1g is offered only as Spot (or flex-start) VMs"),
    ({"preset": "basic", "head_machine_type": "a3-highgpu-2g"}, "the head is always standard"),
    ({"worker_machine_type": "a2-highgpu-1g", "accelerator_type": "nvidia-a100-80gb"},
     "a2-highgpu-1g comes with nvidia-tesla-a100, not nvidia-a100-80gb"),
])
def test_what_compute_engine_or_torch_would_refuse_is_one_clear_error(values, message):
    with pytest.raises(UserError) as err:
        ClusterSpec.from_mapping({**BASE, **values}).validated()
    assert message in str(err.value)


def test_shapes_at_the_limits_pass():
    v100 = checked(build(accelerator_type="nvidia-tesla-v100", worker_machine_type="n1-highmem-8", install="true"))
    assert worker_type(v100)[1]["resources"] == {"CPU": 8, "GPU": 1}  # 8 vCPUs, 52 GB: within 12 / 78
    t4 = build(accelerator_type="nvidia-tesla-t4", accelerator_count=4, worker_machine_type="n1-standard-96")
    assert worker_type(t4)[1]["resources"] == {"CPU": 96, "GPU": 4}
    name = "a" * 35
    config = build(cluster_name=name)
    assert len(f"ray-{config['cluster_name']}-worker-1a2b3c4d-compute") == 63


def test_nodes_get_python_311_in_a_venv_first_on_path(tmp_path):
    """The images' Python is 3.10: every node makes a 3.11 venv with uv, and puts it first on the PATH
    of the shells Ray runs commands in (the command is run here, on a .bashrc like Ubuntu's)."""
    import subprocess

    commands = build()["setup_commands"]
    assert "uv==0.13.9" in commands[0] and "astral.sh/uv/0.13.9/install.sh" in commands[0]
    assert commands[1] == "test -x ~/launcher-venv/bin/python || ~/.local/bin/uv venv --seed --python 3.11 " \
                          "~/launcher-venv"
    assert not any("conda" in c for c in commands)
    bashrc = tmp_path / ".bashrc"
    bashrc.write_text("case $- in\n    *i*) ;;\n      *) return;;\nesac\nexport AFTER_GUARD=1\n")
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for _ in range(2):  # set-up runs again on every `ray up`: the line is added once
        subprocess.run(["bash", "-c", commands[2]], env=env, check=True)
    text = bashrc.read_text()
    assert text.count("launcher-venv") == 1 and text.startswith("export PATH=$HOME/launcher-venv/bin:$PATH\n")
    path = subprocess.run(["bash", "-c", "source ~/.bashrc; echo $PATH"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert path.split(":")[0] == f"{tmp_path}/launcher-venv/bin"
    assert "export AFTER_GUARD=1" in text  # the user's .bashrc is kept


def test_pyproject_pins_what_the_nodes_need():
    import tomllib

    from cluster.config import GOOGLE_API_CLIENT

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["requires-python"] == ">=3.11"
    assert set(GOOGLE_API_CLIENT) <= set(project["optional-dependencies"]["cluster"])
    # Ray's GCP provider imports it: `ray up` works from this environment.
    from ray.autoscaler._private.gcp import node_provider  # noqa: F401

    config = build(preset="standard-1", install="pip install launcher==0.1.0", source_dir=None)
    pins = f"{UV_PIP} google-api-python-client==2.202.0 google-auth-httplib2==0.4.4"
    assert pins in config["head_setup_commands"]  # the head's autoscaler, whatever --install installs
    assert pins not in config["worker_setup_commands"]


def test_os_login_is_off_on_every_node():
    for config in (build(preset="standard-1"), build(preset="basic-gpu")):
        for node in config["available_node_types"].values():
            assert {"key": "enable-oslogin", "value": "FALSE"} in node["node_config"]["metadata"]["items"]


def test_what_stopped_vms_a_cluster_can_leave_is_said():
    from cluster.config import cost_notes

    pre = ClusterSpec.from_mapping({**BASE, "provisioning": "preemptible"}).validated()
    assert "cache_stopped_nodes" not in ray_cluster_config(pre, VERSION)["provider"]
    text = to_yaml(ray_cluster_config(pre, VERSION), pre, VERSION)
    assert "# Preemptible workers: Compute Engine stops a preempted VM" in text
    assert "launcher cluster down THIS_FILE (`ray down`, then the VMs and disks it left)" in text
    stop = ClusterSpec.from_mapping({**BASE, "provisioning": "spot", "termination_action": "STOP"}).validated()
    assert "plain `ray down` stops every VM" in " ".join(cost_notes(stop))
    spot = ClusterSpec.from_mapping({**BASE, "provisioning": "spot"}).validated()
    assert not [n for n in cost_notes(spot) if "stop" in n.lower()] and "Preemptible" not in to_yaml(build(), spot,
                                                                                                      VERSION)


def test_gpu_workers_cost_nothing_idle_unless_kept(tmp_path):
    """GPU workers start at min_workers 0 (the autoscaler adds them on demand), said in the file; --min-workers
    keeps some; CPU workers stay at max_workers; every node's external IP is a choice the file explains."""
    gpu = ClusterSpec.from_mapping({**BASE, "accelerator_type": "nvidia-tesla-t4", "max_workers": 4}).validated()
    config = ray_cluster_config(gpu, VERSION)
    worker = config["available_node_types"]["n1-standard-8-t4x1"]
    assert (worker["min_workers"], worker["max_workers"]) == (0, 4)
    text = to_yaml(config, gpu, VERSION)
    assert "# GPU workers: min_workers 0: none runs (or bills) while the cluster is idle" in text
    assert "# External IPs: every node has one" in text and "Cloud NAT" in text
    kept = ClusterSpec.from_mapping({**BASE, "accelerator_type": "nvidia-tesla-t4", "min_workers": 1}).validated()
    assert kept.min_workers == 1 and "# GPU workers: min_workers 1: that many run, and bill, while the cluster is " \
        "idle." in to_yaml(ray_cluster_config(kept, VERSION), kept, VERSION)
    for preset in ("standard-1", "custom"):  # CPU workers: there when a run starts
        cpu = ClusterSpec.from_mapping({**BASE, "preset": preset}).validated()
        assert cpu.min_workers == cpu.max_workers > 0
    g2 = ClusterSpec.from_mapping({**BASE, "preset": "standard-1", "worker_machine_type": "g2-standard-8"}).validated()
    assert g2.min_workers == 0  # a type with built-in GPUs is a GPU worker too
    with pytest.raises(UserError, match=r"min_workers \(3\) is above max_workers \(2\)"):
        ClusterSpec.from_mapping({**BASE, "min_workers": 3}).validated()


def test_every_node_is_on_the_network_an_a3_worker_names():
    """An A3 worker needs gVNIC, so it names its interface (network default); the head then names the same
    network, or Ray would put it on the region's first subnet, which may belong to another VPC."""
    config = ray_cluster_config(ClusterSpec.from_mapping({**BASE, "worker_machine_type": "a3-highgpu-8g"})
                                .validated(), VERSION)
    nics = {n: t["node_config"]["networkInterfaces"][0] for n, t in config["available_node_types"].items()}
    assert {nic["network"] for nic in nics.values()} == {"projects/my-project/global/networks/default"}
    assert nics["ray_head"].get("nicType") is None and nics["a3-highgpu-8g-h100-80gbx8"]["nicType"] == "GVNIC"
    cpu = ray_cluster_config(ClusterSpec.from_mapping(BASE).validated(), VERSION)
    assert not any("networkInterfaces" in t["node_config"] for t in cpu["available_node_types"].values())


def test_a_machine_type_written_with_its_gpus_is_split_into_the_type_and_accelerator(capsys):
    from cluster.spec import ClusterSpec

    spec = ClusterSpec(project="p", worker_machine_type="n1-standard-8+nvidia-tesla-t4x2").validated()
    assert (spec.worker_machine_type, spec.accelerator_type, spec.accelerator_count) == \
        ("n1-standard-8", "nvidia-tesla-t4", 2)
    assert ClusterSpec(project="p", worker_machine_type="g2-standard-24+nvidia-l4x2").validated().node_gpus(False) == 2
    with pytest.raises(UserError, match="name different GPUs"):
        ClusterSpec(project="p", worker_machine_type="n1-standard-8+nvidia-tesla-t4",
                    accelerator_type="nvidia-l4").validated()
    with pytest.raises(UserError, match="GPUs go on the workers"):
        ClusterSpec(project="p", head_machine_type="n1-standard-8+nvidia-tesla-t4").validated()


def test_container_images_get_podman_and_are_pulled_on_every_node(capsys):
    """Job files' containerSpec images (issue 43, part 4): Ray starts a rank's image with podman,
    so every node gets podman, a login to Google's registries with the VM's token, and the
    images pulled while it is set up."""
    plain = build()["setup_commands"]
    config = checked(build(container_images=["us-docker.pkg.dev/p/r/trainer:1", "rayproject/ray:2.60.0-py311"]))
    setup = config["setup_commands"]
    assert setup[:len(plain)] == plain and not any("podman" in c for c in plain)
    extra = setup[len(plain):]
    assert extra[0].startswith("command -v podman > /dev/null || ") and "install -y podman" in extra[0]
    assert extra[1:] == ["gcloud auth print-access-token | podman login --username oauth2accesstoken "
                         "--password-stdin us-docker.pkg.dev",
                         "podman pull --quiet us-docker.pkg.dev/p/r/trainer:1",
                         "podman pull --quiet rayproject/ray:2.60.0-py311"]
    with pytest.raises(UserError, match="is not an image reference"):
        build(container_images=["x; rm -rf /"])
    assert main(["cluster", "config", "--project", "p1", "--container-image", "gcr.io/p/a:1,gcr.io/p/b:2"]) == 0
    setup = yaml.safe_load(capsys.readouterr().out)["setup_commands"]
    assert [c for c in setup if c.startswith("podman pull")] == ["podman pull --quiet gcr.io/p/a:1",
                                                                 "podman pull --quiet gcr.io/p/b:2"]


# -- issue 66, items 6 and 7a: zones, machine types and Spot flags that do not exist -----------------

def one_error_line(capsys) -> str:
    """The CLI's stderr after a refused command: exactly one line, no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("flags, said", [
    (["--zone", "us-central1-z"], ["zone 'us-central1-z' does not exist: us-central1's zones are us-central1-a, "
                                   "us-central1-b, us-central1-c, us-central1-f", "did you mean us-central1-f?",
                                   "set --zone"]),
    (["--zone", "us-east1-a"], ["zone 'us-east1-a' does not exist", "did you mean us-east1-b?"]),
    (["--zone", "us-centrl1-a"], ["us-centrl1, which is not a Compute Engine region", "did you mean us-central1-a"]),
    (["--worker-machine-type", "n1-standard-7"],
     ["--worker-machine-type n1-standard-7: n1-standard types have 1, 2, 4, 8, 16, 32, 64 or 96 vCPUs, not 7",
      "did you mean n1-standard-8 or n1-standard-4?", "set --worker-machine-type"]),
    (["--head-machine-type", "e2-highmem-32"], ["e2-highmem types have 2, 4, 8 or 16 vCPUs, not 32",
                                                "did you mean e2-highmem-16"]),
    (["--worker-machine-type", "custom-7-16384"], ["N1 custom types have 1 or an even number up to 96 vCPUs, not 7",
                                                   "did you mean custom-8-16384 or custom-6-16384?"]),
    (["--worker-machine-type", "custom-6-16000"], ["multiples of 256 MB, not 16000 MB",
                                                   "did you mean custom-6-15872?"]),
    (["--worker-machine-type", "custom-6-48128"], ["at most 6.5 GB per vCPU", "did you mean custom-6-48128-ext"]),
    (["--worker-machine-type", "n2d-custom-6-16384"], ["N2D custom types have 2, 4, 8, 16, 32, 48, 64, 80 or 96 "
                                                       "vCPUs, not 6"]),
    (["--worker-machine-type", "e2-custom-4-40960"], ["E2 custom types take at most 32768 MB with 4 vCPUs"]),
    (["--termination-action", "STOP"], ["--termination-action STOP applies only to Spot VMs, and the workers are "
                                        "standard; add --provisioning spot, or drop --termination-action"]),
    (["--termination-action", "STOP", "--provisioning", "preemptible"], ["the workers are preemptible"]),
    (["--worker-machine-type", "t2a-standard-8"], ["--worker-machine-type: t2a-standard-8 is an Arm (ARM64) machine "
                                                   "type and image common-cpu is X86_64", "t2d-standard-8"]),
    (["--head-machine-type", "c4a-standard-4"], ["is an Arm (ARM64) machine type", "(c4-standard-4, or another "
                                                 "series), or an arm64 image (--image)"]),
])
def test_what_does_not_exist_is_refused_offline_in_one_line(flags, said, capsys):
    assert main(["cluster", "config", "--project", "p", *flags]) == 2
    line = one_error_line(capsys)
    for part in said:
        assert part in line, line


@pytest.mark.parametrize("machine", ["n1-standard-8", "n1-highcpu-96", "n2-highmem-128", "n2d-standard-224",
                                     "e2-standard-32", "c2-standard-30", "c2d-highmem-56", "t2d-standard-60",
                                     "custom-6-16384", "custom-1-1024", "custom-6-48128-ext", "n2-custom-36-65536",
                                     "n2d-custom-8-16384", "e2-custom-8-16384", "g2-standard-8", "a3-highgpu-8g",
                                     # series the table does not list pass unchecked: never refuse a real type
                                     "c3-standard-22", "n4-standard-16", "c4-highmem-48", "n4-custom-4-16384"])
def test_real_machine_types_pass(machine):
    from cluster import machines

    assert machines.machine_type_problem(machine) is None
    spec = ClusterSpec.from_mapping({**BASE, "worker_machine_type": machine, "provisioning": "spot"}).validated()
    assert worker_type(ray_cluster_config(spec, VERSION))[1]["resources"]["CPU"] == machines.machine_vcpus(machine)


def test_an_arm_type_with_an_arm_image_makes_a_cluster_file():
    spec = ClusterSpec.from_mapping({**BASE, "worker_machine_type": "t2a-standard-8",
                                     "image": "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts-arm64",
                                     "head_machine_type": "t2a-standard-4"}).validated()
    assert worker_type(ray_cluster_config(spec, VERSION))[1]["resources"] == {"CPU": 8}


def test_real_zones_and_custom_types_make_a_cluster_file(capsys):
    from cluster import zones

    for zone in ("us-central1-f", "us-east1-b", "europe-west1-d", "asia-southeast1-c", "europe-north2-a"):
        assert zones.zone_problem(zone) is None, zone
    assert main(["cluster", "config", "--project", "p", "--zone", "europe-west1-b",
                 "--worker-machine-type", "custom-6-16384", "--provisioning", "spot",
                 "--termination-action", "STOP"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    name, node = worker_type(config)
    assert (name, node["resources"], config["provider"]["region"]) == ("custom-6-16384", {"CPU": 6}, "europe-west1")
    assert node["node_config"]["scheduling"]["instanceTerminationAction"] == "STOP"
    assert node["node_config"]["disks"][0]["initializeParams"]["diskType"].endswith("/pd-balanced")  # N1's


def test_what_the_gpu_nodes_setup_cannot_promise_is_said_in_the_file_and_at_config_time(capsys):
    from cluster.config import TENSORFLOW_ON_GPU

    assert main(["cluster", "config", "--project", "p", "--accelerator", "nvidia-tesla-t4",
                 "--extras", "tensorflow"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"note: {TENSORFLOW_ON_GPU}"]
    assert "# TensorFlow may run on the CPU of the GPU nodes" in captured.out
    assert "tensorflow[and-cuda]" not in " ".join(yaml.safe_load(captured.out)["worker_setup_commands"])
    for flags in (["--extras", "tensorflow"], ["--accelerator", "nvidia-tesla-t4", "--extras", "mlflow"]):
        assert main(["cluster", "config", "--project", "p", *flags]) == 0
        assert "TensorFlow" not in capsys.readouterr().err  # no GPU, or no TensorFlow: nothing to say
    assert main(["cluster", "config", "--project", "p", "--worker-machine-type", "a3-highgpu-8g",
                 "--horovod"]) == 0
    header = " ".join(line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("# "))
    assert ("Horovod on the GPU nodes is built with NCCL (torch's nvidia-nccl wheel, linked shared) for compute "
            "capability 9.0 (nvidia-h100-80gb)") in header
    assert "with the image's CUDA 12.9 beside torch's CUDA 13 it is unrun" in header
