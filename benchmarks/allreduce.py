"""Allreduce bandwidth and latency per message size, through the launcher's own comms.

``gloo`` and ``nccl`` are the native backend's torch.distributed process
group as Ray Train's TorchTrainer sets it up (nccl needs GPUs); ``horovod``
is the Horovod backend's ``hvd.allreduce``. Each worker calls its comm's
``allreduce_sum`` on a float32 tensor of each size, so these are the
collectives the training loop uses.

Figures follow nccl-tests (PERFORMANCE.md there): for a message of S bytes
taking t seconds, algbw = S / t and busbw = algbw * 2 (n-1) / n, the
bandwidth each link needs for a ring allreduce, comparable across n. The
reference is the memory-copy bandwidth of the driver's machine, measured in
the same run (numpy copy of a 256 MiB buffer: bytes copied / s): on one
machine every rank's traffic goes through memory, so busbw cannot beat it.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any, Callable

from benchmarks import raywork

UNITS = {"": 1, "B": 1, "KB": 1024, "K": 1024, "MB": 1024 ** 2, "M": 1024 ** 2, "GB": 1024 ** 3, "G": 1024 ** 3}
LATENCY_MAX_BYTES = 64 * 1024  # sizes reported as latency
TARGET_BYTES = 512 * 1024 ** 2  # per size: repeat until about this much has been reduced
COPY_BYTES = 256 * 1024 ** 2
CHOICES = ("gloo", "horovod", "nccl")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"size {text!r} is not a number with an optional unit (B, KB, MB, GB)")
    value = int(float(m.group(1)) * UNITS[m.group(2)])
    if value < 4:
        raise ValueError(f"size {text!r} is below 4 bytes (one float32)")
    return value


def parse_sizes(text: str) -> list[int]:
    """``4KB..256MB`` (powers of two from 4 KiB to 256 MiB) or a list ``4KB,1MB,64MB``."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split("..", 1))
        if hi < lo:
            raise ValueError(f"sizes {text!r}: the upper end is below the lower end")
        sizes = [lo]
        while sizes[-1] * 2 <= hi:
            sizes.append(sizes[-1] * 2)
        return sizes
    return [parse_size(t) for t in text.split(",") if t.strip()]


