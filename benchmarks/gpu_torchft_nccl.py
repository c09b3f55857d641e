"""--strategy ft's collective layer on one GPU: torchft's Manager over ProcessGroupNCCL, as
launcher/worker/ft.py builds it (a lighthouse, a TCPStore, the same Manager settings, PGTransport,
torchft's DistributedDataParallel), training a small regression for a few steps on the GPU.

One replica group of one rank: each step forms a quorum, allreduces the gradients through NCCL and
commits. It checks the NCCL path end to end (process group configured per quorum, allreduce on CUDA
tensors, commit) and that the model learns; it is no bandwidth figure. Without a GPU it runs the
same on gloo (ProcessGroupGloo), which is what the test suite covers.

Usage: python benchmarks/gpu_torchft_nccl.py [STEPS]
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft import Optimizer as OptimizerWrapper
from torchft.checkpointing.pg_transport import PGTransport
from torchft.coordination import LighthouseServer


def main(steps: int = 40) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    collective = timedelta(seconds=60)
    pg = (ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=collective)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model.state_dict, "optim": optimizer.state_dict}
    manager = Manager(
        pg=pg, load_state_dict=lambda sd: None, state_dict=lambda: {k: f() for k, f in state.items()},
        min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60), rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=lighthouse.address(), replica_id="replica_00000",
        hostname="127.0.0.1", init_sync=False, checkpoint_transport=PGTransport(pg, timeout=collective, device=device))
    ddp = DistributedDataParallel(manager, model)
    optim = OptimizerWrapper(manager, optimizer)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=generator)
    y = x @ torch.randn(16, 1, generator=generator)
    x, y = x.to(device), y.to(device)
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        optim.zero_grad()  # starts the step's quorum
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # gradients allreduced through the quorum's process group
        optim.step()  # commits when every rank of the quorum may
        losses.append(loss.item())
    took = time.perf_counter() - started
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"torchft on {name} ({type(pg).__name__}): {steps} steps, {manager.current_step()} committed, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {took / steps * 1e3:.1f} ms a step with its quorum")
    manager.shutdown()
    lighthouse.shutdown()
    assert manager.current_step() == steps and losses[-1] < losses[0] / 4, losses
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 40))
