"""The managed loop for gradient-boosted trees: XGBoost on Ray Train's XGBoost backend.

Ray Train's ``XGBoostConfig`` starts XGBoost's collective tracker and runs every worker's
training function inside XGBoost's communicator, so ``xgboost.train`` here is distributed
XGBoost: each worker holds its rows of the table, histograms are summed over the workers,
and every worker ends each round with the same booster.

A round is a step. The run is one epoch of ``num_boost_round`` steps, and everything the
launcher promises for steps holds per round: a checkpoint every ``--checkpoint-every-steps``
rounds (rank 0 writes the booster, UBJSON, then the manifest; without the flag every 10
rounds, spaced further while a checkpoint costs more than 2 % of the rounds between), resume
at the round (the booster is loaded and the remaining rounds are trained on top of it; with
``subsample`` 1 the result is bitwise the booster of an uninterrupted run), and a preemption
notice checked between rounds (a checkpoint at once, then hold).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any

import numpy as np
import xgboost as xgb

import workloads
from launcher import _ray
from launcher.backends.base import Comm
from launcher.spec import BOOSTING_CHECKPOINT_ROUNDS, JobSpec
from launcher.storage.checkpoint import read_manifest
from launcher.storage.datacache import local_data
from launcher.worker.loop import Position, Session
from launcher.worker.usage import memory_report, peak_memory_mb

BOOSTER_FILE = "model.ubj"  # in a checkpoint: the booster after its rounds (XGBoost's UBJSON)
CHECKPOINT_SHARE = 0.02  # without --checkpoint-every-steps: checkpoints take at most this share of the rounds


def checkpoint_spacing(checkpoint_s: float, round_s: float) -> int:
    """Rounds from one default checkpoint to the next: every :data:`BOOSTING_CHECKPOINT_ROUNDS`,
    or as many more as keep a checkpoint (``checkpoint_s``, the slowest rank's) within
    :data:`CHECKPOINT_SHARE` of the rounds' time. The booster grows every round and so does
    its checkpoint: on short rounds a fixed cadence would cost more the longer the run (1,200
    rounds of 28 ms on 2 workers: a 5.7 MB booster, 15 % of the training time at every 10)."""
    if round_s <= 0 or checkpoint_s <= 0:
        return BOOSTING_CHECKPOINT_ROUNDS
    return max(BOOSTING_CHECKPOINT_ROUNDS, math.ceil(checkpoint_s / (CHECKPOINT_SHARE * round_s)))


class XGBComm(Comm):
    """Rank and world size from Ray Train, sums through XGBoost's own collective (the
    communicator Ray Train's XGBoost backend opened around the training function)."""

    def setup(self) -> None:
        import ray.train

        ctx = ray.train.get_context()
        self._rank, self._world = ctx.get_world_rank(), ctx.get_world_size()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def allreduce_sum(self, values):
        return self._allreduce(values, "SUM")

    def allreduce_max(self, values):
        return self._allreduce(values, "MAX")

    def _allreduce(self, values, op: str):
        values = np.asarray(values, dtype=np.float64)
        if self._world == 1:
            return values
        from xgboost import collective

        return np.asarray(collective.allreduce(values, getattr(collective.Op, op)), dtype=np.float64)


def _booster_digest(booster) -> str:
    return hashlib.sha256(bytes(booster.save_raw("ubj"))).hexdigest()


class BoostingTraining(Session):
    """One worker of a boosting run: its rows as DMatrix, the booster, the rounds."""

    def __init__(self, spec: JobSpec, comm, function: Any = None) -> None:
        super().__init__(spec, comm)  # no training function: it trains the spec's workload
        self.workload = workloads.get(spec.workload)
        data = local_data(spec.data)
        params = spec.params
        train = self.workload.load(data, "train", self.rank, self.world, params)
        test = self.workload.load(data, "test", self.rank, self.world, params)
        # The objective and the number of classes from the whole training split, the same on
        # every rank whatever its rows hold.
        whole = self.workload.load(data, "train", 0, 1, params)
        self.params = self.workload.booster_params(whole.y, params, spec.seed)
        if spec.gpus_per_worker > 0:  # Ray Train gives each worker its GPU as the only visible one
            self.params["device"] = "cuda"
        self.is_classifier = self.params["objective"].startswith(("multi:", "binary:"))
        names = self.workload.feature_names(data, params)
        self.dtrain = xgb.DMatrix(train.x, label=train.y, feature_names=names)
        self.dtest = xgb.DMatrix(test.x, label=test.y, feature_names=names)
        self.test_labels = test.y
        self.train_rows = len(train)
        self.rounds = int(params["num_boost_round"])
        self.steps_per_epoch = self.rounds
        self.booster = None
        self.next_checkpoint = BOOSTING_CHECKPOINT_ROUNDS  # the default cadence's next round
        self.evals_log: dict[str, dict[str, list[float]]] = {}

    # -- checkpoints ----------------------------------------------------------------------------
    def restore(self, directory: str) -> None:
        manifest = read_manifest(directory)
        if manifest.framework != "xgboost":
            raise RuntimeError(f"checkpoint {directory} was written by {manifest.framework}, not xgboost")
        booster = xgb.Booster()
        with open(os.path.join(directory, BOOSTER_FILE), "rb") as f:
            booster.load_model(bytearray(f.read()))
        self.booster = booster
        # A round's position means the same at any worker count: the booster is the whole model.
        self.restored(Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step), manifest)

    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with open(os.path.join(directory, BOOSTER_FILE), "wb") as f:
            f.write(bytes(self.booster.save_raw("ubj")))
        self.write_manifest(directory, metrics)

    def step_checkpoint_due(self) -> bool:
        if self.spec.checkpoint_every_steps:
            return super().step_checkpoint_due()
        return self.pos.global_step >= self.next_checkpoint

    def step_checkpoint_taken(self) -> None:
        """Without --checkpoint-every-steps, space the next checkpoint by what this one cost
        (every rank takes the slowest rank's figures, so all agree on the round)."""
        if self.spec.checkpoint_every_steps:
            return
        cost, round_s = self.comm.allreduce_max([self.checkpoint_s, self.step_s])
        self.next_checkpoint = self.pos.global_step + checkpoint_spacing(float(cost), float(round_s))

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        return self.comm.allreduce_sum(values)

    def weights_digest(self) -> str:
        return _booster_digest(self.booster)

    def preemption_action(self) -> str | None:
        """As :meth:`Session.preemption_action`, asked after every round, but each worker reads its
        own notice (Ray Train hands it to every worker of the group) and they agree through
        XGBoost's collective: a small allreduce instead of a round trip through Ray Train's
        synchronisation actor (on 2 workers, rounds of ~45 ms: launcher/alone 0.850 -> 0.877)."""
        k = self.spec.preemption_check_steps
        if not k or not self.notices or self.pos.global_step % k:
            return None
        info = _ray.train_context().preemption_context.preemption_info
        deadline = float(info.deadline_ms) if info is not None and info.deadline_ms is not None else 0.0
        # [any rank noticed, -(the soonest deadline)]: 0 stands for none known
        seen, soonest = self.comm.allreduce_max([float(info is not None), -deadline if deadline else -math.inf])
        if not seen:
            return None
        first, self.noticed = not self.noticed, True
        if self._deadline_close(int(-soonest) if math.isfinite(soonest) else None, k):
            return "hold"
        return "checkpoint" if first else None

    # -- the loop -------------------------------------------------------------------------------
    def run(self, started: float, model_ready: float) -> None:
        if self.rank == 0:
            self.marks.update(worker_start=started, model_ready=model_ready, worker_ready=time.time())
        self.fit()

    def fit(self) -> None:
        done = self.pos.global_step
        if self.pos.epoch >= 1 or done >= self.rounds:
            self.pos.epoch, self.pos.step_in_epoch = 1, 0
            self.send({"kind": "done", **self.evaluate()}, checkpoint=False)
            return
        self.next_checkpoint = (done // BOOSTING_CHECKPOINT_ROUNDS + 1) * BOOSTING_CHECKPOINT_ROUNDS
        started = time.perf_counter()
        booster = xgb.train(self.params, self.dtrain, num_boost_round=self.rounds - done, xgb_model=self.booster,
                            evals=[(self.dtrain, "train"), (self.dtest, "test")], verbose_eval=False,
                            callbacks=[Rounds(self)])
        took = time.perf_counter() - started
        self.booster = booster
        self.pos.epoch, self.pos.step_in_epoch = 1, 0
        rows = self.sum_over_ranks(np.array([self.train_rows * (self.rounds - done)], dtype=np.float64))[0]
        own = np.zeros((2, self.world))
        own[:, self.rank] = peak_memory_mb()
        rss, gpu = self.sum_over_ranks(own.ravel()).reshape(2, self.world)
        extra = {"weights_sha256": self.weights_digest()} if self.rank == 0 else {}
        self.send({"kind": "epoch", "train_loss": self._last("train"), "samples": int(rows),
                   "train_time_s": took, "samples_per_s": rows / took if took > 0 else 0.0,
                   **self.evaluate(), **memory_report(rss, gpu), **extra})

    def round_done(self, booster, evals_log: dict, round_started: float) -> None:
        """After each round (the callback): the position, then progress, notices and checkpoints."""
        self.booster, self.evals_log = booster, evals_log
        self.pos.step_in_epoch += 1
        self.pos.global_step += 1
        self.after_step(round_started, epoch_ends=self.pos.global_step >= self.rounds, values=self.round_metrics)

    # -- metrics ----------------------------------------------------------------------------------
    def _last(self, name: str) -> float:
        """The last value of the first metric XGBoost logged for eval set ``name``."""
        logged = self.evals_log.get(name) or {}
        for values in logged.values():
            return float(values[-1])
        return float("nan")

    def round_metrics(self) -> dict[str, float]:
        out = {"train_loss": self._last("train"), "loss": self._last("test")}
        for name, logged in self.evals_log.items():
            for metric, values in logged.items():
                out[f"{name}_{metric}"] = float(values[-1])
        return out

    def evaluate(self) -> dict[str, float]:
        """The test split's metrics (XGBoost sums them over the workers) and, for a classifier,
        its accuracy over every rank's rows."""
        if self.booster is None:
            return {}
        text = self.booster.eval(self.dtest, "test")  # "[0]\ttest-mlogloss:0.1234"
        out: dict[str, float] = {}
        for item in text.split("\t")[1:]:
            metric, _, value = item.partition(":")
            out[metric.replace("-", "_")] = float(value)
        if out:
            out["loss"] = next(iter(out.values()))
        if self.is_classifier:
            scores = self.booster.predict(self.dtest)
            predicted = scores.argmax(1) if scores.ndim == 2 else (scores > 0.5).astype(np.int64)
            hits = self.sum_over_ranks(np.array([float((predicted == self.test_labels).sum()),
                                                 float(len(self.test_labels))]))
            out["accuracy"] = float(hits[0] / max(1.0, hits[1]))
        return out


class Rounds(xgb.callback.TrainingCallback):
    """XGBoost's training callback that hands every round to the session."""

    def __init__(self, session: BoostingTraining) -> None:
        super().__init__()
        self.session = session
        self.started = time.perf_counter()

    def before_iteration(self, model, epoch, evals_log) -> bool:
        self.started = time.perf_counter()
        return False

    def after_iteration(self, model, epoch, evals_log) -> bool:
        self.session.round_done(model, evals_log, self.started)
        return False
