"""``launcher runs`` (launcher.storage.runs): each kind of run listed with what it trained and its
own metrics, read from run logs written by the launcher's own RunLog."""

from __future__ import annotations

import json
import time

import pytest

from launcher.cli.main import main
from launcher.spec import JobSpec
from launcher.storage import Storage
from launcher.storage.runlog import RunLog
from launcher.storage.runs import headline
from launcher.summary import BestTrial, RunStatus, RunSummary, TrialCounts, TuningSummary


def logged_run(root: str, name: str, rows: list[dict], workload: str = "digits-mlp") -> None:
    """A finished run's log: its start, ``rows`` as its metrics lines, its end."""
    spec = JobSpec(name=name, storage=root, workload="digits-mlp").validated()
    log = RunLog(Storage.resolve(root), name)
    log.begin({**spec.to_dict(), "workload": workload})
    for row in rows:
        log.record(row, tensorboard=False)
    log.finish(RunSummary(name=name, status=RunStatus.SUCCEEDED, workload=workload, framework="torch",
                          backend="native", workers=2, epochs=3, wall_s=12.0).to_json())


def listed(capsys, root: str) -> tuple[dict[str, dict], dict[str, str]]:
    """(rows by name from --json, table lines by name)."""
    assert main(["runs", "--storage", root, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert main(["runs", "--storage", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STATUS", "WORKLOAD", "EPOCHS", "METRICS"], lines[0]
    return rows, {line.split()[0]: line for line in lines[1:]}


def hypertune(step: int, **metrics) -> dict:
    """A program's hypertune entry, as the driver logs it."""
    return {"source": "hypertune", "global_step": step, "timestamp": time.time(), "trial": "", **metrics}


def test_runs_show_each_runs_own_headline_metrics(capsys, tmp_path):
    root = str(tmp_path)
    epoch = {"kind": "epoch", "step_in_epoch": 0, "world_size": 2, "samples": 100, "train_time_s": 1.0}
    # a user loop whose metrics are val_loss and acc
    logged_run(root, "own", [{**epoch, "epoch": e, "global_step": 10 * e, "train_loss": 0.9 / e,
                              "val_loss": 1.0 / e, "acc": 0.5 + e / 10} for e in (1, 2, 3)], "loop.py:train")
    # a regression: a loss and a mean absolute error
    logged_run(root, "reg", [{**epoch, "epoch": 1, "global_step": 10, "val_loss": 0.25, "mae": 0.125}])
    # the managed loop's own names
    logged_run(root, "builtin", [{**epoch, "epoch": 1, "global_step": 23, "train_loss": 0.7, "loss": 0.5,
                                  "accuracy": 0.875}])
    rows, table = listed(capsys, root)
    assert rows["own"]["metrics"] == pytest.approx({"train_loss": 0.3, "val_loss": 1 / 3, "acc": 0.8})
    assert rows["own"]["epochs"] == 3
    assert "val_loss 0.3333  acc 0.8000" in table["own"], table["own"]
    assert "val_loss 0.2500  mae 0.1250" in table["reg"], table["reg"]
    assert "loss 0.5000  accuracy 0.8750" in table["builtin"], table["builtin"]
    assert " - " not in table["own"].split("12s")[0]  # no empty metric cell before WALL


def test_headline_picks_by_name_family():
    assert headline({"train_loss": 1.0, "loss": 2.0, "accuracy": 0.5}) == {"loss": 2.0, "accuracy": 0.5}
    assert headline({"train_loss": 1.0, "perplexity": 9.0}) == {"train_loss": 1.0, "perplexity": 9.0}
    assert headline({"val_acc": 0.5, "auc": 0.7, "val_loss": 0.3}) == {"val_loss": 0.3, "val_acc": 0.5}
    assert headline({}) == {}


def test_program_runs_count_their_epochs_and_show_every_reported_metric(capsys, tmp_path):
    root = str(tmp_path)
    # a trainer package reporting accuracy and loss (two hypertune entries) after each of 3 epochs
    rows = []
    for e in (1, 2, 3):
        rows += [hypertune(22 * e, accuracy=0.8 + e / 100), hypertune(22 * e, loss=0.5 / e)]
    logged_run(root, "pkg", rows, "module:trainer.task")
    # a job file's program, restarted once: its third epoch's report came twice
    logged_run(root, "job", [hypertune(s, accuracy=0.9) for s in (22, 44, 66, 66)], "module:trainer.task")
    # a program that says which epoch it is at
    logged_run(root, "counted", [hypertune(100, epoch=4, accuracy=0.7)], "script:train.py")
    listed_rows, table = listed(capsys, root)
    assert listed_rows["pkg"]["epochs"] == 3 and listed_rows["job"]["epochs"] == 3
    assert listed_rows["counted"]["epochs"] == 4
    assert listed_rows["pkg"]["metrics"] == pytest.approx({"accuracy": 0.83, "loss": 0.5 / 3})
    assert table["pkg"].split()[3] == "3" and "loss 0.1667  accuracy 0.8300" in table["pkg"], table["pkg"]


def test_a_tuning_run_lists_the_epochs_of_its_trials_and_its_best_trials_metrics(capsys, tmp_path):
    root = str(tmp_path)
    store = Storage.resolve(root)
    trials = str(tmp_path / "search")
    epoch = {"kind": "epoch", "step_in_epoch": 0, "world_size": 2}
    for i in range(4):  # 4 trials of 3 epochs
        logged_run(trials, f"trial_{i}", [{**epoch, "epoch": e, "global_step": 23 * e, "loss": 1.0 / (e + i),
                                           "accuracy": 0.5 + i / 10, "train_loss": 1.0} for e in (1, 2, 3)])
    store.write_text(json.dumps({"spec": {"workload": "digits-mlp", "framework": "torch"}, "program": None,
                                 "metric": "accuracy"}), "search", "tuning.json")
    best = BestTrial(trial="3", metric="accuracy", value=0.8, params={"lr": 0.1}, run_dir=f"{trials}/trial_3")
    summary = TuningSummary(name="search", status=RunStatus.SUCCEEDED, goal="MAXIMIZE", metric="accuracy",
                            trials=TrialCounts(total=4, succeeded=4), best=best, wall_s=60.0)
    store.write_text(json.dumps(summary.to_json()), "search", "summary.json")
    rows, table = listed(capsys, root)
    assert rows["search"]["epochs"] == 12 and rows["search"]["trials"] == 4
    assert rows["search"]["metrics"]["loss"] == pytest.approx(1 / 6)
    assert "loss 0.1667  accuracy 0.8000" in table["search"] and "best accuracy 0.8000" in table["search"]


def test_compare_with_a_metric_no_run_reported_is_one_line_before_the_table(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a plot would go
    root = str(tmp_path)
    for name in ("a", "b"):
        logged_run(root, name, [{"kind": "epoch", "epoch": e, "global_step": 10 * e, "loss": 1 / e,
                                 "accuracy": 0.5 + e / 10} for e in (1, 2)])
    for metric, said in (("los", "did you mean loss? plot one of: accuracy, loss"),
                         ("nosuchmetric", "plot one of: accuracy, loss")):
        assert main(["runs", "--storage", root, "--compare", "a", "b", "--plot", metric]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, out + err
        assert err.strip().endswith(f"--plot {metric}: no run here reported {metric}; {said}"), err
    assert not list(tmp_path.glob("*.png"))


def test_runs_list_each_runs_strategy(capsys, tmp_path):
    """The WORKLOAD column and --json say how each run kept its model in step (--strategy)."""
    root = str(tmp_path)
    epoch = {"kind": "epoch", "epoch": 1, "step_in_epoch": 0, "global_step": 10, "world_size": 2, "loss": 0.5}
    logged_run(root, "whole", [epoch])
    spec = JobSpec(name="sharded", storage=root, workload="examples/gpt.py:train", strategy="fsdp").validated()
    log = RunLog(Storage.resolve(root), "sharded")
    log.begin(spec.to_dict())
    log.record(epoch, tensorboard=False)
    rows, table = listed(capsys, root)  # before its launch has ended: the run's spec says it
    assert rows["sharded"]["strategy"] == "fsdp" and "examples/gpt.py:train/torch/fsdp" in table["sharded"]
    log.finish(RunSummary(name="sharded", status=RunStatus.SUCCEEDED, workload=spec.workload, framework="torch",
                          backend="native", strategy="fsdp", workers=2, epochs=1).to_json())
    rows, table = listed(capsys, root)
    assert rows["sharded"]["strategy"] == "fsdp" and "examples/gpt.py:train/torch/fsdp" in table["sharded"]
    assert rows["whole"]["strategy"] == "ddp" and "digits-mlp/torch/ddp" in table["whole"], table["whole"]


def test_a_ft_runs_quorum_changes_and_their_cost_are_shown(capsys, tmp_path):
    """--strategy ft: the quorum changes stand in for restarts in the table, and `runs NAME` says
    what each cost; a run without any says nothing of them."""
    root = str(tmp_path)
    spec = JobSpec(name="ft", storage=root, strategy="ft", workers=3, min_workers=2).validated()
    log = RunLog(Storage.resolve(root), "ft")
    log.begin(spec.to_dict())
    log.record({"kind": "epoch", "epoch": 1, "step_in_epoch": 0, "global_step": 10, "world_size": 3, "loss": 0.5},
               tensorboard=False)
    log.finish(RunSummary(name="ft", status=RunStatus.SUCCEEDED, workload=spec.workload, framework="torch",
                          backend="native", strategy="ft", workers=3, epochs=1, quorum_changes=2,
                          quorum_change_s=[0.24, 0.18], replicas_replaced=1).to_json())
    logged_run(root, "plain", [{"kind": "epoch", "epoch": 1, "step_in_epoch": 0, "global_step": 10,
                                "world_size": 2, "loss": 0.5}])
    rows, table = listed(capsys, root)
    assert rows["ft"]["quorum_changes"] == 2 and rows["ft"]["quorum_change_s"] == [0.24, 0.18], rows["ft"]
    assert "0 (2 quorum changes)" in table["ft"] and "quorum" not in table["plain"], table
    assert main(["runs", "ft", "--storage", root]) == 0
    out = capsys.readouterr().out
    assert "quorum changes 2 (0.4s for their steps' quorums: 0.24s/0.18s), replicas replaced 1" in out, out
    assert main(["runs", "plain", "--storage", root]) == 0
    assert "quorum" not in capsys.readouterr().out
