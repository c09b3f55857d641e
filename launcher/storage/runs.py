"""``launcher runs``: the runs under a storage root, read from their run logs."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from launcher.storage.checkpoint import complete_checkpoints
from launcher.storage.runlog import read_jsonl
from launcher.summary import RunStatus
from launcher.storage.store import Storage

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


def _status(launches: list[dict[str, Any]], summary: dict[str, Any] | None) -> str:
    """The last launch's status; a launch with no end is running or was interrupted."""
    if not launches:
        return str(RunStatus.PENDING)
    last = launches[-1]
    if last.get("event") == "end":
        return (last.get("summary") or summary or {}).get("status", "unknown")
    if last.get("host") == socket.gethostname() and not pid_alive(int(last.get("pid", 0))):
        return str(RunStatus.INTERRUPTED)
    return str(RunStatus.RUNNING)


def describe_run(storage: Storage, name: str) -> dict[str, Any] | None:
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
    ends = [e.get("summary") or {} for e in launches if e.get("event") == "end"]
    wall = sum(float(e.get("wall_s", 0.0)) for e in ends)
    interruptions = [i for e in ends for i in e.get("interruptions") or []]
    return {
        "name": name, "status": _status(launches, summary), "workload": info.get("workload"),
        "framework": info.get("framework"),
        "epochs": checkpoints[-1][0].epoch if checkpoints else last_metrics.get("epoch", 0),
        "metrics": shown,
        "checkpoint": storage.to_uri(checkpoints[-1][1]) if checkpoints else None,
        "checkpoints": [{"epoch": m.epoch, "step": m.global_step, "uri": storage.to_uri(path)}
                        for m, path in checkpoints],
        "launches": sum(1 for e in launches if e.get("event") == "start"),
        "restarts": sum(int(e.get("restarts", 0)) for e in ends),
        "preemptions": sum(int(e.get("preemptions", 0)) for e in ends),
        "steps_lost": sum(int(e.get("steps_lost", 0)) for e in ends),
        "time_lost_s": round(sum(float(e.get("time_lost_s", 0.0)) for e in ends), 1),
        "interruptions": interruptions,
        "wall_s": round(wall, 1),
    }


def describe_tuning(storage: Storage, name: str) -> dict[str, Any] | None:
    """A tuning run's row (None: the folder is not a tuning run either)."""
    definition = storage.read_text(name, TUNING_FILE)
    if definition is None:
        return None
    try:
        info = json.loads(definition)
        text = storage.read_text(name, TUNING_SUMMARY)
        summary = json.loads(text) if text else None
    except ValueError:
        return damaged(name, f"{TUNING_FILE} or {TUNING_SUMMARY} is damaged")
    spec = info.get("spec") or {}
    program = info.get("program")
    row = damaged(name, "")
    row.update(workload="tuning:" + (f"{program['kind']}:{program['target']}" if program else spec.get("workload", "?")),
               framework=spec.get("framework", "?"), kind="tuning", note=None)
    if summary is None:
        lock = storage.read_text(name, "launch.lock")
        row["status"] = str(RunStatus.RUNNING) if lock else "not finished"
        return row
    best = summary.get("best") or {}
    metric = summary.get("metric")
    row.update(status=summary.get("status", "unknown"), wall_s=float(summary.get("wall_s") or 0.0),
               trials=(summary.get("trials") or {}).get("total", 0), best=best, metric=metric)
    if metric in best:
        row["metrics"] = {metric: best[metric]}
        row["note"] = f"best {metric} {best[metric]:.4f} ({best.get('trial')}), {row['trials']} trial(s)"
    return row


def damaged(name: str, why: str) -> dict[str, Any]:
    """The row of a run whose log cannot be read: listed, marked, never a reason to fail the list."""
    return {"name": name, "status": "unreadable", "note": why, "workload": "?", "framework": "?", "epochs": 0,
            "metrics": {}, "checkpoint": None, "checkpoints": [], "launches": 0, "restarts": 0, "preemptions": 0,
            "steps_lost": 0, "time_lost_s": 0.0, "interruptions": [], "wall_s": 0.0}


def list_runs(storage: Storage) -> list[dict[str, Any]]:
    runs = [describe_run(storage, name) for name in storage.list_dirs()]
    return [r for r in runs if r is not None]


def format_table(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "no runs"
    header = ("NAME", "STATUS", "WORKLOAD", "EPOCHS", "LOSS", "ACC", "WALL", "RESTARTS", "LOST", "LAST CHECKPOINT")
    rows = [header]
    for r in runs:
        m = r["metrics"]
        rows.append((r["name"], r["status"], f"{r['workload']}/{r['framework']}", str(r["epochs"]),
                     f"{m['loss']:.4f}" if "loss" in m else "-", f"{m['accuracy']:.4f}" if "accuracy" in m else "-",
                     f"{r['wall_s']:.0f}s", format_restarts(r), format_lost(r),
                     r.get("note") or "-" if r.get("kind") == "tuning" else os.path.basename(r["checkpoint"] or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def format_run(run: dict[str, Any]) -> str:
    """One run (``launcher runs NAME``): its row of the table, then the complete checkpoints
    its folder keeps, oldest first (what --keep-checkpoints left)."""
    kept = run.get("checkpoints") or []
    lines = [format_table([run])]
    if run.get("kind") != "tuning":
        lines.append(f"checkpoints kept: {len(kept)}" + ("" if kept else " (none complete)"))
        lines.extend(f"  epoch {c['epoch']}, step {c['step']}: {c['uri']}" for c in kept)
    return "\n".join(lines)


def format_restarts(r: dict[str, Any]) -> str:
    """"3 (2 preempted)": restarts in all, how many of them preemptions."""
    if not r.get("restarts"):
        return "0"
    return f"{r['restarts']} ({r.get('preemptions', 0)} preempted)"


def format_lost(r: dict[str, Any]) -> str:
    """Steps and seconds lost in all, then the seconds lost to each interruption."""
    if not r.get("restarts"):
        return "-"
    gone = r.get("interruptions") or []
    if gone and all("steps_lost" in i and i["steps_lost"] is None for i in gone):
        return "unknown (the program resumes itself)"
    each = "/".join(f"{float(i.get('time_lost_s') or 0):.0f}s" for i in r.get("interruptions") or [])
    return f"{r.get('steps_lost', 0)} steps, {r.get('time_lost_s', 0.0):.0f}s" + (f" [{each}]" if each else "")
