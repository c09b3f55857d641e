"""Folds what the controller says during one launch into progress lines, the run log and a summary.

:class:`Tracker` takes the controller's events (:mod:`launcher.summary`) as the
driver's pump hands them over: rank 0's reports (metrics, checkpoints, start-up
marks, checkpoints taken on a preemption notice), failures, notices and
restarts. At the end, :meth:`Tracker.reconcile` gives every checkpoint whose
report never arrived (Ctrl-C aborts Ray Train's controller while the workers
still store checkpoints) its metrics row, and :meth:`Tracker.summary` makes the
launch's :class:`~launcher.summary.RunSummary`, with what each restart cost.

Times: a one-off set-up the launch waited for (a first Horovod build, see
:func:`launcher.driver.startup.setup_phase`) counts in neither the elapsed time
of the progress lines nor the wall time; the throughput covers the steps
trained, a cut-off epoch's included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from launcher import frameworks
from launcher.driver import startup, trainer
from launcher.driver.progress import Progress, format_epoch, format_round
from launcher.measures import peak_memory, pick_metrics, summarise_usage
from launcher.spec import JobSpec
from launcher.storage.checkpoint import Manifest, complete_checkpoints, resume_point
from launcher.storage.runlog import RunLog
from launcher.summary import Attempt, Event, Failure, Interruption, Preempting, Report, Restart, RunStatus, RunSummary
from launcher.worker.timing import SHARE_KEYS, combine


@dataclass
class Tracker:
    """What one launch has seen so far."""

    spec: JobSpec
    log: RunLog
    progress: Progress
    started: float = field(default_factory=time.time)
    last: dict[str, Any] | None = None
    checkpoint: str | None = None
    resumed_from: dict[str, int] | None = None
    attempts: list[str] = field(default_factory=list)
    failures: int = 0
    noted_failure: bool = False
    failed_at: float | None = None
    restarts: list[Restart] = field(default_factory=list)
    notices: list[dict[str, Any]] = field(default_factory=list)    # checkpoints taken on a notice
    checkpoint_times: dict[int, float] = field(default_factory=dict)
    lost: list[dict[str, Any]] = field(default_factory=list)       # per restart, from the progress board
    attempt_log: list[Attempt] = field(default_factory=list)       # per worker group: steps and times
    attempt_marks: dict[str, dict[str, float]] = field(default_factory=dict)  # rank 0's start-up marks
    recoveries: list[float] = field(default_factory=list)
    samples: int = 0
    train_time: float = 0.0
    data_wait: list[tuple[float, float, float]] = field(default_factory=list)  # per epoch: mean s, max share, time
    timed: list[dict[str, Any]] = field(default_factory=list)  # the epoch reports with a time breakdown
    usage: dict[int, list[list[float]]] = field(default_factory=dict)  # each rank's usage samples this launch
    memory: dict[str, Any] = field(default_factory=dict)  # each rank's peak memory so far (measures.peak_memory)
    log_failed: bool = False
    on_epoch: Callable[[dict[str, Any]], None] | None = None  # e.g. a tuning trial's report to Ray Tune
    plain_reports: int = 0  # reports without the launcher's bookkeeping (a Ray Train function's)
    setup_s: float = field(default_factory=startup.setup_seconds)  # one-off set-up before the tracker began
    recorded_steps: set[int] = field(default_factory=set)  # the steps this launch wrote a metrics row for
    # Per attempt, the steps trained since its last epoch report: [from step, from time, to step, to time].
    spans: dict[str, list[Any]] = field(default_factory=dict)
    epoch_steps: int = 0  # the steps the epoch reports' samples cover
    notes_said: list[str] = field(default_factory=list)  # the workers' notes shown so far
    quorums: list[dict[str, Any]] = field(default_factory=list)  # --strategy ft: each quorum change reported
    replaced: list[Restart] = field(default_factory=list)  # --strategy ft: replicas Ray Train replaced alone

    def handle(self, event: Event) -> None:
        if isinstance(event, Failure):
            self._failure(event)
        elif isinstance(event, Preempting):
            self.progress.note(f"preemption notice: Ray is draining the node(s) of rank(s) "
                               f"{', '.join(map(str, event.ranks))}")
        elif isinstance(event, Restart) and self.spec.replica_groups:
            # Ray Train's controller replaces the failed replica groups alone (all of them at once: the group)
            self.replaced.append(event)
            self.noted_failure = False
            self.progress.note(f"replacing the replica(s) lost to {event.what()}; the others train on")
        elif isinstance(event, Restart):
            self.restarts.append(event)
            self.failed_at, self.noted_failure = self.failed_at or event.time, False
            self.progress.note(f"restarting the worker group after {event.what()}")
        elif isinstance(event, Report):
            self._report(event)

    def _report(self, event: Report) -> None:
        m = event.metrics
        if m.get("kind") == "quorum":
            self._quorum(m)
            return
        if "kind" not in m:  # a Ray Train function's own ray.train.report: one per epoch, by its examples
            m = self._plain_report(m)
        self._attempt_seen(m)
        self._usage(m.pop("usage_ranks", None) or {})
        marks = m.pop("startup_marks", None) or {}
        if marks:
            self.attempt_marks.setdefault(m.get("attempt"), marks)
        for name, when in marks.items():
            startup.mark(name, when)
        self._span(m, marks)
        if self.failed_at is not None and "first_step" in marks:
            # failure seen -> first step of the restarted worker group
            self.recoveries.append(round(marks["first_step"] - self.failed_at, 2))
            self.failed_at = None
        for note in m.pop("notes", None) or []:  # a worker's words for the user, once per run
            if note not in self.notes_said:
                self.notes_said.append(note)
                self.progress.note(note)
        if m.get("kind") == "note":
            return
        if self.last and m.get("global_step") is not None and m.get("global_step") == self.last.get("global_step"):
            # Two reports of one step (an epoch's end and a step checkpoint at the same step can
            # arrive in either order): the later one keeps what only the other said (the digest).
            m = {**self.last, **m}
        self.last = m
        if event.checkpoint:
            self.checkpoint = self.log.storage.to_uri(event.checkpoint)
            self.checkpoint_times.setdefault(int(m.get("global_step", 0)), float(m.get("time", event.time)))
        kind = m.get("kind")
        if kind == "preemption":
            if not any(n["attempt"] == m.get("attempt") for n in self.notices):
                self.notices.append({"attempt": m.get("attempt"), "step": m.get("global_step")})
            self.progress.note(f"checkpointed at step {m.get('global_step')} on the preemption notice; " + (
                "holding until Ray restarts the workers" if m.get("held") else "training on until the deadline"))
        if kind == "epoch":
            self.samples += int(m.get("samples", 0))
            self.train_time += float(m.get("train_time_s", 0.0))
            self._note_wait(m)
            self.memory = peak_memory([self.memory, m])
            self.progress.epoch(m, self.elapsed())
        if kind == "step" and frameworks.get(self.spec.framework).line_per_checkpoint:
            self.progress.note(format_round(m, int(self.spec.params.get("num_boost_round", 0)), self.elapsed()))
        if kind in ("epoch", "step", "preemption"):
            self._record(m)
        if kind == "epoch" and self.on_epoch is not None:
            self.on_epoch(dict(m))

    def _quorum(self, m: dict[str, Any]) -> None:
        """--strategy ft: the replicas training each step changed (one left, or joined and was healed)."""
        self.quorums.append(m)
        healed = ", a replica healed from a peer" if m.get("healed") else ""
        self.progress.note(f"quorum changed at step {m.get('global_step')}: {m.get('before')} -> "
                           f"{m.get('participants')} replicas ({float(m.get('quorum_s') or 0.0):.2f} s for the "
                           f"step's quorum{healed})")
        self._record(m)

    def _plain_report(self, m: dict[str, Any]) -> dict[str, Any]:
        """A report without the launcher's bookkeeping (a Ray Train function's): counted as an epoch,
        its own ``epoch`` (0-based, as in Ray's examples) taken where it gives one."""
        self.plain_reports += 1
        epoch = int(m["epoch"]) + 1 if isinstance(m.get("epoch"), (int, float)) else self.plain_reports
        step = m.get("global_step", m.get("step", self.plain_reports))
        return {**m, "kind": "epoch", "epoch": epoch, "global_step": step, "time": m.get("time", time.time())}

    def elapsed(self) -> float:
        """Seconds since the launch began, less the one-off set-up it waited for."""
        return time.time() - self.started - self.setup_s

    def _span(self, m: dict[str, Any], marks: dict[str, float]) -> None:
        """Where the attempt's training since its last epoch report began and got to: the work
        a launch stopped mid-epoch did, which no epoch report counts."""
        attempt, step, when = m.get("attempt"), m.get("global_step"), m.get("time")
        if attempt is None or not isinstance(step, (int, float)) or not isinstance(when, (int, float)):
            return
        span = self.spans.get(attempt)
        if span is None:  # the attempt's first report: it began training where it resumed, when ready
            start = int((m.get("restored_from") or {}).get("step", 0))
            span = self.spans[attempt] = [start, marks.get("worker_ready"), start, marks.get("worker_ready")]
        if m.get("kind") == "epoch":
            if m.get("samples"):
                self.epoch_steps += max(0, int(step) - int(span[0]))
            self.spans[attempt] = [int(step), float(when), int(step), float(when)]
        elif int(step) > span[2]:
            span[2], span[3] = int(step), float(when)

    def _usage(self, by_rank: dict[str, list[list[float]]]) -> None:
        samples = {int(rank): rows for rank, rows in by_rank.items() if rows}
        if not samples:
            return
        for rank, rows in samples.items():
            self.usage.setdefault(rank, []).extend(rows)
        try:
            self.log.record_usage(samples)
        except OSError as exc:  # the run log is a record: training goes on without it
            self._log_failed(exc)

    def _note_wait(self, m: dict[str, Any]) -> None:
        if isinstance(m.get(SHARE_KEYS[0]), (int, float)):
            self.timed.append({k: m.get(k) for k in (*SHARE_KEYS, "train_time_s", "straggler_rank",
                                                      "straggler_factor")})
        if isinstance(m.get("data_wait_s"), (int, float)) and float(m.get("train_time_s") or 0) > 0:
            self.data_wait.append((float(m["data_wait_s"]), float(m.get("data_wait_max_fraction") or 0.0),
                                   float(m["train_time_s"])))

    def wait_fractions(self) -> tuple[float | None, float | None]:
        """This launch's input wait as a share of its epochs' training time: the ranks' mean, and
        the worst epoch's slowest rank."""
        seconds = sum(t for _, _, t in self.data_wait)
        if not seconds:
            return None, None
        return (round(sum(w for w, _, _ in self.data_wait) / seconds, 4),
                round(max(f for _, f, _ in self.data_wait), 4))

    def samples_per_s(self) -> float:
        """Samples per second of training over what this launch trained: the epochs' own counts,
        and the steps of epochs cut off (at the epochs' samples per step, or --batch-size per
        worker when no epoch ended), timed from rank 0's reports and the progress board."""
        samples, seconds = float(self.samples), self.train_time
        board = {a.attempt: a for a in self.attempt_log}
        per_step = self.samples / self.epoch_steps if self.epoch_steps else \
            float(self.spec.batch_size or 0) * int((self.last or {}).get("world_size") or self.spec.workers)
        for attempt, (first, began, last, ended) in self.spans.items():
            seen = board.get(attempt)
            if seen is not None and seen.last_step > last:  # steps trained after the last report
                last, ended = seen.last_step, seen.last_time
            if began is not None and ended is not None and last > first and ended > began:
                samples += (last - first) * per_step
                seconds += ended - began
        return round(samples / seconds, 2) if seconds > 0 else 0.0

    def _record(self, m: dict[str, Any]) -> None:
        """The run log's line for a report; storage refusing writes is said once, not raised."""
        if isinstance(m.get("global_step"), (int, float)):
            self.recorded_steps.add(int(m["global_step"]))
        try:
            self.log.record(m)
        except OSError as exc:
            self._log_failed(exc)

    def _log_failed(self, exc: OSError) -> None:
        """Storage refused a run log write: said once; training goes on."""
        if not self.log_failed:
            self.log_failed = True
            self.progress.note(f"cannot write the run log ({exc.strerror or type(exc).__name__}"
                               f"{': ' + str(exc.filename) if exc.filename else ''}); training goes on")

    def _attempt_seen(self, m: dict[str, Any]) -> None:
        """The first report of a worker group says where it started from."""
        if m.get("attempt") in self.attempts:
            return
        if not self.attempts:
            self.resumed_from = m.get("restored_from")
            if self.resumed_from:
                self.progress.note(f"resumed {resume_point(self.resumed_from, self.spec.epochs)}")
        else:
            back = m.get("restored_from") or {"epoch": 0, "step": 0}
            self._catch_up(int(back["step"]))  # the failed group's checkpoints whose reports were lost
            self.progress.note(f"restarted from the latest checkpoint: {resume_point(back, self.spec.epochs)}")
        self.attempts.append(m.get("attempt"))

    def _failure(self, event: Failure) -> None:
        """Ray reports a failing group on every poll until it acts: note the first one only."""
        self.failures += 1
        if self.noted_failure:
            return
        self.noted_failure = True
        if self.failed_at is None:
            self.failed_at = event.time
        killed = trainer.killed_for_memory(event.errors, self.memory)
        if killed:
            self.progress.note(f"worker group failed: {killed}")
            return
        if not self.spec.max_failures and any(e.startswith("UserError: ") for e in event.errors.values()):
            return  # bad input a worker found: the launch ends with its line alone (trainer.worker_user_error)
        first = min(event.errors)
        what = "a replica" if self.spec.replica_groups else "worker group"
        self.progress.note(f"{what} failed (rank {first}: {trainer.error_line(event.errors[first])})")

    def account(self, board: list[dict[str, Any]]) -> None:
        """Steps and time each restart lost, from the progress board's view of the attempts."""
        self.attempt_log = [Attempt(start_step=int(a["start_step"]), first_time=a["first_time"],
                                    last_step=int(a["last_step"]), last_time=a["last_time"],
                                    marks=self.attempt_marks.get(a.get("attempt"), {}),
                                    attempt=str(a.get("attempt") or ""),
                                    notice_checkpoint_s=a.get("notice_checkpoint_s")) for a in board]
        self.lost = lost_work(self.attempt_log, self.checkpoint_times)

    def _catch_up(self, upto: int) -> None:
        """A restarted group resumes from step ``upto``: the checkpoints the failed group stored up to
        there whose reports died with it get their rows now, before the new group's (in step order)."""
        try:
            found = complete_checkpoints(self.log.storage, self.spec.name)
        except OSError:
            return  # storage that does not answer now: the launch's end tries again
        self.reconcile([(m, p) for m, p in found if m.global_step <= upto], settle=False)

    def reconcile(self, found: list[tuple[Manifest, str]], settle: bool = True) -> None:
        """Trust storage over the reports: checkpoints can land after the last report was seen.

        Ctrl-C aborts Ray Train's controller, and with it the reports it had not passed on,
        while the workers go on storing checkpoints for a moment (a lost node takes its reports
        along the same way). Each checkpoint this launch stored past the last metrics row gets
        its row now, from its manifest (which holds the report's numbers), with its progress
        line; ``settle``: the run then stands at the newest. ``found``: the run's complete
        checkpoints, oldest first (at the launch's end: listed before any is pruned)."""
        after = max(self.recorded_steps, default=-1)  # rows stay in step order: none before the last
        for manifest, path in found:
            if manifest.created < self.started or manifest.global_step <= after:
                continue  # an earlier launch's, or one whose report came
            m = checkpoint_report(manifest)
            self._recovered(m)
            self._record(m)
        if settle and found and found[-1][0].global_step > int((self.last or {}).get("global_step", -1)):
            manifest, path = found[-1]
            self.last = checkpoint_report(manifest)
            self.checkpoint = self.log.storage.to_uri(path)

    def _recovered(self, m: dict[str, Any]) -> None:
        """A checkpoint whose report was cut off, from its manifest: an epoch is counted and shown as
        it would have been; the last worker group's training reached its step (for the rate)."""
        span = self.spans.get(self.attempts[-1]) if self.attempts else None  # the last group's
        step, when = int(m["global_step"]), m.get("time")
        if span and isinstance(when, (int, float)):
            if m["kind"] == "epoch" and span[0] < step:
                # its steps are counted with the epoch's: not again as a cut-off epoch's (the board's view)
                span[:] = [step, float(when), max(span[2], step), max(span[3] or 0.0, float(when))]
            elif step > span[2]:
                span[2], span[3] = step, float(when)
        if m["kind"] == "epoch":
            self.samples += int(m.get("samples", 0))
            self.train_time += float(m.get("train_time_s", 0.0))
            self.memory = peak_memory([self.memory, m])
            at = float(when) - self.started - self.setup_s if isinstance(when, (int, float)) else self.elapsed()
            self.progress.note(f"{format_epoch(m, self.spec.epochs, at)}  "
                               "(from its checkpoint: the report was cut off)")

    def interruptions(self) -> list[Interruption]:
        out = []
        for i, r in enumerate(self.restarts):
            lost = self.lost[i] if i < len(self.lost) else {}
            out.append(Interruption(cause=r.cause, steps_lost=lost.get("steps_lost"),
                                    time_lost_s=lost.get("time_lost_s"),
                                    resumed_from_step=lost.get("resumed_from_step"),
                                    recovery_s=self.recoveries[i] if i < len(self.recoveries) else None))
        return out

    def summary(self, status: RunStatus, error: str | None = None, model: str | None = None) -> RunSummary:
        m = self.last or {}
        interruptions = self.interruptions()
        return RunSummary(
            name=self.spec.name, status=status, workload=self.spec.workload, framework=self.spec.framework,
            backend=self.spec.backend, strategy=self.spec.strategy, workers=self.spec.workers,
            final_workers=m.get("world_size"),
            epochs=self.spec.epochs, epochs_completed=m.get("epoch", 0), steps_completed=m.get("global_step", 0),
            metrics=pick_metrics(m),
            samples_per_s=self.samples_per_s(),
            data_wait_fraction=self.wait_fractions()[0], data_wait_max_fraction=self.wait_fractions()[1],
            **dict(zip(("time_shares", "stragglers"), combine(self.timed))), usage=summarise_usage(self.usage),
            **self.memory,
            checkpoint=self.checkpoint, resumed_from=self.resumed_from, restarts=len(self.restarts),
            preemptions=sum(1 for r in self.restarts if r.cause == "preemption"),
            preemption_notices=len(self.notices),
            notice_checkpoint_s=max((a.notice_checkpoint_s for a in self.attempt_log
                                     if a.notice_checkpoint_s is not None), default=None),
            steps_lost=sum(int(i.steps_lost or 0) for i in interruptions),
            time_lost_s=round(sum(float(i.time_lost_s or 0.0) for i in interruptions), 2),
            interruptions=interruptions, attempts=self.attempt_log, recovery_s=self.recoveries,
            quorum_changes=len(self.quorums), replicas_replaced=len(self.replaced),
            quorum_change_s=[round(float(q.get("quorum_s") or 0.0), 3) for q in self.quorums],
            weights_sha256=m.get("weights_sha256"), wall_s=round(self.elapsed(), 2), setup_s=round(self.setup_s, 2),
            launch=self.log.launch, run_dir=self.log.uri(), error=error, model=model or m.get("model"),
            model_note=m.get("model_note") if model or m.get("model") else None, mlflow=self.log.tracked())


def checkpoint_report(manifest: Manifest) -> dict[str, Any]:
    """The report a checkpoint was stored with, as far as its manifest keeps it (the numbers:
    metrics, samples, times), marked ``from_checkpoint``."""
    return {**manifest.metrics, "kind": "step" if manifest.step_in_epoch else "epoch", "epoch": manifest.epoch,
            "step_in_epoch": manifest.step_in_epoch, "global_step": manifest.global_step,
            "world_size": manifest.world_size, "from_checkpoint": 1}


def lost_work(attempts: list[Attempt], checkpoint_times: dict[int, float]) -> list[dict[str, Any]]:
    """Steps and seconds each restart cost, from consecutive attempts.

    Steps lost: the steps the earlier attempt trained past the step the next
    one resumed from (they were trained twice). Time lost: from the moment
    training first reached the resumed-from step (the checkpoint's time) to
    the next attempt's first step; it covers redone steps, waiting out a
    notice, and restarting the workers.
    """
    out = []
    for before, after in zip(attempts, attempts[1:]):
        resumed = int(after.start_step)
        # A checkpoint the controller never reported (one taken just before a resize, or written
        # by the survivors of a lost node) at the step the group stopped: reached when rank 0 last
        # noted a step. Otherwise, without its time, the attempt's start (the most it can be).
        stopped_there = resumed >= int(before.last_step)
        reached = checkpoint_times.get(resumed, before.last_time if stopped_there else before.first_time)
        out.append({"resumed_from_step": resumed,
                    "steps_lost": max(0, int(before.last_step) - resumed),
                    "time_lost_s": round(max(0.0, after.first_time - reached), 2)})
    return out
