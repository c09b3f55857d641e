"""What runs inside a Ray Train worker.

:mod:`~launcher.worker.loop` holds what every kind of training shares (the
session's position, checkpoints, preemption notices); :mod:`~launcher.worker.session`
is the PyTorch training session a user's own loop gets, and the managed torch
loop (:mod:`~launcher.worker.torch_loop`) is one client of it;
:mod:`~launcher.worker.tf_loop` is the TensorFlow loop; :mod:`~launcher.worker.export`
writes the final model.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "train_loop_per_worker": "launcher.worker.entry",
    "Training": "launcher.worker.loop",
    "TorchSession": "launcher.worker.session",
    "BareSession": "launcher.worker.session",
    "managed": "launcher.worker.torch_loop",
    "train_workload": "launcher.worker.torch_loop",
    "TFTraining": "launcher.worker.tf_loop",
    "configure_tensorflow": "launcher.worker.tf_loop",
    "export": "launcher.worker.export",
    "GlobalOrder": "launcher.worker.order",
    "StepClock": "launcher.worker.timing",
})
