"""Script and package runs, driver side: the user's own program on N Ray workers, as a run.

``launcher run --script train.py -- ARGS`` and ``launcher run --package DIR
--module trainer.task -- ARGS`` start the backend's Ray Train V2 trainer with
:func:`launcher.worker.script.script_worker` as the training function (see
there for what each rank does). Such a run is a run like a built-in one: it
has a run folder with ``run.json``, ``launches.jsonl``, ``metrics.jsonl`` (the
program's hypertune reports) and ``summary.json``, one launch at a time (the
run lock), ``--max-failures`` restarts of the whole program, and restarts on
preemption that do not count against that budget. The program resumes itself
from ``AIP_CHECKPOINT_DIR``, which stays the same across restarts and launches.

The driver prints each line of the program as ``[rank R] ...`` on stderr, with the
rest of the progress (stdout holds the summary alone), and exits with
the program's status: that of the rank that failed first in the last worker
group, 0 when every rank succeeded, 130 when interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from launcher.driver import runpath, session, startup, trainer
from launcher.driver.program import Program, check_container
from launcher.driver.progress import Progress
from launcher.errors import UserError
from launcher.measures import program_epochs, program_metrics
from launcher.storage import gcs
from launcher.storage.runlog import ProgramLines
from launcher.summary import Interruption, Preempting, Restart, RunStatus, RunSummary
from launcher.worker import deps, vertex
from launcher.worker.script import program_folder, script_worker

POLL_S = 0.2            # how often the driver fetches lines
EXIT_INTERRUPTED = 130  # as a shell reports a command stopped by SIGINT
NOTICE_S = 30           # GCE's preemption notice: what LAUNCHER_PREEMPTION_DEADLINE_S promises at most


@dataclass
class Outcome:
    """What the ranks said, per worker group: exit statuses (and when), lines, metrics, notices."""

    out: TextIO
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)   # attempt -> rank -> status
    ended: dict[str, dict[int, float]] = field(default_factory=dict)
    attempts: list[str] = field(default_factory=list)                 # in the order they started
    notices: set[str] = field(default_factory=set)                    # attempts that got a notice
    metrics: list[dict[str, Any]] = field(default_factory=list)       # rank 0's hypertune entries
    lines: int = 0

    def handle(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one worker event; returns new metric entries (for the run log)."""
        rank, attempt = event["rank"], event.get("attempt", "")
        if attempt and attempt not in self.attempts:
            self.attempts.append(attempt)
        if "lines" in event:
            self.out.write("".join(f"[rank {rank}] {line}\n" for line in event["lines"]))
            self.out.flush()
            self.lines += len(event["lines"])
        if "notice" in event:
            self.notices.add(attempt)
        if "exit" in event:
            self.statuses.setdefault(attempt, {})[rank] = event["exit"]
            self.ended.setdefault(attempt, {})[rank] = event.get("time", 0.0)
        new = event.get("metrics") or []
        self.metrics += new
        return new

    def last_statuses(self) -> dict[int, int]:
        return dict(self.statuses.get(self.attempts[-1], {})) if self.attempts else {}

    def exit_code(self, workers: int, error: str | None) -> tuple[int, str | None]:
        """(exit status, message) from the last worker group: the status of the rank that
        failed first (when one rank dies, the others usually fail after it); 1 when no
        rank reported one."""
        statuses = self.last_statuses()
        ended = self.ended.get(self.attempts[-1], {}) if self.attempts else {}
        failed = sorted((r for r, s in statuses.items() if s != 0), key=lambda r: (ended[r], r))
        if failed:
            rank, status = failed[0], statuses[failed[0]]
            code = 128 - status if status < 0 else status  # killed by signal N -> 128+N, like a shell
            others = f" (then also: rank {', '.join(map(str, failed[1:]))})" if failed[1:] else ""
            return code, f"rank {rank} exited with status {status}{others}"
        if error is not None or len(statuses) < workers:
            return 1, error or "not every rank reported an exit status"
        return 0, None


