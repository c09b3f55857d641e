"""What a benchmark ran on: CPU model, cores, threads, library versions, GPU.

Every benchmark stores :func:`describe` in its JSON and prints
:func:`header` above its table, so a figure never travels without the
machine and software that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

LIBRARIES = ("ray", "torch", "tensorflow", "horovod", "numpy")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpus() -> list[str]:
    """GPU names from nvidia-smi; empty without one (never imports a framework)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def describe(threads_per_worker: int | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(), "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
        "threads_per_worker": threads_per_worker, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(), "versions": versions(), "gpus": gpus(), **extra,
    }


def header(info: dict[str, Any], what: str) -> str:
    libs = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    gpu = ", ".join(info["gpus"]) if info["gpus"] else "no GPU"
    threads = info.get("threads_per_worker")
    return (f"# {what}\n# {info['date_utc']} on {info['cpu_model']} ({info['cpu_cores']} cores, {gpu})"
            + (f", {threads} thread(s) per worker" if threads else "") + f"\n# {libs}")
