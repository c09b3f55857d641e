"""``launcher runs``: the runs under a storage root, read from their run logs.

Each row shows the run's own metrics: the last epoch's for a workload or a training
function, whatever they are named (``val_loss``, ``acc``, ``perplexity``), the
latest value of each metric a program reported through hypertune, the best
trial's for a tuning run; the table's METRICS column picks the headline ones
(:func:`headline`). EPOCHS counts what was trained: the newest checkpoint's
epoch, a program's epochs by its reports, every trial's for a tuning run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import socket
from dataclasses import dataclass, field
from typing import Any

from launcher.measures import (format_memory, format_shares, format_usage, peak_memory, pick_metrics, program_epochs,
                               program_metrics, summarise_usage)
from launcher.storage.checkpoint import complete_checkpoints
from launcher.storage.runlog import RUN, SUMMARY, TUNING, RunRecord
from launcher.storage.store import Storage
from launcher.summary import USAGE_FIELDS, RunStatus, RunSummary, TuningSummary

# Metric name families, most telling first: a run's headline loss and accuracy (see headline()).
LOSS_NAMES = ("loss", "val_loss", "eval_loss", "test_loss", "valid_loss", "validation_loss", "train_loss")
ACCURACY_NAMES = ("accuracy", "val_accuracy", "acc", "val_acc", "eval_accuracy", "test_accuracy", "test_acc",
                  "train_accuracy", "train_acc")
HEADLINE = 2  # metrics the table shows per run


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
    strategy: str | None = None                       # --strategy (ddp, fsdp); None: a program's own
    epochs: int = 0                                   # epochs trained (a tuning run's: over its trials)
    metrics: dict[str, float] = field(default_factory=dict)  # the run's final metrics, by their own names
    checkpoint: str | None = None                     # the newest complete one
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # every complete one kept
    launches: int = 0
    restarts: int = 0
    preemptions: int = 0
    steps_lost: int = 0
    time_lost_s: float = 0.0
    interruptions: list[dict[str, Any]] = field(default_factory=list)
    # --strategy ft: the quorum changes over every launch, the seconds each cost its step, the replicas replaced
    quorum_changes: int = 0
    quorum_change_s: list[float] = field(default_factory=list)
    replicas_replaced: int = 0
    wall_s: float = 0.0
    # Each worker's peak memory over the run's epochs, by rank (MiB; see launcher.measures.peak_memory).
    peak_rss_mb_max: float | None = None
    peak_rss_mb_ranks: list[float] = field(default_factory=list)
    peak_gpu_mb_max: float | None = None
    peak_gpu_mb_ranks: list[float] = field(default_factory=list)
    # Each worker's CPU, memory and GPU over every launch (usage.jsonl; launcher.measures.summarise_usage),
    # and where the last launch that measured it spent its training time.
    usage: list[dict[str, Any]] = field(default_factory=list)
    time_shares: dict[str, float] = field(default_factory=dict)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None
    mlflow: str | None = None                         # where it is tracked (--mlflow), as its last launch said
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


def _status(launches: list[dict[str, Any]], summary: RunSummary | None) -> RunStatus:
    """The last launch's status; a launch with no end is running or was interrupted."""
    if not launches:
        return RunStatus.PENDING
    last = launches[-1]
    if last.get("event") == "end":
        said = last.get("summary")  # summary.json: the same summary, unless this line lost it
        return RunStatus.parse(said.get("status")) if said else summary.status if summary else RunStatus.UNKNOWN
    if last.get("host") == socket.gethostname() and not pid_alive(int(last.get("pid", 0))):
        return RunStatus.INTERRUPTED
    return RunStatus.RUNNING


