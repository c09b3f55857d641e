"""The training driver: a validated JobSpec in, a finished (or resumed) run out.

:func:`run` checks everything it can before any worker starts (storage,
data, backend, cluster size), connects to Ray, builds the backend's Ray
Train V2 trainer with a stable run name (so a second launch resumes), shows
progress as reports arrive, exports the final model and writes the run log.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import workloads
from launcher import backends
from launcher.storage import datacache
from launcher.storage import gcs
from launcher.driver import localhead
from launcher.driver import session as raysession
from launcher.driver import startup
from launcher.storage.checkpoint import Manifest, complete_checkpoints
from launcher.errors import UserError
from launcher.driver.progress import Progress
from launcher.storage.runlog import RunLog
from launcher.spec import JobSpec
from launcher.summary import RunStatus
from launcher.storage import Storage

POLL_S = 0.5
HEALTH_CHECK_S = 0.2
PREEMPTION_POLL_S = 1.0
METRIC_KEYS = ("loss", "accuracy", "train_loss")


@dataclass
class Tracker:
    """Folds the reports of one launch into what the summary needs."""

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
    restarts: list[dict[str, Any]] = field(default_factory=list)   # cause, time, error
    notices: list[dict[str, Any]] = field(default_factory=list)    # checkpoints taken on a notice
    checkpoint_times: dict[int, float] = field(default_factory=dict)
    lost: list[dict[str, Any]] = field(default_factory=list)       # per restart, from the progress board
    attempt_log: list[dict[str, Any]] = field(default_factory=list)  # per worker group: steps and times
    attempt_marks: dict[str, dict[str, float]] = field(default_factory=dict)  # rank 0's start-up marks
    recoveries: list[float] = field(default_factory=list)
    samples: int = 0
    train_time: float = 0.0

    def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "failure":
            self._failure(event)
            return
        if kind == "preempting":
            self.progress.note(f"preemption notice: Ray is draining the node(s) of rank(s) "
                               f"{', '.join(map(str, event['ranks']))}")
            return
        if kind == "restart":
            self.restarts.append({"cause": event["cause"], "time": event["time"], "error": event["error"]})
            self.failed_at, self.noted_failure = self.failed_at or event["time"], False
            self.progress.note(f"restarting the worker group after a {event['cause']}")
            return
        m = event["metrics"]
        if m.get("attempt") not in self.attempts:
            if not self.attempts:
                self.resumed_from = m.get("restored_from")
                if self.resumed_from:
                    self.progress.note(f"resumed from epoch {self.resumed_from['epoch']}, "
                                       f"step {self.resumed_from['step']}")
            else:
                back = m.get("restored_from") or {"epoch": 0, "step": 0}
                self.progress.note(f"restarted from the latest checkpoint: epoch {back['epoch']}, step {back['step']}")
            self.attempts.append(m.get("attempt"))
        marks = m.pop("startup_marks", None) or {}
        if marks:
            self.attempt_marks.setdefault(m.get("attempt"), marks)
        for name, when in marks.items():
            startup.mark(name, when)
        if self.failed_at is not None and "first_step" in marks:
            # failure seen -> first step of the restarted worker group
            self.recoveries.append(round(marks["first_step"] - self.failed_at, 2))
            self.failed_at = None
        self.last = m
        if event.get("checkpoint"):
            self.checkpoint = self.log.storage.to_uri(event["checkpoint"])
            self.checkpoint_times.setdefault(int(m.get("global_step", 0)), float(m.get("time", event["time"])))
        if m.get("kind") == "preemption":
            if not any(n["attempt"] == m.get("attempt") for n in self.notices):
                self.notices.append({"attempt": m.get("attempt"), "step": m.get("global_step")})
            self.progress.note(f"checkpointed at step {m.get('global_step')} on the preemption notice; " + (
                "holding until Ray restarts the workers" if m.get("held") else "training on until the deadline"))
        if m.get("kind") == "epoch":
            self.samples += int(m.get("samples", 0))
            self.train_time += float(m.get("train_time_s", 0.0))
            self.progress.epoch(m, time.time() - self.started)
        if m.get("kind") in ("epoch", "step", "preemption"):
            self.log.record(m)

    def _failure(self, event: dict[str, Any]) -> None:
        """Ray reports a failing group on every poll until it acts: note the first one only."""
        self.failures += 1
        if self.noted_failure:
            return
        self.noted_failure = True
        if self.failed_at is None:
            self.failed_at = event["time"]
        first = min(event["errors"])
        self.progress.note(f"worker group failed (rank {first}: {event['errors'][first].splitlines()[0]})")

    def account(self, attempts: list[dict[str, Any]]) -> None:
        """Steps and time each restart lost, from the progress board's view of the attempts."""
        from launcher.driver.events import lost_work

        self.lost = lost_work(attempts, self.checkpoint_times)
        # worker_start / model_ready / worker_ready / first_step: where each group's start-up went
        self.attempt_log = [{**{k: a[k] for k in ("start_step", "first_time", "last_step", "last_time")},
                             "marks": self.attempt_marks.get(a.get("attempt"), {})} for a in attempts]

    def reconcile(self, manifest: Manifest, path: str) -> None:
        """Trust storage over the reports: checkpoints can land after the last report was seen
        (for example while Ctrl-C is aborting the workers)."""
        if manifest.global_step > int((self.last or {}).get("global_step", -1)):
            self.last = {**manifest.metrics, "epoch": manifest.epoch, "global_step": manifest.global_step}
            self.checkpoint = self.log.storage.to_uri(path)

    def summary(self, status: RunStatus, **extra: Any) -> dict[str, Any]:
        m = self.last or {}
        interruptions = []
        for i, r in enumerate(self.restarts):
            lost = self.lost[i] if i < len(self.lost) else {}
            interruptions.append({"cause": r["cause"], "steps_lost": lost.get("steps_lost"),
                                  "time_lost_s": lost.get("time_lost_s"),
                                  "resumed_from_step": lost.get("resumed_from_step"),
                                  "recovery_s": self.recoveries[i] if i < len(self.recoveries) else None})
        return {
            "name": self.spec.name, "status": str(status), "workload": self.spec.workload,
            "framework": self.spec.framework, "backend": self.spec.backend, "workers": self.spec.workers,
            "final_workers": m.get("world_size"),
            "epochs": self.spec.epochs, "epochs_completed": m.get("epoch", 0),
            "steps_completed": m.get("global_step", 0),
            "metrics": {k: m[k] for k in METRIC_KEYS if k in m},
            "samples_per_s": round(self.samples / self.train_time, 2) if self.train_time else 0.0,
            "checkpoint": self.checkpoint, "resumed_from": self.resumed_from, "restarts": len(self.restarts),
            "preemptions": sum(1 for r in self.restarts if r["cause"] == "preemption"),
            "preemption_notices": len(self.notices),
            "steps_lost": sum(int(i["steps_lost"] or 0) for i in interruptions),
            "time_lost_s": round(sum(float(i["time_lost_s"] or 0.0) for i in interruptions), 2),
            "interruptions": interruptions, "attempts": self.attempt_log, "weights_sha256": m.get("weights_sha256"),
            "recovery_s": self.recoveries,
            "wall_s": round(time.time() - self.started, 2), "launch": self.log.launch,
            "run_dir": self.log.uri(), **extra,
        }


