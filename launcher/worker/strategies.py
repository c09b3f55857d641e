"""How a torch model is kept in step across the workers: one strategy per ``--strategy``, by name.

A strategy owns everything that differs between keeping the whole model on every worker
and sharding it: how the model and optimizer are prepared, whether gradients are reduced
inside the backward pass, how the registered state is written to a checkpoint and read
back (one file on rank 0, or a share per rank), how the whole weights are gathered (for a
digest, for the export), the whole model the export traces as a program (a copy of the
model, or of the sharded one's skeleton kept before sharding), and whether the survivors of a
lost node can write a checkpoint.
:class:`~launcher.worker.session.TorchSession` asks its strategy and never tests which one
it has; a new way of synchronising a model (fault-tolerant replica groups, say) is a new
entry in :data:`STRATEGIES`, not a new branch in the session. Where a strategy does what the
session otherwise does itself (the training loader's order, reports, preemption notices, whether
a step counts), the session asks it through the hooks at the end of :class:`Strategy`.

- ``ddp`` (:class:`Replicated`): the whole model on each worker, wrapped by the backend's
  communicator (torch DDP, or Horovod's broadcast and DistributedOptimizer); rank 0 writes
  the model and the other states, every rank its RNG file.
- ``fsdp`` (:class:`Sharded`): FSDP2 (:mod:`launcher.worker.sharded`); every rank writes its
  shards with torch.distributed.checkpoint, which loads them on any worker count; the final
  checkpoint's whole model, gathered on rank 0, is exported as a program like ddp's.
- ``ft`` (:class:`launcher.worker.ft.FaultTolerant`): ddp whose workers are torchft replica
  groups, a quorum per step; a lost worker leaves the quorum and is replaced alone.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import os
import shutil
from typing import Any, Callable

from launcher import _ray
from launcher.worker.formats import TORCH_MODEL_FILE, torch_rng_file
from launcher.worker.loader import BatchOrder, SessionError, user_line

STATE_FILE = "state.pt"           # every registered object's state_dict but the model's


class NothingLeft(BaseException):
    """This worker has nothing to train: its training function ends here, as finished (an ``ft``
    replica that joins once the others are done). A BaseException, which user code does not catch."""


class Strategy:
    """The interface (see the module docstring); ``session`` is the TorchSession it serves."""

    name = ""
    reduces_in_backward = False   # gradients are reduced inside backward(): no end of it to time
    collective_forward = False    # a forward pass is a collective: every rank makes as many
    whole_state_on_rank = True    # one rank holds the whole state (a survivors' checkpoint can be written)
    requires_prepare = False      # a model not given to session.prepare() would train wrong

    def __init__(self, session) -> None:
        self.session = session

    @staticmethod
    def export_file(folder: str, out: str) -> str:
        """The whole model of checkpoint ``folder`` written to ``out`` as one torch file
        (``launcher checkpoint export``); returns how it was made. This: rank 0's model file."""
        shutil.copyfile(os.path.join(folder, TORCH_MODEL_FILE), out + ".tmp")
        os.replace(out + ".tmp", out)
        return "copied"

    def prepare(self, module, optimizer, blocks):
        """(the model to train with, the optimizer to step) for ``module`` on the session's device."""
        raise NotImplementedError

    def gradient_sync(self, model, on: bool):
        """A context in which backward() reduces the gradients (``on``) or only accumulates them."""
        raise NotImplementedError

    def full_state(self, model) -> dict[str, Any]:
        """The whole model's state_dict on rank 0 (a collective where the model is sharded)."""
        return model.state_dict()

    def whole_model(self, directory: str):
        """Rank 0, at the final checkpoint (``directory``, written): (a CPU copy of the whole,
        unsharded model with its final weights, for the export to trace; None) or (None, why
        not). The copy is the export's own: it may change it (eval mode)."""
        return copy.deepcopy(self.session.model()).cpu(), None

    def save(self, directory: str, metrics: dict[str, Any], background: bool) -> None:
        raise NotImplementedError

    def upload_fn(self):
        """What Ray's upload thread runs for a background save (None: Ray's own upload)."""
        return None

    def restore(self, directory: str, state: dict[str, Any], info: dict[str, Any], manifest) -> None:
        """Take the model's (and any sharded) state from the checkpoint in ``directory``; ``state``
        holds the other registered states, read already."""
        raise NotImplementedError

    def registered(self) -> None:
        """Objects were registered: load those of the checkpoint this strategy keeps back."""

    def waiting(self) -> list[str]:
        """Names of the checkpoint's objects not loaded yet (not registered)."""
        return []

    def lost_ranks(self, gone: set[int]) -> None:
        """Ranks went with their node, and no survivors' checkpoint is written (say why, once)."""

    # -- what the session does its own way unless the strategy does it (``ft``'s replicas do) ----------
    def batch_order(self, *args: Any) -> BatchOrder:
        """The training loader's batch sampler (arguments as :class:`BatchOrder` takes them)."""
        return BatchOrder(*args)

    def loader_options(self, num_workers: int, prefetch: bool | None) -> bool | None:
        """The training loader's ``prefetch`` (None: the session's default), refusing what cannot be."""
        return prefetch

    def send(self, metrics: dict[str, Any], checkpoint: bool) -> bool:
        """Report (and checkpoint) in the strategy's own way; False: the session reports through Ray Train."""
        return False

    def preemption_action(self, ask: Callable[[], str | None]) -> str | None:
        """Every step: what to do about a preemption notice (``ask``: the session's collective answer)."""
        return ask()

    def step_counts(self) -> bool:
        """Whether the step the loop just finished counts (it is not retried)."""
        return True

    def close(self) -> None:
        """The training function returned or failed: let go of what the strategy holds."""

    def rank_state(self, directory: str, manifest, info: dict[str, Any]) -> tuple[Any, Any]:
        """This rank's (RNG states, epoch's metrics so far) from the checkpoint in ``directory``, where
        it was written at this worker count and batch size; else (None, the epoch's metrics put
        together from every old rank's file). None for what the checkpoint does not hold."""
        import torch

        s = self.session
        path = os.path.join(directory, torch_rng_file(s.rank))
        if manifest.world_size == s.world and manifest.batch_size == s.spec.batch_size and os.path.isfile(path):
            mine = torch.load(path, weights_only=False)
            if isinstance(mine, torch.Tensor):  # an older managed checkpoint: torch's CPU stream only
                return {"torch": mine}, None
            return mine["rng"], mine["epoch"]
        return None, _epoch_across_layouts(directory, manifest.world_size, s.rank)


