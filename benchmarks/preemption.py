"""``launcher bench preemption``: what preemptions cost a run, per strategy, on a local autoscaling cluster.

An :class:`launcher.lab.autoscaling.AutoscalingLab` (a head, ``workers`` one-CPU worker
nodes with fake GCE metadata servers and the real watcher, and Ray's autoscaler whose
replacement nodes take ``boot_s`` to come up) runs digits-mlp while a node is preempted
every ``every_s`` seconds (with GCE's notice, or lost outright), ``preemptions`` times,
under each strategy: ``wait`` (a fixed group waits for the replacement), ``elastic``
(``--min-workers``: go on with the nodes that remain, grow back when the replacement
joins) and ``elastic-early`` (elastic, and the replacement asked for on the notice).
From the run's attempts (each worker group's first/last step and time):

* recovery: node removed -> first training step of the restarted group;
* goodput: time spent on steps that were kept / wall time from the first step
  to the last. Steps redone after a restart, waiting out a drain and restarting
  all count against it; evaluation and checkpoints inside an attempt count as
  useful, since an uninterrupted run has them too.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from typing import Any, Callable

from benchmarks import results
from launcher.driver import stop_running
from launcher.storage import Storage


BIN_S = 5.0  # the plot's throughput: mean over windows this long


def goodput(attempts: list[dict[str, Any]]) -> float:
    """Useful training time / wall time over a run's attempts (see the module docstring)."""
    if not attempts:
        return 0.0
    useful = 0.0
    for i, a in enumerate(attempts):
        trained = a["last_step"] - a["start_step"]
        if trained <= 0:
            continue
        kept_until = attempts[i + 1]["start_step"] if i + 1 < len(attempts) else a["last_step"]
        kept = max(0, min(a["last_step"], kept_until) - a["start_step"])
        useful += kept * (a["last_time"] - a["first_time"]) / trained
    wall = attempts[-1]["last_time"] - attempts[0]["first_time"]
    return useful / wall if wall > 0 else 0.0


def sample_accounting(attempts: list[dict[str, Any]], sizes: dict[str, int], workers: int,
                      batch_size: int) -> dict[str, float]:
    """Goodput in samples: the samples each attempt trained (its steps x ``batch_size`` x its group
    size: an epoch's last, smaller batch is counted whole, a small overcount), those trained again
    after a restart (the steps an attempt took after the checkpoint the next one resumed from;
    with the global order's cursor a resize repeats nothing more), and the samples trained once
    per second of wall time over what the full group trains per second (its own attempts at full
    size). The run log's epoch rows cannot give the samples: after a resize an epoch's row counts
    only the steps since."""
    if not attempts:
        return {"samples_trained": 0, "samples_repeated": 0, "goodput_samples": None}

    def rate(world: int) -> float:
        return float(batch_size * world)

    trained = repeated = full_samples = full_s = 0.0
    for i, a in enumerate(attempts):
        steps = max(0, a["last_step"] - a["start_step"])
        world = sizes.get(a.get("attempt"), workers)
        trained += steps * rate(world)
        if i + 1 < len(attempts):
            redone = max(0, a["last_step"] - max(a["start_step"], attempts[i + 1]["start_step"]))
            repeated += redone * rate(world)
        if world == workers and a["last_time"] > a["first_time"]:
            full_samples += steps * rate(world)
            full_s += a["last_time"] - a["first_time"]
    wall = attempts[-1]["last_time"] - attempts[0]["first_time"]
    full_rate = full_samples / full_s if full_s else 0.0
    once = trained - repeated
    return {"samples_trained": round(trained), "samples_repeated": round(repeated),
            "goodput_samples": round(once / wall / full_rate, 4) if wall > 0 and full_rate > 0 else None}


