"""Ray Train's native backend: torch DistributedDataParallel (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

from launcher.backends import Backend, TorchComm


class DDPComm(TorchComm):
    """torch.distributed as set up by Ray Train's TorchTrainer."""

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


class NativeBackend(Backend):
    name = "native"
    description = "Ray Train's own: torch DDP (gloo on CPU, nccl on GPU)"
    frameworks = ("torch",)

    def trainer(self, spec, train_fn, loop_config, scaling_config, run_config):
        from ray.train.torch import TorchConfig, TorchTrainer

        return TorchTrainer(
            train_fn,
            train_loop_config=loop_config,
            torch_config=TorchConfig(backend="nccl" if spec.gpus_per_worker > 0 else "gloo"),
            scaling_config=scaling_config,
            run_config=run_config,
        )

    # Script mode: a script written for torchrun calls init_process_group("env://")
    # itself, so its workers get a plain trainer (no process group of Ray's) and
    # torchrun's variables, with rank 0's address and a free port as the master.
    runs_scripts = True

    def script_trainer(self, spec, train_fn, config, scaling_config, run_config):
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        return DataParallelTrainer(train_fn, train_loop_config=config, scaling_config=scaling_config,
                                   run_config=run_config)

    def script_env(self, framework: str) -> dict[str, str]:
        import socket

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

    def torch_comm(self, spec=None) -> TorchComm:
        return DDPComm()
