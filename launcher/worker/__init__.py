"""What runs inside a Ray Train worker.

:mod:`~launcher.worker.loop` is the training loop every framework shares
(data order, position, checkpoints, preemption notices, ``fit()``);
:mod:`~launcher.worker.torch_loop` and :mod:`~launcher.worker.tf_loop` fill in
the framework; :mod:`~launcher.worker.export` writes the final model.
"""

from launcher._lazy import lazy_exports  # noqa: E402

__all__, __getattr__ = lazy_exports(__name__, {
    "train_loop_per_worker": "launcher.worker.entry",
    "Training": "launcher.worker.loop",
    "TorchTraining": "launcher.worker.torch_loop",
    "TFTraining": "launcher.worker.tf_loop",
    "configure_tensorflow": "launcher.worker.tf_loop",
    "export": "launcher.worker.export",
})
