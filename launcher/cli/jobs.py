"""``launcher submit / jobs / status / logs / stop``: runs as Ray jobs on a running cluster.

Parsers and handlers only; the work is in :mod:`launcher.driver.jobs`. Every
command takes ``--address http://HEAD:8265`` (the dashboard's job API), or
reads RAY_API_SERVER_ADDRESS / RAY_ADDRESS. ``submit`` takes every
``launcher run`` flag and validates the spec here, before anything is sent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from launcher import _ray
from launcher.cli.options import (EXIT_CANCELLED, EXIT_OK, add_program_flags, add_run_flags, add_verbose,
                                  program_from_args, program_spec, spec_from_args, wants_job_dir)
from launcher.storage import Storage
from launcher.storage.runlog import RunRecord
from launcher.storage.uri import DEFAULT_STORAGE, normalize_storage

ADDRESS_HELP = ("the head's dashboard (Ray job API), e.g. http://127.0.0.1:8265; "
                "default RAY_API_SERVER_ADDRESS, else RAY_ADDRESS")


def add_parsers(sub) -> None:
    """Add the job commands to the ``launcher`` subparsers ``sub``."""
    sb = sub.add_parser("submit", help="submit a run to a running Ray cluster as a Ray job; prints the job id")
    # The run flags, but --address: here it is the job server, not the run's cluster.
    add_run_flags(sb, skip=("address",))
    sb.set_defaults(address=None)
    _address(sb)
    add_program_flags(sb)
    sb.add_argument("--follow", action="store_true",
                    help="then stream the job's logs until it ends; exit code as for `launcher logs --follow`")
    sb.add_argument("--json", action="store_true", help="print the job id, run name and address as one JSON object")

    jobs = sub.add_parser("jobs", help="list the runs submitted to a Ray cluster")
    _address(jobs)
    jobs.add_argument("--json", action="store_true")

    st = sub.add_parser("status", help="a submitted job's status and Ray's message about it")
    st.add_argument("job_id", metavar="JOB", help="the id `launcher submit` printed")
    _address(st)
    st.add_argument("--json", action="store_true", help="Ray's full job details as one JSON object")

    lg = sub.add_parser("logs", help="a run's output, every rank's (NAME), or a submitted job's driver (JOB); "
                        "--follow streams it until the run or job ends")
    lg.add_argument("job_id", metavar="NAME|JOB", help="a run's name (its ranks' output, kept in its storage), or "
                    "the job id `launcher submit` printed (launcher-NAME: the job's driver output)")
    _address(lg)
    lg.add_argument("--follow", "-f", action="store_true",
                    help="stream until the run's launch or the job ends (a job: then exit 0 if it SUCCEEDED, "
                         "1 if FAILED, 130 if STOPPED)")
    lg.add_argument("--storage", default=DEFAULT_STORAGE, help=f"a run's storage root (default {DEFAULT_STORAGE})")
    lg.add_argument("--rank", type=int, metavar="R", help="a run: this rank's output only")
    lg.add_argument("--launch", type=int, metavar="N", help="a run: its Nth launch (default: the last with output)")

    sp = sub.add_parser("stop", help="stop a submitted job (the run writes its summary; the same --name resumes)")
    sp.add_argument("job_id", metavar="JOB")
    _address(sp)
    sp.add_argument("--no-wait", action="store_true", help="return once the stop is requested")


def _address(parser: argparse.ArgumentParser) -> None:
    """--address and -v, the options every job command takes."""
    parser.add_argument("--address", dest="job_server", default=None, metavar="URL", help=ADDRESS_HELP)
    add_verbose(parser)


def _quiet_ray(verbose: bool) -> None:
    """Ray's job client quiet unless -v (see :func:`launcher._ray.quiet_job_client`)."""
    if not verbose:
        _ray.quiet_job_client()


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cmd_submit(args: argparse.Namespace) -> int:
    from launcher.driver import jobs as submit

    program = program_from_args(args)  # bad flags and programs stop here: nothing is sent
    spec = program_spec(args, program) if program is not None else spec_from_args(args)
    _quiet_ray(args.verbose)
    job = submit.submit(spec, args.job_server, program, args.program_args, job_dir=wants_job_dir(args, program))
    if not spec.storage.startswith("gs://"):
        _note(f"note: storage {spec.storage} is a local path: every node of the cluster must see it "
              "(on a cloud cluster use --storage gs://BUCKET/PREFIX)")
    if args.json:
        print(json.dumps({"job_id": job.job_id, "name": job.name, "address": job.address,
                          "entrypoint": job.entrypoint}), flush=True)
    else:
        print(job.job_id, flush=True)
    _note(f"submitted run {job.name} as job {job.job_id} to {job.address}; follow it with "
          f"`launcher logs {job.job_id} --follow --address {job.address}`")
    if not args.follow:
        return EXIT_OK
    return _follow(submit, args.job_server, job.job_id)


