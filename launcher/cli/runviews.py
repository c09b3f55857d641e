"""What ``launcher runs`` shows beyond the table: runs side by side (``--compare``) and plots of
a run's metrics, of where its time went and of its workers' usage (``--plot``)."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import time

from launcher.cli.options import EXIT_OK
from launcher.errors import UserError
from launcher.settings import USAGE_S
from launcher.storage import Storage
from launcher.storage.runlog import LOGS, USAGE as USAGE_LOG, RunRecord
from launcher.storage.runs import describe_run, format_comparison, plottable, series
from launcher.summary import USAGE_FIELDS
from launcher.worker.timing import PHASES, SHARE_KEYS, WORDS

TIME = "time"    # --plot time: where each epoch's training time went
USAGE = "usage"  # --plot usage: each worker's CPU and memory over the run


def no_run(storage: Storage, name: str, hint: str = "") -> UserError:
    return UserError(f"no run {name} under {storage.uri}",
                     "`launcher runs` lists the runs there; --storage names another root" + hint)


def run_named(storage: Storage, name: str):
    run = describe_run(storage, name)
    if run is None:
        raise no_run(storage, name)
    return run


def compare(storage: Storage, names: list[str], args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(names))
    if len(names) < 2:
        raise UserError(f"--compare needs two runs or more, got {len(names)}", "name them: --compare RUN_A RUN_B")
    runs = {n: run_named(storage, n) for n in names}
    if any(r.kind == "tuning" for r in runs.values()):
        raise UserError("--compare takes runs, not tuning runs", "compare a tuning run's trials by their names")
    specs = {n: RunRecord(storage, n).spec() for n in names}
    if args.json:
        print(json.dumps({n: {"spec": specs[n], **runs[n].to_json()} for n in names}, indent=1))
        return EXIT_OK
    rows = {n: RunRecord(storage, n).at_steps() for n in names}
    metric = args.plot or _default_metric(rows)
    if args.plot:  # a metric no run reported is one line, before the table
        check_metric(rows, metric, special=False)
    print(format_comparison(runs, specs))
    if metric is None:
        print("no metric to plot: the runs reported none yet")
        return EXIT_OK
    print(f"wrote {plot_metric(rows, metric, args.out or f'compare-{metric}.png')}")
    return EXIT_OK


def _default_metric(rows: dict[str, list]) -> str | None:
    for name in ("loss", "val_loss", "train_loss"):
        if any(series(r, name) for r in rows.values()):
            return name
    return next((m for r in rows.values() for m in plottable(r)), None)


def plot_run(storage: Storage, name: str, metric: str, out: str | None) -> str:
    out, record = out or f"{name}-{metric}.png", RunRecord(storage, name)
    if metric == TIME:
        return plot_time(record.at_steps(), name, out)
    if metric == USAGE:
        return plot_usage(record.usage(), name, out)
    return plot_metric({name: record.at_steps()}, metric, out)


def _figure(nrows: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows=nrows, figsize=(7.5, 2.4 + 2.2 * nrows), squeeze=False)


def _save(fig, out: str) -> str:
    """Write the figure to ``out``; returns its absolute path (what `wrote ...` says: a default
    name lands in the current folder, which the user should not have to guess)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write the plot ({exc.strerror or exc})",
                        "give a path in a folder you can write to") from None
    finally:
        plt.close(fig)
    return os.path.abspath(out)


def check_metric(rows: dict[str, list], metric: str, special: bool = True) -> None:
    """UserError unless some run in ``rows`` reported ``metric``: the line names the metrics they did
    (``special``: and the plots that are not metrics, which only a single run's --plot draws)."""
    if any(series(r, metric) for r in rows.values()):
        return
    known = sorted({m for r in rows.values() for m in plottable(r)})
    close = difflib.get_close_matches(metric, known + ([TIME, USAGE] if special else []), n=1)
    names = ", ".join(known) or "(none reported yet)"
    others = f", or '{TIME}' or '{USAGE}'" if special else ""
    raise UserError(f"--plot {metric}: no run here reported {metric}",
                    (f"did you mean {close[0]}? " if close else "") + f"plot one of: {names}{others}")


def plot_metric(rows: dict[str, list], metric: str, out: str) -> str:
    """METRIC over the steps, one line per run."""
    check_metric(rows, metric, special=len(rows) == 1)
    drawn = {n: series(r, metric) for n, r in rows.items()}
    fig, axes = _figure()
    ax = axes[0][0]
    for name, points in drawn.items():
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} over the steps")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out)