def is_shipped(program: Program, address: str | None) -> bool:
    """Whether the program's folder goes with Ray's runtime environment: always for a
    package or a folder with dependencies, and for a script when joining a cluster (on
    this machine a script runs where it is)."""
    if program.image:  # the launcher's own code, for the ranks in the image (Program.runtime_env)
        return True
    joining = bool(address or os.environ.get("RAY_ADDRESS")) or session.in_ray_job()
    return program.kind == "module" or bool(program.requirements) or joining


@dataclass(frozen=True)
class ProgramRun:
    """A program as a run (what :func:`launcher.driver.launch.run` takes besides the spec): what
    runs, its arguments, whether it gets ``--job-dir RUN_DIR``, and the tuning trial it is
    (CLOUD_ML_TRIAL_ID; the tuning driver has checked and shipped its folder already)."""

    program: Program
    args: tuple[str, ...] = ()
    job_dir: bool = True
    trial_id: str | None = None


def run_program(spec, job: ProgramRun, *, verbose: bool = False, out: TextIO | None = None,
                progress_out: TextIO | None = None,
                on_metrics: Callable[[dict[str, Any]], None] | None = None) -> RunSummary:
    """Run ``job.program`` on spec.workers workers as run ``spec.name`` (through
    :func:`launcher.driver.launch.run`); the summary's ``exit_status`` is the program's. A run of
    the same name continues (the program finds its checkpoints in AIP_CHECKPOINT_DIR).

    ``out``: where the ranks' ``[rank R]`` lines go (default stderr: progress, not the summary).
    ``on_metrics``: called with each entry rank 0 writes to its hypertune file (on the driver's
    pump thread).
    """
    from launcher.driver import code

    program = job.program
    started = time.time()
    out = out or sys.stderr
    check_container(program, list(job.args), spec)  # a container on a machine that cannot start it: one line
    progress = Progress(0, stream=progress_out or sys.stderr)
    setup_s = check_backend(spec)
    spec = dataclasses.replace(spec, workload=program.label)
    shipped = is_shipped(program, spec.address)
    if shipped and not session.in_ray_job() and job.trial_id is None:
        code.check_size(program.folder, what=f"the {'package' if program.kind == 'module' else 'script'}'s folder")
    storage, log = runpath.open_run(spec, progress)
    runtime_env = program.runtime_env() if shipped and not session.in_ray_job() else None
    with runpath.connected(spec, storage, progress, verbose=verbose, workers_needed=spec.workers,
                           program_env=runtime_env) as (lock, conn):
        program_config = program.to_config(shipped)
        if program.requirements:
            install_everywhere(program, program_config, conn.nodes, progress)
        return _run(spec, job, program_config, log, lock, conn, out, progress, started, verbose, on_metrics,
                    setup_s=setup_s)


def check_backend(spec) -> float:
    """UserError unless the spec's backend runs programs, and its framework, here; returns the
    seconds of one-off set-up it took (a first Horovod build), which the run's wall time leaves out."""
    from launcher import backends

    backend = backends.get(spec.backend)
    if not backend.runs_scripts:
        able = [b.name for b in backends.REGISTRY if b.runs_scripts]
        raise UserError(f"backend {spec.backend} cannot run scripts yet", f"use --backend {' or '.join(able)}")
    with startup.setup_phase() as setup:
        backend.prepare(spec.framework, lambda line: print(line, file=sys.stderr, flush=True))
    reason = backend.unavailable_reason(spec.framework)
    if reason:
        raise UserError(f"backend {spec.backend} cannot run {spec.framework} here: {reason}")
    return setup.seconds


