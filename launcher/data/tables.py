"""A table as Ray Data datasets, for a Ray Train XGBoost function.

Ray's XGBoost examples take their rows from ``ray.train.get_dataset_shard("train")`` and
``("validation")``: ``XGBoostTrainer(datasets=...)`` gives each worker its share of those
datasets. ``launcher run --workload FILE.py:NAME --data TABLE`` with such a function makes
them from ``--data`` (a CSV or Parquet file, or a folder of them, local or ``gs://``) with
Ray Data, so the function runs as written: a ``--param test_fraction`` share of the rows is
the validation set, the rest the training set.

A row's side is a hash of its values, not a shuffle: no all-to-all shuffle of the table
(``train_test_split(shuffle=True)`` took 2.2 s of every launch on a 442-row table here), a
split that does not depend on how the files are read into blocks, and identical rows kept
on one side. Both datasets are materialized before the workers start.
"""

from __future__ import annotations

import math

import pyarrow.fs

from launcher.errors import UserError
from launcher.storage.store import Storage

SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
DEFAULT_TEST_FRACTION = 0.2
BUCKETS = 1_000_003  # a row is held out when its hash falls in the first test_fraction of these


def table_kind(name: str) -> str | None:
    """"csv" or "parquet" from a file's name, or None."""
    lowered = name.lower()
    return next((kind for suffix, kind in SUFFIXES.items() if lowered.endswith(suffix)), None)


def table_files(data: str) -> tuple[Storage, list[str], str]:
    """The storage ``data`` is on, the table files it names (filesystem paths) and their kind;
    one line (a UserError) for a missing table, a folder without tables or with both kinds."""
    storage = Storage.resolve(data)
    info = storage.fs.get_file_info(storage.root)
    fix = "give a CSV or Parquet file, or a folder of them, with a header row naming the columns"
    if info.type == pyarrow.fs.FileType.NotFound:
        raise UserError(f"--data {data} does not exist", fix)
    if info.type == pyarrow.fs.FileType.Directory:
        found = storage.fs.get_file_info(pyarrow.fs.FileSelector(storage.root, recursive=True))
        files = sorted(f.path for f in found if f.type == pyarrow.fs.FileType.File and table_kind(f.path))
    else:
        files = [storage.root] if table_kind(storage.root) else []
    if not files:
        raise UserError(f"--data {data} holds no CSV or Parquet table (by the files' names)", fix)
    kinds = {table_kind(f) for f in files}
    if len(kinds) > 1:
        raise UserError(f"--data {data} mixes CSV and Parquet files", "keep one format per folder")
    return storage, files, kinds.pop()


def ray_datasets(data: str, test_fraction: object = DEFAULT_TEST_FRACTION) -> dict:
    """``{"train": ..., "validation": ...}``: Ray Data datasets of the table ``data`` names."""
    try:
        test_fraction = float(test_fraction)
    except (TypeError, ValueError):
        test_fraction = math.nan
    if not 0.0 < test_fraction < 1.0:
        raise UserError("--param test_fraction: the validation share must be a number between 0 and 1",
                        "use e.g. --param test_fraction=0.2")
    import ray.data

    storage, files, kind = table_files(data)
    read = ray.data.read_parquet if kind == "parquet" else ray.data.read_csv
    table = read(files, filesystem=storage.fs)
    # Read and split here, before the workers start: once they hold the CPUs, Ray Data's tasks
    # would wait for one forever where the workers take every CPU (a laptop's run: seen hang).
    return {name: table.map_batches(rows_on_side, batch_format="pandas",
                                    fn_kwargs={"fraction": test_fraction, "held_out": held_out}).materialize()
            for name, held_out in (("train", False), ("validation", True))}


def rows_on_side(batch, fraction: float, held_out: bool):
    """The rows of a pandas ``batch`` on one side of the split: held out (``held_out``) or not."""
    import pandas as pd

    buckets = pd.util.hash_pandas_object(batch, index=False).to_numpy() % BUCKETS
    mask = buckets < fraction * BUCKETS
    return batch[mask if held_out else ~mask]


__all__ = ["ray_datasets", "rows_on_side", "table_files"]
