"""The launcher's torch training loop without Ray, started by torchrun.

``torchrun --nproc-per-node 2 benchmarks/torchrun_digits.py --epochs 1`` trains
digits-mlp with the same data shards, model, optimizer, batch size and loop
code (launcher.train_torch.TorchTraining) as ``launcher run``, so the
overhead benchmark compares launchers, not training code. Rank 0 prints one
JSON line with its timings.
"""

from __future__ import annotations

import argparse
import json
import os
import time

STARTED = time.time()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--workload", default="digits-mlp")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from launcher.backends.native import DDPComm
    from launcher.spec import JobSpec
    from launcher.train_torch import TorchTraining

    class CpuComm(DDPComm):  # DDPComm asks Ray Train for the device; here it is the CPU
        def device(self):
            return torch.device("cpu")

    dist.init_process_group("gloo")  # env:// rendezvous from torchrun
    world = dist.get_world_size()
    spec = JobSpec(workload=args.workload, workers=world, epochs=args.epochs, storage="/tmp").validated()
    training = TorchTraining(spec, CpuComm())
    ready = time.time()
    model = training.comm.wrap_model(training.module)
    stats = {}
    for _ in range(spec.epochs):
        stats = training.run_epoch(model, training.optimizer)
        training.pos.epoch, training.pos.step_in_epoch = training.pos.epoch + 1, 0
        stats.update(training.evaluate())
    if dist.get_rank() == 0:
        print(json.dumps({"process_start_to_ready_s": ready - STARTED, "accuracy": stats["accuracy"],
                          "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
