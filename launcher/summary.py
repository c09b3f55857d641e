"""What a run reports: its status, its summary, and the events that make them.

* :class:`RunStatus`: the life of a run, as shown to the user and recorded in the run log.
* :class:`RunSummary`: the outcome of one launch (printed, written to ``summary.json``
  and ``launches.jsonl``), with the :class:`Interruption` and :class:`Attempt` records.
* The controller events (:class:`Report`, :class:`Failure`, :class:`Preempting`,
  :class:`Restart`): what Ray Train's controller tells the driver while a run goes.

Each has one ``to_json()``; the events also come back with :func:`event_from_json`.
What the figures in a summary are made from (metrics, memory, time shares, usage) is
:mod:`launcher.measures`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Union


class RunStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    PREEMPTED = "preempted"
    RESUMING = "resuming"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"  # the launching process went away without a final word
    UNREADABLE = "unreadable"    # its run log cannot be read (listed, marked, never a reason to fail a list)
    UNKNOWN = "unknown"          # a record that names no status, or one this version does not know

    @classmethod
    def parse(cls, text: Any) -> "RunStatus":
        """The member a recorded status names; UNKNOWN for anything else."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN

    def __str__(self) -> str:
        return self.value


# -- records of a launch ------------------------------------------------------------------

@dataclass
class Interruption:
    """One restart of the worker group: why, and what it cost."""

    cause: str                          # "preemption", "failure" or "resize"
    steps_lost: int | None = None       # steps trained twice (past the checkpoint resumed from)
    time_lost_s: float | None = None    # from the checkpoint's time to the next group's first step
    resumed_from_step: int | None = None
    recovery_s: float | None = None     # failure seen -> first step of the restarted group


@dataclass
class Attempt:
    """One worker group's life, from rank 0's word: the steps it trained and when."""

    start_step: int
    first_time: float
    last_step: int
    last_time: float
    marks: dict[str, float] = field(default_factory=dict)  # rank 0's start-up milestones
    attempt: str = ""  # the group's id, as its reports (metrics.jsonl) name it
    notice_checkpoint_s: float | None = None  # how long its checkpoint on a preemption notice took