def plot_time(rows: list, name: str, out: str) -> str:
    """Each epoch's training time by phase (stacked shares), and the straggler's factor."""
    epochs = [m for m in rows if m.get("kind") == "epoch" and isinstance(m.get(SHARE_KEYS[0]), (int, float))]
    if not epochs:
        raise UserError(f"--plot {TIME}: run {name} has no epoch with a time breakdown",
                        "runs of your own loop, the managed loops and Keras' fit report one at each epoch's end")
    fig, axes = _figure()
    ax = axes[0][0]
    steps = [int(m["global_step"]) for m in epochs]
    labels = [str(s) for s in steps]
    bottom = [0.0] * len(epochs)
    for phase, key in zip(PHASES, SHARE_KEYS):
        values = [100 * float(m.get(key) or 0.0) for m in epochs]
        ax.bar(labels, values, bottom=bottom, label=f"{phase} ({WORDS[phase]})")
        bottom = [b + v for b, v in zip(bottom, values)]
    for label, m in zip(labels, epochs):
        if isinstance(m.get("straggler_rank"), int):
            ax.annotate(f"rank {m['straggler_rank']} {m['straggler_factor']:.1f}x", (label, 101), ha="center",
                        fontsize=7)
    ax.set_ylim(0, 112)
    ax.set_xlabel("epoch's last step")
    ax.set_ylabel("% of training time (mean over ranks)")
    ax.set_title(f"run {name}: where each epoch's time went")
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    return _save(fig, out)


def plot_usage(samples: list, name: str, out: str) -> str:
    """Each worker's CPU % and RSS over wall time (and its GPU where one was used)."""
    ranks = sorted({int(u["rank"]) for u in samples if isinstance(u.get("rank"), int)})
    if not ranks:
        raise UserError(f"--plot {USAGE}: run {name} has no usage samples ({USAGE_LOG})",
                        f"workers sample every {USAGE_S.default} s ({USAGE_S}); a run shorter than that has none")
    gpu = any(float(u.get("gpu_pct") or 0) or float(u.get("gpu_mb") or 0) for u in samples)
    figures = [f for f in USAGE_FIELDS[1:] if gpu or not f.startswith("gpu")]
    fig, axes = _figure(len(figures))
    start = min(float(u["time"]) for u in samples)
    for ax, field in zip((a[0] for a in axes), figures):
        for rank in ranks:
            mine = [u for u in samples if u.get("rank") == rank]
            ax.plot([float(u["time"]) - start for u in mine], [float(u.get(field) or 0) for u in mine],
                    label=f"rank {rank}")
        ax.set_ylabel({"cpu_pct": "CPU % of a core", "rss_mb": "RSS (MB)", "gpu_pct": "GPU %",
                       "gpu_mb": "GPU memory (MB)"}[field])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(f"run {name}: each worker over time")
    axes[0][0].legend(fontsize=7)
    axes[-1][0].set_xlabel("seconds since the first sample")
    return _save(fig, out)


# -- launcher logs ------------------------------------------------------------------------------

LOG_NAME = re.compile(r"^(?P<started>\d{8}-\d{6})-(?P<id>[0-9a-f]+)-rank(?P<rank>\d+)\.log$")


def log_files(storage: Storage, name: str, launch: int | None) -> tuple[int, list[tuple[str, int]]]:
    """(the launch, its rank logs as (file, rank) in the order their worker groups started)."""
    record = RunRecord(storage, name)
    if not record.exists():
        raise no_run(storage, name, "; a job's driver output: its id (`launcher jobs` lists them) and --address")
    launches = record.logged_launches()
    if not launches:
        raise UserError(f"run {name} has no worker output in {record.uri(LOGS)}",
                        "runs keep it from this version on; an earlier launch's output is in Ray's logs "
                        "(`launcher run --verbose` shows it as it comes)")
    if launch is None:
        launch = launches[-1]
    elif launch not in launches:
        raise UserError(f"--launch {launch}: run {name} has worker output of launch(es) "
                        f"{', '.join(map(str, launches))}", "give one of those")
    files = []
    for file in record.rank_logs(launch):
        m = LOG_NAME.match(file)
        if m:
            files.append((m.group("started"), int(m.group("rank")), file))
    return launch, [(file, rank) for _, rank, file in sorted(files)]


def show_logs(storage: Storage, name: str, rank: int | None = None, launch: int | None = None,
              follow: bool = False, out=None, poll_s: float = 1.0) -> int:
    """Print each rank's output of the launch, every line prefixed with its rank; ``follow``:
    then the new output as it comes, until the launch has ended."""
    out, record = out or sys.stdout, RunRecord(storage, name)
    launch, files = log_files(storage, name, launch)
    if rank is not None and files and rank not in {r for _, r in files}:
        raise UserError(f"--rank {rank}: launch {launch} of run {name} has output of rank(s) "
                        f"{', '.join(map(str, sorted({r for _, r in files})))}", "give one of those")
    shown: dict[str, int] = {}

    def show_new(whole: bool) -> bool:
        new = False
        for file, r in log_files(storage, name, launch)[1]:
            if rank is not None and r != rank:
                continue
            text = record.rank_log(launch, file)
            end = len(text) if whole else text.rfind("\n") + 1  # a line being written waits for its end
            if end > shown.get(file, 0):
                for line in text[shown.get(file, 0):end].splitlines():
                    out.write(f"[rank {r}] {line}\n")
                shown[file] = end
                new = True
        out.flush()
        return new

    show_new(whole=not follow)
    try:
        while follow:
            ended = record.ended(launch)
            time.sleep(poll_s)
            if not show_new(whole=ended) and ended:
                break
    except KeyboardInterrupt:
        pass
    return EXIT_OK