class Replicated(Strategy):
    """``ddp``: the whole model on each worker, kept in step by the backend's communicator."""

    name = "ddp"

    def prepare(self, module, optimizer, blocks):
        comm = self.session.comm
        wrapped = comm.wrap_model(module)
        if optimizer is not None:
            optimizer = comm.wrap_optimizer(optimizer, module)
        comm.after_restore(module, optimizer if optimizer is not None else _NoOptimizer())
        return wrapped, optimizer

    def gradient_sync(self, model, on: bool):
        return contextlib.nullcontext() if on or not hasattr(model, "no_sync") else model.no_sync()

    def save(self, directory: str, metrics: dict[str, Any], background: bool) -> None:
        s = self.session
        others = s.rng_sizes(directory)
        if s.rank != 0:
            return
        loader = s.train_loader
        cursor = self.save_state(directory, loader.batches if loader is not None else 0)
        s.write_manifest(directory, metrics, others, cursor=cursor)

    def save_state(self, directory: str, batches: int, **extra: Any) -> int | None:
        """Rank 0's files: the model, every other registered state, the loader's position (and
        ``extra`` beside it); returns the epoch's cursor in the global order after ``batches``
        (None without one)."""
        import torch

        s = self.session
        torch.save(s.model().state_dict(), os.path.join(directory, TORCH_MODEL_FILE))
        state = {name: obj.state_dict() for name, obj in s.objects.items() if name != s.model_name}
        state["_launcher"] = {"batches": batches, "model": s.model_name, **extra}
        torch.save(state, os.path.join(directory, STATE_FILE))
        return s.cursor_at(batches)

    def restore(self, directory: str, state: dict[str, Any], info: dict[str, Any], manifest) -> None:
        import torch

        if info.get("sharded"):
            raise SessionError(f"the checkpoint at step {manifest.global_step} was written with --strategy fsdp "
                               "(its state is sharded); resume it with --strategy fsdp (any worker count)")
        state[info.get("model") or "model"] = torch.load(os.path.join(directory, TORCH_MODEL_FILE),
                                                         map_location="cpu")


