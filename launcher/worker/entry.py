"""The function Ray Train runs on every worker of a launcher run.

``config["spec"]`` is a validated JobSpec dict; ``config["resume"]`` lists
complete checkpoints the driver found in storage, newest first;
``config["board"]`` is the driver's progress board (or None);
``config["env"]`` holds variables the worker needs (e.g. the storage
emulator's address); ``config["notices"]`` whether a preemption notice can
come; ``config["user_config"]`` what a Ray Train function gets as its config.
Two paths: a function written for Ray Train runs as it is; everything else trains on the
framework's session (:mod:`launcher.frameworks` names it): the user's training function, or
for a workload the framework's managed loop (torch, TensorFlow) or its boosting rounds
(XGBoost). The session is imported here, on the worker, so the driver never imports torch
or TensorFlow.
"""

from __future__ import annotations

import os
import time
from typing import Any

import workloads
from launcher import backends, faultpoint, frameworks
from launcher.spec import JobSpec
from launcher.worker.ranklog import RankLog


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Join the backend's workers, build the framework's training state, restore, train; this
    rank's output is copied to the run's storage as it goes (launcher.worker.ranklog)."""
    started = time.time()
    os.environ.update(config.get("env", {}))
    spec = JobSpec(**config["spec"])
    log = _rank_log(spec, config)
    try:
        _train(spec, config, started)
    except Exception:
        if log is not None:
            log.failed()
        raise
    finally:
        if log is not None:
            log.close()


def _rank_log(spec: JobSpec, config: dict[str, Any]) -> RankLog | None:
    import ray.train

    try:
        return RankLog(spec.storage, spec.name, config.get("launch"), ray.train.get_context().get_world_rank()).start()
    except Exception as exc:  # noqa: BLE001 - storage refusing the log's file: train without it
        print(f"launcher: this rank's output is not copied to the run's storage ({type(exc).__name__}: {exc})",
              flush=True)
        return None


def _train(spec: JobSpec, config: dict[str, Any], started: float) -> None:
    """One of two paths: a function written for Ray Train runs as it is; everything else trains
    on the framework's session (the user's loop, or the managed loop for a workload)."""
    faultpoint.pause("workers-start")
    framework = frameworks.get(spec.framework)
    framework.configure(spec)  # before anything imports the framework (a training function's file does)
    function = _training_function(spec)
    if function is not None and function.kind == workloads.function.RAY_TRAIN:
        # Written for Ray Train's TorchTrainer or XGBoostTrainer (then inside XGBoost's
        # communicator): Ray's own API inside, the run's values as config.
        function.fn(dict(config["user_config"]))
        return
    framework.train(spec, backends.get(spec.backend), function, config, started)


def _training_function(spec: JobSpec):
    """The user's training function the spec names (a session function), or None for a workload."""
    if not workloads.is_reference(spec.workload):
        return None
    workload = workloads.get(spec.workload)
    return workload if isinstance(workload, workloads.TrainingFunction) else None
