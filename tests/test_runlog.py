"""A run's folder (launcher.storage.runlog): what RunLog, the lock and a tuning run write, read back
through RunRecord from real files in a temporary folder, damaged files included. No Ray."""

from __future__ import annotations

import ast
import json
import os

import pytest

from launcher.errors import UserError
from launcher.spec import JobSpec
from launcher.storage import RunRecord, Storage
from launcher.storage import runlog
from launcher.storage.runlock import RunLock
from launcher.storage.runlog import ProgramLines, RunLog
from launcher.summary import RunStatus, RunSummary, TrialCounts, TuningSummary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = (runlog.RUN, runlog.LAUNCHES, runlog.METRICS, runlog.USAGE, runlog.SUMMARY, runlog.LOCK, runlog.TUNING)


def summary(name: str, status: RunStatus, **more) -> dict:
    return RunSummary(name=name, status=status, workload="digits-mlp", framework="torch", backend="native",
                      workers=2, epochs=2, **more).to_json()


def launched(storage: Storage, name: str, trained: list[int], status: RunStatus | None, **spec) -> RunLog:
    """One launch of ``name``: its start, an epoch line (and a mid-epoch one) per epoch, its end."""
    log = RunLog(storage, name)
    log.begin(JobSpec(name=name, storage=storage.uri, **spec).validated().to_dict())
    for e in trained:
        log.record({"kind": "checkpoint", "epoch": e, "global_step": 10 * e - 5}, tensorboard=False)
        log.record({"kind": "epoch", "epoch": e, "global_step": 10 * e, "loss": 1.0 / e}, tensorboard=False)
    log.record({"source": "hypertune", "trial": ""}, tensorboard=False)  # a report at no step
    if status is not None:
        log.finish(summary(name, status, restarts=len(trained)))
    return log


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage.resolve(str(tmp_path / "runs"))


def test_a_run_written_by_two_launches_reads_back_launch_by_launch(storage):
    assert not RunRecord(storage, "r").exists() and RunRecord(storage, "r").identity() is None
    launched(storage, "r", [1], RunStatus.CANCELLED, epochs=1)
    launched(storage, "r", [2], RunStatus.SUCCEEDED, epochs=2, lr=0.05)
    record = RunRecord(storage, "r")
    assert record.exists()
    ident = record.identity()
    assert (ident["name"], ident["workload"], ident["framework"]) == ("r", "digits-mlp", "torch")
    assert ident["spec"]["epochs"] == 1  # run.json keeps the first launch's spec
    assert [e["launch"] for e in record.starts()] == [1, 2]
    assert [e["event"] for e in record.launches()] == ["start", "end", "start", "end"]
    assert record.ended(1) and record.ended(2) and not record.ended(3)
    assert [s.status for s in record.summaries()] == [RunStatus.CANCELLED, RunStatus.SUCCEEDED]
    assert record.summary().status == RunStatus.SUCCEEDED and record.summary().restarts == 1
    assert record.spec()["epochs"] == 2 and record.spec()["lr"] == 0.05  # the latest launch's
    metrics = record.metrics()
    assert [m.get("kind", m.get("source")) for m in metrics] == ["checkpoint", "epoch", "hypertune"] * 2
    assert [m["launch"] for m in metrics] == [1, 1, 1, 2, 2, 2]
    assert [m["global_step"] for m in record.at_steps()] == [5, 10, 15, 20]
    assert RunLog(storage, "r").identity() == ident


def test_a_launch_still_running_has_a_start_and_no_end(storage):
    launched(storage, "r", [1], None)
    record = RunRecord(storage, "r")
    assert [e["event"] for e in record.launches()] == ["start"]
    assert not record.ended(1) and record.summaries() == [] and record.summary() is None


def test_a_torn_last_line_is_passed_over_and_the_next_line_starts_anew(storage):
    launched(storage, "r", [1], RunStatus.SUCCEEDED)
    for file in (runlog.LAUNCHES, runlog.METRICS):
        with open(storage.path("r", file), "a") as f:
            f.write('{"event": "sta')  # a writer killed mid-line
    assert len(RunRecord(storage, "r").launches()) == 2 and len(RunRecord(storage, "r").metrics()) == 3
    launched(storage, "r", [2], RunStatus.SUCCEEDED)
    record = RunRecord(storage, "r")
    assert [e["launch"] for e in record.starts()] == [1, 2]
    assert [m["epoch"] for m in record.at_steps()] == [1, 1, 2, 2]


def test_a_damaged_summary_is_none_and_the_launches_keep_every_summary(storage):
    launched(storage, "r", [1], RunStatus.SUCCEEDED)
    for garbage in ('{"status": "succ', "[1, 2]"):
        with open(storage.path("r", runlog.SUMMARY), "w") as f:
            f.write(garbage)
        record = RunRecord(storage, "r")
        assert record.summary() is None
        assert [s.status for s in record.summaries()] == [RunStatus.SUCCEEDED]


