"""What every framework's per-worker training loop shares.

The data order (a pure function of seed, epoch and rank), the training
position, the choice of the checkpoint to resume from, and reporting to Ray
Train with a checkpoint folder. ``train_torch`` and ``train_tf`` build on it,
so a run behaves the same whichever framework trains it.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import uuid
from typing import Any, Callable

import numpy as np

from launcher.checkpoint import newest_complete


def epoch_order(seed: int, epoch: int, rank: int, n: int) -> np.ndarray:
    """The order in which rank visits its n training samples during ``epoch``."""
    return np.random.default_rng([seed, epoch, rank]).permutation(n)


@dataclasses.dataclass
class Position:
    epoch: int = 0           # completed epochs
    step_in_epoch: int = 0   # steps done in the epoch under way
    global_step: int = 0


def diverged(value: float, position: Position, lr: float) -> FloatingPointError:
    return FloatingPointError(
        f"training diverged: loss is {value} at epoch {position.epoch + 1}, "
        f"step {position.global_step + 1}; lower --lr (now {lr:g})")


def checkpoint_to_resume(config: dict[str, Any], storage) -> tuple[Any, str] | None:
    """(filesystem, path) of the newest complete checkpoint this worker group should resume from.

    Candidates: the checkpoint Ray Train offers (after a restart) and those the
    driver found in storage (``config["resume"]``). None when there is none.

    Raises:
        RuntimeError: Ray offered a checkpoint, but neither it nor any other is complete.
    """
    import ray.train

    options = [(storage.fs, path) for path in config.get("resume", [])]
    offered = ray.train.get_checkpoint()
    if offered is not None:
        options.insert(0, (offered.filesystem, offered.path))
    chosen = newest_complete(options)
    if chosen is not None:
        return chosen[0], chosen[1]
    if offered is not None:
        raise RuntimeError(f"cannot resume: checkpoint {offered.path} is incomplete and no other is complete")
    return None


class Reporter:
    """Reports metrics (and optionally a checkpoint) to Ray Train with the run's bookkeeping."""

    def __init__(self, pos: Position, world: int, steps_per_epoch: int) -> None:
        self.pos, self.world, self.steps_per_epoch = pos, world, steps_per_epoch
        self.attempt = uuid.uuid4().hex[:12]
        self.restored_from: dict[str, int] | None = None
        self.marks: dict[str, float] = {}  # start-up milestones, sent with the first report

    def report(self, metrics: dict[str, Any], save: Callable[[str, dict[str, Any]], None] | None) -> None:
        """Send ``metrics``; with ``save``, first write a checkpoint with ``save(folder, metrics)``."""
        import ray.train

        metrics = {**metrics, "epoch": self.pos.epoch, "step_in_epoch": self.pos.step_in_epoch,
                   "global_step": self.pos.global_step, "world_size": self.world,
                   "attempt": self.attempt, "restored_from": self.restored_from,
                   "steps_per_epoch": self.steps_per_epoch}
        if self.marks:
            metrics["startup_marks"], self.marks = self.marks, {}
        if save is None:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="launcher-ckpt-") as d:
            save(d, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    def mark_first_step(self) -> None:
        if "first_step" not in self.marks and "worker_ready" in self.marks:
            self.marks["first_step"] = time.time()