def describe_run(storage: Storage, name: str) -> RunRow | None:
    """The run ``name``'s row (a tuning run's too); None when the folder is neither."""
    record = RunRecord(storage, name)
    try:
        info = record.identity()
    except ValueError:
        return damaged(name, f"{RUN} is damaged")
    if info is None:
        return describe_tuning(storage, name)
    launches, lines = record.launches(), record.metrics()
    checkpoints = complete_checkpoints(storage, name)
    reported = [m for m in lines if m.get("source") == "hypertune"]  # a script's or package's run
    if reported:
        epochs, shown = program_epochs(reported), program_metrics(reported)
    else:
        epochs, shown = final_metrics(lines)
    if checkpoints:
        epochs = checkpoints[-1][0].epoch
    ends = record.summaries(launches)
    timed = [e for e in ends if e.time_shares]
    samples: dict[int, list[list[float]]] = {}
    for u in record.usage():
        if isinstance(u.get("rank"), int):
            samples.setdefault(u["rank"], []).append([float(u.get(f) or 0.0) for f in USAGE_FIELDS])
    return RunRow(
        name=name, status=_status(launches, record.summary()), workload=info.get("workload") or "?",
        framework=info.get("framework") or "?", strategy=_strategy(info, ends), epochs=epochs, metrics=shown,
        checkpoint=storage.to_uri(checkpoints[-1][1]) if checkpoints else None,
        checkpoints=[{"epoch": m.epoch, "step": m.global_step, "uri": storage.to_uri(path)}
                     for m, path in checkpoints],
        launches=sum(1 for e in launches if e.get("event") == "start"),
        restarts=sum(e.restarts for e in ends),
        preemptions=sum(e.preemptions for e in ends),
        steps_lost=sum(e.steps_lost for e in ends),
        time_lost_s=round(sum(e.time_lost_s for e in ends), 1),
        interruptions=[dataclasses.asdict(i) for e in ends for i in e.interruptions],
        quorum_changes=sum(e.quorum_changes for e in ends),
        quorum_change_s=[x for e in ends for x in e.quorum_change_s],
        replicas_replaced=sum(e.replicas_replaced for e in ends),
        wall_s=round(sum(e.wall_s for e in ends), 1),
        # the epochs' reports: a launch still running, or cut off before its summary, counts too
        **peak_memory(m for m in lines if m.get("kind") == "epoch"),
        usage=summarise_usage(samples),
        time_shares=timed[-1].time_shares if timed else {}, stragglers=timed[-1].stragglers if timed else [],
        mlflow=next((e.mlflow for e in reversed(ends) if e.mlflow), None),
    )


def _strategy(info: dict[str, Any], ends: list[RunSummary]) -> str | None:
    """The strategy the last launch's summary names; before any has ended, the run's spec's
    (a program's none: it keeps its own model in step)."""
    said = [e.strategy for e in ends if e.strategy]
    spec = info.get("spec") if isinstance(info.get("spec"), dict) else {}
    return said[-1] if said else None if "program" in spec else spec.get("strategy")


def final_metrics(lines: list[dict[str, Any]]) -> tuple[int, dict[str, float]]:
    """(the last epoch reached, the run's final metrics) from a run's metrics.jsonl: the last
    epoch's row (its evaluation), else the last row with an epoch (a mid-epoch checkpoint's)."""
    rows = [m for m in lines if "epoch" in m]
    if not rows:
        return 0, {}
    epochs = [m for m in rows if m.get("kind") == "epoch"]
    last = (epochs or rows)[-1]
    return int(rows[-1].get("epoch") or 0), pick_metrics(last)


def describe_tuning(storage: Storage, name: str) -> RunRow | None:
    """A tuning run's row (None: the folder is not a tuning run either)."""
    record = RunRecord(storage, name)
    try:
        info = record.tuning()
        summary = record.tuning_summary() if info is not None else None
    except ValueError:
        return damaged(name, f"{TUNING} or {SUMMARY} is damaged")
    if info is None:
        return None
    spec = info.get("spec") or {}
    program = info.get("program")
    row = RunRow(name=name, status=RunStatus.UNKNOWN, kind="tuning", framework=spec.get("framework", "?"),
                 workload="tuning:" + (f"{program['kind']}:{program['target']}" if program
                                       else spec.get("workload", "?")))
    trials = trial_rows(storage, name)
    row.epochs = sum(t.epochs for t in trials.values())
    if summary is None:  # no launch has ended: one runs now, or the last was cut off
        row.status = RunStatus.RUNNING if record.lock() is not None else RunStatus.INTERRUPTED
        return row
    best = summary.best
    row.status = summary.status
    row.wall_s = float(summary.wall_s or 0.0)
    row.trials = summary.trials.total
    row.best, row.metric = (best.to_json() if best else {}), summary.metric
    if best is not None:
        trial = trials.get(posixpath.basename(best.run_dir.rstrip("/"))) if best.run_dir else None
        row.metrics = {**(trial.metrics if trial else {}), best.metric: best.value}
        row.note = f"best {best.metric} {best.value:.4f} ({best.trial}), {row.trials} trial(s)"
    return row