def install_everywhere(program: Program, config: dict[str, Any], nodes, progress) -> None:
    """Install the program's dependencies on every node now (once per node; cached), so a
    requirement that cannot be installed is one line before any worker starts."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    what = " and ".join(program.sources)
    if program.archives:
        progress.note(f"installing {what} and its dependencies on {len(nodes)} node(s) (kept for later launches)")
    else:
        progress.note(f"installing the dependencies from {what} on {len(nodes)} node(s) "
                      f"({len(program.requirements)} requirement(s); kept for later launches)")

    @ray.remote(num_cpus=0)
    def install(program_config: dict[str, Any]) -> bool:
        try:
            return deps.ensure(program_config["requirements"], program_config["env_key"],
                               program_folder(program_config), pip_environ=program_config.get("pip_env"))[1]
        except deps.DependencyError as exc:
            return str(exc)

    t0 = time.time()
    refs = {n.node_id: install.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
            .remote(config) for n in nodes}
    installed = 0
    for node, ref in refs.items():
        result = ray.get(ref)
        if isinstance(result, str):
            shown = [r.replace("{folder}", program.folder) for r in program.requirements[:3]]
            subject = f"{what} (or a dependency)" if program.archives else f"the dependencies from {what}"
            raise UserError(f"{subject} could not be installed on node {node[:12]}: {result}",
                            f"try `pip install {' '.join(shown)}{' ...' if len(program.requirements) > 3 else ''}`"
                            f" here, fix {what}, then run again")
        installed += bool(result)
    progress.note(f"dependencies ready on every node in {time.time() - t0:.1f}s"
                  + (f" (installed on {installed})" if installed else " (already there)"))


def _run(spec, job: ProgramRun, program_config: dict[str, Any], log, lock, conn, out: TextIO, progress,
         started: float, verbose: bool, on_metrics=None, setup_s: float = 0.0) -> RunSummary:
    import ray

    from launcher import backends
    from launcher.driver.events import EventChannel, Mailbox, _on_this_node

    program, args = job.program, list(job.args)
    log.begin({**spec.to_dict(), "program": {"kind": program.kind, "target": program.target,
                                             "folder": program.folder, "args": list(args),
                                             **({"packages": list(program.packages)} if program.archives else {})}})
    run_uri = log.uri()
    progress.note(f"starting {spec.workers} {spec.framework}/{spec.backend} workers for {program.label}, "
                  f"run {spec.name} (AIP_CHECKPOINT_DIR {run_uri.rstrip('/')}/checkpoints/)")
    sink = Mailbox.options(**_on_this_node()).remote()  # the ranks' lines, statuses, metrics; their roster
    channel = EventChannel(board=False)
    config = {"program": program_config, "args": args, "job_dir": run_uri if job.job_dir else None, "run_uri": run_uri,
              "run_name": spec.name, "cwd": os.getcwd(), "backend": spec.backend, "framework": spec.framework,
              "sink": sink, "env": {**gcs.worker_env(), **dict(program.env)}, "notice_s": NOTICE_S,
              "trial_id": job.trial_id, "omp_threads": os.environ.get("OMP_NUM_THREADS")}
    trainer.apply_ray_train_env(conn.local, fixed=True)  # a program's group never shrinks
    run_config = ranks_run_config(spec, program, log.storage, [channel.forwarder, channel.states])
    ray_trainer = backends.get(spec.backend).script_trainer(spec, script_worker, config,
                                                            trainer.scaling_config(spec, elastic=False), run_config)
    outcome = Outcome(out)
    restarts: list[Restart] = []
    log_failed = False
    ranks_said = ProgramLines(log)  # the ranks' output in the run's logs/ (launcher logs NAME)

    def record(write) -> None:
        nonlocal log_failed
        try:
            write()
        except OSError as exc:
            if not log_failed:
                log_failed = True
                progress.note(f"cannot write the run log ({exc.strerror or type(exc).__name__}); "
                              "the program goes on")

    def drain() -> None:
        for event in ray.get(sink.take.remote()):
            if event.get("lines"):
                ranks_said.add(event.get("attempt", ""), int(event["rank"]), event["lines"])
            if event.get("usage"):
                record(lambda: log.record_usage({int(event["rank"]): event["usage"]}))
            for entry in outcome.handle(event):
                if on_metrics is not None:
                    on_metrics(dict(entry))
                record(lambda: log.record({"source": "hypertune", **entry}, tensorboard=False))
        record(ranks_said.flush)
        for event in channel.take():
            if isinstance(event, Preempting):
                progress.note(f"preemption notice: Ray is draining the node(s) of rank(s) "
                              f"{', '.join(map(str, event.ranks))}; the program gets SIGTERM")
            elif isinstance(event, Restart):
                restarts.append(event)
                progress.note(f"restarting the program on a new worker group after {event.what()}")
        lock.refresh()

    try:
        fitted = trainer.fit(ray_trainer, drain, local=conn.local, verbose=verbose, poll_s=POLL_S,
                             abort=channel.abort, limit_s=spec.max_run_s)
    finally:
        channel.close()
        ray.kill(sink)
        record(lambda: ranks_said.flush(force=True))
    return _finish(spec, program, fitted, outcome, restarts, log, progress, started, setup_s)


def ranks_run_config(spec, program: Program, storage, callbacks: list):
    """Ray Train's RunConfig for a program's run; a container's ranks run in its image
    (``worker_runtime_env``: the ranks alone, see Program.worker_runtime_env)."""
    run_config = trainer.run_config(spec, storage, max_failures=spec.max_failures, callbacks=callbacks)
    if program.image:
        run_config.worker_runtime_env = program.worker_runtime_env()
    return run_config


def run_reports(log, outcome: Outcome) -> list[dict[str, Any]]:
    """Every hypertune entry of the run, its earlier launches' included (the run log's); this
    launch's alone where the log cannot be read."""
    try:
        return [e for e in log.reader.metrics() if e.get("source") == "hypertune"]
    except OSError:
        return list(outcome.metrics)


