"""Integration tests: real training with 2 workers on a real local Ray (shared across tests)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import workloads
from datafiles import write_cifar_tar
from launcher.storage.checkpoint import complete_checkpoints
from launcher.cli.main import main
from launcher.storage.runlog import read_jsonl
from launcher.storage import Storage

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"name", "status", "workload", "framework", "backend", "workers", "epochs_completed",
                "steps_completed", "metrics", "samples_per_s", "checkpoint", "resumed_from", "restarts", "wall_s"}


def launch(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["run", "--json", *argv])
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold exactly one JSON object:\n{out}\nstderr:\n{err}"
    assert "a resumed run will not be exact" not in err, err  # the managed loop registers all its state
    return code, json.loads(lines[0])


def test_default_run_learns_logs_and_exports(ray_local, capsys, storage):
    code, s = launch(capsys, "--storage", storage, "--name", "digits_default", "--profile-startup")
    assert code == 0, s
    phases = s["startup"]["phases"]
    for phase in ("Ray start or connect", "controller and worker group start",
                  "worker setup (process group, data, model, restore)", "first training step", "training"):
        assert phases[phase] >= 0, phases
    parts = ("worker setup: process group, data, model, optimizer", "worker setup: finding and restoring a checkpoint")
    assert sum(phases[p] for p in parts) == pytest.approx(
        phases["worker setup (process group, data, model, restore)"], abs=0.002)
    assert phases["training"] < s["wall_s"]
    assert SUMMARY_KEYS <= set(s)
    assert (s["status"], s["workers"], s["epochs_completed"], s["restarts"]) == ("succeeded", 2, 10, 0)
    assert s["steps_completed"] == 10 * 23  # 719 samples per rank, batches of 32
    assert s["metrics"]["accuracy"] >= 0.90 and s["metrics"]["loss"] < 0.5
    assert s["resumed_from"] is None and s["samples_per_s"] > 0

    run_dir = os.path.join(storage, "digits_default")
    epochs = [m for m in read_jsonl(open(os.path.join(run_dir, "metrics.jsonl")).read()) if m["kind"] == "epoch"]
    assert [m["epoch"] for m in epochs] == list(range(1, 11))
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    # Rank 0 exported the model with the final checkpoint (not the driver's fallback).
    assert epochs[-1]["model"] == s["model"] and "model" not in epochs[-2]
    launches = read_jsonl(open(os.path.join(run_dir, "launches.jsonl")).read())
    assert [e["event"] for e in launches] == ["start", "end"]
    assert launches[0]["spec"]["workers"] == 2 and launches[1]["summary"]["status"] == "succeeded"
    assert json.load(open(os.path.join(run_dir, "summary.json")))["steps_completed"] == 230
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tensorboard")))
    # keep_checkpoints defaults to 3; the last is the final epoch
    kept = complete_checkpoints(Storage.resolve(storage), "digits_default")
    assert [m.epoch for m, _ in kept] == [8, 9, 10]
    assert s["checkpoint"] == kept[-1][1]

    # Launched again, the finished run trains nothing; its summary has the same shape
    # (--profile-startup on it used to fail with KeyError 'startup').
    code, again = launch(capsys, "--storage", storage, "--name", "digits_default", "--profile-startup")
    assert code == 0 and again["status"] == "succeeded" and again["note"].startswith("nothing to train")
    assert set(again) == set(s)
    assert (again["epochs_completed"], again["steps_completed"], again["final_workers"]) == (10, 230, 2)
    assert again["metrics"] == pytest.approx(s["metrics"]) and again["model"] == s["model"]
    assert again["startup"]["phases"]["spec, storage and data checks"] >= 0
    assert again["interruptions"] == [] and again["attempts"] == [] and again["recovery_s"] == []

    import torch

    model = torch.export.load(os.path.join(run_dir, "model", "model.pt2")).module()
    test = workloads.get("digits-mlp").load(None, "test", 0, 1, {})
    with torch.no_grad():
        predicted = model(torch.from_numpy(test.x)).argmax(1).numpy()
    assert (predicted == test.y).mean() >= 0.90


def test_resume_continues_exactly_where_it_stopped_and_a_missing_model_is_exported(ray_local, capsys, storage):
    common = ["--storage", storage, "--seed", "7", "--checkpoint-every-steps", "10", "--keep-checkpoints", "20"]
    code, full = launch(capsys, *common, "--name", "straight", "--epochs", "3")
    assert code == 0
    mlruns = os.path.join(storage, "mlruns")
    code, first = launch(capsys, *common, "--name", "stopped", "--epochs", "1", "--mlflow", mlruns)
    assert code == 0 and first["epochs_completed"] == 1
    code, resumed = launch(capsys, *common, "--name", "stopped", "--epochs", "3", "--mlflow", mlruns)
    assert code == 0
    assert resumed["resumed_from"] == {"epoch": 1, "step": 23}
    # --mlflow: both launches are one MLflow run, with the epochs of both, its params those of the first
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{mlruns}/mlflow.db")
    (tracked,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert first["mlflow"] == resumed["mlflow"] and tracked.info.run_id in resumed["mlflow"]
    history = client.get_metric_history(tracked.info.run_id, "accuracy")
    assert [m.step for m in history] == [23, 46, 69] and history[-1].value == resumed["metrics"]["accuracy"]
    assert tracked.info.status == "FINISHED" and tracked.data.params["epochs"] == "1"
    assert tracked.data.tags["changed.epochs"] == "3 (launch 2)"
    assert {a.path for a in client.list_artifacts(tracked.info.run_id, "model")} >= {"model/model.pt2"}
    assert (resumed["epochs_completed"], resumed["steps_completed"]) == (3, 69)
    # Same seed and workers: resuming at an epoch boundary changes nothing.
    assert resumed["metrics"] == full["metrics"]

    steps = [(m.global_step, m.step_in_epoch) for m, _ in complete_checkpoints(Storage.resolve(storage), "straight")]
    assert steps == [(10, 10), (20, 20), (23, 0), (30, 7), (40, 17), (46, 0), (50, 4), (60, 14), (69, 0)]
    epochs = [m["epoch"] for m in read_jsonl(open(os.path.join(storage, "stopped", "metrics.jsonl")).read())
              if m["kind"] == "epoch"]
    assert epochs == [1, 2, 3]  # the second launch trained only the remaining epochs

    code, again = launch(capsys, *common, "--name", "stopped", "--epochs", "3")
    assert code == 0 and "nothing to train" in again["note"] and again["epochs_completed"] == 3
    # A complete run whose model is missing gets it exported by the next launch, but not while
    # another launch holds the run (the one that trained it may be exporting it right now).
    import shutil
    import time

    from launcher.storage.runlock import LOCK

    shutil.rmtree(os.path.join(storage, "stopped", "model"))
    with open(os.path.join(storage, "stopped", LOCK), "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "since": 0, "heartbeat": time.time()}, f)
    assert main(["run", *common, "--name", "stopped", "--epochs", "3"]) == 2
    assert "run stopped is being trained by another launch (pid 1 on elsewhere" in capsys.readouterr().err
    os.remove(os.path.join(storage, "stopped", LOCK))
    code, again = launch(capsys, *common, "--name", "stopped", "--epochs", "3")
    assert code == 0 and again["model"] and os.path.isdir(again["model"])
    assert not os.path.exists(os.path.join(storage, "stopped", LOCK))

    assert main(["runs", "--storage", storage, "--json"]) == 0
    runs = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert runs["stopped"]["status"] == "succeeded" and runs["stopped"]["launches"] == 2
    assert runs["stopped"]["mlflow"] == resumed["mlflow"] and runs["straight"]["mlflow"] is None
    assert runs["stopped"]["epochs"] == 3
    assert runs["straight"]["metrics"] == pytest.approx(full["metrics"])  # its final metrics, by their names


def test_cluster_too_small_is_rejected_before_start(ray_local, capsys, storage):
    code = main(["run", "--storage", storage, "--workers", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot place 3 workers of 1 CPU each" in err and "2 CPUs and 0 GPUs" in err
    code = main(["run", "--storage", storage, "--gpus-per-worker", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "1 CPU + 1 GPU" in err and "room for 0" in err
    runs = os.listdir(storage) if os.path.isdir(storage) else []
    assert not any(os.path.exists(os.path.join(storage, r, "launches.jsonl")) for r in runs)  # no launch began


# One file workload (mnist-cnn's IDX files are read by the same path and checked without Ray in
# test_workloads.py) and one synthetic one.
@pytest.mark.parametrize("workload,extra,min_acc", [
    ("cifar10-cnn", ["--epochs", "2"], 0.3),
    ("resnet18-synthetic", ["--param", "image_size=32", "--param", "num_samples=64", "--param", "num_classes=10",
                            "--batch-size", "8"], None),
])
def test_file_and_synthetic_workloads_train(ray_local, capsys, storage, tmp_path, workload, extra, min_acc):
    data = []
    if workload.startswith("cifar"):
        data = ["--data", write_cifar_tar(str(tmp_path / "cifar-10-python.tar.gz"), per_batch=240, n_test=300)]
    code, s = launch(capsys, "--workload", workload, "--storage", storage, *data, *extra)
    assert code == 0 and s["status"] == "succeeded", s
    assert np.isfinite(s["metrics"]["loss"])
    if min_acc is not None:
        assert s["metrics"]["accuracy"] >= min_acc, s["metrics"]
    assert os.path.isfile(os.path.join(storage, s["name"], "model", "model.pt2"))


# A worker SIGKILLed mid-run, restarted from the latest checkpoint: the last launch of
# tests/faults/test_signal_moments.py (a cold launch of this same run). A run whose ranks span the
# nodes of a multi-node cluster: tests/test_placement.py, on that module's 2-node cluster.


def test_diverging_run_fails_with_one_clear_error(ray_local, capsys, storage):
    code, s = launch(capsys, "--storage", storage, "--lr", "1e30", "--epochs", "1", "--name", "diverge")
    assert code == 1 and s["status"] == "failed"
    assert s["error"].startswith("rank ") and "training diverged" in s["error"] and "lower --lr" in s["error"]
    launches = read_jsonl(open(os.path.join(storage, "diverge", "launches.jsonl")).read())
    assert launches[-1]["summary"]["status"] == "failed"


def test_ray_train_settings_leave_the_users_values_and_the_watcher_only_off_on_a_local_ray(monkeypatch):
    from launcher.driver import trainer

    watcher, period = trainer.PREEMPTION_WATCHER_ENV, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    for key in (watcher, period):  # monkeypatch puts back whatever was there before the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(trainer, "_SET_HERE", {})
    trainer.apply_ray_train_env(local=True)
    assert (os.environ[watcher], os.environ[period]) == ("0", str(trainer.HEALTH_CHECK_S))
    # The next run is on a cluster: Ray Train's watcher is back.
    monkeypatch.setenv(trainer.START_TIMEOUT_ENV, "")
    monkeypatch.delenv(trainer.START_TIMEOUT_ENV)
    trainer.apply_ray_train_env(local=False, fixed=True)  # a fixed group waits for a GCE replacement's minutes
    assert watcher not in os.environ
    assert os.environ[trainer.START_TIMEOUT_ENV] == str(trainer.FIXED_START_TIMEOUT_S)
    trainer.apply_ray_train_env(local=False, fixed=False)  # an elastic one gives up on a gone node sooner
    assert os.environ[trainer.START_TIMEOUT_ENV] == str(trainer.ELASTIC_START_TIMEOUT_S)
    # A process this one starts (a benchmark, a test's launch) inherits the local run's "off";
    # the marker says a launcher set it, so the child's cluster run has Ray Train's watcher.
    monkeypatch.setenv(trainer.SET_BY_LAUNCHER_ENV, "")
    trainer.apply_ray_train_env(local=True)
    assert trainer.SET_BY_LAUNCHER_ENV in os.environ and os.environ[watcher] == "0"
    monkeypatch.setattr(trainer, "_SET_HERE", {})  # the child process: nothing set there yet
    trainer.apply_ray_train_env(local=False)
    assert watcher not in os.environ
    monkeypatch.setenv(period, "1")  # the user's own setting, made after the launcher's
    monkeypatch.setenv(watcher, "1")
    trainer.apply_ray_train_env(local=True)
    assert (os.environ[watcher], os.environ[period]) == ("1", "1")
    monkeypatch.setattr(trainer, "_SET_HERE", {})  # ... and in a process this one starts
    trainer.apply_ray_train_env(local=True)
    assert (os.environ[watcher], os.environ[period]) == ("1", "1")