@pytest.mark.parametrize("garbage, why", [('{"name": "r', "not JSON"), ('["r"]', "a list, not an object")])
def test_a_damaged_run_json_is_named_with_what_is_wrong(storage, garbage, why):
    launched(storage, "r", [1], RunStatus.SUCCEEDED)
    with open(storage.path("r", runlog.RUN), "w") as f:
        f.write(garbage)
    with pytest.raises(ValueError, match=rf"runs/r/run\.json is damaged \({why}"):
        RunRecord(storage, "r").identity()
    with pytest.raises(UserError, match=r"run r: .*run\.json is damaged .*delete that file"):
        RunLog(storage, "r").identity()
    assert RunRecord(storage, "r").spec()["name"] == "r"  # the launches still name the spec


def test_usage_samples_read_back_per_rank(storage):
    log = launched(storage, "r", [1], None)
    log.record_usage({0: [[100.0, 50.0, 300.0, 0.0, 0.0]], 1: [[100.0, 75.0, 310.0, 0.0, 0.0],
                                                              [105.0, 80.0, 320.0, 0.0, 0.0]]})
    log.finish(summary("r", RunStatus.SUCCEEDED))
    usage = RunRecord(storage, "r").usage()
    assert [(u["rank"], u["cpu_pct"]) for u in usage] == [(0, 50.0), (1, 75.0), (1, 80.0)]
    assert all(u["launch"] == 1 for u in usage)


def test_the_lock_reads_as_its_holder_none_or_a_dead_writers(storage):
    record = RunRecord(storage, "r")
    assert record.lock() is None
    lock = RunLock(storage, "r")
    lock.acquire()
    holder = record.lock()
    assert holder["pid"] == os.getpid() and holder["heartbeat"] >= holder["since"]
    lock.release()
    assert record.lock() is None
    storage.write_text('{"host": "h', "r", runlog.LOCK)  # cut off while written
    assert record.lock() == {"heartbeat": 0}


def test_a_tuning_run_and_its_trials(storage):
    record = RunRecord(storage, "study")
    assert record.tuning() is None and record.tuning_summary() is None
    storage.write_text(json.dumps({"spec": {"framework": "torch"}}), "study", runlog.TUNING)
    assert record.tuning() == {"spec": {"framework": "torch"}} and record.tuning_summary() is None
    assert not record.exists()  # a tuning run is not a run
    storage.write_text(json.dumps(TuningSummary(name="study", status=RunStatus.SUCCEEDED, goal="MINIMIZE",
                                                metric="loss", trials=TrialCounts(total=3)).to_json()),
                       "study", runlog.SUMMARY)
    assert record.tuning_summary().trials.total == 3
    inner = Storage.resolve(storage.uri_of("study"))
    launched(inner, "trial_1", [1], RunStatus.SUCCEEDED)
    trial = RunRecord(storage, "study", "trial_1")
    assert trial.exists() and trial.summary().status == RunStatus.SUCCEEDED
    assert trial.uri(runlog.RUN) == storage.uri_of("study", "trial_1", "run.json")
    storage.write_text("{", "study", runlog.TUNING)
    with pytest.raises(ValueError, match=r"study/tuning\.json is damaged \(not JSON"):
        record.tuning()


def test_rank_logs_by_launch(storage):
    log = launched(storage, "r", [1], None)
    lines = ProgramLines(log)
    lines.add("abcdef123", 1, ["one"])
    lines.add("abcdef123", 0, ["zero", "again"])
    lines.flush(force=True)
    record = RunRecord(storage, "r")
    assert record.logged_launches() == [1]
    files = record.rank_logs(1)
    assert len(files) == 2 and all(f.endswith((f"-abcdef-rank0.log", "-abcdef-rank1.log")) for f in files)
    rank0 = next(f for f in files if f.endswith("rank0.log"))
    assert record.rank_log(1, rank0).splitlines()[1:] == ["zero", "again"]
    assert record.rank_logs(2) == [] and record.rank_log(2, rank0) == ""


def test_a_run_records_file_name_is_written_in_one_module_only():
    """Every other module takes the names from launcher.storage.runlog (or reads through RunRecord)."""
    found = []
    for top in ("launcher", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for file in files:
                path = os.path.join(folder, file)
                if not file.endswith(".py") or path.endswith(os.path.join("storage", "runlog.py")):
                    continue
                tree = ast.parse(open(path, encoding="utf-8").read())
                found += [f"{os.path.relpath(path, ROOT)}:{n.lineno} {n.value}" for n in ast.walk(tree)
                          if isinstance(n, ast.Constant) and n.value in FILES]
    assert found == []
