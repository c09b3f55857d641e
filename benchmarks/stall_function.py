"""The training function `launcher bench stall` runs: a ~100 MB state and short steps.

Each step does a little fixed work (a matrix product), then ``session.step()``; every
``--checkpoint-every-steps`` steps that call takes a checkpoint. The function times every
step from the outside, so a checkpoint's cost to training is the checkpoint steps' extra
time over the median plain step. It also times ``torch.save`` of the same state to local
disk: the serialisation a checkpoint cannot avoid.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import workloads
from workloads import Param


@workloads.training_function(epochs=1, batch_size=1, params=[
    Param("mb", int, 100, "size of the model's state in MB"),
    Param("steps", int, 40, "steps in the epoch"),
    Param("work", int, 256, "side of the matrix product each step does")])
def stall(session) -> None:
    """A ~100 MB state, short steps, timed around each session.step()."""
    import torch

    p = session.params
    model = torch.nn.Module()
    model.weights = torch.nn.Parameter(torch.randn(p["mb"] * 2**20 // 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # stateless: the model is the state
    session.register(model=model, optimizer=optimizer)
    serialise = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(3):
            t0 = time.perf_counter()
            torch.save(model.state_dict(), os.path.join(d, "model.pt"))
            serialise.append(time.perf_counter() - t0)
    loader = session.loader(list(range(p["steps"] * session.world_size)), batch_size=1)
    every = session.spec.checkpoint_every_steps or 0
    a = torch.randn(p["work"], p["work"])
    plain, checkpointed = [], []
    for _ in session.epochs():
        for _ in loader:
            t0 = time.perf_counter()
            for _ in range(4):
                a = torch.tanh(a @ a)
            session.step()
            took = time.perf_counter() - t0
            last = session.step_in_epoch == len(loader)
            (checkpointed if every and session.global_step % every == 0 and not last else plain).append(took)
        base = statistics.median(plain)
        session.report(step_ms=1000 * base, serialise_ms=1000 * statistics.median(serialise),
                       checkpoint_step_ms=1000 * statistics.mean(checkpointed) if checkpointed else 0.0,
                       stall_ms=1000 * (statistics.mean(checkpointed) - base) if checkpointed else 0.0,
                       checkpoints=len(checkpointed), state_mb=p["mb"])
