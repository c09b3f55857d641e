"""``launcher bench preemption``: what preemptions cost a run, per strategy, on a local autoscaling cluster.

An :class:`launcher.lab.autoscaling.AutoscalingLab` (a head, ``workers`` one-CPU worker
nodes with fake GCE metadata servers and the real watcher, and Ray's autoscaler whose
replacement nodes take ``boot_s`` to come up) runs digits-mlp while a node is preempted
every ``every_s`` seconds (with GCE's notice, or lost outright), ``preemptions`` times,
under each strategy: ``wait`` (a fixed group waits for the replacement), ``elastic``
(``--min-workers``: go on with the nodes that remain, grow back when the replacement
joins), ``elastic-early`` (elastic, and the replacement asked for on the notice) and ``ft``
(``--strategy ft``: torchft replica groups, a quorum per step; the node's replica leaves, the
others train on, the replacement joins). The samples trained against wall time, goodput in
samples and the samples repeated or skipped come from the run log
(:mod:`benchmarks.preemption_report`); from the run's attempts (each worker group's first/last
step and time):

* recovery: node removed -> first training step of the restarted group;
* goodput: time spent on steps that were kept / wall time from the first step
  to the last. Steps redone after a restart, waiting out a drain and restarting
  all count against it; evaluation and checkpoints inside an attempt count as
  useful, since an uninterrupted run has them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from typing import Any, Callable, Iterator

from benchmarks.preemption_report import timeline
from launcher.driver import stop_running
from launcher.storage import RunRecord, Storage


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


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A way of meeting preemptions: what it changes in the run (``launcher bench preemption
    --strategies`` takes the names of :data:`STRATEGIES`; a new one is an entry there)."""

    help: str
    elastic: bool = False            # goes on with --min-workers while a node is missing (a program cannot)
    replace_on_notice: bool = False  # the replacement asked for as the notice comes
    ft: bool = False                 # --strategy ft: replica groups, a quorum per step (no group restart)


STRATEGIES = {"wait": Strategy("a fixed group waits for the replacement node"),
              "elastic": Strategy("--min-workers: train on the nodes that remain, grow back when the replacement "
                                  "joins", elastic=True),
              "elastic-early": Strategy("elastic, and the replacement asked for as the notice comes", elastic=True,
                                        replace_on_notice=True),
              "ft": Strategy("--strategy ft: torchft replica groups; the others train on while a node's replica "
                             "leaves and its replacement joins (asked for as the notice comes, as a user's run does)",
                             elastic=True, replace_on_notice=True, ft=True)}


