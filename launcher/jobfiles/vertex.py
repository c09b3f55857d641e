"""Vertex AI's CustomJob (``gcloud ai custom-jobs create --config``), bare or inside a
CustomJob, and gcloud's ``--worker-pool-spec`` flags: the blocks, and how a job of them
becomes a :class:`JobFile` (the pools, the package or container, the output directory,
scheduling). A HyperparameterTuningJob's ``trialJobSpec`` is read here too."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

from cluster import machine_types
from launcher import schema
from launcher.errors import UserError
from launcher.jobfiles.common import NOTE_ACCOUNT, NOTE_DISKS, NOTE_NETWORK, NOTE_QUEUE, NOTE_TRACKING, \
    REFUSE_KEYS, REFUSE_SHELL, REFUSE_TPU, WHY_NO_PS, WHY_NO_TPU, JobFile, _declared, _installed, _key, _placed, \
    _run_folder, _spelled, duration_s
from launcher.schema import option

@dataclass(frozen=True)
class MachineSpec:
    machineType: str | None = _key(help="e.g. n1-standard-8")
    acceleratorType: str | None = _key(help="e.g. NVIDIA_TESLA_T4")
    acceleratorCount: int = _key(0, ge=0, help="GPUs per replica")
    tpuTopology: str | None = _key(help=REFUSE_TPU)
    reservationAffinity: dict | None = _key(help="noted: the cluster's VMs are what they are; reservations are the cluster file's to use")


@dataclass(frozen=True)
class PythonPackageSpec:
    executorImageUri: str = option(cli=False, help="the container Vertex AI would run it in (not used: the ranks "
                                   "run in the nodes' own environment)")
    packageUris: tuple[str, ...] = option(cli=False, help="the trainer package: sdists, wheels (local or gs://)")
    pythonModule: str = option(cli=False, help="the module each rank runs")
    args: tuple[str, ...] = _key((), help="the module's arguments")
    env: tuple[EnvVar, ...] = _key((), help="environment variables of every rank")


@dataclass(frozen=True)
class EnvVar:
    name: str = option(cli=False, help="the variable's name")
    value: str = _key("", help="its value")


@dataclass(frozen=True)
class ContainerSpec:
    imageUri: str = option(cli=False, help="the image each rank runs in (Ray's runtime_env image_uri: the nodes "
                           "need podman, the image Ray and Python as the nodes have them)")
    command: tuple[str, ...] = _key((), help="what each rank runs in the image (required here: the image's "
                                    "ENTRYPOINT is not read), e.g. [python, -m, trainer.task]")
    args: tuple[str, ...] = _key((), help="the command's arguments")
    env: tuple[EnvVar, ...] = _key((), help="environment variables of every rank")


@dataclass(frozen=True)
class DiskSpec:
    bootDiskType: str | None = _key(help=NOTE_DISKS)
    bootDiskSizeGb: int | None = _key(help=NOTE_DISKS)


@dataclass(frozen=True)
class WorkerPoolSpec:
    machineSpec: MachineSpec | None = _key(help="the pool's VMs")
    replicaCount: int = _key(0, ge=0, help="replicas in the pool")
    pythonPackageSpec: PythonPackageSpec | None = _key(help="the trainer package")
    containerSpec: ContainerSpec | None = _key(help="the image and command each rank runs (instead of "
                                               "pythonPackageSpec), on a cluster whose nodes have podman")
    diskSpec: DiskSpec | None = _key(help="the boot disk (noted: the cluster file sets it)")
    nfsMounts: tuple[dict, ...] | None = _key(help="refused: NFS mounts are not made; the ranks read data from Cloud Storage or local paths; give the data as gs:// URIs")


@dataclass(frozen=True)
class OutputDirectory:
    outputUriPrefix: str = option(cli=False, help="the base output directory")


@dataclass(frozen=True)
class VertexScheduling:
    timeout: str | None = _key(help="e.g. 7200s: the run is stopped and summarised when it passes")
    restartJobOnWorkerRestart: bool = _key(False, help="restart every rank when one restarts (always so here)")
    strategy: Literal["STRATEGY_UNSPECIFIED", "ON_DEMAND", "LOW_COST", "STANDARD", "SPOT", "FLEX_START"] = _key(
        "STRATEGY_UNSPECIFIED", help="SPOT: the cluster's workers are Spot VMs")
    disableRetries: bool = _key(False, help="no restart after a failure")
    maxWaitDuration: str | None = _key(help=NOTE_QUEUE)


@dataclass(frozen=True)
class CustomJobSpec:
    workerPoolSpecs: tuple[WorkerPoolSpec, ...] = option(cli=False, min_items=1, help="the pools, primary first")
    baseOutputDirectory: OutputDirectory | None = _key(help="the run's folder; AIP_* folders under it")
    scheduling: VertexScheduling | None = _key(help="timeout, restarts, Spot")
    serviceAccount: str | None = _key(help=NOTE_ACCOUNT)
    network: str | None = _key(help=NOTE_NETWORK)
    reservedIpRanges: tuple[str, ...] | None = _key(help=NOTE_NETWORK)
    enableWebAccess: bool | None = _key(help=REFUSE_SHELL)
    enableDashboardAccess: bool | None = _key(help=REFUSE_SHELL)
    tensorboard: str | None = _key(help=NOTE_TRACKING)
    experiment: str | None = _key(help=NOTE_TRACKING)
    experimentRun: str | None = _key(help=NOTE_TRACKING)
    protectedArtifactLocationId: str | None = _key(help="noted: artifacts stay in the run's folder")
    persistentResourceId: str | None = _key(help="noted: the Ray cluster the run joins is its persistent resource")
    models: tuple[str, ...] | None = _key(help="noted: the run's model is in its model/ folder; no Model Garden model is fetched")


@dataclass(frozen=True)
class CustomJob:
    jobSpec: CustomJobSpec = option(cli=False, help="the job")
    displayName: str | None = _key(help="the run's name (made a valid one)")
    labels: dict | None = _key(help="noted: labels are shown in this line only")
    encryptionSpec: dict | None = _key(help=REFUSE_KEYS)


def worker_pool_flags(items: list[str]) -> JobFile:
    """gcloud's ``--worker-pool-spec=machine-type=...,replica-count=...`` flags, pool by pool
    (an empty one skips a pool), as a Vertex CustomJob."""
    pools: list[dict[str, Any]] = []
    for n, item in enumerate(items):
        pools.append(_pool_flag(item, f"--worker-pool-spec #{n + 1}") if item.strip() else {})
    out = JobFile("vertex-custom-job", "--worker-pool-spec")
    spec = schema.build(CustomJobSpec, {"workerPoolSpecs": pools}, "--worker-pool-spec")
    _declared(spec, "", out)
    _from_custom_job(spec, out, "")
    return _placed(out)


_POOL_KEYS = {"machine-type": ("machineSpec", "machineType"), "replica-count": ("replicaCount",),
              "accelerator-type": ("machineSpec", "acceleratorType"),
              "accelerator-count": ("machineSpec", "acceleratorCount"),
              "executor-image-uri": ("pythonPackageSpec", "executorImageUri"),
              "python-module": ("pythonPackageSpec", "pythonModule"),
              "disk-type": ("diskSpec", "bootDiskType"), "disk-size": ("diskSpec", "bootDiskSizeGb")}
_POOL_REFUSED = {"container-image-uri": "give the image in a CustomJob file's containerSpec (imageUri, command, "
                                        "args) with --config instead",
                 "local-package-path": "give the package with --package DIR (or a built sdist or wheel) instead",
                 "script": "give the script with --script FILE instead",
                 "requirements": "declare them in the package's setup.py (install_requires) instead",
                 "extra-packages": "name them in --package, comma-separated, instead",
                 "extra-dirs": "put them in the package instead"}


def _pool_flag(item: str, where: str) -> dict[str, Any]:
    pool: dict[str, Any] = {}
    for part in item.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"{where}: {part!r} is not KEY=VALUE",
                            "for example --worker-pool-spec=machine-type=n1-standard-4,replica-count=1")
        if key in _POOL_REFUSED:
            raise UserError(f"{where}: {key} is not supported", _POOL_REFUSED[key])
        if key not in _POOL_KEYS:
            raise UserError(f"{where}: unknown key {key!r}", schema.closest(key, list(_POOL_KEYS) + list(_POOL_REFUSED)))
        path = _POOL_KEYS[key]
        target = pool
        for step in path[:-1]:
            target = target.setdefault(step, {})
        target[path[-1]] = int(value) if value.isdigit() else value
    if "pythonPackageSpec" in pool:  # gcloud takes the URIs from --python-package-uris (--package here)
        pool["pythonPackageSpec"].setdefault("executorImageUri", "(gcloud flag)")
        pool["pythonPackageSpec"].setdefault("packageUris", [])
    return pool


def _from_custom_job(spec: CustomJobSpec, out: JobFile, where: str) -> None:
    source = out.source
    pools = spec.workerPoolSpecs
    names = {0: "primary replica", 1: "workers", 2: "parameter servers", 3: "reduction server"}
    if len(pools) > 4:
        raise UserError(f"{source}: {where}workerPoolSpecs has {len(pools)} pools: Vertex AI has at most 4",
                        "pool 0 the primary replica, 1 the workers, 2 parameter servers, 3 reduction server")
    primary = pools[0]
    if primary.replicaCount != 1:
        raise UserError(f"{source}: {where}workerPoolSpecs[0].replicaCount is {primary.replicaCount}: pool 0 is "
                        "the primary replica, exactly 1", "put the other replicas in workerPoolSpecs[1]")
    package: PythonPackageSpec | None = None
    container: ContainerSpec | None = None
    for i, pool in enumerate(pools):
        at = f"{where}workerPoolSpecs[{i}]"
        if pool.machineSpec is not None and pool.machineSpec.acceleratorType \
                and "TPU" in pool.machineSpec.acceleratorType.upper():
            raise UserError(f"{source}: {at}.machineSpec.acceleratorType {pool.machineSpec.acceleratorType} is not "
                            f"supported: {WHY_NO_TPU}", "use an NVIDIA GPU type, e.g. NVIDIA_TESLA_T4")
        if i >= 2:
            if pool.replicaCount:
                why = WHY_NO_PS if i == 2 else ("the ranks' allreduce runs among themselves (NCCL or Horovod's "
                                                "ring), with no reduction server")
                out.note(f"{at} ({names[i]}, {pool.replicaCount}) is not started: {why}")
            continue
        if pool.containerSpec is not None and pool.pythonPackageSpec is not None:
            raise UserError(f"{source}: {at} has both containerSpec and pythonPackageSpec: a pool runs one program",
                            "keep containerSpec (the image's command) or pythonPackageSpec (a trainer package)")
        if pool.containerSpec is not None:
            if package is not None or (container is not None and pool.containerSpec != container):
                raise UserError(f"{source}: {at}.containerSpec differs from workerPoolSpecs[0]'s program: every rank "
                                "runs the same program here", "give pool 1 the same containerSpec as pool 0")
            container = pool.containerSpec
        if pool.pythonPackageSpec is not None:
            if container is not None:
                raise UserError(f"{source}: {at}.pythonPackageSpec differs from workerPoolSpecs[0]'s containerSpec: "
                                "every rank runs the same program here", "give pool 1 the same containerSpec as pool 0")
            if package is not None and _program(pool.pythonPackageSpec) != _program(package):
                raise UserError(f"{source}: {at}.pythonPackageSpec differs from workerPoolSpecs[0]'s: every rank "
                                "runs the same program here", "give pool 1 the same package, module and args")
            package = package or pool.pythonPackageSpec
    workers = pools[1] if len(pools) > 1 else WorkerPoolSpec()
    out.fields["workers"] = 1 + workers.replicaCount
    gpus = _accelerators(workers.machineSpec if workers.replicaCount else primary.machineSpec)
    if gpus:
        out.fields["gpus_per_worker"] = float(gpus)
    if workers.replicaCount and _accelerators(primary.machineSpec) != gpus:
        out.note(f"{where}workerPoolSpecs[0] asks for {_accelerators(primary.machineSpec)} GPU(s) and pool 1 for "
                 f"{gpus}: every rank gets {gpus} (the ranks of one run are alike)")
    if primary.machineSpec is not None and primary.machineSpec.machineType:
        out.machines["primary"] = _vertex_machine(primary.machineSpec)
    if workers.replicaCount and workers.machineSpec is not None and workers.machineSpec.machineType:
        out.machines["workers"] = _vertex_machine(workers.machineSpec)
    if package is not None:
        out.package_uris, out.module, out.args = package.packageUris, package.pythonModule, package.args
        out.check_packages(f"{where}workerPoolSpecs[0].pythonPackageSpec.")
        out.env = {e.name: e.value for e in package.env}
        if package.executorImageUri != "(gcloud flag)":
            out.note(f"{where}workerPoolSpecs[0].pythonPackageSpec.executorImageUri is not used: the ranks run in "
                     f"the nodes' own environment ({_environment(package.executorImageUri)})")
    if container is not None:
        _container(container, f"{where}workerPoolSpecs[0].containerSpec", out)
    if spec.baseOutputDirectory is not None:
        _run_folder(spec.baseOutputDirectory.outputUriPrefix, f"{where}baseOutputDirectory.outputUriPrefix", out)
    s = spec.scheduling
    if s is not None:
        if s.timeout:
            out.fields["max_run_s"] = duration_s(s.timeout, f"{source}: {where}scheduling.timeout")
        if s.restartJobOnWorkerRestart:
            out.fields["max_failures"] = -1
        if s.disableRetries:
            out.fields["max_failures"] = 0
        if s.strategy in ("SPOT", "LOW_COST"):
            out.note(f"{where}scheduling.strategy {s.strategy}: Spot VMs are the cluster's workers "
                     "(`launcher cluster config --provisioning spot`); the run checkpoints on each preemption "
                     "notice and resumes")


def _container(spec: ContainerSpec, at: str, out: JobFile) -> None:
    """The image, its command and args, and the env, as the run's program (each rank runs
    ``command + args`` in the image; see :func:`launcher.driver.program.from_container`)."""
    if not spec.imageUri.strip():
        raise UserError(f"{out.source}: {at}.imageUri is empty", "name the image, e.g. us-docker.pkg.dev/P/R/trainer:1")
    if not spec.command:
        raise UserError(f"{out.source}: {at}.command is missing: the image's ENTRYPOINT and CMD are not read here "
                        "(Ray starts the image with its own entrypoint)",
                        "give the command each rank runs, e.g. command: [python, -m, trainer.task]")
    out.image, out.command, out.args = spec.imageUri.strip(), spec.command, spec.args
    out.env = {e.name: e.value for e in spec.env}


def _program(p: PythonPackageSpec) -> tuple:
    return (p.packageUris, p.pythonModule, p.args)


def _accelerators(spec: MachineSpec | None) -> int:
    """GPUs per replica: the accelerator given, or the ones an A2/A3/G2 machine type brings."""
    if spec is None:
        return 0
    if spec.acceleratorType:
        return spec.acceleratorCount
    if spec.machineType:
        try:
            return machine_types.parse(spec.machineType).count
        except UserError:
            return 0
    return 0


def _vertex_machine(spec: MachineSpec) -> str:
    return _spelled(spec.machineType + (f"+{spec.acceleratorType}x{spec.acceleratorCount}"
                                        if spec.acceleratorType and spec.acceleratorCount else ""))


# Vertex AI's prebuilt training images, by the framework their name starts with
# (us-docker.pkg.dev/vertex-ai/training/pytorch-cpu.2-4.py310, tf-gpu.2-17.py310, ...).
_IMAGE_FRAMEWORKS = {"pytorch": ("torch", "PyTorch"), "tf": ("tensorflow", "TensorFlow"),
                     "tf2": ("tensorflow", "TensorFlow"), "tensorflow": ("tensorflow", "TensorFlow"),
                     "sklearn": ("scikit-learn", "scikit-learn"), "scikit-learn": ("scikit-learn", "scikit-learn"),
                     "xgboost": ("xgboost", "XGBoost")}


def _environment(image: str | None = None) -> str:
    """What the nodes run, named for the framework ``image`` asks for (PyTorch for a
    ``pytorch-cpu`` image), with the version the image's name carries where it differs;
    for an image of no known framework, the frameworks installed here."""
    py = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    name = (image or "").rstrip("/").rpartition("/")[2].split(":")[0].lower()
    for prefix, (dist, shown) in _IMAGE_FRAMEWORKS.items():
        match = re.match(rf"{re.escape(prefix)}(?:-[a-z0-9]+)?\.(\d+)-(\d+)", name)
        if match:
            have = _installed(dist)
            if have is None:
                return f"{py}, no {shown} installed; the image has {shown} {match[1]}.{match[2]}"
            wanted = f"{match[1]}.{match[2]}"
            same = have == wanted or have.startswith(wanted + ".")
            return f"{py}, {shown} {have}" + ("" if same else f"; the image has {shown} {wanted}")
    found = [f"{shown} {_installed(dist)}" for dist, shown in (("torch", "PyTorch"), ("tensorflow", "TensorFlow"))
             if _installed(dist)]
    return ", ".join([py] + found)
