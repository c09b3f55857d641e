"""``launcher run`` (a workload, or an unmodified script with --script) and ``launcher workloads``."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
from typing import Iterator, TextIO

from launcher import frameworks
from launcher.cli.options import (EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, add_program_flags, add_run_flags, add_verbose,
                                  program_from_args, program_spec, spec_from_args, wants_job_dir)
from launcher.driver import startup
from launcher.measures import format_memory, format_shares, format_usage
from launcher.storage.checkpoint import resume_point
from launcher.storage.runs import format_quorums
from launcher.summary import RunStatus, RunSummary


def add_parsers(sub) -> None:
    run = sub.add_parser("run", help="train a workload (resumes a run of the same --name)")
    add_run_flags(run)
    add_program_flags(run)
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    run.add_argument("--profile-startup", action="store_true",
                     help="print where the time went before the first training step")
    add_verbose(run)

    wl = sub.add_parser("workloads", help="list workloads, their frameworks, data and --params; or check and "
                        "describe your own (FILE.py:NAME or package.module:NAME)")
    wl.add_argument("workload", nargs="?", metavar="FILE.py:NAME",
                    help="a workload of yours to check and describe (default: list the built-in ones)")
    wl.add_argument("--json", action="store_true")


def cmd_run(args: argparse.Namespace) -> int:
    program = program_from_args(args)
    if program is not None:
        return cmd_program(args, program)
    from launcher.driver import launch
    from workloads.user import defer_framework_imports

    with defer_framework_imports():  # the workers load them; the driver seldom needs them
        spec = spec_from_args(args)
    with sigterm_as_ctrl_c():
        with summary_stream() as out:
            summary = launch.run(spec, verbose=args.verbose)
            if args.profile_startup:
                print(startup.format_table(summary.startup), file=sys.stderr)
            text = json.dumps(summary.to_json(), sort_keys=True, default=str) if args.json else format_summary(summary)
            print(text, file=out, flush=True)
            if args.json and summary.error and summary.status == RunStatus.FAILED:
                print(f"error: {summary.error}", file=sys.stderr, flush=True)  # for the person reading stderr
    return {RunStatus.SUCCEEDED: EXIT_OK, RunStatus.CANCELLED: EXIT_CANCELLED}.get(summary.status, EXIT_FAILED)


def cmd_program(args: argparse.Namespace, program) -> int:
    """``launcher run --script`` / ``--package --module``: check everything, then run;
    returns the program's exit status (130 when interrupted)."""
    from launcher.driver import launch
    from launcher.driver.script import ProgramRun

    spec = program_spec(args, program)
    job = ProgramRun(program, tuple(args.program_args), job_dir=wants_job_dir(args, program))
    with sigterm_as_ctrl_c():
        with summary_stream() as out:
            # The ranks' lines are progress: stderr, as the docs say; stdout holds the summary alone.
            summary = launch.run(spec, job, out=sys.stderr, verbose=args.verbose)
            text = json.dumps(summary.to_json(), sort_keys=True, default=str) if args.json else format_summary(summary)
            print(text, file=out, flush=True)
    return summary.exit_status


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Meanwhile SIGTERM (a scheduler, CI or `launcher stop` stopping us) ends the run as
    Ctrl-C does: the workers aborted, the summary written, exit 130."""
    previous = signal.signal(signal.SIGTERM, _sigterm_as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def summary_stream() -> Iterator[TextIO]:
    """Yield the stream for the summary; meanwhile file descriptor 1 points at stderr.

    Ray prints some messages (a worker that died, ...) straight to stdout. While
    a run goes, everything written to stdout at any level lands on stderr, so
    stdout holds the summary alone (scripts parse `--json`).
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # captured (tests, notebooks)
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    os.dup2(sys.stderr.fileno(), fd)
    try:
        with os.fdopen(os.dup(saved), "w") as out:
            yield out
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def _sigterm_as_sigint(signum, frame) -> None:
    """Do what Ctrl-C would do now: while a trainer fits, Ray Train's SIGINT handler
    (it aborts the controller and the workers, then the fit ends); otherwise Python's."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def format_summary(s: RunSummary) -> str:
    if s.exit_codes is not None:
        return format_program_summary(s)
    lines = [f"run {s.name}: {s.status}"]
    if s.note:
        lines.append(f"  {s.note}")
    strategy = f", strategy {s.strategy}" if s.strategy else ""
    lines.append(f"  {s.workload} / {s.framework} / {s.backend}{strategy}, {s.workers} workers")
    framework = frameworks.get(s.framework)
    done = (f"epochs {s.epochs_completed}/{s.epochs}, steps {s.steps_completed}" if framework.counts_epochs
            else f"{framework.step_word} {s.steps_completed}")
    lines.append(f"  {done}"
                 + (f", resumed {resume_point(s.resumed_from, s.epochs)}" if s.resumed_from else "")
                 + (f", {s.restarts} restart(s)" if s.restarts else ""))
    if s.restarts or s.preemption_notices:
        lines.append("  " + format_interruptions(s))
    if s.quorum_changes or s.replicas_replaced:  # --strategy ft
        lines.append("  " + format_quorums(s.quorum_changes, s.quorum_change_s, s.replicas_replaced))
    if s.metrics:
        lines.append("  " + ", ".join(f"{k} {v:.4f}" for k, v in s.metrics.items()))
    rate = f"{s.samples_per_s:,.0f} samples/s, " if s.samples_per_s else ""  # a Ray Train function counts none
    wait = "" if s.data_wait_fraction is None or s.time_shares else (
        f"input wait {100 * s.data_wait_fraction:.1f}% of training (slowest rank's worst epoch "
        f"{100 * (s.data_wait_max_fraction or 0):.1f}%), ")
    lines.append(f"  {rate}{wait}wall {s.wall_s:.1f}s{format_setup(s)}")
    if s.time_shares:
        lines.append("  " + format_shares(s.time_shares, s.stragglers))
    memory = format_memory(vars(s))
    if memory:
        lines.append(f"  {memory}")
    lines += [f"  {line}" for line in format_usage(s.usage)]
    if s.error:
        lines.append(f"  error: {s.error}")
    lines.append(f"  run log:    {s.run_dir}")
    if s.checkpoint:
        lines.append(f"  checkpoint: {s.checkpoint}")
    if s.model:
        lines.append(f"  model:      {s.model}")
        if s.model_note:
            lines.append(f"              {s.model_note}")
    if s.mlflow:
        lines.append(f"  mlflow:     {s.mlflow}")
    return "\n".join(lines)


def format_program_summary(s: RunSummary) -> str:
    """A script's or package's run: exit statuses, restarts, last reported metrics."""
    codes = ", ".join(f"rank {r}: {c}" for r, c in s.exit_codes.items()) or "none reported"
    lines = [f"run {s.name}: {s.status}", f"  {s.workload} / {s.framework} / {s.backend}, {s.workers} workers",
             f"  exit status {codes}"]
    if s.restarts or s.preemption_notices:
        lines.append(f"  restarts {s.restarts}: preemptions {s.preemptions} ({s.preemption_notices} notice(s) "
                     f"passed on as SIGTERM), failures {s.restarts - s.preemptions}")
    if s.metrics:
        lines.append("  last reported (hypertune): " + ", ".join(f"{k} {v:g}" for k, v in s.metrics.items())
                     + (f" at step {s.steps_completed}" if s.steps_completed else "")
                     + (f"; epochs {s.epochs_completed} (by its reports)" if s.epochs_completed else ""))
    lines.append(f"  wall {s.wall_s:.1f}s{format_setup(s)}")
    if s.error:
        lines.append(f"  error: {s.error}")
    lines.append(f"  run log:    {s.run_dir}")
    if s.model:
        lines.append(f"  model:      {s.model}")
    if s.mlflow:
        lines.append(f"  mlflow:     {s.mlflow}")
    return "\n".join(lines)


def format_setup(s: RunSummary) -> str:
    """" (+ 561.0s of one-off set-up ...)" where the launch waited for one (a first Horovod build): its
    time is in neither the wall time nor samples/s."""
    return f" (+ {s.setup_s:.1f}s of one-off set-up: see --profile-startup)" if s.setup_s >= 0.05 else ""


def format_interruptions(s: RunSummary) -> str:
    took = f" in {s.notice_checkpoint_s:.1f}s" if s.notice_checkpoint_s is not None else ""
    return (f"preemptions {s.preemptions} ({s.preemption_notices} checkpointed on a notice{took}), "
            f"failures {s.restarts - s.preemptions}; steps lost {s.steps_lost}, time lost {s.time_lost_s:.1f}s")


def cmd_workloads(args: argparse.Namespace) -> int:
    import workloads

    from launcher.spec import canonical_workload, load_workload

    if args.workload:
        described = [{**load_workload(args.workload).describe(), "reference": canonical_workload(args.workload)}]
    else:
        described = [w.describe() for w in workloads.REGISTRY]
    if args.json:
        print(json.dumps(described, indent=1))
        return EXIT_OK
    print("\n".join(workload_lines(described)))
    return EXIT_OK


def workload_lines(described: list[dict]) -> list[str]:
    """``launcher workloads`` as a table: each column as wide as its longest entry and two spaces
    apart (a fixed width ran the frameworks "torch, tensorflow" into the description), the
    workload's details indented under its frameworks."""
    frameworks = [", ".join(d["frameworks"]) for d in described]
    name_w = max([len("NAME")] + [len(d["name"]) for d in described])
    fw_w = max([len("FRAMEWORKS")] + [len(f) for f in frameworks])
    pad = " " * (name_w + 2)
    lines = [f"{'NAME':<{name_w}}  {'FRAMEWORKS':<{fw_w}}  DESCRIPTION"]
    for d, fw in zip(described, frameworks):
        lines.append(f"{d['name']:<{name_w}}  {fw:<{fw_w}}  {d['description']}")
        if d.get("reference"):
            lines.append(f"{pad}--workload {d['reference']}")
        if d.get("kind"):
            lines.append(f"{pad}{d['kind']}, defined at {d['defined_at']}")
        defaults = d.get("defaults") or {}
        if d.get("kind") and defaults:
            lines.append(f"{pad}defaults: epochs {defaults['epochs']}, batch size {defaults['batch_size']}, "
                         f"lr {defaults['lr']:g}")
        lines.append(f"{pad}data: {d['data']}")
        if isinstance(d["params"], str):
            lines.append(f"{pad}params: {d['params']}")
            continue
        lines += [f"{pad}--param {name}=... (default {p['default']}): {p['help']}" for name, p in d["params"].items()]
    return lines


COMMANDS = {"run": cmd_run, "workloads": cmd_workloads}
