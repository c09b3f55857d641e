"""From a JobSpec to a running Ray Train trainer: the configs, and ``fit()`` with a pump.

Every trainer the launcher starts (a training run, a script run, the warm
head's warm-up) gets its Ray Train settings, scaling and run configs here,
and :func:`fit` runs it while a thread hands the driver what the workers
and the controller said, so both kinds of run stop, fail and get
interrupted the same way.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from launcher.driver import placement
from launcher.errors import LauncherError, UserError
from launcher.settings import RAY_TRAIN_SET as SET_BY_LAUNCHER_ENV
from launcher.summary import RunStatus

POLL_S = 0.5
HEALTH_CHECK_S = 0.2
PREEMPTION_POLL_S = 1.0
INTERRUPTED = "interrupted (SIGINT/SIGTERM); run again with the same --name to resume"


def ray_train_env() -> dict[str, str]:
    """Ray Train settings every run uses (Ray passes them on to its controller and workers)."""
    return {
        # Ray Train's controller polls its workers every 2 s by default, so it notices the end
        # of training up to 2 s late; 0.2 s measured ~2-4 s off a short run. It costs the
        # controller 1.7 % of a core all run (0.9 % at 1 s: benchmarks/ray_tax), but the poll is
        # also when Ray Train registers a reported checkpoint: at 1 s a Ray Train function
        # Ctrl-C'd right after ray.train.report resumed from the checkpoint before (a test saw it).
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
def _watcher_on() -> bool:
    """Ray Train's preemption watcher is on (read as Ray reads its boolean settings)."""
    value = os.environ.get(PREEMPTION_WATCHER_ENV)
    return True if value is None else value.strip().lower() in ("1", "true")


def notices_possible(spec, local: bool) -> bool:
    """Whether a preemption notice can reach this run (after :func:`apply_ray_train_env`). Under
    --strategy ft each replica reads its own node's drain state (Ray Train runs no watcher for
    replica groups): on any cluster but a ``local`` Ray, whatever Ray Train's watcher setting says
    (a process that ran a local launch passes its "off" on to the launches it starts). Otherwise
    only through Ray Train's preemption watcher: without it ``get_preemption_info()`` always answers
    None, and the workers skip asking (a barrier across ranks every few steps)."""
    if spec.replica_groups:
        return not local
    return _watcher_on()


def restarts_possible(spec, local: bool) -> bool:
    """Whether Ray Train can restart this run's worker group (after :func:`apply_ray_train_env`):
    a failure budget, preemptions it watches for, or an elastic group on a cluster whose nodes
    come and go. Without any, nothing needs to track how far each group got."""
    if spec.replica_groups:  # a lost replica is replaced alone: the quorum's reports say what it cost
        return False
    if spec.max_failures != 0 or _watcher_on():
        return True
    return not local and spec.min_workers is not None


# A fixed-size group waiting for a node Ray Train asks for (on GCE, a preempted VM's replacement:
# minutes) gives up after Ray's 60 s and restarts as a "failure"; nothing else could fit it.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
FIXED_START_TIMEOUT_S = 900.0
# An elastic group is sized on the nodes Ray lists; a node lost without notice stays listed until
# its health checks fail (5 checks 3 s apart), so the first restart after it can ask for a node
# that is gone, and its placement group then waited Ray's whole 60 s before the next try at the
# size that fits (the chaos lab's stockout run: 83 s, most of it that wait). A group sized on
# free nodes is placed in under a second: 20 s gives up on a gone node sooner, past Ray's ~15 s.
ELASTIC_START_TIMEOUT_S = 20.0


