"""The training session: the user's own PyTorch loop with every guarantee of the launcher.

``--workload FILE.py:train`` where ``train(session)`` is the user's loop. The launcher
calls it on every worker with a :class:`TorchSession`; a few lines of the loop go
through the session and the rest stays the user's::

    def train(session):
        model = MyModel()
        optimizer = torch.optim.AdamW(model.parameters(), lr=session.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 100)
        model, optimizer = session.prepare(model, optimizer)     # DDP or Horovod, same weights
        session.register(model=model, optimizer=optimizer, scheduler=scheduler)  # restored here
        loader = session.loader(MyDataset(...), batch_size=session.batch_size)
        for epoch in session.epochs():                            # starts where the run stopped
            for x, y in loader:                                   # mid-epoch: at the exact batch
                loss = F.mse_loss(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step(); scheduler.step()
                session.step(train_loss=loss)                     # may checkpoint (cadence, notice)
            session.report(val_loss=evaluate(model))              # epoch end: checkpoint

What makes a resumed run exact, the session owns: the data order (one order of seed and
epoch over the whole data set, :mod:`launcher.worker.order`), the position inside the epoch, every
registered state (anything with ``state_dict``/``load_state_dict``), every rank's RNG
states, and the step at which all ranks save on a preemption notice. Checkpoints are the
launcher's own (:class:`launcher.worker.loop.Session`: manifest written last, storage,
keep-N), so ``launcher runs``, tuning and gs:// work as for any workload.

The loader is a plain ``torch.utils.data.DataLoader`` over the user's map-style dataset,
driven by a batch sampler whose order is that pure function; its position is a batch
count, restored by starting the sampler there. torchdata's ``StatefulDataLoader`` is not
needed for this (it saves the sampler's and workers' iteration state, which here is
derived from the position); it serves iterable or stateful datasets, and a user with one
registers it like any other state: ``session.register(loader=stateful_loader)``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from launcher.spec import JobSpec
from launcher.storage import Storage
from launcher.storage.checkpoint import read_manifest
from launcher.worker import torch_rng
from launcher.worker.formats import TORCH_OPTIMIZER_FILE, torch_rng_file
from launcher.worker.loader import ResumableLoader, SessionError, user_line
from launcher.worker.loop import Position
from launcher.worker.strategies import STATE_FILE, NothingLeft, strategy_for, unwrap
from launcher.worker.usersession import UserSession, unregistered_objects


class TorchSession(UserSession):
    """What a training function gets: the run's facts, the backend, a resumable loader, and
    the checkpoints. See the module docstring for the loop it expects."""

    def __init__(self, spec: JobSpec, comm, function: Any = None) -> None:
        import torch

        super().__init__(spec, comm, function)
        self.device = comm.device()
        torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
        self.objects: dict[str, Any] = {}
        self.model_name: str | None = None
        self._saved: dict[str, Any] = {}       # states read from the checkpoint, until registered
        self._rng: dict[str, Any] | None = None
        self._resume: tuple[int, int | None] | None = None  # a resumed epoch's (batches, cursor)
        self._layout_changed = False  # the checkpoint was written by another worker count or batch size
        self._train_loader: ResumableLoader | None = None
        self._watched = False  # an optimizer is registered, whose steps mark the state updated
        self.boundary = True   # the last counted step ended with an optimizer step
        self._counted_batches = 0  # the training loader's batches when the position was last counted
        self._stand_ins: dict[int, Any] = {}  # id of an optimizer given to prepare() -> the one returned
        self._strategy = strategy_for(self)   # --strategy: how the model is kept in step, saved, restored
        self._prepared = False
        self._example: tuple | None = None  # rank 0: the model's first inputs, 2 rows, for the export
        self._example_hook = None
        torch_rng.seed_all(spec.seed)  # the same initial weights on every rank

    # -- the run's facts -------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        import ray.train

        return ray.train.get_context().get_local_rank()

    @property
    def precision(self) -> str:
        """``--precision``: fp32, bf16 or fp16."""
        return self.spec.precision

    def autocast(self):
        """``torch.autocast`` for ``--precision`` on the session's device (a no-op for fp32)."""
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.spec.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def grad_scaler(self):
        """A ``torch.amp.GradScaler`` for ``--precision fp16`` (disabled otherwise); register it."""
        import torch

        return torch.amp.GradScaler(self.device.type, enabled=self.spec.precision == "fp16")

    # -- the backend ------------------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """``--strategy``: ddp (the whole model on every worker) or fsdp (sharded)."""
        return self._strategy.name

    @property
    def collective_forward(self) -> bool:
        """Whether a forward pass is a collective (a sharded model gathers its weights): every
        rank must then make as many passes, in evaluation too."""
        return self._strategy.collective_forward

    def gradient_sync(self, model, on: bool = True):
        """A context for ``backward()``: with ``on`` False the gradients are only accumulated
        (a batch inside a gradient-accumulation step), otherwise reduced over the workers."""
        return self._strategy.gradient_sync(model, on)

    def prepare(self, model, optimizer=None, *, blocks=None):
        """The model on the session's device, wrapped for the backend (DDP, or as it is for
        Horovod), and the optimizer (Horovod's DistributedOptimizer); rank 0's weights on
        every rank. Returns ``model`` or ``(model, optimizer)`` as given.

        With ``--strategy fsdp`` the model is sharded in place with FSDP2 instead
        (:mod:`launcher.worker.sharded`): each of ``blocks`` (module classes, or modules of
        the model; default: every child holding a good share of the parameters) and then the
        whole model; the optimizer, made before, is pointed at the sharded parameters.
        ``blocks`` is ignored by ddp, so one function runs both ways."""
        given = optimizer
        wrapped, optimizer = self._strategy.prepare(model.to(self.device), optimizer, blocks)
        self._prepared = True
        if given is not None and optimizer is not given:
            self._stand_ins[id(given)] = optimizer  # Horovod's wrapper stands for the optimizer given
        return wrapped if optimizer is None else (wrapped, optimizer)

    def clip_gradients(self, model, optimizer, max_norm: float):
        """``clip_grad_norm_`` on the model's gradients as the backend has reduced them (with
        Horovod it waits for the allreduce first); call it between ``backward()`` and
        ``optimizer.step()``. Returns the norm before clipping."""
        return self.comm.clip_gradients(unwrap(model).parameters(), optimizer, max_norm)

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        import torch

        return self.comm.allreduce_sum(torch.from_numpy(np.array(values, dtype=np.float64))).numpy()

    # -- state ---------------------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Objects whose state the checkpoints hold: the model (the first ``nn.Module``, or the one
        named ``model``), optimizers, LR schedulers, a GradScaler, anything with ``state_dict``
        and ``load_state_dict``. On a resumed run each is restored here, before the first step."""
        import torch

        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise SessionError(f"session.register({name}=...) at {user_line()}: a {type(obj).__name__} has no "
                                   "state_dict()/load_state_dict(); register objects that do (a model, an "
                                   "optimizer, a scheduler, a GradScaler) and keep plain values in one of them")
            if name in self.objects and self.objects[name] is not obj:
                raise SessionError(f"session.register({name}=...) at {user_line()}: {name!r} is registered "
                                   "already; give each object its own name")
            if isinstance(obj, torch.nn.Module):
                obj = unwrap(obj)
                if self.model_name is None or name == "model":
                    self.model_name = name
                    self._watch_inputs(obj)
                    if not self._strategy.reduces_in_backward:  # no end of the reduction to see then
                        self.clock.watch_gradients(obj)
            self.objects[name] = obj
            if name in self._saved:
                obj.load_state_dict(self._saved.pop(name))
            if isinstance(obj, torch.optim.Optimizer):
                # An optimizer step the position does not count yet makes the state a step ahead of
                # it: no survivors' checkpoint is written from it (see Session.salvage).
                obj.register_step_post_hook(self._model_updated)
                self._watched = True
                self.clock.watch_optimizer(obj)
        self._strategy.registered()

    def _watch_inputs(self, model) -> None:
        """Rank 0: keep the registered model's first inputs (2 rows), the example its program
        is exported from at the end."""
        if self.rank != 0:
            return
        if self._example_hook is not None:
            self._example_hook.remove()

        def first_call(_module, args, kwargs):
            from launcher.worker.export import example_rows

            self._example = example_rows(args, kwargs)
            self._example_hook.remove()

        self._example_hook = model.register_forward_pre_hook(first_call, with_kwargs=True)

    def export_function(self, directory: str) -> str:
        """The weights, and the model as a ``torch.export`` program from the inputs it was first
        called with (why not, in one line, when it cannot be)."""
        from launcher.worker.export import export_weights, torch_program, weights_only_note

        program, why = None, "it was never called"
        if self._example is not None:
            try:
                model, why = self._strategy.whole_model(directory)
            except Exception as exc:  # noqa: BLE001 - the user's model (a deepcopy of it); the weights stay
                model, why = None, f"the model could not be copied ({type(exc).__name__}: {str(exc)[:200]})"
            if model is not None:
                program, why = torch_program(model, self._example, keep=False)
                del model
        if program is None:
            print(f"rank 0: the model is exported as its state_dict only, without a program predict and serve can "
                  f"run ({why})", flush=True)
            self.model_note = weights_only_note(why)
        return export_weights(self.spec, directory, Storage.resolve(self.spec.storage), program, why)

    def _model_updated(self, *_: Any) -> None:
        self.updated = True

    def loader(self, dataset: Any, batch_size: int | None = None, *, shuffle: bool = True, train: bool = True,
               collate_fn: Callable | None = None, num_workers: int = 0, drop_last: bool = False,
               pin_memory: bool | None = None, to_device: bool = True, shard: bool = True,
               prefetch: bool | None = None, **kwargs: Any) -> ResumableLoader:
        """A loader over a map-style ``dataset`` (``len`` and ``dataset[i]``; items of any
        structure): this rank's shard, in the launcher's order (``shuffle``) or in order,
        ``num_workers`` prefetch processes, pinned memory and batches moved to the device on a
        GPU. The training loader (``train``, one per session) resumes at the exact batch;
        an evaluation loader (``train=False``) covers the whole dataset across the ranks.
        ``shard=False``: the dataset is this rank's share already (e.g. a workload's shard).
        ``prefetch`` (default: on a GPU): a thread reads the next batches and copies them to the
        device on a stream of their own while the current one trains.
        A dataset with ``__getitems__(indices)`` is read a batch per call (torch's batched fetch)."""
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise SessionError(f"session.loader(...) at {user_line()}: a {type(dataset).__name__} is not a map-style "
                               "dataset (len(d) and d[i]); wrap an iterable in a list or a torch Dataset")
        if train and self._train_loader is not None:
            first = self._train_loader.made_at
            if self._in_epochs and first == user_line():
                raise SessionError(f"session.loader(...) at {first} runs again in the next epoch: make the training "
                                   "loader once, before `for epoch in session.epochs():` (it starts each epoch "
                                   "in that epoch's order, and a resumed run at its batch)")
            raise SessionError(f"session.loader(...) at {user_line()}: this session has a training loader already "
                               f"(made at {first}); make it once, before the epoch loop, and make the other "
                               "loaders (evaluation, validation) with train=False")
        n = len(dataset)
        if n < (self.world if train and shard else 1):
            raise SessionError(f"session.loader(...) at {user_line()}: the dataset has {n} item(s) for "
                               f"{self.world} worker(s): a worker would have none; give it more items")
        order = self._strategy.batch_order(self, n, int(batch_size or self.spec.batch_size), train, shuffle and train,
                                           drop_last, shard, dataset)
        if train:
            prefetch = self._strategy.loader_options(num_workers, prefetch)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        if prefetch is None:
            prefetch = self.device.type == "cuda"
        made = ResumableLoader(self, dataset, order, collate_fn=collate_fn, num_workers=num_workers,
                               pin_memory=pin_memory, to_device=to_device, prefetch=prefetch, **kwargs)
        made.made_at = user_line()
        if train:
            self._train_loader = made
            self.steps_per_epoch = order.epoch_length()
        return made

    def _as_metric(self, value: Any) -> Any:
        detach = getattr(value, "detach", None)
        return detach().float() if callable(detach) else float(value)

    def _epoch_ends(self) -> bool:
        loader = self._train_loader
        return loader is not None and loader.batches >= len(loader)

    def _epoch_done(self) -> None:
        if self._train_loader is not None:
            self._train_loader.batches = 0
            self._train_loader.order.epoch_over()

    def _loader_start(self, loader: ResumableLoader) -> int:
        """The batch the training loader starts at: the resumed position once, then 0."""
        if self._resume is None:
            return 0
        (batches, cursor), self._resume = self._resume, None
        loader.order.resume_at(batches, cursor)
        return batches

    def _settle_position(self) -> None:
        """A checkpoint of another layout (worker count, batch size) resumed mid-epoch: the
        training loader continues at the saved cursor in the global order; without one (no
        loader yet, a dataset sharded by the user, a checkpoint without a cursor) the epoch is
        done again from its start, as no position in other shards matches."""
        if not (self._layout_changed and self.pos.step_in_epoch):
            return
        loader = self._train_loader
        if loader is not None and loader.order.is_global and self._resume and self._resume[1] is not None:
            return
        self.pos.step_in_epoch, self._resume, self._carried = 0, None, None

    # -- the loop --------------------------------------------------------------------------
    def _begin(self) -> None:
        """Before the first step: a model registered, the RNG streams set (restored)."""
        if self.model_name is None:
            raise SessionError(f"`session.epochs()` at {user_line()} before any model was registered: call "
                               "session.register(model=model, optimizer=optimizer, ...) first, so checkpoints "
                               "hold the model and the run can export it")
        if self._strategy.requires_prepare and not self._prepared:
            raise SessionError(f"`session.epochs()` at {user_line()}: --strategy {self.strategy} works on the model "
                               "session.prepare(model, optimizer) returns, but it was never called; call it before "
                               "registering them")
        if self._saved or self._strategy.waiting():
            names = ", ".join(sorted([*self._saved, *self._strategy.waiting()]))
            raise SessionError(f"`session.epochs()` at {user_line()}: the checkpoint holds {names}, which this "
                               "run did not register; register the same objects as the run that wrote it")
        self._settle_position()
        if self._rng is not None:
            torch_rng.set_states(self._rng)
            self._rng = None
        else:  # a per-rank stream for dropout and augmentation, as the managed loop
            torch_rng.seed_all(self.spec.seed * 1000 + self.rank + 1)
        self.say_unregistered()
        if self.rank == 0 and "worker_ready" not in self.marks:
            # The checkpoint was found before the training code built its data and model, and
            # restored as each object was registered: both count as setting up.
            self.marks["model_ready"] = self.marks["worker_ready"] = time.time()

    def unregistered(self) -> list[str]:
        """Training state alive in this process that no checkpoint holds: optimizers, LR
        schedulers and enabled GradScalers that were not registered (an optimizer given to
        ``prepare`` counts as registered when what ``prepare`` returned for it is)."""
        import torch

        kinds = ((torch.optim.Optimizer, "optimizer", "its moments and step counts start afresh", "optimizer"),
                 (torch.optim.lr_scheduler.LRScheduler, "LR scheduler", "its schedule starts over", "scheduler"),
                 (torch.optim.lr_scheduler.ReduceLROnPlateau, "LR scheduler", "its schedule starts over",
                  "scheduler"),
                 (torch.amp.GradScaler, "GradScaler", "its loss scale starts over", "scaler"))
        registered = {id(o) for o in self.objects.values()}

        def kept(obj) -> bool:  # registered, stood in for by a registered one, or without state
            return (id(obj) in registered or id(self._stand_ins.get(id(obj))) in registered
                    or (isinstance(obj, torch.amp.GradScaler) and not obj.is_enabled()))

        found: dict[int, str] = {}
        for obj in unregistered_objects(tuple(k[0] for k in kinds), kept):
            what, why, name = next(k[1:] for k in kinds if issubclass(type(obj), k[0]))
            found[id(obj)] = f"the {what} {type(obj).__name__} is not registered ({why}; " \
                             f"session.register({name}=...) keeps it)"
        return sorted(found.values())

    # -- checkpoints -------------------------------------------------------------------------
    def model(self):
        return self.objects[self.model_name]

    def weights_digest(self) -> str:
        from launcher.worker.torch_loop import weights_digest

        return weights_digest(self._strategy.full_state(self.model()))  # a collective where sharded

    def step(self, *, boundary: bool = True, **metrics: Any) -> None:
        if not self._strategy.step_counts():  # not committed (ft): its batch is drawn again
            return
        self._counted_batches = self._train_loader.batches if self._train_loader is not None else 0
        super().step(boundary=boundary, **metrics)

    def send(self, metrics: dict[str, Any], checkpoint: bool = True) -> None:
        if not self._strategy.send(metrics, checkpoint):
            super().send(metrics, checkpoint)

    def preemption_action(self) -> str | None:
        return self._strategy.preemption_action(super().preemption_action)

    def run_function(self) -> None:
        try:
            super().run_function()
        except NothingLeft as done:  # the training is over without this worker
            print(f"rank {self.rank}: nothing left to train: {done}", flush=True)
        finally:
            self._strategy.close()

    def save(self, directory: str, metrics: dict[str, Any]) -> None:
        self._strategy.save(directory, metrics, self.background_save)

    def upload_fn(self):
        """What Ray's upload thread runs for a background save (None: Ray's own upload)."""
        return self._strategy.upload_fn()

    @property
    def train_loader(self) -> ResumableLoader | None:
        return self._train_loader

    def cursor_at(self, batches: int) -> int | None:
        """The epoch's cursor in the global order after ``batches`` of the training loader (None
        without one, or at the epoch's start)."""
        loader = self._train_loader
        return loader.order.cursor_at(batches) if loader is not None and batches else None

    def rng_sizes(self, directory: str) -> dict[str, int]:
        """Write this rank's RNG file; every rank's file and size (a collective)."""
        rng = self._save_rng(directory)
        return self.sizes_over_ranks(torch_rng_file, os.path.getsize(rng))

    def _save_rng(self, directory: str) -> str:
        """This rank's RNG streams and its share of the epoch's metrics so far (a resumed epoch
        reports the whole epoch's means, not only those of the steps after the resume)."""
        return torch_rng.save(directory, self.rank, self._epoch_so_far())

    def can_salvage(self) -> bool:
        if not self._strategy.whole_state_on_rank:  # the last complete checkpoint stands
            return False
        return (bool(self.rank_nodes) and self._watched and self.model_name is not None and self.trained
                and self.boundary and not self.updated)

    def salvage(self, error: BaseException, gone: set[int]) -> str | None:
        if not self._strategy.whole_state_on_rank:
            self._strategy.lost_ranks(gone)
            return None
        return super().salvage(error, gone)

    def save_alone(self, directory: str, metrics: dict[str, Any]) -> bool:
        self._save_rng(directory)
        cursor = self._strategy.save_state(directory, self._counted_batches if self.pos.step_in_epoch else 0)
        self.write_manifest(directory, metrics, cursor=cursor)
        return True

    def restore(self, directory: str) -> None:
        """Read the checkpoint's states into memory; each is loaded when its object is registered."""
        import torch

        manifest = read_manifest(directory)
        if os.path.isfile(os.path.join(directory, STATE_FILE)):
            state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)
        else:  # written by the managed loop before it ran on the session: the optimizer alone
            state = {"optimizer": torch.load(os.path.join(directory, TORCH_OPTIMIZER_FILE), map_location="cpu")}
            state["_launcher"] = {"batches": manifest.step_in_epoch}  # its steps were batches
        info = state.pop("_launcher", {})
        self._saved = state
        self._strategy.restore(directory, state, info, manifest)
        pos = Position(manifest.epoch, manifest.step_in_epoch, manifest.global_step)
        self.restored(pos, manifest)
        self._layout_changed = manifest.world_size != self.world or manifest.batch_size != self.spec.batch_size
        self._rng, carried = self._strategy.rank_state(directory, manifest, info)
        if self.pos.step_in_epoch:
            self._carried = carried
            self._resume = (int(info.get("batches", 0)), manifest.cursor)