def recoveries(attempts: list[dict[str, Any]], removals: list[float]) -> list[float]:
    """For each removed node, seconds until the next attempt's first step."""
    out = []
    for removed in removals:
        nxt = [a["first_time"] for a in attempts if a["first_time"] >= removed]
        if nxt:
            out.append(round(min(nxt) - removed, 2))
    return out


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A way of meeting preemptions: what it changes in the run (``launcher bench preemption
    --strategies`` takes the names of :data:`STRATEGIES`; a new one is an entry there)."""

    help: str
    elastic: bool = False            # goes on with --min-workers while a node is missing (a program cannot)
    replace_on_notice: bool = False  # the replacement asked for as the notice comes


STRATEGIES = {"wait": Strategy("a fixed group waits for the replacement node"),
              "elastic": Strategy("--min-workers: train on the nodes that remain, grow back when the replacement "
                                  "joins", elastic=True),
              "elastic-early": Strategy("elastic, and the replacement asked for as the notice comes", elastic=True,
                                        replace_on_notice=True)}


def run(strategies: list[str], *, workers: int, min_workers: int, every_s: float, preemptions: int,
        boot_s: float, stockout_s: float, notice_s: float, with_notice: bool, epochs: int,
        note: Callable[[str], None], base=None, program=None, program_args: list[str] | None = None,
        job_dir: bool = False) -> dict:
    """Each strategy on a fresh autoscaling lab (``workers`` one-CPU nodes, replacements ready
    ``boot_s`` after the autoscaler asks): ``preemptions`` nodes preempted ``every_s`` apart.

    ``base``: the run's spec (its code, data and settings; digits-mlp by default) but for the workers,
    epochs, name, storage, address and failure settings, which each strategy sets. ``program``: a --script or --package instead, run to its end under each
    strategy, after an uninterrupted reference run (see :func:`run_program_strategy`)."""
    settings = {"workers": workers, "min_workers": min_workers, "every_s": every_s, "preemptions": preemptions,
                "boot_s": boot_s, "stockout_s": stockout_s, "notice_s": notice_s if with_notice else None,
                "epochs": epochs}
    code = program.label if program is not None else (base.workload if base is not None else "digits-mlp")
    settings["code"] = code
    lab_args = dict(workers=workers, every_s=every_s, preemptions=preemptions, boot_s=boot_s, stockout_s=stockout_s,
                    notice_s=notice_s, with_notice=with_notice, note=note)
    out = []
    if program is not None:
        note("bench: the program uninterrupted first (the reference for goodput)")
        reference = run_program(base, program, program_args or [], job_dir, "reference", **lab_args, preempt=False)
        settings["reference_wall_s"] = reference["wall_s"]
    for strategy in strategies:
        note(f"bench: strategy {strategy} ({STRATEGIES[strategy].help})")
        if program is not None:
            r = run_program(base, program, program_args or [], job_dir, strategy, **lab_args)
            r["goodput"] = round(reference["wall_s"] / r["wall_s"], 4) if r["wall_s"] else 0.0
            out.append(r)
        else:
            out.append(run_strategy(strategy, min_workers=min_workers, epochs=epochs, base=base, **lab_args))
    return {"settings": settings, "strategies": out}


def _spec_for(base, strategy: str, root: str, address: str, **fields):
    from launcher import JobSpec

    base = base or JobSpec(checkpoint_every_steps=20)
    return dataclasses.replace(base, storage=root, name=f"bench_preemption_{strategy.replace('-', '_')}",
                               address=address, max_failures=-1, keep_checkpoints=3,
                               replace_on_notice=STRATEGIES[strategy].replace_on_notice, **fields).validated()


def _preempt_every(lab, job, every_s: float, preemptions: int, with_notice: bool) -> None:
    """The chaos, in this (main) thread, at a fixed period: preemption k comes at k x every_s."""
    next_at, done = time.time() + every_s, 0
    while job.running and done < preemptions:
        time.sleep(0.2)
        if time.time() >= next_at:
            (lab.preempt if with_notice else lab.kill)(0)
            done += 1
            next_at += every_s


def _lab_events(lab) -> list[dict[str, Any]]:
    events = [{k: v for k, v in e.items() if k != "node"} for e in lab.events]
    events += [e for e in lab.provider_events() if e["event"] in ("create", "node started", "create failed")]
    return sorted(events, key=lambda e: e["time"])


def run_strategy(strategy: str, *, workers: int, min_workers: int, every_s: float, preemptions: int,
                 boot_s: float, stockout_s: float, notice_s: float, with_notice: bool, epochs: int,
                 note: Callable[[str], None], base=None) -> dict:
    from launcher.lab import AutoscalingLab, run_in_background

    elastic = STRATEGIES[strategy].elastic
    with tempfile.TemporaryDirectory(prefix="launcher-bench-preempt-") as root, \
            AutoscalingLab(nodes=workers, notice_s=notice_s, margin_s=min(5.0, notice_s / 3), boot_s=boot_s,
                           stockout_s=stockout_s, note=note) as lab:
        spec = _spec_for(base, strategy, root, lab.address, workers=workers, epochs=epochs,
                         min_workers=min_workers if elastic else None)
        if not spec.checkpoint_every_steps:
            spec = dataclasses.replace(spec, checkpoint_every_steps=20)
        job = run_in_background(spec, note)
        job.wait_for_checkpoint(lambda m: m.global_step > 0, timeout_s=600)
        _preempt_every(lab, job, every_s, preemptions, with_notice)
        # After the last one: the full group again, and a little training on it, then stop.
        if job.running:
            before = {r.get("attempt") for r in _records(Storage.resolve(root), spec.name)}
            lab.wait_for_nodes(workers, timeout_s=boot_s + stockout_s + 300)
            _train_at_full_size(job, storage_root=root, name=spec.name, workers=workers, old=before,
                                timeout_s=boot_s + stockout_s + 300)
            stop_running("the benchmark's preemptions are done")
        summary = job.wait(timeout_s=3600)
        removals = [e["time"] for e in lab.events if e["event"].startswith("node removed")]
        events = _lab_events(lab)
        records = _records(Storage.resolve(root), spec.name)
    attempts = summary.to_json()["attempts"]
    sizes = attempt_sizes(records)
    return {"strategy": strategy, "workers": workers, "min_workers": spec.min_workers, "every_s": every_s,
            "boot_s": boot_s, "notice_s": notice_s if with_notice else None, "status": str(summary.status),
            "steps": summary.steps_completed, "nodes_removed": len(removals), "restarts": summary.restarts,
            "steps_lost": summary.steps_lost, "time_lost_s": summary.time_lost_s,
            "recovery_s": recoveries(attempts, removals), "goodput": round(goodput(attempts), 4),
            "reduced_s": round(reduced_time(attempts, sizes, workers), 1), "wall_s": summary.wall_s,
            "attempts": attempts, "sizes": sizes, "period_s": period(removals),
            "breakdown_s": breakdown(attempts, events), "lab_events": events,
            "throughput": throughput(records), **sample_accounting(attempts, sizes, workers, int(spec.batch_size))}


def run_program(base, program, program_args: list[str], job_dir: bool, strategy: str, *, workers: int,
                every_s: float, preemptions: int, boot_s: float, stockout_s: float, notice_s: float,
                with_notice: bool, note: Callable[[str], None], preempt: bool = True) -> dict:
    """A --script or --package run to its end on a fresh lab, its nodes preempted every ``every_s``
    (unless not ``preempt``). A program keeps its steps to itself: the figures are the wall time
    (goodput: the uninterrupted run's wall time over this one's), the restarts and, per removed node,
    the seconds until Ray Train started the next group (recovery here: the program's own restart
    and resume come after)."""
    from launcher.lab import AutoscalingLab, run_in_background

    with tempfile.TemporaryDirectory(prefix="launcher-bench-preempt-") as root, \
            AutoscalingLab(nodes=workers, notice_s=notice_s, margin_s=min(5.0, notice_s / 3), boot_s=boot_s,
                           stockout_s=stockout_s, note=note) as lab:
        spec = _spec_for(base, strategy, root, lab.address, workers=workers, min_workers=None)
        job = run_in_background(spec, note, program=program, program_args=program_args, job_dir=job_dir)
        if preempt:
            _preempt_every(lab, job, every_s, preemptions, with_notice)
        summary = job.wait(timeout_s=3600)
        removals = [e["time"] for e in lab.events if e["event"].startswith("node removed")]
        events = _lab_events(lab)
    restarts = summary.to_json()["interruptions"]
    return {"strategy": strategy, "workers": workers, "min_workers": None, "every_s": every_s, "boot_s": boot_s,
            "notice_s": notice_s if with_notice else None, "status": str(summary.status),
            "exit_code": job.exit_code, "steps": None, "nodes_removed": len(removals),
            "restarts": summary.restarts, "steps_lost": None, "time_lost_s": summary.time_lost_s,
            "recovery_s": [r["recovery_s"] for r in restarts if r.get("recovery_s") is not None],
            "goodput": None, "reduced_s": 0.0, "wall_s": summary.wall_s, "attempts": [], "sizes": {},
            "samples_trained": None, "samples_repeated": None, "goodput_samples": None,
            "period_s": period(removals), "breakdown_s": {}, "lab_events": events, "throughput": []}


def _records(storage, name: str) -> list[dict[str, Any]]:
    text = storage.read_text(name, "metrics.jsonl") or ""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _train_at_full_size(job, storage_root: str, name: str, workers: int, old: set, timeout_s: float) -> None:
    """Wait until a group of ``workers`` that started after the last preemption (an attempt not
    in ``old``) has reported 3 times: it is back at full size, and trained on."""
    storage, end = Storage.resolve(storage_root), time.time() + timeout_s
    while job.running and time.time() < end:
        new = [r for r in _records(storage, name) if r.get("attempt") not in old and r.get("world_size") == workers]
        if len(new) >= 3:
            return
        time.sleep(0.5)


def attempt_sizes(records: list[dict[str, Any]]) -> dict[str, int]:
    """Each attempt's group size, from its reports."""
    return {r["attempt"]: int(r["world_size"]) for r in records if r.get("attempt") and r.get("world_size")}


