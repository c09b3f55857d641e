"""``launcher bench preemption``: what preemptions cost a run, measured on a local multi-node cluster.

A :class:`launcher.lab.chaos.PreemptionLab` (head + 2 one-CPU worker nodes with fake
GCE metadata servers and the real watcher) runs digits-mlp while a node is
preempted every ``every_s`` seconds (with GCE's notice, or lost outright). From
the run's attempts (each worker group's first/last step and time):

* recovery: node removed -> first training step of the restarted group;
* goodput: time spent on steps that were kept / wall time from the first step
  to the last. Steps redone after a restart, waiting out a drain and restarting
  all count against it; evaluation and checkpoints inside an attempt count as
  useful, since an uninterrupted run has them too.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable

from benchmarks import results


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


def recoveries(attempts: list[dict[str, Any]], removals: list[float]) -> list[float]:
    """For each removed node, seconds until the next attempt's first step."""
    out = []
    for removed in removals:
        nxt = [a["first_time"] for a in attempts if a["first_time"] >= removed]
        if nxt:
            out.append(round(min(nxt) - removed, 2))
    return out


def run(every_s: float, epochs: int, notice_s: float, with_notice: bool, note: Callable[[str], None]) -> dict:
    from launcher import JobSpec
    from launcher.lab import PreemptionLab, run_in_background

    with tempfile.TemporaryDirectory(prefix="launcher-bench-preempt-") as root, \
            PreemptionLab(nodes=2, notice_s=notice_s, margin_s=min(5.0, notice_s / 3), note=note) as lab:
        spec = JobSpec(epochs=epochs, checkpoint_every_steps=50, storage=root, name="bench_preemption",
                       address=lab.address, max_failures=-1, keep_checkpoints=3).validated()
        job = run_in_background(spec, note)
        job.wait_for_checkpoint(lambda m: m.global_step > 0, timeout_s=600)
        # The chaos stays in this (main) thread: Ray's Cluster.add_node installs signal handlers.
        # A fixed period: notice k comes at k x every_s, so nodes go every_s apart (lab.preempt
        # itself takes the whole notice; restarting the clock after it would stretch the period).
        next_at = time.time() + every_s
        while job.running:
            time.sleep(0.2)
            if time.time() >= next_at and job.running:
                (lab.preempt if with_notice else lab.kill)(0)
                next_at += every_s
        summary = job.wait(timeout_s=3600)
        removals = [e["time"] for e in lab.events if e["event"].startswith("node removed")]
        events = [{k: v for k, v in e.items() if k != "node"} for e in lab.events]
    attempts = summary.to_json()["attempts"]
    return {"every_s": every_s, "notice_s": notice_s if with_notice else None, "epochs": epochs,
            "status": str(summary.status), "steps": summary.steps_completed, "preemptions": len(removals),
            "restarts": summary.restarts, "steps_lost": summary.steps_lost,
            "time_lost_s": summary.time_lost_s, "recovery_s": recoveries(attempts, removals),
            "goodput": round(goodput(attempts), 4), "wall_s": summary.wall_s, "attempts": attempts,
            "period_s": period(removals), "breakdown_s": breakdown(attempts, events), "lab_events": events}


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


def format_result(r: dict) -> str:
    rec = r["recovery_s"]
    lines = [f"preemption every {r['every_s']:g}s, "
             + (f"{r['notice_s']:g}s notice" if r["notice_s"] else "no notice")
             + f": {r['status']}, {r['steps']} steps, {r['preemptions']} node(s) removed"
             + (f" ({r['period_s']:g}s apart)" if r.get("period_s") else "") + f", {r['restarts']} restart(s)",
             "  recovery (node removed -> first step): "
             + (f"mean {sum(rec) / len(rec):.1f}s, max {max(rec):.1f}s" if rec else "-"),
             f"  steps lost {r['steps_lost']}, time lost {r['time_lost_s']:.1f}s",
             f"  goodput {100 * r['goodput']:.1f}% (useful step time / wall time), wall {r['wall_s']:.0f}s"]
    if r.get("breakdown_s"):
        lines.append("  per preemption (mean s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_s"].items()))
    return "\n".join(lines)


def write_results(r: dict, out_dir: str) -> list[str]:
    fig, ax = results.new_figure()
    a = r["attempts"]
    t0 = a[0]["first_time"] if a else 0.0
    for i, att in enumerate(a):
        ax.plot([att["first_time"] - t0, att["last_time"] - t0], [att["start_step"], att["last_step"]],
                marker="o", label=f"attempt {i + 1}")
    marks = {"preemption notice": ("grey", ":"), "node removed": ("black", "--"),
             "node removed without notice": ("black", "--")}
    labelled = set()
    for e in r.get("lab_events", []):
        if e["event"] in marks and a:
            color, style = marks[e["event"]]
            ax.axvline(e["time"] - t0, color=color, linestyle=style, linewidth=0.8,
                       label=None if e["event"] in labelled else e["event"])
            labelled.add(e["event"])
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("global step")
    ax.set_title(f"preemption every {r['every_s']:g}s: goodput {100 * r['goodput']:.0f}%")
    ax.legend(fontsize=7)
    row = {k: r.get(k) for k in ("every_s", "period_s", "notice_s", "steps", "preemptions", "restarts",
                                 "steps_lost", "time_lost_s", "goodput", "wall_s")}
    row["recovery_mean_s"] = round(sum(r["recovery_s"]) / len(r["recovery_s"]), 2) if r["recovery_s"] else None
    return results.write(out_dir, "preemption", [row], {"result": r}, fig)
