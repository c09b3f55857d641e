"""AI Platform Training's job config (``gcloud ai-platform jobs submit training --config``):
the ``trainingInput`` blocks, and how a job of them becomes a :class:`JobFile` (scale
tiers, replica types and counts, the package, the job directory, versions)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from launcher.errors import UserError
from launcher.jobfiles.common import NOTE_ACCOUNT, NOTE_DISKS, NOTE_NETWORK, NOTE_QUEUE, REFUSE_CONTAINER, \
    REFUSE_KEYS, REFUSE_SHELL, REFUSE_TPU, WHY_NO_PS, WHY_NO_TPU, JobFile, _installed, _key, _run_folder, \
    _spelled, duration_s, run_name
from launcher.schema import option
from launcher.tune.hyperparams import Hyperparameters

# Each scale tier's ranks (a master, then workers), GPUs per rank and parameter servers,
# as AI Platform Training defines them.
SCALE_TIERS = {
    "BASIC": (1, 0, 0),
    "BASIC_GPU": (1, 1, 0),
    "STANDARD_1": (5, 0, 3),
    "PREMIUM_1": (20, 0, 11),
}
SCALE_TIER_NAMES = ("BASIC", "BASIC_GPU", "BASIC_TPU", "STANDARD_1", "PREMIUM_1", "CUSTOM")


@dataclass(frozen=True)
class AcceleratorConfig:
    type: str = _key(help="e.g. NVIDIA_TESLA_T4")
    count: int = _key(1, ge=1, help="accelerators per replica")


@dataclass(frozen=True)
class ReplicaConfig:
    acceleratorConfig: AcceleratorConfig | None = _key(help="GPUs of each replica")
    imageUri: str | None = _key(help=REFUSE_CONTAINER)
    containerCommand: tuple[str, ...] | None = _key(help=REFUSE_CONTAINER)
    containerArgs: tuple[str, ...] | None = _key(help=REFUSE_CONTAINER)
    tpuTfVersion: str | None = _key(help=REFUSE_TPU)
    diskConfig: dict | None = _key(help=NOTE_DISKS)


@dataclass(frozen=True)
class AipScheduling:
    maxRunningTime: str | None = _key(help="e.g. 7200s: the run is stopped and summarised when it passes")
    maxWaitTime: str | None = _key(help=NOTE_QUEUE)
    priority: int | None = _key(help=NOTE_QUEUE)


@dataclass(frozen=True)
class TrainingInput:
    scaleTier: Literal["BASIC", "BASIC_GPU", "BASIC_TPU", "STANDARD_1", "PREMIUM_1", "CUSTOM"] = _key(
        "BASIC", help="the preset cluster shape")
    masterType: str | None = _key(help="the primary replica's machine type (CUSTOM)")
    masterConfig: ReplicaConfig | None = _key(help="the primary replica's accelerators")
    workerType: str | None = _key(help="the workers' machine type")
    workerConfig: ReplicaConfig | None = _key(help="the workers' accelerators")
    workerCount: int = _key(0, ge=0, help="workers besides the primary replica")
    parameterServerType: str | None = _key(help="the parameter servers' machine type (they are not started)")
    parameterServerConfig: ReplicaConfig | None = _key(help="the parameter servers' accelerators (not started)")
    parameterServerCount: int = _key(0, ge=0, help="parameter servers: not started, the ranks allreduce")
    evaluatorType: str | None = _key(help="the evaluators' machine type (they are not started)")
    evaluatorConfig: ReplicaConfig | None = _key(help="the evaluators' accelerators (not started)")
    evaluatorCount: int = _key(0, ge=0, help="evaluators: not started, evaluate in the program")
    packageUris: tuple[str, ...] = _key((), help="the trainer package: sdists, wheels (local or gs://)")
    pythonModule: str | None = _key(help="the module each rank runs, e.g. trainer.task")
    args: tuple[str, ...] = _key((), help="the module's arguments")
    hyperparameters: Hyperparameters | None = _key(help="the search (launcher tune)")
    region: str | None = _key(help="noted: the cluster's zone decides where the ranks run (`launcher cluster config --zone`)")
    jobDir: str | None = _key(help="the job directory (--job-dir): the run's folder")
    runtimeVersion: str | None = _key(help="compared with the TensorFlow the nodes run")
    pythonVersion: str | None = _key(help="compared with the Python the nodes run")
    scheduling: AipScheduling | None = _key(help="maxRunningTime, maxWaitTime")
    useChiefInTfConfig: bool | None = _key(help="TF_CONFIG names the primary replica chief (always so here)")
    network: str | None = _key(help=NOTE_NETWORK)
    serviceAccount: str | None = _key(help=NOTE_ACCOUNT)
    encryptionConfig: dict | None = _key(help=REFUSE_KEYS)
    enableWebAccess: bool | None = _key(help=REFUSE_SHELL)


@dataclass(frozen=True)
class AipJob:
    trainingInput: TrainingInput = option(cli=False, help="the training job")
    jobId: str | None = _key(help="the run's name")
    labels: dict | None = _key(help="noted: labels are shown in this line only")
    etag: str | None = _key(help="noted: an etag guards updates of a job resource; there is none here")


def _from_ai_platform(job: AipJob, out: JobFile, tuning: bool) -> JobFile:
    t = job.trainingInput
    source = out.source
    where = "trainingInput."
    if t.scaleTier == "BASIC_TPU":
        raise UserError(f"{source}: {where}scaleTier BASIC_TPU is not supported: {WHY_NO_TPU}",
                        "use BASIC_GPU, or CUSTOM with an acceleratorConfig of NVIDIA GPUs")
    for role in ("master", "worker", "parameterServer", "evaluator"):
        config = getattr(t, f"{role}Config")
        if config is not None:
            _replica_config(config, f"{where}{role}Config", source)

    if t.scaleTier == "CUSTOM":
        if not t.masterType:
            raise UserError(f"{source}: {where}masterType is missing: scaleTier CUSTOM needs it",
                            "for example masterType: n1-standard-8")
        ranks = 1 + t.workerCount
        gpus = _gpus(t.workerConfig if t.workerCount else t.masterConfig)
        master_gpus = _gpus(t.masterConfig)
        if t.workerCount and t.masterConfig is not None and master_gpus != gpus:
            out.note(f"{where}masterConfig asks for {master_gpus} GPU(s) and workerConfig for {gpus}: every rank "
                     f"gets {gpus} (the ranks of one run are alike)")
        servers = t.parameterServerCount
        out.machines["primary"] = _machine(t.masterType, t.masterConfig)
        if t.workerCount:
            if not t.workerType:
                raise UserError(f"{source}: {where}workerType is missing: workerCount {t.workerCount} needs it",
                                "for example workerType: n1-standard-8")
            out.machines["workers"] = _machine(t.workerType, t.workerConfig)
    else:
        ranks, gpus, servers = SCALE_TIERS[t.scaleTier]
        for key in ("masterType", "workerType", "parameterServerType"):
            if getattr(t, key):
                raise UserError(f"{source}: {where}{key} applies to scaleTier CUSTOM, not {t.scaleTier}",
                                f"set scaleTier: CUSTOM, or remove {key}")
        if t.workerCount or t.parameterServerCount:
            raise UserError(f"{source}: {where}workerCount and parameterServerCount apply to scaleTier CUSTOM, "
                            f"not {t.scaleTier}", "set scaleTier: CUSTOM with masterType, or remove them")
        out.note(f"{where}scaleTier {t.scaleTier}: {ranks} rank(s)" + (f", {gpus} GPU each" if gpus else ""))
    out.fields["workers"] = ranks
    if gpus:
        out.fields["gpus_per_worker"] = float(gpus)
    if servers or t.parameterServerType or t.parameterServerConfig:
        kind = f" ({t.parameterServerType})" if t.parameterServerType else ""
        out.note(f"{where}parameterServerCount {servers}{kind}: parameter servers are not started: {WHY_NO_PS}; "
                 "a program written for ParameterServerStrategy will not find them")
    if t.evaluatorCount or t.evaluatorType or t.evaluatorConfig:
        out.note(f"{where}evaluatorCount {t.evaluatorCount}: evaluators are not started; evaluate in the program "
                 "(rank 0, after training)")

    out.package_uris, out.module, out.args = t.packageUris, t.pythonModule, t.args
    out.check_packages(where)
    if t.jobDir:
        _run_folder(t.jobDir, f"{where}jobDir", out)
    elif job.jobId:
        out.fields["name"] = run_name(job.jobId)
    if t.hyperparameters is not None:
        if not tuning:
            raise UserError(f"{source}: {where}hyperparameters: this job file is a tuning job",
                            f"tune it with `launcher tune --config {source}`, or remove the block to run once")
        out.hyperparameters = t.hyperparameters
    if t.scheduling is not None:
        if t.scheduling.maxRunningTime:
            out.fields["max_run_s"] = duration_s(t.scheduling.maxRunningTime, f"{source}: {where}scheduling."
                                                 "maxRunningTime")
    if t.useChiefInTfConfig is False:
        out.note(f"{where}useChiefInTfConfig false: TF_CONFIG names the primary replica chief all the same "
                 "(as AI Platform does from runtime 2.1)")
    _versions(t.runtimeVersion, t.pythonVersion, where, out)
    return out


def _replica_config(config: ReplicaConfig, where: str, source: str) -> None:
    accel = config.acceleratorConfig
    if accel is not None and "TPU" in accel.type.upper():
        raise UserError(f"{source}: {where}.acceleratorConfig.type {accel.type} is not supported: {WHY_NO_TPU}",
                        "use an NVIDIA GPU type, e.g. NVIDIA_TESLA_T4")


def _gpus(config: ReplicaConfig | None) -> int:
    return config.acceleratorConfig.count if config is not None and config.acceleratorConfig else 0


def _machine(machine_type: str, config: ReplicaConfig | None) -> str:
    accel = config.acceleratorConfig if config is not None else None
    return _spelled(machine_type + (f"+{accel.type}x{accel.count}" if accel else ""))


def _versions(runtime: str | None, python: str | None, where: str, out: JobFile) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python and python.strip() != here:
        out.note(f"warning: {where}pythonVersion {python}, but the launcher runs Python {here} (the nodes are "
                 "set up with the same)")
    tf = _installed("tensorflow")
    if runtime and tf and not (tf == runtime or tf.startswith(runtime.rstrip(".") + ".")):
        out.note(f"warning: {where}runtimeVersion {runtime}, but the launcher has TensorFlow {tf} (the nodes are "
                 "set up with the same)")
