"""Running a benchmark function on Ray Train workers through a launcher backend.

The benchmarks measure the launcher's real path: the backend's own trainer
(:meth:`launcher.backends.Backend.trainer`) starts the workers and sets up
the process group, and the worker function uses the same comm object
(TorchComm/TFComm) as the training loops. Rank 0 hands its result back as a
``result.json`` inside a Ray Train checkpoint, which works on any cluster
whose storage the driver can read.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from typing import Any, Callable

from launcher.driver import apply_ray_train_env, describe_failure, prepare_trainer

RESULT_FILE = "result.json"


def backend_or_reason(name: str, framework: str):
    """(backend, None) when ``name`` can run ``framework`` here, else (None, one-line reason)."""
    from launcher import backends

    if name not in backends.REGISTRY:
        return None, f"backend {name!r} is not part of this launcher build (have: {', '.join(backends.REGISTRY.names())})"
    backend = backends.get(name)
    if framework not in backend.frameworks:
        return None, f"backend {name} does not support {framework} (it supports {', '.join(backend.frameworks)})"
    method = "tf_comm" if framework == "tensorflow" else "torch_comm"
    if getattr(type(backend), method) is getattr(backends.Backend, method):
        return None, f"backend {name} has no {framework} worker side ({method}) in this launcher build"
    reason = backend.unavailable_reason(framework)  # may probe the library in a subprocess: ask once
    return (None, reason) if reason else (backend, None)


BARE_ENV = "LAUNCHER_BENCH_BARE"  # set by benchmarks/bare.py: no Ray, torchrun's or horovodrun's processes


def torch_comm(backend_name: str):
    """The comm a bench worker measures with: its backend's on a Ray Train worker; run bare
    (benchmarks/bare.py), the same collective set up by torchrun (gloo, nccl) or horovodrun."""
    from launcher import backends

    bare = os.environ.get(BARE_ENV)
    if not bare:
        return backends.get(backend_name).torch_comm()
    if bare == "horovod":
        return backends.HorovodComm()
    import torch
    import torch.distributed as dist

    class BareDDPComm(backends.DDPComm):  # DDPComm asks Ray Train for the device
        def device(self):
            if bare == "nccl":
                return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            return torch.device("cpu")

    if not dist.is_initialized():
        dist.init_process_group(bare)  # env:// rendezvous from torchrun
        if bare == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return BareDDPComm()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bare_command(launcher: str, comm: str, workers: int, function: str, config: dict[str, Any]) -> list[str]:
    """``function(config)`` on ``workers`` processes of ``launcher`` (torchrun or horovodrun),
    through benchmarks/bare.py with ``--comm`` gloo, nccl or horovod."""
    bindir = os.path.dirname(sys.executable)
    args = [os.path.join(ROOT, "benchmarks", "bare.py"), "--comm", comm, function, json.dumps(config)]
    if launcher == "horovodrun":
        return [os.path.join(bindir, "horovodrun"), "-np", str(workers), "-H", f"localhost:{workers}",
                sys.executable, *args]
    return [os.path.join(bindir, "torchrun"), *torchrun_port(), f"--nproc-per-node={workers}", *args]


def torchrun_port() -> list[str]:
    """torchrun's rendezvous on a free port: its fixed default (29500) can still be held by the
    previous run, which fails the next one at start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return ["--master-addr=127.0.0.1", f"--master-port={s.getsockname()[1]}"]


def last_json(stdout: str) -> dict:
    """The last JSON object printed; horovodrun prefixes each line with ``[rank]<stdout>:``."""
    lines = [line[line.index("{"):] for line in stdout.strip().splitlines() if "{" in line]
    if not lines:
        raise RuntimeError(f"no JSON result in the output: {stdout.strip()[-200:]!r}")
    return json.loads(lines[-1])