@dataclass
class RunSummary:
    """The outcome of one launch of a run (a run resumed later has one per launch)."""

    name: str
    status: RunStatus
    workload: str
    framework: str
    backend: str
    workers: int
    epochs: int
    # --strategy: how the launcher keeps the model in step (ddp: whole on every worker; fsdp:
    # sharded); None where the code does that itself (a --script or --package program).
    strategy: str | None = None
    epochs_completed: int = 0
    steps_completed: int = 0
    final_workers: int | None = None    # the group's size at the end (elastic runs shrink)
    metrics: dict[str, float] = field(default_factory=dict)
    samples_per_s: float = 0.0
    # The share of the training time the ranks waited for their next batch (your own loop's
    # session.loader / session.dataset): their mean, and the rank that waited most; None unmeasured.
    data_wait_fraction: float | None = None
    data_wait_max_fraction: float | None = None
    # Where the training time went (launcher.worker.timing): the share per phase (data, compute,
    # sync, optimizer, checkpoint, notice; the ranks' mean), and the ranks named stragglers.
    time_shares: dict[str, float] = field(default_factory=dict)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    # Each worker's CPU, memory and GPU over the launch, sampled every few seconds
    # (launcher.worker.usage.summarise: mean and peak per rank).
    usage: list[dict[str, Any]] = field(default_factory=list)
    # Each worker's peak memory in MiB, by rank, the largest its epoch reports gave (see
    # peak_memory): the resident set and, where torch used CUDA, GPU memory; None/empty unmeasured.
    peak_rss_mb_max: float | None = None
    peak_rss_mb_ranks: list[float] = field(default_factory=list)
    peak_gpu_mb_max: float | None = None
    peak_gpu_mb_ranks: list[float] = field(default_factory=list)
    checkpoint: str | None = None
    resumed_from: dict[str, int] | None = None
    restarts: int = 0
    preemptions: int = 0
    preemption_notices: int = 0         # checkpoints taken on a notice
    notice_checkpoint_s: float | None = None  # the longest of them, saved and stored (GCE gives 30 s)
    steps_lost: int = 0
    time_lost_s: float = 0.0
    interruptions: list[Interruption] = field(default_factory=list)
    # --strategy ft: the quorum changes (a replica left or joined; none where the group kept its size),
    # the seconds each cost the step it happened at, and the replicas Ray Train replaced alone.
    quorum_changes: int = 0
    quorum_change_s: list[float] = field(default_factory=list)
    replicas_replaced: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    weights_sha256: str | None = None
    wall_s: float = 0.0                 # the launch's time, less setup_s
    setup_s: float = 0.0                # a one-off set-up the launch waited for (a first Horovod build)
    launch: int | None = None
    run_dir: str = ""
    error: str | None = None
    model: str | None = None
    model_note: str | None = None       # the model is weights only: why, and how to predict instead
    mlflow: str | None = None           # where the run is tracked (--mlflow): its MLflow run's page or id
    note: str | None = None
    startup: dict[str, Any] = field(default_factory=dict)
    exit_codes: dict[str, int] | None = None  # script and package runs: each rank's exit status
    exit_status: int | None = None      # and the program's: the first failed rank's, 130 when interrupted

    @property
    def succeeded(self) -> bool:
        return self.status == RunStatus.SUCCEEDED

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the status as its string)."""
        out = dataclasses.asdict(self)
        out["status"] = str(self.status)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunSummary":
        """The summary :meth:`to_json` wrote (``summary.json``, a line of ``launches.jsonl``).

        Keys this version does not know are left out and missing ones take their defaults,
        so a summary written by an older or newer launcher still reads.

        Raises:
            ValueError: ``data`` is not a JSON object.
        """
        values = _known(cls, data, "a run summary")
        for key, default in (("name", "?"), ("workload", "?"), ("framework", "?"), ("backend", "?"),
                             ("workers", 0), ("epochs", 0)):
            values.setdefault(key, default)
        values["interruptions"] = _records(Interruption, data.get("interruptions"))
        values["attempts"] = _records(Attempt, data.get("attempts"))
        return cls(**values)


@dataclass
class TrialCounts:
    """How many trials of a tuning run ended each way."""

    total: int = 0
    succeeded: int = 0
    stopped_early: int = 0
    failed: int = 0
    not_finished: int = 0
    pending: int = 0


@dataclass
class BestTrial:
    """The tuning run's best trial. In JSON the metric's value is keyed by the metric's name
    (``{"trial": ..., "accuracy": 0.97, ...}``), as ``launcher runs`` and scripts read it."""

    trial: str
    metric: str
    value: float
    params: dict[str, Any] = field(default_factory=dict)
    run_dir: str = ""
    model: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"trial": self.trial, self.metric: self.value, "params": dict(self.params),
                "run_dir": self.run_dir, "model": self.model}

    @classmethod
    def from_json(cls, data: Any, metric: str) -> "BestTrial | None":
        if not isinstance(data, dict) or metric not in data:
            return None
        return cls(trial=str(data.get("trial", "?")), metric=metric, value=data[metric],
                   params=dict(data.get("params") or {}), run_dir=data.get("run_dir") or "",
                   model=data.get("model"))


@dataclass
class TuningSummary:
    """The outcome of one launch of a tuning run (its ``summary.json``)."""

    name: str
    status: RunStatus
    goal: str
    metric: str
    note: str | None = None
    algorithm: str = "ALGORITHM_UNSPECIFIED"
    early_stopping: bool = False
    max_trials: int = 0
    trials: TrialCounts = field(default_factory=TrialCounts)
    best: BestTrial | None = None
    wall_s: float = 0.0
    workload: str = "?"
    run_dir: str = ""
    files: dict[str, str] = field(default_factory=dict)  # json, csv, plot -> URI
    mlflow: str | None = None  # where it is tracked (--mlflow): the trials are its MLflow run's children
    kind: str = "tuning"

    @property
    def succeeded(self) -> bool:
        return self.status == RunStatus.SUCCEEDED

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["status"] = str(self.status)
        out["best"] = self.best.to_json() if self.best else None
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TuningSummary":
        """The summary :meth:`to_json` wrote; unknown keys left out, missing ones defaulted.

        Raises:
            ValueError: ``data`` is not a JSON object.
        """
        values = _known(cls, data, "a tuning summary")
        values.setdefault("name", "?")
        values.setdefault("goal", "?")
        metric = values.setdefault("metric", "?")
        counts = _records(TrialCounts, [data.get("trials")])
        values["trials"] = counts[0] if counts else TrialCounts()
        values["best"] = BestTrial.from_json(data.get("best"), metric)
        return cls(**values)


def _known(cls, data: Any, what: str) -> dict[str, Any]:
    """A summary's JSON as ``cls``'s fields: keys this version does not know left out, the status
    parsed. ValueError: ``data`` is not a JSON object."""
    if not isinstance(data, dict):
        raise ValueError(f"not {what}: a JSON object is expected")
    names = {f.name for f in dataclasses.fields(cls)}
    return {**{k: v for k, v in data.items() if k in names}, "status": RunStatus.parse(data.get("status"))}


def _records(cls, items: Any) -> list:
    """Record dataclasses from their JSON: unknown keys left out, incomplete records skipped."""
    known = {f.name for f in dataclasses.fields(cls)}
    out = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict):
            try:
                out.append(cls(**{k: v for k, v in item.items() if k in known}))
            except TypeError:
                continue
    return out


# -- events from Ray Train's controller ---------------------------------------------------

@dataclass
class Report:
    """Rank 0's metrics from one ``ray.train.report``, and the checkpoint persisted with it."""

    time: float
    metrics: dict[str, Any]
    checkpoint: str | None = None
    type: str = "report"