def apply_ray_train_env(local: bool, fixed: bool = False) -> None:
    """Set :func:`ray_train_env` here (values the user set win), before a trainer is built.

    On a ``local`` Ray the launcher runs (see :class:`launcher.driver.session.Connection`) no
    node is preempted, so Ray Train's preemption watcher is left out: one process less starting
    while the workers set up (0.6-1.2 s of a warm 2-worker start on 2 cores), and no drain-state
    poll every second (on 2 cores an idle Ray actor costs about 0.7 % of a core). To rehearse a
    preemption on the warm head (`launcher preemption watch` with a fake metadata server), set
    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1: a value the user set wins. On a cluster, a ``fixed``-size
    group waits up to :data:`FIXED_START_TIMEOUT_S` for its nodes, an elastic one
    :data:`ELASTIC_START_TIMEOUT_S`."""
    for item in filter(None, os.environ.get(SET_BY_LAUNCHER_ENV, "").split(",")):
        key, _, value = item.partition("=")
        if os.environ.get(key) == value:  # a parent launcher process set it, not the user
            _SET_HERE.setdefault(key, value)
    wanted = ray_train_env()
    if local:
        wanted[PREEMPTION_WATCHER_ENV] = "0"
    else:  # a fixed group waits for its nodes; an elastic one tries again at the size that fits
        wanted[START_TIMEOUT_ENV] = str(FIXED_START_TIMEOUT_S if fixed else ELASTIC_START_TIMEOUT_S)
    for key, value in list(_SET_HERE.items()):
        if os.environ.get(key) != value:  # changed since by someone else: theirs now
            del _SET_HERE[key]
        elif key not in wanted:  # set for an earlier run in this process, not wanted now
            del os.environ[key], _SET_HERE[key]
    for key, value in wanted.items():
        if key in _SET_HERE or key not in os.environ:
            os.environ[key] = _SET_HERE[key] = value
    os.environ[SET_BY_LAUNCHER_ENV] = ",".join(f"{key}={value}" for key, value in sorted(_SET_HERE.items()))


def is_elastic(spec) -> bool:
    """--min-workers below --workers: the group may run smaller than asked (with --strategy ft the
    group keeps its size: --min-workers is the quorum's minimum, and a lost replica is replaced alone)."""
    return spec.min_workers is not None and spec.min_workers < spec.workers and not spec.replica_groups


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
    user_error: Any = None  # a worker's UserError (bad input it found): the launch ends with it, exit 2


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


def prepare_trainer(ray_trainer, local: bool):
    """The launcher's settings that depend on the Ray this process is connected to: on a ``local``
    Ray there is no autoscaler, so a fixed-size group sends it no resource requests (see
    launcher.backends.raytrain.FixedWithoutRequests). Returns ``ray_trainer``."""
    if local and hasattr(ray_trainer, "request_resources"):
        ray_trainer.request_resources = False
    return ray_trainer


def fit(trainer, drain: Callable[[], None], *, local: bool, verbose: bool = False, poll_s: float = POLL_S,
        abort: Callable[[float], bool] | None = None, limit_s: float | None = None,
        memory: Callable[[], dict[str, Any]] | None = None) -> FitOutcome:
    """``trainer.fit()`` while a thread calls ``drain()`` every ``poll_s`` (and once after).

    Ctrl-C (and SIGTERM, which the CLI turns into it) ends the run as CANCELLED;
    a failure of the workers as FAILED with one line naming the rank and its error (one killed for
    memory: its memory, from Ray's word and ``memory()``, the workers' peaks so far, and the fix).
    ``abort(timeout_s)`` lets :func:`stop_running` end the run from another thread, as
    CANCELLED too; so does ``limit_s`` (``--max-run-s``) once the fit has run that long.
    ``local``: the Connection's (see :func:`prepare_trainer`).
    """
    prepare_trainer(trainer, local)
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
            outcome.user_error = worker_user_error(exc)
            outcome.error = (str(outcome.user_error) if outcome.user_error is not None
                             else describe_failure(exc, memory() if memory is not None else None))
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