def human(size: int) -> str:
    for unit, scale in (("GB", 1024 ** 3), ("MB", 1024 ** 2), ("KB", 1024)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes per second of a numpy copy between two large buffers (median of ``repeats``)."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def repeats_for(size: int, target: int = TARGET_BYTES) -> int:
    return max(3, min(200, target // size))


# -- worker side ---------------------------------------------------------------------------

def worker(config: dict[str, Any]) -> None:
    import os

    os.environ.update(config.get("env", {}))
    import torch

    from launcher import backends

    torch.set_num_threads(config["threads"])
    comm = backends.get(config["backend"]).torch_comm()
    comm.setup()
    device = comm.device()
    out = []
    for size in config["sizes"]:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        reps = repeats_for(size, config.get("target_bytes", TARGET_BYTES))
        for _ in range(2):
            comm.allreduce_sum(tensor)
        comm.allreduce_sum(torch.zeros(1, device=device))  # line the ranks up before timing
        start = time.perf_counter()
        for _ in range(reps):
            comm.allreduce_sum(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append({"bytes": size, "repeats": reps, "time_s": (time.perf_counter() - start) / reps})
    # Ranks finish a collective within one message of each other: report their mean time.
    mean = comm.allreduce_sum(torch.tensor([o["time_s"] for o in out], dtype=torch.float64)) / comm.world_size
    for o, t in zip(out, mean.tolist()):
        o["time_s"] = t
    raywork.hand_back(comm.rank, {"sizes": out, "world_size": comm.world_size, "device": str(device)})


# -- driver side ---------------------------------------------------------------------------

def _target(name: str) -> tuple[str, float]:
    """Launcher backend and GPUs per worker behind a --backends choice."""
    return ("horovod", 0.0) if name == "horovod" else ("native", 1.0 if name == "nccl" else 0.0)


def run(names: list[str], sizes: list[int], workers: int, threads: int, note: Callable[[str], None],
        target_bytes: int = TARGET_BYTES) -> tuple[list[dict], list[dict], float]:
    """(measurements, skipped, copy bandwidth in bytes/s)."""
    from benchmarks import machine
    from launcher.driver import connect

    note(f"memory-copy reference: numpy copy of {human(COPY_BYTES)} ...")
    copy_bw = copy_bandwidth()
    note(f"memory copy: {copy_bw / 1e9:.2f} GB/s")
    todo, skipped = [], []
    for name in names:
        backend_name, gpus = _target(name)
        if gpus and not machine.gpus():
            reason = "nccl needs GPUs and this machine has none (nvidia-smi finds no GPU)"
        else:
            backend, reason = raywork.backend_or_reason(backend_name, "torch")
        if reason:
            note(f"{name}: unavailable: {reason}")
            skipped.append({"backend": name, "reason": reason})
        else:
            todo.append((name, backend, gpus))
    measured: list[dict] = []
    if not todo:
        return measured, skipped, copy_bw
    config = {"sizes": sizes, "target_bytes": target_bytes}
    with connect(None, workers=workers, cpus_per_worker=threads):
        for i, (name, backend, gpus) in enumerate(todo, 1):
            note(f"[{i}/{len(todo)}] {name}: {workers} workers, {len(sizes)} sizes "
                 f"{human(sizes[0])}..{human(sizes[-1])} ...")
            try:
                out = raywork.run(backend, "torch", "resnet18-synthetic", workers, threads, worker, config,
                                  gpus_per_worker=gpus)
            except Exception as exc:
                reason = raywork.one_line(exc)
                note(f"[{i}/{len(todo)}] {name} failed: {reason}")
                skipped.append({"backend": name, "reason": f"failed: {reason}"})
                continue
            for s in out["sizes"]:
                measured.append({"backend": name, "workers": workers, **s})
            note(f"[{i}/{len(todo)}] {name} done")
    return measured, skipped, copy_bw


def summarize(measured: list[dict], copy_bw: float) -> list[dict]:
    rows = []
    for m in measured:
        n, algbw = m["workers"], m["bytes"] / m["time_s"]
        busbw = algbw * 2 * (n - 1) / n
        rows.append({"backend": m["backend"], "workers": n, "bytes": m["bytes"], "size": human(m["bytes"]),
                     "time_us": round(m["time_s"] * 1e6, 1), "algbw_gb_s": round(algbw / 1e9, 4),
                     "busbw_gb_s": round(busbw / 1e9, 4), "busbw_vs_copy": round(busbw / copy_bw, 4),
                     "latency_us": round(m["time_s"] * 1e6, 1) if m["bytes"] <= LATENCY_MAX_BYTES else None})
    return rows


def format_rows(rows: list[dict], skipped: list[dict], copy_bw: float) -> str:
    lines = [f"memory-copy bandwidth (reference): {copy_bw / 1e9:.2f} GB/s",
             f"{'backend':<8} {'workers':>7} {'size':>7} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} "
             f"{'busbw/copy':>10}"]
    for r in rows:
        lines.append(f"{r['backend']:<8} {r['workers']:>7} {r['size']:>7} {r['time_us']:>10.1f} "
                     f"{r['algbw_gb_s']:>11.3f} {r['busbw_gb_s']:>11.3f} {100 * r['busbw_vs_copy']:>9.1f}%")
    small = [r for r in rows if r["latency_us"] is not None]
    for name in dict.fromkeys(r["backend"] for r in small):
        lat = [r["latency_us"] for r in small if r["backend"] == name]
        lines.append(f"{name}: latency (sizes <= {human(LATENCY_MAX_BYTES)}) {min(lat):.0f}-{max(lat):.0f} us")
    for s in skipped:
        lines.append(f"{s['backend']:<8} unavailable: {s['reason']}")
    return "\n".join(lines)


def write_results(rows: list[dict], skipped: list[dict], copy_bw: float, info: dict, out_dir: str) -> list[str]:
    """allreduce.json, allreduce.csv and allreduce.png (busbw and time against size)."""
    from benchmarks import results

    fig, (ax_bw, ax_t) = results.new_figure(ncols=2, figsize=(11, 4))
    for name in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == name]
        ax_bw.plot([r["bytes"] for r in mine], [r["busbw_gb_s"] for r in mine], marker="o", label=f"{name} busbw")
        ax_t.plot([r["bytes"] for r in mine], [r["time_us"] for r in mine], marker="o", label=name)
    ax_bw.axhline(copy_bw / 1e9, color="red", linestyle="--", label="memory copy")
    ax_bw.set(xscale="log", xlabel="message bytes", ylabel="GB/s", title="allreduce bus bandwidth")
    ax_t.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="time per allreduce (us)",
             title="allreduce time (latency at small sizes)")
    for ax in (ax_bw, ax_t):
        ax.legend()
    fig.suptitle(f"{info['cpu_model']} ({info['cpu_cores']} cores), {info['date_utc']}", fontsize=8)
    payload = {"machine": info, "copy_bandwidth_gb_s": copy_bw / 1e9, "unavailable": skipped,
               "definitions": {"algbw": "bytes / time", "busbw": "algbw * 2(n-1)/n (nccl-tests)",
                               "copy_bandwidth": "numpy copy of 256 MiB: bytes copied / s (driver's machine)"}}
    return results.write(out_dir, "allreduce", rows, payload, fig)
