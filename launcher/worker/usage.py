"""How busy each worker is: CPU, memory and GPU, sampled every few seconds.

A daemon thread in each worker takes a sample every 5 seconds
(``LAUNCHER_USAGE_S`` sets it; 0 turns sampling off): the CPU its process and their
children (data-loading workers, a program's process) used since the last sample, as a
percentage of one core; their resident memory; and on a GPU, the device's utilisation and the
memory this process holds there (NVIDIA's NVML). The samples ride with the rank's next report
to Ray Train (every rank's report reaches the driver's callback), so sampling adds no process,
no actor and no call per step; the driver writes them to the run log (``usage.jsonl``) and
TensorBoard, and sums them up per rank in the summary and ``launcher runs NAME``.
Each epoch's report also gives every rank's peak memory (:func:`peak_memory_mb`,
:func:`memory_report`).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil
import pynvml

from launcher.summary import USAGE_FIELDS  # what a sample holds, in order
from launcher.settings import STEP_HOOKS, USAGE_S


def worker_env() -> dict[str, str]:
    """The driver's settings of what workers measure (``LAUNCHER_USAGE_S``, and
    ``LAUNCHER_STEP_HOOKS`` of :mod:`launcher.worker.timing`), passed on to them."""
    return {k: os.environ[k] for k in (USAGE_S, STEP_HOOKS) if k in os.environ}


def interval_s() -> float:
    try:
        return max(0.0, float(USAGE_S.get()))
    except ValueError:
        return float(USAGE_S.default)


class Sampler:
    """This worker's samples since they were last taken (:meth:`take`)."""

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = interval_s() if every_s is None else every_s
        self._process = psutil.Process()
        self._samples: list[list[float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = (time.monotonic(), self._cpu_seconds())
        self._gpu: _Gpu | None = None
        self._gpu_looked = False  # NVML opened, or found to have nothing for this worker
        self._thread: threading.Thread | None = None

    def start(self) -> "Sampler":
        if self.every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="launcher-usage", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> list[list[float]]:
        """The samples taken since the last call (a list of :data:`USAGE_FIELDS` rows)."""
        with self._lock:
            out, self._samples = self._samples, []
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                sample = self.sample()
            except Exception:  # noqa: BLE001 - a process gone between listing and reading: skip once
                continue
            with self._lock:
                self._samples.append(sample)

    def sample(self) -> list[float]:
        now, cpu = time.monotonic(), self._cpu_seconds()
        (then, before), self._last = self._last, (now, cpu)
        pct = 100.0 * max(0.0, cpu - before) / (now - then) if now > then else 0.0
        rss = sum(_quiet(lambda p: p.memory_info().rss, p) for p in self._tree()) / 2**20
        if not self._gpu_looked:
            self._gpu, self._gpu_looked = _Gpu.open()
        gpu_pct, gpu_mb = self._gpu.read() if self._gpu is not None else (0.0, 0.0)
        return [round(time.time(), 2), round(pct, 1), round(rss, 1), round(gpu_pct, 1), round(gpu_mb, 1)]

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self._process, *self._process.children(recursive=True)]
        except psutil.Error:
            return [self._process]

    def _cpu_seconds(self) -> float:
        def used(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system

        return sum(_quiet(used, p) for p in self._tree())


def _quiet(read, process) -> float:
    try:
        return float(read(process))
    except psutil.Error:  # the process ended meanwhile
        return 0.0


class _Gpu:
    """NVML's view of the GPU this worker uses (the first of CUDA_VISIBLE_DEVICES, as Ray sets it)."""

    def __init__(self, nvml, handle) -> None:
        self.nvml, self.handle, self.pid = nvml, handle, os.getpid()

    @classmethod
    def open(cls) -> "tuple[_Gpu | None, bool]":
        """(the GPU, whether to stop looking). Ray gives a GPU worker CUDA_VISIBLE_DEVICES (and a
        CPU worker an empty one); without it, the device torch chose, once torch has set CUDA up."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            cuda = getattr(sys.modules.get("torch"), "cuda", None)
            if cuda is None or not cuda.is_initialized():
                return None, False  # not yet: look again at the next sample
            visible = str(cuda.current_device())
        visible = visible.split(",")[0].strip()
        if not visible or visible in ("-1", "NoDevFiles"):
            return None, True
        try:
            pynvml.nvmlInit()
            handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith("GPU-")
                      else pynvml.nvmlDeviceGetHandleByIndex(int(visible)))
            return cls(pynvml, handle), True
        except Exception:  # noqa: BLE001 - no NVML (no driver, no GPU): CPU figures only
            return None, True

    def read(self) -> tuple[float, float]:
        n = self.nvml
        utilisation = float(n.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        mine = [p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(self.handle)
                if p.pid == self.pid and p.usedGpuMemory is not None]
        used = sum(mine) if mine else n.nvmlDeviceGetMemoryInfo(self.handle).used
        return utilisation, used / 2**20


def peak_memory_mb() -> tuple[float, float]:
    """This process's peak memory so far, in MiB: its resident set (RSS) and, where torch has
    set up CUDA, the GPU memory its tensors took (0 without). torch is read only if already
    imported: a TensorFlow worker never imports it for this."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    gpu = cuda.max_memory_allocated() / 2**20 if cuda is not None and cuda.is_initialized() else 0.0
    return float(rss), float(gpu)


def memory_report(rss: np.ndarray, gpu: np.ndarray) -> dict[str, Any]:
    """An epoch report's memory: each rank's peak RSS (MiB, by rank) and the largest, and the
    same for GPU memory where a rank used any; what a worker killed for memory is told by."""
    out: dict[str, Any] = {"peak_rss_mb_max": round(float(np.max(rss)), 1),
                           "peak_rss_mb_ranks": [round(float(v), 1) for v in rss]}
    if np.any(gpu > 0):
        out.update(peak_gpu_mb_max=round(float(np.max(gpu)), 1), peak_gpu_mb_ranks=[round(float(v), 1) for v in gpu])
    return out
