"""MLflow tracking (launcher.storage.tracking), fast tier: a real MLflow client on a real SQLite store
in a temporary folder, fed through the run log as a launch feeds it; no Ray, no subprocess."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from launcher import flags
from launcher.cli.main import build_parser
from launcher.cli.options import spec_from_args
from launcher.cli.run import format_summary
from launcher.errors import Unreachable, UserError
from launcher.storage import Storage
from launcher.storage.runlog import RunLog, read_jsonl
from launcher.storage.tracking import RECORD_FILE, Tracking, check_store_reach, store_uri
from launcher.storage.tracking_values import params_of, report_metrics
from launcher.storage.uri import normalize_tracking
from launcher.summary import RunStatus, RunSummary

SPEC = {"workload": "digits-mlp", "framework": "torch", "backend": "native", "epochs": 2, "lr": 0.01,
        "name": "r", "data": None, "mlflow": "x", "params": {"hidden": 32, "lr": 0.5}}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module (MLflow creates its tables once: about 2 s)."""
    return normalize_tracking(str(tmp_path_factory.mktemp("mlruns")))


@pytest.fixture(scope="module")
def client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(store_uri(store)[0])


def launch(store: str, storage: Storage, name: str, spec: dict | None = None,
           notes: list[str] | None = None) -> RunLog:
    log = RunLog(storage, name, Tracking(store, storage, name, (notes if notes is not None else []).append))
    log.begin({**SPEC, "name": name, **(spec or {})})
    return log


def summary(status: str, steps: int, **extra) -> dict:
    return {"status": status, "steps_completed": steps, "samples_per_s": 100.0, "wall_s": 3.5, "restarts": 0,
            **extra}


