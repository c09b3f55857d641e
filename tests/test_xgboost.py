"""--framework xgboost: the tabular workload on Ray Train's XGBoost backend.

Fast tier: the spec's refusals and defaults, the table reader's one-line errors, the objective
chosen from the labels. Integration: distributed XGBoost on 2 workers learns, a run stopped
after a round checkpoint resumes at that round and ends with the very booster of an
uninterrupted run, and the exported model.bst loads in plain XGBoost.
"""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from launcher.errors import UserError
from launcher.spec import JobSpec
from test_session import stop_after_step_checkpoint
from test_user_workloads import run_cli
from workloads.tabular import Tabular, read_table

TABULAR = Tabular()
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def diabetes_csv(folder) -> str:
    """scikit-learn's bundled diabetes table (442 rows, 10 features, a real-valued target) as a CSV."""
    import sklearn

    base = os.path.join(os.path.dirname(sklearn.__file__), "datasets", "data")
    with gzip.open(os.path.join(base, "diabetes_data_raw.csv.gz"), "rt") as f:
        x = np.loadtxt(f)
    with gzip.open(os.path.join(base, "diabetes_target.csv.gz"), "rt") as f:
        y = np.loadtxt(f)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(str(folder), "diabetes.csv")
    names = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]
    with open(path, "w", encoding="utf-8") as f:
        f.write(",".join(names + ["progression"]) + "\n")
        for row, target in zip(x, y):
            f.write(",".join(f"{v:g}" for v in row) + f",{target:g}\n")
    return path


# -- the spec ---------------------------------------------------------------------------------------

def test_xgboost_trains_the_tabular_workload_with_round_checkpoints_by_default():
    spec = JobSpec(framework="xgboost").validated()
    # No cadence fixed: the boosting loop checkpoints every 10 rounds, or further apart by cost.
    assert (spec.workload, spec.epochs, spec.checkpoint_every_steps, spec.preemption_check_steps) == \
        ("tabular", 1, None, 1)
    assert spec.params["num_boost_round"] == 50
    given = JobSpec(framework="xgboost", checkpoint_every_steps=5, preemption_check_steps=3).validated()
    assert (given.checkpoint_every_steps, given.preemption_check_steps) == (5, 3)
    assert given.validated() == given  # a validated spec validates to itself


def test_default_round_checkpoints_are_spaced_by_their_cost():
    from launcher.worker.xgb_loop import checkpoint_spacing

    assert checkpoint_spacing(0.005, 0.05) == 10       # cheap against the rounds: every 10
    assert checkpoint_spacing(0.04, 0.028) == 72       # 40 ms on 28 ms rounds: 2 % of the rounds' time
    assert checkpoint_spacing(0.0, 0.0) == 10          # nothing measured yet


def test_a_workers_xgboost_error_is_told_by_its_message_not_its_native_stack():
    from ray.train import WorkerGroupError

    from launcher.driver.trainer import describe_failure, error_line

    class XGBoostError(ValueError):
        pass

    text = ("[08:21:29] /__w/xgboost/xgboost/src/collective/result.cc:83: [comm.cc:220|08:21:29]:\n"
            "- Failed to connect to the peer 1: connection refused\nStack trace:\n"
            "  [bt] (0) /venv/lib/libxgboost.so(+0x2a8f3c) [0x7f00]\n"
            "  [bt] (8) /lib/x86_64-linux-gnu/libffi.so.8(ffi_call+0xcd) [0x7fd4]\n")
    line = describe_failure(WorkerGroupError("x", {0: XGBoostError(text)}))
    assert line == "rank 0: XGBoostError: - Failed to connect to the peer 1: connection refused", line
    # the progress line, from the error's text as the worker sent it
    assert error_line(f"XGBoostError: {text}") == (
        "XGBoostError: [08:21:29] /__w/xgboost/xgboost/src/collective/result.cc:83: [comm.cc:220|08:21:29]: "
        "- Failed to connect to the peer 1: connection refused")
    assert error_line("ValueError: bad --param\nmore") == "ValueError: bad --param"


