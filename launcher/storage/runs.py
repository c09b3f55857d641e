"""``launcher runs``: the runs under a storage root, read from their run logs."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from launcher.storage.checkpoint import complete_checkpoints
from launcher.storage.runlog import read_jsonl
from launcher.storage.store import Storage
from launcher.summary import RunStatus, RunSummary, TuningSummary

TUNING_FILE = "tuning.json"      # a tuning run's folder holds this (its definition) instead of run.json
TUNING_SUMMARY = "summary.json"  # and, once a launch ends, its summary


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunRow:
    """One run (or tuning run) as ``launcher runs`` lists it, read from its run log."""

    name: str
    status: RunStatus
    workload: str = "?"
    framework: str = "?"
    epochs: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None                     # the newest complete one
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # every complete one kept
    launches: int = 0
    restarts: int = 0
    preemptions: int = 0
    steps_lost: int = 0
    time_lost_s: float = 0.0
    interruptions: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    note: str | None = None
    kind: str = "run"                                 # or "tuning"
    trials: int | None = None                         # a tuning run's
    best: dict[str, Any] | None = None
    metric: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the status as its string; a plain run's tuning fields left out)."""
        out = dataclasses.asdict(self)
        out["status"] = str(self.status)
        if self.kind != "tuning":
            for key in ("kind", "trials", "best", "metric"):
                out.pop(key)
        return out


def _status(launches: list[dict[str, Any]], summary: dict[str, Any] | None) -> RunStatus:
    """The last launch's status; a launch with no end is running or was interrupted."""
    if not launches:
        return RunStatus.PENDING
    last = launches[-1]
    if last.get("event") == "end":
        return RunStatus.parse((last.get("summary") or summary or {}).get("status"))
    if last.get("host") == socket.gethostname() and not pid_alive(int(last.get("pid", 0))):
        return RunStatus.INTERRUPTED
    return RunStatus.RUNNING


def _summaries(launches: list[dict[str, Any]]) -> list[RunSummary]:
    """The summaries the run log's launches ended with (unreadable ones left out)."""
    out = []
    for e in launches:
        if e.get("event") == "end" and isinstance(e.get("summary"), dict):
            try:
                out.append(RunSummary.from_json(e["summary"]))
            except (ValueError, TypeError):
                continue
    return out


def describe_run(storage: Storage, name: str) -> RunRow | None:
    """The run ``name``'s row (a tuning run's too); None when the folder is neither."""
    ident = storage.read_text(name, "run.json")
    if ident is None:
        return describe_tuning(storage, name)
    try:
        info = json.loads(ident)
        if not isinstance(info, dict):
            raise ValueError("not an object")
    except ValueError:
        return damaged(name, "run.json is damaged")
    launches = read_jsonl(storage.read_text(name, "launches.jsonl"))
    summary_text = storage.read_text(name, "summary.json")
    try:
        summary = json.loads(summary_text) if summary_text else None
    except ValueError:
        summary = None  # launches.jsonl has every summary too
    lines = read_jsonl(storage.read_text(name, "metrics.jsonl"))
    metrics = [m for m in lines if "epoch" in m]
    checkpoints = complete_checkpoints(storage, name)
    last_metrics = metrics[-1] if metrics else {}
    reported = [m for m in lines if m.get("source") == "hypertune"]  # a script's or package's run
    shown = {k: last_metrics[k] for k in ("loss", "accuracy") if k in last_metrics}
    if reported:
        shown = {k: v for k, v in reported[-1].items()
                 if k not in ("launch", "time", "source", "timestamp", "trial", "global_step", "checkpoint_path")
                 and isinstance(v, (int, float))}
    ends = _summaries(launches)
    return RunRow(
        name=name, status=_status(launches, summary), workload=info.get("workload") or "?",
        framework=info.get("framework") or "?",
        epochs=checkpoints[-1][0].epoch if checkpoints else last_metrics.get("epoch", 0),
        metrics=shown,
        checkpoint=storage.to_uri(checkpoints[-1][1]) if checkpoints else None,
        checkpoints=[{"epoch": m.epoch, "step": m.global_step, "uri": storage.to_uri(path)}
                     for m, path in checkpoints],
        launches=sum(1 for e in launches if e.get("event") == "start"),
        restarts=sum(e.restarts for e in ends),
        preemptions=sum(e.preemptions for e in ends),
        steps_lost=sum(e.steps_lost for e in ends),
        time_lost_s=round(sum(e.time_lost_s for e in ends), 1),
        interruptions=[dataclasses.asdict(i) for e in ends for i in e.interruptions],
        wall_s=round(sum(e.wall_s for e in ends), 1),
    )


