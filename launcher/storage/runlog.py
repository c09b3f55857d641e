"""A run's folder: its records, written by :class:`RunLog` and read back by :class:`RunRecord`.

Layout under ``<storage>/<name>/`` (Ray Train's checkpoint folders sit beside it):

* ``run.json``       identity of the run, written by its first launch, never rewritten
* ``launches.jsonl`` one "start" and one "end" line per launch (spec, host, status)
* ``metrics.jsonl``  one line per epoch and per mid-epoch checkpoint, appended
* ``usage.jsonl``    each rank's CPU, memory and GPU samples, appended
* ``summary.json``   the latest launch's summary (every summary is also in launches.jsonl)
* ``launch.lock``    the launch training now (:mod:`launcher.storage.runlock`)
* ``logs/``          each rank's output, ``logs/launch<L>/<started>-<group>-rank<N>.log``
* ``tensorboard/``   TensorBoard event files, one file per launch
* ``model/``         the final model in the framework's own format

A tuning run's folder holds ``tuning.json`` (its definition) instead of ``run.json``, and
its own ``summary.json``. These names are written here and nowhere else.
Nothing is overwritten except summary.json, whose history stays in launches.jsonl.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

from launcher.errors import UserError
from launcher.summary import TIME_PHASES, USAGE_FIELDS, RunSummary, TuningSummary
from launcher.storage.store import Storage

RUN, LAUNCHES, METRICS, USAGE = "run.json", "launches.jsonl", "metrics.jsonl", "usage.jsonl"
SUMMARY, LOCK, TUNING = "summary.json", "launch.lock", "tuning.json"
LOGS, TENSORBOARD = "logs", "tensorboard"
IDENTITY_KEYS = ("workload", "framework")


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, default=str) + "\n"


def read_jsonl(text: str | None) -> list[dict[str, Any]]:
    """Parse JSON lines, skipping a torn last line (a writer cut off mid-line)."""
    out = []
    for line in (text or "").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class RunRecord:
    """A run's folder read back, each file when asked. ``name``: the folder's path under the storage
    root, in parts (a tuning run's trial: the tuning run, the trial). A torn last line of a JSON-lines
    file (its writer cut off) is passed over; a damaged JSON file is a ValueError naming it."""

    def __init__(self, storage: Storage, *name: str) -> None:
        self.storage, self.name = storage, name

    def uri(self, *parts: str) -> str:
        return self.storage.uri_of(*self.name, *parts)

    def _lines(self, *parts: str) -> list[dict[str, Any]]:
        return read_jsonl(self.storage.read_text(*self.name, *parts))

    def _object(self, file: str) -> dict[str, Any] | None:
        text = self.storage.read_text(*self.name, file)
        try:
            value = None if text is None else json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{self.uri(file)} is damaged (not JSON: {exc})") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{self.uri(file)} is damaged (a {type(value).__name__}, not an object)")
        return value

    def exists(self) -> bool:
        """Whether the folder is a run's (it has a run.json; a tuning run's has not)."""
        return self.storage.exists(*self.name, RUN)

    def identity(self) -> dict[str, Any] | None:
        """run.json (name, created, workload, framework, the first launch's spec); None: no run yet."""
        return self._object(RUN)

    def launches(self) -> list[dict[str, Any]]:
        """launches.jsonl: a "start" line per launch, and an "end" line with its summary once it ended."""
        return self._lines(LAUNCHES)

    def starts(self) -> list[dict[str, Any]]:
        return [e for e in self.launches() if e.get("event") == "start"]

    def ended(self, launch: int) -> bool:
        return any(e.get("event") == "end" and e.get("launch") == launch for e in self.launches())

    def summaries(self, launches: list[dict[str, Any]] | None = None) -> list[RunSummary]:
        """The summaries the launches ended with, oldest first (unreadable ones left out)."""
        out = []
        for e in self.launches() if launches is None else launches:
            if e.get("event") == "end" and isinstance(e.get("summary"), dict):
                try:
                    out.append(RunSummary.from_json(e["summary"]))
                except (ValueError, TypeError):
                    continue
        return out

    def summary(self) -> RunSummary | None:
        """The latest launch's summary (summary.json); None without a readable one."""
        try:
            data = self._object(SUMMARY)
            return None if data is None else RunSummary.from_json(data)
        except (ValueError, TypeError):
            return None

    def spec(self) -> dict[str, Any]:
        """The latest launch's spec (run.json's before any launch line)."""
        starts = self.starts()
        if starts and isinstance(starts[-1].get("spec"), dict):
            return starts[-1]["spec"]
        try:
            return dict((self.identity() or {}).get("spec") or {})
        except (ValueError, TypeError):
            return {}

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl: the epochs', the mid-epoch checkpoints' and a program's (hypertune) reports."""
        return self._lines(METRICS)

    def at_steps(self) -> list[dict[str, Any]]:
        """The metrics that stand at a step (epochs and mid-epoch checkpoints)."""
        return [m for m in self.metrics() if isinstance(m.get("global_step"), (int, float))]

    def usage(self) -> list[dict[str, Any]]:
        """usage.jsonl: a line per rank and sample (launcher.summary.USAGE_FIELDS)."""
        return self._lines(USAGE)

    def lock(self) -> dict[str, Any] | None:
        """The holder of the run's lock (host, pid, since, heartbeat); None: no launch holds it. A
        lock cut off while written (its writer died then) has no heartbeat."""
        try:
            return self._object(LOCK)
        except ValueError:
            return {"heartbeat": 0}

    def tuning(self) -> dict[str, Any] | None:
        """A tuning run's definition (tuning.json); None: the folder is not a tuning run's."""
        return self._object(TUNING)

    def tuning_summary(self) -> TuningSummary | None:
        """A tuning run's latest summary; None before a launch of it ended."""
        data = self._object(SUMMARY)
        return None if data is None else TuningSummary.from_json(data)

    def logged_launches(self) -> list[int]:
        """The launches whose ranks' output is kept (logs/launch<L>/), oldest first."""
        return sorted(int(d[len("launch"):]) for d in self.storage.list_dirs(*self.name, LOGS)
                      if d.startswith("launch") and d[len("launch"):].isdigit())

    def rank_logs(self, launch: int) -> list[str]:
        """The file names of a launch's rank logs (:func:`rank_log_name`)."""
        return self.storage.list_files(*self.name, LOGS, log_folder(launch))

    def rank_log(self, launch: int, file: str) -> str:
        return self.storage.read_text(*self.name, LOGS, log_folder(launch), file) or ""


class RunLog:
    """A run's log, as one launch writes it; ``tracking`` (a
    :class:`launcher.storage.tracking.Tracking`, for ``--mlflow``) gets what it records too."""

    def __init__(self, storage: Storage, name: str, tracking=None) -> None:
        self.storage, self.name, self.tracking = storage, name, tracking
        self.reader = RunRecord(storage, name)
        self.launch = 0
        self._tb = None
        self._tb_dir = ""
        self._usage_steps: dict[int, int] = {}  # per rank: the samples written to TensorBoard

    def uri(self, *parts: str) -> str:
        return self.storage.uri_of(self.name, *parts)

    def tracked(self) -> str | None:
        """Where the run is tracked in MLflow (a summary's ``mlflow``); None when it is not."""
        return self.tracking.label() if self.tracking is not None and self.tracking.run_id else None

    def identity(self) -> dict[str, Any] | None:
        """run.json's content; None for a new run.

        Raises:
            UserError: run.json is damaged (it is never rewritten, so this is not ours to fix).
        """
        try:
            return self.reader.identity()
        except ValueError as exc:
            raise UserError(f"run {self.name}: {exc}", "restore it from a backup, or delete that file to start the "
                            "run's log anew (its checkpoints are kept), or choose another --name") from None

    def check_compatible(self, spec) -> dict[str, Any] | None:
        """The existing run's identity, if any; UserError when the spec cannot continue it."""
        ident = self.identity()
        if ident is None:
            return None
        for key in IDENTITY_KEYS:
            if ident.get(key) != getattr(spec, key):
                raise UserError(
                    f"run {self.name} already exists in {self.storage.uri} with {key} {ident.get(key)}, "
                    f"not {getattr(spec, key)}", "choose another --name to start a new run")
        return ident

    def begin(self, spec_dict: dict[str, Any]) -> int:
        """Record the start of a launch; returns its index (1 for the first)."""
        self.launch = len(self.reader.starts()) + 1
        if self.tracking is not None:  # a store that cannot be opened stops the launch before it is logged
            self.tracking.begin(self.launch, spec_dict)
        if self.launch == 1:
            self.storage.write_text(json.dumps({
                "name": self.name, "created": time.time(),
                **{k: spec_dict[k] for k in IDENTITY_KEYS}, "spec": spec_dict}, indent=1), self.name, RUN)
        self.storage.append_text(_line({
            "event": "start", "launch": self.launch, "time": time.time(), "host": socket.gethostname(),
            "pid": os.getpid(), "spec": spec_dict}), self.name, LAUNCHES)
        summary_writer_class()  # now, not at the first report while the workers train
        return self.launch

    def record(self, metrics: dict[str, Any], tensorboard: bool = True) -> None:
        """Append one metrics line and (``tensorboard``) the scalars to TensorBoard."""
        self.storage.append_text(_line({"launch": self.launch, "time": time.time(), **metrics}),
                                 self.name, METRICS)
        if self.tracking is not None:
            self.tracking.record(metrics)
        if not tensorboard:
            return
        writer = self._writer()
        step = int(metrics.get("global_step", 0))
        for key in ("loss", "accuracy", "train_loss", "samples_per_s", "peak_rss_mb_max", "peak_gpu_mb_max"):
            if isinstance(metrics.get(key), (int, float)):
                writer.add_scalar(key, metrics[key], step)
        for phase in TIME_PHASES:  # the epoch's share of training time per phase (launcher.worker.timing)
            if isinstance(metrics.get(f"time_{phase}"), (int, float)):
                writer.add_scalar(f"time/{phase}", metrics[f"time_{phase}"], step)
        writer.flush()
        self._sync_tensorboard()

    def record_usage(self, by_rank: dict[int, list[list[float]]]) -> None:
        """Append each rank's usage samples (launcher.worker.usage: time, CPU %, RSS and GPU figures)
        to ``usage.jsonl``, and to TensorBoard as ``usage/<figure>/rank<N>`` over wall time."""
        lines = [_line({"launch": self.launch, "rank": rank, **dict(zip(USAGE_FIELDS, sample))})
                 for rank, samples in sorted(by_rank.items()) for sample in samples]
        if not lines:
            return
        self.storage.append_text("".join(lines), self.name, USAGE)
        if self.tracking is not None:
            self.tracking.usage(by_rank)
        writer = self._writer()
        for rank, samples in by_rank.items():
            for sample in samples:
                values = dict(zip(USAGE_FIELDS, sample))
                self._usage_steps[rank] = self._usage_steps.get(rank, -1) + 1
                for key in USAGE_FIELDS[1:]:
                    if key.startswith("gpu") and not values[key]:
                        continue
                    writer.add_scalar(f"usage/{key}/rank{rank}", values[key], self._usage_steps[rank],
                                      walltime=values["time"])
        writer.flush()
        self._sync_tensorboard()

    def _writer(self):
        if self._tb is None:
            SummaryWriter = summary_writer_class()
            # Object stores cannot append: write locally, upload after each flush.
            self._tb_dir = (self.storage.path(self.name, TENSORBOARD) if self.storage.is_local
                            else tempfile.mkdtemp(prefix="launcher-tb-"))
            # A distinct suffix per launch: event files are never overwritten.
            self._tb = SummaryWriter(self._tb_dir, filename_suffix=f".launch{self.launch}")
        return self._tb

    def _sync_tensorboard(self) -> None:
        if self._tb is not None and not self.storage.is_local:
            self.storage.upload_dir(self._tb_dir, self.name, TENSORBOARD)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._tb is not None:
            self._tb.close()
            self._sync_tensorboard()
            self._tb = None
        self.storage.append_text(_line({"event": "end", "launch": self.launch, "time": time.time(),
                                        "summary": summary}), self.name, LAUNCHES)
        self.storage.write_text(json.dumps(summary, indent=1, sort_keys=True, default=str),
                                self.name, SUMMARY)
        if self.tracking is not None:
            self.tracking.summary(summary, self.launch)


def log_folder(launch: int | None) -> str:
    """The folder under ``<run>/logs/`` that holds a launch's rank logs."""
    return f"launch{launch}" if launch else "launch0"


def rank_log_name(started: float, attempt: str, rank: int) -> str:
    """A rank log's file name: when its worker group started (UTC), the group, the rank."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(started))}-{attempt[:6]}-rank{rank}.log"


class ProgramLines:
    """A program run's ranks' output, as the driver receives it, written to the same files a
    session run's workers write (``<run>/logs/launch<L>/``, one per rank and worker group):
    at once on a local folder, every :data:`FLUSH_S` seconds on gs:// (each write rewrites the object)."""

    FLUSH_S = 10.0

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self._names: dict[tuple[str, int], str] = {}
        self._waiting: dict[str, list[str]] = {}
        self._flushed = 0.0

    def add(self, attempt: str, rank: int, lines: list[str]) -> None:
        key = (attempt, rank)
        if key not in self._names:
            self._names[key] = rank_log_name(time.time(), attempt or "0", rank)
            self._waiting.setdefault(self._names[key], []).append(
                f"=== rank {rank}, worker group {attempt[:8]}, output as the driver received it ===")
        self._waiting.setdefault(self._names[key], []).extend(lines)

    def flush(self, force: bool = False) -> None:
        due = force or self.log.storage.is_local or time.monotonic() - self._flushed >= self.FLUSH_S
        if not self._waiting or not due:
            return
        self._flushed = time.monotonic()
        waiting, self._waiting = self._waiting, {}
        for name, lines in waiting.items():
            self.log.storage.append_text("".join(f"{line}\n" for line in lines), self.log.name, LOGS,
                                         log_folder(self.log.launch), name)


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded yet.

    tensorboardX's writer imports torch only to accept torch tensors, which the
    driver never passes it; loading torch there took 1.2 of the import's 1.55 s of
    CPU, on the driver, beside the workers. With ``sys.modules["torch"] = None``
    its ``import torch`` fails fast and it falls back to numpy (0.4 s). A torch that a user's
    file imported but has not used yet (:func:`workloads.user.defer_framework_imports`) counts as
    not loaded, and stays as it was.
    """
    from workloads.user import not_loaded_yet

    if "tensorboardX" in sys.modules or ("torch" in sys.modules and not not_loaded_yet("torch")):
        from tensorboardX import SummaryWriter

        return SummaryWriter
    saved = sys.modules.get("torch")  # a user's file's torch, not loaded until it is used
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            if saved is None:
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = saved
    return SummaryWriter

