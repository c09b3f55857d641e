"""How the launcher builds its Ray Train trainers, lean on start-up.

Every backend's trainer is a :class:`LeanTrainer`: Ray Train's own
DataParallelTrainer, less the parts a launcher run never uses. Measured on a
2-core machine (``launcher run --profile-startup``), these are seconds of a
short run:

* Ray Train always adds its Ray Data callback, which starts a DatasetManager
  actor (one more Python process importing Ray Data) and sends Ray Data's
  context to every worker, even when the trainer is given no datasets. Our
  workloads read their own data, so without datasets the callback is dropped.
* Ray Train starts a detached PlacementGroupCleaner actor per run (another
  process) to remove the workers' placement group should the controller die
  while the driver lives on. The launcher's driver always ends when the run
  ends, and Ray removes a finished job's placement groups itself, so it is
  dropped too (``LAUNCHER_PG_CLEANER=1`` keeps it).
* Ray's ``TorchConfig`` lives in a module that imports torch at the top, so
  the driver and Ray Train's controller (a fresh process on every run) both
  import torch just to hold the config. :class:`TorchProcessGroup` is the same
  configuration with the same worker-side set-up (Ray's own functions, called
  on the workers), in a module without torch; it also needs two round trips
  to the workers where Ray's backend makes four.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray.train.backend import Backend, BackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from launcher import _ray
from launcher.settings import PG_CLEANER


class LeanTrainer(DataParallelTrainer):
    """DataParallelTrainer without Ray Data's callback (when it has no datasets), without the
    placement-group cleaner and, where ``request_resources`` is False (a local Ray: no
    autoscaler to ask), without Ray's autoscaling coordinator for a fixed-size group. An
    elastic group gets :class:`launcher.backends.elastic.ElasticNow`, Ray's elastic policy
    over the cluster as it is now."""

    request_resources = True

    def _create_default_callbacks(self):  # listed in launcher._ray.OVERRIDDEN
        unused = () if self.datasets else (_ray.DatasetsCallback,)
        if PG_CLEANER.get() != "1":
            unused += (_ray.PlacementGroupCleanerCallback,)
        ours = getattr(self.backend_config, "callbacks", None)  # what the backend needs of the controller
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)] + \
            (ours() if ours is not None else [])

    def _initialize_and_run_controller(self, **kwargs):  # listed in launcher._ray.OVERRIDDEN
        policy = kwargs.get("scaling_policy")
        if not self.request_resources and type(policy) is _ray.FixedScalingPolicy:
            kwargs["scaling_policy"] = FixedWithoutRequests(scaling_config=policy.scaling_config)
        elif type(policy) is _ray.ElasticScalingPolicy:
            from launcher.backends.elastic import ElasticNow

            board = (self.train_loop_config or {}).get("board")
            kwargs["scaling_policy"] = ElasticNow(policy.scaling_config, board=board)
        return super()._initialize_and_run_controller(**kwargs)


class FixedWithoutRequests(_ray.FixedScalingPolicy):
    """Ray Train's fixed-size policy, minus its resource requests.

    Every policy registers the group's resources with Ray's autoscaling coordinator, a detached
    actor that forwards them to the cluster's autoscaler. On a local Ray there is no autoscaler
    to add nodes, and starting the coordinator is one more process on the first run's critical
    path (the controller waits for it: 1.2 s of a cold 2-worker start on 2 cores) and an actor
    that polls while the workers train."""

    def after_controller_start(self, train_run_context) -> None:
        pass  # no coordinator client: Ray's cancel on shutdown and on abort then does nothing

    def _maybe_send_resource_request(self) -> None:  # listed in launcher._ray.OVERRIDDEN
        pass


def trainer(train_fn, loop_config, backend_config, scaling_config, run_config, datasets=None) -> LeanTrainer:
    return LeanTrainer(train_fn, train_loop_config=loop_config, backend_config=backend_config,
                       scaling_config=scaling_config, run_config=run_config, datasets=datasets)


# ---- torch.distributed without importing torch outside the workers ----

def _worker_address() -> tuple[str, int]:
    return _ray.get_address_and_port()


def _join_process_group(master: tuple[str, int], backend: str, rank: int, world: int, timeout_s: int) -> None:
    """On each worker: torchrun's variables, then init_process_group by Ray's own routine."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
    _ray.set_torch_distributed_env_vars()
    _ray.setup_torch_process_group(backend=backend, world_rank=rank, world_size=world, init_method="env://",
                               timeout_s=timeout_s)


def _leave_process_group(destroy: bool) -> None:
    _ray.shutdown_torch(destroy_process_group=destroy)


class _CudaDevice:
    """Ray's TorchConfigContextManager (the worker's default CUDA device), imported on the worker."""

    def __enter__(self):
        self._inner = _ray.TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


class _ProcessGroupBackend(Backend):
    def on_start(self, worker_group, backend_config: "TorchProcessGroup") -> None:
        import ray

        backend = backend_config.backend
        if backend is None:
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        master = worker_group.execute_single(0, _worker_address)
        world = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, _join_process_group, master, backend, rank, world,
                                                   backend_config.timeout_s)
                 for rank in range(world)])

    def on_shutdown(self, worker_group, backend_config) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(worker_group.execute_async(_leave_process_group, len(worker_group) > 1), timeout=30)
        except GetTimeoutError:
            pass  # Ray's TorchConfig also gives up on a hung shutdown and goes on


class TorchWorkers(BackendConfig):
    """A torch backend's config: each worker's default CUDA device set, and marked as torch."""

    @property
    def train_func_context(self):
        return _CudaDevice

    @property
    def framework(self):
        return _ray.TrainingFramework.TORCH


@dataclass
class TorchProcessGroup(TorchWorkers):
    """Ray's TorchConfig (env:// rendezvous) for CPU and GPU, minus torch in the driver and controller."""

    backend: str | None = None  # None: nccl with GPUs, else gloo
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _ProcessGroupBackend
