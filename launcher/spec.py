"""JobSpec: the one typed, validated description of a training run.

Each field is declared once below (type, default, help); the YAML keys of
``--config`` and the flags of ``launcher run`` / ``submit`` derive from that
declaration (:mod:`launcher.schema`). A spec is built from a YAML file and/or
flags (flags win), then :meth:`JobSpec.validated` checks every field and
fills the defaults that depend on others (workload hyper-parameters, the run
name). Everything here is pure: checks that touch the outside world (data
files, storage, the Ray cluster) happen in the driver, before any worker.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import workloads
from cluster import machine_types
from launcher import schema
from launcher.errors import UserError
from launcher.schema import option
from launcher.storage.uri import (DEFAULT_STORAGE, DEFAULT_TRACKING, normalize_data, normalize_storage,
                                  normalize_tracking)

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")
FRAMEWORKS = ("torch", "tensorflow", "xgboost")
PROGRAM_FRAMEWORKS = ("sklearn",)  # only a program's (--package, --script): no built-in workload trains with it
BOOSTING_WORKLOAD = "tabular"  # what --framework xgboost trains when no --workload is given
BOOSTING_CHECKPOINT_ROUNDS = 10  # a boosting run's checkpoint cadence when none is given (at least)
__all__ = ["JobSpec", "BOOSTING_CHECKPOINT_ROUNDS", "FRAMEWORKS", "HOROVOD_OPTIONS", "check_name", "default_name",
           "load_spec_file", "normalize_data", "normalize_storage"]


@dataclass(frozen=True)
class JobSpec:
    """What to train, how, where and with which resources.

    ``None`` in epochs, batch_size and lr means "the workload's default";
    ``None`` in name means "generate one"; ``None`` in checkpoint_every_steps
    means "once per epoch" (for xgboost: every 10 rounds, further apart where a checkpoint
    would cost more than 2 % of the rounds' time); ``None`` in address means "start a local Ray".
    """

    workload: str = option(workloads.DEFAULT,
                           help="a built-in workload (see `launcher workloads`; default digits-mlp) or yours: "
                           "FILE.py:NAME or package.module:NAME")
    framework: str = option("torch", help="torch (default), tensorflow or xgboost (gradient-boosted trees on "
                            "the tabular workload: a round is a step); for a --package or --script program also "
                            "sklearn (found from its imports when not given)")
    backend: str = option("native", help="native (Ray Train's own: torch DDP, TF MultiWorkerMirroredStrategy; "
                          "default) or horovod (see `launcher doctor`)")
    workers: int = option(2, help="number of worker processes (default 2)")
    cpus_per_worker: float = option(1.0, help="CPUs per worker (default 1)")
    gpus_per_worker: float = option(0.0, help="GPUs per worker (default 0)")
    epochs: int | None = option(None, help="epochs to train in all (default: the workload's)")
    # per worker; the global batch is workers x batch_size
    batch_size: int | None = option(None, help="batch size per worker (default: the workload's)")
    lr: float | None = option(None, help="learning rate (default: the workload's)")
    seed: int = option(0, help="random seed (default 0): same seed and workers, same result")
    data: str | None = option(None, help="data for workloads that read files: a local path or gs://BUCKET/PREFIX")
    data_cache_gb: float | None = option(None, help="streamed shard sets (launcher.data.Shards): the most each "
                                         "node's cache of fetched shards holds, in GiB (default 16)")
    storage: str = option(DEFAULT_STORAGE, help="where runs are kept: a folder or gs://BUCKET/PREFIX "
                          "(default ./runs)")
    name: str | None = option(None, help="run name; an existing name resumes that run")
    mlflow: str | None = option(None, const=DEFAULT_TRACKING, metavar="URI",
                                help="track the run in MLflow (off unless given): --mlflow alone keeps it in "
                                f"{DEFAULT_TRACKING}, --mlflow URI in a tracking server (http://HOST:5000), a "
                                "database (sqlite:///FILE.db) or a folder; one MLflow run per run, resumed with it")
    checkpoint_every_steps: int | None = option(None, help="also checkpoint every N steps (default: per epoch; "
                                                "xgboost: every 10 rounds or more, by their cost)")
    keep_checkpoints: int = option(3, help="checkpoints to keep (default 3)")
    checkpoint_upload: str = option("sync", help="sync (default): training waits while a checkpoint is stored; "
                                    "async: step and epoch checkpoints are stored in the background (those taken on "
                                    "a preemption notice and the last one always wait)")
    max_failures: int = option(0, help="worker-group restarts allowed after failures (default 0, -1: unlimited); "
                               "preemptions never count")
    max_run_s: float | None = option(None, help="stop the run once this launch has trained this many seconds "
                                     "and summarise it (AI Platform's maxRunningTime, Vertex AI's "
                                     "scheduling.timeout); the same --name resumes it from its last checkpoint "
                                     "(default: no limit)")
    # ask Ray Train for a preemption notice every N steps; 0: never
    preemption_check_steps: int = option(10, help="check for a preemption notice every N steps and checkpoint at "
                                         "once on one (default 10; 1 for --framework xgboost; 0: never)")
    # elastic: carry on with as few as this many workers (None: fixed size)
    min_workers: int | None = option(None, help="elastic: when nodes are lost and not replaced, go on with as few "
                                     "as this many workers (default: always --workers); with --strategy ft, "
                                     "the quorum's minimum")
    replace_on_notice: bool = option(True, help="on a cluster, ask the autoscaler for a preempted node's "
                                     "replacement as its notice comes, so it boots while the node drains "
                                     "(default true)")
    address: str | None = option(None, help="Ray cluster address (default: RAY_ADDRESS or a new local Ray)")
    # Compute Engine machine types, as AI Platform's workerType / masterType (+ acceleratorConfig) or
    # Vertex's worker pools 1 and 0 name them (cluster.machines); on a cluster only (a local run notes them).
    machine_type: str | None = option(None, help="on a cluster, run the workers on nodes of this Compute Engine "
                                      "machine type: MACHINE[+ACCELERATOR[xCOUNT]], e.g. n1-standard-8 or "
                                      "n1-standard-8+nvidia-tesla-t4x1 (default: any node)")
    primary_machine_type: str | None = option(None, help="on a cluster, run rank 0 on a node of this machine type "
                                              "(AI Platform's masterType, Vertex's pool 0; default: "
                                              "--machine-type)")
    # The managed torch loop's numerics (a training function reads them from its session).
    precision: str = option("fp32", help="fp32 (default), bf16 or fp16: mixed precision by autocast in the managed "
                            "torch loop (fp16 with a checkpointed GradScaler); your own loop: session.autocast()")
    strategy: str = option("ddp", help="ddp (default): every worker holds the whole model; fsdp: the model, its "
                           "gradients and optimizer state are sharded over the workers (torch FSDP2; native "
                           "torch backend), for models larger than one worker; ft: ddp whose workers are torchft "
                           "replica groups, a quorum per step, so a lost worker restarts no other (--min-workers: "
                           "the fewest that train on)")
    fsdp_offload: bool = option(False, help="fsdp on GPUs: keep the parameters and optimizer state in CPU memory "
                                "between uses (slower, larger models)")
    grad_clip: float | None = option(None, help="clip the gradients' global norm to this (default: no clipping)")
    grad_accumulation: int = option(1, help="batches whose gradients add up before each optimizer step, any torch "
                                    "backend (default 1)")
    params: dict[str, Any] = option(default_factory=dict, cli=False,
                                    help="workload parameters (on the command line: --param KEY=VALUE)")
    # Horovod only (--backend horovod): fp16 gradient compression, the tensor-fusion
    # buffer in MiB (None: Horovod's 128), backward passes accumulated per optimizer step.
    hvd_fp16: bool = option(False, help="Horovod: compress gradients to fp16 for the allreduce")
    hvd_fusion_mb: float | None = option(None, help="Horovod: tensor-fusion buffer in MiB (default 128; 0: off)")
    hvd_backward_passes: int = option(1, help="Horovod: backward passes (batches) whose gradients add up locally "
                                      "per optimizer step (default 1)")

    # -- construction -----------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "spec") -> "JobSpec":
        """Build a spec from a mapping (YAML or flags); unknown keys and wrong types are errors."""
        return cls(**schema.from_mapping(cls, values, source))

    def merged(self, overrides: Mapping[str, Any], source: str = "flags") -> "JobSpec":
        """A copy with ``overrides`` (values not None) applied, type-checked like from_mapping."""
        base = dataclasses.asdict(self)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return JobSpec.from_mapping(base, source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- validation -----------------------------------------------------------------
    def validated(self, now: _dt.datetime | None = None) -> "JobSpec":
        """Check every field and return the spec with all defaults resolved.

        Raises:
            UserError: naming the field, the bad value and what would be valid.
        """
        if self.framework == "torch" and workloads.is_reference(self.workload):
            function = load_workload(self.workload)
            if isinstance(function, workloads.TrainingFunction) and function.frameworks in (("tensorflow",),
                                                                                          ("xgboost",)):
                # A Keras or TensorFlow function, or a Ray Train XGBoost function: no --framework needed.
                return dataclasses.replace(self, framework=function.frameworks[0]).validated(now)
        if self.framework == "xgboost" and self.workload == workloads.DEFAULT:
            return dataclasses.replace(self, workload=BOOSTING_WORKLOAD).validated(now)
        workload = self._check_choices()
        boosting = self._check_boosting(workload)
        if boosting is not self:
            return boosting.validated(now)
        self._check_numbers()
        self._check_horovod_options()
        self._check_numerics()
        self._check_upload()
        self._check_strategy(workload)
        machine_type, primary = self._machine_types()
        try:
            params = workload.resolve_params(self.params)
        except (KeyError, ValueError) as exc:
            raise UserError(str(exc).strip('"'), "see `launcher workloads` for each workload's params")
        name = self.name or default_name(workload.name, self.framework, self.backend, now)
        check_name(name)
        d = workload.defaults
        return dataclasses.replace(
            self,
            epochs=self.epochs or d.epochs,
            batch_size=self.batch_size or d.batch_size,
            lr=self.lr or d.lr,
            name=name,
            workload=canonical_workload(self.workload),
            storage=normalize_storage(self.storage),
            data=normalize_data(self.data),
            mlflow=normalize_tracking(self.mlflow),
            params=params,
            machine_type=machine_type,
            primary_machine_type=primary,
        )

    def _check_choices(self) -> workloads.Workload:
        """Workload, framework and backend exist and go together; returns the workload."""
        from launcher import backends  # the registry only; imports no framework

        workload = load_workload(self.workload)
        if self.data is not None and not workload.reads_data and not workloads.is_reference(self.workload):
            raise UserError(f"--data {self.data}: workload {workload.name} reads no data files",
                            "drop --data (see `launcher workloads` for the workloads that read files)")
        if self.framework in PROGRAM_FRAMEWORKS:
            raise UserError(f"--framework {self.framework} labels a scikit-learn trainer package or script: no "
                            "built-in workload trains with it", "run it with --package DIR --module trainer.task "
                            "(or --script FILE), or use --framework xgboost for boosted trees on a table")
        if self.framework not in FRAMEWORKS:
            raise UserError(f"unknown framework {self.framework!r}", f"valid: {', '.join(FRAMEWORKS)}")
        if self.framework == "xgboost" and getattr(workload, "kind", None) == workloads.function.SESSION:
            raise UserError(f"{workload.name}(session) is a training function for torch or TensorFlow; an XGBoost "
                            "function is written as Ray Train's", "write it as def NAME(config) calling "
                            "xgboost.train with ray.train.xgboost.RayTrainReportCallback (see the XGBoost guide)")
        if self.framework not in workload.frameworks:
            raise UserError(f"workload {workload.name} has no {self.framework} model",
                            f"use --framework {' or '.join(workload.frameworks)}")
        if getattr(workload, "kind", None) == workloads.function.RAY_TRAIN and self.backend != "native":
            raise UserError(f"{workload.name}(config) is a Ray Train function: it runs on Ray Train's own "
                            f"{'XGBoost' if self.framework == 'xgboost' else 'torch'} backend, not {self.backend}",
                            "drop --backend, or write it as def NAME(session) to train with Horovod")
        backend = _lookup(backends.REGISTRY, self.backend, "--backend")
        if self.framework not in backend.frameworks:
            raise UserError(f"backend {self.backend} does not support {self.framework}",
                            f"it supports: {', '.join(backend.frameworks)}")
        return workload

    def _check_boosting(self, workload) -> "JobSpec":
        """--framework xgboost: refuse what a boosting run has no use for, in one line; returns the
        spec with a boosting run's defaults (checkpoints spaced by the loop, a notice check every
        round) where the user gave none, or ``self``."""
        if self.framework != "xgboost":
            return self
        neural = [(name, why) for name, why in (
            ("epochs", "the rounds are --param num_boost_round=N"),
            ("batch_size", "each round reads every row"), ("lr", "the learning rate is --param eta=X"),
            ("precision", None), ("grad_clip", None), ("grad_accumulation", None), ("strategy", None),
            ("min_workers", "an XGBoost run keeps a fixed group (XGBoost's tracker is set up for a fixed number "
                            "of workers); a preempted worker is replaced and the run resumes at its last round "
                            "checkpoint"))
            if getattr(self, name) not in (_DEFAULTS[name], getattr(workload.defaults, name, None))]
        if neural:
            name, why = neural[0]
            raise UserError(f"{_flag(name)} does not apply to an XGBoost run" + (f": {why}" if why else
                            ": it trains trees, not a network"), f"drop {_flag(name)}")
        # checkpoint_every_steps stays None unless given: the boosting loop then checkpoints every
        # BOOSTING_CHECKPOINT_ROUNDS rounds, spaced further where a checkpoint costs more.
        defaults = {}
        if self.preemption_check_steps == _DEFAULTS["preemption_check_steps"]:
            defaults["preemption_check_steps"] = 1  # a round takes long enough to ask after each
        return dataclasses.replace(self, **defaults) if defaults else self

    def _check_numbers(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{f.name} must be a finite number, got {value}",
                                f"set {_flag(f.name)} to a number")
        _at_least("workers", self.workers, 1)
        _positive("cpus_per_worker", self.cpus_per_worker)
        _at_least("gpus_per_worker", self.gpus_per_worker, 0)
        for name in ("epochs", "batch_size", "checkpoint_every_steps"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        if self.lr is not None:
            _positive("lr", self.lr)
        _at_least("seed", self.seed, 0)
        _at_least("keep_checkpoints", self.keep_checkpoints, 1)
        _at_least("max_failures", self.max_failures, -1)
        _at_least("preemption_check_steps", self.preemption_check_steps, 0)
        if self.max_run_s is not None:
            _positive("max_run_s", self.max_run_s)
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise UserError(f"--min-workers {self.min_workers} is outside 1..{self.workers} (--workers)",
                            "give a number of workers the run may shrink to, at most --workers")

    def _check_horovod_options(self) -> None:
        given = [name for name, default in HOROVOD_OPTIONS.items() if getattr(self, name) != default]
        if given and self.backend != "horovod":
            raise UserError(f"{_flag(given[0])} is a Horovod option, but the backend is {self.backend}",
                            "add --backend horovod, or drop the option")
        if self.hvd_fusion_mb is not None:
            _at_least("hvd_fusion_mb", self.hvd_fusion_mb, 0)
        _at_least("hvd_backward_passes", self.hvd_backward_passes, 1)
        if self.hvd_backward_passes > 1 and self.framework != "torch":
            raise UserError(f"--hvd-backward-passes {self.hvd_backward_passes}: gradient accumulation is "
                            f"implemented for torch runs only, not {self.framework}",
                            "drop the option, or raise --batch-size instead")


    def _machine_types(self) -> tuple[str | None, str | None]:
        """--machine-type and --primary-machine-type checked and spelled one way (cluster.machines)."""
        return tuple(str(machine_types.parse(value, _flag(name))) if value else None
                     for name, value in (("machine_type", self.machine_type),
                                         ("primary_machine_type", self.primary_machine_type)))

    def _check_upload(self) -> None:
        if self.checkpoint_upload not in ("sync", "async"):
            raise UserError(f"unknown checkpoint upload {self.checkpoint_upload!r}", "valid: sync, async")

    def _check_numerics(self) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision {self.precision!r}", f"valid: {', '.join(PRECISIONS)}")
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)
        if self.data_cache_gb is not None:
            _positive("data_cache_gb", self.data_cache_gb)
        _at_least("grad_accumulation", self.grad_accumulation, 1)
        changed = [n for n, default in (("precision", "fp32"), ("grad_clip", None), ("grad_accumulation", 1))
                   if getattr(self, n) != default]
        if changed and self.framework != "torch":
            raise UserError(f"{_flag(changed[0])} applies to torch runs; the TensorFlow loop does not take it",
                            "drop the option, or use --framework torch")
        if self.grad_accumulation > 1 and self.hvd_backward_passes > 1 \
                and self.grad_accumulation != self.hvd_backward_passes:
            raise UserError(f"--grad-accumulation {self.grad_accumulation} and --hvd-backward-passes "
                            f"{self.hvd_backward_passes} disagree", "give one of them (they mean the same)")

    def _check_strategy(self, workload) -> None:
        """--strategy fsdp or ft: a torch run on the native backend whose code calls session.prepare."""
        if self.strategy not in STRATEGIES:
            raise UserError(f"unknown strategy {self.strategy!r}", f"valid: {', '.join(STRATEGIES)}")
        if self.fsdp_offload and self.strategy != "fsdp":
            raise UserError("--fsdp-offload applies to --strategy fsdp", "add --strategy fsdp, or drop the option")
        if self.strategy == "ddp":
            return
        what = {"fsdp": "shards a PyTorch model (torch FSDP2)",
                "ft": "keeps a PyTorch model in step with torchft replica groups"}[self.strategy]
        if self.framework != "torch":
            raise UserError(f"--strategy {self.strategy} {what}; TensorFlow runs are data parallel only and "
                            "restart their group on a lost node", "drop --strategy, or train the model in PyTorch")
        if self.backend != "native":
            raise UserError(f"--strategy {self.strategy} runs on the native torch backend, not {self.backend}: "
                            "Horovod's allreduce keeps a fixed ring of whole models", "drop --backend horovod")
        if getattr(workload, "kind", None) == workloads.function.RAY_TRAIN:
            raise UserError(f"{workload.name}(config) is a Ray Train function: it keeps its model in step itself",
                            "drop --strategy, or write it as def NAME(session)")
        if self.strategy == "ft":
            self._check_replica_groups()
            return
        if self.precision == "fp16":
            raise UserError("--precision fp16 with --strategy fsdp: a sharded model's gradients are not scaled by "
                            "GradScaler", "use --precision bf16 (FSDP2's mixed precision)")
        if self.fsdp_offload and not self.gpus_per_worker:
            raise UserError("--fsdp-offload moves a GPU worker's parameters and optimizer state to CPU memory, but "
                            "the workers have no GPU", "add --gpus-per-worker 1, or drop --fsdp-offload")

    def _check_replica_groups(self) -> None:
        """--strategy ft: every step is committed or retried whole, so nothing may skip or split one."""
        if self.precision == "fp16":
            raise UserError("--precision fp16 with --strategy ft: GradScaler skips an optimizer step on overflow, "
                            "and a torchft step must be committed or retried", "use --precision bf16")
        if self.accumulation > 1:
            raise UserError(f"--grad-accumulation {self.accumulation} with --strategy ft: a quorum is formed per "
                            "optimizer step, and a step's batches would span quorums",
                            "drop --grad-accumulation, or raise --batch-size")

    @property
    def replica_groups(self) -> bool:
        """--strategy ft: each worker is a torchft replica group of its own, kept in the run by a
        quorum per step (Ray Train replaces a lost one alone; the group is never resized)."""
        return self.strategy == "ft"

    @property
    def accumulation(self) -> int:
        """Batches per optimizer step: --grad-accumulation, or Horovod's --hvd-backward-passes."""
        return max(self.grad_accumulation, self.hvd_backward_passes)


