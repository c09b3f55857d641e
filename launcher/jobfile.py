"""AI Platform Training and Vertex AI job files, read as the launcher's own settings.

People arrive with the files they already have:

* AI Platform's ``gcloud ai-platform jobs submit training --config FILE``:
  ``trainingInput: {scaleTier, masterType, workerCount, packageUris,
  pythonModule, args, jobDir, hyperparameters, ...}``;
* Vertex AI's ``gcloud ai custom-jobs create --config FILE``: a CustomJobSpec
  (``workerPoolSpecs``, ``baseOutputDirectory``, ``scheduling``), bare or
  inside a CustomJob (``displayName``, ``jobSpec``);
* Vertex AI's HyperparameterTuningJob (``studySpec``, ``maxTrialCount``,
  ``parallelTrialCount``, ``trialJobSpec``);
* gcloud's ``--worker-pool-spec=machine-type=...,replica-count=...`` flags.

:func:`read` turns any of them into a :class:`JobFile`: JobSpec values (the
ranks, GPUs, storage, name, time limit, machine types), the trainer package
and its arguments, a hyperparameter search in AI Platform's form, and notes:
one line for each key the launcher reads but does differently (parameter
servers are not started: the ranks synchronise by allreduce). Keys that
cannot work here (TPUs, AI Platform's container keys) are refused with one line saying
why, and an unknown key names the closest valid one. A Vertex pool's ``containerSpec``
(imageUri, command, args, env) is a program of its own: each rank runs the command in
that image, on a cluster whose nodes can start it (Ray's runtime_env ``image_uri``,
see :func:`launcher.driver.program.from_container`). The files' own spelling is kept:
each block below is declared with :mod:`launcher.schema`, the project's one
way of checking specs.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

from cluster import machines
from launcher import schema
from launcher.errors import UserError
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
ARCHIVE_SUFFIXES = (".tar.gz", ".whl")
WHY_NO_PS = "the ranks synchronise by allreduce (Horovod or Ray Train's own), which needs no parameter server"
WHY_NO_CONTAINER = "AI Platform's container keys are not read: containers run from a Vertex AI CustomJob's " \
    "containerSpec"
WHY_NO_TPU = "the launcher trains on CPUs and NVIDIA GPUs"
# A key's help says what becomes of it: "noted: WHY" (one line, then the run goes on) or
# "refused: WHY; HOW TO FIX" (one line, exit 2); see :func:`_declared`.
REFUSE_CONTAINER = f"refused: {WHY_NO_CONTAINER}; write the job as a CustomJob whose workerPoolSpecs have a " \
    "containerSpec (imageUri, command, args), or give packageUris and pythonModule"
REFUSE_TPU = f"refused: {WHY_NO_TPU}; use an NVIDIA GPU type, e.g. NVIDIA_TESLA_T4"
REFUSE_KEYS = "refused: customer-managed encryption keys are Compute Engine's and Cloud Storage's to set; remove it"
REFUSE_SHELL = "refused: interactive shells into the ranks are not offered; remove it"
NOTE_DISKS = "noted: the cluster file sets the disks (`launcher cluster config --disk-size-gb`)"
NOTE_QUEUE = "noted: not applied, the launcher does not queue jobs; a run waits for its ranks' resources as Ray " \
    "schedules them"
NOTE_NETWORK = "noted: the cluster's to set (`launcher cluster config --network`), not the job's"
NOTE_ACCOUNT = "noted: the cluster's to set (`launcher cluster config --service-account`), not the job's"
NOTE_TRACKING = "noted: not used; TensorBoard logs go to AIP_TENSORBOARD_LOG_DIR under the run's folder"
NOTE_DEFAULT = "noted: not used; the search starts from its own points"


def _key(default: Any = None, **kw: Any) -> Any:
    return option(default, cli=False, help=kw.pop("help", ""), **kw)


# -- AI Platform Training: trainingInput ----------------------------------------------------

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


# -- Vertex AI: CustomJobSpec, HyperparameterTuningJob ----------------------------------------

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


@dataclass(frozen=True)
class MetricSpec:
    metricId: str = option(cli=False, help="the metric's tag (hypertune's hyperparameter_metric_tag)")
    goal: Literal["MAXIMIZE", "MINIMIZE"] = option(cli=False, help="MAXIMIZE or MINIMIZE")
    safetyConfig: dict | None = _key(help="refused: safety thresholds are not checked; remove safetyConfig")


@dataclass(frozen=True)
class RangeSpec:
    minValue: float = option(cli=False, help="the range's lower end")
    maxValue: float = option(cli=False, help="the range's upper end")
    defaultValue: float | None = _key(help=NOTE_DEFAULT)


@dataclass(frozen=True)
class ValuesSpec:
    values: tuple[float, ...] = option(cli=False, min_items=1, help="the values")
    defaultValue: float | None = _key(help=NOTE_DEFAULT)


@dataclass(frozen=True)
class CategoriesSpec:
    values: tuple[str, ...] = option(cli=False, min_items=1, help="the values")
    defaultValue: str | None = _key(help=NOTE_DEFAULT)


@dataclass(frozen=True)
class ParameterSpec:
    LABEL = "parameterId"

    parameterId: str = option(cli=False, help="the parameter's name (the program's --NAME)")
    doubleValueSpec: RangeSpec | None = _key(help="a real range")
    integerValueSpec: RangeSpec | None = _key(help="an integer range")
    discreteValueSpec: ValuesSpec | None = _key(help="numbers to pick from")
    categoricalValueSpec: CategoriesSpec | None = _key(help="strings to pick from")
    scaleType: Literal["SCALE_TYPE_UNSPECIFIED", "UNIT_LINEAR_SCALE", "UNIT_LOG_SCALE",
                       "UNIT_REVERSE_LOG_SCALE"] | None = _key(help="how a range is searched")
    conditionalParameterSpecs: tuple[dict, ...] | None = _key(help="refused: every parameter is searched in every trial; remove conditionalParameterSpecs")

    def check(self) -> None:
        given = [k for k in ("doubleValueSpec", "integerValueSpec", "discreteValueSpec", "categoricalValueSpec")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"parameter {self.parameterId}: give exactly one of doubleValueSpec, integerValueSpec, "
                             f"discreteValueSpec, categoricalValueSpec (got {', '.join(given) or 'none'})")


@dataclass(frozen=True)
class StudySpec:
    metrics: tuple[MetricSpec, ...] = option(cli=False, min_items=1, help="the metric the trials are ranked by")
    parameters: tuple[ParameterSpec, ...] = option(cli=False, min_items=1, help="the parameters searched")
    algorithm: Literal["ALGORITHM_UNSPECIFIED", "GRID_SEARCH", "RANDOM_SEARCH"] = _key(
        "ALGORITHM_UNSPECIFIED", help="how the values are chosen (unspecified: Bayesian, Optuna's TPE here)")
    measurementSelectionType: Literal["MEASUREMENT_SELECTION_TYPE_UNSPECIFIED", "LAST_MEASUREMENT",
                                      "BEST_MEASUREMENT"] | None = _key(help="noted: a trial counts with its last report")
    observationNoise: str | None = _key(help="noted: the search (Optuna's TPE) takes no noise setting")
    decayCurveStoppingSpec: dict | None = _key(help="early stopping: ASHA here")
    medianAutomatedStoppingSpec: dict | None = _key(help="early stopping: ASHA here")
    convexAutomatedStoppingSpec: dict | None = _key(help="early stopping: ASHA here")


@dataclass(frozen=True)
class TuningJob:
    studySpec: StudySpec = option(cli=False, help="what is searched")
    trialJobSpec: CustomJobSpec = option(cli=False, help="the job each trial runs")
    maxTrialCount: int = _key(1, ge=1, help="trials in all")
    parallelTrialCount: int = _key(1, ge=1, help="trials at once")
    maxFailedTrialCount: int = _key(0, ge=0, help="failed trials before the study stops")
    displayName: str | None = _key(help="the tuning run's name (made a valid one)")
    labels: dict | None = _key(help="noted: labels are shown in this line only")
    encryptionSpec: dict | None = _key(help=REFUSE_KEYS)


# -- what a file means here ---------------------------------------------------------------

@dataclass
class JobFile:
    """A job file as the launcher runs it. ``fields`` are JobSpec values (flags go over them)."""

    kind: str                                   # "ai-platform", "vertex-custom-job", "vertex-tuning-job"
    source: str
    fields: dict[str, Any] = field(default_factory=dict)
    package_uris: tuple[str, ...] = ()
    module: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    image: str | None = None                    # a containerSpec's imageUri: the ranks run ``command`` in it
    command: tuple[str, ...] = ()
    hyperparameters: Hyperparameters | None = None
    notes: list[str] = field(default_factory=list)
    machines: dict[str, str] = field(default_factory=dict)   # "primary", "workers" -> MACHINE[+ACCELxN]

    def check_packages(self, where: str) -> None:
        """Each package URI must be a built package (a local folder is taken as well)."""
        for uri in self.package_uris:
            if not uri.endswith(ARCHIVE_SUFFIXES) and not (not uri.startswith("gs://") and os.path.isdir(uri)):
                raise UserError(f"{self.source}: {where}packageUris: {uri} is not an sdist or wheel "
                                f"({', '.join(ARCHIVE_SUFFIXES)})",
                                "build one with `python setup.py sdist` (or `pip wheel .`) and name the file")

    @property
    def package(self) -> str | None:
        """``--package``'s value: the URIs, comma-separated (installed in order)."""
        return ",".join(self.package_uris) or None

    def note(self, text: str) -> None:
        self.notes.append(f"{self.source}: {text}")