def run(strategies: list[str], *, workers: int, min_workers: int, every_s: float, preemptions: int,
        boot_s: float, stockout_s: float, notice_s: float, with_notice: bool, epochs: int,
        note: Callable[[str], None], base=None, program=None, program_args: list[str] | None = None,
        job_dir: bool = False, lab=None) -> dict:
    """Each strategy on a fresh autoscaling lab (``workers`` one-CPU nodes, replacements ready
    ``boot_s`` after the autoscaler asks): ``preemptions`` nodes preempted ``every_s`` apart.

    ``lab``: an :class:`~launcher.lab.AutoscalingLab` already up, with these settings, to use instead
    of a fresh one per strategy (what it did before the run is left out of the figures).
    ``base``: the run's spec (its code, data and settings; digits-mlp by default) but for the workers,
    epochs, name, storage, address and failure settings, which each strategy sets. ``program``: a --script or --package instead, run to its end under each
    strategy, after an uninterrupted reference run (see :func:`run_program_strategy`)."""
    settings = {"workers": workers, "min_workers": min_workers, "every_s": every_s, "preemptions": preemptions,
                "boot_s": boot_s, "stockout_s": stockout_s, "notice_s": notice_s if with_notice else None,
                "epochs": epochs}
    code = program.label if program is not None else (base.workload if base is not None else "digits-mlp")
    settings["code"] = code
    lab_args = dict(workers=workers, every_s=every_s, preemptions=preemptions, boot_s=boot_s, stockout_s=stockout_s,
                    notice_s=notice_s, with_notice=with_notice, note=note, lab=lab)
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
    strategy_name = "ft" if STRATEGIES[strategy].ft else ("ddp" if base.strategy == "ft" else base.strategy)
    return dataclasses.replace(base, strategy=strategy_name, storage=root, name=f"bench_preemption_{strategy.replace('-', '_')}",
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


def _lab_events(lab, since: float) -> list[dict[str, Any]]:
    events = [{k: v for k, v in e.items() if k != "node"} for e in lab.events]
    events += [e for e in lab.provider_events() if e["event"] in ("create", "node started", "create failed")]
    return sorted((e for e in events if e["time"] >= since), key=lambda e: e["time"])


def _removals(lab, since: float) -> list[float]:
    return [e["time"] for e in lab.events if e["event"].startswith("node removed") and e["time"] >= since]


@contextlib.contextmanager
def _lab_for(lab, *, workers: int, notice_s: float, boot_s: float, stockout_s: float,
             note: Callable[[str], None]) -> Iterator[tuple[Any, str, float]]:
    """(the lab, a fresh storage folder, when the run began): ``lab`` if given, else a lab of its own."""
    from launcher.lab import AutoscalingLab

    own = lab is None
    with tempfile.TemporaryDirectory(prefix="launcher-bench-preempt-") as root, \
            (AutoscalingLab(nodes=workers, notice_s=notice_s, margin_s=min(5.0, notice_s / 3), boot_s=boot_s,
                            stockout_s=stockout_s, note=note) if own else contextlib.nullcontext(lab)) as lab:
        yield lab, root, time.time()


def run_strategy(strategy: str, *, workers: int, min_workers: int, every_s: float, preemptions: int,
                 boot_s: float, stockout_s: float, notice_s: float, with_notice: bool, epochs: int,
                 note: Callable[[str], None], base=None, lab=None) -> dict:
    from launcher.lab import run_in_background

    elastic = STRATEGIES[strategy].elastic
    with _lab_for(lab, workers=workers, notice_s=notice_s, boot_s=boot_s, stockout_s=stockout_s,
                  note=note) as (lab, root, since):
        spec = _spec_for(base, strategy, root, lab.address, workers=workers, epochs=epochs,
                         min_workers=min_workers if elastic else None)
        if not spec.checkpoint_every_steps:
            spec = dataclasses.replace(spec, checkpoint_every_steps=20)
        job = run_in_background(spec, note)
        job.wait_for_checkpoint(lambda m: m.global_step > 0, timeout_s=600)
        _preempt_every(lab, job, every_s, preemptions, with_notice)
        # After the last one: the full group again, and a little training on it, then stop.
        if job.running:
            last = time.time()
            before = {r.get("attempt") for r in RunRecord(Storage.resolve(root), spec.name).metrics()}
            lab.wait_for_nodes(workers, timeout_s=boot_s + stockout_s + 300)
            _train_at_full_size(job, storage_root=root, name=spec.name, workers=workers,
                                back=_ft_back(last) if STRATEGIES[strategy].ft else _restarted(before),
                                timeout_s=boot_s + stockout_s + 300)
            stop_running("the benchmark's preemptions are done")
        summary = job.wait(timeout_s=3600)
        removals, events = _removals(lab, since), _lab_events(lab, since)
        records = RunRecord(Storage.resolve(root), spec.name).metrics()
    attempts = summary.to_json()["attempts"]
    line = timeline(records, attempts, workers, int(spec.batch_size))
    return {"strategy": strategy, "workers": workers, "min_workers": spec.min_workers, "every_s": every_s,
            "boot_s": boot_s, "notice_s": notice_s if with_notice else None, "status": str(summary.status),
            "error": summary.error, "steps": summary.steps_completed, "nodes_removed": len(removals),
            "restarts": summary.restarts,
            "steps_lost": summary.steps_lost, "time_lost_s": summary.time_lost_s,
            "ft": STRATEGIES[strategy].ft, "quorum_changes": summary.quorum_changes,
            "quorum_change_s": summary.quorum_change_s, "replicas_replaced": summary.replicas_replaced,
            "recovery_s": recoveries(attempts, removals),
            "goodput": None if STRATEGIES[strategy].ft else round(goodput(attempts), 4),
            "wall_s": summary.wall_s, "attempts": attempts, "period_s": period(removals),
            "breakdown_s": breakdown(attempts, events), "lab_events": events, "removals": removals,
            "samples_timeline": line.pop("points"), **line}


def run_program(base, program, program_args: list[str], job_dir: bool, strategy: str, *, workers: int,
                every_s: float, preemptions: int, boot_s: float, stockout_s: float, notice_s: float,
                with_notice: bool, note: Callable[[str], None], preempt: bool = True, lab=None) -> dict:
    """A --script or --package run to its end on a fresh lab, its nodes preempted every ``every_s``
    (unless not ``preempt``). A program keeps its steps to itself: the figures are the wall time
    (goodput: the uninterrupted run's wall time over this one's), the restarts and, per removed node,
    the seconds until Ray Train started the next group (recovery here: the program's own restart
    and resume come after)."""
    from launcher.lab import run_in_background

    with _lab_for(lab, workers=workers, notice_s=notice_s, boot_s=boot_s, stockout_s=stockout_s,
                  note=note) as (lab, root, since):
        spec = _spec_for(base, strategy, root, lab.address, workers=workers, min_workers=None)
        job = run_in_background(spec, note, program=program, program_args=program_args, job_dir=job_dir)
        if preempt:
            _preempt_every(lab, job, every_s, preemptions, with_notice)
        summary = job.wait(timeout_s=3600)
        removals, events = _removals(lab, since), _lab_events(lab, since)
    restarts = summary.to_json()["interruptions"]
    return {"strategy": strategy, "workers": workers, "min_workers": None, "every_s": every_s, "boot_s": boot_s,
            "notice_s": notice_s if with_notice else None, "status": str(summary.status),
            "error": summary.error, "exit_code": job.exit_code, "steps": None, "nodes_removed": len(removals),
            "restarts": summary.restarts, "steps_lost": None, "time_lost_s": summary.time_lost_s,
            "recovery_s": [r["recovery_s"] for r in restarts if r.get("recovery_s") is not None],
            "goodput": None, "reduced_s": 0.0, "wall_s": summary.wall_s, "attempts": [],
            "samples_trained": None, "samples_repeated": None, "samples_skipped": None,
            "goodput_samples": None, "period_s": period(removals), "breakdown_s": {}, "lab_events": events}


def _restarted(old: set) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    """A restarting strategy's reports since the last preemption: those of a group (an attempt) not in ``old``."""
    return lambda records: [r for r in records if r.get("attempt") not in old]


def _ft_back(since: float) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    """--strategy ft's reports after the quorum last changed, if it changed after ``since`` (the group
    is one attempt throughout: its size is the quorum's)."""
    def after(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        changes = [r["time"] for r in records if r.get("kind") == "quorum" and r.get("time", 0) > since]
        return [r for r in records if changes and r.get("time", 0) > max(changes)]
    return after


def _train_at_full_size(job, storage_root: str, name: str, workers: int, back, timeout_s: float) -> None:
    """Wait until the group is back at full size after the last preemption and has reported there
    3 times (``back``: the records since it came back, of :func:`_restarted` or :func:`_ft_back`)."""
    storage, end = Storage.resolve(storage_root), time.time() + timeout_s
    while job.running and time.time() < end:
        if len([r for r in back(RunRecord(storage, name).metrics()) if r.get("world_size") == workers]) >= 3:
            return
        time.sleep(0.5)


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