def trial_rows(storage: Storage, name: str) -> dict[str, RunRow]:
    """The rows of a tuning run's trials (runs of their own, in its folder), by run name."""
    try:
        inner = Storage.resolve(storage.uri_of(name))
        rows = (describe_run(inner, trial) for trial in inner.list_dirs())
        return {r.name: r for r in rows if r is not None and r.status != RunStatus.UNREADABLE}
    except OSError:
        return {}


def damaged(name: str, why: str) -> RunRow:
    """The row of a run whose log cannot be read: listed, marked, never a reason to fail the list."""
    return RunRow(name=name, status=RunStatus.UNREADABLE, note=why)


def list_runs(storage: Storage) -> list[RunRow]:
    runs = [describe_run(storage, name) for name in storage.list_dirs()]
    return [r for r in runs if r is not None]


def headline(metrics: dict[str, float], most: int = HEADLINE) -> dict[str, float]:
    """The metrics a run is judged by, under their own names: its loss (``loss``, else
    ``val_loss``, ... ``train_loss``, else any ``*loss``) and its accuracy (``accuracy``,
    ``val_accuracy``, ``acc``, ... else any ``*acc*``), then its other metrics in the order
    reported (``perplexity``, ``auc``, ``mae``), ``most`` in all."""
    def first(names: tuple[str, ...], like) -> str | None:
        return next((n for n in names if n in metrics), None) or next((n for n in metrics if like(n)), None)

    picked = [n for n in (first(LOSS_NAMES, lambda n: n.endswith("loss")),
                          first(ACCURACY_NAMES, lambda n: "acc" in n and not n.endswith("loss"))) if n is not None]
    picked += [n for n in metrics if n not in picked and not n.endswith("loss")]
    picked += [n for n in metrics if n not in picked]
    return {n: metrics[n] for n in picked[:most]}


def format_value(value: float) -> str:
    """Four decimals, or four significant digits for the very large and the very small."""
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.4g}"


def format_metrics(metrics: dict[str, float]) -> str:
    """"val_loss 0.3120  acc 0.8812": a run's headline metrics by name; "-" for none."""
    return "  ".join(f"{k} {format_value(v)}" for k, v in headline(metrics).items()) or "-"


