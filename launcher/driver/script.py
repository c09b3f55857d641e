"""Bring-your-own-script mode: run an unmodified training script on N Ray workers.

``launcher run --script train.py --backend B --workers N -- ARGS`` starts the
backend's Ray Train V2 trainer with :func:`script_worker` as the training
function. Each worker asks the backend for the environment a script of that
backend expects (Horovod: the HOROVOD_* ring variables its Ray backend already
put in the worker's environment; torch native: torchrun's MASTER_ADDR, RANK,
...), starts ``python train.py ARGS`` as a subprocess with it, and sends the
subprocess's output, line by line, to the driver through a small Ray actor
(so it works across nodes and does not depend on Ray's log_to_driver). The
driver prints each line as ``[rank R] ...`` and exits with the script's
status: that of the rank that failed first, or 0 when every rank succeeded.

A backend opts in by returning a trainer from ``Backend.script_trainer`` and
the per-worker variables from ``Backend.script_env`` (see launcher.backends).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from launcher.errors import UserError

FLUSH_S = 0.1           # how often a worker ships buffered output lines
MAX_BATCH = 500         # and at most this many per message
POLL_S = 0.2            # how often the driver fetches lines
SHEBANG = re.compile(rb"^#!.*\bpython[0-9.]*\b")


# -- validation (driver, before any worker) ---------------------------------------------------

def check_script(path: str) -> str:
    """The script's absolute path; UserError when it is missing or not Python."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise UserError(f"--script {path}: no such file", "give the path of a Python training script")
    if not os.path.isfile(full):
        raise UserError(f"--script {path}: not a file", "give the path of a Python training script, not a folder")
    if not full.endswith(".py"):
        with open(full, "rb") as f:
            first = f.readline(200)
        if not SHEBANG.match(first):
            raise UserError(f"--script {path}: not a Python script (no .py suffix and no python shebang)",
                            "rename it to end with .py, or start it with #!/usr/bin/env python3")
    return full


