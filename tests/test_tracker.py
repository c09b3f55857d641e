"""launcher.driver.tracker: what a launch's reports become (metrics rows, progress lines, the
summary), fed real controller events, real checkpoints in storage and real start-up timing."""

from __future__ import annotations

import io
import os
import time

import pytest

from launcher import faultpoint
from launcher.driver import startup
from launcher.driver.progress import Progress
from launcher.driver.tracker import Tracker
from launcher.spec import JobSpec
from launcher.storage import Storage, complete_checkpoints
from launcher.storage.checkpoint import Manifest, write_manifest
from launcher.storage.runlog import RunLog, read_jsonl
from launcher.summary import Report, Restart, RunStatus

STEPS = 23  # steps per epoch


def new_tracker(tmp_path, epochs: int = 20, started: float | None = None) -> tuple[Tracker, io.StringIO]:
    spec = JobSpec(name="r", storage=str(tmp_path / "runs"), epochs=epochs).validated()
    log = RunLog(Storage.resolve(spec.storage), spec.name)
    log.begin(spec.to_dict())
    out = io.StringIO()
    return Tracker(spec, log, Progress(epochs, stream=out), started=started or time.time() - 1), out


def epoch_report(epoch: int, when: float, **extra) -> dict:
    """Rank 0's report at the end of ``epoch``, as the managed loop sends it."""
    return {"kind": "epoch", "epoch": epoch, "step_in_epoch": 0, "global_step": epoch * STEPS, "world_size": 2,
            "time": when, "attempt": "a1", "restored_from": None, "samples": 1438, "train_time_s": 0.5,
            "samples_per_s": 2876.0, "train_loss": 1.0 / epoch, "loss": 1.0 / epoch, "accuracy": 0.5 + epoch / 100,
            **extra}


def store_checkpoint(storage: Storage, report: dict) -> str:
    """A complete checkpoint of ``report``'s epoch in the run's folder, as rank 0 writes one."""
    folder = storage.path("r", f"checkpoint_{report['global_step']:06d}")
    os.makedirs(folder)
    with open(os.path.join(folder, "model.pt"), "wb") as f:
        f.write(b"weights")
    write_manifest(folder, Manifest(epoch=report["epoch"], step_in_epoch=0, global_step=report["global_step"],
                                    world_size=2, framework="torch", backend="native", workload="digits-mlp",
                                    batch_size=32, seed=0,
                                    metrics={k: v for k, v in report.items() if isinstance(v, (int, float))}))
    return folder


def rows(tracker: Tracker) -> list[dict]:
    return read_jsonl(tracker.log.storage.read_text("r", "metrics.jsonl"))


def test_epochs_whose_reports_were_cut_off_get_their_rows_from_their_checkpoints(tmp_path):
    # Ctrl-C at epoch 9: the controller passed on epochs 1-9; the workers stored 10 and 11 meanwhile.
    tracker, out = new_tracker(tmp_path)
    storage = tracker.log.storage
    t0 = time.time()
    for epoch in range(1, 10):
        report = epoch_report(epoch, t0 + epoch, **({"startup_marks": {"worker_ready": t0}} if epoch == 1 else {}))
        tracker.handle(Report(t0 + epoch, dict(report), store_checkpoint(storage, report)))
    for epoch in (10, 11):
        store_checkpoint(storage, epoch_report(epoch, t0 + epoch))
    assert "epoch 10/20" not in out.getvalue()

    tracker.reconcile(complete_checkpoints(storage, "r"))

    epochs = [r["epoch"] for r in rows(tracker) if r["kind"] == "epoch"]
    assert epochs == list(range(1, 12))  # a row for every epoch a checkpoint holds, once
    recovered = [r for r in rows(tracker) if r.get("from_checkpoint")]
    assert [r["epoch"] for r in recovered] == [10, 11] and recovered[-1]["loss"] == pytest.approx(1 / 11)
    assert "epoch 11/20  step 253" in out.getvalue() and "the report was cut off" in out.getvalue()
    summary = tracker.summary(RunStatus.CANCELLED)
    assert (summary.epochs_completed, summary.steps_completed) == (11, 11 * STEPS)
    assert summary.checkpoint.endswith("checkpoint_000253") and summary.metrics["accuracy"] == pytest.approx(0.61)
    assert summary.samples_per_s == pytest.approx(1438 / 0.5)

    # A second look (or an earlier launch's checkpoints) writes nothing twice.
    tracker.reconcile(complete_checkpoints(storage, "r"))
    assert len(rows(tracker)) == 11
    later, _ = new_tracker(tmp_path, started=time.time() + 1)
    later.reconcile(complete_checkpoints(storage, "r"))
    assert len(rows(later)) == 11