@pytest.mark.parametrize("changes, needle", [
    ({"epochs": 3}, "--param num_boost_round"),
    ({"lr": 0.1}, "--param eta"),
    ({"strategy": "fsdp"}, "not a network"),
    ({"precision": "bf16"}, "not a network"),
    ({"min_workers": 1}, "fixed group"),
    ({"backend": "horovod"}, "does not support xgboost"),
    ({"params": {"tree_method": "exact"}}, "no exact method"),
    ({"params": {"depth": 3}}, "has no parameter 'depth'"),
])
def test_what_a_boosting_run_cannot_take_is_refused(changes, needle):
    with pytest.raises(UserError, match=needle):
        JobSpec(framework="xgboost", **changes).validated()


def test_the_tabular_workload_is_refused_for_torch():
    with pytest.raises(UserError, match="use --framework xgboost"):
        JobSpec(workload="tabular").validated()


# -- the table ----------------------------------------------------------------------------------------

def test_without_data_the_table_is_the_digits_and_splits_cover_every_row():
    params = TABULAR.resolve_params({})
    x, y, names = read_table(None, "label")
    assert x.shape == (1797, 64) and len(names) == 64 and set(np.unique(y)) == set(range(10))
    test = [TABULAR.load(None, "test", r, 3, params) for r in range(3)]
    train = [TABULAR.load(None, "train", r, 3, params) for r in range(3)]
    assert sum(len(s) for s in test) == 359 and sum(len(s) for s in train) == 1797 - 359
    rows = {tuple(row) for s in train + test for row in np.c_[s.x, s.y]}
    assert len(rows) == len({tuple(row) for row in np.c_[x, y]})  # every row once
    assert TABULAR.booster_params(y, params, 7)["objective"] == "multi:softprob"
    assert TABULAR.booster_params(y, params, 7)["num_class"] == 10


def test_csv_and_a_parquet_folder_read_alike(tmp_path):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    path = diabetes_csv(tmp_path)
    x, y, names = read_table(path, "progression")
    assert x.shape == (442, 10) and names[:3] == ["age", "sex", "bmi"] and y.dtype.kind in "if"
    folder = tmp_path / "parquet"
    folder.mkdir()
    table = pacsv.read_csv(path)
    pq.write_table(table.slice(0, 200), str(folder / "part-0.parquet"))
    pq.write_table(table.slice(200), str(folder / "part-1.parquet"))
    x2, y2, names2 = read_table(str(folder), "progression")
    assert names2 == names and np.array_equal(x2, x) and np.array_equal(y2, y)
    params = TABULAR.resolve_params({"label": "progression"})
    assert TABULAR.booster_params(y, params, 0)["objective"] == "reg:squarederror"
    binary = (y > np.median(y)).astype(np.int64)
    assert TABULAR.booster_params(binary, params, 0)["objective"] == "binary:logistic"


