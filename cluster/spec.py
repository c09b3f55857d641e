"""ClusterSpec: one typed, validated description of a Compute Engine Ray cluster.

Each field is declared once (type, default, help); the ``--spec`` YAML keys and
the ``launcher cluster config`` flags derive from it (:mod:`launcher.schema`).
A spec starts from a preset (named after AI Platform's scale tiers), then a
YAML file's keys, then command-line flags (each layer wins over the one
before). :meth:`ClusterSpec.validated` checks every field and fills the values
that depend on others (region from zone, GPU image, vCPU counts). Everything
here is pure: zones and machine types are checked offline against the tables
of :mod:`cluster.zones` and :mod:`cluster.machines` (``us-central1-z`` and
``n1-standard-7`` do not exist), and checks against a real project live in
:mod:`cluster.preflight`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from cluster import machine_types, machines, zones
# Re-exported: the machine facts live in cluster.machines (one table), older callers import them from here.
from cluster.machines import ACCELERATORS, bundled_gpus, machine_series, machine_vcpus  # noqa: F401
from launcher import _deferred, schema
from launcher.errors import UserError
from launcher.schema import option

PROVISIONING = ("standard", "spot", "preemptible")
TERMINATION_ACTIONS = ("DELETE", "STOP")
IMAGE_PROJECT = "projects/deeplearning-platform-release/global/images/family"
# Deep Learning VM families: CUDA 12.9 with the NVIDIA 580 driver preinstalled (T4, L4, V100, A100, H100
# all run on 580); the CPU family is the one Ray's own GCP defaults use.
GPU_IMAGE = f"{IMAGE_PROJECT}/common-cu129-ubuntu-2204-nvidia-580"
CPU_IMAGE = f"{IMAGE_PROJECT}/common-cpu"
SCOPE_PREFIX = "https://www.googleapis.com/auth/"
# Least privilege: read/write Cloud Storage (checkpoints, data) and write logs and metrics. The head also
# needs the Compute scope because Ray's autoscaler on it creates and deletes the worker VMs.
WORKER_SCOPES = ("devstorage.read_write", "logging.write", "monitoring.write")
HEAD_EXTRA_SCOPES = ("compute",)
CLUSTER_NAME_RE = re.compile(r"^[a-z][a-z0-9-]*[a-z0-9]$")
# Ray names VMs ray-<cluster>-worker-<8 hex>-compute: 28 characters around the cluster name, and
# Compute Engine refuses names over 63 characters, so the `ray up` that would start them fails.
VM_NAME_EXTRA = len("ray--worker-12345678-compute")
MAX_NAME = 63 - VM_NAME_EXTRA


@dataclass(frozen=True)
class ClusterSpec:
    """What to provision. ``None`` means "derived" (see :meth:`validated`)."""

    preset: str = option("custom", help="basic | standard-1 | basic-gpu | custom (default custom)")
    project: str | None = option(None, help="Google Cloud project id (default: GOOGLE_CLOUD_PROJECT)")
    region: str | None = option(None, help="region (default: the zone's)")
    zone: str = option("us-central1-a", help="zone (default us-central1-a)")
    cluster_name: str = option("launcher", flag="--name", help="cluster name (default launcher)")
    head_machine_type: str = option("n1-standard-4", help="head VM type (default n1-standard-4)")
    worker_machine_type: str = option("n1-standard-8", help="worker VM type (default n1-standard-8)")
    min_workers: int | None = option(None, help="workers kept running, and billing, while idle (default: 0 for GPU "
                                     "workers, which Ray's autoscaler starts on demand; max_workers for CPU workers)")
    max_workers: int = option(2, help="most workers (default: the preset's)")
    # on the workers, or on the head when max_workers is 0
    accelerator_type: str | None = option(None, flag="--accelerator", help="GPU type on the workers (on the head "
                                          "if --max-workers 0), e.g. nvidia-tesla-t4, nvidia-l4, nvidia-tesla-v100, "
                                          "nvidia-tesla-a100")
    accelerator_count: int = option(0, help="GPUs per VM (default 1; implied for A2/A3/G2 types)")
    # of the worker nodes; the head is always standard
    provisioning: str = option("standard", help="standard | spot | preemptible (worker VMs; default standard)")
    termination_action: str = option("DELETE", help="what Compute Engine does to a preempted Spot VM: "
                                     "DELETE (default) | STOP")
    disk_size_gb: int = option(100, help="boot disk size (default 100)")
    disk_type: str | None = option(None, help="boot disk type (default: pd-balanced, or hyperdisk-balanced on "
                                   "series that take only Hyperdisk)")
    image: str | None = option(None, help="boot image (default: a Deep Learning VM family, with CUDA on GPU nodes)")
    service_account: str | None = option(None, help="service account email (default: the one `ray up` creates)")
    scopes: tuple[str, ...] = option((), help="comma-separated OAuth scopes (default: devstorage.read_write,"
                                     "logging.write,monitoring.write; the head adds compute)")
    network: str | None = option(None, help="VPC network (default: the project's default)")
    subnetwork: str | None = option(None, help="subnetwork of the region")
    idle_timeout_minutes: int = option(5, help="minutes before an idle worker above min is removed")
    max_setup_failures: int = option(3, help="worker VMs of one type whose setup may fail in a row before the head "
                                     "launches no more of that type (default 3; 0: never stop, as Ray alone)")
    horovod: bool = option(False, help="build Horovod on every node (its extra, with TensorFlow, comes with it)")
    extras: tuple[str, ...] = option((), help="comma-separated extras of the launcher every node installs beside "
                                     "the core (torch): the frameworks and features its jobs use, e.g. "
                                     "tensorflow,xgboost,mlflow,tune, or all (default: none)")
    container_images: tuple[str, ...] = option((), flag="--container-image", help="comma-separated images that job "
                                               "files' containerSpec runs: podman is installed and each image "
                                               "pulled on every node (Ray starts the ranks' images with podman)")
    install: str | None = option(None, help="command that installs this launcher on each node, with the extras its "
                                 "jobs need (default: copy this project to ~/launcher and pip install it)")
    # the local project folder copied to nodes (filled in by the CLI)
    source_dir: str | None = option(None, cli=False, help="the local project folder copied to the nodes")
    ssh_user: str = option("ubuntu", cli=False, help="the user `ray up` logs in as")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "spec") -> "ClusterSpec":
        """Build a spec from a preset and a mapping (YAML or flags); unknown keys are errors."""
        schema.check_keys(cls, values, source)
        base = preset_values(str(values.get("preset") or "custom"))
        # An empty YAML value (``zone:``) leaves the preset's or the default value.
        base.update(schema.from_mapping(cls, {k: v for k, v in values.items() if v is not None}, source))
        return cls(**base)

    def merged(self, overrides: Mapping[str, Any], source: str = "flags") -> "ClusterSpec":
        """A copy with ``overrides`` (values not None) applied and type-checked."""
        values = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return ClusterSpec.from_mapping(values, source)

    # -- derived values ----------------------------------------------------------
    @property
    def gpu_on_head(self) -> bool:
        return bool(self.accelerator_type) and self.max_workers == 0

    @property
    def preemptible_workers(self) -> bool:
        return self.provisioning != "standard" and self.max_workers > 0

    def validated(self) -> "ClusterSpec":
        """Check every field; return a copy with the derived fields filled in."""
        if self.preset not in PRESETS:
            raise UserError(f"unknown preset {self.preset!r}", f"valid presets: {', '.join(PRESETS)}")
        if not self.project:
            raise UserError("no Google Cloud project given",
                            "pass --project PROJECT_ID (or set GOOGLE_CLOUD_PROJECT)")
        zone_region = zones.check_zone(self.zone, _flag("zone"))  # offline, against cluster/zones.py
        region = self.region or zone_region
        if region != zone_region:
            raise UserError(f"zone {self.zone} is not in region {region}",
                            f"use --region {zone_region} or a zone of {region}")
        _check_name(self.cluster_name)
        self = _split_gpus(self)
        _check_workers(self)
        _check_choices(self)
        _check_images(self.container_images)
        _check_extras(self)
        for machine, field in ((self.head_machine_type, "head_machine_type"),
                               (self.worker_machine_type, "worker_machine_type")):
            machines.check_gpu_machine(machine)
            machine_vcpus(machine)  # raises when the count cannot be known
            machines.check_machine_type(machine, _flag(field))  # n1-standard-7 does not exist
        spec = _with_built_in_gpus(self)
        gpus = _check_accelerator(spec)
        for name, least in (("disk_size_gb", 10), ("idle_timeout_minutes", 1), ("max_setup_failures", 0)):
            if getattr(self, name) < least:
                raise UserError(f"{name} is too small: {getattr(self, name)}", f"set {_flag(name)} to at least {least}")
        scopes = tuple(expand_scope(s) for s in self.scopes)
        spec = dataclasses.replace(spec, region=region, scopes=scopes, accelerator_count=gpus)
        if spec.min_workers is None:  # GPU workers cost nothing idle; CPU workers are there when a run starts
            spec = dataclasses.replace(spec, min_workers=0 if spec.node_gpus(head=False) else spec.max_workers)
        for head in (True, False) if spec.max_workers else (True,):
            _check_node(spec, head)
        return spec

    def node_machine(self, head: bool) -> str:
        return self.head_machine_type if head else self.worker_machine_type

    def node_accelerator(self, head: bool) -> tuple[str | None, int]:
        """The GPU model and count of one head (head=True) or worker VM: a machine type's own GPUs
        (A2/A3/A4/G2, whatever --accelerator says), else --accelerator on the node that takes it."""
        built_in = machines.GPU_MACHINES.get(self.node_machine(head))
        if built_in:
            return built_in.accelerator, built_in.gpus
        if self.accelerator_type and head == self.gpu_on_head:
            return self.accelerator_type, self.accelerator_count
        return None, 0

    def node_gpus(self, head: bool) -> int:
        """GPUs on one head (head=True) or worker VM."""
        return self.node_accelerator(head)[1]

    def node_image(self, head: bool) -> str:
        """The boot image of the head (head=True) or worker VMs."""
        return self.image or (GPU_IMAGE if self.node_gpus(head) else CPU_IMAGE)

    def node_disk_type(self, head: bool) -> str:
        """The boot disk type: --disk-type, or the first one the node's machine series takes."""
        return self.disk_type or machines.disk_types(self.node_machine(head))[0]

    def node_provisioning(self, head: bool) -> str:
        return "standard" if head else self.provisioning


