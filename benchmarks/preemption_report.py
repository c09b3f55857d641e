"""``launcher bench preemption``'s accounting in samples, its table and its plot.

Everything here reads a run's own records: the run log's metrics.jsonl rows (each report of a
step, an epoch, a notice or a quorum change: its global step, time, group size and attempt)
and the summary's attempts (each worker group's first step and time). From them,
:func:`timeline` draws the samples trained against wall time, which the table's figures and
the plot share:

* samples trained once: a step is counted the first time the run goes past it; a restarted
  group that resumes from an older checkpoint trains the steps since again (repeated); a group
  that starts past the last step reported counts the steps between as trained by the old group
  (its checkpoint proves them; unreported), and a group whose own reports jump ahead would have
  skipped some (skipped);
* the full group's pace: samples per second while all ``workers`` trained, one attempt's
  consecutive reports apart (a restart's gap is never inside one);
* goodput in samples: samples trained once / (wall time x the full group's pace).

A step's samples are counted as ``batch_size`` x the group size (an epoch's last, smaller
batch is counted whole, a small overcount).
"""

from __future__ import annotations

from typing import Any

from benchmarks import results


def _size(r: dict[str, Any]) -> int | None:
    """The group size of the steps up to this report: a quorum change's ``before``, else its
    ``world_size``."""
    size = r.get("before") if r.get("kind") == "quorum" else r.get("world_size")
    return int(size) if size else None


def timeline(records: list[dict[str, Any]], attempts: list[dict[str, Any]], workers: int,
             batch_size: int) -> dict[str, Any]:
    """The run's samples over time: ``points`` [(seconds since the first step, samples trained
    once)], ``t0`` (the first step's time; under ft, which has no attempts, the first report's),
    ``samples_trained``/``_repeated``/``_skipped``/``_unreported``, ``full_pace`` (samples/s at
    full size), ``reduced_s`` (seconds trained on fewer than ``workers``) and ``goodput_samples``.

    A group starts from a checkpoint, and a checkpoint is written only of steps trained: when a
    group starts past the last step reported (the old group checkpointed, then was stopped before
    its report reached the run log), the steps between were trained once, by the old group, at its
    size; they count as trained (``samples_unreported`` says how many), from the new group's start.
    ``samples_skipped`` is what a group's own reports jump over (none, in a sound run)."""
    start = {a["attempt"]: (a["start_step"], a["first_time"]) for a in attempts if a.get("attempt")}
    rows = sorted((r for r in records if isinstance(r.get("global_step"), (int, float))
                   and isinstance(r.get("time"), (int, float))), key=lambda r: r["time"])
    t0 = min([a["first_time"] for a in attempts] + ([rows[0]["time"]] if rows and not attempts else []), default=0.0)
    last: dict[Any, tuple[int, float]] = {}
    high = None  # the furthest step trained so far
    once = trained = repeated = skipped = unreported = full_samples = full_s = reduced = 0.0
    points = [(0.0, 0.0)]
    old_size = None  # the size of the last step reported: the old group's, at a new group's start
    for r in rows:
        step, when, attempt = int(r["global_step"]), float(r["time"]), r.get("attempt")
        first = attempt not in last
        prev = last.get(attempt) or start.get(attempt)
        last[attempt] = (step, when)
        size = _size(r)
        if prev is None or size is None or step <= prev[0]:
            continue
        from_step, from_time = prev
        per_step = float(batch_size * size)
        if high is not None and from_step > high and first and attempt in start and old_size is not None:
            gap = (from_step - high) * float(batch_size * old_size)  # see the docstring
            unreported += gap
            trained += gap
            once += gap
            high = from_step
        if from_time - t0 > points[-1][0]:  # a new group's first step: the gap before it stays flat
            points.append((round(from_time - t0, 3), once))
        old_size = size
        if high is not None and from_step > high:
            skipped += (from_step - high) * per_step
        new = step - max(from_step, high if high is not None else from_step)
        trained += (step - from_step) * per_step
        repeated += (step - from_step - max(0, new)) * per_step
        once += max(0, new) * per_step
        high = step if high is None else max(high, step)
        if size >= workers:
            full_samples += (step - from_step) * per_step
            full_s += when - from_time
        else:
            reduced += when - from_time
        points.append((round(when - t0, 3), once))
    wall = points[-1][0]
    pace = full_samples / full_s if full_s > 0 else None
    return {"points": points, "t0": t0, "samples_trained": round(trained), "samples_repeated": round(repeated),
            "samples_skipped": round(skipped), "samples_unreported": round(unreported),
            "full_pace": round(pace, 3) if pace else None,
            "reduced_s": round(reduced, 1),
            "goodput_samples": round(once / wall / pace, 4) if pace and wall > 0 else None}


