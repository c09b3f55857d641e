"""tabular: a table of numeric features and a label, trained with gradient-boosted trees (XGBoost).

``--data`` is a CSV or Parquet file, or a folder of them (read in name order), local or
``gs://``; one column is the label (``--param label=COLUMN``), every other column a numeric
feature. Without ``--data`` the table is scikit-learn's bundled digits (64 pixel columns and
the digit), so the workload runs with no files at all. A fixed share of the rows
(``test_fraction``, drawn with a fixed seed) is held out for evaluation; each worker trains
on every ``world``-th remaining row, as distributed XGBoost splits data by rows.

XGBoost's own parameters are ``--param``s too (``max_depth``, ``eta``, ``objective``, ...);
``num_boost_round`` is the number of rounds, and a round is a training step.
"""

from __future__ import annotations

import glob
import os
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from workloads.base import DataError, Defaults, Param, Split, Workload, check_split_name, shard_indices

SPLIT_SEED = 0  # the held-out rows never depend on the run's seed
SUFFIXES = (".csv", ".csv.gz", ".parquet", ".pq")
DATA_HELP = ("a CSV or Parquet file (or a folder of them) with a header, one label column "
             "(--param label=COLUMN) and numeric features")
# objective "auto": chosen from the labels (see objective_for)
OBJECTIVES = ("auto", "reg:squarederror", "reg:absoluteerror", "reg:logistic", "binary:logistic",
              "multi:softprob", "multi:softmax", "count:poisson", "reg:tweedie", "rank:pairwise")


def _fraction(value: str) -> float:
    f = float(value)
    if not 0.0 < f < 1.0:
        raise ValueError("must be between 0 and 1 (exclusive)")
    return f


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError("must be a positive integer")
    return n


def _non_negative(value: str) -> float:
    f = float(value)
    if f < 0:
        raise ValueError("must be 0 or more")
    return f


def _unit(value: str) -> float:
    f = float(value)
    if not 0.0 < f <= 1.0:
        raise ValueError("must be in (0, 1]")
    return f


def _objective(value: str) -> str:
    if value not in OBJECTIVES:
        raise ValueError(f"unknown objective (valid: {', '.join(OBJECTIVES)})")
    return value


def _tree_method(value: str) -> str:
    if value not in ("hist", "approx"):
        raise ValueError("valid: hist, approx (distributed XGBoost has no exact method)")
    return value


# The parameters that go to xgboost.train as they are (the rest are the workload's own).
BOOSTER_PARAMS = ("max_depth", "eta", "subsample", "colsample_bytree", "min_child_weight", "lambda", "alpha",
                  "gamma", "tree_method", "max_bin", "eval_metric")


