"""Connecting to Ray: reuse, join or start a cluster, and check a job fits on it.

With no address the launcher starts a local Ray sized to the request (at
least the machine's cores, more when the job asks for more workers, so a
laptop can run N worker processes on fewer cores). With ``--address`` (or
RAY_ADDRESS) it joins that cluster and checks that the workers can be placed
before starting anything.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from launcher import _ray, settings
from launcher._ray import JOB_CONFIG_ENV
from launcher.driver import localhead
from launcher.driver.reaper import Reaper
from launcher.errors import Unreachable, UserError
from launcher.worker import pool

LOCAL_OVERSUBSCRIPTION = localhead.LOCAL_OVERSUBSCRIPTION  # a local Ray runs up to this many worker CPUs per core

# Ray's processes that a training launch's own local Ray runs for nobody, stopped once it is up
# (unless --verbose): the log monitor forwards worker logs to a driver that asked for none
# (log_to_driver=False); the API server (dashboard.py, started even without the dashboard)
# answers job submissions and the state API, which go to a cluster or the warm head, never to a
# launch's own Ray; the autoscaler monitor has nothing to scale. With 2 workers on 2 cores they
# took 1.2 % of a core that the workers get back (benchmarks.ray_tax, char_lm, 4 epochs:
# everything but the workers 6.5 and 6.6 % -> 5.1 and 5.1 %).
IDLE_DAEMONS = ("PROCESS_TYPE_LOG_MONITOR", "PROCESS_TYPE_DASHBOARD", "PROCESS_TYPE_MONITOR")

# Settings for a local Ray the launcher starts (its processes read them from their environment;
# a value the user set wins): no idle workers prestarted for the driver (localhead.PRESTART_ENV:
# on 2 cores their start also landed on the critical path of a cold launch, beside the
# controller's), and the dashboard agent's reporter once a minute (see localhead.REPORTER_ENV).
LOCAL_RAY_ENV = {localhead.PRESTART_ENV: "0", localhead.REPORTER_ENV: localhead.REPORTER_MS, **localhead.MARK_ENV}


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    cpus: float
    gpus: float
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)  # Ray's node labels


def _quiet_ray_loggers(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.ERROR
    for name in ("ray", "ray.train", "ray.tune", "ray.data"):
        logging.getLogger(name).setLevel(level)


@dataclass(frozen=True)
class Connection:
    """This process's connection to Ray, as :func:`connect` yields it."""

    nodes: list[NodeResources]   # the alive nodes when it connected
    # A local Ray (this launch's own, `launcher up`'s warm head, or one that this process's own
    # ray.init() started before connect()): no node of it is preempted and no autoscaler answers
    # resource requests. A tuning trial inside its search's Ray knows from its environment
    # (settings.LOCAL_RAY, on every process of a local Ray the launcher started). False on any
    # other cluster.
    local: bool = False
    # The warm head's pool time (launcher.worker.pool): a run's driver refills the pool when its
    # workers are done. 0 anywhere else, or where the head keeps none.
    pool_s: int = 0
    pool_raylet: int | None = None  # the head's raylet, whose idle processes make its pool
    # A training launch on the warm head: the launch's settings (code.passed_env), which its
    # workers apply first thing (the run config's "env"). The head's processes were started
    # before the launch, so the settings must travel with the run; they travel in its config,
    # not in the job's runtime environment, so that a run's ready processes (launcher.worker.pool)
    # serve the next run of the framework whatever its settings. Empty anywhere else (a launch's
    # own local Ray inherits them; a cluster's nodes have their own).
    env: Mapping[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def connect(address: str | None, *, workers: int, cpus_per_worker: float, verbose: bool = False,
            workload: str | None = None, program: dict | None = None,
            lean: bool = False, preload: str | None = None) -> Iterator[Connection]:
    """Yield the :class:`Connection`; shut Ray down afterwards only if we started it.

    ``lean``: a training launch; a local Ray it starts runs without :data:`IDLE_DAEMONS`.

    ``workload``: a user workload's reference, whose folder is shipped to the workers
    (:mod:`launcher.driver.code`) with the job's runtime environment. ``program``: the
    runtime environment of a script's or package's folder (see launcher.driver.program).
    ``preload``: the framework of a training launch, whose processes on the warm head import it
    ahead (launcher.worker.pool) when the head keeps a pool.
    """
    head = localhead.warm_head_for(address)
    address = address or os.environ.get("RAY_ADDRESS")
    pool_s = int(head.get("pool_s", 0)) if head and preload else 0
    import ray

    _quiet_ray_loggers(verbose)
    reaper = None
    if not ray.is_initialized() and not address and not head:
        reaper = Reaper().start()  # a SIGKILLed driver leaves no Ray process of its own behind
    try:
        from launcher.driver import code

        extra = pool.job_env(preload) if pool_s else {}
        settings = code.passed_env(os.environ) if head and preload else None
        with _ray_started(address, head, workers, cpus_per_worker, workload, verbose, program, lean,
                          extra, settings is None) as started:
            # A local Ray this launch started, or the warm head: nothing preempts this machine's node.
            local = (bool(head) or not address) if started else already_local()
            yield Connection(alive_nodes(), local=local,
                             pool_s=pool_s if started else 0, env=settings if started and settings else {},
                             pool_raylet=localhead.raylet_of(head["pid"]) if started and pool_s else None)
    finally:
        if reaper is not None:
            reaper.done()


@contextlib.contextmanager
def _ray_started(address, head, workers, cpus_per_worker, workload, verbose, program,
                 lean: bool = False, extra: dict | None = None, settings_in_job: bool = True) -> Iterator[bool]:
    """Ray initialised for this launch (unless it already was); shut down after, if we started it."""
    import ray

    started = False
    if not ray.is_initialized():
        sigterm = signal.getsignal(signal.SIGTERM)
        with _interrupts_noted() as interrupted:
            try:
                _init(address, head, workers, cpus_per_worker, workload, verbose, program, extra, settings_in_job)
            except (KeyboardInterrupt, SystemExit):
                # Ray's start-up has its own SIGTERM handler, which exits: a signal while Ray
                # starts ends the launch as Ctrl-C would (exit 130), with Ray shut down.
                ray.shutdown()
                raise KeyboardInterrupt from None
        started = True
        _restore_python_sigterm(sigterm)
        if lean and not verbose and not (address or head):
            _stop_daemons(*IDLE_DAEMONS)
        if interrupted():  # Ray's start-up swallowed a Ctrl-C: honour it now
            ray.shutdown()
            raise KeyboardInterrupt

    try:
        yield started
    finally:
        if started:
            if not (address or head):
                # Ray's shutdown stops its processes one at a time, the GCS before the autoscaler
                # monitor; the monitor then spends Ray's whole 1 s grace telling the stopped GCS
                # that it was terminated (measured: 1.0 s of a 1.36 s shutdown). So it goes first.
                _stop_daemons("PROCESS_TYPE_MONITOR")
            ray.shutdown()


def already_local() -> bool:
    """Whether the Ray that this process was connected to before :func:`connect` is a local one:
    this process's own ``ray.init()`` started it, or the process runs on a local Ray the launcher
    started (a tuning trial's actor: its raylet passed on settings.LOCAL_RAY)."""
    return os.environ.get(settings.LOCAL_RAY) == "1" or _ray.started_by_this_process()


def _stop_daemons(*kinds: str) -> None:
    """Kill the named processes (keys of :data:`launcher._ray.PRIVATE`) of the local Ray this
    process started. Ray's shutdown skips a process that is already gone."""
    try:
        node = _ray.resolve("global_worker").node
        for kind in kinds:
            for info in node.all_processes.get(_ray.resolve(kind), []):
                info.process.kill()
                info.process.wait(timeout=5)
    except Exception:  # noqa: BLE001 - only CPU time is at stake: ray.shutdown() stops them anyway
        pass


def _init(address: str | None, head: dict | None, workers: int, cpus_per_worker: float, workload: str | None,
          verbose: bool, program: dict | None = None, extra: dict | None = None, settings_in_job: bool = True) -> None:
    """ray.init for each way of finding Ray: the warm head, a submitted job's cluster, an
    address, or a new local Ray sized to the request. ``extra``: more of the warm head's job
    runtime environment (its pool's, launcher.worker.pool). ``settings_in_job``: on the warm head,
    the launch's settings go in the job's runtime environment (a training launch passes them in
    its run's config instead: :attr:`Connection.env`)."""
    import ray

    from launcher.driver import code

    kwargs = dict(include_dashboard=False, log_to_driver=verbose,
                  logging_level=logging.INFO if verbose else logging.ERROR)
    try:
        if head:  # `launcher up`'s warm head on this machine: same code, nothing to ship, but the
            # head's processes were started before this launch: its settings go with it
            address = head["address"]
            settings = {"env_vars": code.passed_env(os.environ)} if settings_in_job else {}
            env = code.merge(code.runtime_env(workload, False, program), settings, extra or {})
            ray.init(address=address, runtime_env=env, **kwargs)
        elif address and in_ray_job():
            # `launcher submit`: the job's runtime env already carries our code, and Ray
            # refuses a second py_modules from ray.init ("Failed to merge the Job's runtime env").
            ray.init(address=address, **kwargs)
        elif address:
            check_reachable(address)  # Ray itself retries for minutes before it gives up
            # Ship this launcher's code with the job, so a cluster runs the driver's version.
            ray.init(address=address, runtime_env=code.runtime_env(workload, True, program), **kwargs)
        else:
            check_local_fit(workers, cpus_per_worker)
            cpus = max(os.cpu_count() or 1, math.ceil(workers * cpus_per_worker))
            with environ(LOCAL_RAY_ENV):  # the raylet reads its settings from its environment
                ray.init(address="local", num_cpus=cpus,  # never a running cluster by surprise
                         runtime_env=code.runtime_env(workload, False, program) or None, **kwargs)
    except ConnectionError as exc:
        raise Unreachable(f"cannot connect to the Ray cluster at {address}: {exc}",
                          "is it up? check --address (or RAY_ADDRESS); a cluster with token authentication "
                          "also needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or "
                          "RAY_AUTH_TOKEN_PATH)") from None


@contextlib.contextmanager
def environ(values: dict[str, str], override: bool = False) -> Iterator[None]:
    """``values`` in os.environ meanwhile: where the user has not set them, or (``override``)
    over theirs; the user's come back after."""
    saved = {key: os.environ.get(key) for key in values if override or key not in os.environ}
    os.environ.update({key: values[key] for key in saved})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _interrupts_noted() -> Iterator[Callable[[], bool]]:
    """Meanwhile Ctrl-C and SIGTERM are noted as well as acted on: Ray's start-up can catch
    the KeyboardInterrupt and carry on, and the SIGTERM handler it installs exits with a
    SystemExit that was seen swallowed ("Exception ignored in ... _releaseLock"); a run
    must not then train anyway. So the SIGTERM handler Ray installs is wrapped to note
    the signal first."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    seen = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    install = signal.signal

    def note(signum, frame) -> None:
        seen.set()
        raise KeyboardInterrupt

    def noting(signum, handler):
        if signum == signal.SIGTERM and callable(handler):
            inner = handler

            def handler(sig, frame):  # noqa: F811 - Ray's handler, noted first
                seen.set()
                inner(sig, frame)
        return install(signum, handler)

    install(signal.SIGINT, note)
    signal.signal = noting
    try:
        yield seen.is_set
    finally:
        signal.signal = install
        install(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def check_local_fit(workers: int, cpus_per_worker: float, cores: int | None = None) -> None:
    """UserError unless the request suits this machine. A local Ray is given as many logical
    CPUs as the workers ask for, so a laptop can run more workers than it has cores; but no
    worker can use more cores than there are, and past LOCAL_OVERSUBSCRIPTION x the cores the
    workers would only wait for each other (and their memory)."""
    cores = cores or os.cpu_count() or 1
    if cpus_per_worker > cores:
        raise UserError(f"--cpus-per-worker {cpus_per_worker:g}: this machine has {cores} CPUs",
                        f"use at most {cores}, or run on a cluster (--address)")
    asked, most = workers * cpus_per_worker, LOCAL_OVERSUBSCRIPTION * cores
    if asked > most:
        raise UserError(f"{workers} workers x {cpus_per_worker:g} CPUs is {asked:g} CPUs; this machine has {cores}, "
                        f"and a local run takes at most {most:g} ({LOCAL_OVERSUBSCRIPTION} per core)",
                        f"lower --workers (at most {int(most // cpus_per_worker)} here), or run on a cluster "
                        "(--address)")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Unreachable unless something accepts a connection at a ``host:port`` or ``ray://host:port``
    address ("auto" and other forms are left to Ray)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        what = "Ray client server" if address.startswith("ray://") else "Ray cluster (its GCS port)"
        raise Unreachable(f"nothing answers at {address}: {exc.strerror or type(exc).__name__}; no {what} there",
                          "is the cluster up? check --address (or RAY_ADDRESS): host:port of the head's GCS "
                          "(6379 unless changed), or ray://host:10001") from None


def _restore_python_sigterm(handler) -> None:
    """Put back the Python SIGTERM handler that was set before ``ray.init``.

    Ray's core worker installs a C++ handler for SIGTERM that dumps a stack and
    kills the process; the CLI's handler (SIGTERM ends the run like Ctrl-C: the
    workers stopped, the summary written) must win. Only the main thread can set it.
    """
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def in_ray_job() -> bool:
    """Whether this process is the entrypoint of a submitted Ray job (Ray's job supervisor
    sets this variable, and RAY_ADDRESS to the cluster's GCS, for the entrypoint)."""
    return JOB_CONFIG_ENV in os.environ


def alive_nodes() -> list[NodeResources]:
    import ray

    return [NodeResources(n["NodeID"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0),
                          dict(n.get("Labels") or {}))
            for n in ray.nodes() if n.get("Alive")]


def placeable_workers(nodes: list[NodeResources], cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many workers of this shape the nodes can hold at once (each worker on one node)."""
    total = 0
    for n in nodes:
        fit = math.floor(n.cpus / cpus_per_worker + 1e-9) if cpus_per_worker > 0 else 10**9
        if gpus_per_worker > 0:
            fit = min(fit, math.floor(n.gpus / gpus_per_worker + 1e-9))
        total += fit
    return total


def check_fits(nodes: list[NodeResources], workers: int, cpus_per_worker: float, gpus_per_worker: float) -> None:
    """UserError unless ``workers`` workers of the given shape fit on the cluster."""
    can = placeable_workers(nodes, cpus_per_worker, gpus_per_worker)
    if can >= workers:
        return
    cpus = sum(n.cpus for n in nodes)
    gpus = sum(n.gpus for n in nodes)
    shape = f"{cpus_per_worker:g} CPU" + (f" + {gpus_per_worker:g} GPU" if gpus_per_worker else "")
    raise UserError(
        f"cannot place {workers} workers of {shape} each: the Ray cluster has {len(nodes)} node(s) with "
        f"{cpus:g} CPUs and {gpus:g} GPUs in all, room for {can}",
        localhead.fit_hint(workers * cpus_per_worker)
        or "lower --workers, --cpus-per-worker or --gpus-per-worker, or add nodes")
