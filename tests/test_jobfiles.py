"""AI Platform and Vertex AI job files as ``--config`` (launcher/jobfiles/): every key of each
declared block is used or refused by name (a table that must cover them all), bad input is one
line before anything starts, and the files run and tune the example trainer package."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import textwrap
import time
import typing

import pytest
import yaml

from launcher import jobfiles, schema
from launcher.cli.main import main
from launcher.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "trainer_package")

# The hyperparameter-tuning config of the Vertex AI guide, verbatim (issue 34).
GUIDE_CONFIG = """\
trainingInput:
  scaleTier: CUSTOM
  masterType: n1-standard-4
  workerType: n1-standard-4
  parameterServerType: n1-standard-4
  workerCount: 3
  parameterServerCount: 2
  hyperparameters:
    goal: MAXIMIZE
    maxTrials: 10
    maxParallelTrials: 2
    hyperparameterMetricTag: accuracy
    params:
    - parameterName: learning_rate
      type: DOUBLE
      minValue: 0.001
      maxValue: 0.1
"""

PACKAGE = {"executorImageUri": "us-docker.pkg.dev/vertex-ai/training/pytorch-xla.2-4.py310:latest",
           "packageUris": ["trainer-0.1.tar.gz"], "pythonModule": "trainer.task"}
POOL0 = {"machineSpec": {"machineType": "n1-standard-4"}, "replicaCount": 1, "pythonPackageSpec": PACKAGE}
BASES = {
    "aip": {"trainingInput": {"scaleTier": "BASIC", "packageUris": ["trainer-0.1.tar.gz"],
                              "pythonModule": "trainer.task"}},
    "custom": {"displayName": "job", "jobSpec": {"workerPoolSpecs": [POOL0]}},
    "tuning": {"studySpec": {"metrics": [{"metricId": "accuracy", "goal": "MAXIMIZE"}],
                             "parameters": [{"parameterId": "lr", "doubleValueSpec": {"minValue": 0.01,
                                                                                      "maxValue": 0.1}}]},
               "trialJobSpec": {"workerPoolSpecs": [POOL0]}},
}
CONTAINER = {"imageUri": "us-docker.pkg.dev/p/r/trainer:1", "command": ["python", "-m", "trainer.task"]}
BASES["container"] = {"displayName": "job", "jobSpec": {"workerPoolSpecs": [
    {"machineSpec": {"machineType": "n1-standard-4"}, "replicaCount": 1, "containerSpec": CONTAINER}]}}
ROOTS = {"aip": jobfiles.AipJob, "custom": jobfiles.CustomJob, "tuning": jobfiles.TuningJob,
         "container": jobfiles.CustomJob}
CUSTOM = {"trainingInput.scaleTier": "CUSTOM", "trainingInput.masterType": "n1-standard-4"}
POOL1 = {"jobSpec.workerPoolSpecs[1]": {**POOL0, "replicaCount": 2}}
T4 = {"acceleratorType": "NVIDIA_TESLA_T4", "acceleratorCount": 2}

# (base, path, value, what becomes of it, other keys the file needs). What becomes of it:
# ("field", JobSpec field, value), ("program", JobFile attribute, value), ("hp", Hyperparameters
# attribute, value), ("note", words in the note), ("refused", words in the one-line error),
# ("same",): honoured as it is (no note, no change).
ROWS = [
    ("aip", "jobId", "my-job", ("field", "name", "my_job"), {}),
    ("aip", "labels", {"team": "ml"}, ("note", "labels"), {}),
    ("aip", "etag", "abc", ("note", "etag"), {}),
    ("aip", "trainingInput.scaleTier", "STANDARD_1", ("field", "workers", 5), {}),
    ("aip", "trainingInput.masterType", "n1-highmem-8", ("field", "machine_type", "n1-highmem-8"),
     {"trainingInput.scaleTier": "CUSTOM"}),
    ("aip", "trainingInput.masterConfig.acceleratorConfig", {"type": "NVIDIA_TESLA_T4", "count": 2},
     ("field", "gpus_per_worker", 2.0), CUSTOM),
    ("aip", "trainingInput.masterConfig.imageUri", "gcr.io/p/i", ("refused", "CustomJob's containerSpec"), CUSTOM),
    ("aip", "trainingInput.masterConfig.containerCommand", ["python"], ("refused", "CustomJob's containerSpec"), CUSTOM),
    ("aip", "trainingInput.masterConfig.containerArgs", ["-m"], ("refused", "CustomJob's containerSpec"), CUSTOM),
    ("aip", "trainingInput.masterConfig.tpuTfVersion", "2.12", ("refused", "NVIDIA GPUs"), CUSTOM),
    ("aip", "trainingInput.masterConfig.diskConfig", {"bootDiskSizeGb": 200}, ("note", "disks"), CUSTOM),
    ("aip", "trainingInput.workerType", "n1-standard-8", ("field", "machine_type", "n1-standard-8"),
     {**CUSTOM, "trainingInput.workerCount": 2}),
    ("aip", "trainingInput.workerCount", 3, ("field", "workers", 4),
     {**CUSTOM, "trainingInput.workerType": "n1-standard-4"}),
    ("aip", "trainingInput.workerConfig.acceleratorConfig", {"type": "NVIDIA_TESLA_T4", "count": 1},
     ("field", "gpus_per_worker", 1.0), {**CUSTOM, "trainingInput.workerType": "n1-standard-4",
                                         "trainingInput.workerCount": 1}),
    ("aip", "trainingInput.parameterServerType", "n1-standard-4", ("note", "parameter servers are not started"),
     CUSTOM),
    ("aip", "trainingInput.parameterServerCount", 2, ("note", "parameter servers are not started"), CUSTOM),
    ("aip", "trainingInput.parameterServerConfig.acceleratorConfig", {"type": "NVIDIA_TESLA_T4"},
     ("note", "parameter servers are not started"), CUSTOM),
    ("aip", "trainingInput.evaluatorType", "n1-standard-4", ("note", "evaluators are not started"), CUSTOM),
    ("aip", "trainingInput.evaluatorCount", 1, ("note", "evaluators are not started"), CUSTOM),
    ("aip", "trainingInput.evaluatorConfig.acceleratorConfig", {"type": "NVIDIA_TESLA_T4"},
     ("note", "evaluators are not started"), CUSTOM),
    ("aip", "trainingInput.packageUris", ["a-1.tar.gz", "gs://b/c/d-2.whl"],
     ("program", "package", "a-1.tar.gz,gs://b/c/d-2.whl"), {}),
    ("aip", "trainingInput.pythonModule", "trainer.other", ("program", "module", "trainer.other"), {}),
    ("aip", "trainingInput.args", ["--epochs", 3], ("program", "args", ("--epochs", "3")), {}),
    ("aip", "trainingInput.hyperparameters", {"goal": "MINIMIZE", "params": [
        {"parameterName": "lr", "type": "DOUBLE", "minValue": 0.1, "maxValue": 1}]}, ("hp", "goal", "MINIMIZE"), {}),
    ("aip", "trainingInput.region", "europe-west4", ("note", "zone"), {}),
    ("aip", "trainingInput.jobDir", "gs://bucket/jobs/run_7", ("field", "storage", "gs://bucket/jobs"), {}),
    ("aip", "trainingInput.runtimeVersion", "1.15", ("note", "TensorFlow"), {}),
    ("aip", "trainingInput.pythonVersion", "2.7", ("note", "Python"), {}),
    ("aip", "trainingInput.scheduling.maxRunningTime", "7200s", ("field", "max_run_s", 7200.0), {}),
    ("aip", "trainingInput.scheduling.maxWaitTime", "600s", ("note", "does not queue"), {}),
    ("aip", "trainingInput.scheduling.priority", 5, ("note", "does not queue"), {}),
    ("aip", "trainingInput.useChiefInTfConfig", True, ("same",), {}),
    ("aip", "trainingInput.network", "projects/p/global/networks/n", ("note", "--network"), {}),
    ("aip", "trainingInput.serviceAccount", "sa@p.iam.gserviceaccount.com", ("note", "--service-account"), {}),
    ("aip", "trainingInput.encryptionConfig", {"kmsKeyName": "k"}, ("refused", "encryption keys"), {}),
    ("aip", "trainingInput.enableWebAccess", True, ("refused", "interactive shells"), {}),

    ("custom", "displayName", "My Job", ("field", "name", "My_Job"), {}),
    ("custom", "labels", {"team": "ml"}, ("note", "labels"), {}),
    ("custom", "encryptionSpec", {"kmsKeyName": "k"}, ("refused", "encryption keys"), {}),
    ("custom", "jobSpec.workerPoolSpecs[1].replicaCount", "3", ("field", "workers", 4), POOL1),
    ("custom", "jobSpec.workerPoolSpecs[1].machineSpec", {"machineType": "n1-standard-8", **T4},
     ("field", "machine_type", "n1-standard-8+nvidia-tesla-t4x2"), POOL1),
    ("custom", "jobSpec.workerPoolSpecs[0].machineSpec.tpuTopology", "2x2", ("refused", "NVIDIA GPUs"), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].machineSpec.reservationAffinity", {"key": "r"},
     ("note", "reservations"), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].pythonPackageSpec.executorImageUri", "img", ("note", "not used"), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].pythonPackageSpec.packageUris", ["t-2.whl"],
     ("program", "package", "t-2.whl"), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].pythonPackageSpec.pythonModule", "trainer.x",
     ("program", "module", "trainer.x"), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].pythonPackageSpec.args", ["--lr=0.1"], ("program", "args", ("--lr=0.1",)),
     {}),
    ("custom", "jobSpec.workerPoolSpecs[0].pythonPackageSpec.env", [{"name": "MODE", "value": "fast"}],
     ("program", "env", {"MODE": "fast"}), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].containerSpec", CONTAINER,
     ("refused", "both containerSpec and pythonPackageSpec"), {}),
    ("container", "jobSpec.workerPoolSpecs[0].containerSpec.imageUri", "gcr.io/p/other:2",
     ("program", "image", "gcr.io/p/other:2"), {}),
    ("container", "jobSpec.workerPoolSpecs[0].containerSpec.command", ["bash", "-c", "train"],
     ("program", "command", ("bash", "-c", "train")), {}),
    ("container", "jobSpec.workerPoolSpecs[0].containerSpec.args", ["--epochs", 3],
     ("program", "args", ("--epochs", "3")), {}),
    ("container", "jobSpec.workerPoolSpecs[0].containerSpec.env", [{"name": "MODE", "value": "fast"}],
     ("program", "env", {"MODE": "fast"}), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].diskSpec", {"bootDiskType": "pd-ssd", "bootDiskSizeGb": "200"},
     ("note", "disks"), {}),
    ("custom", "jobSpec.workerPoolSpecs[0].nfsMounts", [{"server": "s", "path": "/p", "mountPoint": "m"}],
     ("refused", "NFS"), {}),
    ("custom", "jobSpec.baseOutputDirectory.outputUriPrefix", "gs://bucket/out/run_3", ("field", "name", "run_3"), {}),
    ("custom", "jobSpec.scheduling.timeout", "3600s", ("field", "max_run_s", 3600.0), {}),
    ("custom", "jobSpec.scheduling.restartJobOnWorkerRestart", True, ("field", "max_failures", -1), {}),
    ("custom", "jobSpec.scheduling.strategy", "SPOT", ("note", "Spot VMs"), {}),
    ("custom", "jobSpec.scheduling.disableRetries", True, ("field", "max_failures", 0), {}),
    ("custom", "jobSpec.scheduling.maxWaitDuration", "600s", ("note", "does not queue"), {}),
    ("custom", "jobSpec.serviceAccount", "sa@p.iam.gserviceaccount.com", ("note", "--service-account"), {}),
    ("custom", "jobSpec.network", "projects/1/global/networks/n", ("note", "--network"), {}),
    ("custom", "jobSpec.reservedIpRanges", ["r"], ("note", "--network"), {}),
    ("custom", "jobSpec.enableWebAccess", True, ("refused", "interactive shells"), {}),
    ("custom", "jobSpec.enableDashboardAccess", True, ("refused", "interactive shells"), {}),
    ("custom", "jobSpec.tensorboard", "projects/p/tensorboards/1", ("note", "AIP_TENSORBOARD_LOG_DIR"), {}),
    ("custom", "jobSpec.experiment", "e", ("note", "AIP_TENSORBOARD_LOG_DIR"), {}),
    ("custom", "jobSpec.experimentRun", "r", ("note", "AIP_TENSORBOARD_LOG_DIR"), {}),
    ("custom", "jobSpec.protectedArtifactLocationId", "l", ("note", "run's folder"), {}),
    ("custom", "jobSpec.persistentResourceId", "pr", ("note", "persistent resource"), {}),
    ("custom", "jobSpec.models", ["m"], ("note", "model/"), {}),

    ("tuning", "maxTrialCount", 12, ("hp", "maxTrials", 12), {}),
    ("tuning", "parallelTrialCount", "3", ("hp", "maxParallelTrials", 3), {}),
    ("tuning", "maxFailedTrialCount", 2, ("hp", "maxFailedTrials", 2), {}),
    ("tuning", "displayName", "sweep 1", ("field", "name", "sweep_1"), {}),
    ("tuning", "labels", {"a": "b"}, ("note", "labels"), {}),
    ("tuning", "encryptionSpec", {"kmsKeyName": "k"}, ("refused", "encryption keys"), {}),
    ("tuning", "studySpec.metrics", [{"metricId": "loss", "goal": "MINIMIZE"}], ("hp", "goal", "MINIMIZE"), {}),
    ("tuning", "studySpec.metrics[0].safetyConfig", {"safetyThreshold": 1}, ("refused", "safety"), {}),
    ("tuning", "studySpec.parameters[1]", {"parameterId": "layers", "integerValueSpec": {"minValue": "1",
                                                                                        "maxValue": "4"}},
     ("hp", "param:layers", ("INTEGER", 1.0, 4.0)), {}),
    ("tuning", "studySpec.parameters[0].doubleValueSpec.defaultValue", 0.05, ("note", "own points"), {}),
    ("tuning", "studySpec.parameters[1]", {"parameterId": "batch", "discreteValueSpec": {"values": [16, 32],
                                                                                        "defaultValue": 16}},
     ("hp", "param:batch", ("DISCRETE", (16.0, 32.0))), {}),
    ("tuning", "studySpec.parameters[1]", {"parameterId": "opt", "categoricalValueSpec": {"values": ["sgd", "adam"],
                                                                                         "defaultValue": "sgd"}},
     ("hp", "param:opt", ("CATEGORICAL", ("sgd", "adam"))), {}),
    ("tuning", "studySpec.parameters[0].scaleType", "UNIT_LOG_SCALE", ("hp", "param:lr", ("LOG",)), {}),
    ("tuning", "studySpec.parameters[0].conditionalParameterSpecs", [{"parameterSpec": {}}],
     ("refused", "every parameter"), {}),
    ("tuning", "studySpec.algorithm", "RANDOM_SEARCH", ("hp", "algorithm", "RANDOM_SEARCH"), {}),
    ("tuning", "studySpec.measurementSelectionType", "BEST_MEASUREMENT", ("note", "last report"), {}),
    ("tuning", "studySpec.observationNoise", "HIGH", ("note", "noise"), {}),
    ("tuning", "studySpec.decayCurveStoppingSpec", {"useElapsedDuration": True},
     ("hp", "enableTrialEarlyStopping", True), {}),
    ("tuning", "studySpec.medianAutomatedStoppingSpec", {}, ("hp", "enableTrialEarlyStopping", True), {}),
    ("tuning", "studySpec.convexAutomatedStoppingSpec", {"maxStepCount": 10},
     ("hp", "enableTrialEarlyStopping", True), {}),
    ("tuning", "trialJobSpec.scheduling.strategy", "SPOT", ("note", "Spot VMs"), {}),
]


def put(doc: dict, path: str, value) -> None:
    """Set ``a.b[1].c`` in nested dicts and lists (an index one past the end appends)."""
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    target = doc
    for here, nxt in zip(parts, parts[1:] + [None]):
        last = nxt is None
        if here.startswith("["):
            i = int(here[1:-1])
            if i == len(target):
                target.append({} if not last else None)
            if last:
                target[i] = value
            target = target[i]
        else:
            if last:
                target[here] = value
            else:
                target = target.setdefault(here, [] if nxt.startswith("[") else {})


def read(base: str, path: str | None = None, value=None, extra: dict | None = None):
    doc = copy.deepcopy(BASES[base])
    for key, v in (extra or {}).items():
        put(doc, key, copy.deepcopy(v))
    if path is not None:
        put(doc, path, copy.deepcopy(value))
    return jobfiles.read(doc, "job.yaml", tuning=True)


def _spec_of(cls, name):
    hint = typing.get_type_hints(cls)[name]
    for arg in [hint, *typing.get_args(hint)]:
        for inner in [arg, *typing.get_args(arg)]:
            if isinstance(inner, type) and hasattr(inner, "__dataclass_fields__"):
                return inner
    return None


def covered(cls, path: str, value) -> set[tuple[str, str]]:
    """The (class, key) pairs a row sets: along its path, and inside its value."""
    out: set[tuple[str, str]] = set()
    parts = [p for p in re.findall(r"[^.\[\]]+", path) if not p.isdigit()]
    for part in parts:
        out.add((cls.__name__, part))
        cls = _spec_of(cls, part)
    out |= inside(cls, value) if cls is not None else set()
    return out


def inside(cls, value) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, dict):
            for key, v in item.items():
                out.add((cls.__name__, key))
                sub = _spec_of(cls, key)
                if sub is not None:
                    out |= inside(sub, v)
    return out


def every_key(cls, seen=None) -> set[tuple[str, str]]:
    seen = set() if seen is None else seen
    out = set()
    for f in schema.fields(cls):
        sub = _spec_of(cls, f.name)
        if sub is not None and sub is not jobfiles.Hyperparameters:
            if sub not in seen:
                seen.add(sub)
                out |= every_key(sub, seen)
            continue  # a block: its keys are what a row sets
        out.add((cls.__name__, f.name))
    return out


def test_the_table_names_every_key_of_every_block():
    want = set().union(*(every_key(cls) for cls in ROOTS.values()))
    have = set().union(*(covered(ROOTS[base], path, value) for base, path, value, _, _ in ROWS))
    missing = sorted(want - have)
    assert not missing, f"keys with no row saying what becomes of them: {missing}"


@pytest.mark.parametrize("base, path, value, outcome, extra", ROWS, ids=[f"{r[0]}:{r[1]}" for r in ROWS])
def test_each_key_is_used_or_refused_by_name(base, path, value, outcome, extra):
    leaf = [p for p in re.findall(r"[^.\[\]]+", path) if not p.isdigit()][-1]
    if outcome[0] == "refused":
        with pytest.raises(UserError) as err:
            read(base, path, value, extra)
        assert outcome[1] in str(err.value) and leaf in err.value.what, str(err.value)
        return
    try:
        before = read(base, extra=extra)
    except UserError:  # the key is what makes the file whole (masterType for CUSTOM)
        before = jobfiles.JobFile("none", "job.yaml")
    after = read(base, path, value, extra)
    new_notes = [n for n in after.notes if n not in before.notes]
    kind = outcome[0]
    if kind == "same":
        assert new_notes == [] and after.fields == before.fields, new_notes
    elif kind == "note":  # a new note, or (for a key the base file has) one naming the key
        assert any(outcome[1] in n for n in new_notes) or any(outcome[1] in n and leaf in n for n in after.notes), \
            after.notes
    elif kind == "field":
        assert after.fields.get(outcome[1]) == outcome[2], after.fields
        assert before.fields.get(outcome[1]) != outcome[2]
    elif kind == "program":
        got = {"package": after.package, "module": after.module, "args": after.args, "env": after.env,
               "image": after.image, "command": after.command}[outcome[1]]
        assert got == outcome[2]
    else:  # hp
        hp = after.hyperparameters
        if outcome[1].startswith("param:"):
            p = next(q for q in hp.params if q.parameterName == outcome[1][6:])
            want = outcome[2]
            if want == ("LOG",):
                assert p.scaleType == "UNIT_LOG_SCALE"
            elif want[0] in ("INTEGER", "DOUBLE"):
                assert (p.type, p.minValue, p.maxValue) == want
            else:
                assert (p.type, p.discreteValues or p.categoricalValues) == want
        else:
            assert getattr(hp, outcome[1]) == outcome[2]
            assert before.hyperparameters is None or getattr(before.hyperparameters, outcome[1]) != outcome[2]


def test_the_guide_config_and_the_scale_tiers():
    job = jobfiles.read(yaml.safe_load(GUIDE_CONFIG), "config.yaml", tuning=True)
    assert job.fields == {"workers": 4, "machine_type": "n1-standard-4"}
    assert job.hyperparameters.params[0].parameterName == "learning_rate"
    assert any("parameterServerCount 2 (n1-standard-4): parameter servers are not started" in n for n in job.notes)
    assert read("aip", "trainingInput.scaleTier", "BASIC_GPU").fields == {"workers": 1, "gpus_per_worker": 1.0}
    assert read("aip", "trainingInput.scaleTier", "PREMIUM_1").fields["workers"] == 20
    # a job file with hyperparameters is a tuning job: `launcher run` says so
    with pytest.raises(UserError, match="launcher tune --config"):
        jobfiles.read(yaml.safe_load(GUIDE_CONFIG), "config.yaml")


def test_gclouds_worker_pool_spec_flags():
    job = jobfiles.worker_pool_flags(["machine-type=n1-standard-4,replica-count=1,python-module=trainer.task",
                                     "machine-type=n1-standard-8,replica-count=2,accelerator-type=NVIDIA_TESLA_T4,"
                                     "accelerator-count=1"])
    assert job.fields == {"workers": 3, "gpus_per_worker": 1.0, "machine_type": "n1-standard-8+nvidia-tesla-t4x1",
                          "primary_machine_type": "n1-standard-4"}
    assert job.module == "trainer.task"
    for bad, words in (("machine-typ=n1", "did you mean machine-type?"),
                       ("container-image-uri=x", "CustomJob file's containerSpec"),
                       ("replica-count", "not KEY=VALUE")):
        with pytest.raises(UserError) as err:
            jobfiles.worker_pool_flags([bad])
        assert words in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("trainingInput:\n  scaleTeir: BASIC\n", "unknown key 'scaleTeir' in trainingInput; did you mean scaleTier?"),
    ("trainingInput:\n  scaleTier: BASIC_2\n", "trainingInput.scaleTier = 'BASIC_2': must be one of BASIC"),
    ("trainingInput:\n  scaleTier: BASIC_TPU\n", "BASIC_TPU is not supported"),
    ("trainingInput:\n  scaleTier: CUSTOM\n", "masterType is missing: scaleTier CUSTOM needs it"),
    ("trainingInput:\n  packageUris: [trainer.zip]\n  pythonModule: trainer.task\n", "not an sdist or wheel"),
    ("workerPoolSpecs:\n- replicaCount: 2\n", "workerPoolSpecs[0].replicaCount is 2: pool 0 is the primary"),
    ("workerPoolSpecs:\n- replicaCount: 1\n  containerSpec: {imageUri: gcr.io/p/i}\n",
     "containerSpec.command is missing: the image's ENTRYPOINT and CMD are not read here"),
    ("workerPoolSpecs:\n- replicaCount: 1\n  containerSpec: {imageUri: gcr.io/p/i, command: [python]}\n"
     "  pythonPackageSpec: {executorImageUri: x, packageUris: [t-1.tar.gz], pythonModule: trainer.task}\n",
     "workerPoolSpecs[0] has both containerSpec and pythonPackageSpec"),
    ("jobSpec:\n  workerPoolSpecs:\n  - replicaCount: 1\n  scheduling: {timeout: soon}\n", "'soon' is not a duration"),
])
def test_bad_job_files_are_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, text, message):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    started = time.time()
    code = main(["run", "--config", str(path), "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert len([line for line in err.strip().splitlines() if not line.startswith("note:")]) == 1, err
    assert time.time() - started < 10
    assert not (tmp_path / "runs").exists()


def test_an_archive_without_the_module_is_refused_by_name(tmp_path, capsys):
    import tarfile

    archive = tmp_path / "other-0.1.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name in ("other-0.1/setup.py", "other-0.1/other/__init__.py"):
            info = tarfile.TarInfo(name)
            tf.addfile(info)
    path = tmp_path / "job.yaml"
    path.write_text(f"trainingInput:\n  packageUris: [{archive}]\n  pythonModule: trainer.task\n")
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "trainer.task" in err and "other" in err, err


@pytest.mark.gcs
def test_a_gs_package_uri_that_does_not_exist_is_one_line(tmp_path, capsys, bucket):
    path = tmp_path / "job.yaml"
    path.write_text(f"trainingInput:\n  packageUris: [gs://{bucket}/code/trainer-0.1.tar.gz]\n"
                    "  pythonModule: trainer.task\n")
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"gs://{bucket}/code/trainer-0.1.tar.gz" in err and "Traceback" not in err, err


def _summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.integration
def test_the_guide_config_verbatim_tunes_the_example_package(ray_local, tmp_path, capsys):
    """The guide's file as it is, its 10 trials capped to one by --max-trial-count (and its 4
    workers to 1 by --workers): the trial gets --learning_rate from the guide's range and learns.
    Trials of the example package side by side (maxParallelTrials 2) are test_tune.py's
    test_a_package_is_tuned_on_its_hypertune_metric_and_a_missing_tag_is_one_line."""
    path = tmp_path / "config.yaml"
    path.write_text(GUIDE_CONFIG)
    code = main(["tune", "--config", str(path), "--package", EXAMPLE, "--module", "trainer.task", "--workers", "1",
                 "--max-trial-count", "1", "--storage", str(tmp_path / "runs"), "--name", "guide", "--json",
                 "--", "--epochs", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    result = _summary(captured.out)
    rows, summary = result["trials"], result["summary"]
    assert len(rows) == 1 and all(r["status"] == "succeeded" for r in rows), rows
    assert all(0.001 <= r["learning_rate"] <= 0.1 and r["accuracy"] > 0.5 for r in rows), rows
    assert summary["best"]["accuracy"] == max(r["accuracy"] for r in rows)
    assert "parameter servers are not started" in captured.err
    for r in rows:  # each trial's program got --learning_rate VALUE
        with open(os.path.join(r["run_dir"], "launches.jsonl")) as f:
            start = json.loads(f.readline())
        args = start["spec"]["program"]["args"]
        assert args[args.index("--learning_rate") + 1] == repr(r["learning_rate"]), args


@pytest.mark.integration
def test_a_vertex_custom_job_with_two_pools_on_spot_runs_and_stops_at_its_timeout(ray_local, tmp_path, capsys):
    """The run is stopped by its scheduling.timeout, counted from the start of its workers, after it
    has trained (steps_completed: the epochs its ranks reported). The test lasts about as long as
    the timeout, so it is short (15 s) and the steps quick (--step-sleep 0.05: an epoch's 22 steps
    in a little over 1 s), leaving the workers and the program most of it to start."""
    path = tmp_path / "custom_job.yaml"
    path.write_text(textwrap.dedent(f"""\
        displayName: digits on spot
        jobSpec:
          workerPoolSpecs:
          - machineSpec: {{machineType: n1-standard-4}}
            replicaCount: 1
            pythonPackageSpec:
              executorImageUri: us-docker.pkg.dev/vertex-ai/training/pytorch-cpu.2-4.py310:latest
              packageUris: [{EXAMPLE}]
              pythonModule: trainer.task
              args: [--epochs, 50, --step-sleep, 0.05]
          - machineSpec: {{machineType: n1-standard-4}}
            replicaCount: 1
            pythonPackageSpec:
              executorImageUri: us-docker.pkg.dev/vertex-ai/training/pytorch-cpu.2-4.py310:latest
              packageUris: [{EXAMPLE}]
              pythonModule: trainer.task
              args: [--epochs, 50, --step-sleep, 0.05]
          baseOutputDirectory: {{outputUriPrefix: {tmp_path}/out/spot_job}}
          scheduling: {{timeout: 15s, strategy: SPOT}}
        """))
    started = time.time()
    code = main(["run", "--config", str(path), "--json"])
    captured = capsys.readouterr()
    summary = _summary(captured.out)
    assert code == 130, captured.err[-3000:]
    assert summary["name"] == "spot_job" and summary["workers"] == 2, summary
    assert summary["run_dir"].rstrip("/") == f"{tmp_path}/out/spot_job"
    assert "time limit" in summary["error"] and summary["status"] == "cancelled", summary
    assert summary["steps_completed"] > 0, summary
    assert time.time() - started < 90
    assert "scheduling.strategy SPOT" in captured.err and "executorImageUri is not used" in captured.err


# -- containerSpec: the image's command is the run's program (issue 43, part 4) ----------------

CONTAINER_JOB = """\
displayName: images
jobSpec:
  workerPoolSpecs:
  - machineSpec: {machineType: n1-standard-4}
    replicaCount: 1
    containerSpec: &c
      imageUri: us-docker.pkg.dev/p/r/trainer:1
      command: [python, -m, trainer.task]
      args: [--epochs, 3]
      env: [{name: MODE, value: fast}]
  - machineSpec: {machineType: n1-standard-4}
    replicaCount: 2
    containerSpec: *c
