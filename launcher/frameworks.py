"""The frameworks a run trains with (``--framework``), by name: what each needs from the rest.

One entry per framework, and the one place that knows how they differ:

- on the worker, what must happen before user code imports it (:meth:`Framework.configure`)
  and which of our sessions trains with it (:meth:`Framework.train`: the communicator the
  backend gives, then the session, running the user's training function or the framework's
  managed loop for a workload);
- on the driver, the Ray Train backend config of Ray's own (native) backend for it, and the
  datasets a Ray Train function of it reads (:meth:`Framework.native_backend`);
- for an unmodified program on the native backend, the environment its platform would give
  it and how many threads it may use (:meth:`Framework.program_env`, ``program_threads``);
- how a run's progress counts (``step_word``: XGBoost's steps are boosting rounds);
- which extra of the launcher installs it (``extra``; torch is in the core): a run of our
  session or loop checks it on the driver and on each worker (:meth:`Framework.require`).

``framework == "..."`` is written here and in the spec's validation, nowhere else. The
registry sits below the worker and the backends in the import order (both read it), so it
names their parts by path, imported when used (:func:`_part`), as TorchX's scheduler
registry names its schedulers; torch, TensorFlow and XGBoost are never imported here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
from typing import Any

import workloads
from launcher import _deferred
from launcher.errors import UserError


def _part(path: str) -> Any:
    """``"package.module:name"`` imported (the worker's sessions, the backends' configs)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class Framework:
    """The interface (see the module docstring)."""

    name = ""
    step_word = "steps"           # what one unit of progress is called in the summary
    counts_epochs = True          # its runs go through epochs of steps (XGBoost's: one epoch of many rounds)
    line_per_checkpoint = False   # progress says each checkpoint (one epoch of many rounds), not only epochs
    joins_checkpoints = False     # `launcher checkpoint export` makes one model file of its checkpoints
    program_threads: str | None = None  # OMP_NUM_THREADS for a program on the native backend (None: all cores)
    program_env_names: tuple[str, ...] = ()  # what program_env() sets that a user would look for by name
    extra: str | None = None      # the launcher's extra that installs it (pyproject.toml), None: the core
    session: str | None = None  # our session for it, "module:class" (None: it trains only in programs)
    managed_loop: str | None = None  # "module:function", (session, workload) -> None: how the session trains a
    #                                  workload (None: the session trains one itself)

    preload: tuple[str, ...] = ()  # modules a warm head's pool imports ahead, besides the session's
    comm_method: str | None = None  # the Backend method that gives its communicator (None: its own)

    def worker_modules(self) -> tuple[str, ...]:
        """What the warm head's pool processes import ahead for a run of this framework
        (launcher.worker.pool): its libraries, our session and managed loop."""
        ours = tuple(path.partition(":")[0] for path in (self.session, self.managed_loop) if path)
        return ("launcher.worker.entry", *self.preload, *ours)

    def require(self) -> None:
        """The one-line UserError when our code would train with this framework and its extra is
        not installed here (a program brings its own framework)."""
        if self.extra:
            _deferred.require(self.extra, f"--framework {self.name}")

    def configure(self, spec) -> None:
        """On the worker, before the training code (and with it the framework) is imported."""
        self.require()  # a node set up without the extra

    def communicator(self, spec, backend) -> Any:
        """On the worker: what the session's ranks join and reduce through (not yet set up)."""
        if self.comm_method is None:
            raise NotImplementedError
        return getattr(backend, self.comm_method)(spec)

    def train(self, spec, backend, function, config: dict[str, Any], started: float) -> None:
        """On the worker: join the backend's workers and train with our session: the user's
        training function ``function``, or (None) the managed loop for the spec's workload."""
        if self.session is None:
            raise UserError(f"--framework {self.name} trains only in a program of the user's (--script or --package)")
        comm = self.communicator(spec, backend)
        comm.setup()
        if function is None and self.managed_loop is not None:
            loop = _part(self.managed_loop)
            function = _part("launcher.worker.usersession:training_function")(workloads.get(spec.workload), loop)
        _part(self.session)(spec, comm, function).start(config, started)

    def native_backend(self, spec) -> tuple[Any, Any]:
        """(Ray Train backend config, datasets or None) of Ray's own backend for this framework."""
        raise UserError(f"--framework {self.name} has no training loop of the launcher's",
                        "run it as a program (--script or --package)")

    def program_backend(self, spec) -> Any:
        """The Ray Train backend config a program of this framework runs under on the native
        backend (None: a plain trainer; the program sets up its own process group)."""
        return None

    def program_env(self) -> dict[str, str]:
        """On a program's worker, on the native backend: what its platform's launcher would set."""
        return {}

    def horovod_env(self) -> dict[str, str]:
        """On a program's worker under Horovod, beside Horovod's ring variables."""
        return {}


