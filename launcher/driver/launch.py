"""One launch of a run: a validated JobSpec in, a finished (or resumed) run's summary out.

:func:`run` checks everything it can before any worker starts (storage,
data, backend, cluster size), connects to Ray, builds the backend's Ray
Train V2 trainer with a stable run name (so a second launch resumes),
shows progress as reports arrive, exports the final model if rank 0 could
not, and writes the run log.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO

import workloads
from launcher import _deferred, backends, frameworks
from launcher.data import cache as shard_cache
from launcher.driver import runpath, script, session, startup, trainer
from launcher.driver.progress import Progress
from launcher.driver.replacement import Replacements
from launcher.driver.tracker import Tracker
from launcher.errors import UserError
from launcher.measures import pick_metrics
from launcher.spec import STRATEGY_EXTRAS, JobSpec
from launcher.storage import Storage, datacache, gcs
from launcher.storage.checkpoint import Manifest, complete_checkpoints, prune, resume_point
from launcher.storage.runlock import RunLock
from launcher.storage.runlog import RunLog
from launcher.summary import Preempting, Restart, RunStatus, RunSummary
from launcher.worker import pool, usage

if TYPE_CHECKING:
    from launcher.driver.script import ProgramRun

RESUME_CANDIDATES = 5  # complete checkpoints offered to the workers, newest first


def preflight(spec: JobSpec, progress: Progress) -> tuple[Storage, RunLog, list[tuple[Manifest, str]]]:
    """Every check that needs no Ray: storage, data (a streamed shard set's largest shard against
    the cache's limit too), backend, the existing run."""
    frameworks.get(spec.framework).require()  # its extra installed, before the run's folder is made
    if spec.strategy in STRATEGY_EXTRAS:
        _deferred.require(STRATEGY_EXTRAS[spec.strategy], f"--strategy {spec.strategy}")
    storage, log = runpath.open_run(spec, progress)
    workload = workloads.get(spec.workload)
    # A shard set the workers will stream (named by --data or a --param) must fit the node's cache.
    shard_cache.check_sets({"--data": spec.data, **{f"--param {k}": v for k, v in spec.params.items()}},
                           spec.data_cache_gb)
    data = datacache.local_data(spec.data, progress.note)
    try:
        workload.check_data(data, spec.params)
        if workloads.is_reference(spec.workload):  # the user's data function, tried as rank 0 runs it
            workloads.user.check_data(workload, spec.workload, data, spec.params, spec.workers)
    except (workloads.DataError, workloads.WorkloadError) as exc:
        raise UserError(str(exc)) from None
    samples = workload.samples(data, "train", spec.params)
    if samples is not None and samples < spec.workers:
        raise UserError(f"{spec.workload} has {samples} training sample(s) for {spec.workers} workers: a worker "
                        "would have none", "use fewer --workers, or more data")
    backend = backends.get(spec.backend)
    with startup.setup_phase():  # a first Horovod build: minutes that are not the run's
        backend.prepare(spec.framework, progress.note)
    reason = backend.unavailable_reason(spec.framework)
    if reason:
        raise UserError(f"backend {spec.backend} cannot run {spec.framework} here: {reason}")
    checkpoints = complete_checkpoints(storage, spec.name)
    if checkpoints and checkpoints[-1][0].strategy != spec.strategy:
        m = checkpoints[-1][0]
        raise UserError(f"run {spec.name} resumes from its checkpoint of step {m.global_step}, written with "
                        f"--strategy {m.strategy}, not {spec.strategy}: a sharded state and a whole one are "
                        "laid out differently", f"resume with --strategy {m.strategy}, or give a new --name")
    return storage, log, checkpoints


def run(spec: JobSpec, program: "ProgramRun | None" = None, *, verbose: bool = False, show_progress: bool = True,
        on_report: Callable[[dict[str, Any]], None] | None = None, out: TextIO | None = None,
        progress_out: TextIO | None = None) -> RunSummary:
    """Train ``spec`` (validated) and return the summary; resumes a run of the same name.

    ``program``: run the user's own program (a --script, a --package's module, a container) on
    the workers instead of a workload (:mod:`launcher.driver.script`); the summary's
    ``exit_status`` is then the program's, its ranks' lines go to ``out`` (default stderr) and the
    progress to ``progress_out``. ``on_report``: called on the driver's pump thread with rank 0's
    metrics after each epoch (a program: each entry it writes to its hypertune file), as a
    tuning trial hands them to Ray Tune.

    Raises:
        UserError: bad input found before any worker started, or by a worker (its run log
            then records the launch as failed with the same line).
        Unreachable: the Ray cluster named by --address (or RAY_ADDRESS) does not answer.
    """
    if program is not None:
        return script.run_program(spec, program, verbose=verbose, out=out, progress_out=progress_out,
                                  on_metrics=on_report)
    startup.begin_run()
    launched = time.time()
    _prefetch_ray_train()
    progress = Progress(spec.epochs, enabled=show_progress)
    storage, log, checkpoints = preflight(spec, progress)
    startup.mark("checks_done")
    if checkpoints and checkpoints[-1][0].epoch >= spec.epochs:
        summary = already_done(spec, log, *checkpoints[-1])
    else:
        try:
            with runpath.connected(spec, storage, progress, verbose=verbose, workload=spec.workload,
                                   workers_needed=spec.min_workers or spec.workers, preload=True) as (lock, conn):
                summary = _train(spec, storage, log, checkpoints, progress, launched, verbose, lock, conn, on_report)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM before Ray Train took over (e.g. while Ray starts)
            progress.close()
            summary = stopped_before_training(spec, log, checkpoints, launched)
    startup.mark("done")
    summary.startup = startup.report(startup.MARKS)
    return summary


# What the driver needs from Ray Train, imported while the checks run and Ray starts.
PREFETCH = ("ray.train", "launcher.driver.events", "launcher.backends.raytrain")


def _prefetch_ray_train() -> None:
    """Import Ray Train (and with it Ray Data and pandas: ~0.8 s on 2 cores) in a thread.

    A new local Ray takes ~3 s to start in its own processes while the driver only waits, so
    the import costs a cold launch nothing then (measured: Ray start plus the import 3.1 s in
    parallel against 5.3 s one after the other). An import that fails here is simply made
    again, and fails, where the module is used."""
    def load() -> None:
        for name in PREFETCH:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported where the module is really imported
                return

    threading.Thread(target=load, name="launcher-prefetch", daemon=True).start()


def _train(spec: JobSpec, storage: Storage, log: RunLog, checkpoints: list[tuple[Manifest, str]],
           progress: Progress, launched: float, verbose: bool, lock: RunLock, conn: session.Connection,
           on_epoch=None) -> RunSummary:
    """Holding the run's lock: train, export, and write the run log's start and end."""
    log.begin(spec.to_dict())
    checkpoints = _prune(spec, storage, progress, checkpoints)  # what a launch killed hard left too
    tracker = Tracker(spec, log, progress, started=launched, on_epoch=on_epoch)
    if checkpoints:
        m = checkpoints[-1][0]
        progress.note(f"run {spec.name} exists: resuming {resume_point(m.position, spec.epochs)}")
    progress.note(starting_line(spec))
    resume = [path for _, path in reversed(checkpoints)][:RESUME_CANDIDATES]
    outcome = _fit(spec, storage, tracker, resume, verbose, lock, conn)
    startup.mark("fit_returned")
    if conn.pool_s:
        _refill_pool(spec, conn, progress)
    progress.close()
    found = complete_checkpoints(storage, spec.name)
    tracker.reconcile(found)  # before pruning: a checkpoint whose report Ctrl-C cut off gets its metrics row
    _prune(spec, storage, progress, found)
    if tracker.resumed_from is None and checkpoints:  # stopped before rank 0 reported where it resumed
        tracker.resumed_from = checkpoints[-1][0].position
    model_uri = None
    result = outcome.result
    if outcome.status == RunStatus.SUCCEEDED and result is not None and result.checkpoint is not None:
        if workloads.is_ray_train(spec.workload):
            # A Ray Train function's checkpoints are its own files: exported where they hold a model
            # the launcher knows (Ray's XGBoost callback's booster); otherwise the function's to export.
            model_uri = _export_ray_train(spec, storage, result.checkpoint)
        else:  # rank 0 exports with its final checkpoint; if that failed, export here
            model_uri = (result.metrics or {}).get("model") or _export(spec, storage, result.checkpoint)
    summary = tracker.summary(outcome.status, error=outcome.error, model=model_uri)
    try:
        log.finish(summary.to_json())
    except OSError as exc:  # storage that stopped taking writes: the summary is still printed
        ray_said = summary.error if summary.error and not summary.error.rstrip().endswith(":") else None
        summary.error = "; ".join(filter(None, (f"storage stopped taking writes: the run log could not be written "
                                                f"({_oserror(exc)}); the checkpoints written so far resume the run",
                                                ray_said)))
        if summary.status == RunStatus.SUCCEEDED:
            summary.status = RunStatus.FAILED
    if outcome.user_error is not None:  # bad input a worker found: one line and exit 2, as before the start
        raise outcome.user_error
    return summary


def _prune(spec: JobSpec, storage: Storage, progress: Progress,
           found: list[tuple[Manifest, str]] | None = None) -> list[tuple[Manifest, str]]:
    """The run's complete checkpoints (``found``: as listed already), oldest first, once those
    beyond --keep-checkpoints are deleted; called holding the run's lock with no worker running.

    Ray Train deletes only the checkpoints its controller registered, so it cannot keep N
    across launches; the launcher does. A Ray Train function's checkpoints have no manifest:
    Ray Train alone keeps N of them."""
    if workloads.is_ray_train(spec.workload):
        return complete_checkpoints(storage, spec.name) if found is None else found
    left, note = prune(storage, spec.name, spec.keep_checkpoints, found)
    if note:
        progress.note(note)
    return left


def _oserror(exc: OSError) -> str:
    where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
    return f"{exc.strerror or type(exc).__name__}{where}"


def _refill_pool(spec: JobSpec, conn: session.Connection, progress: Progress) -> None:
    """On the warm head, once the run's workers are done (whatever the outcome): processes ready
    for the next run (launcher.worker.pool). Never fails the run: without them the next one only
    starts slower."""
    try:
        pool.refill(spec.workers + pool.RAY_TRAIN_ACTORS, conn.pool_s, conn.pool_raylet)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        progress.note(f"no ready processes kept for the next run ({type(exc).__name__}: {exc})")


def _fit(spec: JobSpec, storage: Storage, tracker: Tracker, resume: list[str], verbose: bool,
         lock: RunLock, conn: session.Connection) -> trainer.FitOutcome:
    """Run the trainer while the pump hands the controller's events to the tracker."""
    from launcher.driver.events import EventChannel
    from launcher.worker.entry import train_loop_per_worker

    trainer.apply_ray_train_env(conn.local, fixed=not trainer.is_elastic(spec))
    # The progress board (an actor, and a call from rank 0 every step) tells how much work each
    # restart lost: a run that cannot restart goes without.
    channel = EventChannel(board=trainer.restarts_possible(spec, conn.local), relay=spec.replica_groups)
    config = trainer.run_config(spec, storage, max_failures=spec.max_failures,
                                keep_checkpoints=spec.keep_checkpoints,
                                callbacks=[channel.forwarder, channel.states])
    loop_config = {"spec": spec.to_dict(), "resume": resume, "env": {**conn.env, **gcs.worker_env(), **usage.worker_env()},
                   "board": channel.board, "notices": trainer.notices_possible(spec, conn.local),
                   "launch": tracker.log.launch,
                   "mailbox": channel.mailbox() if spec.replica_groups else None}
    if workloads.is_ray_train(spec.workload):
        loop_config["user_config"] = workloads.function.ray_config(spec)
    ray_trainer = backends.get(spec.backend).trainer(spec, train_loop_per_worker, loop_config,
                                                     trainer.scaling_config(spec), config)

    replacements = Replacements(spec, spec.replace_on_notice and not conn.local, tracker.progress.note)

    def drain() -> None:
        for event in channel.take():
            tracker.handle(event)
            on_membership(spec, event, replacements, tracker.progress.note, on_cluster=not conn.local)
        lock.refresh()

    try:
        return trainer.fit(ray_trainer, drain, local=conn.local, verbose=verbose, abort=channel.abort,
                           limit_s=spec.max_run_s,
                           memory=lambda: tracker.memory)
    finally:
        replacements.withdraw()
        tracker.account(channel.attempts())
        channel.close()


def on_membership(spec: JobSpec, event, replacements: Replacements, note, on_cluster: bool) -> None:
    """A notice: ask for the replacement now. A restart: the preempted node is gone; say what a
    fixed-size group waits for (an elastic one goes on with the nodes that remain)."""
    if isinstance(event, Preempting):
        replacements.on_notice(event.ranks)
    elif isinstance(event, Restart):
        replacements.withdraw()
        if on_cluster and spec.min_workers is None and event.cause == "preemption":
            note(f"waiting for a full group of {spec.workers} workers: the autoscaler brings the preempted "
                 "node's replacement (minutes for a Compute Engine VM; --min-workers goes on without it)")


def starting_line(spec: JobSpec) -> str:
    """The launch's header: what starts, how its model is kept in step (--strategy), which run."""
    return (f"starting {spec.workers} {spec.framework}/{spec.backend} workers (strategy {spec.strategy}) "
            f"for {spec.workload}, run {spec.name}")


def _export(spec: JobSpec, storage: Storage, checkpoint) -> str | None:
    from launcher.worker.export import export

    with checkpoint.as_directory() as d:
        return export(spec, d, storage)


# The file Ray Train's XGBoost callback (ray.train.xgboost.RayTrainReportCallback.CHECKPOINT_NAME)
# checkpoints its booster to, as the launcher's own XGBoost loop does.
RAY_XGBOOST_MODEL = "model.ubj"


def _export_ray_train(spec: JobSpec, storage: Storage, checkpoint) -> str | None:
    """A Ray Train function's last checkpoint as ``<run>/model/``, where it holds a booster that
    Ray's ``RayTrainReportCallback`` wrote: ``model.bst`` and ``model.json`` as the built-in XGBoost
    workload exports them, so ``launcher predict`` and ``serve`` take it. None otherwise."""
    with checkpoint.as_directory() as d:
        if not os.path.isfile(os.path.join(d, RAY_XGBOOST_MODEL)):
            return None
        from launcher.worker.export import export_xgboost

        return export_xgboost(spec, d, storage)


def already_done(spec: JobSpec, log: RunLog, manifest: Manifest, path: str) -> RunSummary:
    """Summary for a run whose checkpoints already cover the requested epochs. A model
    missing from the run (its export was cut off) is exported from ``path`` now."""
    model = log.uri("model") if log.storage.exists(spec.name, "model") else None
    if model is None and manifest.epoch == spec.epochs and not manifest.step_in_epoch:
        import ray.train

        lock = RunLock(log.storage, spec.name)
        lock.acquire()  # the launch that trained it may be exporting it right now: refused then
        try:
            model = _export(spec, log.storage, ray.train.Checkpoint(path, filesystem=log.storage.fs))
        finally:
            lock.release()
    return RunSummary(
        name=spec.name, status=RunStatus.SUCCEEDED, workload=spec.workload, framework=spec.framework,
        backend=spec.backend, strategy=spec.strategy, workers=spec.workers, final_workers=manifest.world_size,
        epochs=spec.epochs,
        epochs_completed=manifest.epoch, steps_completed=manifest.global_step,
        metrics=pick_metrics(manifest.metrics), checkpoint=log.storage.to_uri(path),
        resumed_from=manifest.position, run_dir=log.uri(),
        model=model,
        note=f"nothing to train: the run already completed {manifest.epoch} epoch(s)")


def stopped_before_training(spec: JobSpec, log: RunLog, checkpoints: list[tuple[Manifest, str]],
                            launched: float) -> RunSummary:
    """Summary for a launch stopped by a signal before its workers trained: the run
    stands where its newest complete checkpoint is (written to the run log if it has begun)."""
    m, path = checkpoints[-1] if checkpoints else (None, None)
    summary = RunSummary(
        name=spec.name, status=RunStatus.CANCELLED, workload=spec.workload, framework=spec.framework,
        backend=spec.backend, strategy=spec.strategy, workers=spec.workers, epochs=spec.epochs,
        epochs_completed=m.epoch if m else 0, steps_completed=m.global_step if m else 0,
        checkpoint=log.storage.to_uri(path) if path else None, wall_s=time.time() - launched,
        launch=log.launch or None, run_dir=log.uri(), note="stopped before any worker trained")
    if log.launch:
        try:
            log.finish(summary.to_json())
        except OSError:
            pass  # the summary is still printed
    return summary

