"""What runs inside a Ray Train worker.

:mod:`~launcher.worker.loop` is the training loop every framework shares
(data order, position, checkpoints, preemption notices, ``fit()``);
:mod:`~launcher.worker.torch_loop` and :mod:`~launcher.worker.tf_loop` fill in
the framework; :mod:`~launcher.worker.export` writes the final model.
"""
