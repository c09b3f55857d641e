"""`launcher tune`: AI Platform's hyperparameters YAML, checked; trials as whole runs on Ray Tune.

The bad-input cases run no Ray (one line, exit 2). The searches run on the
session's local Ray (2 CPUs), with real Ray Tune trials, each a real Ray Train
run of its own; the interrupted search is a real `launcher tune` process
stopped with SIGINT and launched again.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launcher.cli.main import main
from launcher.summary import RunStatus, TuningSummary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "examples", "trainer_package")



def last_line(out: str) -> str:
    """The --json summary: stdout's last line (in-process, Ray may print a warning to stdout
    first; the CLI itself sends everything but the summary to stderr)."""
    return out.strip().splitlines()[-1]

def write_yaml(tmp_path, text: str, name: str = "tune.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


LR_LOG = """
    workload: digits-mlp
    epochs: 1
    workers: 1
    hyperparameters:
      goal: MAXIMIZE
      hyperparameterMetricTag: accuracy
      maxTrials: 4
      maxParallelTrials: 2
      params:
        - parameterName: lr
          type: DOUBLE
          minValue: 0.00005
          maxValue: 0.3
          scaleType: UNIT_LOG_SCALE
"""


@pytest.mark.parametrize("edit, message", [
    (("goal: MAXIMIZE", "gaol: MAXIMIZE"), "hyperparameters: unknown key 'gaol'; did you mean goal?"),
    (("scaleType: UNIT_LOG_SCALE", "scale: UNIT_LOG_SCALE"), "unknown key 'scale' in params[0] (lr); did you mean "
                                                             "scaleType?"),
    (("maxValue: 0.3", "maxValue: 0.00001"), "parameter lr: minValue 5e-05 must be below maxValue 1e-05"),
    (("minValue: 0.00005", "minValue: 0"), "parameter lr: UNIT_LOG_SCALE needs minValue > 0"),
    (("parameterName: lr", "parameterName: dropout"), "parameter dropout is neither a tunable JobSpec field"),
    (("parameterName: lr", "parameterName: workers"), "parameter workers is a JobSpec field a trial cannot vary"),
    (("hyperparameterMetricTag: accuracy", "hyperparameterMetricTag: auc"),
     "hyperparameterMetricTag 'auc' is not reported by digits-mlp; it reports accuracy, loss, train_loss"),
    (("type: DOUBLE", "type: FLOAT"), "params[0] (lr).type = 'FLOAT': must be one of DOUBLE, INTEGER"),
    (("maxTrials: 4", "maxTrials: 0"), "maxTrials = 0: must be at least 1"),
    (("parameterName: lr", "parameterName: epochs"), "parameter epochs = 5e-05 is refused by the job"),
    (("maxParallelTrials: 2", "maxParallelTrials: 2\n  algorithm: GRID_SEARCH"),
     "GRID_SEARCH cannot search DOUBLE parameter lr"),
])
def test_bad_hyperparameters_are_one_line_and_exit_2(tmp_path, capsys, edit, message):
    text = textwrap.dedent(LR_LOG).replace(*edit)
    path = write_yaml(tmp_path, text)
    started = time.time()
    code = main(["tune", "--config", path, "--storage", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert time.time() - started < 10  # before any Ray starts
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


def test_a_missing_hyperparameters_block_and_a_search_that_does_not_fit(tmp_path, capsys):
    path = write_yaml(tmp_path, "workload: digits-mlp\nepochs: 1\n")
    assert main(["tune", "--config", path]) == 2
    assert "no hyperparameters block" in capsys.readouterr().err
    path = write_yaml(tmp_path, LR_LOG.replace("maxParallelTrials: 2", "maxParallelTrials: 50"))
    assert main(["tune", "--config", path, "--workers", "2", "--storage", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "100 workers x 1 CPUs" in err or "maxParallelTrials 50 x 2" in err, err


def study_of(tmp_path, storage: str, yaml_text: str, name: str):
    """The checked Study a YAML describes, as `launcher tune --name NAME --storage STORAGE` builds it."""
    from launcher.spec import JobSpec
    from launcher.tune.study import Study, load

    path = write_yaml(tmp_path, yaml_text, f"{name}.yaml")
    hp, raw = load(path)
    spec = JobSpec.from_mapping(raw, source=path).merged({"name": name, "storage": storage}).validated()
    return Study(hp=hp, spec=spec, source=path)


def test_a_trials_status_is_what_it_did_across_launches(tmp_path, capsys, storage):
    """No Ray: Tune's trials as Tune leaves them after an interrupt, the trials' own runs as
    they left them, and the table an earlier launch wrote (one that labelled two trials that
    had not started yet as stopped early)."""
    from types import SimpleNamespace

    from launcher.storage import Storage
    from launcher.tune import results, watch

    store = Storage.resolve(storage)

    def trial(trial_id, status, summary=None, ran=False):
        if summary or ran:
            store.write_text("{}", "st", f"trial_{trial_id}", "run.json")
        if summary:
            store.write_text(json.dumps({"status": summary, "model": "m"}), "st", f"trial_{trial_id}", "summary.json")
        return SimpleNamespace(trial_id=trial_id, status=status, config={"lr": 0.01}, last_result={})

    earlier = [{"number": 1, "trial": "trial_a", "status": "stopped early", "accuracy": None, "epochs": 0},
               {"number": 2, "trial": "trial_b", "status": "stopped early", "accuracy": None, "epochs": 0},
               {"number": 3, "trial": "trial_c", "status": "succeeded", "accuracy": 0.9666, "epochs": 1},
               {"number": 4, "trial": "trial_d", "status": "stopped early", "accuracy": 0.2, "epochs": 1}]
    trials = [trial("a", "TERMINATED"),                    # asked an actor for, interrupted before it started
              trial("b", "TERMINATED", "succeeded"),       # the earlier "stopped early" was wrong: it ran since
              trial("c", "TERMINATED", "succeeded"),
              trial("d", "TERMINATED", "cancelled"),       # with ASHA off, no stop is ASHA's
              trial("e", "TERMINATED"),                    # started in this launch, interrupted
              trial("f", "PENDING", "cancelled"),          # started in an earlier launch, waiting again
              trial("g", "PENDING"),
              trial("h", "ERROR", "failed")]
    study = study_of(tmp_path, storage, LR_LOG, "st")
    tally = watch.Tally(study, io.StringIO(), None, store)
    tally.recall(earlier)
    tally.started |= {"e"}
    tally.interrupted = True
    statuses = [results.trial_status(study, store, t, tally) for t in trials]
    assert statuses == ["pending", "succeeded", "succeeded", "not finished", "not finished", "not finished",
                        "pending", "failed"]
    # the best so far counts the earlier launch's trials: a worse trial ending now does not replace it
    tally.ended_with("e", 0.117)
    assert tally.counts([]).endswith("best accuracy 0.9666 (trial_c)"), tally.counts([])
    tally.ended_with("g", 0.97)
    assert tally.best == (0.97, "trial_g")

    # with ASHA on, a trial it stopped (it had reported) stays stopped early; one that never started does not
    asha_yaml = LR_LOG.replace("maxTrials: 4", "maxTrials: 4\n      enableTrialEarlyStopping: true")
    asha = study_of(tmp_path, storage, asha_yaml, "st")
    asha_tally = watch.Tally(asha, io.StringIO(), None, store)
    asha_tally.recall(earlier)
    assert asha_tally.stopped == {"d"}
    assert [results.trial_status(asha, store, t, asha_tally) for t in trials[:4]] == \
        ["pending", "succeeded", "succeeded", "stopped early"]

    # the summary, its table, its plot and `launcher runs` take pending trials in
    table = results.rows(study, trials, store, tally)
    assert [r["status"] for r in table].count("pending") == 2
    summary = results.write(study, store, table, started=time.time(), interrupted=True, stopped=None)
    assert summary.trials.pending == 2 and summary.status == RunStatus.CANCELLED
    # summary.json reads back as the same record
    assert TuningSummary.from_json(json.loads(store.read_text("st", "summary.json"))) == summary
    text = results.format_summary(study, summary, table)
    assert "2 pending" in text and "trial_a  pending" in text, text
    store.write_text(json.dumps(study.to_record()), "st", "tuning.json")
    assert main(["runs", "--storage", storage]) == 0
    listed = capsys.readouterr().out
    assert any(line.split()[:2] == ["st", "cancelled"] for line in listed.splitlines()), listed


def read_summary(storage: str, name: str) -> dict:
    with open(os.path.join(storage, name, "summary.json")) as f:
        return json.load(f)


def tracked(mlruns: str, name: str):
    """The tuning run ``name``'s MLflow run in the SQLite store in ``mlruns``, and its children."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{mlruns}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parent = next(r for r in runs if r.info.run_name == name)
    return parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


