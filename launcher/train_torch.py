"""The per-worker training loop for PyTorch, shared by every torch backend.

Each Ray Train worker runs :func:`train_loop_per_worker`: join the backend's
process group, load its own data shard, build the model, restore the latest
checkpoint if there is one, then train epoch by epoch, reporting metrics and
a checkpoint through ``ray.train.report``.

Data order is a pure function of (seed, epoch, rank): a run restored at any
step replays the same batches it would have seen, so resuming mid-epoch
skips exactly the batches already trained on.

Every ``preemption_check_steps`` steps all ranks ask Ray Train whether a node
of theirs is being preempted (a barrier, so every rank asks at the same
steps). On a notice they checkpoint at once, then keep training while the
drain deadline is far enough off, and when it comes close (rank 0's clock
decides, so all ranks agree) they checkpoint once more and hold, training no
further: Ray Train stops the group at the deadline and restarts it from that
last checkpoint, so an announced preemption costs no training steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import tempfile
import time
import uuid
from typing import Any

import numpy as np

import workloads
from launcher import backends
from launcher.checkpoint import Manifest, complete_checkpoints, newest_complete, read_manifest, write_manifest
from launcher.spec import JobSpec

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
EVAL_BATCH = 512
RESERVE_MIN_S = 3.0  # stop training at least this long before the drain deadline


def epoch_order(seed: int, epoch: int, rank: int, n: int) -> np.ndarray:
    """The order in which rank visits its n training samples during ``epoch``."""
    return np.random.default_rng([seed, epoch, rank]).permutation(n)


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


@dataclasses.dataclass
class Position:
    epoch: int = 0           # completed epochs
    step_in_epoch: int = 0   # steps done in the epoch under way
    global_step: int = 0


class TorchTraining:
    """One worker's training state and the operations on it."""

    def __init__(self, spec: JobSpec, comm: backends.TorchComm) -> None:
        import torch

        from launcher.datacache import local_data

        self.spec, self.comm = spec, comm
        self.rank, self.world = comm.rank, comm.world_size
        self.workload = workloads.get(spec.workload)
        self.device = comm.device()
        torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
        data = local_data(spec.data)  # gs:// data: this node's verified copy
        self.train = self.workload.load(data, "train", self.rank, self.world, spec.params)
        self.test = self.workload.load(data, "test", self.rank, self.world, spec.params)
        torch.manual_seed(spec.seed)  # same initial weights on every rank
        self.module = self.workload.torch_model(spec.params).to(self.device)
        self.optimizer = make_optimizer(self.workload.defaults.optimizer, self.module.parameters(), spec.lr)
        torch.manual_seed(spec.seed * 1000 + self.rank + 1)  # per-rank stream (dropout, augmentation)
        self.pos = Position()
        self.restored_from: dict[str, int] | None = None
        self.attempt = uuid.uuid4().hex[:12]
        self.steps_per_epoch = math.ceil(len(self.train) / spec.batch_size)
        self.marks: dict[str, float] = {}  # start-up milestones, sent with the first report
        self.board = None  # the driver's ProgressBoard actor (rank 0 writes to it)
        self.start_step = 0
        self.noticed = False
        self.step_s = 0.0        # recent time per step, for the reserve before a drain deadline
        self.checkpoint_s = 0.0  # time the last checkpoint took

    # -- checkpoints ------------------------------------------------------------------
    def restore(self, directory: str) -> None:
        """Load model, optimizer, RNG state and data position from a checkpoint folder."""
        import torch

        manifest = read_manifest(directory)
        self.module.load_state_dict(torch.load(os.path.join(directory, MODEL_FILE), map_location=self.device))
        self.optimizer.load_state_dict(torch.load(os.path.join(directory, OPTIMIZER_FILE), map_location=self.device))
        pos = Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step)
        same_layout = manifest.world_size == self.world and manifest.batch_size == self.spec.batch_size
        rng_file = os.path.join(directory, f"rng_rank{self.rank}.pt")
        if same_layout and os.path.isfile(rng_file):
            torch.set_rng_state(torch.load(rng_file))
        if pos.step_in_epoch and not same_layout:
            # The shards and batches differ, so the mid-epoch position has no exact
            # equivalent: redo the whole epoch rather than skip unseen samples.
            pos.step_in_epoch = 0
        self.pos = pos
        self.start_step = pos.global_step
        self.restored_from = manifest.position

    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        import torch

        torch.save(torch.get_rng_state(), os.path.join(directory, f"rng_rank{self.rank}.pt"))
        if self.rank != 0:
            return
        torch.save(self.module.state_dict(), os.path.join(directory, MODEL_FILE))
        torch.save(self.optimizer.state_dict(), os.path.join(directory, OPTIMIZER_FILE))
        s = self.spec
        write_manifest(directory, Manifest(
            epoch=self.pos.epoch, step_in_epoch=self.pos.step_in_epoch, global_step=self.pos.global_step,
            world_size=self.world, framework=s.framework, backend=s.backend, workload=s.workload,
            batch_size=s.batch_size, seed=s.seed, metrics=metrics))

    def report(self, metrics: dict[str, Any], checkpoint: bool = True) -> None:
        import ray.train

        metrics = {**metrics, "epoch": self.pos.epoch, "step_in_epoch": self.pos.step_in_epoch,
                   "global_step": self.pos.global_step, "world_size": self.world, "time": time.time(),
                   "attempt": self.attempt, "restored_from": self.restored_from,
                   "steps_per_epoch": self.steps_per_epoch}
        if self.marks:
            metrics["startup_marks"], self.marks = self.marks, {}
        if not checkpoint:
            ray.train.report(metrics)
            return
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="launcher-ckpt-") as d:
            self.save(d, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        self.checkpoint_s = time.perf_counter() - started

    # -- training -----------------------------------------------------------------------
    def batch(self, split, idx: np.ndarray):
        import torch

        return (torch.from_numpy(split.x[idx]).to(self.device),
                torch.from_numpy(split.y[idx]).to(self.device))

    def run_epoch(self, model, optimizer) -> dict[str, float]:
        """Train the rest of the current epoch; returns train loss and throughput."""
        import torch
        import torch.nn.functional as F

        s, every = self.spec, self.spec.checkpoint_every_steps
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
                raise FloatingPointError(
                    f"training diverged: loss is {value} at epoch {self.pos.epoch + 1}, "
                    f"step {self.pos.global_step + 1}; lower --lr (now {s.lr:g})")
            loss.backward()
            boundary = (i + 1) % accumulate == 0 or i + 1 == self.steps_per_epoch
            if boundary:
                optimizer.step()
                optimizer.zero_grad()
            if "first_step" not in self.marks and "worker_ready" in self.marks:
                self.marks["first_step"] = time.time()
            totals += torch.tensor([value * len(y), len(y)], dtype=torch.float64)
            self.pos.step_in_epoch, self.pos.global_step = i + 1, self.pos.global_step + 1
            self.note_progress()
            self.step_s = 0.9 * self.step_s + 0.1 * (time.perf_counter() - step_started) if self.step_s else (
                time.perf_counter() - step_started)
            # Only at optimizer-step boundaries: a checkpoint cannot hold half-accumulated gradients.
            action = self.preemption_action() if boundary else None
            if action:
                self.report({"kind": "preemption", "notice": 1, "held": int(action == "hold"), "train_loss": value})
                if action == "hold":
                    self.hold()
            elif every and boundary and self.pos.global_step % every == 0 and i + 1 < self.steps_per_epoch:
                self.report({"kind": "step", "train_loss": value})
        seconds = time.perf_counter() - start
        totals = self.comm.allreduce_sum(totals)
        samples = int(totals[1].item())
        return {"train_loss": totals[0].item() / max(1.0, totals[1].item()), "samples": samples,
                "train_time_s": seconds, "samples_per_s": samples / seconds if seconds > 0 else 0.0}

    # -- preemption -----------------------------------------------------------------------
    def note_progress(self) -> None:
        """Rank 0 tells the driver's board how far it got (fire and forget)."""
        if self.board is not None and self.rank == 0:
            self.board.step.remote(self.attempt, self.start_step, self.pos.global_step, time.time())

    def preemption_action(self) -> str | None:
        """Every K steps, on every rank alike (Ray's barrier): None (train on), "checkpoint"
        (a notice just came and there is time to train on) or "hold" (checkpoint and stop)."""
        k = self.spec.preemption_check_steps
        if not k or self.pos.global_step % k:
            return None
        import ray.train

        info = ray.train.get_preemption_info()  # the same answer on every rank
        if info is None:
            return None
        first, self.noticed = not self.noticed, True
        if self._deadline_close(info.deadline_ms, k):
            return "hold"
        return "checkpoint" if first else None

    def _deadline_close(self, deadline_ms: int | None, k: int) -> bool:
        """Rank 0 decides whether the deadline is near (the ranks' clocks and timings differ);
        the others take its answer through an all-reduce."""
        import torch

        close = 0.0
        if self.rank == 0:
            reserve = max(RESERVE_MIN_S, 2 * self.checkpoint_s + 2 * k * self.step_s)
            close = float(deadline_ms is None or deadline_ms / 1000 - time.time() <= reserve)
        return bool(self.comm.allreduce_sum(torch.tensor([close], dtype=torch.float64))[0].item() > 0)

    def hold(self) -> None:
        """Train no further: the checkpoint just taken is where the restarted group resumes,
        so any step taken now would be thrown away. Ray Train stops this worker at the
        drain deadline (or sooner, when the node goes)."""
        print(f"rank {self.rank}: preemption notice: checkpointed step {self.pos.global_step}, "
              "waiting for Ray Train to restart the group", flush=True)
        while True:
            time.sleep(1.0)

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

    def fit(self) -> None:
        model = self.comm.wrap_model(self.module)
        optimizer = self.comm.wrap_optimizer(self.optimizer, model)
        # Checkpoints save the optimizer that is stepped: Horovod's wrapper is a new object
        # with its own state (its state_dict has the plain torch format).
        self.optimizer = optimizer
        self.comm.after_restore(self.module, optimizer)
        if self.pos.epoch >= self.spec.epochs:
            # Nothing left to train: report where the run stands so the driver sees it.
            self.report({"kind": "done", **self.evaluate()}, checkpoint=False)
            return
        while self.pos.epoch < self.spec.epochs:
            stats = self.run_epoch(model, optimizer)
            self.pos.epoch, self.pos.step_in_epoch = self.pos.epoch + 1, 0
            extra = {"weights_sha256": weights_digest(self.module.state_dict())} if (
                self.pos.epoch == self.spec.epochs and self.rank == 0) else {}
            self.report({"kind": "epoch", **stats, **self.evaluate(), **extra})


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker.

    ``config["spec"]`` is a validated JobSpec dict; ``config["resume"]`` lists
    complete checkpoints the driver found in storage, newest first.
    """
    started = time.time()
    import ray.train

    from launcher.storage import Storage

    os.environ.update(config.get("env", {}))  # e.g. the storage emulator's address
    spec = JobSpec(**config["spec"])
    comm = backends.get(spec.backend).torch_comm(spec)
    comm.setup()
    training = TorchTraining(spec, comm)
    storage = Storage.resolve(spec.storage)
    training.board = config.get("board")
    # A restarted group looks at storage again: Ray's newest checkpoint may be cut off,
    # and the driver's list is from launch time.
    found = [path for _, path in reversed(complete_checkpoints(storage, spec.name))][:5]
    options = [(storage.fs, path) for path in found + list(config.get("resume", []))]
    offered = ray.train.get_checkpoint()
    if offered is not None:
        options.insert(0, (offered.filesystem, offered.path))
    chosen = newest_complete(options)
    if chosen is not None:
        fs, path, _ = chosen
        with ray.train.Checkpoint(path, filesystem=fs).as_directory() as d:
            training.restore(d)
    elif offered is not None:
        raise RuntimeError(f"cannot resume: checkpoint {offered.path} is incomplete and no other is complete")
    if comm.rank == 0:
        training.marks.update(worker_start=started, worker_ready=time.time())
    training.fit()
