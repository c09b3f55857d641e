"""A tuning run's results: one row per trial, the best trial, and the files they go to.

In the tuning run's folder: ``trials.json`` (the summary and every row),
``trials.csv`` (the rows), ``tuning.png`` (the metric per trial, and the metric
against each parameter) and ``summary.json`` (what ``launcher runs`` lists).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import time
from typing import Any

from launcher import schema
from launcher.storage.runlog import SUMMARY, RunRecord
from launcher.storage.tracking import Tracking, check_store_reach
from launcher.storage.tracking_values import params_of
from launcher.summary import BestTrial, RunStatus, TrialCounts, TuningSummary
from launcher.tune.trial import trial_name

SUCCEEDED, STOPPED, FAILED, UNFINISHED = "succeeded", "stopped early", "failed", "not finished"
PENDING = "pending"  # never started: Ray Tune runs it on the next launch
STATUSES = (SUCCEEDED, STOPPED, FAILED, UNFINISHED, PENDING)


def error_line(trial) -> str:
    """A failed trial's error in one line: the TrialFailed message when there is one."""
    try:
        error = trial.get_error()
    except Exception:  # noqa: BLE001 - the error file may be gone
        error = None
    text = str(error or "unknown error")
    for line in reversed(text.splitlines()):
        if "TrialFailed:" in line:
            return line.split("TrialFailed:", 1)[1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "unknown error"


def trial_status(study, storage, trial, tally=None) -> str:
    """What the trial did, across launches: succeeded, stopped early, failed, not finished or pending.

    Ray Tune's status says little: it marks a trial its scheduler stopped as terminated, like
    one that ended, and after an interrupt every trial it had asked an actor for, started or
    not, as terminated too (its saved state has them running or pending: the next launch runs
    them). So, in this order:

    - failed: Tune saw the trial fail;
    - succeeded: the trial's own run says so in its summary (only a run that trained to its
      end does), whatever an earlier launch's table said;
    - stopped early: ASHA stopped it (``tally.stopped``: this launch's decisions, and those
      an earlier launch's table recorded);
    - pending: it never started: not in this launch (``tally.started``), and it has no run
      of its own from an earlier one;
    - not finished: it started and did not end (interrupted: it resumes next time), or the
      whole search was stopped while it ran.
    """
    if trial.status == "ERROR":
        return FAILED
    name = trial_name(trial.trial_id)
    record = RunRecord(storage, study.name, name)
    summary = record.summary()
    if summary is not None and summary.status == SUCCEEDED:
        return SUCCEEDED
    if tally is not None and trial.trial_id in tally.stopped:
        return STOPPED
    started = tally is not None and trial.trial_id in tally.started
    if not started and not record.exists():
        return PENDING
    return UNFINISHED


def earlier_rows(storage, name: str) -> list[dict[str, Any]]:
    """The rows the last launch of this tuning run wrote to trials.json (none: no launch
    wrote one, or it is damaged)."""
    text = storage.read_text(name, "trials.json")
    try:
        content = json.loads(text) if text else {}
    except ValueError:
        return []
    table = content.get("trials") if isinstance(content, dict) else None
    if not isinstance(table, list):
        return []
    return [r for r in table if isinstance(r, dict) and isinstance(r.get("trial"), str)]


def earlier_stops(study, table: list[dict[str, Any]]) -> set[str]:
    """The trials an earlier launch's rows list as stopped early by ASHA (Ray Tune's saved
    state does not keep the scheduler's decisions). None without ASHA, and only trials that
    reported: ASHA stops a trial on one of its results (launches before "pending" existed
    labelled trials that never started as stopped early)."""
    if not study.hp.enableTrialEarlyStopping:
        return set()
    count = "epochs" if study.program is None else "reports"
    return {r["trial"] for r in table
            if r.get("status") == STOPPED and isinstance(r.get(count), int) and r[count] > 0}


def rows(study, trials: list, storage, tally=None) -> list[dict[str, Any]]:
    """One row per trial, in the order Ray Tune created them."""
    metric = study.metric()
    out = []
    for number, trial in enumerate(trials, 1):
        last = trial.last_result or {}
        status = trial_status(study, storage, trial, tally)
        value = last.get(metric)
        name = trial_name(trial.trial_id)
        row = {"number": number, "trial": name, "status": status, **study.hp.values(trial.config),
               metric: float(value) if isinstance(value, (int, float)) else None,
               "epochs" if study.program is None else "reports":
                   int(last.get("epoch" if study.program is None else "training_iteration") or 0),
               "wall_s": round(float(last.get("time_total_s") or 0.0), 1),
               "run_dir": storage.uri_of(study.name, name),
               "error": error_line(trial) if status == FAILED else None}
        out.append(row)
    return out


def best(study, table: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the best metric among the trials that reported it (ties: the earlier trial)."""
    metric = study.metric()
    scored = [r for r in table if r.get(metric) is not None and r["status"] in (SUCCEEDED, STOPPED)]
    if not scored:
        return None
    sign = 1 if study.hp.mode == "max" else -1
    return max(scored, key=lambda r: (sign * r[metric], -r["number"]))


def track(study, storage, note) -> Tracking | None:
    """The tuning run's MLflow run (``--mlflow``), started: the parent of its trials' runs, which
    find it in the tuning run's folder (:mod:`launcher.storage.tracking`)."""
    if not study.spec.mlflow:
        return None
    check_store_reach(study.spec.mlflow, study.spec.address or os.environ.get("RAY_ADDRESS"),
                      "the trials run on the cluster's nodes")
    tracking = Tracking(study.spec.mlflow, storage, study.name, note)
    definition = {"goal": study.hp.goal, "metric": study.metric(), "maxTrials": study.hp.maxTrials,
                  "maxParallelTrials": study.hp.maxParallelTrials, "algorithm": study.hp.algorithm,
                  "early_stopping": study.hp.enableTrialEarlyStopping,
                  "hyperparameters": [schema.to_mapping(p) for p in study.hp.params]}
    params = {**params_of(study.spec.to_dict()), **params_of({f"tuning.{k}": v for k, v in definition.items()})}
    tracking.start(None, params, {"launcher.kind": "tuning", "launcher.workload": study.spec.workload})
    return tracking


def _tracked(tracking: Tracking, summary: TuningSummary) -> None:
    """The tuning run's end in MLflow: the best value, the trial counts, the result files."""
    figures = {f"trials/{k}": float(v) for k, v in dataclasses.asdict(summary.trials).items()}
    if summary.best is not None and isinstance(summary.best.value, (int, float)):
        figures[f"best/{summary.metric}"] = float(summary.best.value)
        tracking.tags({"launcher.best_trial": summary.best.trial})
    tracking.metrics(figures, 0)
    tracking.text(json.dumps(summary.to_json(), indent=1, sort_keys=True, default=str), "launcher/summary.json")
    for name in ("trials.csv", "tuning.png"):
        tracking.artifacts(name)
    tracking.end(summary.status)


def write(study, storage, table: list[dict[str, Any]], *, started: float, interrupted: bool,
          stopped: str | None, tracking: Tracking | None = None) -> TuningSummary:
    """Write the result files (and end the tuning run's MLflow run); returns the summary (also in
    summary.json)."""
    metric = study.metric()
    top = best(study, table)
    counts = {s.replace(" ", "_"): sum(1 for r in table if r["status"] == s) for s in STATUSES}
    if interrupted:
        status, note = RunStatus.CANCELLED, "interrupted; launch again with the same --name to go on"
    elif stopped:
        status, note = RunStatus.FAILED, stopped
    elif top is None:
        status, note = RunStatus.FAILED, "no trial reported the metric"
    else:
        status, note = RunStatus.SUCCEEDED, None
    best_out = None
    if top is not None:
        run = RunRecord(storage, study.name, top["trial"]).summary()
        best_out = BestTrial(trial=top["trial"], metric=metric, value=top[metric],
                             params={p.parameterName: top[p.parameterName] for p in study.hp.params},
                             run_dir=top["run_dir"], model=run.model if run is not None else None)
    files = {kind: storage.uri_of(study.name, f) for kind, f in
             (("json", "trials.json"), ("csv", "trials.csv"), ("plot", "tuning.png"))}
    summary = TuningSummary(
        name=study.name, status=status, note=note, goal=study.hp.goal, metric=metric,
        algorithm=study.hp.algorithm, early_stopping=study.hp.enableTrialEarlyStopping,
        max_trials=study.hp.maxTrials, trials=TrialCounts(total=len(table), **counts), best=best_out,
        wall_s=round(time.time() - started, 1),
        workload=study.program.label if study.program is not None else study.spec.workload,
        run_dir=storage.uri_of(study.name), files=files,
        mlflow=tracking.label() if tracking is not None else None)
    storage.write_text(json.dumps({"summary": summary.to_json(), "trials": table}, indent=1, default=str),
                       study.name, "trials.json")
    storage.write_text(to_csv(table), study.name, "trials.csv")
    storage.write_bytes(plot(study, table, top), study.name, "tuning.png")
    storage.write_text(json.dumps(summary.to_json(), indent=1, default=str), study.name, SUMMARY)
    if tracking is not None:
        _tracked(tracking, summary)
    return summary


def to_csv(table: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = list(table[0]) if table else ["trial"]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(table)
    return buf.getvalue()


def format_table(study, table: list[dict[str, Any]]) -> str:
    metric = study.metric()
    names = [p.parameterName for p in study.hp.params]
    count = "epochs" if study.program is None else "reports"
    header = ("#", "TRIAL", "STATUS", *names, metric.upper(), count.upper(), "WALL")
    lines = [header]
    for r in table:
        lines.append((str(r["number"]), r["trial"], r["status"], *(_cell(r[n]) for n in names),
                      "-" if r[metric] is None else f"{r[metric]:.4f}", str(r[count]), f"{r['wall_s']:.0f}s"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def format_summary(study, summary: TuningSummary, table: list[dict[str, Any]]) -> str:
    t = summary.trials
    parts = [f"tuning run {summary.name}: {summary.status}" + (f" ({summary.note})" if summary.note else ""),
             f"  {t.total} trial(s): {t.succeeded} succeeded, {t.stopped_early} stopped early, "
             f"{t.failed} failed" + (f", {t.not_finished} not finished" if t.not_finished else "")
             + (f", {t.pending} pending" if t.pending else "")
             + f"; {summary.wall_s:.0f}s", "", format_table(study, table), ""]
    b = summary.best
    if b:
        params = ", ".join(f"{k}={_cell(v)}" for k, v in b.params.items())
        parts.append(f"best: {b.trial} {b.metric} {b.value:.4f} with {params}")
        parts.append(f"  run {b.run_dir}")
        if b.model:
            parts.append(f"  model {b.model}")
    files = summary.files
    parts.append(f"results: {files['csv']}, {files['json']}; plot: {files['plot']}")
    if summary.mlflow:
        parts.append(f"mlflow: {summary.mlflow} (a child run per trial)")
    return "\n".join(parts)


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def plot(study, table: list[dict[str, Any]], top: dict[str, Any] | None) -> bytes:
    """The metric per trial, then the metric against each parameter, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = study.metric()
    params = study.hp.params
    fig, axes = plt.subplots(ncols=1 + len(params), figsize=(4.2 * (1 + len(params)), 3.8), squeeze=False)
    axes = axes[0]
    marks = {SUCCEEDED: ("o", "tab:blue"), STOPPED: ("v", "tab:orange"), FAILED: ("x", "tab:red"),
             UNFINISHED: ("s", "tab:gray"), PENDING: ("D", "silver")}
    scored = [r for r in table if r[metric] is not None]
    ax = axes[0]
    for status, (marker, color) in marks.items():
        pts = [r for r in scored if r["status"] == status]
        if pts:
            ax.scatter([r["number"] for r in pts], [r[metric] for r in pts], marker=marker, color=color, label=status)
    if top is not None:
        ax.scatter([top["number"]], [top[metric]], s=220, facecolors="none", edgecolors="black", label="best")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per trial ({study.hp.goal.lower()})")
    if scored:
        ax.legend(fontsize=7)
    for ax, p in zip(axes[1:], params):
        name = p.parameterName
        categorical = p.type == "CATEGORICAL"
        order = p.grid() if categorical else None
        for status, (marker, color) in marks.items():
            pts = [r for r in scored if r["status"] == status]
            if pts:
                xs = [order.index(r[name]) if categorical else r[name] for r in pts]
                ax.scatter(xs, [r[metric] for r in pts], marker=marker, color=color)
        if categorical:
            ax.set_xticks(range(len(order)), [str(v) for v in order], rotation=30)
        elif p.scaleType in ("UNIT_LOG_SCALE", "UNIT_REVERSE_LOG_SCALE"):
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs {name}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