def describe_tuning(storage: Storage, name: str) -> RunRow | None:
    """A tuning run's row (None: the folder is not a tuning run either)."""
    definition = storage.read_text(name, TUNING_FILE)
    if definition is None:
        return None
    try:
        info = json.loads(definition)
        text = storage.read_text(name, TUNING_SUMMARY)
        summary = TuningSummary.from_json(json.loads(text)) if text else None
    except ValueError:
        return damaged(name, f"{TUNING_FILE} or {TUNING_SUMMARY} is damaged")
    spec = info.get("spec") or {}
    program = info.get("program")
    row = RunRow(name=name, status=RunStatus.UNKNOWN, kind="tuning", framework=spec.get("framework", "?"),
                 workload="tuning:" + (f"{program['kind']}:{program['target']}" if program
                                       else spec.get("workload", "?")))
    if summary is None:  # no launch has ended: one runs now, or the last was cut off
        row.status = RunStatus.RUNNING if storage.read_text(name, "launch.lock") else RunStatus.INTERRUPTED
        return row
    best = summary.best
    row.status = summary.status
    row.wall_s = float(summary.wall_s or 0.0)
    row.trials = summary.trials.total
    row.best, row.metric = (best.to_json() if best else {}), summary.metric
    if best is not None:
        row.metrics = {best.metric: best.value}
        row.note = f"best {best.metric} {best.value:.4f} ({best.trial}), {row.trials} trial(s)"
    return row


def damaged(name: str, why: str) -> RunRow:
    """The row of a run whose log cannot be read: listed, marked, never a reason to fail the list."""
    return RunRow(name=name, status=RunStatus.UNREADABLE, note=why)


def list_runs(storage: Storage) -> list[RunRow]:
    runs = [describe_run(storage, name) for name in storage.list_dirs()]
    return [r for r in runs if r is not None]


def format_table(runs: list[RunRow]) -> str:
    if not runs:
        return "no runs"
    header = ("NAME", "STATUS", "WORKLOAD", "EPOCHS", "LOSS", "ACC", "WALL", "RESTARTS", "LOST", "LAST CHECKPOINT")
    rows = [header]
    for r in runs:
        m = r.metrics
        rows.append((r.name, str(r.status), f"{r.workload}/{r.framework}", str(r.epochs),
                     f"{m['loss']:.4f}" if "loss" in m else "-", f"{m['accuracy']:.4f}" if "accuracy" in m else "-",
                     f"{r.wall_s:.0f}s", format_restarts(r), format_lost(r),
                     r.note or "-" if r.kind == "tuning" else os.path.basename(r.checkpoint or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def format_run(run: RunRow) -> str:
    """One run (``launcher runs NAME``): its row of the table, then the complete checkpoints
    its folder keeps, oldest first (what --keep-checkpoints left)."""
    lines = [format_table([run])]
    if run.kind != "tuning":
        kept = run.checkpoints
        lines.append(f"checkpoints kept: {len(kept)}" + ("" if kept else " (none complete)"))
        lines.extend(f"  epoch {c['epoch']}, step {c['step']}: {c['uri']}" for c in kept)
    return "\n".join(lines)


def format_restarts(r: RunRow) -> str:
    """"3 (2 preempted)": restarts in all, how many of them preemptions."""
    if not r.restarts:
        return "0"
    return f"{r.restarts} ({r.preemptions} preempted)"


def format_lost(r: RunRow) -> str:
    """Steps and seconds lost in all, then the seconds lost to each interruption."""
    if not r.restarts:
        return "-"
    gone = r.interruptions
    if gone and all("steps_lost" in i and i["steps_lost"] is None for i in gone):
        return "unknown (the program resumes itself)"
    each = "/".join(f"{float(i.get('time_lost_s') or 0):.0f}s" for i in gone)
    return f"{r.steps_lost} steps, {r.time_lost_s:.0f}s" + (f" [{each}]" if each else "")
