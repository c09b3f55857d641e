"""The launcher's torch training loop without Ray, started by torchrun.

``torchrun --nproc-per-node 2 benchmarks/torchrun_digits.py --epochs 1`` trains
digits-mlp with the same data shards, model, optimizer, batch size and loop
code (launcher.worker.torch_loop.TorchTraining) as ``launcher run``, so the
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
    p.add_argument("--comm", choices=("ddp", "horovod"), default="ddp",
                   help="ddp: torch.distributed from torchrun's env; horovod: under horovodrun")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from launcher import JobSpec
    from launcher.backends import DDPComm
    from launcher.worker import TorchTraining

    class CpuComm(DDPComm):  # DDPComm asks Ray Train for the device; here it is the CPU
        def device(self):
            return torch.device("cpu")

    if args.comm == "horovod":
        from launcher.backends import HorovodComm

        comm = HorovodComm()
    else:
        dist.init_process_group("gloo")  # env:// rendezvous from torchrun
        comm = CpuComm()
    comm.setup()
    # No Ray Train here, so no preemption notices to poll for.
    spec = JobSpec(workload=args.workload, workers=comm.world_size, epochs=args.epochs, storage="/tmp",
                   backend="horovod" if args.comm == "horovod" else "native",
                   preemption_check_steps=0).validated()
    training = TorchTraining(spec, comm)
    ready = time.time()
    training.marks["worker_ready"] = ready  # makes run_epoch mark its first step
    training.prepare()  # the backend's wrapped model and optimizer, every rank's state equal
    stats = {}
    for _ in range(spec.epochs):
        stats = training.run_epoch()
        training.pos.epoch, training.pos.step_in_epoch = training.pos.epoch + 1, 0
        stats.update(training.evaluate())
    if comm.rank == 0:
        first = training.marks.get("first_step")
        # The overhead benchmark passes its own launch time, so this counts from the command's start.
        launched = float(os.environ.get("BENCH_LAUNCHED", STARTED))
        print(json.dumps({"process_start_to_ready_s": ready - STARTED, "accuracy": stats["accuracy"],
                          "samples_per_s": stats["samples_per_s"], "threads": torch.get_num_threads(),
                          "first_step_s": (first - launched) if first else None,
                          "omp": os.environ.get("OMP_NUM_THREADS")}))
    if args.comm == "ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