class Sharded(Strategy):
    """``fsdp``: FSDP2 shards; checkpoints are DCP folders every rank writes its share of."""

    name = "fsdp"
    reduces_in_backward = True
    collective_forward = True
    whole_state_on_rank = False
    requires_prepare = True

    @staticmethod
    def export_file(folder: str, out: str) -> str:
        """Every rank's shards joined into one model file."""
        import torch

        from launcher.worker.sharded import export_file

        state = torch.load(os.path.join(folder, STATE_FILE), map_location="cpu", weights_only=False)
        export_file(folder, state["_launcher"].get("model") or "model", out)
        return "joined from its shards"

    def __init__(self, session) -> None:
        super().__init__(session)
        self.dcp = None                     # the DCP saver and loader (prepare() makes it: a collective)
        self.directory: str | None = None   # a checkpoint being restored from
        self.left: list[str] = []           # its objects not loaded yet (model first, then optimizers)
        self.model_key = "model"
        self.manifest_after: tuple | None = None  # a save's manifest, written once its shards are
        self.skeleton: tuple | None = None  # rank 0: (the prepared module, its copy on meta, or why none)

    def prepare(self, module, optimizer, blocks):
        from launcher.worker import sharded

        spec = self.session.spec
        if self.session.rank == 0:  # what the final export loads the whole weights into
            try:
                self.skeleton = (module, sharded.skeleton(module), None)
            except Exception as exc:  # noqa: BLE001 - the user's module; training goes on, the export says why
                self.skeleton = (module, None, f"the model could not be copied ({type(exc).__name__}: {exc})")
        sharded.shard(module, optimizer, device=self.session.device, precision=spec.precision,
                      offload=spec.fsdp_offload, blocks=blocks)
        self.dcp = sharded.Checkpointer(self.session.device)
        return module, optimizer

    def gradient_sync(self, model, on: bool):
        model.set_requires_gradient_sync(on)  # reduce-scatter only on the last batch of a step
        return contextlib.nullcontext()

    def full_state(self, model) -> dict[str, Any]:
        from launcher.worker.sharded import full_model_state

        return full_model_state(model)

    def whole_model(self, directory: str):
        """The skeleton :meth:`prepare` kept, given the whole weights the final checkpoint
        gathered on rank 0 (``model.pt``, read memory-mapped): no collective here, so rank 0
        exports alone while the others go on."""
        import torch

        from launcher.worker.sharded import load_skeleton

        if self.skeleton is None or self.skeleton[0] is not self.session.model():
            return None, "the registered model is not the one session.prepare() sharded"
        prepared, clone, why = self.skeleton
        self.skeleton = (prepared, None, "it was exported already")  # the copy leaves with the export
        path = os.path.join(directory, TORCH_MODEL_FILE)
        if clone is None or not os.path.exists(path):
            return None, why or "the final checkpoint holds no whole model"
        return load_skeleton(clone, torch.load(path, map_location="cpu", mmap=True, weights_only=True))

    def save(self, directory: str, metrics: dict[str, Any], background: bool) -> None:
        """Every rank writes its shards of the model and optimizers (DCP), its RNG file, and rank 0
        the other states; the manifest, naming every rank's files, is written once the shards are
        (by :meth:`upload_fn` for a ``background`` save). The final checkpoint holds the whole
        model too (``model.pt``, gathered on rank 0), for the export and ``launcher predict``."""
        import torch

        from launcher.worker import sharded

        s = self.session
        model = s.model()
        states = {s.model_name: sharded.model_state(model)}
        for name, obj in s.objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                states[name] = sharded.optimizer_state(model, obj)
        self.dcp.save(states, directory, background)
        others = s.rng_sizes(directory)
        final = s.pos.epoch >= s.spec.epochs and not s.pos.step_in_epoch
        whole = sharded.full_model_state(model) if final else None
        if s.rank != 0:
            return
        if whole is not None:
            torch.save(whole, os.path.join(directory, TORCH_MODEL_FILE))
        loader = s.train_loader
        batches = loader.batches if loader is not None else 0
        state = {name: obj.state_dict() for name, obj in s.objects.items() if name not in states}
        state["_launcher"] = {"batches": batches, "model": s.model_name, "sharded": sorted(states)}
        torch.save(state, os.path.join(directory, STATE_FILE))
        self.manifest_after = (directory, metrics, others, s.cursor_at(batches), dataclasses.replace(s.pos))
        if not background:
            self._write_manifest()

    def _write_manifest(self, after: tuple | None = None) -> None:
        """The manifest of a save (``after``: a background one's, kept by its upload)."""
        from launcher.worker.sharded import shard_files

        if after is None:
            after, self.manifest_after = self.manifest_after, None
        directory, metrics, others, cursor, pos = after
        self.session.write_manifest(directory, metrics, {**others, **shard_files(directory)}, cursor=cursor, pos=pos)

    def upload_fn(self):
        """For a background save: it waits until this rank's shards are written, then (rank 0)
        writes the manifest, then stores the folder."""
        if self.dcp is None or self.dcp.pending is None:
            return None
        import ray.train

        written, manifest = self.dcp.pending, self.manifest_after
        self.manifest_after = None  # this checkpoint's, whatever the next save does meanwhile

        def upload(checkpoint, name: str):
            written.result()  # this rank's shards are in the folder (and rank 0's metadata)
            if manifest is not None:
                self._write_manifest(manifest)
            return _ray.persist_checkpoint(ray.train.get_context(), checkpoint, name)

        return upload

    def restore(self, directory: str, state: dict[str, Any], info: dict[str, Any], manifest) -> None:
        if not info.get("sharded"):
            raise SessionError(f"the checkpoint at step {manifest.global_step} was written with --strategy "
                               "ddp (the whole model on each worker), not sharded; resume it with --strategy ddp, "
                               "or start a new run (a new --name) with --strategy fsdp")
        # Loaded as the model and optimizers are registered (sharded like them).
        self.directory, self.left = directory, list(info["sharded"])
        self.model_key = info.get("model") or "model"
        self.session.keep_checkpoint()

    def registered(self) -> None:
        """Load the registered objects the checkpoint holds: the model, then (it needs the model's
        sharding) each optimizer; the last one loaded lets the folder go."""
        from launcher.worker import sharded

        s = self.session
        if not self.left or s.model_name not in s.objects:
            return
        model = s.model()
        if self.dcp is None:
            raise SessionError(f"session.register(...) at {user_line()}: the checkpoint was written by a run with "
                               "--strategy fsdp (its state is sharded), but this run's model was not sharded; "
                               "call session.prepare(model, optimizer) before registering them")
        for name in [n for n in self.left if n in s.objects]:
            if name == self.model_key:
                sharded.load_model(self.dcp, model, name, self.directory)
            else:
                sharded.load_optimizer(self.dcp, model, s.objects[name], name, self.directory)
            self.left.remove(name)
        if not self.left:
            s.release_checkpoint()

    def waiting(self) -> list[str]:
        return list(self.left)

    def lost_ranks(self, gone: set[int]) -> None:
        s = self.session
        if gone and s.rank == min(set(range(s.world)) - gone, default=-1):  # said once
            print(f"rank {s.rank}: ranks {sorted(gone)} went with their node; a sharded run (--strategy "
                  "fsdp) has no survivors' checkpoint, as no rank holds the whole state: it resumes from its "
                  f"last complete checkpoint (step {max(s.saved_step, 0)})", flush=True)