def _follow(submit, address: str | None, job_id: str) -> int:
    try:
        status = submit.follow(address, job_id, submit.write_stdout)
    except KeyboardInterrupt:
        _note(f"stopped following; job {job_id} goes on (`launcher stop {job_id}` stops it)")
        return EXIT_CANCELLED
    _note(f"job {job_id}: {status}")
    return submit.exit_code(status)


def cmd_jobs(args: argparse.Namespace) -> int:
    from launcher.driver import jobs as submit

    _quiet_ray(args.verbose)
    jobs = submit.list_jobs(args.job_server)
    if args.json:
        print(json.dumps(jobs, indent=1))
        return EXIT_OK
    if not jobs:
        print("no launcher jobs on this cluster")
        return EXIT_OK
    print(f"{'JOB':<40} {'RUN':<36} STATUS")
    for j in jobs:
        print(f"{j['job_id']:<40} {j['run']:<36} {j['status']}")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from launcher.driver import jobs as submit

    _quiet_ray(args.verbose)
    details = submit.info(args.job_server, args.job_id)
    if args.json:
        print(json.dumps(details, sort_keys=True, default=str))
    else:
        print(format_status(details))
    return EXIT_OK


def format_status(d: dict[str, Any]) -> str:
    lines = [f"job {d.get('submission_id') or d.get('job_id')}: {d['status']}"]
    if d.get("message"):
        lines.append(f"  {d['message']}")
    run = (d.get("metadata") or {}).get("launcher_run")
    if run:
        lines.append(f"  run: {run}")
    if d.get("start_time") and d.get("end_time"):
        lines.append(f"  wall: {(d['end_time'] - d['start_time']) / 1000:.1f}s")
    if d.get("driver_exit_code") is not None:
        lines.append(f"  exit code: {d['driver_exit_code']}")
    return "\n".join(lines)


def cmd_logs(args: argparse.Namespace) -> int:
    from launcher.driver import jobs as submit

    storage = Storage.resolve(normalize_storage(args.storage))
    cluster = args.job_server or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if args.job_server is None and (RunRecord(storage, args.job_id).exists() or not cluster):
        # A run of that name (or no cluster to ask for a job): its ranks' output, from its storage.
        from launcher.cli.runviews import show_logs

        return show_logs(storage, args.job_id, rank=args.rank, launch=args.launch, follow=args.follow)
    _quiet_ray(args.verbose)
    if args.follow:
        return _follow(submit, args.job_server, args.job_id)
    submit.write_stdout(submit.logs(args.job_server, args.job_id))
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from launcher.driver import jobs as submit

    _quiet_ray(args.verbose)
    if args.no_wait:
        was_running, status = submit.stop(args.job_server, args.job_id, wait_s=0)
    else:
        was_running, status = submit.stop(args.job_server, args.job_id)
    if not was_running:
        print(f"job {args.job_id} had already ended: {status}")
    else:
        print(f"job {args.job_id}: {status}" + ("" if status in submit.TERMINAL else " (stop requested)"))
    return EXIT_OK


COMMANDS = {"submit": cmd_submit, "jobs": cmd_jobs, "status": cmd_status, "logs": cmd_logs, "stop": cmd_stop}