def worker_user_error(exc: BaseException):
    """The UserError a worker raised (the lowest rank's), as Ray Train's exception holds it, or None.

    Bad input a worker finds (a shard set's file missing, a cache too small for a shard; the
    session says where in the user's code) is the user's to fix as much as a bad flag: the
    launch ends with its one line and exit 2, not a wrapped ``rank 0: RuntimeError: ...``."""
    failures = getattr(exc, "worker_failures", None) or {}
    for rank in sorted(failures):
        inner = failures[rank]
        cause = getattr(inner, "cause", None) or inner  # a RayTaskError holds the worker's own error
        if isinstance(cause, UserError):
            return UserError(" ".join(line.strip() for line in cause.what.splitlines() if line.strip()), cause.fix)
    return None


def describe_failure(exc: BaseException, memory: dict[str, Any] | None = None) -> str:
    """One line naming the failing rank and its error, from Ray Train's exception; a worker killed
    for memory first (see :func:`killed_for_memory`), as the others then fail for want of it."""
    killed = killed_for_memory(exc, memory)
    if killed:
        return killed
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank = min(failures)
        inner = failures[rank]
        cause = getattr(inner, "cause", None) or inner
        text = _without_native_stack(str(cause))
        if isinstance(cause, LauncherError):  # one line of ours already (a storage outage): no type before it
            return f"rank {rank}: {' '.join(line.strip() for line in text)}"
        return f"rank {rank}: {type(cause).__name__}: {text[-1] if text else ''}"
    text = _without_native_stack(str(exc))
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def error_line(text: str) -> str:
    """One line for a worker's error text (``Type: message``): its first line, and the next one
    where the first only leads into it (XGBoost's ``[time] file.cc:83: [comm.cc:220]:``)."""
    lines = _without_native_stack(text)
    if not lines:
        return ""
    if lines[0].rstrip().endswith(":") and len(lines) > 1:
        return f"{lines[0].rstrip()} {lines[1].strip()}"
    return lines[0]


def _without_native_stack(text: str) -> list[str]:
    """``text``'s lines up to a native library's stack trace (XGBoost's errors end with
    ``Stack trace:`` and ``[bt] (N) ...`` lines, whose last says nothing about the error)."""
    lines = []
    for line in text.strip().splitlines():
        if line.strip() == "Stack trace:" or line.lstrip().startswith("[bt] ("):
            break
        lines.append(line)
    return [line for line in lines if line.strip()]


MEMORY_FIX = "--strategy fsdp to shard the model, more workers, or a smaller --batch-size"
# Ray's memory monitor killed the worker ("... the node running low on memory. Memory on the node
# (IP: 10.0.0.5, ID: ...) was 14.80GB used / 15.50GB limit (0.95) ... pid=123, actual memory used=9.10GB";
# Rays before 2.56: "... where the task (..., pid=123, memory used=9.10GB) was running was 14.80GB / 15.50GB").
_RAY_OOM = re.compile(r"NODE_OUT_OF_MEMORY|running low on memory|Memory on the node \(IP")
_NODE_MEMORY = re.compile(r"Memory on the node \(IP: (?P<ip>[^,)\s]+)[^)]*\).*? was (?P<used>[\d.]+) ?GB(?: used)? / "
                          r"(?P<limit>[\d.]+) ?GB", re.S)
_TASK_MEMORY = r"pid={pid}, (?:actual )?memory used=([\d.]+) ?GB"
# Ended by SIGKILL with no error of its own, as the kernel's OOM killer ends a process (Ray cannot
# tell it from a crash: "Worker unexpectedly exits with a connection error code 2").
_KILLED = re.compile(r"SIGKILL|signal 9\b|exit (?:code|status):? ?(?:-9|137)\b|exits with a connection error code")
_NOT_MEMORY = re.compile(r"its node has died|preempt|ray\.kill", re.I)
_CUDA_OOM = re.compile(r"CUDA out of memory(?:\. Tried to allocate [\d.]+ [KMG]iB)?"
                       r"(?:\. GPU \d+ has a total capacity of [\d.]+ [KMG]iB)?")
_NODE_IP = re.compile(r"node_ip='([^']+)'|\tip: (\S+)|\(IP: ([^,)\s]+)")
_PID = re.compile(r"\bpid[=:] ?(\d+)")


