"""The ``launcher`` command line: parse, call one library function, print.

``main(argv)`` returns the exit code, so tests and notebooks can call it.
User errors print one line on stderr (what, why, how to fix) and exit 2;
a run that fails exits 1; --verbose adds tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
from typing import Any, Iterator, Sequence, TextIO

from launcher import __version__
from launcher.cli import bench as cli_bench
from launcher.cli import cluster as cli_cluster
from launcher.cli import doctor as cli_doctor
from launcher.cli import jobs as cli_submit
from launcher.driver import startup
from launcher.errors import UserError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130

# flag -> (JobSpec field, type, help); every JobSpec field but params has one.
RUN_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--workload", "workload", str, "workload name (see `launcher workloads`); default digits-mlp"),
    ("--framework", "framework", str, "torch (default) or tensorflow"),
    ("--backend", "backend", str, "native (Ray Train's own: torch DDP, TF MultiWorkerMirroredStrategy; default) "
     "or horovod (see `launcher doctor`)"),
    ("--workers", "workers", int, "number of worker processes (default 2)"),
    ("--cpus-per-worker", "cpus_per_worker", float, "CPUs per worker (default 1)"),
    ("--gpus-per-worker", "gpus_per_worker", float, "GPUs per worker (default 0)"),
    ("--epochs", "epochs", int, "epochs to train in all (default: the workload's)"),
    ("--batch-size", "batch_size", int, "batch size per worker (default: the workload's)"),
    ("--lr", "lr", float, "learning rate (default: the workload's)"),
    ("--seed", "seed", int, "random seed (default 0): same seed and workers, same result"),
    ("--data", "data", str, "data for workloads that read files: a local path or gs://BUCKET/PREFIX"),
    ("--storage", "storage", str, "where runs are kept: a folder or gs://BUCKET/PREFIX (default ./runs)"),
    ("--name", "name", str, "run name; an existing name resumes that run"),
    ("--checkpoint-every-steps", "checkpoint_every_steps", int, "also checkpoint every N steps (default: per epoch)"),
    ("--keep-checkpoints", "keep_checkpoints", int, "checkpoints to keep (default 3)"),
    ("--max-failures", "max_failures", int, "worker-group restarts allowed after failures (default 0, -1: "
     "unlimited); preemptions never count"),
    ("--min-workers", "min_workers", int, "elastic: when nodes are lost and not replaced, go on with as "
     "few as this many workers (default: always --workers)"),
    ("--preemption-check-steps", "preemption_check_steps", int, "check for a preemption notice every N steps "
     "and checkpoint at once on one (default 10, 0: never)"),
    ("--address", "address", str, "Ray cluster address (default: RAY_ADDRESS or a new local Ray)"),
    ("--hvd-fp16", "hvd_fp16", bool, "Horovod: compress gradients to fp16 for the allreduce"),
    ("--hvd-fusion-mb", "hvd_fusion_mb", float, "Horovod: tensor-fusion buffer in MiB (default 128; 0: off)"),
    ("--hvd-backward-passes", "hvd_backward_passes", int,
     "Horovod: backward passes (batches) whose gradients add up locally per optimizer step (default 1)"),
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="launcher", description="Distributed deep-learning training on Ray, "
                "from a laptop to a Compute Engine cluster.")
    p.add_argument("--version", action="version", version=f"launcher {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="show Ray's logs and full tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="train a workload (resumes a run of the same --name)")
    run.add_argument("--config", help="job spec YAML; flags override its values")
    for flag, dest, typ, help_ in RUN_FLAGS:
        if typ is bool:  # a switch; None when absent so the YAML's value stands
            run.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=help_)
        else:
            run.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    run.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                     help="workload parameter, e.g. --param image_size=64 (repeatable)")
    run.add_argument("--script", help="run this unmodified training script on every worker instead of a "
                     "workload, with the backend's environment (e.g. horovodrun's); arguments after --")
    run.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARGS", help="arguments for --script")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    run.add_argument("--profile-startup", action="store_true",
                     help="print where the time went before the first training step")
    run.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                     help="show Ray's logs and full tracebacks")

    wl = sub.add_parser("workloads", help="list workloads, their frameworks and the data they need")
    wl.add_argument("--json", action="store_true")

    runs = sub.add_parser("runs", help="list the runs under a storage root")
    runs.add_argument("--storage", default="./runs", help="storage root: a folder or gs://BUCKET/PREFIX "
                      "(default ./runs)")
    runs.add_argument("--json", action="store_true")

    up = sub.add_parser("up", help="start a warm local Ray head that `launcher run` uses until `launcher down`")
    up.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the head (default: this machine's)")
    up.add_argument("--port", type=int, default=6390, help="the head's GCS port on 127.0.0.1 (default 6390)")
    sub.add_parser("down", help="stop the warm local Ray head started by `launcher up`")

    bench_sub = cli_bench.add_parsers(sub, _Parser)

    from launcher.cli import preemption as cli_preemption

    cli_preemption.add_bench_parser(bench_sub)
    cli_preemption.add_parsers(sub, _Parser)

    data = sub.add_parser("data", help="data on Cloud Storage")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", parser_class=_Parser, required=True)
    up = data_sub.add_parser("upload", help="upload a data file or folder; prints the URI to pass as --data")
    up.add_argument("local", help="file or folder to upload")
    up.add_argument("uri", help="gs://BUCKET/PREFIX to upload under")
    cli_cluster.add_parsers(sub, _Parser)
    cli_submit.add_parsers(sub, _Parser)
    cli_doctor.add_parsers(sub, _Parser)
    return p


def spec_from_args(args: argparse.Namespace):
    """YAML file (if any) first, then the flags that were given."""
    from launcher.spec import JobSpec
    from launcher.specfile import load_spec_file

    spec = load_spec_file(args.config) if args.config else JobSpec()
    overrides = {dest: getattr(args, dest) for _, dest, _, _ in RUN_FLAGS}
    if args.param:
        params = dict(spec.params)
        for item in args.param:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise UserError(f"--param {item!r} is not KEY=VALUE", "for example --param image_size=64")
            params[key.strip()] = value.strip()
        overrides["params"] = params
    return spec.merged(overrides).validated()


def cmd_run(args: argparse.Namespace) -> int:
    if args.script or args.script_args:
        from launcher.driver.script import cmd_script

        return cmd_script(args)
    from launcher.driver import launch as driver

    spec = spec_from_args(args)
    # SIGTERM (a scheduler or CI stopping us) ends the run like Ctrl-C: summary written, exit 130.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with summary_stream() as out:
            summary = driver.run(spec, verbose=args.verbose)
            if args.profile_startup:
                print(startup.format_table(summary["startup"]), file=sys.stderr)
            text = json.dumps(summary, sort_keys=True, default=str) if args.json else format_summary(summary)
            print(text, file=out, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"succeeded": EXIT_OK, "cancelled": EXIT_CANCELLED}.get(summary["status"], EXIT_FAILED)


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


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def format_summary(s: dict[str, Any]) -> str:
    m = s.get("metrics") or {}
    lines = [f"run {s['name']}: {s['status']}"]
    if s.get("note"):
        lines.append(f"  {s['note']}")
    lines.append(f"  {s['workload']} / {s['framework']} / {s['backend']}, {s['workers']} workers")
    lines.append(f"  epochs {s['epochs_completed']}/{s['epochs']}, steps {s['steps_completed']}"
                 + (f", resumed from epoch {s['resumed_from']['epoch']}" if s.get("resumed_from") else "")
                 + (f", {s['restarts']} restart(s)" if s.get("restarts") else ""))
    if s.get("restarts") or s.get("preemption_notices"):
        lines.append("  " + format_interruptions(s))
    if m:
        lines.append("  " + ", ".join(f"{k} {v:.4f}" for k, v in m.items()))
    lines.append(f"  {s['samples_per_s']:,.0f} samples/s, wall {s['wall_s']:.1f}s")
    if s.get("error"):
        lines.append(f"  error: {s['error']}")
    lines.append(f"  run log:    {s['run_dir']}")
    if s.get("checkpoint"):
        lines.append(f"  checkpoint: {s['checkpoint']}")
    if s.get("model"):
        lines.append(f"  model:      {s['model']}")
    return "\n".join(lines)


def format_interruptions(s: dict[str, Any]) -> str:
    pre, notices = s.get("preemptions", 0), s.get("preemption_notices", 0)
    return (f"preemptions {pre} ({notices} checkpointed on a notice), failures {s['restarts'] - pre}; "
            f"steps lost {s.get('steps_lost', 0)}, time lost {s.get('time_lost_s', 0.0):.1f}s")


def cmd_workloads(args: argparse.Namespace) -> int:
    import workloads

    described = [w.describe() for w in workloads.REGISTRY]
    if args.json:
        print(json.dumps(described, indent=1))
        return EXIT_OK
    for d in described:
        print(f"{d['name']:<20} {', '.join(d['frameworks']):<12} {d['description']}")
        print(f"{'':<20} data: {d['data']}")
        for name, p in d["params"].items():
            print(f"{'':<20} --param {name}=... (default {p['default']}): {p['help']}")
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    from launcher.storage.runs import format_table, list_runs
    from launcher.spec import normalize_storage
    from launcher.storage import Storage

    storage = Storage.resolve(normalize_storage(args.storage))
    runs = list_runs(storage)
    print(json.dumps(runs, indent=1) if args.json else format_table(runs))
    return EXIT_OK


def cmd_data(args: argparse.Namespace) -> int:
    from launcher.storage.datacache import upload

    uri = upload(args.local, args.uri)
    print(uri)
    return EXIT_OK


def cmd_up(args: argparse.Namespace) -> int:
    from launcher.driver import localhead

    if args.num_cpus is not None and args.num_cpus < 1:
        raise UserError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    state = localhead.up(args.num_cpus, args.port, note=lambda message: print(message, file=sys.stderr, flush=True))
    verb = "already running" if state.get("already_running") else "started"
    print(f"warm local Ray {verb} at {state['address']} with {state['num_cpus']} CPUs; "
          "`launcher run` uses it until `launcher down`")
    return EXIT_OK


def cmd_down(args: argparse.Namespace) -> int:
    from launcher.driver import localhead

    print("stopped the warm local Ray" if localhead.down() else "no warm local Ray was running")
    return EXIT_OK


def cmd_preemption(args: argparse.Namespace) -> int:
    from launcher.cli.preemption import cmd_preemption as run_preemption_command

    return run_preemption_command(args)


COMMANDS = {"run": cmd_run, "workloads": cmd_workloads, "runs": cmd_runs, "data": cmd_data, "bench": cli_bench.cmd_bench,
            "up": cmd_up, "down": cmd_down, "cluster": cli_cluster.cmd_cluster, **cli_submit.COMMANDS,
            **cli_doctor.COMMANDS, "preemption": cmd_preemption}


def _exit_now(code: int) -> None:
    """End a finished ``launcher run`` process without the interpreter's clean-up.

    Everything is written and Ray is shut down by now; tearing down the modules
    Ray, pyarrow and friends loaded takes another ~0.6 s on a 2-core machine.
    """
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv_given = argv
    if argv is None:  # a real command line: time the process from its start
        startup.begin_cli()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    verbose = "-v" in argv or "--verbose" in argv
    try:
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return EXIT_USAGE
        code = COMMANDS[args.command](args)
        if argv_given is None and args.command == "run":
            _exit_now(code)
        return code
    except UserError as exc:
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_CANCELLED