PRESETS: dict[str, dict[str, Any]] = {
    # AI Platform's BASIC: one machine. Here: a head VM that also trains.
    "basic": {"head_machine_type": "n1-standard-8", "max_workers": 0},
    # STANDARD_1: a master and several CPU workers.
    "standard-1": {"head_machine_type": "n1-standard-4", "worker_machine_type": "n1-standard-8", "max_workers": 4},
    # BASIC_GPU: one machine with one GPU (AI Platform used a K80; T4 is today's entry GPU).
    "basic-gpu": {"head_machine_type": "n1-standard-8", "max_workers": 0,
                  "accelerator_type": "nvidia-tesla-t4", "accelerator_count": 1},
    # CUSTOM: the dataclass defaults, every field set by flags or the YAML file.
    "custom": {},
}


def preset_values(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}", f"valid presets: {', '.join(PRESETS)}")
    return {"preset": name, **PRESETS[name]}


def expand_scope(scope: str) -> str:
    """'devstorage.read_write' -> the full OAuth scope URL (full URLs pass through)."""
    scope = scope.strip()
    if not scope:
        raise UserError("an empty scope was given", "list scopes separated by commas, e.g. devstorage.read_write")
    return scope if scope.startswith("https://") else SCOPE_PREFIX + scope


def _split_gpus(spec: "ClusterSpec") -> "ClusterSpec":
    """A machine type written the launcher's way, ``MACHINE+ACCELERATORxN`` (as --machine-type
    and job files take it), as the machine type alone and ``--accelerator`` / ``--accelerator-count``;
    a GPU named twice, differently, is refused."""
    for field, flag, head in (("worker_machine_type", "--worker-machine-type", False),
                              ("head_machine_type", "--head-machine-type", True)):
        text = getattr(spec, field)
        if "+" not in text:
            continue
        parsed = machine_types.parse(text, flag)
        spec = dataclasses.replace(spec, **{field: parsed.machine})
        if parsed.machine in machines.GPU_MACHINES:
            continue  # the GPUs are the type's own
        given = (spec.accelerator_type, spec.accelerator_count or 1)
        if spec.accelerator_type and given != (parsed.accelerator, parsed.count):
            raise UserError(f"{flag} {text} and --accelerator {spec.accelerator_type} "
                            f"(count {spec.accelerator_count or 1}) name different GPUs", "give them one way")
        if head != (spec.max_workers == 0):
            raise UserError(f"{flag} {text}: GPUs go on the workers (on the head only with --max-workers 0)",
                            f"give the GPUs with {'--worker-machine-type' if head else '--head-machine-type'}")
        spec = dataclasses.replace(spec, accelerator_type=parsed.accelerator, accelerator_count=parsed.count)
    return spec