def killed_for_memory(error: Any, memory: dict[str, Any] | None = None) -> str | None:
    """One line for a worker killed for memory: which (rank, node), how much memory (the node's
    figures from Ray's message, the worker's peak from ``memory``, see
    :func:`launcher.measures.peak_memory`) and the fix; None when ``error`` says nothing of memory.

    ``error``: Ray Train's exception (its ``worker_failures`` by rank), ``{rank: error}`` (an
    exception or its text, as a :class:`~launcher.summary.Failure` holds it), or one error.
    Ray's memory monitor and a CUDA allocation that failed are certain; a worker that died with no
    error of its own (SIGKILL) is said as what the kernel's OOM killer leaves (Ray cannot tell)."""
    failures = error if isinstance(error, dict) else getattr(error, "worker_failures", None) or {None: error}
    said = {rank: _error_text(e) for rank, e in failures.items()}
    ranked = sorted(said.items(), key=lambda item: -1 if item[0] is None else item[0])
    for finds, fix in ((_ray_oom, "use"), (_cuda_oom, "use"), (_sigkill, "if memory ran out, use")):
        for rank, (text, kinds) in ranked:
            found = finds(text, kinds)
            if found:
                return f"{_who(rank, text)} {found}{_peak(rank, memory or {})}; {fix} {MEMORY_FIX}"
    return None


def _error_text(error: Any) -> tuple[str, set[type]]:
    """An error's text and its causes' (Ray wraps them: RayTaskError.cause, a failed health
    check's failure), and their types."""
    texts, kinds, seen = [], set(), set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts.append(str(error))
        kinds.add(type(error))
        error = (getattr(error, "health_check_failure", None) or getattr(error, "cause", None)
                 or getattr(error, "__cause__", None)) if isinstance(error, BaseException) else None
    return "\n".join(texts), kinds


def _ray_oom(text: str, kinds: set[type]) -> str | None:
    exceptions = sys.modules.get("ray.exceptions")  # an error from Ray: Ray is imported
    if not (_RAY_OOM.search(text) or exceptions and any(issubclass(k, exceptions.OutOfMemoryError) for k in kinds)):
        return None
    node = _NODE_MEMORY.search(text)
    pid = _PID.search(text)
    own = re.search(_TASK_MEMORY.format(pid=pid.group(1) if pid else r"\d+"), text)
    return ("was killed by Ray's memory monitor" + (f": its node had {node['used']} of {node['limit']} GB in use"
                                                     if node else "")
            + (f", the worker {own.group(1)} GB" if own else ""))


def _cuda_oom(text: str, kinds: set[type]) -> str | None:
    found = _CUDA_OOM.search(text)
    return f"ran out of GPU memory ({found.group(0)})" if found else None


def _sigkill(text: str, kinds: set[type]) -> str | None:
    if not _KILLED.search(text) or _NOT_MEMORY.search(text):
        return None
    return "died with no error of its own, as when the kernel's OOM killer ends it (`dmesg` on the node tells)"


def _who(rank: int | None, text: str) -> str:
    """"rank 1 (node 10.0.0.5)", as far as the error tells."""
    ip = next((g for m in _NODE_IP.finditer(text) for g in m.groups() if g), None)
    return ("a worker" if rank is None else f"rank {rank}") + (f" (node {ip})" if ip else "")


def _peak(rank: int | None, memory: dict[str, Any]) -> str:
    """"; its peak RSS 3,120 MB at the last epoch's end" (and GPU memory), where the reports said."""
    parts, own = [], False
    for name, label in (("peak_rss_mb", "RSS"), ("peak_gpu_mb", "GPU memory")):
        ranks = memory.get(f"{name}_ranks") or []
        mine = rank is not None and rank < len(ranks)
        value = ranks[rank] if mine else memory.get(f"{name}_max")
        if isinstance(value, (int, float)) and value > 0:
            parts.append(f"{label} {value:,.0f} MB")
            own = own or mine
    whose = "its" if own else "the workers' largest"
    return f"; {whose} peak {' and '.join(parts)} at the last epoch's end" if parts else ""