def kind_of(raw: Any) -> str | None:
    """Which job file a loaded YAML is (None: the launcher's own spec file)."""
    if not isinstance(raw, dict):
        return None
    if "trainingInput" in raw:
        return "ai-platform"
    if "studySpec" in raw or "trialJobSpec" in raw:
        return "vertex-tuning-job"
    if "workerPoolSpecs" in raw or "jobSpec" in raw:
        return "vertex-custom-job"
    return None


def read(raw: dict[str, Any], source: str, *, tuning: bool = False) -> JobFile:
    """The job file ``raw`` as the launcher runs it, machine types included (see :func:`_read`)."""
    return _placed(_read(raw, source, tuning=tuning))


def _placed(out: JobFile) -> JobFile:
    """Machine types as JobSpec fields: the workers' type, and rank 0's where there are workers."""
    primary, workers = out.machines.get("primary"), out.machines.get("workers")
    if workers:
        out.fields["machine_type"] = workers
        if primary and primary != workers:
            out.fields["primary_machine_type"] = primary
    elif primary:
        out.fields["machine_type"] = primary
    return out


def _read(raw: dict[str, Any], source: str, *, tuning: bool = False) -> JobFile:
    """The job file ``raw`` (loaded YAML) as the launcher runs it.

    Raises:
        UserError: a key that does not exist (with the closest one), a value of the wrong
            kind, or a key that cannot work here (containers, TPUs), with why.
    """
    kind = kind_of(raw)
    if kind == "ai-platform":
        if isinstance(raw.get("trainingInput"), dict) and "hyperparameters" in raw:
            raise UserError(f"{source}: hyperparameters given twice (top level and under trainingInput)",
                            "keep the one under trainingInput")
        job = schema.build(AipJob, _lenient(raw), source)
        out = JobFile("ai-platform", source)
        _declared(job, "", out)
        return _from_ai_platform(job, out, tuning)
    if kind == "vertex-tuning-job":
        if not tuning:
            raise UserError(f"{source}: a HyperparameterTuningJob (studySpec, trialJobSpec) is a tuning job",
                            f"tune it with `launcher tune --config {source}`, or run its trialJobSpec alone")
        job = schema.build(TuningJob, _lenient(raw), source)
        out = JobFile("vertex-tuning-job", source)
        _declared(job, "", out)
        _from_custom_job(job.trialJobSpec, out, "trialJobSpec.")
        out.hyperparameters = _study(job, source)
        if job.displayName:
            out.fields.setdefault("name", run_name(job.displayName))
        return out
    if kind == "vertex-custom-job":
        out = JobFile("vertex-custom-job", source)
        if "jobSpec" in raw:
            job = schema.build(CustomJob, _lenient(raw), source)
            _declared(job, "", out)
            _from_custom_job(job.jobSpec, out, "jobSpec.")
            if job.displayName:
                out.fields.setdefault("name", run_name(job.displayName))
        else:
            spec = schema.build(CustomJobSpec, _lenient(raw), source)
            _declared(spec, "", out)
            _from_custom_job(spec, out, "")
        return out
    raise UserError(f"{source}: not an AI Platform or Vertex AI job file",
                    "expected trainingInput (AI Platform), workerPoolSpecs or jobSpec (a Vertex CustomJob), "
                    "or studySpec and trialJobSpec (a Vertex HyperparameterTuningJob)")


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


