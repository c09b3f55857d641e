"""The backend interfaces: what the driver asks of a backend, and what a worker's loop asks.

A backend has two halves. On the driver it turns a validated JobSpec into a
Ray Train V2 trainer (:meth:`Backend.trainer`). On each worker it provides a
:class:`TorchComm` (how to wrap the model and optimizer, and how to sum a
tensor over all ranks) or, for TensorFlow, a :class:`TFComm` (the variable
scope and the synchronous train step). The training loops in
:mod:`launcher.worker` only talk to these.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable


class Comm:
    """Worker-side collective operations: what a training loop of any framework asks."""

    def setup(self) -> None:
        """Join the other workers (called once per worker, before anything else; for
        TensorFlow, before any variable exists)."""

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def after_restore(self, model, optimizer) -> None:
        """Called once before training, after any checkpoint was restored (and, for torch,
        the model and optimizer wrapped): make every rank's state equal (e.g. broadcast
        rank 0's). DDP needs nothing here: it broadcasts when wrapping the model."""

    def allreduce_sum(self, values):
        """Sum ``values`` (a torch tensor; for TensorFlow a float64 numpy vector) over all
        ranks; every rank gets the result."""
        raise NotImplementedError


class TorchComm(Comm):
    """Collective operations for a torch training loop."""

    def device(self):
        raise NotImplementedError

    def wrap_model(self, model):
        """Return the model as it should be trained (e.g. wrapped in DDP)."""
        return model

    def wrap_optimizer(self, optimizer, model):
        """Return the optimizer as it should be stepped (e.g. Horovod's)."""
        return optimizer

    def clip_gradients(self, parameters, optimizer, max_norm: float):
        """Clip the gradients' global norm to ``max_norm`` before ``optimizer.step()``; returns
        the norm before clipping. The gradients must be the reduced ones: DDP has reduced them
        by the end of ``backward()``."""
        import torch

        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def allreduce_sum_(self, tensor):
        """Sum ``tensor`` over all ranks in place, as gradients are reduced while training."""
        return self.allreduce_sum(tensor)


class TFComm(Comm):
    """Collective operations for a TensorFlow training loop."""

    def scope(self):
        """Context in which the model and optimizer variables are created."""
        return contextlib.nullcontext()

    def train_step(self, model, optimizer, loss):
        """A callable ``step(x, y) -> this rank's mean loss`` doing one synchronous update.

        ``loss(y, logits)`` returns per-example losses. The update must follow the
        gradient of the mean loss over the global batch (all ranks' examples).
        """
        raise NotImplementedError

    wraps_keras_optimizer = False  # whether a Keras optimizer must be wrapped to reduce gradients

    def keras_optimizer(self, optimizer):
        """A Keras optimizer as this backend steps it (the mirrored strategy reduces gradients
        itself; Horovod wraps it)."""
        return optimizer

    def is_wrapped(self, optimizer) -> bool:
        """Whether ``optimizer`` is :meth:`keras_optimizer`'s already."""
        return True


class Backend:
    """Driver-side description of a backend."""

    name: str = ""
    description: str = ""
    frameworks: tuple[str, ...] = ()

    def unavailable_reason(self, framework: str) -> str | None:
        """None when usable here; otherwise why not and how to fix it, in one line."""
        return None

    def forget_checks(self) -> None:
        """Drop what :meth:`unavailable_reason` kept from earlier processes' checks (``launcher
        doctor`` asks afresh). Most backends keep nothing."""

    def prepare(self, framework: str, note: Callable[[str], None]) -> None:
        """Make the backend usable here if it can be done now (before :meth:`unavailable_reason`
        is asked), saying what it does through ``note``. Most backends have nothing to do."""

    def trainer(self, spec, train_fn: Callable[[dict], None], loop_config: dict[str, Any],
                scaling_config, run_config):
        """A Ray Train V2 trainer that runs ``train_fn(loop_config)`` on every worker."""
        raise NotImplementedError

    # -- script mode (launcher.driver.script): a backend sets runs_scripts and may override both
    runs_scripts: bool = False

    def script_trainer(self, spec, train_fn: Callable[[dict], None], config: dict[str, Any],
                       scaling_config, run_config):
        """The trainer that runs ``train_fn(config)`` for script mode; by default the training one."""
        return self.trainer(spec, train_fn, config, scaling_config, run_config)

    def script_env(self, framework: str) -> dict[str, str]:
        """Runs on each worker just before its script starts: the variables that a script
        written for this backend's own launcher (horovodrun, torchrun, ...) expects."""
        return {}

    def script_threads(self, framework: str) -> str | None:
        """``OMP_NUM_THREADS`` as this backend's own launcher gives a script when the user set
        none: None leaves it unset (horovodrun; a Vertex AI replica), so the math libraries use
        every core, where Ray would set it to the worker's CPU count."""
        return None

    def torch_comm(self, spec=None) -> TorchComm:
        """The worker-side half, configured from the (validated) spec."""
        raise NotImplementedError

    def tf_comm(self, spec=None) -> TFComm:
        raise NotImplementedError
