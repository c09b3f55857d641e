"""The managed PyTorch loop: a Workload trained by the launcher, as one client of the session.

:func:`train_workload` is a training function like a user's
(:mod:`launcher.worker.session`): it builds the workload's model, optimizer and
LR schedule from the workload's hooks (``torch_model``, ``torch_optimizer``,
``torch_scheduler``), trains with the workload's ``torch_loss`` under
``--precision`` (autocast; fp16 with a checkpointed GradScaler), ``--grad-clip``
and ``--grad-accumulation``, and reports the workload's ``torch_metrics`` after
each epoch. Resuming, checkpoints, preemption notices and reporting are the
session's, so the managed loop and a user's loop keep one set of guarantees.

Nothing is read back from the device per step: the losses add up on the device
and are read when a report needs them (a checkpoint, the epoch's end). The
workload's training split is read a batch per call (``__getitems__``), in the order the
session's loader gives (:mod:`launcher.worker.order`: one order over the whole split, a pure
function of seed and epoch, each global batch split over the ranks).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import numpy as np

from launcher.worker.usersession import training_function, workload_splits

EVAL_BATCH = 512
__all__ = ["SplitDataset", "managed", "train_workload", "weights_digest"]


def weights_digest(state_dict) -> str:
    """sha256 over a model's tensors (names, dtypes, shapes and bytes, in name order)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SplitDataset:
    """A workload's shard (``take(idx) -> (x, y)``) as a map-style dataset whose loader reads a
    whole batch per call, as the shard's arrays are best read."""

    def __init__(self, split) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        x, y = self.split.take(np.array([i]))
        return x[0], y[0]

    def __getitems__(self, indices: list[int]):
        return self.split.take(np.asarray(indices))


def as_tensors(batch) -> tuple[Any, Any]:
    """A batch from :class:`SplitDataset` (numpy inputs and labels) as tensors, sharing memory."""
    import torch

    x, y = batch
    return torch.from_numpy(x), torch.from_numpy(y)


def managed(workload):
    """The training function that trains ``workload`` (what the session runs for a Workload)."""
    return training_function(workload, train_workload)


def train_workload(session, workload) -> None:
    """Train ``workload`` for the run's epochs with the session (see the module docstring)."""
    spec, params = session.spec, session.spec.params
    train, test = workload_splits(session, workload)
    module = workload.torch_model(params)
    optimizer = workload.torch_optimizer(module.parameters(), spec.lr, params)
    model, optimizer = session.prepare(module, optimizer)
    loader = session.loader(SplitDataset(train), spec.batch_size, collate_fn=as_tensors)
    accumulate = spec.accumulation
    steps = spec.epochs * -(-len(loader) // accumulate)
    scheduler = workload.torch_scheduler(optimizer, steps, params)
    scaler = session.grad_scaler()
    state = {"model": module, "optimizer": optimizer}
    if scheduler is not None:
        state["scheduler"] = scheduler
    if scaler.is_enabled():
        state["scaler"] = scaler
    session.register(**state)
    evaluation = session.loader(SplitDataset(test), EVAL_BATCH, train=False, shard=False, collate_fn=as_tensors)

    for _ in session.epochs():
        model.train()
        optimizer.zero_grad()  # gradients to None (torch >= 2.0); Horovod's takes no arguments
        for x, y in loader:
            i = loader.batches  # batches done in this epoch, this one included
            boundary = i % accumulate == 0 or i == len(loader)
            with session.gradient_sync(model, boundary):  # reduced on a step's last batch only
                with session.autocast():
                    loss = workload.torch_loss(model(x), y, params)
                if i == 1 or loss.dim():
                    _check_loss(workload, loss)
                scaler.scale(loss / accumulate if accumulate > 1 else loss).backward()
            if boundary:
                if spec.grad_clip:
                    scaler.unscale_(optimizer)
                    session.clip_gradients(model, optimizer, spec.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            session.step(train_loss=loss.detach(), boundary=boundary)
        evaluate(session, workload, module, evaluation)


def _check_loss(workload, loss) -> None:
    """One line naming the workload's loss hook when it does not return a scalar tensor."""
    from launcher.worker.loader import SessionError

    if getattr(loss, "dim", None) is not None and loss.dim() == 0 and loss.is_floating_point():
        return
    hook = type(workload).torch_loss
    try:
        where = f"{inspect.getsourcefile(hook)}:{inspect.getsourcelines(hook)[1]}"
    except (OSError, TypeError):
        where = type(workload).__name__
    what = (f"a tensor of shape {tuple(loss.shape)}" if hasattr(loss, "shape") else f"a {type(loss).__name__}")
    raise SessionError(f"torch_loss of workload {workload.name} at {where} returned {what}, not a scalar tensor: "
                       "reduce it over the batch (e.g. F.mse_loss(outputs, labels), or .mean())")


def evaluate(session, workload, module, loader) -> None:
    """Report the workload's metrics on this rank's test shard (averaged over the ranks by the
    session, each rank counting as many as it scored)."""
    import torch

    module.eval()
    outputs, labels = [], []
    with torch.no_grad(), session.autocast():
        for x, y in loader:
            outputs.append(module(x).float())
            labels.append(y)
        if session.collective_forward and outputs:
            # Each forward pass of a sharded model gathers its weights (a collective): a rank with
            # fewer test batches makes as many passes as the others, on a batch it has seen.
            counts = np.zeros(session.world)
            counts[session.rank] = len(outputs)
            for _ in range(int(session.sum_over_ranks(counts).max()) - len(outputs)):
                module(x)
    module.train()
    if outputs:
        metrics = workload.torch_metrics(torch.cat(outputs), torch.cat(labels), session.spec.params)
        session.report(weight=sum(len(y) for y in labels), **metrics)
