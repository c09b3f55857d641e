"""AI Platform Training and Vertex AI job files, read as the launcher's own settings.

People arrive with the files they already have:

* AI Platform's ``gcloud ai-platform jobs submit training --config FILE``:
  ``trainingInput: {scaleTier, masterType, workerCount, packageUris,
  pythonModule, args, jobDir, hyperparameters, ...}``;
* Vertex AI's ``gcloud ai custom-jobs create --config FILE``: a CustomJobSpec
  (``workerPoolSpecs``, ``baseOutputDirectory``, ``scheduling``), bare or
  inside a CustomJob (``displayName``, ``jobSpec``);
* Vertex AI's HyperparameterTuningJob (``studySpec``, ``maxTrialCount``,
  ``parallelTrialCount``, ``trialJobSpec``);
* gcloud's ``--worker-pool-spec=machine-type=...,replica-count=...`` flags.

:func:`read` turns any of them into a :class:`JobFile`: JobSpec values (the
ranks, GPUs, storage, name, time limit, machine types), the trainer package
and its arguments, a hyperparameter search in AI Platform's form, and notes:
one line for each key the launcher reads but does differently (parameter
servers are not started: the ranks synchronise by allreduce). Keys that
cannot work here (TPUs, AI Platform's container keys) are refused with one line saying
why, and an unknown key names the closest valid one. A Vertex pool's ``containerSpec``
(imageUri, command, args, env) is a program of its own: each rank runs the command in
that image, on a cluster whose nodes can start it (Ray's runtime_env ``image_uri``,
see :func:`launcher.driver.program.from_container`). The files' own spelling is kept:
each block is declared with :mod:`launcher.schema`, the project's one
way of checking specs.

This module tells the formats apart and reads a file (:func:`kind_of`, :func:`read`);
each format's blocks and their reading live in :mod:`.aiplatform`, :mod:`.vertex`
(with the ``--worker-pool-spec`` flags) and :mod:`.tuning`, and what they share (the
result, :class:`JobFile`, and the keys' notes and refusals) in :mod:`.common`.
"""

from __future__ import annotations

from typing import Any

from launcher import schema
from launcher.errors import UserError
from launcher.jobfiles.aiplatform import AipJob, _from_ai_platform
from launcher.jobfiles.common import JobFile, _declared, _lenient, _placed, duration_s, run_name
from launcher.jobfiles.tuning import TuningJob, _study
from launcher.jobfiles.vertex import ContainerSpec, CustomJob, CustomJobSpec, WorkerPoolSpec, _from_custom_job, \
    worker_pool_flags
from launcher.tune.hyperparams import Hyperparameters

__all__ = ["AipJob", "ContainerSpec", "CustomJob", "CustomJobSpec", "Hyperparameters", "JobFile", "TuningJob",
           "WorkerPoolSpec", "duration_s", "kind_of", "read", "run_name", "worker_pool_flags"]


def kind_of(raw: Any) -> str | None:
    """Which job file a loaded YAML is (None: the launcher's own spec file)."""
    if not isinstance(raw, dict):
        return None
    if "trainingInput" in raw:
        return "ai-platform"
    if "studySpec" in raw or "trialJobSpec" in raw:
        return "vertex-tuning-job"
    if "workerPoolSpecs" in raw or "jobSpec" in raw:
        return "vertex-custom-job"
    return None


def read(raw: dict[str, Any], source: str, *, tuning: bool = False) -> JobFile:
    """The job file ``raw`` as the launcher runs it, machine types included (see :func:`_read`)."""
    return _placed(_read(raw, source, tuning=tuning))


def _read(raw: dict[str, Any], source: str, *, tuning: bool = False) -> JobFile:
    """The job file ``raw`` (loaded YAML) as the launcher runs it.

    Raises:
        UserError: a key that does not exist (with the closest one), a value of the wrong
            kind, or a key that cannot work here (containers, TPUs), with why.
    """
    kind = kind_of(raw)
    if kind == "ai-platform":
        if isinstance(raw.get("trainingInput"), dict) and "hyperparameters" in raw:
            raise UserError(f"{source}: hyperparameters given twice (top level and under trainingInput)",
                            "keep the one under trainingInput")
        job = schema.build(AipJob, _lenient(raw), source)
        out = JobFile("ai-platform", source)
        _declared(job, "", out)
        return _from_ai_platform(job, out, tuning)
    if kind == "vertex-tuning-job":
        if not tuning:
            raise UserError(f"{source}: a HyperparameterTuningJob (studySpec, trialJobSpec) is a tuning job",
                            f"tune it with `launcher tune --config {source}`, or run its trialJobSpec alone")
        job = schema.build(TuningJob, _lenient(raw), source)
        out = JobFile("vertex-tuning-job", source)
        _declared(job, "", out)
        _from_custom_job(job.trialJobSpec, out, "trialJobSpec.")
        out.hyperparameters = _study(job, source)
        if job.displayName:
            out.fields.setdefault("name", run_name(job.displayName))
        return out
    if kind == "vertex-custom-job":
        out = JobFile("vertex-custom-job", source)
        if "jobSpec" in raw:
            job = schema.build(CustomJob, _lenient(raw), source)
            _declared(job, "", out)
            _from_custom_job(job.jobSpec, out, "jobSpec.")
            if job.displayName:
                out.fields.setdefault("name", run_name(job.displayName))
        else:
            spec = schema.build(CustomJobSpec, _lenient(raw), source)
            _declared(spec, "", out)
            _from_custom_job(spec, out, "")
        return out
    raise UserError(f"{source}: not an AI Platform or Vertex AI job file",
                    "expected trainingInput (AI Platform), workerPoolSpecs or jobSpec (a Vertex CustomJob), "
                    "or studySpec and trialJobSpec (a Vertex HyperparameterTuningJob)")