class Torch(Framework):
    name = "torch"
    joins_checkpoints = True
    program_threads = "1"  # torchrun's default for several processes
    session = "launcher.worker.session:TorchSession"
    managed_loop = "launcher.worker.torch_loop:train_workload"
    preload = ("torch", "ray.train.torch")
    comm_method = "torch_comm"

    def native_backend(self, spec):
        if spec.replica_groups:  # --strategy ft: a torchft replica group per worker, no process group across
            if importlib.util.find_spec("torchft") is None:
                raise UserError("--strategy ft needs torchft, which is not installed here",
                                "pip install 'launcher[torchft]' (on every node of a cluster too)")
            groups = _part("launcher.backends.replicas:ReplicaGroups")
            return groups(min_replicas=spec.min_workers or spec.workers), None
        # Ray's TorchTrainer with TorchConfig, less torch in the driver and controller (raytrain.py).
        group = _part("launcher.backends.raytrain:TorchProcessGroup")
        return group(backend="nccl" if spec.gpus_per_worker > 0 else "gloo"), None

    def program_env(self) -> dict[str, str]:
        """torchrun's variables: a script calls init_process_group("env://") itself, with rank 0's
        address and a free port as the master."""
        import ray
        import ray.train
        from ray.train.collective import broadcast_from_rank_zero

        ctx = ray.train.get_context()
        master = None
        if ctx.get_world_rank() == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                master = (ray.util.get_node_ip_address(), s.getsockname()[1])
        addr, port = broadcast_from_rank_zero(master)
        return {"MASTER_ADDR": addr, "MASTER_PORT": str(port),
                "RANK": str(ctx.get_world_rank()), "WORLD_SIZE": str(ctx.get_world_size()),
                "LOCAL_RANK": str(ctx.get_local_rank()), "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
                "GROUP_RANK": str(ctx.get_node_rank()), "NODE_RANK": str(ctx.get_node_rank())}


class TensorFlow(Framework):
    name = "tensorflow"
    program_env_names = ("TF_CONFIG",)
    extra = "tensorflow"
    session = "launcher.worker.tf_session:TFSession"
    managed_loop = "launcher.worker.tf_loop:train_workload"
    comm_method = "tf_comm"

    def worker_modules(self) -> tuple[str, ...]:
        # None of TensorFlow's: configure() must run before TensorFlow is imported.
        return ("launcher.worker.entry",)

    def configure(self, spec) -> None:
        super().configure(spec)
        # The legacy tf.keras, and TensorFlow's thread pools sized to the worker's CPUs.
        _part("launcher.worker.tf_session:configure_tensorflow")(max(1, int(spec.cpus_per_worker)))

    def native_backend(self, spec):
        # Ray's TensorflowTrainer does the same, but importing ray.train.tensorflow imports
        # TensorFlow into the driver (seconds, and C++ log noise) for nothing.
        return _part("launcher.backends.native:tf_config")(), None

    def program_backend(self, spec):
        # A TF_CONFIG script builds its own MultiWorkerMirroredStrategy: its workers get the same
        # TF_CONFIG backend as our TensorFlow loop, and the variable in their environment.
        return _part("launcher.backends.native:tf_config")()

    def program_env(self) -> dict[str, str]:
        # tf-keras is installed: Keras 3's model.fit fails under MultiWorkerMirroredStrategy.
        return {"TF_CONFIG": os.environ["TF_CONFIG"], "TF_USE_LEGACY_KERAS": "1"}

    def horovod_env(self) -> dict[str, str]:
        return {"TF_USE_LEGACY_KERAS": "1"}  # horovod.tensorflow needs the legacy tf.keras


class XGBoost(Framework):
    name = "xgboost"
    step_word = "rounds"
    extra = "xgboost"
    counts_epochs = False
    line_per_checkpoint = True
    session = "launcher.worker.xgb_loop:BoostingTraining"  # the boosting rounds: a workload only

    def communicator(self, spec, backend):
        return _part("launcher.worker.xgb_loop:XGBComm")()  # XGBoost's own collective, whatever the backend

    def native_backend(self, spec):
        # Ray Train's XGBoost backend: XGBoost's tracker on the controller, each worker's training
        # function inside XGBoost's communicator.
        from ray.train.xgboost import XGBoostConfig

        datasets = None
        if spec.data is not None and workloads.is_ray_train(spec.workload):
            # A function written for XGBoostTrainer reads ray.train.get_dataset_shard("train") and
            # ("validation"): the table as Ray Data datasets, each worker given its share.
            from launcher.data.tables import DEFAULT_TEST_FRACTION, ray_datasets

            datasets = ray_datasets(spec.data, spec.params.get("test_fraction", DEFAULT_TEST_FRACTION))
        return XGBoostConfig(), datasets


class ScikitLearn(Framework):
    """Only a program's (a scikit-learn trainer package or script): it trains on its own."""

    name = "sklearn"


REGISTRY: dict[str, Framework] = {f.name: f for f in (Torch(), TensorFlow(), XGBoost(), ScikitLearn())}


def get(name: str) -> Framework:
    """The framework called ``name`` (the spec has checked it); a name no entry has (a run log
    that does not say) gets the interface's defaults."""
    return REGISTRY.get(name) or Framework()
