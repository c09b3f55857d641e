"""ClusterSpec -> a Ray cluster file for the GCP provider (a pure function), and its YAML text.

The file is what ``ray up`` reads: Ray stays the provisioner. What the
launcher adds over a hand-written file:

- secure defaults: the head starts Ray's dashboard and job API on 127.0.0.1
  only (reach it with ``ray dashboard cluster.yaml``, an SSH tunnel), no
  firewall rule is created, and VMs get least-privilege OAuth scopes;
- GPUs done right: guestAccelerators (or an A2/A3/G2 type that brings its
  own), onHostMaintenance TERMINATE, a Deep Learning VM image with the NVIDIA
  driver, and the resources Ray schedules on;
- Spot/preemptible workers with the scheduling fields Compute Engine needs and
  the launcher's preemption watcher started next to Ray on each of them;
- machine types that mean something: the worker node type is named after
  its machine type and GPUs (``n1-standard-8-t4x1``) and every node type
  carries Ray node labels saying which it is (:mod:`cluster.machines`), so a
  run's ``--machine-type`` places its ranks on those nodes;
- the same launcher on every node: the project source is copied to
  ``~/launcher`` and pip-installed (pinned dependencies included), or a
  command of your own (``install``) runs instead.
"""

from __future__ import annotations

from typing import Any

from cluster import machines
from cluster.spec import ACCELERATORS, HEAD_EXTRA_SCOPES, SCOPE_PREFIX, WORKER_SCOPES, ClusterSpec, machine_vcpus
from launcher.errors import UserError

# The head keeps one name whatever it runs on (it may share its machine type with the workers);
# a worker type is named after its machine type (machines.MachineType.node_type).
HEAD_TYPE = "ray_head"
REMOTE_SOURCE = "~/launcher"
# The service account `ray up` creates and grants roles to (ray/autoscaler/_private/gcp/config.py).
RAY_SERVICE_ACCOUNT = "ray-autoscaler-sa-v1@{project}.iam.gserviceaccount.com"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # CPU-only VMs skip GBs of CUDA wheels
WATCH_COMMAND = "nohup launcher preemption watch < /dev/null > /tmp/launcher-preemption-watch.log 2>&1 &"
# rsync --exclude patterns: a bare name matches at any depth, a leading / at the project root only
# (.gitignore is applied too, through rsync_filter).
RSYNC_EXCLUDE = [".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info", "/runs", "/bench-results", "/build"]


def ray_cluster_config(spec: ClusterSpec, version: str) -> dict[str, Any]:
    """The Ray cluster file (as a dict) for a validated spec and this launcher's version."""
    if spec.install is None and not spec.source_dir:
        raise UserError("cannot find this project's source folder to copy to the nodes",
                        f"pass --install 'pip install launcher=={version}' (a command that installs it)")
    if spec.horovod and not spec.source_dir:
        raise UserError("horovod needs the project source on the nodes (scripts/install-horovod)",
                        "run `launcher cluster config` from a checkout of the project")
    node_types = {HEAD_TYPE: _node_type(spec, head=True)}
    if spec.max_workers > 0:
        node_types[machine_type(spec, head=False).node_type] = _node_type(spec, head=False)
    config: dict[str, Any] = {
        "cluster_name": spec.cluster_name,
        "max_workers": spec.max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": spec.idle_timeout_minutes,
        "provider": _provider(spec),
        "auth": {"ssh_user": spec.ssh_user},
        "available_node_types": node_types,
        "head_node_type": HEAD_TYPE,
        "file_mounts": {REMOTE_SOURCE: spec.source_dir} if spec.source_dir else {},
        "rsync_exclude": list(RSYNC_EXCLUDE),
        "rsync_filter": [".gitignore"],
        "initialization_commands": [],
        "setup_commands": [_conda_path_command()],
        "head_setup_commands": _install_commands(spec, version, gpu=spec.node_gpus(head=True) > 0),
        "worker_setup_commands": _install_commands(spec, version, gpu=spec.node_gpus(head=False) > 0),
        "head_start_ray_commands": _head_start(),
        "worker_start_ray_commands": _worker_start(spec),
    }
    return config


def to_yaml(config: dict[str, Any], spec: ClusterSpec, version: str) -> str:
    """YAML text with a short header saying how to use the file."""
    import yaml

    header = (f"# Ray cluster file for Compute Engine, written by launcher {version} (preset {spec.preset}).\n"
              f"# Check it:  launcher cluster preflight THIS_FILE [--bucket gs://...]\n"
              f"# Start it:  launcher cluster up THIS_FILE   (preflight, then `ray up`)\n"
              f"# Dashboard: ray dashboard THIS_FILE         (SSH tunnel; Ray's ports stay closed)\n"
              f"# Stop it:   launcher cluster down THIS_FILE\n")
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=1000)


def machine_type(spec: ClusterSpec, head: bool) -> machines.MachineType:
    """The machine type (and GPUs) of the head (head=True) or worker VMs."""
    gpus = spec.node_gpus(head)
    return machines.of_node(spec.head_machine_type if head else spec.worker_machine_type,
                            spec.accelerator_type, gpus)


def _node_type(spec: ClusterSpec, head: bool) -> dict[str, Any]:
    machine = spec.head_machine_type if head else spec.worker_machine_type
    gpus = spec.node_gpus(head)
    resources = {"CPU": machine_vcpus(machine)}
    if gpus:
        resources["GPU"] = gpus
    # Ray starts the node with these labels (RAY_OVERRIDE_LABELS): a run's label selector finds it.
    node: dict[str, Any] = {"resources": resources, "labels": machine_type(spec, head).labels,
                            "node_config": _node_config(spec, head, machine, gpus)}
    if not head:
        node["min_workers"] = spec.min_workers
        node["max_workers"] = spec.max_workers
    return node


