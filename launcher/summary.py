"""What a run reports: its status, its summary, and the events that make them.

* :class:`RunStatus`: the life of a run, as shown to the user and recorded in the run log.
* :class:`RunSummary`: the outcome of one launch (printed, written to ``summary.json``
  and ``launches.jsonl``), with the :class:`Interruption` and :class:`Attempt` records.
* The controller events (:class:`Report`, :class:`Failure`, :class:`Preempting`,
  :class:`Restart`): what Ray Train's controller tells the driver while a run goes.

Each has one ``to_json()``; the events also come back with :func:`event_from_json`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Union


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

    @property
    def is_terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.INTERRUPTED)

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
        if not isinstance(data, dict):
            raise ValueError("not a run summary: a JSON object is expected")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["status"] = RunStatus.parse(data.get("status"))
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
        if not isinstance(data, dict):
            raise ValueError("not a tuning summary: a JSON object is expected")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["status"] = RunStatus.parse(data.get("status"))
        values.setdefault("name", "?")
        values.setdefault("goal", "?")
        metric = values.setdefault("metric", "?")
        counts = _records(TrialCounts, [data.get("trials")])
        values["trials"] = counts[0] if counts else TrialCounts()
        values["best"] = BestTrial.from_json(data.get("best"), metric)
        return cls(**values)


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


METRIC_KEYS = ("loss", "accuracy", "train_loss")
# What a report carries about the run itself, not the model: never shown as a metric.
BOOKKEEPING = frozenset({
    "kind", "epoch", "step_in_epoch", "global_step", "world_size", "time", "attempt", "restored_from",
    "steps_per_epoch", "startup_marks", "samples", "train_time_s", "samples_per_s", "notice", "held",
    "data_wait_s", "data_wait_fraction", "data_wait_max_fraction",
    "time_data", "time_compute", "time_sync", "time_optimizer", "time_checkpoint", "time_notice",
    "busy_s_ranks", "straggler_rank", "straggler_factor", "usage", "usage_ranks",
    "peak_rss_mb_max", "peak_rss_mb_ranks", "peak_gpu_mb_max", "peak_gpu_mb_ranks",
    "weights_sha256", "model", "model_note", "timestamp", "checkpoint_dir_name", "training_iteration",
    "launch", "source", "from_checkpoint",  # what the run log adds to a report
    "trial", "checkpoint_path"})  # a program's hypertune entry's


def pick_metrics(values: dict[str, Any]) -> dict[str, float]:
    """The metrics a summary shows, from a report or a checkpoint's manifest: the managed loop's
    (loss, accuracy, train_loss) first, then any other number a training function reported."""
    known = {k: values[k] for k in METRIC_KEYS if k in values}
    others = {k: v for k, v in values.items() if k not in BOOKKEEPING and k not in known
              and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**known, **others}


def program_metrics(entries: list[dict[str, Any]]) -> dict[str, float]:
    """A program's (``--script``, ``--package``) latest value of each metric it reported through
    hypertune: one entry per tag and report, so the last entry alone may hold one metric of several."""
    out: dict[str, float] = {}
    for entry in entries:
        out.update(pick_metrics(entry))
    return out


def program_epochs(entries: list[dict[str, Any]]) -> int:
    """How many epochs a program trained, from its hypertune entries: its own ``epoch`` metric
    where it reports one, else the number of steps it reported metrics at (a trainer reports
    once per epoch, as the example package and Vertex AI's samples do). Steps reported again
    after a restart count once."""
    epochs = [e["epoch"] for e in entries if isinstance(e.get("epoch"), (int, float))]
    if epochs:
        return int(max(epochs))
    return len({e.get("global_step") if e.get("global_step") is not None else ("at", e.get("timestamp"))
                for e in entries})


# The memory a report or a summary gives, each as NAME_max (MiB, the largest of the ranks) and
# NAME_ranks (MiB, by rank): the workers' resident sets, and their GPU memory.
MEMORY = ("peak_rss_mb", "peak_gpu_mb")
MEMORY_RANKS_SHOWN = 8  # more ranks than this: the largest and the mean, not each


def peak_memory(reports: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Each rank's peak memory over ``reports`` (epoch reports, metrics rows, summaries, or what
    this returned before): per rank the largest figure any gave, and the largest of all. A
    checkpoint's manifest keeps only the largest. Keys with nothing measured are left out."""
    out: dict[str, Any] = {}
    for m in reports:
        for name in MEMORY:
            top, ranks = m.get(f"{name}_max"), m.get(f"{name}_ranks")
            if _number(top):
                out[f"{name}_max"] = max(float(top), out.get(f"{name}_max", 0.0))
            if isinstance(ranks, list) and ranks:
                have = out.get(f"{name}_ranks", [])
                new = [float(v) if _number(v) else 0.0 for v in ranks]
                out[f"{name}_ranks"] = [max(a, b) for a, b in zip(have, new)] + have[len(new):] + new[len(have):]
                out[f"{name}_max"] = max(out[f"{name}_ranks"] + [out.get(f"{name}_max", 0.0)])
    return out


def format_memory(m: Mapping[str, Any]) -> str:
    """"peak memory per rank: RSS 412 / 430 MB, GPU 1,024 / 1,020 MB" (past
    :data:`MEMORY_RANKS_SHOWN` ranks: the largest, whose, and the mean); "" when unmeasured."""
    parts = []
    for name, label in zip(MEMORY, ("RSS", "GPU")):
        top, ranks = m.get(f"{name}_max"), m.get(f"{name}_ranks") or []
        if ranks and len(ranks) <= MEMORY_RANKS_SHOWN:
            parts.append(f"{label} " + " / ".join(f"{v:,.0f}" for v in ranks) + " MB")
        elif ranks:
            worst = max(range(len(ranks)), key=ranks.__getitem__)
            parts.append(f"{label} max {ranks[worst]:,.0f} MB (rank {worst}), mean "
                         f"{sum(ranks) / len(ranks):,.0f} MB over {len(ranks)} ranks")
        elif _number(top):
            parts.append(f"{label} max {top:,.0f} MB")
    return "peak memory per rank: " + ", ".join(parts) if parts else ""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- where the time went and how busy the workers were (launcher.worker.timing, .usage) --------------

USAGE_FIELDS = ("time", "cpu_pct", "rss_mb", "gpu_pct", "gpu_mb")  # one usage sample, in this order
TIME_PHASES = ("data", "compute", "sync", "optimizer", "checkpoint", "notice")  # a step's time, split


def format_shares(shares: dict[str, float], stragglers: list[dict[str, Any]]) -> str:
    """The summary's line: the phases by their share (those of 0.5 % or more), then the stragglers."""
    parts = [f"{p} {100 * v:.1f}%" for p, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.005]
    line = ("time: " + ", ".join(parts)) if parts else ""
    for s in stragglers:
        line += (f"; straggler: rank {s['rank']} ({s['factor']:.1f}x the median busy time, "
                 f"{s['epochs']} epoch{'s' if s['epochs'] != 1 else ''})")
    return line


def summarise_usage(samples: dict[int, list[list[float]]]) -> list[dict[str, Any]]:
    """Per rank, from its samples: mean and peak CPU %, mean and peak RSS (MiB), and where a GPU
    was seen, its mean and peak utilisation and peak memory."""
    out = []
    for rank in sorted(samples):
        rows = samples[rank]
        if not rows:
            continue
        column = {f: [r[i] for r in rows] for i, f in enumerate(USAGE_FIELDS)}
        entry: dict[str, Any] = {"rank": rank, "samples": len(rows),
                                 "cpu_pct_mean": round(sum(column["cpu_pct"]) / len(rows), 1),
                                 "cpu_pct_peak": max(column["cpu_pct"]),
                                 "rss_mb_mean": round(sum(column["rss_mb"]) / len(rows), 1),
                                 "rss_mb_peak": max(column["rss_mb"])}
        if any(column["gpu_mb"]) or any(column["gpu_pct"]):
            entry.update(gpu_pct_mean=round(sum(column["gpu_pct"]) / len(rows), 1),
                         gpu_pct_peak=max(column["gpu_pct"]), gpu_mb_peak=max(column["gpu_mb"]))
        out.append(entry)
    return out


def format_usage(per_rank: list[dict[str, Any]]) -> list[str]:
    """One line per rank for a summary: CPU and memory, mean and peak (and the GPU's); past
    :data:`MEMORY_RANKS_SHOWN` ranks, one line: the ranks' mean, and the extremes with their rank."""
    if len(per_rank) > MEMORY_RANKS_SHOWN:
        def pick(key: str, low: bool = False) -> dict[str, Any]:
            return (min if low else max)(per_rank, key=lambda u: u.get(key, 0.0))

        idle, big = pick("cpu_pct_mean", low=True), pick("rss_mb_peak")
        mean = sum(u["cpu_pct_mean"] for u in per_rank) / len(per_rank)
        line = (f"usage over {len(per_rank)} ranks: CPU {mean:.0f}% mean (least busy: rank {idle['rank']}, "
                f"{idle['cpu_pct_mean']:.0f}%); RSS peak {big['rss_mb_peak']:,.0f} MB (rank {big['rank']})")
        gpus = [u for u in per_rank if "gpu_pct_mean" in u]
        if gpus:
            low = min(gpus, key=lambda u: u["gpu_pct_mean"])
            line += (f"; GPU {sum(u['gpu_pct_mean'] for u in gpus) / len(gpus):.0f}% mean (least busy: rank "
                     f"{low['rank']}, {low['gpu_pct_mean']:.0f}%)")
        return [line + " (launcher runs NAME --plot usage: each rank over time)"]
    lines = []
    for u in per_rank:
        line = (f"rank {u['rank']}: CPU {u['cpu_pct_mean']:.0f}% mean, {u['cpu_pct_peak']:.0f}% peak; "
                f"RSS {u['rss_mb_mean']:,.0f} MB mean, {u['rss_mb_peak']:,.0f} MB peak")
        if "gpu_pct_mean" in u:
            line += (f"; GPU {u['gpu_pct_mean']:.0f}% mean, {u['gpu_pct_peak']:.0f}% peak, "
                     f"{u['gpu_mb_peak']:,.0f} MB peak")
        lines.append(line + f" ({u['samples']} samples)")
    return lines
