"""The per-worker training loop for PyTorch, shared by every torch backend.

:class:`TorchTraining` is the torch half of :class:`launcher.worker.loop.Training`:
the workload's ``nn.Module`` and optimizer, wrapped by the backend's
:class:`~launcher.backends.TorchComm` (DDP or Horovod), one optimizer step per
batch (or per ``hvd_backward_passes`` batches), and checkpoints holding the
model, the optimizer and every rank's RNG state.

Data order is a pure function of (seed, epoch, rank): a run restored at any
step replays the same batches it would have seen, so resuming mid-epoch
skips exactly the batches already trained on. Positions, reports, resume and
preemption notices are handled by :class:`launcher.worker.loop.Training`.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any

import numpy as np

from launcher.backends.base import TorchComm
from launcher.spec import JobSpec
from launcher.storage.checkpoint import read_manifest
from launcher.worker.formats import TORCH_MODEL_FILE as MODEL_FILE
from launcher.worker.formats import TORCH_OPTIMIZER_FILE as OPTIMIZER_FILE
from launcher.worker.formats import torch_rng_file
from launcher.worker.loop import Position, Training, epoch_order

EVAL_BATCH = 512
__all__ = ["MODEL_FILE", "OPTIMIZER_FILE", "TorchTraining", "epoch_order", "weights_digest"]


def weights_digest(state_dict) -> str:
    """sha256 over a model's tensors (names, dtypes, shapes and bytes, in name order)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_optimizer(name: str, params, lr: float):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


class TorchTraining(Training):
    """One worker's torch training state and the operations on it."""

    def __init__(self, spec: JobSpec, comm: TorchComm) -> None:
        import torch

        super().__init__(spec, comm)
        self.device = comm.device()
        torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
        torch.manual_seed(spec.seed)  # same initial weights on every rank
        self.module = self.workload.torch_model(spec.params).to(self.device)
        self.optimizer = make_optimizer(self.workload.defaults.optimizer, self.module.parameters(), spec.lr)
        self.model = self.module  # what is trained: the module as the backend wraps it (prepare)
        torch.manual_seed(spec.seed * 1000 + self.rank + 1)  # per-rank stream (dropout, augmentation)

    # -- checkpoints ------------------------------------------------------------------
    def restore(self, directory: str) -> None:
        """Load model, optimizer, RNG state and data position from a checkpoint folder."""
        import torch

        manifest = read_manifest(directory)
        self.module.load_state_dict(torch.load(os.path.join(directory, MODEL_FILE), map_location=self.device))
        self.optimizer.load_state_dict(torch.load(os.path.join(directory, OPTIMIZER_FILE), map_location=self.device))
        same_layout = manifest.world_size == self.world and manifest.batch_size == self.spec.batch_size
        rng_file = os.path.join(directory, torch_rng_file(self.rank))
        if same_layout and os.path.isfile(rng_file):
            torch.set_rng_state(torch.load(rng_file))
        self.restored(Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step), manifest)

    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        import torch

        rng = os.path.join(directory, torch_rng_file(self.rank))
        torch.save(torch.get_rng_state(), rng)
        # Every rank's RNG file goes into the manifest with its size, so a checkpoint
        # whose rank-1 file was cut off counts as incomplete (a collective: all ranks).
        others = self.sizes_over_ranks(torch_rng_file, os.path.getsize(rng))
        if self.rank != 0:
            return
        torch.save(self.module.state_dict(), os.path.join(directory, MODEL_FILE))
        torch.save(self.optimizer.state_dict(), os.path.join(directory, OPTIMIZER_FILE))
        self.write_manifest(directory, metrics, others)

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        import torch

        return self.comm.allreduce_sum(torch.from_numpy(values.copy())).numpy()

    # -- training -----------------------------------------------------------------------
    def batch(self, split, idx: np.ndarray):
        import torch

        x, y = split.take(idx)
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def run_epoch(self) -> dict[str, float]:
        """Train the rest of the current epoch; returns train loss and throughput."""
        import torch
        import torch.nn.functional as F

        s, model, optimizer = self.spec, self.model, self.optimizer
        # accumulate > 1: gradients of that many batches add up locally before one
        # optimizer step (Horovod's backward_passes_per_step).
        accumulate = self.comm.accumulation_steps
        order = epoch_order(s.seed, self.pos.epoch, self.rank, len(self.train))
        model.train()
        totals = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
        start = time.perf_counter()
        # zero_grad() sets gradients to None (torch >= 2.0); Horovod's optimizer takes no arguments.
        optimizer.zero_grad()
        for i in range(self.pos.step_in_epoch, self.steps_per_epoch):
            step_started = time.perf_counter()
            x, y = self.batch(self.train, order[i * s.batch_size:(i + 1) * s.batch_size])
            loss = F.cross_entropy(model(x), y)
            value = loss.item()  # one device sync per step, reused below
            if not math.isfinite(value):
                raise self.diverged(value)
            loss.backward()
            boundary = (i + 1) % accumulate == 0 or i + 1 == self.steps_per_epoch
            if boundary:
                optimizer.step()
                optimizer.zero_grad()
            totals += torch.tensor([value * len(y), len(y)], dtype=torch.float64)
            self.stepped(i, value, step_started, boundary)
        seconds = time.perf_counter() - start
        totals = self.comm.allreduce_sum(totals)
        samples = int(totals[1].item())
        return {"train_loss": totals[0].item() / max(1.0, totals[1].item()), "samples": samples,
                "train_time_s": seconds, "samples_per_s": samples / seconds if seconds > 0 else 0.0}

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the whole test split (each rank scores its shard)."""
        import torch
        import torch.nn.functional as F

        self.module.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        with torch.no_grad():
            for lo in range(0, len(self.test), EVAL_BATCH):
                x, y = self.batch(self.test, np.arange(lo, min(lo + EVAL_BATCH, len(self.test))))
                logits = self.module(x)
                totals += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                        (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        totals = self.comm.allreduce_sum(totals)
        n = max(1.0, totals[2].item())
        return {"loss": totals[0].item() / n, "accuracy": totals[1].item() / n}

    def prepare(self) -> None:
        self.model = self.comm.wrap_model(self.module)
        # Checkpoints save the optimizer that is stepped: Horovod's wrapper is a new object
        # with its own state (its state_dict has the plain torch format).
        self.optimizer = self.comm.wrap_optimizer(self.optimizer, self.model)
        self.comm.after_restore(self.module, self.optimizer)

    def weights_digest(self) -> str:
        return weights_digest(self.module.state_dict())