def _node_config(spec: ClusterSpec, head: bool, machine: str, gpus: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "machineType": machine,
        "disks": [{"boot": True, "autoDelete": True, "type": "PERSISTENT",
                   "initializeParams": {"diskSizeGb": spec.disk_size_gb, "sourceImage": spec.node_image(head)}}],
        "serviceAccounts": [{"email": spec.service_account or RAY_SERVICE_ACCOUNT.format(project=spec.project),
                             "scopes": _scopes(spec, head)}],
    }
    if gpus and not ACCELERATORS[spec.accelerator_type].bundled:
        config["guestAccelerators"] = [{"acceleratorType": spec.accelerator_type, "acceleratorCount": gpus}]
    scheduling = _scheduling(spec, head, gpus)
    if scheduling:
        config["scheduling"] = scheduling
    if gpus:
        # Older Deep Learning VM images install the driver at first boot only when asked to.
        config["metadata"] = {"items": [{"key": "install-nvidia-driver", "value": "True"}]}
    if spec.network or spec.subnetwork:
        interface: dict[str, Any] = {"accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}
        if spec.network:
            interface["network"] = _resource(spec, "global/networks", spec.network)
        if spec.subnetwork:
            interface["subnetwork"] = _resource(spec, f"regions/{spec.region}/subnetworks", spec.subnetwork)
        config["networkInterfaces"] = [interface]
    return config


def _provider(spec: ClusterSpec) -> dict[str, Any]:
    """Ray's GCP provider. With Spot workers whose termination action is STOP, a preempted VM is
    stopped with its disk (its set-up done) rather than deleted, and ``cache_stopped_nodes`` has
    Ray's provider start such a VM again (``instances.start``) before it creates a new one: once
    capacity returns, the replacement skips creation and set-up (Ray 2.60's
    ``GCPNodeProvider.create_node`` lists the stopped VMs of the node type and starts them)."""
    provider: dict[str, Any] = {"type": "gcp", "region": spec.region, "availability_zone": spec.zone,
                                "project_id": spec.project}
    if spec.provisioning == "spot" and spec.termination_action == "STOP":
        provider["cache_stopped_nodes"] = True
    return provider


def _scheduling(spec: ClusterSpec, head: bool, gpus: int) -> dict[str, Any]:
    """Compute Engine scheduling: GPUs cannot live-migrate; Spot/preemptible VMs cannot restart."""
    scheduling: dict[str, Any] = {}
    model = "standard" if head else spec.provisioning
    if gpus or model != "standard":
        scheduling["onHostMaintenance"] = "TERMINATE"
    if model != "standard":
        scheduling["automaticRestart"] = False
    if model == "spot":
        scheduling["provisioningModel"] = "SPOT"
        scheduling["instanceTerminationAction"] = spec.termination_action
    elif model == "preemptible":
        scheduling["preemptible"] = True
    return scheduling


def _scopes(spec: ClusterSpec, head: bool) -> list[str]:
    scopes = list(spec.scopes) or [SCOPE_PREFIX + s for s in WORKER_SCOPES]
    broad = {SCOPE_PREFIX + "cloud-platform", SCOPE_PREFIX + "compute"}
    if head and not broad & set(scopes):
        scopes += [SCOPE_PREFIX + s for s in HEAD_EXTRA_SCOPES]
    return scopes


def _resource(spec: ClusterSpec, collection: str, name: str) -> str:
    """A short network name -> its project path (full paths and URLs pass through)."""
    return name if "/" in name else f"projects/{spec.project}/{collection}/{name}"


def _conda_path_command() -> str:
    # Deep Learning VM images keep Python in /opt/conda; Ray runs commands in a login shell that reads .bashrc.
    return ("if [ -d /opt/conda/bin ] && ! grep -q /opt/conda/bin ~/.bashrc; then "
            "echo 'export PATH=/opt/conda/bin:$PATH' >> ~/.bashrc; fi")


def _install_commands(spec: ClusterSpec, version: str, gpu: bool) -> list[str]:
    """Install this launcher (same version as here) and, if asked, Horovod on one kind of node."""
    if spec.install is not None:
        install = spec.install
    else:
        extra = "" if gpu else f" --extra-index-url {CPU_TORCH_INDEX}"
        install = f"pip install --quiet{extra} {REMOTE_SOURCE}"
    commands = [install,
                f"python -c 'import launcher, sys; v = launcher.__version__; "
                f"sys.exit(0 if v == \"{version}\" else \"launcher \" + v + \" installed, {version} wanted\")'"]
    if spec.horovod:
        commands.append(f"cd {REMOTE_SOURCE} && scripts/install-horovod")
    return commands


def _head_start() -> list[str]:
    return ["ray stop",
            "ulimit -n 65536; ray start --head --port=6379 --object-manager-port=8076 "
            "--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=127.0.0.1"]


def _worker_start(spec: ClusterSpec) -> list[str]:
    commands = ["ray stop", "ulimit -n 65536; ray start --address=$RAY_HEAD_IP:6379 --object-manager-port=8076"]
    if spec.preemptible_workers:
        # GCE gives Spot/preemptible VMs 30 s notice; the watcher drains this Ray node so training checkpoints.
        commands.append(WATCH_COMMAND)
    return commands
