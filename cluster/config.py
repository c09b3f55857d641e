"""ClusterSpec -> a Ray cluster file for the GCP provider (a pure function), and its YAML text.

The file is what ``ray up`` reads: Ray stays the provisioner. What the
launcher adds over a hand-written file:

- secure defaults: the head starts Ray's dashboard and job API on 127.0.0.1
  only (reach it with ``ray dashboard cluster.yaml``, an SSH tunnel), no
  firewall rule is created, and VMs get least-privilege OAuth scopes;
- GPUs done right: guestAccelerators (or an A2/A3/A4/G2 type that brings its
  own, found in :mod:`cluster.machines`), onHostMaintenance TERMINATE, a Deep
  Learning VM image with the NVIDIA 580 driver that torch's CUDA 13 wheels
  need, and the resources Ray schedules on; boot disks of a type the machine
  series takes (the API's default, pd-standard, is refused by G2 and A3);
- a Python the pinned dependencies accept: the images carry Python 3.10, so
  every node gets a Python 3.11 virtual environment made by uv
  (``~/launcher-venv``, first on PATH for every command Ray runs), and the
  head gets the Google API client that Ray's GCP provider imports;
- SSH that works: OS Login is turned off on the cluster's VMs
  (``enable-oslogin: FALSE``), since Ray logs in with a key it puts in the
  project's metadata, which OS Login ignores;
- Spot/preemptible workers with the scheduling fields Compute Engine needs and
  the launcher's preemption watcher started next to Ray on each of them;
- machine types that mean something: the worker node type is named after
  its machine type and GPUs (``n1-standard-8-t4x1``) and every node type
  carries Ray node labels saying which it is (:mod:`cluster.machines`), so a
  run's ``--machine-type`` places its ranks on those nodes;
- the same launcher on every node: the project source is copied to
  ``~/launcher`` and pip-installed (pinned dependencies included) with the
  extras the spec names (``extras``; the core alone by default, and
  ``horovod`` when Horovod is built), or a command of your own (``install``)
  runs instead.
"""

from __future__ import annotations

import textwrap
from typing import Any

from cluster import machine_types, machines
from cluster.machines import ACCELERATORS, machine_series, machine_vcpus
from cluster.spec import HEAD_EXTRA_SCOPES, SCOPE_PREFIX, WORKER_SCOPES, ClusterSpec
from launcher.errors import UserError

# The head keeps one name whatever it runs on (it may share its machine type with the workers);
# a worker type is named after its machine type (machine_types.MachineType.node_type).
HEAD_TYPE = "ray_head"
REMOTE_SOURCE = "~/launcher"
# Ray's GCP provider with its label cache kept current (cluster/gcp_provider.py says why), named as an
# external provider: Ray imports it on the laptop for `ray up` and on the head for the autoscaler.
PROVIDER_MODULE = "cluster.gcp_provider.Provider"


def is_gcp(provider: dict) -> bool:
    """Ray's GCP provider, named as Ray names it (type gcp) or as this launcher's cluster files do."""
    kind = provider.get("type")
    return kind == "gcp" or (kind == "external" and provider.get("module") == PROVIDER_MODULE)
