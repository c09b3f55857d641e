"""The function Ray Train runs on every worker of a launcher run.

``config["spec"]`` is a validated JobSpec dict; ``config["resume"]`` lists
complete checkpoints the driver found in storage, newest first;
``config["board"]`` is the driver's progress board (or None);
``config["env"]`` holds variables the worker needs (e.g. the storage
emulator's address). The framework's loop is imported here, on the worker,
so the driver never imports torch or TensorFlow.
"""

from __future__ import annotations

import os
import time
from typing import Any

from launcher import backends, faultpoint
from launcher.spec import JobSpec


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Join the backend's workers, build the framework's training state, restore, train."""
    started = time.time()
    os.environ.update(config.get("env", {}))
    faultpoint.pause("workers-start")
    spec = JobSpec(**config["spec"])
    backend = backends.get(spec.backend)
    if spec.framework == "tensorflow":
        from launcher.worker.tf_loop import TFTraining, configure_tensorflow

        configure_tensorflow(max(1, int(spec.cpus_per_worker)))  # before TensorFlow starts
        comm, training_class = backend.tf_comm(spec), TFTraining
    else:
        from launcher.worker.torch_loop import TorchTraining

        comm, training_class = backend.torch_comm(spec), TorchTraining
    comm.setup()
    training = training_class(spec, comm)
    training.start(config, started)
