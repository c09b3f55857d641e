"""A benchmark's worker function without Ray: the bare baseline it is compared with.

``torchrun --nproc-per-node N benchmarks/bare.py --comm gloo MODULE:FUNCTION
CONFIG_JSON`` (or ``nccl``; or ``horovodrun -np N -H localhost:N python
benchmarks/bare.py --comm horovod ...``) calls the same worker function that
`launcher bench` runs on Ray Train workers, with the same config. Only the
set-up differs: the process group comes from torchrun's environment (or
``hvd.init()`` under horovodrun) instead of Ray Train's, see
:func:`benchmarks.raywork.torch_comm`; rank 0 prints its result as one JSON
line instead of handing it back to Ray. So the launcher/bare ratio a bench
prints compares launchers, not loops.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

from benchmarks import raywork  # noqa: E402 - importable once the path above is set


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--comm", choices=("gloo", "nccl", "horovod"), required=True)
    p.add_argument("function", help="MODULE:FUNCTION, e.g. benchmarks.allreduce:worker")
    p.add_argument("config", help="the worker's config, as JSON")
    args = p.parse_args()

    os.environ[raywork.BARE_ENV] = args.comm
    module, _, name = args.function.partition(":")
    getattr(importlib.import_module(module), name)(json.loads(args.config))
    if args.comm != "horovod":
        # torch 2.13's gloo aborts about one exit in three ("terminate called without an
        # active exception") when the process group is left to the interpreter's teardown.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