def preflight(spec: JobSpec, progress: Progress) -> tuple[Storage, RunLog, list[tuple[Manifest, str]]]:
    """Every check that needs no Ray: storage, data, backend, the existing run."""
    storage = Storage.resolve(spec.storage)
    where = storage.check_writable()
    if not storage.is_local:
        progress.note(f"storage: {where}")
    workload = workloads.get(spec.workload)
    try:
        workload.check_data(datacache.local_data(spec.data, progress.note), spec.params)
    except workloads.DataError as exc:
        raise UserError(str(exc)) from None
    reason = backends.get(spec.backend).unavailable_reason(spec.framework)
    if reason:
        raise UserError(f"backend {spec.backend} cannot run {spec.framework} here: {reason}")
    log = RunLog(storage, spec.name)
    log.check_compatible(spec)
    return storage, log, complete_checkpoints(storage, spec.name)


def run(spec: JobSpec, *, verbose: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Train ``spec`` (validated) and return the summary; resumes a run of the same name.

    Raises:
        UserError: bad input found before any worker started.
    """
    startup.begin_run()
    launched = time.time()
    progress = Progress(spec.epochs, enabled=show_progress)
    storage, log, checkpoints = preflight(spec, progress)
    startup.mark("checks_done")
    if checkpoints and checkpoints[-1][0].epoch >= spec.epochs:
        return _already_done(spec, log, *checkpoints[-1])
    head = None if spec.address or os.environ.get("RAY_ADDRESS") else localhead.running_head()
    if head:
        progress.note(f"using the warm local Ray at {head['address']} (`launcher down` stops it)")
    else:
        address = spec.address or os.environ.get("RAY_ADDRESS")
        progress.note(f"connecting to Ray at {address}" if address else "starting a local Ray instance")
    with raysession.connect(spec.address, workers=spec.workers, cpus_per_worker=spec.cpus_per_worker,
                            verbose=verbose) as nodes:
        startup.mark("ray_ready")
        raysession.check_fits(nodes, spec.min_workers or spec.workers, spec.cpus_per_worker, spec.gpus_per_worker)
        log.begin(spec.to_dict())
        tracker = Tracker(spec, log, progress, started=launched)
        if checkpoints:
            m = checkpoints[-1][0]
            progress.note(f"run {spec.name} exists: resuming after epoch {m.epoch} (step {m.global_step})")
        progress.note(f"starting {spec.workers} {spec.framework}/{spec.backend} workers "
                      f"for {spec.workload}, run {spec.name}")
        resume = [path for _, path in reversed(checkpoints)][:5]
        status, error, result = _fit(spec, storage, tracker, resume, verbose)
        startup.mark("fit_returned")
        progress.close()
        latest = complete_checkpoints(storage, spec.name)
        if latest:
            tracker.reconcile(*latest[-1])
        model_uri = None
        if status == RunStatus.SUCCEEDED and result is not None and result.checkpoint is not None:
            # Rank 0 exports with its final checkpoint; if that failed, export here.
            model_uri = (result.metrics or {}).get("model") or _export(spec, storage, result.checkpoint)
        summary = tracker.summary(status, error=error, model=model_uri)
        log.finish(summary)
    startup.mark("done")
    summary["startup"] = startup.report(startup.MARKS)
    return summary


def ray_train_env() -> dict[str, str]:
    """Ray Train settings every run uses (Ray passes them on to its controller and workers)."""
    return {
        # Ray Train's controller polls its workers every 2 s by default, so it notices
        # the end of training up to 2 s late; 0.2 s measured ~2-4 s off a short run.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(HEALTH_CHECK_S),
        # Ray Train polls the nodes' drain state every 5 s by default: 1 s leaves more of
        # GCE's 30 s notice for the checkpoint.
        "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(PREEMPTION_POLL_S),
    }


def _fit(spec: JobSpec, storage: Storage, tracker: Tracker, resume: list[str], verbose: bool):
    """Run the trainer while a thread pumps reports into the tracker."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from launcher.driver.events import EventChannel

    if spec.framework == "tensorflow":
        from launcher.worker.tf_loop import train_loop_per_worker
    else:
        from launcher.worker.torch_loop import train_loop_per_worker

    for key, value in ray_train_env().items():
        os.environ.setdefault(key, value)
    channel = EventChannel()
    run_config = RunConfig(
        name=spec.name, storage_path=storage.root,
        storage_filesystem=None if storage.is_local else storage.fs,
        checkpoint_config=CheckpointConfig(num_to_keep=spec.keep_checkpoints),
        # Preemptions have their own, unlimited budget: only real failures count against --max-failures.
        failure_config=FailureConfig(max_failures=spec.max_failures, max_preemption_failures=-1),
        callbacks=[channel.forwarder, channel.states],
    )
    resources = {"CPU": spec.cpus_per_worker}
    if spec.gpus_per_worker:
        resources["GPU"] = spec.gpus_per_worker
    elastic = spec.min_workers is not None and spec.min_workers < spec.workers
    scaling = ScalingConfig(num_workers=(spec.min_workers, spec.workers) if elastic else spec.workers,
                            use_gpu=spec.gpus_per_worker > 0,
                            resources_per_worker=resources)
    trainer = backends.get(spec.backend).trainer(
        spec, train_loop_per_worker, {"spec": spec.to_dict(), "resume": resume, "env": gcs.worker_env(),
                                            "board": channel.board}, scaling, run_config)

    stop = threading.Event()

    def pump() -> None:
        while True:
            done = stop.wait(POLL_S)
            for event in channel.take():
                tracker.handle(event)
            if done:
                return

    pumper = threading.Thread(target=pump, name="launcher-progress", daemon=True)
    pumper.start()
    status, error, result = RunStatus.FAILED, None, None
    try:
        result = trainer.fit()
        status = RunStatus.SUCCEEDED
    except (KeyboardInterrupt, SystemExit):
        # Ray Train's own SIGINT handler aborts the workers, then exits via SystemExit.
        status, error = RunStatus.CANCELLED, "interrupted (SIGINT/SIGTERM); run again with the same --name to resume"
    except Exception as exc:  # Ray Train wraps worker errors in TrainingFailedError
        if verbose:
            import traceback

            traceback.print_exc()
        error = describe_failure(exc)
    finally:
        stop.set()
        pumper.join(timeout=30)
        tracker.account(channel.attempts())
        channel.close()
    return status, error, result


def describe_failure(exc: BaseException) -> str:
    """One line naming the failing rank and its error, from Ray Train's exception."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank = min(failures)
        inner = failures[rank]
        cause = getattr(inner, "cause", None) or inner
        text = str(cause).strip().splitlines()
        return f"rank {rank}: {type(cause).__name__}: {text[-1] if text else ''}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _export(spec: JobSpec, storage: Storage, checkpoint) -> str | None:
    from launcher.worker.export import export

    with checkpoint.as_directory() as d:
        return export(spec, d, storage)


def _already_done(spec: JobSpec, log: RunLog, manifest: Manifest, path: str) -> dict[str, Any]:
    """Summary for a run whose checkpoints already cover the requested epochs."""
    return {
        "name": spec.name, "status": str(RunStatus.SUCCEEDED), "workload": spec.workload,
        "framework": spec.framework, "backend": spec.backend, "workers": spec.workers,
        "epochs": spec.epochs, "epochs_completed": manifest.epoch, "steps_completed": manifest.global_step,
        "metrics": {k: manifest.metrics[k] for k in METRIC_KEYS if k in manifest.metrics},
        "samples_per_s": 0.0, "checkpoint": log.storage.to_uri(path), "resumed_from": manifest.position, "restarts": 0,
        "preemptions": 0, "steps_lost": 0, "time_lost_s": 0.0,
        "wall_s": 0.0, "launch": None, "run_dir": log.uri(), "error": None,
        "model": log.uri("model") if log.storage.exists(spec.name, "model") else None,
        "note": f"nothing to train: the run already completed {manifest.epoch} epoch(s)",
    }
