"""What runs inside a Ray Train worker.

:mod:`~launcher.worker.entry` is the function Ray Train runs: a function written for Ray Train
runs as it is, everything else trains on the framework's session (``launcher.frameworks``).
:mod:`~launcher.worker.loop` holds what every session shares (position, checkpoints,
preemption notices); :mod:`~launcher.worker.session` is the PyTorch session and
:mod:`~launcher.worker.tf_session` the TensorFlow one, each running a user's training function
or its framework's managed loop (:mod:`~launcher.worker.torch_loop`,
:mod:`~launcher.worker.tf_loop`) for a workload; :mod:`~launcher.worker.order` is the data
order and its cursor; :mod:`~launcher.worker.export` writes the final model.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "train_loop_per_worker": "launcher.worker.entry",
    "TorchSession": "launcher.worker.session",
    "BareSession": "launcher.worker.bare",
    "TFSession": "launcher.worker.tf_session",
    "managed": "launcher.worker.torch_loop",
    "train_workload": "launcher.worker.torch_loop",
    "configure_tensorflow": "launcher.worker.tf_session",
    "export": "launcher.worker.export",
    "GlobalOrder": "launcher.worker.order",
    "EpochCursor": "launcher.worker.order",
    "StepClock": "launcher.worker.timing",
})