class _NoOptimizer:
    """An optimizer with no state, for a model prepared without one."""

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}}


def _epoch_across_layouts(directory: str, old_world: int, rank: int) -> dict[str, Any] | None:
    """The interrupted epoch's metrics so far, for ``rank`` of a group of another size that goes on
    with it. A rank's step sums are the old ranks' sums averaged, so that each new rank's mean
    starts at the old steps' mean over all ranks (what the epoch's metric is); the samples go to
    rank 0 alone, so that their sum over the new ranks is the old ranks'. None without every
    old rank's file."""
    import torch

    parts = []
    for r in range(old_world):
        path = os.path.join(directory, torch_rng_file(r))
        saved = torch.load(path, weights_only=False) if os.path.isfile(path) else None
        if not isinstance(saved, dict) or not saved.get("epoch"):
            return None
        parts.append(saved["epoch"])
    names = set(parts[0]["sums"])
    return {"sums": {n: sum(p["sums"].get(n, 0.0) for p in parts) / old_world for n in names},
            "counts": dict(parts[0]["counts"]), "reported": {},
            "samples": sum(int(p["samples"]) for p in parts) if rank == 0 else 0,
            "data_wait": sum(float(p.get("data_wait", 0.0)) for p in parts) / old_world,
            "seconds": max(float(p["seconds"]) for p in parts)}


# ``ft`` is named by path (imported when a run uses it): its module builds on Replicated here.
STRATEGIES: dict[str, type[Strategy] | str] = {"ddp": Replicated, "fsdp": Sharded,
                                                "ft": "launcher.worker.ft:FaultTolerant"}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy class ``--strategy NAME`` names (the spec has checked the name)."""
    entry = STRATEGIES[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry


def strategy_for(session) -> Strategy:
    """The strategy ``session.spec.strategy`` names, serving ``session``."""
    return strategy_class(session.spec.strategy)(session)


def unwrap(model):
    """The module inside a DDP wrapper (its state_dict keys have no ``module.`` prefix)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