# -- AI Platform ------------------------------------------------------------------------------

def _declared(spec: Any, where: str, out: JobFile) -> None:
    """Every key given whose help says "refused: WHY; FIX" (UserError) or "noted: WHY" (a note),
    through the whole file; the other keys are read by the code below."""
    for f in schema.fields(type(spec)):
        value = getattr(spec, f.name)
        if value is None or value is False or value == ():
            continue
        at = f"{where}{f.name}"
        if f.help.startswith("refused: "):
            why, _, fix = f.help.removeprefix("refused: ").partition("; ")
            raise UserError(f"{out.source}: {at} is not supported: {why}", fix or f"remove {f.name}")
        if f.help.startswith("noted: "):
            out.note(f"{at} {_shown(value)}: {f.help.removeprefix('noted: ')}")
        if f.kind == "spec":
            _declared(value, at + ".", out)
        elif f.kind == "list" and not isinstance(f.item, str):
            for i, item in enumerate(value):
                _declared(item, f"{at}[{i}].", out)


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


def _spelled(text: str) -> str:
    """A machine type as --machine-type spells it (cluster.machines); bad ones are left for the
    spec's own check, which names the flag."""
    try:
        return str(machines.parse(text))
    except UserError:
        return text


# -- Vertex AI --------------------------------------------------------------------------------

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
            return machines.parse(spec.machineType).count
        except UserError:
            return 0
    return 0


