"""What the commands share: exit codes, the parser class, and the run flags.

The run flags (``launcher run``, ``launcher submit``, and later ``tune``) are
generated from :class:`~launcher.spec.JobSpec`'s declaration, so a new spec
field is a new flag and YAML key at once. :func:`spec_from_args` turns the
parsed flags (over an optional ``--config`` YAML) into a validated spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import re
import sys

from launcher import flags, schema
from launcher.errors import UserError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """-v after the command too (``launcher run -v``), not only before it."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show Ray's logs and full tracebacks")


def add_run_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """``--config``, one flag per JobSpec field (except ``skip``) and ``--param KEY=VALUE``."""
    from launcher.spec import JobSpec  # imports the workload registry: only for the commands that run

    parser.add_argument("--config", help="job spec YAML, or an AI Platform / Vertex AI job file (trainingInput, "
                        "workerPoolSpecs, a CustomJob or HyperparameterTuningJob); flags override its values")
    flags.add_flags(parser, JobSpec, skip=skip)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter, e.g. --param image_size=64 (repeatable)")


def add_program_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that run the user's own program instead of a workload (run and submit)."""
    parser.add_argument("--script", help="run this unmodified training script on every worker instead of a "
                        "workload, with the backend's environment (torchrun's, horovodrun's, TF_CONFIG) and "
                        "Vertex AI's; its folder is shipped to every node; arguments after --")
    parser.add_argument("--package", metavar="DIR|URIS", help="a trainer package's folder (as gcloud's "
                        "--package-path), or built packages (as --python-package-uris): sdists (.tar.gz) and "
                        "wheels (.whl), local or gs://, separated by commas, installed in order; shipped to every "
                        "node and installed there with the dependencies they declare (the driver's PIP_* "
                        "variables apply)")
    parser.add_argument("--module", metavar="NAME", help="the module to run from --package, as python -m NAME "
                        "(as gcloud's --module-name), e.g. trainer.task")
    parser.add_argument("--no-job-dir", action="store_true",
                        help="do not append --job-dir RUN_DIR to a package's arguments (AI Platform passes it)")
    parser.add_argument("--job-dir-arg", action="store_true",
                        help="append --job-dir RUN_DIR to a --script's arguments too (off by default: a script "
                        "written for torchrun or horovodrun would reject an unknown flag)")
    parser.add_argument("--worker-pool-spec", action="append", default=[], metavar="KEY=VALUE,...",
                        help="a Vertex AI worker pool, as gcloud ai custom-jobs create takes it (repeatable: pool 0 "
                        "the primary replica, pool 1 the workers): machine-type, replica-count, accelerator-type, "
                        "accelerator-count, python-module, executor-image-uri")
    parser.add_argument("program_args", nargs="*", metavar="-- ARGS",
                        help="arguments for --script or --module")


def job_file(args: argparse.Namespace, *, tuning: bool = False):
    """The AI Platform / Vertex AI job that ``--config`` or ``--worker-pool-spec`` gives (None:
    neither does), read once per command; its notes are printed then, before anything starts.

    A job file's package, module and arguments stand where the flags name none."""
    if hasattr(args, "_job_file"):
        return args._job_file
    from launcher import jobfiles

    job = None
    raw = schema.load_yaml(args.config, "--config") if getattr(args, "config", None) else None
    if jobfiles.kind_of(raw):
        job = jobfiles.read(raw, args.config, tuning=tuning)
    pools = getattr(args, "worker_pool_spec", None) or []
    if pools:
        if job is not None:
            raise UserError("--worker-pool-spec and a job file in --config both describe the job",
                            "give one of them")
        job = jobfiles.worker_pool_flags(pools)
        if isinstance(raw, dict):  # the launcher's own YAML: the pools go over its keys
            job.fields = {**raw, **job.fields}
            job.source = args.config
    args._job_file = job
    if job is not None:
        for line in job.notes:
            print(f"note: {line}", file=sys.stderr, flush=True)
        if not (args.script or args.package) and job.package:
            args.package = job.package
        if not (args.script or args.module) and job.module:
            args.module = job.module
        if not args.program_args and job.args:
            args.program_args = list(job.args)
    return job


def program_from_args(args: argparse.Namespace, *, tuning: bool = False):
    """The Program the flags name (or the job file), checked (None: a workload run)."""
    from launcher.driver.program import from_flags

    job_file(args, tuning=tuning)
    job = getattr(args, "_job_file", None)
    if job is not None and job.image and not (args.script or args.package or args.module):
        from launcher.driver.program import from_container

        return from_container(job.image, job.command, job.env)  # its args are args.program_args already
    program = from_flags(args.script, args.package, args.module)
    if program is not None and job is not None and job.env:
        program = dataclasses.replace(program, env=tuple(sorted(job.env.items())))
    if program is None and args.program_args:
        raise UserError(f"unexpected arguments {' '.join(args.program_args)!r}",
                        "program arguments go after --script PATH (or --package DIR --module NAME) and --, "
                        "e.g. --script train.py -- --lr 0.1")
    if program is None and (args.no_job_dir or args.job_dir_arg):
        raise UserError(f"{'--no-job-dir' if args.no_job_dir else '--job-dir-arg'} applies to --script or "
                        "--package runs only")
    if args.no_job_dir and args.job_dir_arg:
        raise UserError("--no-job-dir and --job-dir-arg contradict each other", "give one of them")
    return program