"""


def _container_args(tmp_path, *extra: str):
    from launcher.cli.main import build_parser

    path = tmp_path / "job.yaml"
    path.write_text(CONTAINER_JOB)
    return build_parser().parse_args(["run", "--config", str(path), "--storage", str(tmp_path / "runs"), *extra])


def test_a_container_job_file_is_the_run_it_describes(tmp_path, capsys):
    from launcher.cli.options import program_from_args, program_spec, wants_job_dir
    from launcher.worker.script import command

    job = jobfiles.read(yaml.safe_load(CONTAINER_JOB), "job.yaml")
    assert (job.image, job.command, job.args, job.env) == (
        "us-docker.pkg.dev/p/r/trainer:1", ("python", "-m", "trainer.task"), ("--epochs", "3"), {"MODE": "fast"})
    assert job.fields["workers"] == 3 and job.notes == []

    args = _container_args(tmp_path)
    program = program_from_args(args)
    spec = program_spec(args, program)
    assert (spec.workers, spec.name) == (3, "images")
    assert program.image == "us-docker.pkg.dev/p/r/trainer:1" and dict(program.env) == {"MODE": "fast"}
    assert args.program_args == ["--epochs", "3"] and not wants_job_dir(args, program)  # Vertex passes no --job-dir
    # What each rank starts: the container's command, then its args (see launcher.worker.script).
    assert command(program.to_config(shipped=False), "/nowhere", args.program_args) == \
        ["python", "-m", "trainer.task", "--epochs", "3"]
    assert program.label == "container:us-docker.pkg.dev/p/r/trainer:1 (python -m trainer.task)"


def test_a_container_job_here_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # this machine as a laptop: no podman, no docker
    path = tmp_path / "job.yaml"
    path.write_text(CONTAINER_JOB)
    started = time.time()
    code = main(["run", "--config", str(path), "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("note:")]
    assert code == 2 and len(lines) == 1, err
    assert ("container job: 3 rank(s) would each run python -m trainer.task --epochs 3 in image "
            "us-docker.pkg.dev/p/r/trainer:1, with env MODE, CLUSTER_SPEC, AIP_MODEL_DIR" in lines[0]), err
    assert "no podman on PATH" in lines[0] and "--container-image" in lines[0] and "Traceback" not in err
    assert time.time() - started < 10
    assert not (tmp_path / "runs").exists()


def test_a_container_job_goes_on_where_podman_or_a_cluster_is(tmp_path, monkeypatch):
    from launcher.cli.options import program_from_args, program_spec
    from launcher.driver.program import check_container

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = _container_args(tmp_path)
    program = program_from_args(args)
    spec = program_spec(args, program)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError):
        check_container(program, args.program_args, spec)
    check_container(program, args.program_args, spec.merged({"address": "10.0.0.2:6379"}))  # the nodes decide
    podman = tmp_path / "podman"
    podman.write_text("#!/bin/sh\n")
    podman.chmod(0o755)
    check_container(program, args.program_args, spec)  # a local Ray that can start the image


def test_a_cluster_runs_the_ranks_in_the_image(tmp_path):
    """The RunConfig the driver builds for a container's ranks carries the image as their
    runtime_env, in a form Ray accepts; the job itself ships the launcher's code, not a folder."""
    from ray.runtime_env import RuntimeEnv
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    from launcher.cli.options import program_from_args, program_spec
    from launcher.driver import code
    from launcher.driver.script import is_shipped, ranks_run_config
    from launcher.storage.store import Storage

    args = _container_args(tmp_path, "--address", "10.0.0.2:6379")
    program = program_from_args(args)
    spec = program_spec(args, program)
    run_config = ranks_run_config(spec, program, Storage.resolve(str(tmp_path / "runs")), [])
    assert run_config.worker_runtime_env == {"image_uri": "us-docker.pkg.dev/p/r/trainer:1"}
    RuntimeEnv(**WorkerGroup._get_worker_runtime_env(run_config.worker_runtime_env))  # Ray's own check passes
    # The job ships the launcher's code (Ray puts it on the PYTHONPATH it passes into the image),
    # on a cluster and on this machine, and no folder of the user's.
    assert is_shipped(program, spec.address) and is_shipped(program, None)
    for joining in (True, False):
        job_env = code.runtime_env(None, joining, program.runtime_env())
        assert "working_dir" not in job_env and job_env["py_modules"] == code.launcher_modules()
        RuntimeEnv(**job_env)

    package = dataclasses.replace(program, image=None, argv=(), kind="module", target="trainer.task")
    assert ranks_run_config(spec, package, Storage.resolve(str(tmp_path / "runs")), []).worker_runtime_env == {}


def test_the_container_keys_help_says_what_they_do():
    helps = {f.name: f.help for f in schema.fields(jobfiles.WorkerPoolSpec)}
    assert not helps["containerSpec"].startswith("refused") and "podman" in helps["containerSpec"]
    assert all(not f.help.startswith(("refused", "noted")) for f in schema.fields(jobfiles.ContainerSpec))
