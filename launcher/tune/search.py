"""A tuning run, driver side: check, connect, let Ray Tune run the trials, write the results.

:func:`run` does every check it can before a trial starts (the definition,
the job's data and backend, whether ``maxParallelTrials`` trials of
``--workers`` workers fit on the cluster), then hands the search to Ray Tune:
its search algorithm (Optuna's TPE for AI Platform's default Bayesian
search, Tune's random or grid search otherwise), ``max_concurrent_trials``,
ASHA when ``enableTrialEarlyStopping`` is on. Each trial is
:func:`launcher.tune.trial.run_trial`, a whole distributed run.

The tuning run's folder ``<storage>/<name>/`` holds ``tuning.json`` (the
definition), ``tune/`` (Ray Tune's experiment state), one run folder per trial,
and at the end ``trials.json``, ``trials.csv``, ``tuning.png`` and
``summary.json``. Launching the same ``--name`` again restores Ray Tune's state:
finished trials stay as they are, unfinished ones resume from their runs'
checkpoints, and the search goes on up to ``maxTrials``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, TextIO

from launcher import _ray
from launcher.driver import placement, session, trainer
from launcher.driver.progress import Progress
from launcher.driver.script import check_backend, install_everywhere, is_shipped
from launcher.errors import UserError
from launcher.storage import Storage
from launcher.storage.runlock import RunLock
from launcher.storage.runlog import TUNING, RunRecord
from launcher.summary import RunStatus, TuningSummary
from launcher.tune import results
from launcher.tune.results import earlier_rows
from launcher.tune.study import STATE_DIR, Study, same_definition
from launcher.tune.trial import trainable as trial_trainable

TRIAL_DRIVER = {"CPU": 0, _ray.HEAD_RESOURCE: 0.001}  # a trial's own driver: no CPU, on the head (never preempted)
ASHA_REDUCTION = 2      # ASHA keeps the best 1/2 of the trials at each rung (few epochs: gentle)


@dataclass
class Outcome:
    """What :func:`run` returns: the summary (also summary.json) and the trials' rows."""

    summary: TuningSummary
    rows: list[dict[str, Any]]
    interrupted: bool = False


def run(study: Study, *, verbose: bool = False, out: TextIO | None = None) -> Outcome:
    """Run (or continue) the tuning run ``study``.

    Raises:
        UserError: bad input, found before any trial starts, or a metric tag the trials never report.
        Unreachable: the Ray cluster named by --address does not answer.
    """
    out = out or sys.stderr
    started = time.time()
    study.check()
    storage = Storage.resolve(study.spec.storage)
    storage.check_writable()
    _check_job(study, out)
    record = study.to_record()
    lock = RunLock(storage, study.name)
    lock.acquire()
    tracking = None
    try:
        _keep_definition(storage, study, record)
        tracking = results.track(study, storage, lambda text: note(out, text))
        workers = study.hp.maxParallelTrials * study.spec.workers
        shipped = _shipped(study)
        note(out, f"tuning run {study.name}: up to {study.hp.maxTrials} trial(s), {study.hp.maxParallelTrials} at "
                  f"a time, {study.spec.workers} worker(s) each; {study.hp.goal.lower()} {study.metric()}")
        if not (study.spec.address or os.environ.get("RAY_ADDRESS")):
            session.check_local_fit(workers, study.spec.cpus_per_worker)
        with session.connect(study.spec.address, workers=workers, cpus_per_worker=study.spec.cpus_per_worker,
                             verbose=verbose, workload=study.spec.workload if study.program is None else None,
                             program=study.program.runtime_env() if shipped else None) as conn:
            placement.check(study.spec, [n.labels for n in conn.nodes], lambda text: note(out, text))
            _check_fits(study, conn.nodes)
            if study.program is not None and study.program.requirements:
                install_everywhere(study.program, study.program.to_config(shipped), conn.nodes, _Notes(out))
            trials, tally = _fit(study, storage, verbose, out, lock, conn.local)
    except BaseException:
        if tracking is not None:
            tracking.end(RunStatus.CANCELLED)
        raise
    finally:
        lock.release()
    if tally.bad_metric:
        if tracking is not None:
            tracking.end(RunStatus.FAILED)
        raise UserError(tally.bad_metric, "set hyperparameterMetricTag to a metric the job reports")

    rows = results.rows(study, trials, storage, tally)
    interrupted = tally.interrupted
    summary = results.write(study, storage, rows, started=started, interrupted=interrupted,
                            stopped=tally.why_stopped, tracking=tracking)
    return Outcome(summary, rows, interrupted)


def note(out: TextIO, text: str) -> None:
    print(f"[tune] {text}", file=out, flush=True)


class _Notes:
    """The ``note(text)`` object install_everywhere wants."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def note(self, text: str) -> None:
        note(self.out, text)


def _shipped(study: Study) -> bool:
    if study.program is None:
        return False

    return is_shipped(study.program, study.spec.address)


def _check_job(study: Study, out: TextIO) -> None:
    """The checks a run of the job does before Ray starts, on the first trial's job."""
    first = {p.parameterName: p.extremes()[0] for p in study.hp.params}
    spec = study.trial_spec(first, "trial_check")
    if study.program is not None:
        check_backend(spec)
        if _shipped(study):
            from launcher.driver import code

            code.check_size(study.program.folder, what="the program's folder")
        return
    from launcher.driver import launch

    launch.preflight(spec, Progress(0, enabled=False))