def lost_per_preemption(r: dict[str, Any]) -> float | None:
    """Seconds the survivors lost to each node removed: the restarts' time lost, or under ft the
    quorum changes' (the replicas that stayed never stopped otherwise)."""
    if not r.get("nodes_removed") or r.get("time_lost_s") is None:
        return None
    lost = sum(r.get("quorum_change_s") or []) if r.get("ft") else r["time_lost_s"]
    return round(lost / r["nodes_removed"], 2)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.1f}s" if values else "-"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def format_result(r: dict) -> str:
    rec = r["recovery_s"]
    steps = "" if r.get("steps") is None else f", {r['steps']} steps"
    changes = f", {r['quorum_changes']} quorum change(s)" if r.get("ft") else ""
    lines = [f"{r['strategy']}: preemption every {r['every_s']:g}s, "
             + (f"{r['notice_s']:g}s notice" if r["notice_s"] else "no notice")
             + f", replacements boot in {r['boot_s']:g}s: {r['status']}{steps}, "
             f"{r['nodes_removed']} node(s) removed" + (f" ({r['period_s']:g}s apart)" if r.get("period_s") else "")
             + f", {r['restarts']} restart(s){changes}"]
    if rec:
        lines.append(f"  recovery (node removed -> first step of a new group): mean {sum(rec) / len(rec):.1f}s, "
                     f"max {max(rec):.1f}s")
    if r.get("steps_lost") is not None:
        lines.append(f"  steps lost {r['steps_lost']}, time lost {r['time_lost_s']:.1f}s "
                     f"({'-' if lost_per_preemption(r) is None else f'{lost_per_preemption(r):.2f}s'} per preemption"
                     f"{', the quorum changes' if r.get('ft') else ''}), {r['reduced_s']:.0f}s on fewer than "
                     f"{r['workers']} workers, wall {r['wall_s']:.0f}s")
        if r.get("goodput_samples") is not None:
            lines.append(f"  goodput in samples {_pct(r['goodput_samples'])} (samples trained once / the full group's "
                         f"pace over the wall time), {r['samples_trained']:,} samples trained, "
                         f"{r['samples_repeated']:,} of them again, {r['samples_skipped']:,} skipped"
                         + (f", {r['samples_unreported']:,} trained but not reported (their checkpoint proves them)"
                            if r.get("samples_unreported") else ""))
    else:
        lines.append(f"  goodput {_pct(r['goodput'])} (the uninterrupted run's wall time / this one's), "
                     f"wall {r['wall_s']:.0f}s; the program keeps its steps to itself")
    if r.get("breakdown_s"):
        lines.append("  per preemption (mean s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_s"].items()))
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """One line per strategy, then each strategy's detail."""
    rows = [("STRATEGY", "GOODPUT (SAMPLES)", "REPEATED", "SKIPPED", "STEPS LOST", "NODES REMOVED", "RESTARTS",
             "LOST PER PREEMPTION", "REDUCED")]
    for r in result["strategies"]:
        lost = lost_per_preemption(r)
        rows.append((r["strategy"], _pct(r.get("goodput_samples") if r.get("steps") is not None else r["goodput"]),
                     _count(r.get("samples_repeated")), _count(r.get("samples_skipped")),
                     _count(r.get("steps_lost")), str(r["nodes_removed"]), str(r["restarts"]),
                     "-" if lost is None else f"{lost:.2f}s", f"{r['reduced_s']:.0f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return table + "\n\n" + "\n".join(format_result(r) for r in result["strategies"])


ROW_FIELDS = ("strategy", "workers", "min_workers", "every_s", "boot_s", "notice_s", "steps", "nodes_removed",
              "restarts", "quorum_changes", "replicas_replaced", "steps_lost", "time_lost_s", "reduced_s",
              "goodput", "goodput_samples", "samples_trained", "samples_repeated", "samples_skipped", "samples_unreported",
              "full_pace", "wall_s")


def write_results(result: dict, out_dir: str) -> list[str]:
    """preemption.json ({"summary": rows, "settings": ..., "strategies": [...]}), .csv, and the plot:
    samples trained once against wall time, one line per strategy, its full group's pace dashed
    beside it (the gap between them is what the preemptions cost), each node removal marked."""
    strategies = result["strategies"]
    fig, ax = results.new_figure(figsize=(8, 4.5))
    for r in strategies:
        points = r.get("samples_timeline") or []
        if len(points) < 2:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        line, = ax.plot(xs, ys, linewidth=1.2, label=f"{r['strategy']}: goodput {_pct(r.get('goodput_samples'))}")
        if r.get("full_pace"):
            ax.plot([0, xs[-1]], [0, r["full_pace"] * xs[-1]], linestyle="--", linewidth=0.8, color=line.get_color(),
                    label=f"{r['strategy']}: the full group's pace")
        t0 = r.get("t0")
        for removed in (r.get("removals") or []) if t0 is not None else []:
            x = removed - t0
            before = [p for p in points if p[0] <= x]
            if before:
                ax.plot([x], [before[-1][1]], marker="v", color=line.get_color(), markersize=5)
    ax.set(xlabel="seconds since the first step (v: a node removed)", ylabel="samples trained once",
           title="Where the time goes: samples trained against the full group's pace")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    rows = []
    for r in strategies:
        row = {k: r.get(k) for k in ROW_FIELDS}
        row["lost_per_preemption_s"] = lost_per_preemption(r)
        row["recovery_mean_s"] = round(sum(r["recovery_s"]) / len(r["recovery_s"]), 2) if r["recovery_s"] else None
        rows.append(row)
    return results.write(out_dir, "preemption", rows, {"settings": result.get("settings", {}),
                                                      "strategies": strategies}, fig)