def _check_name(name: str) -> None:
    if not CLUSTER_NAME_RE.match(name):
        raise UserError(f"cluster name {name!r} is not valid",
                        f"use 2-{MAX_NAME} lowercase letters, digits and '-', starting with a letter")
    if len(name) > MAX_NAME:
        raise UserError(f"cluster name {name!r} is {len(name)} characters: Ray names the worker VMs "
                        f"ray-{name}-worker-XXXXXXXX-compute ({len(name) + VM_NAME_EXTRA} characters) and "
                        "Compute Engine refuses names over 63",
                        f"use a --name of at most {MAX_NAME} characters")


def _check_workers(spec: ClusterSpec) -> None:
    if spec.min_workers is None:
        spec = dataclasses.replace(spec, min_workers=0)
    if spec.max_workers < 0 or spec.min_workers < 0:
        raise UserError(f"worker counts must be >= 0, got min {spec.min_workers}, max {spec.max_workers}",
                        "set --min-workers and --max-workers to 0 or more")
    if spec.min_workers > spec.max_workers:
        raise UserError(f"min_workers ({spec.min_workers}) is above max_workers ({spec.max_workers})",
                        "raise --max-workers or lower --min-workers")


IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")


def _check_images(images: tuple[str, ...]) -> None:
    """Each --container-image is an image reference (it goes into the nodes' shell commands)."""
    for image in images:
        if not IMAGE_RE.match(image):
            raise UserError(f"--container-image {image!r} is not an image reference",
                            "write it like us-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG")


