"""From a JobSpec to a running Ray Train trainer: the configs, and ``fit()`` with a pump.

Every trainer the launcher starts (a training run, a script run, the warm
head's warm-up) gets its Ray Train settings, scaling and run configs here,
and :func:`fit` runs it while a thread hands the driver what the workers
and the controller said, so both kinds of run stop, fail and get
interrupted the same way.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from launcher.driver import placement
from launcher.summary import RunStatus

POLL_S = 0.5
HEALTH_CHECK_S = 0.2
PREEMPTION_POLL_S = 1.0
INTERRUPTED = "interrupted (SIGINT/SIGTERM); run again with the same --name to resume"


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


# Ray Train's preemption watcher: an actor per worker group that polls the nodes' drain state.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_SET_HERE: dict[str, str] = {}  # what apply_ray_train_env set, and to what (the rest is the user's)
# An elastic group looks for room to grow back this often (Ray Train's default: 60 s, so a
# replacement node that joined waited up to a minute before the group used it).
RESIZE_CHECK_S = 5.0
_local_ray = False  # connected to a local Ray the launcher runs: this launch's own, or the warm head


def set_local_ray(value: bool) -> None:
    """Called by launcher.driver.session when it connects (True: a local Ray this launch started,
    or `launcher up`'s warm head) and when it disconnects (False)."""
    global _local_ray
    _local_ray = bool(value)


def on_cluster() -> bool:
    """Connected to a cluster the launcher did not start (its nodes, and an autoscaler, come and go)."""
    return not _local_ray


def _watcher_on() -> bool:
    """Ray Train's preemption watcher is on (read as Ray reads its boolean settings)."""
    value = os.environ.get(PREEMPTION_WATCHER_ENV)
    return True if value is None else value.strip().lower() in ("1", "true")


def notices_possible() -> bool:
    """Whether a preemption notice can reach this run (after :func:`apply_ray_train_env`): only
    through Ray Train's preemption watcher. Without it ``get_preemption_info()`` always answers
    None, and the workers skip asking (a barrier across ranks every few steps)."""
    return _watcher_on()


def restarts_possible(spec) -> bool:
    """Whether Ray Train can restart this run's worker group (after :func:`apply_ray_train_env`):
    a failure budget, preemptions it watches for, or an elastic group on a cluster whose nodes
    come and go. Without any, nothing needs to track how far each group got."""
    if spec.max_failures != 0 or _watcher_on():
        return True
    return not _local_ray and spec.min_workers is not None


# A fixed-size group waiting for a node Ray Train asks for (on GCE, a preempted VM's replacement:
# minutes) gives up after Ray's 60 s and restarts as a "failure"; nothing else could fit it.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
FIXED_START_TIMEOUT_S = 900.0


def apply_ray_train_env(fixed: bool = False) -> None:
    """Set :func:`ray_train_env` here (values the user set win), before a trainer is built.

    On a local Ray the launcher runs (:func:`set_local_ray`: the launch's own or the warm head) no
    node is preempted, so Ray Train's preemption watcher is left out: one process less starting
    while the workers set up (0.6-1.2 s of a warm 2-worker start on 2 cores), and no drain-state
    poll every second (on 2 cores an idle Ray actor costs about 0.7 % of a core). To rehearse a
    preemption on the warm head (`launcher preemption watch` with a fake metadata server), set
    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1: a value the user set wins. On a cluster, a ``fixed``-size
    group waits up to :data:`FIXED_START_TIMEOUT_S` for its nodes."""
    wanted = ray_train_env()
    if _local_ray:
        wanted[PREEMPTION_WATCHER_ENV] = "0"
    elif fixed:
        # An elastic group keeps Ray's 60 s: it tries again at the size that fits then.
        wanted[START_TIMEOUT_ENV] = str(FIXED_START_TIMEOUT_S)
    for key, value in list(_SET_HERE.items()):
        if os.environ.get(key) != value:  # changed since by someone else: theirs now
            del _SET_HERE[key]
        elif key not in wanted:  # set for an earlier run in this process, not wanted now
            del os.environ[key], _SET_HERE[key]
    for key, value in wanted.items():
        if key in _SET_HERE or key not in os.environ:
            os.environ[key] = _SET_HERE[key] = value


def is_elastic(spec) -> bool:
    """--min-workers below --workers: the group may run smaller than asked."""
    return spec.min_workers is not None and spec.min_workers < spec.workers


def scaling_config(spec, elastic: bool = True):
    """Workers, their resources, the nodes they must run on (--machine-type and
    --primary-machine-type, on a cluster) and, when ``elastic`` and --min-workers is set, the range."""
    from ray.train import ScalingConfig

    resources = {"CPU": spec.cpus_per_worker}
    if spec.gpus_per_worker:
        resources["GPU"] = spec.gpus_per_worker
    shrinks = elastic and is_elastic(spec)
    extra = {"elastic_resize_monitor_interval_s": RESIZE_CHECK_S} if shrinks else {}
    return ScalingConfig(num_workers=(spec.min_workers, spec.workers) if shrinks else spec.workers,
                         use_gpu=spec.gpus_per_worker > 0, resources_per_worker=resources,
                         label_selector=placement.label_selector(spec), **extra)


def run_config(spec, storage, *, max_failures: int, keep_checkpoints: int | None = None,
               callbacks: list | None = None):
    """The run's name and storage (a second launch of the same name resumes), the failure
    budget (preemptions have their own, unlimited one) and the callbacks."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    return RunConfig(
        name=spec.name, storage_path=storage.root,
        storage_filesystem=None if storage.is_local else storage.fs,
        checkpoint_config=CheckpointConfig(num_to_keep=keep_checkpoints) if keep_checkpoints else None,
        # Not Ray's relax_collectives_on_preemption: with it an announced preemption cost a step
        # (the survivors' report ran ahead of the preempted rank's; seen in the chaos lab), and it
        # does nothing when rank 0 is preempted. A node reclaimed before the notice's checkpoint
        # commits is covered by the survivors' own checkpoint (launcher.worker.loop.Session.salvage).
        failure_config=FailureConfig(max_failures=max_failures, max_preemption_failures=-1),
        callbacks=callbacks or [],
    )


@dataclass
class FitOutcome:
    status: RunStatus
    error: str | None = None
    result: Any = None  # Ray Train's Result when the run succeeded


@dataclass
class _Abortable:
    """A run fitting in this process, and how to abort it (see :func:`stop_running`)."""

    abort: Callable[[float], bool]
    reason: str | None = None  # set once an abort was asked for


_RUNNING: dict[int, _Abortable] = {}
_RUNNING_LOCK = threading.Lock()


def stop_running(reason: str, timeout_s: float = 30.0) -> int:
    """Abort every run fitting in this process, as Ctrl-C would, and return how many.

    For a process that cannot send itself SIGINT because its run is fitted in a thread:
    a Ray Tune trial that Tune stops (ASHA, an interrupted search). Each of those runs ends
    CANCELLED with ``reason`` as its error.
    """
    with _RUNNING_LOCK:
        running = list(_RUNNING.values())
    for run in running:
        run.reason = reason
    return sum(bool(run.abort(timeout_s)) for run in running)


def prepare_trainer(ray_trainer):
    """The launcher's settings that depend on the Ray this process is connected to: on a local
    Ray there is no autoscaler, so a fixed-size group sends it no resource requests (see
    launcher.backends.raytrain.FixedWithoutRequests). Returns ``ray_trainer``."""
    if _local_ray and hasattr(ray_trainer, "request_resources"):
        ray_trainer.request_resources = False
    return ray_trainer


def fit(trainer, drain: Callable[[], None], *, verbose: bool = False, poll_s: float = POLL_S,
        abort: Callable[[float], bool] | None = None, limit_s: float | None = None) -> FitOutcome:
    """``trainer.fit()`` while a thread calls ``drain()`` every ``poll_s`` (and once after).

    Ctrl-C (and SIGTERM, which the CLI turns into it) ends the run as CANCELLED;
    a failure of the workers as FAILED with one line naming the rank and its error.
    ``abort(timeout_s)`` lets :func:`stop_running` end the run from another thread, as
    CANCELLED too; so does ``limit_s`` (``--max-run-s``) once the fit has run that long.
    """
    prepare_trainer(trainer)
    stop = threading.Event()
    me = _Abortable(abort) if abort is not None else None
    if me is not None:
        with _RUNNING_LOCK:
            _RUNNING[id(me)] = me

    started = time.monotonic()

    def pump() -> None:
        while True:
            done = stop.wait(poll_s)
            drain()
            if done:
                return
            if limit_s is not None and me is not None and me.reason is None \
                    and time.monotonic() - started >= limit_s:
                me.reason = time_limit_reason(limit_s)
                threading.Thread(target=me.abort, args=(30.0,), name="launcher-time-limit", daemon=True).start()

    pumper = threading.Thread(target=pump, name="launcher-pump", daemon=True)
    pumper.start()
    outcome = FitOutcome(RunStatus.FAILED)
    try:
        outcome.result = trainer.fit()
        outcome.status = RunStatus.SUCCEEDED
        if me is not None and me.reason is not None:
            outcome.status, outcome.error = RunStatus.CANCELLED, me.reason
    except (KeyboardInterrupt, SystemExit):
        # Ray Train's own SIGINT handler aborts the workers, then exits via SystemExit.
        outcome.status, outcome.error = RunStatus.CANCELLED, INTERRUPTED
    except Exception as exc:  # Ray Train wraps worker errors in TrainingFailedError
        if me is not None and me.reason is not None:  # the aborted controller's process ends
            outcome.status, outcome.error = RunStatus.CANCELLED, me.reason
        else:
            if verbose:
                traceback.print_exc()
            outcome.error = describe_failure(exc)
    finally:
        stop.set()
        pumper.join(timeout=30)
        if me is not None:
            with _RUNNING_LOCK:
                _RUNNING.pop(id(me), None)
    return outcome


def time_limit_reason(limit_s: float) -> str:
    """The run's error when --max-run-s stopped it."""
    return (f"stopped: the time limit (--max-run-s {limit_s:g}, a job file's maxRunningTime or timeout) passed; "
            "the same --name resumes from the last checkpoint")


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