PRECISIONS = ("fp32", "bf16", "fp16")
STRATEGIES = ("ddp", "fsdp", "ft")
STRATEGY_EXTRAS = {"ft": "torchft"}  # the launcher's extra a strategy needs beyond the core
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(JobSpec)}
# Horovod's options and their defaults (which any backend accepts).
HOROVOD_OPTIONS = {f.name: f.default for f in dataclasses.fields(JobSpec) if f.name.startswith("hvd_")}


def load_spec_file(path: str) -> JobSpec:
    """A JobSpec from a YAML file whose keys are JobSpec fields (``workers: 4``,
    ``params: {image_size: 64}``); any other key is an error naming the closest valid one."""
    raw = schema.load_mapping(path, "--config", "workload: ..., workers: ...")
    return JobSpec.from_mapping(raw, source=path)


# -- helpers -------------------------------------------------------------------------

def default_name(workload: str, framework: str, backend: str, now: _dt.datetime | None = None) -> str:
    """<workload>_<framework>_<backend>_<YYYYmmdd_HHMMSS>, dashes turned into underscores."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d_%H%M%S")
    return f"{workload}_{framework}_{backend}_{stamp}".replace("-", "_")


def check_name(name: str) -> None:
    """Run names follow the AI Platform job-ID rule."""
    if not NAME_RE.match(name):
        raise UserError(
            f"invalid run name {name!r}: use letters, digits and underscores, start with a letter, "
            "at most 128 characters", "for example --name digits_run_1")


def load_workload(name: str) -> workloads.Workload:
    """The built-in workload of that name, or the user's workload a ``FILE.py:NAME`` /
    ``module:NAME`` reference names (imported and checked).

    Raises:
        UserError: no such workload, or user code that does not import or lacks a part.
    """
    if not workloads.is_reference(name):
        if name.endswith(".py") or "/" in name:
            raise UserError(f"--workload {name} is a file: name the workload in it", f"write {name}:NAME")
        return _lookup(workloads.REGISTRY, name, "--workload")
    try:
        return workloads.get(name)
    except workloads.WorkloadError as exc:
        raise UserError(str(exc)) from None


def canonical_workload(name: str) -> str:
    """A user workload's file reference with an absolute path (workers start elsewhere)."""
    if not workloads.is_reference(name):
        return name
    return workloads.user.parse_reference(name).canonical


def _lookup(registry, name: str, flag: str):
    try:
        return registry.get(name)
    except workloads.UnknownName as exc:
        raise UserError(f"{flag}: {exc}") from None


def _at_least(name: str, value: float, low: float) -> None:
    if value < low:
        raise UserError(f"{name} must be >= {low}, got {value}", f"set {_flag(name)} to {low} or more")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{name} must be > 0, got {value}", f"set {_flag(name)} to a positive number")


def _flag(name: str) -> str:
    return schema.flag_of(JobSpec, name)