def _keep_definition(storage, study: Study, record: dict[str, Any]) -> None:
    """Write tuning.json on the first launch; later launches must define the same search."""
    found = RunRecord(storage, study.name)
    try:
        recorded = found.tuning()
    except ValueError as exc:
        raise UserError(str(exc), "restore it, or start a tuning run under another --name") from None
    if recorded is None:
        if found.exists():
            raise UserError(f"--name {study.name} is a training run in {study.spec.storage}, not a tuning run",
                            "pass another --name")
        storage.write_text(json.dumps(record, indent=1, default=str), study.name, TUNING)
        return
    changed = same_definition(recorded, record)
    if changed:
        raise UserError(f"tuning run {study.name} was started with a different {changed}",
                        "launch it again with the same YAML and flags, or pass another --name")


def _check_fits(study: Study, nodes) -> None:
    spec, hp = study.spec, study.hp
    can = session.placeable_workers(nodes, spec.cpus_per_worker, spec.gpus_per_worker)
    if can < spec.workers:
        session.check_fits(nodes, spec.workers, spec.cpus_per_worker, spec.gpus_per_worker)
    wanted = hp.maxParallelTrials * spec.workers
    if can < wanted:
        shape = f"{spec.cpus_per_worker:g} CPU" + (f" + {spec.gpus_per_worker:g} GPU" if spec.gpus_per_worker else "")
        raise UserError(f"maxParallelTrials {hp.maxParallelTrials} x {spec.workers} worker(s) of {shape} is {wanted} "
                        f"workers; the Ray cluster has room for {can}",
                        f"set maxParallelTrials to {can // spec.workers} or less, use fewer --workers, or add nodes")


def _fit(study: Study, storage, verbose: bool, out: TextIO, lock, local: bool) -> tuple[list, Any]:
    """Build (or restore) the Tuner, run it, and return its trials and the tally of what happened."""
    from ray import tune

    trainer.apply_ray_train_env(local)
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"  # the Watch names a missing metric in one line
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # verbose=0 then prints nothing: the Watch says it all
    if not verbose:
        logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    from launcher.tune import watch as watching

    tally = watching.start(study, out, lock, storage)
    tally.recall(earlier_rows(storage, study.name))
    watch = watching.Watch()
    trainable = tune.with_resources(trial_trainable(study), TRIAL_DRIVER)
    path = storage.path(study.name, STATE_DIR)
    fs = None if storage.is_local else storage.fs
    run_config = tune.RunConfig(name=STATE_DIR, storage_path=storage.path(study.name), storage_filesystem=fs,
                                callbacks=[watch], stop=watch, verbose=0,
                                failure_config=tune.FailureConfig(max_failures=0))
    if tune.Tuner.can_restore(path, storage_filesystem=fs):
        note(out, "continuing: finished trials are kept, unfinished ones resume from their checkpoints")
        # The restored RunConfig brings its own Watch (stateless: it reports to this launch's tally).
        tuner = tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=False,
                                   restart_errored=False, storage_filesystem=fs)
    else:
        tuner = tune.Tuner(trainable, param_space=study.hp.space(), tune_config=_tune_config(study),
                           run_config=run_config)
    with _interrupts_noted(tally):
        tuner.fit()
    return tally.trials, tally


@contextlib.contextmanager
def _interrupts_noted(tally) -> Iterator[None]:
    """Meanwhile a SIGINT handler installed (Ray Tune's: it ends the search gracefully and
    saves its state, so running trials resume next time) notes the signal in ``tally`` first:
    Tune's results do not say that the search was interrupted."""
    install = signal.signal

    def noting(signum, handler):
        if signum == signal.SIGINT and callable(handler):
            inner = handler

            def handler(sig, frame):  # noqa: F811 - Tune's handler, noted first
                tally.interrupted = True
                inner(sig, frame)
        return install(signum, handler)

    signal.signal = noting
    try:
        yield
    finally:
        signal.signal = install


def _tune_config(study: Study):
    from ray import tune

    hp = study.hp
    metric, mode = study.metric(), hp.mode
    if hp.algorithm == "GRID_SEARCH":
        from ray.tune.search.basic_variant import BasicVariantGenerator

        points = hp.grid_points()
        search = BasicVariantGenerator(points_to_evaluate=points, random_state=study.spec.seed,
                                       max_concurrent=hp.maxParallelTrials)
        samples = len(points)
    elif hp.algorithm == "RANDOM_SEARCH":
        from ray.tune.search.basic_variant import BasicVariantGenerator

        search = BasicVariantGenerator(random_state=study.spec.seed, max_concurrent=hp.maxParallelTrials)
        samples = hp.maxTrials
    else:  # AI Platform's default is Bayesian optimisation: Optuna's TPE sampler
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        search, samples = OptunaSearch(seed=study.spec.seed), hp.maxTrials
    scheduler = None
    if hp.enableTrialEarlyStopping:
        from launcher.tune.watch import EarlyStopping

        program = study.program is not None
        scheduler = EarlyStopping(time_attr="training_iteration" if program else "epoch",
                                  max_t=1000 if program else max(1, study.spec.epochs or 1),
                                  grace_period=1, reduction_factor=ASHA_REDUCTION)
    # Tune caps a Searcher (Optuna) with max_concurrent_trials; its own generator takes the cap itself.
    limited = hp.algorithm == "ALGORITHM_UNSPECIFIED"
    return tune.TuneConfig(metric=metric, mode=mode, search_alg=search, scheduler=scheduler, num_samples=samples,
                           max_concurrent_trials=hp.maxParallelTrials if limited else None)