def run_bare(cmd: list[str], threads: int) -> dict[str, Any]:
    """Rank 0's result of a bare run (RuntimeError with its last error line if it failed)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(failure_reason(res.stderr, res.returncode))
    return last_json(res.stdout)


def failure_reason(stderr: str, returncode: int, width: int = 300) -> str:
    """The line of a failed process's stderr that says why. torchrun and horovodrun end with
    a report of their own (ChildFailedError, rows of "=" signs) after the worker's traceback:
    the worker's exception line is what counts, so the first "XxxError: message" line is
    taken, else the last line with words in it."""
    lines = [line.strip() for line in stderr.splitlines() if any(c.isalnum() for c in line)]
    for line in lines:
        head, sep, message = line.partition(": ")
        if sep and message.strip() and head.split(".")[-1].endswith(("Error", "Exception")) and " " not in head \
                and "ChildFailedError" not in head:
            return line[:width]
    return (lines[-1] if lines else f"exit status {returncode}")[:width]


def hand_back(rank: int, result: dict[str, Any]) -> None:
    """Called by every rank at the end (ray.train.report is collective); rank 0's result returns.
    Run bare, rank 0 prints it as one JSON line instead."""
    if os.environ.get(BARE_ENV):
        if rank == 0:
            print(json.dumps(result), flush=True)
        return
    import ray.train

    if rank != 0:
        ray.train.report({"rank": rank})
        return
    with tempfile.TemporaryDirectory(prefix="bench-result-") as d:
        with open(os.path.join(d, RESULT_FILE), "w") as f:
            json.dump(result, f)
        ray.train.report({"rank": rank}, checkpoint=ray.train.Checkpoint.from_directory(d))


def run(backend, framework: str, workload: str, workers: int, threads: int, fn: Callable[[dict], None],
        config: dict[str, Any], gpus_per_worker: float = 0.0, local: bool = True) -> dict[str, Any]:
    """Run ``fn(config)`` on ``workers`` Ray Train workers of ``backend``; return rank 0's result
    (``local``: on a local Ray the benchmark started, as every benchmark here does)."""
    from ray.train import RunConfig, ScalingConfig

    from launcher import JobSpec

    apply_ray_train_env(local)  # the Ray Train settings `launcher run` uses (its health-check period, ...)

    spec = JobSpec(workload=workload, framework=framework, backend=backend.name, workers=workers,
                   cpus_per_worker=float(threads), gpus_per_worker=gpus_per_worker,
                   params=config.get("params", {}), storage=tempfile.gettempdir()).validated()
    resources = {"CPU": float(threads), **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    scaling = ScalingConfig(num_workers=workers, use_gpu=gpus_per_worker > 0, resources_per_worker=resources)
    config = {**config, "backend": backend.name, "threads": threads,
              "env": {"OMP_NUM_THREADS": str(threads), "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}}
    with tempfile.TemporaryDirectory(prefix="launcher-bench-") as storage:
        name = f"bench_{uuid.uuid4().hex[:8]}"
        run_config = RunConfig(name=name, storage_path=storage)
        try:
            result = prepare_trainer(backend.trainer(spec, fn, config, scaling, run_config), local).fit()
        except Exception as exc:
            # Seen with TensorFlow's MultiWorkerMirroredStrategy on a loaded machine: rank 0 has
            # reported its result, then a worker health check fails while the group shuts down.
            # The measurement is complete, so keep it and say what happened.
            found = sorted(glob.glob(os.path.join(storage, name, "checkpoint_*", RESULT_FILE)))
            if not found:
                raise
            with open(found[-1]) as f:
                return {**json.load(f), "note": f"result kept; Ray Train failed after it: {one_line(exc)[:200]}"}
        if result.checkpoint is None:
            raise RuntimeError("the benchmark workers returned no result")
        with result.checkpoint.as_directory() as d, open(os.path.join(d, RESULT_FILE)) as f:
            return json.load(f)


def one_line(exc: BaseException) -> str:
    return describe_failure(exc)
