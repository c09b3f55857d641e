"""``launcher bench scaling --framework xgboost``: rows/s per worker count, against XGBoost alone.

Each measurement is a whole run on the same table: ``launcher run --framework xgboost --json``
(the tabular workload on Ray Train's XGBoost backend, with its round checkpoints and notice
checks), and right after it the same rows, parameters and rounds under XGBoost's own tracker
with no Ray (:mod:`benchmarks.xgb_bare`). Both count rows trained per second over the time
``xgboost.train`` took (rows x rounds). Pairs alternate, so drift in the machine hits both;
``vs_bare`` is the median launcher/bare ratio over the repeats, and efficiency is rows/s at N
workers over N times rows/s at 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

from benchmarks import results
from benchmarks.function_scaling import format_rows, plot, summarize
from benchmarks.raywork import failure_reason, last_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARE = "xgboost-alone"


def make_table(folder: str, rows: int, features: int, seed: int = 0) -> str:
    """A regression table (Parquet): ``features`` Gaussian columns, a non-linear target ``y``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * np.abs(x[:, 3]) + 0.1 * rng.standard_normal(rows)
    table = pa.table({**{f"f{i}": x[:, i] for i in range(features)}, "y": y.astype(np.float32)})
    path = os.path.join(folder, f"table_{rows}x{features}.parquet")
    pq.write_table(table, path)
    return path


def run(data: str, worker_counts: list[int], repeats: int, rounds: int, threads: int, params: list[str],
        note: Callable[[str], None]) -> list[dict]:
    """Every worker count ``repeats`` times, launcher then XGBoost alone; one dict per run."""
    measured = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("RAY_ADDRESS", None)
    extra = [a for item in params for a in ("--param", item)]
    with tempfile.TemporaryDirectory(prefix="launcher-xgbscaling-") as tmp:
        for n in worker_counts:
            for i in range(repeats):
                for variant in ("launcher", BARE):
                    if variant == "launcher":
                        cmd = [sys.executable, "-m", "launcher", "run", "--json", "--framework", "xgboost",
                               "--data", data, "--param", "label=y", "--param", f"num_boost_round={rounds}",
                               *extra, "--workers", str(n), "--cpus-per-worker", str(threads),
                               "--storage", os.path.join(tmp, "runs"), "--name", f"xgb_{n}_{i}"]
                    else:
                        cmd = [sys.executable, "-m", "benchmarks.xgb_bare", "--data", data, "--label", "y",
                               "--workers", str(n), "--rounds", str(rounds), "--threads", str(threads), *extra]
                    start = time.perf_counter()
                    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
                    wall = time.perf_counter() - start
                    m = {"backend": "xgboost", "workers": n, "repeat": i, "variant": variant, "wall_s": round(wall, 2)}
                    if res.returncode != 0:
                        m["failed"] = failure_reason(res.stderr, res.returncode, 200)
                        note(f"{n} worker(s), {variant}: FAILED: {m['failed']}")
                    else:
                        out = last_json(res.stdout)
                        rate = out.get("samples_per_s") or (out.get("metrics") or {}).get("samples_per_s")
                        m["samples_per_s"] = float(rate or 0.0)
                        note(f"{n} worker(s), repeat {i + 1}/{repeats}, {variant:<13} {m['samples_per_s']:,.0f} "
                             f"rows/s (wall {wall:.1f}s)")
                    measured.append(m)
    return measured


def write_results(rows: list[dict], measured: list[dict], info: dict, setup: dict, out_dir: str) -> list[str]:
    """xgboost-scaling.json, .csv and .png (rows/s and efficiency against workers; launcher/alone)."""
    fig = plot(rows, "rows/s (median)", f"XGBoost, {setup['rows']:,} rows x {setup['features']} features",
               "XGBoost alone")
    payload = {"machine": info, "setup": setup, "measurements": measured,
               "definitions": {"samples_per_s": "rows x rounds over the time xgboost.train took (rank 0)",
                               "vs_bare": "median over repeats of launcher/XGBoost alone, each pair back to back",
                               "efficiency": "rows/s at N workers / (N x rows/s at 1 worker), per variant"}}
    return results.write(out_dir, "xgboost-scaling", rows, payload, fig)


__all__ = ["BARE", "format_rows", "make_table", "run", "summarize", "write_results"]