class Tabular(Workload):
    def __init__(self) -> None:
        super().__init__(
            name="tabular",
            description="gradient-boosted trees (XGBoost) on a CSV/Parquet table; without --data, "
                        "scikit-learn's digits as 64 pixel columns",
            defaults=Defaults(epochs=1, batch_size=1, lr=0.3),
            frameworks=("xgboost",),
            data_help=DATA_HELP + "; without it, scikit-learn's digits",
            data_optional=True,
            params=(
                Param("label", str, "label", "the label column"),
                Param("test_fraction", _fraction, 0.2, "share of the rows held out for evaluation"),
                Param("num_boost_round", _positive_int, 50, "boosting rounds (a round is a step)"),
                Param("objective", _objective, "auto",
                      "XGBoost's objective; auto: binary:logistic for labels 0 and 1, multi:softprob "
                      "for labels 0..K-1 (each present), reg:squarederror for any other numbers"),
                Param("max_depth", _positive_int, 6, "XGBoost: maximum tree depth"),
                Param("eta", _non_negative, 0.3, "XGBoost: learning rate"),
                Param("subsample", _unit, 1.0, "XGBoost: share of rows sampled per tree (below 1 the "
                                               "resumed run is no longer bitwise the same)"),
                Param("colsample_bytree", _unit, 1.0, "XGBoost: share of columns sampled per tree"),
                Param("min_child_weight", _non_negative, 1.0, "XGBoost: minimum hessian in a leaf"),
                Param("lambda", _non_negative, 1.0, "XGBoost: L2 regularisation"),
                Param("alpha", _non_negative, 0.0, "XGBoost: L1 regularisation"),
                Param("gamma", _non_negative, 0.0, "XGBoost: minimum loss reduction to split"),
                Param("tree_method", _tree_method, "hist", "XGBoost: hist or approx"),
                Param("max_bin", _positive_int, 256, "XGBoost: histogram bins per feature"),
                Param("eval_metric", str, "", "XGBoost: evaluation metric (empty: the objective's default)"),
            ),
        )

    # -- data -----------------------------------------------------------------------------------
    def check_data(self, data: str | None, params: Mapping[str, Any]) -> None:
        """The files exist, the label column is there and every other column is numeric: read on
        the driver before any worker starts (the whole table: boosting reads it all anyway)."""
        table = read_table(data, params["label"])
        if len(table[1]) < 2:
            raise DataError(f"--data {data}: {len(table[1])} row(s); boosting needs at least 2 "
                            "(some are held out for evaluation)")

    def samples(self, data: str | None, split: str, params: Mapping[str, Any]) -> int | None:
        x, _, _ = read_table(data, params["label"])
        n_test = held_out(len(x), params["test_fraction"])
        return len(x) - n_test if split == "train" else n_test

    def load(self, data: str | None, split: str, rank: int, world_size: int,
             params: Mapping[str, Any]) -> Split:
        """This rank's rows of ``split``: every ``world_size``-th row of the split (all rows covered)."""
        check_split_name(split)
        x, y, _ = read_table(data, params["label"])
        order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
        n_test = held_out(len(y), params["test_fraction"])
        rows = order[:n_test] if split == "test" else order[n_test:]
        rows = rows[shard_indices(len(rows), rank, world_size, equal=False)]
        return Split(x[rows], y[rows])

    def feature_names(self, data: str | None, params: Mapping[str, Any]) -> list[str]:
        return read_table(data, params["label"])[2]

    # -- what the model is ------------------------------------------------------------------------
    def input_shape(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        raise NotImplementedError("a table's width is known from its data: see feature_names")

    def objective_for(self, y: np.ndarray, params: Mapping[str, Any]) -> tuple[str, int | None]:
        """(objective, num_class or None) for labels ``y`` (the whole training split's)."""
        objective = params["objective"]
        integral = y.dtype.kind in "iub" or bool(np.all(np.equal(np.mod(y, 1), 0)))
        values = np.unique(y) if len(y) else np.array([])
        classes = int(values.max()) + 1 if integral and len(values) and values.min() >= 0 else 0
        if objective == "auto":
            # Classes are the labels 0..K-1, each present; any other numbers are a target.
            labelled = integral and 2 <= len(values) <= 1000 and np.array_equal(values, np.arange(len(values)))
            objective = ("binary:logistic" if len(values) == 2 else "multi:softprob") if labelled \
                else "reg:squarederror"
        if objective.startswith("multi:"):
            if not classes:
                raise DataError(f"objective {objective} needs labels 0..K-1, got values from {y.min()} "
                                f"to {y.max()}")
            return objective, classes
        if objective == "binary:logistic" and not set(np.unique(y)) <= {0, 1}:
            raise DataError("objective binary:logistic needs labels 0 and 1")
        return objective, None

    def booster_params(self, y: np.ndarray, params: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """What ``xgboost.train`` takes for this run (the labels decide the objective)."""
        objective, num_class = self.objective_for(y, params)
        out = {k: params[k] for k in BOOSTER_PARAMS if params[k] != ""}
        out.update(objective=objective, seed=seed, nthread=0)
        if num_class:
            out["num_class"] = num_class
        return out


def held_out(n: int, fraction: float) -> int:
    """Rows held out for evaluation: at least one, and at least one left to train on."""
    return min(max(1, int(round(n * fraction))), n - 1) if n > 1 else 0


def table_files(data: str) -> list[str]:
    """The data files ``data`` names (a file, or a folder's CSV/Parquet files in name order)."""
    if os.path.isdir(data):
        found = sorted(f for f in glob.glob(os.path.join(data, "**", "*"), recursive=True)
                       if f.endswith(SUFFIXES) and os.path.isfile(f))
        if not found:
            raise DataError(f"--data {data}: the folder holds no {', '.join(SUFFIXES)} files; expected {DATA_HELP}")
        kinds = {_kind(f) for f in found}
        if len(kinds) > 1:
            raise DataError(f"--data {data}: the folder mixes CSV and Parquet files; keep one format per folder")
        return found
    if not os.path.exists(data):
        raise DataError(f"--data {data} does not exist: expected {DATA_HELP}")
    if not data.endswith(SUFFIXES):
        raise DataError(f"--data {data}: not a CSV or Parquet file (by its name); expected {DATA_HELP}")
    return [data]


def _kind(path: str) -> str:
    return "parquet" if path.endswith((".parquet", ".pq")) else "csv"


@lru_cache(maxsize=4)
def read_table(data: str | None, label: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(features as float32, labels, feature names) of the whole table. DataError, in one line,
    for a missing label column or a column that is not numeric."""
    if data is None:
        from workloads.digits import _raw_digits

        pixels, digits = _raw_digits()
        names = [f"pixel_{i}" for i in range(pixels.shape[1])]
        if label != "label":
            raise DataError(f"--param label={label}: the built-in digits table's label column is 'label'; "
                            "drop the param, or give --data")
        return pixels.astype(np.float32), digits.astype(np.int64), names
    import pyarrow as pa

    files = table_files(data)
    tables = []
    for path in files:
        try:
            if _kind(path) == "parquet":
                import pyarrow.parquet as pq

                tables.append(pq.read_table(path))
            else:
                import pyarrow.csv as pacsv

                tables.append(pacsv.read_csv(path))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"--data {path}: cannot be read as {_kind(path).upper()} "
                            f"({str(exc).splitlines()[0]})") from None
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DataError(f"--data {data}: its files disagree on their columns ({str(exc).splitlines()[0]})") from None
    if label not in table.column_names:
        raise DataError(f"--data {data} has no label column {label!r} (its columns: "
                        f"{', '.join(table.column_names[:12])}{', ...' if table.num_columns > 12 else ''}); "
                        "name the label with --param label=COLUMN")
    names = [c for c in table.column_names if c != label]
    if not names:
        raise DataError(f"--data {data}: only the label column {label!r}, no features")
    columns = []
    for name in names + [label]:
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_boolean(column.type) or pa.types.is_null(column.type)):
            sample = next((v for v in column.to_pylist() if v is not None), None)
            what = "the label" if name == label else "feature"
            raise DataError(f"--data {data}: {what} column {name!r} is {column.type}, not numeric (e.g. "
                            f"{sample!r}); encode it as numbers or drop the column")
        columns.append(column.to_numpy(zero_copy_only=False).astype(np.float64))
    x = np.stack(columns[:-1], axis=1).astype(np.float32)
    y = columns[-1]
    if np.isnan(y).any():
        raise DataError(f"--data {data}: the label column {label!r} has {int(np.isnan(y).sum())} empty value(s); "
                        "drop those rows")
    if np.all(np.mod(y, 1) == 0):
        y = y.astype(np.int64)
    return x, y, names