# -- worker side ---------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the worker thread that started it ends
    (Ray killing a worker must not leave an orphaned training script holding the ring)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def script_worker(config: dict[str, Any]) -> None:
    """Ray Train's training function in script mode: run the script, stream its output."""
    import subprocess
    import tempfile

    import ray
    import ray.train

    from launcher import backends

    rank = ray.train.get_context().get_world_rank()
    sink = config["sink"]
    os.environ.update(config.get("env", {}))
    backend = backends.get(config["backend"])
    env = {**os.environ, **backend.script_env(config["framework"]), "PYTHONUNBUFFERED": "1"}
    path = config["script"]
    if not os.path.isfile(path):  # another machine: run the driver's copy
        fd, path = tempfile.mkstemp(prefix="launcher-script-", suffix=".py")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config["source"])
    cwd = config["cwd"] if os.path.isdir(config["cwd"]) else os.path.dirname(path)
    proc = subprocess.Popen([sys.executable, path, *config["args"]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                            preexec_fn=_die_with_parent)
    lines: list[str] = []
    lock = threading.Lock()

    def read() -> None:
        for raw in proc.stdout:
            with lock:
                lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pending = []

    def ship() -> None:
        with lock:
            batch, lines[:] = lines[:MAX_BATCH], lines[MAX_BATCH:]
        if batch:
            pending.append(sink.put.remote({"rank": rank, "lines": batch}))

    while proc.poll() is None:
        time.sleep(FLUSH_S)
        ship()
    reader.join()
    while lines:
        ship()
    status = proc.returncode
    ray.get(pending + [sink.put.remote({"rank": rank, "exit": status, "time": time.time()})])
    if status != 0:
        raise ScriptFailed(rank, status)


class ScriptFailed(RuntimeError):
    def __init__(self, rank: int, status: int) -> None:
        super().__init__(f"rank {rank}: the script exited with status {status}")
        self.rank, self.status = rank, status


# -- driver side ---------------------------------------------------------------------------

@dataclass
class Outcome:
    """What the ranks said: their exit statuses (and when), and the lines printed."""

    statuses: dict[int, int] = field(default_factory=dict)
    ended: dict[int, float] = field(default_factory=dict)
    lines: int = 0

    def handle(self, event: dict[str, Any], out: TextIO) -> None:
        rank = event["rank"]
        if "lines" in event:
            out.write("".join(f"[rank {rank}] {line}\n" for line in event["lines"]))
            out.flush()
            self.lines += len(event["lines"])
        if "exit" in event:
            self.statuses[rank] = event["exit"]
            self.ended[rank] = event.get("time", 0.0)

    def exit_code(self, workers: int, error: str | None) -> tuple[int, str | None]:
        """(exit status, message): the status of the rank that failed first (when one rank
        dies, the others usually fail after it, e.g. "Horovod has been shut down");
        1 when no rank reported one."""
        failed = sorted((r for r, s in self.statuses.items() if s != 0), key=lambda r: (self.ended[r], r))
        if failed:
            rank, status = failed[0], self.statuses[failed[0]]
            code = 128 - status if status < 0 else status  # killed by signal N -> 128+N, like a shell
            others = f" (then also: rank {', '.join(map(str, failed[1:]))})" if failed[1:] else ""
            return code, f"rank {rank} exited with status {status}{others}"
        if error is not None or len(self.statuses) < workers:
            return 1, error or "not every rank reported an exit status"
        return 0, None


def run_script(spec, script: str, args: list[str], *, out: TextIO | None = None, verbose: bool = False) -> int:
    """Run ``script`` (checked) with ``args`` on spec.workers workers; returns the exit status.

    Raises:
        UserError: the backend cannot run here (before any worker starts).
    """
    from launcher import backends
    from launcher.driver import session as raysession
    from launcher.driver.launch import describe_failure

    out = out or sys.stdout
    backend = backends.get(spec.backend)
    if not backend.runs_scripts:
        able = [b.name for b in backends.REGISTRY if b.runs_scripts]
        raise UserError(f"backend {spec.backend} cannot run scripts yet", f"use --backend {' or '.join(able)}")
    reason = backend.unavailable_reason(spec.framework)
    if reason:
        raise UserError(f"backend {spec.backend} cannot run {spec.framework} here: {reason}")
    with open(script, encoding="utf-8", errors="replace") as f:
        source = f.read()
    with raysession.connect(spec.address, workers=spec.workers, cpus_per_worker=spec.cpus_per_worker,
                            verbose=verbose) as nodes:
        raysession.check_fits(nodes, spec.workers, spec.cpus_per_worker, spec.gpus_per_worker)
        from launcher.storage import gcs
        from launcher.driver.events import Mailbox

        sink = Mailbox.remote()
        config = {"script": script, "source": source, "args": list(args), "cwd": os.getcwd(),
                  "backend": spec.backend, "framework": spec.framework, "sink": sink,
                  "env": gcs.worker_env()}
        trainer = backend.script_trainer(spec, script_worker, config, _scaling(spec), _run_config(spec))
        outcome = Outcome()
        error = _fit_streaming(trainer, sink, outcome, out, verbose, describe_failure)
    code, message = outcome.exit_code(spec.workers, error)
    if message:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _fit_streaming(trainer, sink, outcome: Outcome, out: TextIO, verbose: bool, describe) -> str | None:
    """trainer.fit() while a thread prints the workers' lines; returns the failure, if any."""
    import ray

    stop = threading.Event()

    def pump() -> None:
        while True:
            done = stop.wait(POLL_S)
            for event in ray.get(sink.take.remote()):
                outcome.handle(event, out)
            if done:
                return

    pumper = threading.Thread(target=pump, name="launcher-script-output", daemon=True)
    pumper.start()
    error = None
    try:
        trainer.fit()
    except (KeyboardInterrupt, SystemExit):
        error = "interrupted"
    except Exception as exc:  # Ray Train wraps the workers' errors
        if verbose:
            import traceback

            traceback.print_exc()
        error = describe(exc)
    finally:
        stop.set()
        pumper.join(timeout=30)
    return error


def _scaling(spec):
    from ray.train import ScalingConfig

    resources = {"CPU": spec.cpus_per_worker}
    if spec.gpus_per_worker:
        resources["GPU"] = spec.gpus_per_worker
    return ScalingConfig(num_workers=spec.workers, use_gpu=spec.gpus_per_worker > 0,
                         resources_per_worker=resources)


def _run_config(spec):
    from ray.train import FailureConfig, RunConfig

    from launcher.storage import Storage

    storage = Storage.resolve(spec.storage)
    # A script's own failures are the user's to see, not to retry.
    return RunConfig(name=spec.name, storage_path=storage.root,
                     storage_filesystem=None if storage.is_local else storage.fs,
                     failure_config=FailureConfig(max_failures=0))


def cmd_script(args) -> int:
    """``launcher run --script``: check everything, then run; returns the exit status."""
    import dataclasses
    import datetime as _dt

    from launcher.cli.main import spec_from_args

    if not args.script:
        raise UserError(f"unexpected arguments {' '.join(args.script_args)!r}",
                        "script arguments go after --script PATH and --, e.g. --script train.py -- --lr 0.1")
    script = check_script(args.script)
    spec = spec_from_args(args)
    if not args.name:
        stem = re.sub(r"[^A-Za-z0-9_]", "_", os.path.splitext(os.path.basename(script))[0])
        spec = dataclasses.replace(spec, name=f"script_{stem}_{_dt.datetime.now():%Y%m%d_%H%M%S}"[:128])
    return run_script(spec, script, args.script_args, verbose=args.verbose)