def _check_extras(spec: ClusterSpec) -> None:
    """Each --extras name is one of pyproject.toml's; they go into the project's own install."""
    valid = (*_deferred.EXTRAS, "all")
    for name in spec.extras:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            raise UserError(f"--extras: unknown extra {name!r}" + (f" (did you mean {close[0]}?)" if close else ""),
                            f"valid: {', '.join(valid)}")
    if spec.extras and spec.install is not None:
        raise UserError("--extras names what the project's own install adds, and --install replaces that install",
                        "put the extras in --install's command (pip install 'launcher[tensorflow]==VERSION'), "
                        "or drop --install")


def _check_choices(spec: ClusterSpec) -> None:
    if spec.provisioning not in PROVISIONING:
        raise UserError(f"unknown provisioning model {spec.provisioning!r}", f"valid: {', '.join(PROVISIONING)}")
    if spec.termination_action not in TERMINATION_ACTIONS:
        raise UserError(f"unknown Spot termination action {spec.termination_action!r}",
                        f"valid: {', '.join(TERMINATION_ACTIONS)}")
    if spec.provisioning != "standard" and spec.max_workers == 0:
        raise UserError(f"provisioning {spec.provisioning} applies to worker VMs, and this cluster has none",
                        "set --max-workers to 1 or more, or use --provisioning standard (the head is never Spot)")
    if spec.termination_action != "DELETE" and spec.provisioning != "spot":
        # Compute Engine takes instanceTerminationAction for Spot VMs only: the file would drop it.
        raise UserError(f"--termination-action {spec.termination_action} applies only to Spot VMs, and the "
                        f"workers are {spec.provisioning}", "add --provisioning spot, or drop --termination-action")


def _check_accelerator(spec: ClusterSpec) -> int:
    """Check the GPU type and count; return the count (implied by the machine type for A2/A3/G2)."""
    if not spec.accelerator_type:
        if spec.accelerator_count:
            raise UserError(f"accelerator_count is {spec.accelerator_count} but no accelerator type is given",
                            f"add --accelerator (one of {', '.join(ACCELERATORS)})")
        return 0
    acc = ACCELERATORS.get(spec.accelerator_type)
    if acc is None:
        close = difflib.get_close_matches(spec.accelerator_type, ACCELERATORS, n=1)
        raise UserError(f"unknown accelerator type {spec.accelerator_type!r}",
                        f"did you mean {close[0]}?" if close else f"valid: {', '.join(ACCELERATORS)}")
    machine = spec.head_machine_type if spec.gpu_on_head else spec.worker_machine_type
    flag = "--head-machine-type" if spec.gpu_on_head else "--worker-machine-type"
    if machine_series(machine) not in acc.series:
        raise UserError(f"{acc.name} attaches to {'/'.join(s.upper() for s in acc.series)} machine types, "
                        f"not {machine}", f"set {flag} to a {acc.series[0]}-... type")
    if acc.retired:
        raise UserError(f"{acc.name}: {acc.retired}", "use nvidia-tesla-t4, or a G2/A2/A3 machine type")
    if acc.bundled:
        count = bundled_gpus(machine)
        if machines.bundled_accelerator(machine) != acc.name:
            raise UserError(f"{machine} comes with {machines.bundled_accelerator(machine)}, not {acc.name}",
                            f"leave out --accelerator, or pick a machine type with {acc.name}")
        if spec.accelerator_count not in (0, count):
            raise UserError(f"{machine} comes with {count} x {acc.name}, not {spec.accelerator_count}",
                            f"set --accelerator-count {count} or pick the machine type with that many GPUs")
        return count
    if spec.accelerator_count == 0:  # a GPU type without a count: one GPU
        return 1
    allowed = machines.N1_SHAPES[acc.name]
    if spec.accelerator_count not in allowed:
        raise UserError(f"accelerator_count must be {_or(allowed)} for {acc.name}, got {spec.accelerator_count}",
                        f"set --accelerator-count to {_or(allowed)} (Compute Engine offers no other N1 shapes)")
    return spec.accelerator_count