def reduced_time(attempts: list[dict[str, Any]], sizes: dict[str, int], workers: int) -> float:
    """Seconds the run trained on fewer than ``workers`` workers."""
    return sum(a["last_time"] - a["first_time"] for a in attempts
               if sizes.get(a.get("attempt"), workers) < workers)


def throughput(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Steps per second between consecutive reports of one attempt: (time, steps/s, world size)."""
    out, last = [], {}
    for r in records:
        if r.get("global_step") is None or r.get("time") is None:
            continue
        prev = last.get(r.get("attempt"))
        if prev is not None and r["time"] > prev["time"] and r["global_step"] > prev["global_step"]:
            out.append({"time": r["time"], "steps_per_s": round((r["global_step"] - prev["global_step"])
                                                                / (r["time"] - prev["time"]), 3),
                        "world_size": r.get("world_size")})
        last[r.get("attempt")] = r
    return out


def breakdown(attempts: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per preemption, in order: training stopped -> drain deadline (held for the
    last checkpoint), deadline -> node removed, removed -> the new group's train function
    starts (placement on the replacement node, worker processes, process group), our
    worker set-up (data, model, restore: rank 0's marks), and the first step."""
    parts: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        parts.setdefault(name, []).append(seconds)

    deadline = None
    for e in events:
        if e["event"] == "node draining":
            deadline = e["deadline"]
        if not e["event"].startswith("node removed"):
            continue
        removed = e["time"]
        before = [a for a in attempts if a["last_time"] <= removed]
        after = [a for a in attempts if a["first_time"] >= removed]
        if not before or not after:
            continue
        stopped, nxt, marks = before[-1]["last_time"], after[0], after[0].get("marks") or {}
        if deadline is not None:
            add("held before the deadline", deadline - stopped)
            add("deadline -> node removed", removed - deadline)
        if "worker_start" in marks and "worker_ready" in marks:
            add("removed -> train function starts", marks["worker_start"] - removed)
            add("worker set-up (data, model, restore)", marks["worker_ready"] - marks["worker_start"])
            add("-> first step", nxt["first_time"] - marks["worker_ready"])
        deadline = None
    return {name: round(sum(v) / len(v), 2) for name, v in parts.items()}


def period(removals: list[float]) -> float | None:
    """Mean seconds between node removals (what "one preemption every N s" means)."""
    if len(removals) < 2:
        return None
    return round((removals[-1] - removals[0]) / (len(removals) - 1), 1)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.1f}s" if values else "-"