def test_mlflow_flag_alone_means_a_store_in_the_launching_folder_and_a_uri_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bare = spec_from_args(build_parser().parse_args(["run", "--mlflow", "--epochs", "1"]))
    assert bare.mlflow == f"file://{tmp_path}/mlruns"
    assert spec_from_args(build_parser().parse_args(["run"])).mlflow is None  # off unless asked
    given = spec_from_args(build_parser().parse_args(["run", "--mlflow", "http://127.0.0.1:5000"]))
    assert given.mlflow == "http://127.0.0.1:5000"
    assert flags.to_argv(given)[flags.to_argv(given).index("--mlflow") + 1] == "http://127.0.0.1:5000"
    assert normalize_tracking("sqlite:///m.db") == f"sqlite:///{tmp_path}/m.db"  # trial actors start elsewhere
    assert normalize_tracking("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert normalize_tracking("file:rel") == f"file://{tmp_path}/rel"
    for bad, words in (("http://me:secret@host:5000", "holds a password"), ("gs://b/p", "not its tracking store"),
                       ("s3://b/p", "no tracking store for the s3: scheme"), ("sqlite://", "in-memory"),
                       ("  ", "is empty")):
        with pytest.raises(UserError, match=words) as caught:
            normalize_tracking(bad)
        assert "secret" not in str(caught.value)


def test_a_folder_holds_an_sqlite_store_unless_it_already_holds_a_file_store(tmp_path):
    assert store_uri(f"file://{tmp_path}/a") == (f"sqlite:///{tmp_path}/a/mlflow.db", f"{tmp_path}/a/artifacts")
    legacy = tmp_path / "old"
    (legacy / "0").mkdir(parents=True)
    (legacy / "0" / "meta.yaml").write_text("name: Default\n")
    assert store_uri(f"file://{legacy}") == (f"file://{legacy}", None)
    assert os.environ.get("MLFLOW_ALLOW_FILE_STORE") == "true"


def test_params_and_metrics_as_mlflow_takes_them():
    params = params_of(SPEC)
    assert params["epochs"] == "2" and params["hidden"] == "32" and params["param.lr"] == "0.5"
    assert params["lr"] == "0.01" and "data" not in params and "mlflow" not in params
    row = {"kind": "epoch", "epoch": 2, "global_step": 40, "loss": 0.25, "top-1 (%)": 91.0, "samples": 640,
           "samples_per_s": 1500.0, "time_data": 0.4, "attempt": "abc", "world_size": 2, "held": True}
    assert report_metrics(row) == {"loss": 0.25, "top-1 ___": 91.0, "epoch": 2.0, "samples_per_s": 1500.0,
                                   "world_size": 2.0, "time/data": 0.4}


def test_a_run_is_one_mlflow_run_across_its_launches(store, client, tmp_path):
    storage = Storage.resolve(str(tmp_path))
    log = launch(store, storage, "r1")
    first = log.tracking.run_id
    now = time.time()
    log.record({"kind": "epoch", "epoch": 1, "global_step": 10, "loss": 0.9, "time_compute": 0.7, "time": now})
    log.record_usage({0: [[now, 95.0, 512.0, 0.0, 0.0], [now + 5, 97.0, 520.0, 0.0, 0.0]],
                      1: [[now, 90.0, 500.0, 0.0, 0.0]]})
    (tmp_path / "r1" / "model").mkdir()
    (tmp_path / "r1" / "model" / "model.json").write_text('{"format": "torch"}')
    log.finish(summary("interrupted", 10, model=str(tmp_path / "r1" / "model")))
    assert client.get_run(first).info.status == "KILLED"  # it will resume

    again = launch(store, storage, "r1", {"epochs": 4})  # a relaunch asks for more epochs
    assert (again.tracking.run_id, again.tracking.resumed) == (first, True)
    assert client.get_run(first).info.status == "RUNNING"
    again.record({"kind": "epoch", "epoch": 2, "global_step": 20, "loss": 0.4, "time": now + 10})
    again.finish(summary("succeeded", 20))

    run = client.get_run(first)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params["epochs"] == "2" and run.data.tags["changed.epochs"] == "4 (launch 2)"
    assert run.data.tags["launcher.run_dir"] == str(tmp_path / "r1") and run.data.tags["launcher.launch"] == "2"
    assert [(m.step, m.value) for m in client.get_metric_history(first, "loss")] == [(10, 0.9), (20, 0.4)]
    assert [m.value for m in client.get_metric_history(first, "usage/cpu_pct/rank0")] == [95.0, 97.0]
    assert [m.step for m in client.get_metric_history(first, "usage/rss_mb/rank1")] == [0]
    assert not client.get_metric_history(first, "usage/gpu_pct/rank0")  # no GPU: no GPU figures
    assert client.get_metric_history(first, "time/compute")[0].value == 0.7
    assert client.get_metric_history(first, "summary/samples_per_s")[-1].step == 20
    files = {a.path for a in client.list_artifacts(first, "launcher")} | \
        {a.path for a in client.list_artifacts(first, "model")}
    assert files == {"launcher/summary-launch1.json", "launcher/summary-launch2.json", "model/model.json"}
    assert len(read_jsonl((tmp_path / "r1" / RECORD_FILE).read_text())) == 1  # the id, kept once
    assert len(client.search_runs([run.info.experiment_id], "attributes.run_name = 'r1'")) == 1
    shown = format_summary(RunSummary(name="r1", status=RunStatus.SUCCEEDED, workload="w", framework="torch",
                                      backend="native", workers=2, epochs=4, mlflow=again.tracked()))
    assert f"mlflow:     run {first} in sqlite:///" in shown and "mlflow ui --backend-store-uri" in shown


def test_a_launch_that_died_before_keeping_the_id_finds_its_run_by_its_folder(store, client, tmp_path):
    storage = Storage.resolve(str(tmp_path))
    first = launch(store, storage, "r2").tracking.run_id  # killed hard: never finished
    (tmp_path / "r2" / RECORD_FILE).unlink()  # as if it died before writing the line
    again = launch(store, storage, "r2")
    assert again.tracking.run_id == first
    assert read_jsonl((tmp_path / "r2" / RECORD_FILE).read_text())[0]["run_id"] == first
    again.finish(summary("failed", 0))
    assert client.get_run(first).info.status == "FAILED"


def test_a_run_inside_a_tracked_runs_folder_is_its_child(store, client, tmp_path):
    storage = Storage.resolve(str(tmp_path))
    parent = Tracking(store, storage, "tune1")
    parent.start(None, {"tuning.goal": "MAXIMIZE"}, {"launcher.kind": "tuning"})
    trials = Storage.resolve(str(tmp_path / "tune1"))  # a trial's storage: the tuning run's folder
    child = launch(store, trials, "trial_a")
    child.finish(summary("succeeded", 5))
    parent.end(RunStatus.SUCCEEDED)
    run = client.get_run(child.tracking.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert run.info.experiment_id == client.get_run(parent.run_id).info.experiment_id
    assert "mlflow.parentRunId" not in client.get_run(parent.run_id).data.tags


def test_a_tracking_server_that_does_not_answer_stops_the_launch_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracking = Tracking(f"http://127.0.0.1:{port}", Storage.resolve(str(tmp_path)), "r3")
    tracking.connect_soon()  # as a launch does while Ray starts: the launch's start raises what it found
    with pytest.raises(Unreachable) as caught:
        tracking.start(1, {}, {})
    said = str(caught.value)
    assert said.startswith(f"the MLflow tracking server at http://127.0.0.1:{port} did not answer (connection "
                           "refused); check that it is up")
    assert "HTTPConnectionPool" not in said and "\n" not in said
    assert not (tmp_path / "r3").exists()  # nothing written


def tree(root) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    return {os.path.relpath(os.path.join(top, n), root): (open(os.path.join(top, n), "rb").read() if n in files
                                                           else None)
            for top, dirs, files in os.walk(root) for n in dirs + files}


@pytest.mark.parametrize("earlier", [False, True])
def test_a_launch_a_tracking_server_stops_leaves_the_run_folder_as_it_was(tmp_path, monkeypatch, earlier):
    """As a launch goes: the run's checks, its lock (which makes the run's folder), Ray, then the log's
    start, where MLflow is found not to answer. A new run leaves no folder; an earlier one's is as it was."""
    from launcher.driver import runpath
    from launcher.driver.progress import Progress

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path / "runs"
    spec = spec_from_args(build_parser().parse_args(["run", "--storage", str(root), "--name", "r9", "--epochs", "1",
                                                     "--mlflow", f"http://127.0.0.1:{port}"]))
    if earlier:
        RunLog(Storage.resolve(spec.storage), spec.name).begin(spec.to_dict())
    before = tree(root)
    progress = Progress(1, enabled=False)
    storage, log = runpath.open_run(spec, progress)
    with pytest.raises(Unreachable):
        with runpath.holding(storage, spec.name, progress):
            log.begin(spec.to_dict())
    assert tree(root) == before and (root / "r9").exists() == earlier


def test_a_store_that_stops_taking_records_is_said_once_and_the_run_log_keeps_them(store, client, tmp_path):
    storage = Storage.resolve(str(tmp_path))
    notes: list[str] = []
    log = launch(store, storage, "r4", notes=notes)
    client.delete_run(log.tracking.run_id)  # MLflow now refuses every write to it
    for step in (1, 2, 3):
        log.record({"kind": "step", "global_step": step, "loss": 1.0 / step})
    log.finish(summary("succeeded", 3))
    assert len(notes) == 1 and notes[0].startswith(f"MLflow at {store_uri(store)[0]} did not take a record (")
    assert notes[0].endswith("training goes on, and the run log keeps every record")
    assert [r["global_step"] for r in read_jsonl((tmp_path / "r4" / "metrics.jsonl").read_text())] == [1, 2, 3]
    assert json.loads((tmp_path / "r4" / "summary.json").read_text())["status"] == "succeeded"


def test_a_store_written_on_another_machine_is_refused_for_a_tracking_server():
    from launcher.driver.jobs import PROGRAM_FIELDS

    local = normalize_tracking("mlruns")
    for here in (None, "127.0.0.1:6379", "http://localhost:8265"):  # a local cluster: the store is here
        check_store_reach(local, here, "anyone")
    with pytest.raises(UserError, match=r"is a store on this machine, but a submitted run's driver runs on the "
                                        r"cluster's head node \(10\.0\.0\.3\) and would write it there; give a "
                                        r"tracking server .*, or use `launcher run --address`"):
        check_store_reach(local, "http://10.0.0.3:8265", "a submitted run's driver runs on the cluster's head node",
                          "or use `launcher run --address` to drive the run from here")
    check_store_reach("http://10.0.0.2:5000", "http://10.0.0.3:8265", "anyone")
    assert "mlflow" in PROGRAM_FIELDS  # a submitted program is tracked too
    with pytest.raises(UserError, match=r"but the trials run on the cluster's nodes \(10\.0\.0\.3\)"):
        check_store_reach(local, "10.0.0.3:6379", "the trials run on the cluster's nodes")


def test_mlflow_experiment_name_chooses_the_experiment(store, client, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lr_sweeps")
    log = launch(store, Storage.resolve(str(tmp_path)), "r5")
    log.finish(summary("succeeded", 1))
    assert client.get_experiment(client.get_run(log.tracking.run_id).info.experiment_id).name == "lr_sweeps"