def test_a_lost_groups_cut_off_report_is_logged_in_step_order_when_the_next_group_starts(tmp_path):
    # Group a1 reports epochs 1-2 and stores 3, then its node is lost with the report of 3.
    tracker, out = new_tracker(tmp_path)
    storage = tracker.log.storage
    t0 = time.time()
    for epoch in (1, 2):
        report = epoch_report(epoch, t0 + epoch)
        tracker.handle(Report(t0 + epoch, dict(report), store_checkpoint(storage, report)))
    store_checkpoint(storage, epoch_report(3, t0 + 3))
    tracker.handle(Restart(t0 + 4, "failure", "ActorDiedError"))
    report = epoch_report(4, t0 + 6, attempt="a2", restored_from={"epoch": 3, "step": 3 * STEPS})
    tracker.handle(Report(t0 + 6, dict(report), store_checkpoint(storage, report)))
    assert [r["epoch"] for r in rows(tracker)] == [1, 2, 3, 4]  # 3 before the new group's 4, not after
    assert [r.get("from_checkpoint") for r in rows(tracker)] == [None, None, 1, None]
    tracker.reconcile(complete_checkpoints(storage, "r"))  # the launch's end: nothing more to add
    assert len(rows(tracker)) == 4 and tracker.summary(RunStatus.SUCCEEDED).epochs_completed == 4


def test_a_launch_stopped_inside_its_first_epoch_reports_the_rate_it_trained_at(tmp_path):
    # Rank 0 ready at t0, a step checkpoint at step 10 two seconds later, then Ctrl-C: no epoch ended.
    tracker, _ = new_tracker(tmp_path)
    t0 = time.time()
    tracker.handle(Report(t0 + 2, {"kind": "step", "epoch": 0, "step_in_epoch": 10, "global_step": 10,
                                   "world_size": 2, "time": t0 + 2, "attempt": "a1", "restored_from": None,
                                   "train_loss": 2.0, "startup_marks": {"worker_ready": t0}}))
    summary = tracker.summary(RunStatus.CANCELLED)
    assert summary.steps_completed == 10
    assert summary.samples_per_s == pytest.approx(10 * 32 * 2 / 2.0)  # batch 32 per worker, 2 workers
    # The next step checkpoint was stored, its report cut off: the group trained that far too.
    folder = tracker.log.storage.path("r", "checkpoint_000020")
    os.makedirs(folder)
    write_manifest(folder, Manifest(epoch=0, step_in_epoch=20, global_step=20, world_size=2, framework="torch",
                                    backend="native", workload="digits-mlp", batch_size=32, seed=0,
                                    metrics={"train_loss": 1.5, "time": t0 + 4}))
    tracker.reconcile(complete_checkpoints(tracker.log.storage, "r"))
    summary = tracker.summary(RunStatus.CANCELLED)
    assert summary.steps_completed == 20 and summary.samples_per_s == pytest.approx(20 * 64 / 4.0)
    assert [(r["kind"], r["global_step"]) for r in rows(tracker)] == [("step", 10), ("step", 20)]


def test_the_rate_counts_a_cut_off_epoch_at_the_epochs_own_samples_per_step(tmp_path):
    tracker, _ = new_tracker(tmp_path)
    t0 = time.time()
    tracker.handle(Report(t0 + 1, epoch_report(1, t0 + 1, samples=2300, train_time_s=1.0,
                                               startup_marks={"worker_ready": t0})))
    tracker.handle(Report(t0 + 2, {"kind": "preemption", "epoch": 1, "step_in_epoch": 10, "global_step": STEPS + 10,
                                   "world_size": 2, "time": t0 + 2, "attempt": "a1", "restored_from": None}))
    summary = tracker.summary(RunStatus.CANCELLED)
    # 2300 samples in 1 s for the epoch, then 10 steps of 100 samples in 1 s
    assert summary.samples_per_s == pytest.approx((2300 + 1000) / 2.0)


def test_a_one_off_set_up_is_a_start_up_phase_not_wall_time(tmp_path, monkeypatch):
    # The real mechanism, with a real wait inside it (the fault point "setup"), as a first Horovod build.
    monkeypatch.setenv(faultpoint.ENV, "setup:1.5")
    monkeypatch.setattr(faultpoint, "_reached", set())
    startup.begin_run()
    launched = time.time()
    with startup.setup_phase() as setup:
        pass
    assert setup.seconds >= 1.5
    tracker, out = new_tracker(tmp_path, started=launched)
    t = time.time()
    tracker.handle(Report(t, epoch_report(1, t, startup_marks={"worker_ready": t - 0.5})))
    summary = tracker.summary(RunStatus.SUCCEEDED)
    took = time.time() - launched
    assert summary.setup_s >= 1.5 and summary.wall_s <= took - 1.5 + 0.05, (summary.wall_s, took)
    elapsed = float(out.getvalue().split("elapsed ")[1].split("s")[0])
    assert elapsed < took - 1.4  # the progress line's elapsed time leaves the set-up out too
    phases = startup.report(startup.MARKS)["phases"]
    assert phases[startup.SETUP_PHASE] >= 1.5
    assert "\n    backend set-up (a first Horovod build)" in startup.format_table(startup.report(startup.MARKS))


def test_a_second_run_in_one_process_times_its_checks_from_its_own_call(monkeypatch):
    """A notebook or a test calls run() twice: the second run's checks start when it is called,
    not at the first run's entry (it said 19.9 s of checks for a run that took 8.7 s)."""
    monkeypatch.setattr(startup, "MARKS", {})
    startup.begin_cli()
    startup.begin_run()
    startup.mark("checks_done")
    first = dict(startup.MARKS)
    assert first["cli_main"] <= first["checks_done"] and "process_start" in first
    time.sleep(0.2)
    startup.begin_run()
    startup.mark("checks_done")
    phases = startup.phases(startup.MARKS)
    assert phases["spec, storage and data checks"] < 0.1, phases
    assert "python start and imports" not in phases  # the process's start was the first run's