# The service account `ray up` creates and grants roles to (ray/autoscaler/_private/gcp/config.py).
RAY_SERVICE_ACCOUNT = "ray-autoscaler-sa-v1@{project}.iam.gserviceaccount.com"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # CPU-only VMs skip GBs of CUDA wheels
# Every node's Python: the Deep Learning VM images carry Ubuntu 22.04's Python 3.10 (and no conda since
# M128), the pinned numpy/scikit-learn/pyarrow need 3.11. uv makes a 3.11 venv (a system 3.11 if there is
# one, else its own build), pinned so every node gets the same.
UV_VERSION = "0.13.9"
PYTHON_VERSION = "3.11"
VENV = "~/launcher-venv"
UV = "~/.local/bin/uv"
# Every install into the venv goes through uv: it downloads and unpacks in parallel, where pip takes one
# wheel at a time (the pinned stack is about 5 GB with CUDA torch, TensorFlow and xgboost).
UV_PIP = f"{UV} pip install --quiet --python {VENV}/bin/python"
# With a second index, uv's default takes a package from the first index that has it (not pip's rule);
# the CPU torch index also carries numpy, pillow and others in fewer versions, so the best match wins.
CPU_INDEX_FLAGS = f"--index-strategy unsafe-best-match --extra-index-url {CPU_TORCH_INDEX}"
# Ray's GCP provider, run by the autoscaler on the head, imports these (pyproject.toml's cluster extra pins the same).
GOOGLE_API_CLIENT = ("google-api-python-client==2.202.0", "google-auth-httplib2==0.4.4")
# How long a GPU node waits for its NVIDIA driver (installed at first boot on some images).
DRIVER_WAIT_S = 300
SETUP_GUARD_LOG = "~/launcher-setup-guard.log"
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
        # What Ray's GCP defaults would add, which an external provider does not get from Ray.
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "initialization_commands": [],
        "setup_commands": python_commands() + container_commands(spec.container_images),
        "head_setup_commands": _install_commands(spec, version, gpu=spec.node_gpus(head=True) > 0, head=True),
        "worker_setup_commands": _install_commands(spec, version, gpu=spec.node_gpus(head=False) > 0, head=False),
        "head_start_ray_commands": _head_start(spec),
        "worker_start_ray_commands": _worker_start(spec),
    }
    return config


def to_yaml(config: dict[str, Any], spec: ClusterSpec, version: str) -> str:
    """YAML text with a short header saying how to use the file."""
    import yaml

    header = (f"# Ray cluster file for Compute Engine, written by launcher {version} (preset {spec.preset}).\n"
              f"# Check it:  launcher cluster preflight THIS_FILE [--bucket gs://...]\n"
              f"# Start it:  launcher cluster up THIS_FILE   (preflight, then `ray up`; if that fails, deletes what "
              f"it made)\n"
              f"# Dashboard: ray dashboard THIS_FILE         (SSH tunnel; Ray's ports stay closed)\n"
              f"# Stop it:   launcher cluster down THIS_FILE (`ray down`, then the VMs and disks it left)\n")
    header += ("# Provider: Ray's GCP provider through cluster.gcp_provider, which keeps its label cache current:\n"
               "# with Ray's own, Ray 2.60's v2 autoscaler takes each new worker's finished setup for a failed one\n"
               "# and replaces the VM. `ray up` of this file runs where this launcher is installed.\n")
    header += "".join(f"# {line}\n" for line in cost_notes(spec))
    header += "".join(f"# {line}\n" for note in setup_notes(spec) for line in textwrap.wrap(note, 110))
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=1000)


def cost_notes(spec: ClusterSpec) -> list[str]:
    """What this cluster bills while idle, and what it can leave behind: said in the file's header and the docs."""
    notes = []
    if spec.max_workers and spec.node_gpus(head=False):
        notes += ([f"GPU workers: min_workers {spec.min_workers}: that many run, and bill, while the cluster is idle.",
                   "With 0 (the default) Ray's autoscaler starts them when a run asks for GPUs (minutes: boot and",
                   "setup) and deletes them after idle_timeout_minutes idle."] if spec.min_workers else
                  ["GPU workers: min_workers 0: none runs (or bills) while the cluster is idle; Ray's autoscaler",
                   "starts them when a run asks for GPUs (minutes: boot and setup) and deletes them after",
                   f"idle_timeout_minutes ({spec.idle_timeout_minutes}) idle. --min-workers N keeps N up."])
    notes += ["External IPs: every node has one (an IN_USE_ADDRESSES quota unit, billed while it runs): `ray up`",
              "reaches the head over SSH on it, and workers download their setup (uv, pip, images) through theirs.",
              "Without them workers need Cloud NAT in the region (remove accessConfigs from their networkInterfaces)."]
    if spec.max_workers and spec.max_setup_failures:
        notes += ["Worker setup failures: Ray replaces a worker whose setup fails with a new VM, without end. After "
                  f"{spec.max_setup_failures}",
                  "VMs of one type fail their setup in a row, the head launches no more of that type (launcher cluster",
                  f"setup-guard says so in one line: ray exec THIS_FILE 'cat {SETUP_GUARD_LOG}'). --max-setup-failures."]
    if spec.provisioning == "preemptible" and spec.max_workers:
        notes += ["Preemptible workers: Compute Engine stops a preempted VM and Ray starts a new one; the stopped",
                  "VM (its disk billed) stays until `launcher cluster down`. Spot workers (DELETE) leave nothing."]
    if spec.provisioning == "spot" and spec.termination_action == "STOP" and spec.max_workers:
        notes += ["STOP: a preempted worker, and a worker Ray scales down, is stopped (disk billed) and started",
                  "again when Ray needs one; plain `ray down` stops every VM. `launcher cluster down` deletes them."]
    return notes


