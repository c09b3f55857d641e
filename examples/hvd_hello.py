"""A minimal script written for horovodrun: `launcher run --script examples/hvd_hello.py
--backend horovod --workers 2 -- --lr 0.1` runs it unmodified on Ray workers."""

import sys

import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
print(f"rank {hvd.rank()} of {hvd.size()}, local rank {hvd.local_rank()}, "
      f"allreduce sum {total:g}, args {sys.argv[1:]}")