@pytest.mark.parametrize("content, label, needle", [
    ("a,b,target\n1,2,0\n3,4,1\n", "label", "has no label column 'label' (its columns: a, b, target)"),
    ("a,colour,label\n1,red,0\n3,blue,1\n", "label", "feature column 'colour' is string, not numeric (e.g. 'red')"),
    ("a,label\n1,0\n2,\n", "label", "the label column 'label' has 1 empty value"),
])
def test_a_bad_table_is_one_line_before_any_worker_starts(capsys, tmp_path, content, label, needle):
    path = tmp_path / "table.csv"
    path.write_text(content)
    code, _, err = run_cli(capsys, "run", "--framework", "xgboost", "--data", str(path), "--param",
                           f"label={label}", "--storage", str(tmp_path / "runs"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "runs" / "ray").exists()


def test_a_missing_data_file_and_a_folder_without_tables_are_one_line(capsys, tmp_path):
    for data, needle in ((tmp_path / "nothing.csv", "does not exist"), (tmp_path, "holds no")):
        code, _, err = run_cli(capsys, "run", "--framework", "xgboost", "--data", str(data),
                               "--storage", str(tmp_path / "runs"))
        assert code == 2 and needle in err and err.count("\n") == 1, err


def test_workloads_lists_tabular_with_its_xgboost_params(capsys):
    code, out, _ = run_cli(capsys, "workloads", "--json")
    assert code == 0
    tabular = next(w for w in json.loads(out) if w["name"] == "tabular")
    assert tabular["frameworks"] == ["xgboost"] and {"num_boost_round", "eta", "max_depth"} <= set(tabular["params"])


# -- training (a real local Ray, real processes) ------------------------------------------------------

@pytest.mark.integration
def test_xgboost_on_2_workers_learns_resumes_at_the_round_and_exports_a_booster(ray_local, warm_head, capsys,
                                                                                tmp_path):
    """The uninterrupted run and the resumed one run in this process on the shared local Ray; the
    run stopped with Ctrl-C after its first round checkpoint is a `launcher run` process (on the
    warm head), which the test can signal. The resumed booster is the uninterrupted one, bitwise."""
    import xgboost as xgb

    storage = str(tmp_path / "runs")
    data = diabetes_csv(tmp_path / "data")
    args = ["--framework", "xgboost", "--data", data, "--param", "label=progression", "--param",
            "num_boost_round=30", "--param", "max_depth=3", "--param", "eta=0.1", "--checkpoint-every-steps",
            "8", "--storage", storage]

    def run(name: str) -> dict:
        code, out, err = run_cli(capsys, "run", "--json", *args, "--name", name)
        assert code == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    whole = run("whole")
    assert whole["status"] == "succeeded" and whole["steps_completed"] == 30, whole
    m = whole["metrics"]
    # It learned: the target's spread is about 77; predicting the mean scores an rmse of that.
    assert m["test_rmse"] < 65 and m["train_loss"] < 50, m

    stopped = stop_after_step_checkpoint(args + ["--name", "stopped"], tmp_path)
    assert stopped["status"] == "cancelled" and stopped["steps_completed"] < 30, stopped
    resumed = run("stopped")
    assert resumed["resumed_from"] == {"epoch": 0, "step": 8}, resumed
    assert resumed["weights_sha256"] == whole["weights_sha256"]  # the very booster, bitwise

    model = os.path.join(storage, "whole", "model")
    described = json.load(open(os.path.join(model, "model.json")))
    assert described["objective"] == "reg:squarederror" and described["features"][:2] == ["age", "sex"]
    booster = xgb.Booster(model_file=os.path.join(model, "model.bst"))
    assert booster.num_boosted_rounds() == 30
    x, _, names = read_table(data, "progression")
    again = xgb.Booster(model_file=os.path.join(storage, "stopped", "model", "booster.json"))
    rows = xgb.DMatrix(x[:20], feature_names=names)
    assert np.array_equal(booster.predict(rows), again.predict(rows))
    # predict and serve load it and answer what the booster predicts (a regression: its numbers)
    from launcher.predict.model import Model, locate

    served = Model(locate(os.path.join(storage, "whole")))
    np.testing.assert_allclose(served.predict(x[:20].tolist()), booster.predict(rows), rtol=1e-6)


@pytest.mark.integration
def test_a_ray_train_xgboost_function_runs_as_written_and_goes_on_from_its_checkpoint(ray_local, capsys, tmp_path):
    """Ray's XGBoostTrainer example shape: get_dataset_shard("train"/"validation") made from --data by
    Ray Data, RayTrainReportCallback checkpoints; a relaunch asking for more rounds goes on from the
    last checkpoint, through to the rounds asked for. Its last booster is exported as
    <run>/model/, which `launcher predict --run` takes.

    Each launch costs more than a built-in XGBoost run's: the driver makes both datasets with Ray
    Data (a read and a split each, materialized before the workers start), Ray Train's data
    config starts a split coordinator (a process importing Ray Data) per dataset, each worker
    materializes its shards, and the callback reports every round. A checkpoint every 4 rounds
    (not 2) keeps a resume from the checkpoint of round 4 with half the checkpoints. The model
    `launcher predict --run` names is loaded here (locate, Model: what its replicas load) and
    compared with the booster; predict's Ray Data pipeline over a CSV is
    test_predict.py's test_a_regression_run_predicts_its_numbers_as_the_exported_program_does."""
    import xgboost as xgb
    from ray.train import Checkpoint
    from ray.train.xgboost import RayTrainReportCallback

    storage = str(tmp_path / "runs")
    args = ["run", "--workload", os.path.join(EXAMPLES, "xgboost_ray_train.py:train_fn_per_worker"), "--data",
            diabetes_csv(tmp_path / "data"), "--param", "label=progression", "--param", "max_depth=3", "--param",
            "eta=0.1", "--param", "checkpoint_every=4", "--workers", "2", "--storage", storage, "--json"]

    def run(name: str, rounds: int) -> dict:
        code, out, err = run_cli(capsys, *args, "--param", f"num_boost_round={rounds}", "--name", name)
        summary = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and summary["status"] == "succeeded" and summary["framework"] == "xgboost", err[-2000:]
        return summary

    # (That a relaunch of a Ray Train function ends where an uninterrupted run ends is checked bitwise
    # for torch in test_session.py; here, that XGBoost's callback checkpoint is what it goes on from.)
    assert run("part", 4)["steps_completed"] >= 4
    resumed = run("part", 8)
    assert resumed["steps_completed"] < 8  # only the rounds the checkpoint lacked
    assert resumed["metrics"]["validation-rmse"] < 65, resumed["metrics"]  # it learned: the target's spread is ~77
    booster = RayTrainReportCallback.get_model(Checkpoint(resumed["checkpoint"]))
    assert booster.num_boosted_rounds() == 8
    # Its last checkpoint's booster is the run's model, exported as the built-in workload's (issue 65
    # item 4: there was no <run>/model/), and the model `launcher predict --run` loads answers what
    # the booster predicts.
    from launcher.predict.model import Model, locate

    assert resumed["model"] == os.path.join(storage, "part", "model"), resumed
    described = json.load(open(os.path.join(resumed["model"], "model.json")))
    assert described["framework"] == "xgboost" and described["rounds"] == 8 and described["features"][:2] == \
        ["age", "sex"] and described["label"] == "progression", described
    x, _, names = read_table(os.path.join(tmp_path, "data", "diabetes.csv"), "progression")
    served = Model(locate(run="part", storage=storage))
    np.testing.assert_allclose(served.predict(x[:30].tolist()),
                               booster.predict(xgb.DMatrix(x[:30], feature_names=names)), rtol=1e-5)


def test_a_tables_validation_rows_are_chosen_by_their_values():
    import pandas as pd

    from launcher.data.tables import ray_datasets, rows_on_side

    rng = np.random.default_rng(0)
    table = pd.DataFrame({"a": rng.normal(size=2000), "b": rng.integers(0, 5, 2000), "y": rng.normal(size=2000)})
    held, kept = rows_on_side(table, 0.2, True), rows_on_side(table, 0.2, False)
    assert len(held) + len(kept) == len(table) and not set(held.index) & set(kept.index)
    assert 0.17 < len(held) / len(table) < 0.23
    # the same rows in other blocks, another order: the same sides
    parts = [rows_on_side(table.iloc[i:i + 300][::-1], 0.2, True) for i in range(0, 2000, 300)]
    assert sorted(pd.concat(parts).index) == sorted(held.index)
    for bad in ("abc", 0, 1.5):  # refused in one line before Ray Data is touched
        with pytest.raises(UserError, match="test_fraction: the validation share must be a number between 0 and 1"):
            ray_datasets("unused.csv", bad)


def test_a_session_function_is_refused_for_xgboost_in_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--framework", "xgboost", "--workload",
                           os.path.join(os.path.dirname(EXAMPLES), "examples", "char_lm.py:train"),
                           "--storage", str(tmp_path / "runs"))
    assert code == 2 and "train(session) is a training function for torch or TensorFlow" in err, err


