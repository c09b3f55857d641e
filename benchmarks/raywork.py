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
import tempfile
import uuid
from typing import Any, Callable

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


def hand_back(rank: int, result: dict[str, Any]) -> None:
    """Called by every rank at the end (ray.train.report is collective); rank 0's result returns."""
    import ray.train

    if rank != 0:
        ray.train.report({"rank": rank})
        return
    with tempfile.TemporaryDirectory(prefix="bench-result-") as d:
        with open(os.path.join(d, RESULT_FILE), "w") as f:
            json.dump(result, f)
        ray.train.report({"rank": rank}, checkpoint=ray.train.Checkpoint.from_directory(d))


def run(backend, framework: str, workload: str, workers: int, threads: int, fn: Callable[[dict], None],
        config: dict[str, Any], gpus_per_worker: float = 0.0) -> dict[str, Any]:
    """Run ``fn(config)`` on ``workers`` Ray Train workers of ``backend``; return rank 0's result."""
    from ray.train import RunConfig, ScalingConfig

    from launcher import JobSpec

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
            result = backend.trainer(spec, fn, config, scaling, run_config).fit()
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
    from launcher.driver import describe_failure

    return describe_failure(exc)