def format_result(r: dict) -> str:
    rec = r["recovery_s"]
    steps = "" if r.get("steps") is None else f", {r['steps']} steps"
    lines = [f"{r['strategy']}: preemption every {r['every_s']:g}s, "
             + (f"{r['notice_s']:g}s notice" if r["notice_s"] else "no notice")
             + f", replacements boot in {r['boot_s']:g}s: {r['status']}{steps}, "
             f"{r['nodes_removed']} node(s) removed" + (f" ({r['period_s']:g}s apart)" if r.get("period_s") else "")
             + f", {r['restarts']} restart(s)",
             "  recovery (node removed -> first step): "
             + (f"mean {sum(rec) / len(rec):.1f}s, max {max(rec):.1f}s" if rec else "-")]
    if r.get("steps_lost") is not None:
        lines.append(f"  steps lost {r['steps_lost']}, time lost {r['time_lost_s']:.1f}s, "
                     f"{r['reduced_s']:.0f}s on fewer than {r['workers']} workers")
        lines.append(f"  goodput {_pct(r['goodput'])} (useful step time / wall time), wall {r['wall_s']:.0f}s")
        if r.get("goodput_samples") is not None:
            lines.append(f"  goodput in samples {_pct(r['goodput_samples'])} (samples trained once per second / the "
                         f"full group's samples per second), {r['samples_trained']:,} samples trained, "
                         f"{r['samples_repeated']:,} of them again")
    else:
        lines.append(f"  goodput {_pct(r['goodput'])} (the uninterrupted run's wall time / this one's), "
                     f"wall {r['wall_s']:.0f}s; the program keeps its steps to itself")
    if r.get("breakdown_s"):
        lines.append("  per preemption (mean s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_s"].items()))
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """One line per strategy, then each strategy's detail."""
    rows = [("STRATEGY", "GOODPUT", "GOODPUT (SAMPLES)", "REPEATED SAMPLES", "STEPS LOST", "NODES REMOVED", "REDUCED",
             "RECOVERY (mean)")]
    for r in result["strategies"]:
        repeated = r.get("samples_repeated")
        rows.append((r["strategy"], _pct(r["goodput"]), _pct(r.get("goodput_samples")),
                     "-" if repeated is None else f"{repeated:,}",
                     "-" if r["steps_lost"] is None else str(r["steps_lost"]),
                     str(r["nodes_removed"]), f"{r['reduced_s']:.0f}s", _mean(r["recovery_s"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return table + "\n\n" + "\n".join(format_result(r) for r in result["strategies"])


def binned_throughput(points: list[dict[str, Any]], t0: float, width_s: float = BIN_S) -> list[tuple[float, float]]:
    """(seconds since ``t0``, mean steps/s x workers) per ``width_s`` window that has reports: the
    data the group gets through, whatever its size (a smaller group takes more, shorter steps);
    one point per report is too noisy to read at a glance. A gap is a window with no report."""
    bins: dict[int, list[float]] = {}
    for p in points:
        bins.setdefault(int((p["time"] - t0) // width_s), []).append(p["steps_per_s"] * (p.get("world_size") or 1))
    return [((k + 0.5) * width_s, sum(v) / len(v)) for k, v in sorted(bins.items())]


def write_results(result: dict, out_dir: str) -> list[str]:
    """preemption.json ({"summary": rows, "settings": ..., "strategies": [...]}), .csv, and a plot of
    throughput over time per strategy with the preemptions marked."""
    strategies = result["strategies"]
    fig, axes = results.new_figure(nrows=max(1, len(strategies)), sharex=True)
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    marks = {"preemption notice": ("grey", ":"), "node removed": ("black", "--"),
             "node removed without notice": ("black", "--"), "node started": ("green", "-.")}
    for ax, r in zip(axes, strategies):
        points, a = r.get("throughput") or [], r["attempts"]
        t0 = a[0]["first_time"] if a else (points[0]["time"] if points else
                                           min((e["time"] for e in r.get("lab_events", [])), default=0.0))
        binned = binned_throughput(points, t0)
        ax.plot([b[0] for b in binned], [b[1] for b in binned], marker=".", linewidth=1)
        labelled = set()
        for e in r.get("lab_events", []):
            if e["event"] in marks and e["time"] >= t0:  # not the lab's first nodes coming up
                color, style = marks[e["event"]]
                label = {"node started": "replacement up"}.get(e["event"], e["event"])
                ax.axvline(e["time"] - t0, color=color, linestyle=style, linewidth=0.8,
                           label=None if label in labelled else label)
                labelled.add(label)
        ax.set_ylabel("worker-steps/s")
        ax.set_title(f"{r['strategy']}: goodput {_pct(r['goodput'])}, {r['reduced_s']:.0f}s reduced",
                     fontsize=9)
        ax.legend(fontsize=6)
    axes[-1].set_xlabel("seconds since the first step")
    rows = []
    for r in strategies:
        row = {k: r.get(k) for k in ("strategy", "workers", "min_workers", "every_s", "boot_s", "notice_s", "steps",
                                     "nodes_removed", "restarts", "steps_lost", "time_lost_s", "reduced_s",
                                     "goodput", "goodput_samples", "samples_trained", "samples_repeated",
                                     "wall_s")}
        row["recovery_mean_s"] = round(sum(r["recovery_s"]) / len(r["recovery_s"]), 2) if r["recovery_s"] else None
        rows.append(row)
    return results.write(out_dir, "preemption", rows, {"settings": result.get("settings", {}),
                                                      "strategies": strategies}, fig)