def test_a_booster_export_without_its_model_bst_is_one_line(capsys, tmp_path):
    model = tmp_path / "runs" / "boosted" / "model"
    model.mkdir(parents=True)
    (model / "model.json").write_text(json.dumps({"workload": "tabular", "framework": "xgboost",
                                                  "files": {"model.bst": "", "booster.json": ""}}))
    (model / "booster.json").write_text("{}")
    (tmp_path / "in.npy").write_bytes(b"")
    code, _, err = run_cli(capsys, "predict", "--model", str(tmp_path / "runs" / "boosted"), "--input",
                           str(tmp_path / "in.npy"), "--output", str(tmp_path / "out"))
    assert code == 2 and "holds no model predict and serve can load (booster.json, model.json)" in err, err
    assert err.count("\n") == 1, err


# -- scikit-learn and XGBoost trainer packages --------------------------------------------------------

@pytest.mark.parametrize("folder, expected", [("sklearn_package", "sklearn"), ("xgboost_package", "xgboost"),
                                              ("trainer_package", None)])
def test_a_package_that_trains_on_its_own_is_told_from_its_imports(folder, expected):
    from launcher.driver.program import from_package, single_process_framework

    program = from_package(os.path.join(EXAMPLES, folder), "trainer.task")
    assert single_process_framework(program) == expected, sorted(program.libraries)


