"""A launcher workload or training function without Ray, started by torchrun or horovodrun.

``torchrun --nproc-per-node 2 benchmarks/torchrun_session.py --workload digits-mlp`` trains
with the same data, model, optimizer, batch size and loop code as ``launcher run`` (the
managed loop and a user's training function both run on a session: here
:class:`launcher.worker.bare.BareSession`, the same session less Ray, checkpoints and
preemption polls), so a benchmark compares launchers, not training code. Rank 0 prints
one JSON line with its timings and the last epoch's metrics.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

STARTED = time.time()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="digits-mlp", help="a built-in workload, FILE.py:NAME or module:NAME")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="as launcher run's --strategy")
    p.add_argument("--comm", choices=("ddp", "horovod"), default="ddp",
                   help="ddp: torch.distributed from torchrun's env; horovod: under horovodrun")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)

    import torch
    import torch.distributed as dist

    import workloads
    from launcher import JobSpec
    from launcher.backends import DDPComm
    from launcher.worker import BareSession, managed

    class LocalComm(DDPComm):  # DDPComm asks Ray Train for the device; here torchrun's LOCAL_RANK says
        def device(self):
            if torch.cuda.is_available():
                return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            return torch.device("cpu")

    if args.comm == "horovod":
        from launcher.backends import HorovodComm

        comm = HorovodComm()
    else:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # env:// from torchrun
        comm = LocalComm()
    comm.setup()
    params = dict(p.split("=", 1) for p in args.param)
    spec = JobSpec(workload=args.workload, workers=comm.world_size, epochs=args.epochs, storage="/tmp",
                   batch_size=args.batch_size, data=args.data, params=params, strategy=args.strategy,
                   backend="horovod" if args.comm == "horovod" else "native",
                   preemption_check_steps=0).validated()
    workload = workloads.get(spec.workload)
    function = workload if isinstance(workload, workloads.TrainingFunction) else managed(workload)
    session = BareSession(spec, comm, function)
    ready = time.time()
    session.start()
    if comm.rank == 0:
        epochs = [r for r in session.reports if r.get("kind") == "epoch"]
        epoch = epochs[-1]
        # As the launcher's summary counts it: all epochs' samples over their training time.
        rate = sum(r["samples"] for r in epochs) / max(1e-9, sum(r["train_time_s"] for r in epochs))
        first = session.marks.get("first_step")
        # The overhead benchmark passes its own launch time, so this counts from the command's start.
        launched = float(os.environ.get("BENCH_LAUNCHED", STARTED))
        print(json.dumps({"process_start_to_ready_s": ready - STARTED, "accuracy": epoch.get("accuracy"),
                          "metrics": {k: v for k, v in epoch.items() if isinstance(v, (int, float))},
                          "samples_per_s": rate, "threads": torch.get_num_threads(),
                          "first_step_s": (first - launched) if first else None,
                          "omp": os.environ.get("OMP_NUM_THREADS")}), flush=True)
    if args.comm == "ddp":
        # Both ranks done before either tears down, and DDP's reference to the group dropped
        # first: a rank that destroyed its group while the other still exited aborted now and
        # then on a loaded machine ("terminate called without an active exception").
        dist.barrier()
        del session, function

        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