def _vertex_machine(spec: MachineSpec) -> str:
    return _spelled(spec.machineType + (f"+{spec.acceleratorType}x{spec.acceleratorCount}"
                                        if spec.acceleratorType and spec.acceleratorCount else ""))


def _study(job: TuningJob, source: str) -> Hyperparameters:
    """A Vertex studySpec in AI Platform's form (checked by the same rules)."""
    study = job.studySpec
    if len(study.metrics) != 1:
        raise UserError(f"{source}: studySpec.metrics lists {len(study.metrics)} metrics: one is searched here",
                        "keep the metric the trials are ranked by")
    params = []
    for p in study.parameters:
        out: dict[str, Any] = {"parameterName": p.parameterId}
        if p.doubleValueSpec is not None:
            out.update(type="DOUBLE", minValue=p.doubleValueSpec.minValue, maxValue=p.doubleValueSpec.maxValue)
        elif p.integerValueSpec is not None:
            out.update(type="INTEGER", minValue=p.integerValueSpec.minValue, maxValue=p.integerValueSpec.maxValue)
        elif p.discreteValueSpec is not None:
            out.update(type="DISCRETE", discreteValues=list(p.discreteValueSpec.values))
        else:
            out.update(type="CATEGORICAL", categoricalValues=list(p.categoricalValueSpec.values))
        if p.scaleType and p.scaleType != "SCALE_TYPE_UNSPECIFIED":
            out["scaleType"] = p.scaleType
        params.append(out)
    stopping = any(getattr(study, k) is not None for k in
                   ("decayCurveStoppingSpec", "medianAutomatedStoppingSpec", "convexAutomatedStoppingSpec"))
    block = {"goal": study.metrics[0].goal, "hyperparameterMetricTag": study.metrics[0].metricId,
             "maxTrials": job.maxTrialCount, "maxParallelTrials": job.parallelTrialCount,
             "maxFailedTrials": job.maxFailedTrialCount, "enableTrialEarlyStopping": stopping,
             "algorithm": study.algorithm, "params": params}
    return schema.build(Hyperparameters, block, f"{source}: studySpec")


# -- shared -----------------------------------------------------------------------------------

def _run_folder(uri: str, where: str, out: JobFile) -> None:
    """The run's folder is the job directory itself: storage its parent, name its last part
    (when that is a valid run name; else the run goes under it)."""
    base = uri.rstrip("/")
    parent, last = posixpath.split(base)
    if parent and parent not in ("gs:", "gs:/") and re.match(r"^[A-Za-z][A-Za-z0-9_]{0,127}$", last):
        out.fields["storage"], out.fields["name"] = parent, last
    else:
        out.fields["storage"] = base
        out.note(f"{where} {uri}: the run's folder is {base}/NAME ({last!r} is not a run name)")


def run_name(text: str) -> str:
    """A valid run name from a display name or job id (letters, digits, underscores)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", text.strip())
    if not name or not name[0].isalpha():
        name = "job_" + name
    return name[:128]


def duration_s(text: str, where: str) -> float:
    """Seconds from a protobuf Duration (``7200s``, ``1.5s``) or a bare number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*s?\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"{where} {text!r} is not a duration", "write seconds with an s, e.g. 7200s")
    return float(match.group(1))


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


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _versions(runtime: str | None, python: str | None, where: str, out: JobFile) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python and python.strip() != here:
        out.note(f"warning: {where}pythonVersion {python}, but the launcher runs Python {here} (the nodes are "
                 "set up with the same)")
    tf = _installed("tensorflow")
    if runtime and tf and not (tf == runtime or tf.startswith(runtime.rstrip(".") + ".")):
        out.note(f"warning: {where}runtimeVersion {runtime}, but the launcher has TensorFlow {tf} (the nodes are "
                 "set up with the same)")


_INT64 = {"replicaCount", "acceleratorCount", "bootDiskSizeGb", "maxTrialCount", "parallelTrialCount",
          "maxFailedTrialCount", "workerCount", "parameterServerCount", "evaluatorCount"}


def _lenient(value: Any, key: str | None = None) -> Any:
    """The file with Vertex's JSON spellings made plain: int64 fields written as strings
    ("replicaCount": "2"), numeric args unquoted in YAML (args: [--epochs, 3])."""
    if isinstance(value, dict):
        return {k: _lenient(v, k) for k, v in value.items()}
    if isinstance(value, list):
        if key in ("args", "command", "packageUris", "containerArgs", "containerCommand"):
            return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        return [_lenient(v) for v in value]
    if key in _INT64 and isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if key in ("minValue", "maxValue") and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