def test_framework_sklearn_is_for_programs_and_not_for_horovod(capsys, tmp_path):
    with pytest.raises(UserError, match="labels a scikit-learn trainer package or script"):
        JobSpec(framework="sklearn").validated()
    code, _, err = run_cli(capsys, "run", "--package", os.path.join(EXAMPLES, "sklearn_package"), "--module",
                           "trainer.task", "--backend", "horovod", "--storage", str(tmp_path / "runs"))
    assert code == 2 and "with a scikit-learn program: scikit-learn trains in one process" in err, err


@pytest.mark.integration
def test_sklearn_and_xgboost_packages_run_as_what_they_are_with_their_models_where_vertex_puts_them(
        ray_local, capsys, tmp_path):
    """Both runs in this process on the shared local Ray (what they say, their summaries and
    models are the point, not a process of their own)."""
    import joblib
    import xgboost as xgb
    from sklearn.datasets import load_digits

    storage = str(tmp_path / "runs")
    code, _, err = run_cli(capsys, "run", "--package", os.path.join(EXAMPLES, "sklearn_package"), "--module",
                           "trainer.task", "--storage", storage, "--name", "sk")
    assert code == 0, err[-3000:]
    assert "imports scikit-learn and no library that trains across processes: it runs once" in err
    summary = json.load(open(os.path.join(storage, "sk", "summary.json")))
    assert (summary["framework"], summary["workers"], summary["status"]) == ("sklearn", 1, "succeeded"), summary
    x, y = load_digits(return_X_y=True)
    model = joblib.load(os.path.join(storage, "sk", "model", "model.joblib"))  # AIP_MODEL_DIR
    assert model.score(x, y) > 0.9
    from launcher.predict.model import Model, locate

    assert Model(locate(os.path.join(storage, "sk"))).predict(x[:50].tolist()) == model.predict(x[:50]).tolist()

    code, _, err = run_cli(capsys, "run", "--package", os.path.join(EXAMPLES, "xgboost_package"), "--module",
                           "trainer.task", "--workers", "2", "--storage", storage, "--name", "xg", "--",
                           "--rounds", "10")
    assert code == 0, err[-3000:]
    assert "imports XGBoost and no library that trains across processes: each of the 2 workers runs it" in err
    summary = json.load(open(os.path.join(storage, "xg", "summary.json")))
    assert (summary["framework"], summary["workers"]) == ("xgboost", 2), summary
    booster = xgb.Booster(model_file=os.path.join(storage, "xg", "model", "model.bst"))
    assert booster.num_boosted_rounds() == 10
    served = Model(locate(os.path.join(storage, "xg")))
    np.testing.assert_allclose(served.predict(x[:50].tolist()), booster.predict(xgb.DMatrix(x[:50])), rtol=1e-6)


# -- bench scaling --framework xgboost ------------------------------------------------------------------

def test_bench_xgboost_refuses_a_table_without_y_in_one_line(capsys, tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b\n1,2\n3,4\n")
    code, _, err = run_cli(capsys, "bench", "scaling", "--framework", "xgboost", "--data", str(path),
                           "--out", str(tmp_path / "out"))
    assert code == 2 and "has no label column 'y'" in err and err.count("\n") == 1, err


@pytest.mark.integration
def test_bench_xgboost_writes_launcher_and_alone_rows(warm_head, capsys, tmp_path):
    """The bench's `launcher run` process goes to the session's warm head (as test_bench_sharding's
    and test_bench_session's do), not to a local Ray of its own started and stopped for it."""
    out = tmp_path / "out"
    code, printed, err = run_cli(capsys, "bench", "scaling", "--framework", "xgboost", "--workers", "2",
                                 "--repeats", "1", "--rows", "4000", "--features", "8", "--rounds", "12",
                                 "--out", str(out))
    assert code == 0, err[-3000:]
    rows = json.load(open(out / "xgboost-scaling.json"))["summary"]
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"launcher", "xgboost-alone"} and all(r["samples_per_s"] > 0 for r in rows), rows
    assert by_variant["launcher"]["vs_bare"] > 0
    assert "launcher/bare" in printed and (out / "xgboost-scaling.png").read_bytes()[:4] == b"\x89PNG"