def wants_job_dir(args: argparse.Namespace, program) -> bool:
    """Whether the program gets ``--job-dir RUN_DIR``: a package does (as on AI Platform)
    unless --no-job-dir; a script only with --job-dir-arg."""
    if program is None:
        return False
    return args.job_dir_arg or (program.kind == "module" and not args.no_job_dir)


def program_spec(args: argparse.Namespace, program):
    """The validated spec of a program run; its default name says what runs and when.

    A program that trains on its own (its modules import scikit-learn or XGBoost and no library
    that trains across processes) is labelled so, and runs on one worker unless --workers (or
    the job file) asks for more: each would run the same program alone."""
    from launcher.driver.program import SINGLE_PROCESS_FRAMEWORKS, single_process_framework

    asked = getattr(args, "framework", None)
    if asked in SINGLE_PROCESS_FRAMEWORKS:  # the spec knows them only as built-in workloads' (or not at all)
        args = argparse.Namespace(**{**vars(args), "framework": None})
    spec = spec_from_args(args)
    alone = asked if asked in SINGLE_PROCESS_FRAMEWORKS else (None if asked else single_process_framework(program))
    if alone:
        spec = _single_process(spec, args, program, alone, detected=asked is None)
    if spec.strategy != "ddp":  # validation: a program keeps its model in step itself
        raise UserError(f"--strategy {spec.strategy} works on a model that session.prepare() is given; a "
                        f"{'--script' if program.kind == 'script' else '--package'} program prepares its own",
                        "drop --strategy, or write it as def NAME(session)")
    job = getattr(args, "_job_file", None)
    raw = schema.load_yaml(args.config, "--config") if getattr(args, "config", None) and job is None else None
    named = (getattr(args, "name", None) or (job is not None and job.fields.get("name"))
             or (isinstance(raw, dict) and raw.get("name")))
    if named:  # --name, the job file's (jobDir, displayName, jobId) or the YAML's: validated() fills in a workload's
        return spec
    stem = re.sub(r"[^A-Za-z0-9_]", "_", program.target.removesuffix(".py"))
    return dataclasses.replace(spec, name=f"{program.kind}_{stem}_{_dt.datetime.now():%Y%m%d_%H%M%S}"[:128])


def _single_process(spec, args: argparse.Namespace, program, framework: str, detected: bool):
    """``spec`` for a program that trains with ``framework`` on its own (see :func:`program_spec`)."""
    from launcher.driver.program import SINGLE_PROCESS_FRAMEWORKS

    name = SINGLE_PROCESS_FRAMEWORKS[framework]
    if spec.backend != "native":
        raise UserError(f"--backend {spec.backend} with a {name} program: {name} trains in one process, with no "
                        "gradients to allreduce", "drop --backend")
    job = getattr(args, "_job_file", None)
    asked = getattr(args, "workers", None) is not None or (job is not None and "workers" in job.fields)
    why = (f"{program.label} imports {name} and no library that trains across processes" if detected
           else f"--framework {framework}")
    if asked and spec.workers > 1:
        print(f"note: {why}: each of the {spec.workers} workers runs it on its own (no communication between "
              "them); drop --workers to run it once", file=sys.stderr, flush=True)
    elif not asked:
        spec = dataclasses.replace(spec, workers=1)
        if spec.min_workers is not None:
            spec = dataclasses.replace(spec, min_workers=None)
        print(f"note: {why}: it runs once, on one worker (--workers N runs N copies)", file=sys.stderr, flush=True)
    return dataclasses.replace(spec, framework=framework)


def spec_from_args(args: argparse.Namespace):
    """The YAML file (if any) first, then the flags that were given; a validated JobSpec."""
    from launcher.spec import JobSpec, load_spec_file

    job = job_file(args)
    if job is not None:
        spec = JobSpec.from_mapping(job.fields, source=job.source)
    else:
        spec = load_spec_file(args.config) if args.config else JobSpec()
    overrides = flags.given_flags(args, JobSpec)
    if args.param:
        overrides["params"] = parse_params(args.param, spec.params)
    return spec.merged(overrides).validated()


def parse_params(items: list[str], base: dict | None = None) -> dict:
    """``--param KEY=VALUE`` items over ``base`` (values stay strings: the workload converts them)."""
    params = dict(base or {})
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--param {item!r} is not KEY=VALUE", "for example --param image_size=64")
        params[key.strip()] = value.strip()
    return params
