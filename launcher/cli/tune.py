"""``launcher tune``: hyperparameter tuning from AI Platform's YAML, each trial a distributed run."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import re
import sys

from launcher import flags
from launcher.cli.options import (EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, add_program_flags, add_run_flags, add_verbose,
                                  job_file, parse_params, program_from_args, wants_job_dir)
from launcher.cli.run import sigterm_as_ctrl_c, summary_stream
from launcher.errors import UserError

EXAMPLE = """example tune.yaml (AI Platform's hyperparameters block; other top-level keys are job keys):
  workload: digits-mlp
  epochs: 3
  hyperparameters:
    goal: MAXIMIZE
    hyperparameterMetricTag: accuracy
    maxTrials: 8
    maxParallelTrials: 2
    enableTrialEarlyStopping: true
    params:
      - parameterName: lr
        type: DOUBLE
        minValue: 0.001
        maxValue: 0.5
        scaleType: UNIT_LOG_SCALE
"""


def add_parsers(sub) -> None:
    tune = sub.add_parser("tune", help="tune hyperparameters (AI Platform's YAML) on Ray Tune; each trial is a "
                          "distributed run; the same --name continues", epilog=EXAMPLE,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(tune)
    tune.set_defaults(config=None)
    for action in tune._actions:  # --config is the tuning YAML here
        if action.dest == "config":
            action.help = ("tuning YAML: a hyperparameters block (or trainingInput.hyperparameters), and job keys "
                           "(workload, epochs, ...) that flags override; required")
    add_program_flags(tune)
    tune.add_argument("--max-trial-count", type=int, metavar="N",
                      help="trials in all, over the file's maxTrials / maxTrialCount (as gcloud's flag)")
    tune.add_argument("--parallel-trial-count", type=int, metavar="N",
                      help="trials at once, over the file's maxParallelTrials / parallelTrialCount")
    tune.add_argument("--json", action="store_true", help="print the summary and the trials as JSON on stdout")
    add_verbose(tune)


def study_from_args(args: argparse.Namespace):
    """The checked Study the flags and the YAML describe."""
    from launcher.spec import JobSpec
    from launcher.tune.study import Study, load

    if not args.config:
        raise UserError("launcher tune needs --config tune.yaml (its hyperparameters block)",
                        "see `launcher tune --help` for an example")
    program = program_from_args(args, tuning=True)
    job = job_file(args, tuning=True)
    if job is not None:
        if job.hyperparameters is None and "hyperparameters" in job.fields:  # own YAML + --worker-pool-spec
            from launcher.tune.hyperparams import parse

            job.hyperparameters = parse(job.fields.pop("hyperparameters"), f"{job.source}: hyperparameters")
        if job.hyperparameters is None:
            raise UserError(f"{job.source}: no hyperparameters to tune (trainingInput.hyperparameters, or a "
                            "HyperparameterTuningJob's studySpec)", "add them, or run the job with launcher run")
        hp, raw = job.hyperparameters, job.fields
    else:
        hp, raw = load(args.config)
    counts = {"maxTrials": args.max_trial_count, "maxParallelTrials": args.parallel_trial_count}
    for key, value in counts.items():
        if value is not None:
            if value < 1:
                flag = "--max-trial-count" if key == "maxTrials" else "--parallel-trial-count"
                raise UserError(f"{flag} must be at least 1, got {value}", f"for example {flag} 2")
            hp = dataclasses.replace(hp, **{key: value})
    spec = JobSpec.from_mapping(raw, source=job.source if job is not None else args.config)
    overrides = flags.given_flags(args, JobSpec)
    overrides.pop("config", None)
    if args.param:
        overrides["params"] = parse_params(args.param, spec.params)
    spec = spec.merged(overrides)
    if not spec.name:
        what = program.target.removesuffix(".py") if program is not None else spec.workload
        stem = re.sub(r"[^A-Za-z0-9_]", "_", what.rsplit(":", 1)[-1])
        spec = spec.merged({"name": f"tune_{stem}_{_dt.datetime.now():%Y%m%d_%H%M%S}"[:128]})
    spec = spec.validated()
    return Study(hp=hp, spec=spec, program=program, args=list(args.program_args),
                 job_dir=wants_job_dir(args, program), source=args.config)


def cmd_tune(args: argparse.Namespace) -> int:
    from launcher.tune import results, search

    study = study_from_args(args)
    with sigterm_as_ctrl_c():
        with summary_stream() as out:
            outcome = search.run(study, verbose=args.verbose, out=sys.stderr)
            if args.json:
                text = json.dumps({"summary": outcome.summary.to_json(), "trials": outcome.rows}, default=str)
            else:
                text = results.format_summary(study, outcome.summary, outcome.rows)
            print(text, file=out, flush=True)
    if outcome.interrupted:
        return EXIT_CANCELLED
    return EXIT_OK if outcome.summary.succeeded else EXIT_FAILED


COMMANDS = {"tune": cmd_tune}