def setup_notes(spec: ClusterSpec) -> list[str]:
    """What the GPU nodes' setup cannot promise, each note one paragraph (`cluster config` prints the first)."""
    gpu = [head for head in (True, False) if (head or spec.max_workers) and spec.node_gpus(head)]
    tensorflow = spec.horovod or bool({"tensorflow", "all"} & set(spec.extras))
    notes = [TENSORFLOW_ON_GPU] if gpu and tensorflow and spec.install is None else []
    if gpu and spec.horovod:
        built = ", ".join(sorted({"{}.{} ({})".format(*ACCELERATORS[a].capability, a)
                                  for a in (spec.node_accelerator(head)[0] for head in gpu)}))
        notes.append(f"Horovod on the GPU nodes is built with NCCL (torch's nvidia-nccl wheel, linked shared) for "
                     f"compute capability {built} with the image's CUDA 12.9 toolkit, on every core. The same "
                     "recipe built and ran an allreduce through NCCL on an H200 with CUDA 13.0's nvcc "
                     "(benchmarks/gpu_horovod_nccl.sh); with the image's CUDA 12.9 beside torch's CUDA 13 it is "
                     "unrun: `horovodrun --check-build` on a GPU node must tick NCCL before a long run.")
    return notes


# pip's tensorflow brings no CUDA libraries; tensorflow[and-cuda] would (PyPI's metadata of 2.21.0: nvidia-*-cu12),
# but those CUDA 12 wheels install into the same nvidia/ folders as torch 2.13's CUDA 13 ones (nvidia-nccl-cu12
# and -cu13 both write nvidia/nccl/lib/libnccl.so.2), so one venv cannot hold both: it is not installed.
TENSORFLOW_ON_GPU = ("TensorFlow may run on the CPU of the GPU nodes: the pip tensorflow wheel brings no CUDA "
                     "libraries and uses a GPU only where it finds CUDA 12 and cuDNN 9 libraries on the node (the "
                     "image has CUDA 12.9; unchecked), and tensorflow[and-cuda] is not installed because its "
                     "CUDA 12 wheels share install paths with torch's CUDA 13 ones; torch (and Horovod's torch API) "
                     "uses the GPUs.")


def machine_type(spec: ClusterSpec, head: bool) -> machine_types.MachineType:
    """The machine type (and GPUs) of the head (head=True) or worker VMs."""
    accelerator, gpus = spec.node_accelerator(head)
    return machine_types.of_node(spec.node_machine(head), accelerator, gpus)


def _node_type(spec: ClusterSpec, head: bool) -> dict[str, Any]:
    machine = spec.node_machine(head)
    gpus = spec.node_gpus(head)
    resources = {"CPU": machine_vcpus(machine)}
    if gpus:
        resources["GPU"] = gpus
    # Ray starts the node with these labels (RAY_OVERRIDE_LABELS): a run's label selector finds it.
    node: dict[str, Any] = {"resources": resources, "labels": machine_type(spec, head).labels,
                            "node_config": _node_config(spec, head)}
    if not head:
        node["min_workers"] = spec.min_workers
        node["max_workers"] = spec.max_workers
    return node