def _with_built_in_gpus(spec: ClusterSpec) -> ClusterSpec:
    """A GPU node whose machine type brings its GPUs (g2-standard-24, a2-highgpu-1g) needs no
    --accelerator: fill it in, so the node is counted, labelled and set up as the GPU node it is."""
    if spec.accelerator_type:
        return spec
    machine = spec.head_machine_type if spec.max_workers == 0 else spec.worker_machine_type
    accelerator = machines.bundled_accelerator(machine)
    return dataclasses.replace(spec, accelerator_type=accelerator) if accelerator else spec


def _check_node(spec: ClusterSpec, head: bool) -> None:
    """What Compute Engine and the pinned torch need of one node type, from the machine table."""
    machine, (accelerator, gpus) = spec.node_machine(head), spec.node_accelerator(head)
    flag = "--head-machine-type" if head else "--worker-machine-type"
    built_in = machines.GPU_MACHINES.get(machine)
    if built_in and built_in.spot_only and spec.node_provisioning(head) == "standard":
        raise UserError(f"{machine} is offered only as Spot (or flex-start) VMs, and the "
                        f"{'head is always' if head else 'workers are'} standard",
                        "use --provisioning spot for the workers, or a3-highgpu-8g" if not head
                        else f"pick another {flag} (e.g. n1-standard-8) and put the GPUs on the workers")
    if accelerator:
        _check_gpu_generation(spec, accelerator)
        _check_driver(spec)
        if not ACCELERATORS[accelerator].bundled:
            problem = machines.n1_shape_problem(accelerator, gpus, machine_vcpus(machine),
                                                machines.machine_memory_gb(machine))
            if problem:
                raise UserError(f"{machine} with {gpus} x {accelerator}: {problem}",
                                f"set {flag} to {machines.n1_largest_type(accelerator, gpus)} or smaller, "
                                "or attach more GPUs")
    problem = machines.architecture_problem(machine, spec.node_image(head))
    if problem:
        raise UserError(f"{flag}: {problem}", f"{machines.architecture_fix(machine, spec.node_image(head))} "
                        "(--image)")
    allowed = machines.disk_types(machine)
    if spec.disk_type and spec.disk_type not in allowed:
        raise UserError(f"boot disk type {spec.disk_type} is not offered for {machine} "
                        f"({machine_series(machine).upper()} takes {', '.join(allowed)})",
                        f"set --disk-type {allowed[0]}, or leave it out")


def _check_gpu_generation(spec: ClusterSpec, accelerator: str) -> None:
    acc = ACCELERATORS[accelerator]
    if acc.torch_runs or spec.install is not None:  # with --install, the user picks the torch build
        return
    raise UserError(f"{accelerator} ({acc.generation}) cannot run torch {machines.TORCH_VERSION}: its CUDA "
                    f"{machines.TORCH_CUDA} wheels need compute capability "
                    f"{'.'.join(map(str, machines.MIN_CAPABILITY))} (Turing) or newer",
                    "use nvidia-tesla-t4, or a G2 (L4), A2 (A100) or A3 (H100) machine type; or pass --install "
                    "with a command that installs a torch build for this GPU")


def _check_driver(spec: ClusterSpec) -> None:
    """An --image for GPU nodes whose name says its driver is older than torch's CUDA needs."""
    driver = machines.image_driver(spec.image or "")
    if driver is not None and driver < machines.MIN_DRIVER and spec.install is None:
        raise UserError(f"image {spec.image} carries the NVIDIA {driver} driver, and torch "
                        f"{machines.TORCH_VERSION}'s CUDA {machines.TORCH_CUDA} wheels need {machines.MIN_DRIVER} "
                        "or newer", "leave out --image (the default has the 580 driver), or pick a "
                        f"...-nvidia-{machines.MIN_DRIVER} image family")


def _or(values) -> str:
    items = [str(v) for v in values]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


def _flag(name: str) -> str:
    return schema.flag_of(ClusterSpec, name)
