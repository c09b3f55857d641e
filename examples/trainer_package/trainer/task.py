"""Train the digits classifier: `python -m trainer.task --job-dir DIR [--epochs N] [--lr LR]`.

Written as for Vertex AI custom training, and nothing else:

* distributed with torch DDP from torchrun's variables (MASTER_ADDR, RANK,
  WORLD_SIZE), or on one process when they are not set;
* checkpoints to AIP_CHECKPOINT_DIR every epoch, and resumes from there at
  the exact step it reached (so a restarted job loses nothing);
* on SIGTERM (Vertex AI and the launcher send it before a preemption) every
  rank stops at the same step, rank 0 saves a checkpoint, and it exits;
* reports the test accuracy to the hyperparameter tuning service with
  cloudml-hypertune, and writes the model to AIP_MODEL_DIR at the end.
"""

import argparse
import json
import os
import signal
import time

import hypertune
import torch
import torch.distributed as dist

from trainer import storage
from trainer.model import accuracy, build_model, load_data

stop_requested = False


def on_sigterm(signum, frame):
    global stop_requested
    stop_requested = True


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-dir", required=True, help="where outputs go when AIP_*_DIR are not set")
    parser.add_argument("--epochs", type=int, default=10)
    # --learning_rate: the name AI Platform's tuning examples give the parameter
    parser.add_argument("--lr", "--learning_rate", "--learning-rate", dest="lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait each step (demos)")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="rank 1 crashes at this step (demos)")
    return parser.parse_args()


def all_agree(flag: bool, distributed: bool) -> bool:
    """True when any rank says so: every rank then stops at the same step."""
    if not distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    checkpoint_dir = os.environ.get("AIP_CHECKPOINT_DIR") or storage.join(args.job_dir, "checkpoints")
    model_dir = os.environ.get("AIP_MODEL_DIR") or storage.join(args.job_dir, "model")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    distributed = world > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_data()
    model = build_model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    per_epoch = len(x_train) // (args.batch_size * world)
    total = per_epoch * args.epochs

    step = 0
    checkpoint_file = storage.join(checkpoint_dir, "checkpoint.pt")
    state = storage.load(checkpoint_file)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"resumed from step {step} of {total}", flush=True)
    if distributed:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ddp = model

    def save(why):
        if rank == 0:
            storage.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                         checkpoint_file)
            print(f"saved checkpoint at step {step} ({why})", flush=True)

    tuner = hypertune.HyperTune()
    started = time.time()
    while step < total:
        epoch, index = divmod(step, per_epoch)
        # The same order on every run: a resumed job sees the batches it had not seen yet.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        batch = order[(index * world + rank) * args.batch_size:][:args.batch_size]
        loss = torch.nn.functional.cross_entropy(ddp(x_train[batch]), y_train[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 1 and step == args.fail_at_step and state is None:  # once: not after a resume
            raise SystemExit(f"rank 1: failing at step {step} on purpose")
        time.sleep(args.step_sleep)
        if all_agree(stop_requested, distributed):
            save("SIGTERM")
            notice = os.environ.get("LAUNCHER_PREEMPTION_FILE")  # the launcher's; Vertex AI has none
            if notice and os.path.exists(notice):  # on the ranks whose node got the notice
                with open(notice) as f:
                    print(f"preemption notice: {json.load(f)['seconds_left']}s were left", flush=True)
            return
        if step % per_epoch == 0:
            acc = accuracy(model, x_test, y_test)
            print(f"epoch {step // per_epoch}/{args.epochs} step {step} loss {loss.item():.4f} "
                  f"accuracy {acc:.4f} ({time.time() - started:.1f}s)", flush=True)
            if rank == 0:
                tuner.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy", metric_value=acc,
                                                          global_step=step)
            save(f"epoch {step // per_epoch}")
    if rank == 0:
        storage.save(model.state_dict(), storage.join(model_dir, "model.pt"))
        storage.save({"hidden": args.hidden}, storage.join(model_dir, "config.pt"))
        print(f"exported the model to {model_dir} after {step} steps", flush=True)
        print(json.dumps({"final_step": step, "accuracy": accuracy(model, x_test, y_test)}), flush=True)
    if distributed:
        dist.barrier()  # leave together: a rank tearing down while another still talks can abort
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