def _node_config(spec: ClusterSpec, head: bool) -> dict[str, Any]:
    machine = spec.node_machine(head)
    accelerator, gpus = spec.node_accelerator(head)
    disk = {"diskSizeGb": spec.disk_size_gb, "sourceImage": spec.node_image(head),
            # a partial URL: instances.insert takes no bare disk type name
            "diskType": f"zones/{spec.zone}/diskTypes/{spec.node_disk_type(head)}"}
    config: dict[str, Any] = {
        "machineType": machine,
        "disks": [{"boot": True, "autoDelete": True, "type": "PERSISTENT", "initializeParams": disk}],
        "serviceAccounts": [{"email": spec.service_account or RAY_SERVICE_ACCOUNT.format(project=spec.project),
                             "scopes": _scopes(spec, head)}],
        "metadata": {"items": _metadata(gpus)},
    }
    if gpus and not ACCELERATORS[accelerator].bundled:
        config["guestAccelerators"] = [{"acceleratorType": accelerator, "acceleratorCount": gpus}]
    scheduling = _scheduling(spec, head, gpus)
    if scheduling:
        config["scheduling"] = scheduling
    interface = _network_interface(spec, machine)
    if interface:
        config["networkInterfaces"] = [interface]
    return config


def _metadata(gpus: int) -> list[dict[str, str]]:
    # Ray logs in with a key it adds to the project's metadata; OS Login (on in many projects and
    # organisations) ignores such keys, and `ray up` would wait for SSH forever. Instance metadata
    # wins over the project's (an organisation policy requiring OS Login wins over both).
    items = [{"key": "enable-oslogin", "value": "FALSE"}]
    if gpus:
        # Older Deep Learning VM images install the driver at first boot only when asked to.
        items.append({"key": "install-nvidia-driver", "value": "True"})
    return items