@dataclass
class Failure:
    """The worker group failed: the ranks that raised and what (Ray repeats it until it acts)."""

    time: float
    errors: dict[int, str]
    type: str = "failure"


@dataclass
class Preempting:
    """The controller saw a notice: the node(s) of these ranks are draining."""

    time: float
    deadline_ms: int | None
    ranks: list[int]
    type: str = "preempting"


@dataclass
class Restart:
    """The controller restarts the worker group, after a preemption, a failure or a resize."""

    time: float
    cause: str
    error: str
    type: str = "restart"

    def what(self) -> str:
        """"a failure", "a preemption", "a resize (the cluster's free resources changed: 2 -> 1 workers)"."""
        return f"a {self.cause} ({self.error})" if self.cause == "resize" else f"a {self.cause}"


Event = Union[Report, Failure, Preempting, Restart]
_EVENTS = {cls.type: cls for cls in (Report, Failure, Preempting, Restart)}  # type: ignore[attr-defined]


def event_to_json(event: Event) -> dict[str, Any]:
    return dataclasses.asdict(event)


def event_from_json(data: dict[str, Any]) -> Event:
    """The event a JSON object (from :func:`event_to_json`) describes."""
    cls = _EVENTS[data["type"]]
    values = dict(data)
    if cls is Failure:  # JSON object keys are strings
        values["errors"] = {int(rank): text for rank, text in values["errors"].items()}
    return cls(**values)


# The layouts of RunSummary.usage's samples and .time_shares' keys (launcher.worker.usage and .timing
# fill them; launcher.measures folds them for the summary).
USAGE_FIELDS = ("time", "cpu_pct", "rss_mb", "gpu_pct", "gpu_mb")  # one usage sample, in this order
TIME_PHASES = ("data", "compute", "sync", "optimizer", "checkpoint", "notice")  # a step's time, split
