"""Distributed XGBoost alone: its own tracker and N processes, no Ray, no launcher.

``python -m benchmarks.xgb_bare --data TABLE --workers N`` trains what ``launcher run
--framework xgboost`` trains (the tabular workload's rows for each rank, the same booster
parameters and rounds, scored on the train and test rows every round as the launcher's loop
scores them) the way XGBoost's documentation runs it by hand: a ``RabitTracker``
here, and each of N processes inside ``xgboost.collective.CommunicatorContext`` with the
tracker's arguments. It prints one JSON line: rows trained per second over the time
``xgboost.train`` took on rank 0 (rows x rounds, summed over the ranks), as the launcher's
run reports ``samples_per_s``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

import numpy as np

import workloads


def _params(args: argparse.Namespace) -> dict:
    given = {"label": args.label, "num_boost_round": str(args.rounds)}
    for item in args.param:
        key, _, value = item.partition("=")
        given[key] = value
    return workloads.get("tabular").resolve_params(given)


def _rank(rank: int, world: int, tracker_args: dict, args: argparse.Namespace, out) -> None:
    import xgboost as xgb
    from xgboost import collective

    workload = workloads.get("tabular")
    params = _params(args)
    train = workload.load(args.data, "train", rank, world, params)
    test = workload.load(args.data, "test", rank, world, params)
    whole = workload.load(args.data, "train", 0, 1, params)
    booster_params = workload.booster_params(whole.y, params, args.seed)
    booster_params["nthread"] = args.threads
    names = workload.feature_names(args.data, params)
    with collective.CommunicatorContext(dmlc_task_id=f"rank-{rank:08d}", **tracker_args):
        dtrain = xgb.DMatrix(train.x, label=train.y, feature_names=names)
        dtest = xgb.DMatrix(test.x, label=test.y, feature_names=names)
        started = time.perf_counter()
        # Scored on both splits every round, as the launcher's loop does (its train_loss and loss).
        xgb.train(booster_params, dtrain, num_boost_round=params["num_boost_round"],
                  evals=[(dtrain, "train"), (dtest, "test")], verbose_eval=False)
        took = time.perf_counter() - started
        rows = collective.allreduce(np.array([float(len(train))]), collective.Op.SUM)[0]
    if rank == 0:
        out.put({"workers": world, "rounds": params["num_boost_round"], "train_time_s": took,
                 "samples_per_s": rows * params["num_boost_round"] / took})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="the table (CSV or Parquet)")
    p.add_argument("--label", default="label")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="XGBoost threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="the tabular workload's")
    args = p.parse_args(argv)
    from xgboost.tracker import RabitTracker

    tracker = RabitTracker(n_workers=args.workers, host_ip="127.0.0.1", sortby="task")
    tracker.start()
    tracker_args = tracker.worker_args()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.workers, tracker_args, args, out)) for r in range(args.workers)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=3600)
    for proc in procs:
        proc.join()
    tracker.wait_for(timeout=60)
    print(json.dumps(result), flush=True)
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