def _network_interface(spec: ClusterSpec, machine: str) -> dict[str, Any] | None:
    """The VM's network interface when it is not Ray's default (the region's first subnet with an
    external address): a network or subnetwork was given, or a node's series needs gVNIC (A3, A4). Then
    every node type gets one, on the same network: Ray would put those without one on the region's
    first subnet, which may be another network's."""
    gvnic = machine_series(machine) in machines.GVNIC_SERIES
    any_gvnic = any(machine_series(spec.node_machine(head)) in machines.GVNIC_SERIES for head in (True, False)
                    if head or spec.max_workers)
    if not (spec.network or spec.subnetwork or any_gvnic):
        return None
    # Every node keeps an external IP: `ray up` reaches the head on it, workers download their setup through
    # theirs (no Cloud NAT assumed); the file's header says so.
    interface: dict[str, Any] = {"accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}
    if spec.network or not spec.subnetwork:
        interface["network"] = _resource(spec, "global/networks", spec.network or "default")
    if spec.subnetwork:
        interface["subnetwork"] = _resource(spec, f"regions/{spec.region}/subnetworks", spec.subnetwork)
    if gvnic:
        interface["nicType"] = "GVNIC"
    return interface


def _provider(spec: ClusterSpec) -> dict[str, Any]:
    """Ray's GCP provider. With Spot workers whose termination action is STOP, a preempted VM is
    stopped with its disk (its set-up done) rather than deleted, and ``cache_stopped_nodes`` has
    Ray's provider start such a VM again (``instances.start``) before it creates a new one: once
    capacity returns, the replacement skips creation and set-up (Ray 2.60's
    ``GCPNodeProvider.create_node`` lists the stopped VMs of the node type and starts them).

    The price: with it, Ray's provider *stops* every VM it terminates, idle workers and `ray down`
    included, and `ray down` lists only running VMs. So it is set only when the user chose STOP, and
    ``launcher cluster down`` deletes whatever `ray down` left. Preemptible workers do not get it:
    Compute Engine stops them on preemption whatever the file says, and Ray (without it) deletes
    idle ones and starts new VMs instead of the stopped ones, which `launcher cluster down` deletes."""
    provider: dict[str, Any] = {"type": "external", "module": PROVIDER_MODULE, "region": spec.region,
                                "availability_zone": spec.zone, "project_id": spec.project}
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


def python_commands() -> list[str]:
    """Every node: uv, a Python 3.11 venv, and that venv first on PATH for the commands Ray runs
    (Ray runs each one in ``bash --login -i`` after sourcing ~/.bashrc)."""
    uv = UV
    return [
        # pip --user into ~/.local (PEP 668 images refuse it unless told; older pips ignore the variable),
        # else Astral's installer
        f"test -x {uv} || PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --user --quiet uv=={UV_VERSION} || "
        f"curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | env UV_NO_MODIFY_PATH=1 sh",
        f"test -x {VENV}/bin/python || {uv} venv --seed --python {PYTHON_VERSION} {VENV}",
        # first line: Ubuntu's .bashrc returns early in a shell that is not interactive
        "grep -qs launcher-venv ~/.bashrc || { { echo 'export PATH=$HOME/launcher-venv/bin:$PATH'; "
        "cat ~/.bashrc 2>/dev/null; } > ~/.bashrc.launcher && mv ~/.bashrc.launcher ~/.bashrc; }",
    ]


def container_commands(images: tuple[str, ...]) -> list[str]:
    """Every node, for job files' containerSpec images: podman (Ray's runtime_env ``image_uri``
    starts a rank's image with it), a login to each Google registry with the VM's own token
    (short-lived: taken when the node is set up), and each image pulled, so a rank's first start
    does not wait for the pull and a missing image fails `ray up`, not the run."""
    if not images:
        return []
    apt = "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -qq"
    commands = [f"command -v podman > /dev/null || {{ {apt} update && {apt} install -y podman; }}"]
    hosts = sorted({image.split("/")[0] for image in images if "/" in image})
    for host in hosts:
        if host.endswith(("-docker.pkg.dev", "gcr.io")):
            commands.append(f"gcloud auth print-access-token | podman login --username oauth2accesstoken "
                            f"--password-stdin {host}")
    commands += [f"podman pull --quiet {image}" for image in images]
    return commands


def _install_commands(spec: ClusterSpec, version: str, gpu: bool, head: bool) -> list[str]:
    """Install this launcher (same version as here), the head's Google API client and, if asked,
    Horovod on one kind of node."""
    if spec.install is not None:
        install = spec.install
    else:
        index = "" if gpu else f" {CPU_INDEX_FLAGS}"
        extras = sorted(set(spec.extras) | ({"horovod"} if spec.horovod else set()))
        # ~ expands before the quote; the brackets are quoted (a glob to the shell otherwise)
        install = f"{UV_PIP}{index} {REMOTE_SOURCE}" + (f"'[{','.join(extras)}]'" if extras else "")
    commands = [install,
                f"python -c 'import launcher, sys; v = launcher.__version__; "
                f"sys.exit(0 if v == \"{version}\" else \"launcher \" + v + \" installed, {version} wanted\")'"]
    if head:  # also with --install: whatever it installs, Ray's autoscaler needs these
        commands.append(f"{UV_PIP} {' '.join(GOOGLE_API_CLIENT)}")
    if gpu:
        commands.insert(0, f"timeout {DRIVER_WAIT_S} bash -c 'until nvidia-smi > /dev/null 2>&1; do sleep 5; done'")
    if gpu and spec.install is None and (spec.horovod or {"xgboost", "all"} & set(spec.extras)):
        commands.append(TORCH_NCCL)
    if spec.horovod:
        commands += _horovod_commands(spec.node_accelerator(head)[0] if gpu else None)
    return commands


# One NCCL for every framework on a GPU node, torch's: xgboost's nvidia-nccl-cu12 and torch's nvidia-nccl-cu13
# write the same nvidia/nccl/{lib/libnccl.so.2,include/nccl.h}, and the wheel pip happens to install last wins.
# This reinstalls the one torch's metadata names (nothing when it names none: a torch of --install's).
TORCH_NCCL = ("nccl=$(python -c 'from importlib.metadata import requires; print(next((r.split(\";\")[0].strip() "
              "for r in requires(\"torch\") or () if r.startswith(\"nvidia-nccl\")), \"\"))') && "
              "{ test -z \"$nccl\" || " + UV_PIP + " --no-deps --reinstall \"$nccl\"; }")
# Where the NCCL wheel is: its include/nccl.h and lib/libnccl.so.2 (the wheel ships no libnccl.so).
NCCL_DIR = ("python -c 'import importlib.util as u; s = u.find_spec(\"nvidia\") and u.find_spec(\"nvidia.nccl\"); "
            "print(list(s.submodule_search_locations)[0] if s else \"\")'")
# Parallel compiles: every core, as memory allows (TensorFlow's headers make a compile take up to 2 GiB).
BUILD_JOBS = ("python -c 'import os; print(max(1, min(os.cpu_count(), os.sysconf(\"SC_PHYS_PAGES\") * "
              "os.sysconf(\"SC_PAGE_SIZE\") // (2 << 30))))'")


def _horovod_commands(accelerator: str | None) -> list[str]:
    """Horovod's build needs cmake 3 and a C++ compiler (not on the images) and compiles on every core.

    On a GPU node (``accelerator``) its allreduce is built on NCCL, the nvidia-nccl wheel torch uses,
    linked shared: Horovod 0.28.1's FindNCCL looks for ``libnccl_static.a`` unless
    HOROVOD_NCCL_LINK=SHARED, then for ``libnccl.so``, and the wheel ships only ``libnccl.so.2``, so a
    ``libnccl.so`` link is made beside it; HOROVOD_NCCL_HOME puts the wheel's include/ and lib/ before
    the CUDA toolkit's in CMake's search. nvcc builds the kernels for the node's GPU only
    (HOROVOD_BUILD_CUDA_CC_LIST, from the machine table's compute capability) with the image's CUDA
    toolkit (/usr/local/cuda, CUDA 12.9; torch's wheels bring CUDA 13). Run on an H200 (torch 2.11
    cu130, nvcc 13.0, g++ 13, cmake 4.4, no TensorFlow): built in 101 s on 16 cores, links the wheel's
    libnccl.so.2, and a GPU allreduce runs through NCCL (benchmarks/gpu_horovod_nccl.sh,
    benchmarks/results/gpu-horovod-nccl-2026-11-28.log). Not run: nvcc 12.9 beside torch's CUDA 13,
    and TensorFlow's GPU ops on a GPU (they compile against CUDA 13 with g++ 12)."""
    apt = "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -qq"
    jobs = f"HOROVOD_BUILD_JOBS=$({BUILD_JOBS})"
    build = f"cd {REMOTE_SOURCE} && {jobs} scripts/install-horovod"
    if accelerator:
        major, minor = ACCELERATORS[accelerator].capability
        build = (f"cd {REMOTE_SOURCE} && nccl=$({NCCL_DIR}) && {{ test -f \"$nccl/lib/libnccl.so.2\" || {{ echo "
                 "\"no NCCL wheel (nvidia-nccl) in the venv; torch's CUDA build brings one\" >&2; false; }; } && "
                 f"ln -sf libnccl.so.2 \"$nccl/lib/libnccl.so\" && {jobs} HOROVOD_GPU=CUDA "
                 "HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_HOME=\"$nccl\" "
                 "HOROVOD_NCCL_INCLUDE=\"$nccl/include\" HOROVOD_NCCL_LIB=\"$nccl/lib\" "
                 f"HOROVOD_CUDA_HOME=/usr/local/cuda HOROVOD_BUILD_CUDA_CC_LIST={major}{minor} "
                 "scripts/install-horovod")
    return [f"{apt} update && {apt} install -y cmake g++", build]


def _head_start(spec: ClusterSpec) -> list[str]:
    commands = ["ray stop",
                "ulimit -n 65536; ray start --head --port=6379 --object-manager-port=8076 "
                "--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=127.0.0.1"]
    if spec.max_workers and spec.max_setup_failures:
        # Ray alone replaces a worker whose setup fails with a new VM, without end (cluster.setup_guard).
        commands.append(f"nohup launcher cluster setup-guard --max-failures {spec.max_setup_failures} < /dev/null "
                        f">> {SETUP_GUARD_LOG} 2>&1 &")
    return commands


def _worker_start(spec: ClusterSpec) -> list[str]:
    commands = ["ray stop", "ulimit -n 65536; ray start --address=$RAY_HEAD_IP:6379 --object-manager-port=8076"]
    if spec.preemptible_workers:
        # GCE gives Spot/preemptible VMs 30 s notice; the watcher drains this Ray node so training checkpoints.
        commands.append(WATCH_COMMAND)
    return commands
