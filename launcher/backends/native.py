"""Ray Train's native backends: torch DistributedDataParallel (gloo on CPU, nccl on GPU)
and TensorFlow's MultiWorkerMirroredStrategy."""

from __future__ import annotations

import json
import os
import socket

from launcher import frameworks
from launcher.backends.base import Backend, TFComm, TorchComm


class DDPComm(TorchComm):
    """torch.distributed as set up by raytrain.TorchProcessGroup (Ray's own set-up routine)."""

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def device(self):
        import ray.train.torch

        return ray.train.torch.get_device()

    def wrap_model(self, model):
        from torch.nn.parallel import DistributedDataParallel

        if self.world_size == 1:
            return model
        device = self.device()
        ids = [device.index] if device.type == "cuda" and device.index is not None else None
        # DDP broadcasts rank 0's parameters and buffers here, so every rank starts equal.
        return DistributedDataParallel(model, device_ids=ids)

    def allreduce_sum(self, tensor):
        import torch.distributed as dist

        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


class MirroredComm(TFComm):
    """TensorFlow's MultiWorkerMirroredStrategy, on the TF_CONFIG Ray's TensorflowTrainer sets."""

    def setup(self) -> None:
        import tensorflow as tf

        task = json.loads(os.environ["TF_CONFIG"])
        self._rank, self._world = task["task"]["index"], len(task["cluster"]["worker"])
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def scope(self):
        return self.strategy.scope()

    def train_step(self, model, optimizer, loss):
        import tensorflow as tf

        strategy, world = self.strategy, self._world

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = loss(y, model(x, training=True))
                # The strategy sums gradients over the workers, so divide by the global batch.
                global_batch = tf.cast(tf.shape(per_example)[0] * world, per_example.dtype)
                scaled = tf.reduce_sum(per_example) / global_batch
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return tf.reduce_mean(per_example)

        @tf.function(reduce_retracing=True)
        def step(x, y):
            return strategy.experimental_local_results(strategy.run(replica_step, args=(x, y)))[0]

        return step

    def allreduce_sum(self, values):
        import tensorflow as tf

        if self._world == 1:
            return values
        tensor = tf.constant(values)
        per_replica = self.strategy.run(lambda: tf.identity(tensor))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()


def _worker_address() -> str:
    import ray.util

    with socket.socket() as sock:  # a port free now; TensorFlow binds it moments later
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def _set_tf_config(addresses: list[str], index: int) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                          "task": {"type": "worker", "index": index}})
    os.environ["TF_USE_LEGACY_KERAS"] = "1"


def tf_config():
    """A Ray Train BackendConfig that gives every worker the TF_CONFIG of one worker cluster."""
    from ray.train.backend import Backend as RayBackend, BackendConfig

    class TFConfigBackend(RayBackend):
        def on_start(self, worker_group, backend_config) -> None:
            import ray

            addresses = worker_group.execute(_worker_address)
            ray.get([worker_group.execute_single_async(i, _set_tf_config, addresses, i)
                     for i in range(len(addresses))])

    class TFConfig(BackendConfig):
        @property
        def backend_cls(self):
            return TFConfigBackend

    return TFConfig()


class NativeBackend(Backend):
    name = "native"
    description = ("Ray Train's own: torch DDP (gloo on CPU, nccl on GPU), TF MultiWorkerMirroredStrategy, "
                   "XGBoost's collective")
    frameworks = ("torch", "tensorflow", "xgboost")

    def trainer(self, spec, train_fn, loop_config, scaling_config, run_config):
        from launcher.backends import raytrain

        backend, datasets = frameworks.get(spec.framework).native_backend(spec)
        return raytrain.trainer(train_fn, loop_config, backend, scaling_config, run_config, datasets=datasets)

    # Script mode: what each framework's program gets (a plain trainer and torchrun's variables,
    # TF_CONFIG, or nothing for one that trains alone) is the framework's (launcher.frameworks).
    runs_scripts = True

    def script_trainer(self, spec, train_fn, config, scaling_config, run_config):
        from launcher.backends import raytrain

        backend = frameworks.get(spec.framework).program_backend(spec)
        return raytrain.trainer(train_fn, config, backend, scaling_config, run_config)

    def script_threads(self, framework: str) -> str | None:
        return frameworks.get(framework).program_threads

    def script_env(self, framework: str) -> dict[str, str]:
        return frameworks.get(framework).program_env()

    def torch_comm(self, spec=None) -> TorchComm:
        if spec is not None and spec.replica_groups:
            from launcher.backends.replicas import ReplicaComm

            return ReplicaComm()
        return DDPComm()

    def tf_comm(self, spec=None) -> TFComm:
        return MirroredComm()
