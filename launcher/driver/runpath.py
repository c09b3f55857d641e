"""What every run does before its own kind of training, whatever code it trains.

A workload, a training function and a program (``--script`` / ``--package``) all
run the same way up to the trainer: the storage is resolved and checked for
writing, the run's log is checked against this launch's spec, the run's lock is
taken (one launch of a run at a time) and a damaged Ray Train checkpoint list is
set aside. :func:`open_run` does the checks and :func:`holding` the rest, so
launch.py (workloads and training functions) and script.py (programs) differ only
in what they train.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from launcher.driver import localhead, placement, session, startup
from launcher.storage import Storage
from launcher.storage.checkpoint import set_aside_damaged_snapshot
from launcher.storage.runlock import RunLock
from launcher.storage.runlog import RunLog
from launcher.storage.tracking import Tracking


def open_run(spec, progress) -> tuple[Storage, RunLog]:
    """The run's storage (writable, said when remote) and its log (compatible with ``spec``), which
    also feeds MLflow when ``spec.mlflow`` is set.

    Raises:
        UserError: storage that cannot be written, or a run of that name that ``spec`` cannot continue
            (an MLflow store that cannot be opened: raised by the log's ``begin``).
        Unreachable: an MLflow tracking server that does not answer (raised by the log's ``begin``).
    """
    storage = Storage.resolve(spec.storage)
    where = storage.check_writable()
    if not storage.is_local:
        progress.note(f"storage: {where}")
    tracking = Tracking(spec.mlflow, storage, spec.name, progress.note) if spec.mlflow else None
    log = RunLog(storage, spec.name, tracking)
    log.check_compatible(spec)
    if tracking is not None:
        tracking.connect_soon()  # while Ray starts; one that does not open stops the launch before any worker
    return storage, log


@contextlib.contextmanager
def holding(storage: Storage, name: str, progress) -> Iterator[RunLock]:
    """The run's lock, held meanwhile (a second launch of the run is refused before anything is
    written), with Ray Train's checkpoint list set aside if it is damaged.

    A launch stopped before it wrote anything (an MLflow server that does not answer, a Ray
    cluster that does not) leaves no run folder behind: the lock made it, and it goes with the
    lock when it is empty and was not there before."""
    lock = RunLock(storage, name)
    new = storage.is_local and not storage.exists(name)  # on Cloud Storage a folder is only its files
    lock.acquire()
    try:
        damaged = set_aside_damaged_snapshot(storage, name)
        if damaged:
            progress.note(damaged)
        yield lock
    finally:
        lock.release()
        if new:
            with contextlib.suppress(OSError):  # not empty: the launch wrote something, which stays
                os.rmdir(storage.path(name))


@contextlib.contextmanager
def connected(spec, storage: Storage, progress, *, verbose: bool, workers_needed: int, workload: str | None = None,
              program_env: dict | None = None, preload: bool = False) -> Iterator[tuple[RunLock, "session.Connection"]]:
    """What every run does before its trainer: the run's lock taken (before Ray starts or anything
    is written), where Ray is said, Ray connected (``workload``'s or the program's folder shipped,
    see :func:`launcher.driver.session.connect`), and the job checked to fit the nodes
    (``workers_needed``: the fewest workers it can start with; ``preload``: on the warm head, its
    processes import the run's framework ahead, launcher.worker.pool)."""
    with holding(storage, spec.name, progress) as lock:
        _say_where(spec, progress)
        with session.connect(spec.address, workers=spec.workers, cpus_per_worker=spec.cpus_per_worker,
                             verbose=verbose, workload=workload, program=program_env, lean=True,
                             preload=spec.framework if preload else None) as conn:
            startup.mark("ray_ready")
            placement.check(spec, [n.labels for n in conn.nodes], progress.note)
            session.check_fits(conn.nodes, workers_needed, spec.cpus_per_worker, spec.gpus_per_worker)
            yield lock, conn


def _say_where(spec, progress) -> None:
    head = localhead.warm_head_for(spec.address)
    if not head and not (spec.address or os.environ.get("RAY_ADDRESS")):
        session.check_local_fit(spec.workers, spec.cpus_per_worker)  # before saying Ray starts
    if head:
        progress.note(f"using the warm local Ray at {head['address']} (`launcher down` stops it)")
    else:
        address = spec.address or os.environ.get("RAY_ADDRESS")
        progress.note(f"connecting to Ray at {address}" if address else "starting a local Ray instance")