def format_table(runs: list[RunRow]) -> str:
    if not runs:
        return "no runs"
    header = ("NAME", "STATUS", "WORKLOAD", "EPOCHS", "METRICS", "WALL", "RESTARTS", "LOST", "LAST CHECKPOINT")
    rows = [header]
    for r in runs:
        trained = "/".join(filter(None, (r.workload, r.framework, r.strategy)))
        rows.append((r.name, str(r.status), trained, str(r.epochs), format_metrics(r.metrics),
                     f"{r.wall_s:.0f}s", format_restarts(r), format_lost(r),
                     r.note or "-" if r.kind == "tuning" else os.path.basename(r.checkpoint or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def format_run(run: RunRow) -> str:
    """One run (``launcher runs NAME``): its row of the table, each worker's peak memory, then the
    complete checkpoints its folder keeps, oldest first (what --keep-checkpoints left)."""
    lines = [format_table([run])]
    memory = format_memory(vars(run))
    if memory:
        lines.append(memory)
    if run.quorum_changes or run.replicas_replaced:
        lines.append(format_quorums(run.quorum_changes, run.quorum_change_s, run.replicas_replaced))
    if run.time_shares:
        lines.append(format_shares(run.time_shares, run.stragglers) + " (the last launch)")
    if run.usage:
        lines.append("usage per worker, all launches:")
        lines.extend(f"  {line}" for line in format_usage(run.usage))
    if run.kind != "tuning":
        kept = run.checkpoints
        lines.append(f"checkpoints kept: {len(kept)}" + ("" if kept else " (none complete)"))
        lines.extend(f"  epoch {c['epoch']}, step {c['step']}: {c['uri']}" for c in kept)
    if run.mlflow:
        lines.append(f"mlflow: {run.mlflow}")
    return "\n".join(lines)


def format_restarts(r: RunRow) -> str:
    """"3 (2 preempted)": restarts in all, how many of them preemptions; under --strategy ft, the
    quorum changes that stood in for restarts."""
    quorums = f" ({r.quorum_changes} quorum changes)" if r.quorum_changes else ""
    if not r.restarts:
        return "0" + quorums
    return f"{r.restarts} ({r.preemptions} preempted)" + quorums


def format_quorums(changes: int, seconds: list[float], replaced: int) -> str:
    """--strategy ft's line: the quorum changes, the seconds their steps' quorums took (each, and in
    all), the replicas Ray Train replaced alone."""
    each = "/".join(f"{x:.2f}s" for x in seconds)
    return (f"quorum changes {changes} ({sum(seconds):.1f}s for their steps' quorums" + (f": {each}" if each else "")
            + f"), replicas replaced {replaced}, no restart of the others")


def format_lost(r: RunRow) -> str:
    """Steps and seconds lost in all, then the seconds lost to each interruption."""
    if not r.restarts:
        return "-"
    gone = r.interruptions
    if gone and all("steps_lost" in i and i["steps_lost"] is None for i in gone):
        return "unknown (the program resumes itself)"
    each = "/".join(f"{float(i.get('time_lost_s') or 0):.0f}s" for i in gone)
    return f"{r.steps_lost} steps, {r.time_lost_s:.0f}s" + (f" [{each}]" if each else "")


# -- comparing runs and plotting their metrics (launcher runs --compare / --plot) ------------------

def series(rows: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """(step, value) of ``metric`` over the rows, by step; a step reported twice (a resumed
    launch's report of a step it redid, an epoch's end and a checkpoint at one step) keeps the last."""
    by_step: dict[int, float] = {}
    for m in rows:
        v = m.get(metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            by_step[int(m["global_step"])] = float(v)
    return sorted(by_step.items())


def plottable(rows: list[dict[str, Any]]) -> list[str]:
    """The metrics a run reported (numbers, the model's first), for an error that lists them."""
    seen: dict[str, None] = {}
    for m in rows:
        seen.update(dict.fromkeys(pick_metrics(m)))
    return list(seen)


def differing(specs: dict[str, dict[str, Any]], always: tuple[str, ...] = ("workload",)) -> list[str]:
    """The spec keys whose values differ between the runs (and ``always``), in the spec's order;
    the run name and storage are left out: they differ by definition."""
    keys: dict[str, None] = dict.fromkeys(always)
    for spec in specs.values():
        keys.update(dict.fromkeys(spec))
    return [k for k in keys if k not in ("name", "storage") and
            (k in always or len({json.dumps(s.get(k), sort_keys=True, default=str) for s in specs.values()}) > 1)]


def format_comparison(runs: dict[str, RunRow], specs: dict[str, dict[str, Any]]) -> str:
    """Params that differ and final metrics, one column per run."""
    names = list(runs)
    rows = [["", *names]]
    rows += [[k, *(_short(specs[n].get(k)) for n in names)] for k in differing(specs)]
    metrics: dict[str, None] = {}
    for r in runs.values():
        metrics.update(dict.fromkeys(r.metrics))
    rows += [[m, *(format_value(runs[n].metrics[m]) if m in runs[n].metrics else "-" for n in names)]
             for m in metrics]
    rows += [["status", *(str(runs[n].status) for n in names)], ["epochs", *(str(runs[n].epochs) for n in names)],
             ["wall", *(f"{runs[n].wall_s:.0f}s" for n in names)]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