def _finish(spec, program: Program, fitted, outcome: Outcome, restarts: list[Restart], log, progress,
            started: float, setup_s: float = 0.0) -> RunSummary:
    if fitted.status == RunStatus.CANCELLED:
        code, message = EXIT_INTERRUPTED, "interrupted; the program was stopped on every worker (the same --name " \
                                          "continues the run)"
        if fitted.error and fitted.error != trainer.INTERRUPTED:  # the time limit, a stopped tuning trial
            message = fitted.error
    else:
        code, message = outcome.exit_code(spec.workers, None if fitted.status == RunStatus.SUCCEEDED
                                          else fitted.error)
    status = fitted.status if fitted.status != RunStatus.SUCCEEDED or code == 0 else RunStatus.FAILED
    last = outcome.metrics[-1] if outcome.metrics else {}
    reported = run_reports(log, outcome)
    model_dir = vertex.output_dirs(log.uri())["AIP_MODEL_DIR"]
    summary = RunSummary(
        name=spec.name, status=status, workload=program.label, framework=spec.framework, backend=spec.backend,
        workers=spec.workers, epochs=0, epochs_completed=program_epochs(reported),
        steps_completed=int(last.get("global_step") or 0), metrics=program_metrics(outcome.metrics),
        restarts=len(restarts),
        preemptions=sum(1 for r in restarts if r.cause == "preemption"), preemption_notices=len(outcome.notices),
        interruptions=[Interruption(cause=r.cause) for r in restarts],
        wall_s=round(time.time() - started - setup_s, 2), setup_s=round(setup_s, 2),
        launch=log.launch, run_dir=log.uri(), error=message,
        model=model_dir if log.storage.exists(spec.name, "model") else None, mlflow=log.tracked(),
        exit_codes={str(r): s for r, s in sorted(outcome.last_statuses().items())}, exit_status=code)
    try:
        log.finish(summary.to_json())
    except OSError as exc:
        summary.error = "; ".join(filter(None, (summary.error, f"the run log could not be written "
                                                f"({exc.strerror or type(exc).__name__})")))
    if message:
        progress.note(f"error: {message}")
    return summary
