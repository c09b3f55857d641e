"""Bring-your-own-script mode, driver side: run an unmodified training script on N Ray workers.

``launcher run --script train.py --backend B --workers N -- ARGS`` starts the
backend's Ray Train V2 trainer with :func:`launcher.worker.script.script_worker`
as the training function. Each worker asks the backend for the environment a script of that
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
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from launcher.errors import UserError
from launcher.summary import RunStatus

POLL_S = 0.2            # how often the driver fetches lines
EXIT_INTERRUPTED = 130  # as a shell reports a command stopped by SIGINT
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
    with open(full, "rb") as f:
        source = f.read()
    try:
        compile(source, full, "exec")  # a syntax error is found here, not after Ray and the workers start
    except SyntaxError as exc:
        raise UserError(f"--script {path}: syntax error at line {exc.lineno}: {exc.msg}",
                        f"run `python -m py_compile {path}` to see it") from None
    except ValueError as exc:  # e.g. null bytes: not a text file
        raise UserError(f"--script {path}: not a Python script ({exc})") from None
    return full


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
        Unreachable: the Ray cluster named by --address does not answer.
    """
    from launcher import backends
    from launcher.driver import session, trainer
    from launcher.storage import Storage, gcs
    from launcher.worker.script import script_worker

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
    with session.connect(spec.address, workers=spec.workers, cpus_per_worker=spec.cpus_per_worker,
                         verbose=verbose) as nodes:
        session.check_fits(nodes, spec.workers, spec.cpus_per_worker, spec.gpus_per_worker)
        import ray

        from launcher.driver.events import Mailbox

        sink = Mailbox.remote()
        config = {"script": script, "source": source, "args": list(args), "cwd": os.getcwd(),
                  "backend": spec.backend, "framework": spec.framework, "sink": sink,
                  "env": gcs.worker_env()}
        trainer.apply_ray_train_env()
        # A script's own failures are the user's to see, not to retry.
        run_config = trainer.run_config(spec, Storage.resolve(spec.storage), max_failures=0)
        ray_trainer = backend.script_trainer(spec, script_worker, config,
                                             trainer.scaling_config(spec, elastic=False), run_config)
        outcome = Outcome()

        def drain() -> None:
            for event in ray.get(sink.take.remote()):
                outcome.handle(event, out)

        fitted = trainer.fit(ray_trainer, drain, verbose=verbose, poll_s=POLL_S)
    if fitted.status == RunStatus.CANCELLED:  # Ctrl-C or SIGTERM: the scripts were stopped
        print("error: interrupted; the script was stopped on every worker", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    error = None if fitted.status == RunStatus.SUCCEEDED else fitted.error
    code, message = outcome.exit_code(spec.workers, error)
    if message:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return code