@pytest.mark.integration
def test_a_search_over_lr_runs_every_trial_and_picks_the_best(ray_local, tmp_path, capsys, storage):
    """Three trials of Optuna's default search, two at a time, each a run of its own; the best
    of them is the summary's. Three tell the best from the worst as four did, with one launch
    less (seeded, Optuna's first samples are the same three lrs either way)."""
    from ray._private.state import actors

    path = write_yaml(tmp_path, LR_LOG.replace("maxTrials: 4", "maxTrials: 3"))
    mlruns = str(tmp_path / "mlruns")
    before = set(actors())
    code = main(["tune", "--config", path, "--storage", storage, "--name", "lr_search", "--json", "--mlflow", mlruns])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    # The trials ran on a local Ray (this process's own): each run left out what only a cluster needs,
    # as a launch on it does (Ray Train's preemption watcher, its autoscaling coordinator, the
    # progress board of a run that cannot restart), while Ray Train's own actors ran.
    started = [a["ActorClassName"] for key, a in actors().items() if key not in before]
    assert started.count("TrainController") == 3, started
    assert not {"PreemptionWatcher", "_AutoscalingCoordinatorActor", "ProgressBoard"} & set(started), started
    result = json.loads(last_line(captured.out))
    rows, summary = result["trials"], result["summary"]
    assert len(rows) == 3 and all(r["status"] == "succeeded" for r in rows), rows
    assert all(r["accuracy"] is not None and r["epochs"] == 1 for r in rows)
    assert len({r["lr"] for r in rows}) == 3 and all(5e-5 <= r["lr"] <= 0.3 for r in rows)
    best = summary["best"]
    assert best["accuracy"] == max(r["accuracy"] for r in rows)
    worst = min(rows, key=lambda r: r["accuracy"])
    assert best["params"]["lr"] != worst["lr"]
    # each trial is a run of its own, under the tuning run's folder, with its model
    assert os.path.isdir(best["model"]) and best["run_dir"].startswith(os.path.join(storage, "lr_search"))
    for r in rows:
        with open(os.path.join(r["run_dir"], "run.json")) as f:
            assert json.load(f)["spec"]["lr"] == pytest.approx(r["lr"])
    with open(os.path.join(storage, "lr_search", "tuning.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(storage, "lr_search", "trials.csv")) as f:
        assert len(f.read().strip().splitlines()) == 4
    assert "started: lr=" in captured.err and "3/3 done" in captured.err
    assert read_summary(storage, "lr_search") == summary
    # `launcher runs` lists the tuning run with its best value
    assert main(["runs", "--storage", storage]) == 0
    listed = capsys.readouterr().out
    assert "lr_search" in listed and f"best accuracy {best['accuracy']:.4f}" in listed
    # MLflow (--mlflow): the tuning run's MLflow run, a child run per trial with its lr and accuracy
    parent, children = tracked(mlruns, "lr_search")
    assert parent.data.metrics["best/accuracy"] == pytest.approx(best["accuracy"])
    assert {float(c.data.params["lr"]): c.data.metrics["accuracy"] for c in children} == \
        pytest.approx({r["lr"]: r["accuracy"] for r in rows})
    assert all(c.info.status == "FINISHED" for c in children) and summary["mlflow"].startswith("run ")


@pytest.mark.integration
def test_a_search_over_xgboost_depth_picks_the_best_booster(ray_local, tmp_path, capsys, storage):
    """A grid over two depths, one trial after the other: the summary's best is the lower loss
    (goal MINIMIZE), and the losses tell stumps from deep trees. A third depth in between
    added a launch and checked nothing more."""
    path = write_yaml(tmp_path, """
        framework: xgboost
        workers: 1
        params:
          num_boost_round: 15
        hyperparameters:
          goal: MINIMIZE
          hyperparameterMetricTag: loss
          maxTrials: 2
          maxParallelTrials: 1
          algorithm: GRID_SEARCH
          params:
            - parameterName: max_depth
              type: DISCRETE
              discreteValues: [1, 6]
    """)
    code = main(["tune", "--config", path, "--storage", storage, "--name", "depth", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    result = json.loads(last_line(captured.out))
    rows, best = result["trials"], result["summary"]["best"]
    assert sorted(r["max_depth"] for r in rows) == [1, 6] and all(r["status"] == "succeeded" for r in rows)
    assert best["loss"] == min(r["loss"] for r in rows)
    by_depth = {r["max_depth"]: r["loss"] for r in rows}
    assert by_depth[1] > by_depth[6], by_depth  # stumps learn the digits worst: the search told them apart
    assert os.path.isfile(os.path.join(best["model"], "model.bst"))


@pytest.mark.integration
def test_asha_stops_a_trial_that_barely_learns(ray_local, tmp_path, capsys, storage):
    """The two good lrs start together; the barely-learning one starts only when a slot frees,
    so both good ones have reported at the first rung (epoch 1) by then, and it falls below
    their median there whatever order they reported in: one such trial is as sure a check as
    two were, with one launch less."""
    path = write_yaml(tmp_path, """
        workload: digits-mlp
        epochs: 3
        workers: 1
        hyperparameters:
          goal: MAXIMIZE
          hyperparameterMetricTag: accuracy
          maxTrials: 3
          maxParallelTrials: 2
          algorithm: GRID_SEARCH
          enableTrialEarlyStopping: true
          params:
            - parameterName: lr
              type: DISCRETE
              discreteValues: [0.1, 0.05, 0.00001]
    """)
    code = main(["tune", "--config", path, "--storage", storage, "--name", "asha", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    rows = json.loads(last_line(captured.out))["trials"]
    shown = [(r["lr"], r["status"], r["epochs"], r["accuracy"]) for r in rows]
    stopped = [r for r in rows if r["status"] == "stopped early"]
    # ASHA keeps the better half at each rung: the barely-learning lr is among those it stops
    # (one of the two good ones may be too, when the other is ahead at a rung; the first of
    # them at each rung goes on, so one good trial always trains all 3 epochs).
    assert any(r["lr"] < 0.001 for r in stopped), shown
    assert all(r["epochs"] < 3 for r in stopped), shown
    assert any(r["status"] == "succeeded" and r["epochs"] == 3 and r["lr"] >= 0.05 for r in rows), shown
    assert "stopped early (ASHA)" in captured.err
    # a stopped trial's workers gave their CPUs back (they once stayed reserved, and the
    # next search waited for them forever)
    assert cpus_free_again(ray_local) == 2, placement_groups(ray_local)
    for r in stopped:  # each stopped run's own summary says why it ended
        with open(os.path.join(r["run_dir"], "summary.json")) as f:
            summary = json.load(f)
        assert summary["status"] == "cancelled" and "stopped by Ray Tune" in summary["error"], summary


def cpus_free_again(ray, within_s: float = 30.0) -> float:
    """The local Ray's free CPUs, once every placement group is given back (or after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free == ray.cluster_resources().get("CPU") or time.monotonic() > deadline:
            return free
        time.sleep(0.5)


def placement_groups(ray) -> list:
    from ray.util import placement_group_table

    return [(pg["state"], pg["bundles"]) for pg in placement_group_table().values() if pg["state"] != "REMOVED"]


@pytest.mark.integration
def test_a_package_is_tuned_on_its_hypertune_metric_and_a_missing_tag_is_one_line(ray_local, tmp_path, capsys,
                                                                                    storage):
    path = write_yaml(tmp_path, """
        workers: 1
        hyperparameters:
          goal: MAXIMIZE
          hyperparameterMetricTag: accuracy
          maxTrials: 2
          maxParallelTrials: 2
          algorithm: GRID_SEARCH
          params:
            - parameterName: lr
              type: DISCRETE
              discreteValues: [0.0001, 0.1]
    """)
    mlruns = str(tmp_path / "mlruns")
    code = main(["tune", "--config", path, "--storage", storage, "--name", "pkg", "--json", "--mlflow", mlruns,
                 "--package", PACKAGE, "--module", "trainer.task", "--", "--epochs", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    result = json.loads(last_line(captured.out))
    rows = {r["lr"]: r for r in result["trials"]}
    assert set(rows) == {0.0001, 0.1} and all(r["status"] == "succeeded" for r in rows.values())
    assert rows[0.1]["accuracy"] > rows[0.0001]["accuracy"]  # the metric is the package's own report
    assert result["summary"]["best"]["params"] == {"lr": 0.1}
    with open(os.path.join(rows[0.1]["run_dir"], "run.json")) as f:
        assert json.load(f)["spec"]["program"]["args"][-2:] == ["--lr", "0.1"]
    _, children = tracked(mlruns, "pkg")  # a program's hypertune reports are its MLflow metrics
    assert sorted(c.data.metrics["accuracy"] for c in children) == pytest.approx(sorted(r["accuracy"] for r in
                                                                                       rows.values()))
    # a tag the package never reports stops the search at its first report
    wrong = path.replace("tune.yaml", "wrong.yaml")
    with open(path) as f, open(wrong, "w") as g:
        g.write(f.read().replace("hyperparameterMetricTag: accuracy", "hyperparameterMetricTag: auc")
                .replace("maxTrials: 2", "maxTrials: 1"))
    code = main(["tune", "--config", wrong, "--storage", storage, "--name", "pkg_wrong",
                 "--package", PACKAGE, "--module", "trainer.task", "--", "--epochs", "1"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "error: hyperparameterMetricTag 'auc' is not among the metrics trial_" in err
    assert "reported: accuracy" in err


@pytest.mark.integration
def test_an_interrupted_search_continues_and_keeps_its_finished_trials(warm_head, tmp_path, capsys):
    """Ctrl-C before the first trial starts, then after it finished; the third launch ends the
    search. Every trial's status is then its own run's, and the best so far counts them all."""
    from launcher.faultpoint import ENV

    storage = str(tmp_path / "runs")
    path = write_yaml(tmp_path, """
        workload: digits-mlp
        epochs: 1
        workers: 1
        hyperparameters:
          goal: MAXIMIZE
          hyperparameterMetricTag: accuracy
          maxTrials: 2
          maxParallelTrials: 1
          algorithm: GRID_SEARCH
          params:
            - parameterName: lr
              type: DISCRETE
              discreteValues: [0.05, 0.01]
    """)
    argv = [sys.executable, "-m", "launcher", "tune", "--config", path, "--storage", storage, "--name", "again"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Ray Tune has made the first trial and asked for its actor: Tune then ends it like a
    # finished one, yet it is only pending (it was once listed as stopped early for good)
    out = interrupt_at(argv, {**env, ENV: "tune-trials:2"}, "fault point tune-trials reached")
    with open(os.path.join(storage, "again", "trials.json")) as f:
        table = json.load(f)
    assert [r["status"] for r in table["trials"]] == ["pending"], table
    assert table["summary"]["trials"]["pending"] == 1 and "1 pending" in out, out
    assert not [d for d in os.listdir(os.path.join(storage, "again")) if d.startswith("trial_")]
    interrupt_at(argv, env, " finished: ")  # the first trial is done: interrupt the search
    first = [d for d in os.listdir(os.path.join(storage, "again")) if d.startswith("trial_")]
    done_before = [d for d in first if read_status(storage, d) == "succeeded"]
    assert done_before, first
    again = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout)
    rows = result["trials"]
    assert len(rows) == 2 and all(r["status"] == "succeeded" for r in rows), rows
    for r in rows:  # each row says what the trial's own run says
        assert r["status"] == read_status(storage, r["trial"]), r
    assert "continuing: finished trials are kept" in again.stderr
    for d in done_before:  # a trial finished before the interrupt was not run again
        with open(os.path.join(storage, "again", d, "launches.jsonl")) as f:
            assert sum(json.loads(line)["event"] == "start" for line in f if line.strip()) == 1
        assert f"{d} started" not in again.stderr
    # the last trial's line names the best of all trials, the one finished before this launch too
    best = result["summary"]["best"]
    ended = [line for line in again.stderr.splitlines() if " finished: " in line]
    assert ended and ended[-1].endswith(f"best accuracy {best['accuracy']:.4g} ({best['trial']})"), ended
    # a search defined differently is refused under the same name
    changed = path.replace("tune.yaml", "changed.yaml")
    with open(path) as f, open(changed, "w") as g:
        g.write(f.read().replace("maxTrials: 2", "maxTrials: 5"))
    assert main(["tune", "--config", changed, "--storage", storage, "--name", "again"]) == 2
    assert "tuning run again was started with a different hyperparameters" in capsys.readouterr().err


def interrupt_at(argv: list[str], env: dict[str, str], text: str) -> str:
    """Launch ``argv`` and send it SIGINT at the first stderr line holding ``text``; its stdout
    once it exited 130 with a cancelled summary."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + err
    assert "cancelled" in out, out
    return out


def read_status(storage: str, trial: str) -> str | None:
    path = os.path.join(storage, "again", trial, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("status")
