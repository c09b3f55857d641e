"""Allreduce bandwidth and latency per message size, through the launcher's own comms.

``gloo`` and ``nccl`` are the native backend's torch.distributed process
group as Ray Train's TorchTrainer sets it up (nccl needs GPUs); ``horovod``
is the Horovod backend's in-place ``hvd.allreduce_``. Each worker calls its
comm's ``allreduce_sum_`` on a float32 tensor of each size, in place, as the
training loop reduces gradients.

Each backend is also measured bare, in the same run: the same worker on the
same collective under ``torchrun`` (gloo, nccl) or ``horovodrun`` (horovod),
without Ray (``benchmarks/bare.py``).
The two alternate ``--rounds`` times and each keeps its median per size, so
the table's launcher/bare ratio is the launcher's tax on communication.

Figures follow nccl-tests (PERFORMANCE.md there): for a message of S bytes
taking t seconds, algbw = S / t and busbw = algbw * 2 (n-1) / n, the
bandwidth each link needs for a ring allreduce, comparable across n. The
reference is the memory-copy bandwidth of the driver's machine, measured in
the same run (numpy copy of a 256 MiB buffer: bytes copied / s): on one
machine every rank's traffic goes through memory, so busbw cannot beat it.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Any, Callable

from benchmarks import raywork, results
from launcher.driver import connect

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

def time_sizes(reduce: Callable, sizes: list[int], target_bytes: int, device, world_size: int) -> list[dict]:
    """Seconds per ``reduce(tensor)`` (an in-place sum over ranks) for a float32 tensor of
    each size, averaged over the ranks; every rank calls this together."""
    import torch

    out = []
    for size in sizes:
        tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)  # zeros: sums never overflow
        reps = repeats_for(size, target_bytes)
        for _ in range(2):
            reduce(tensor)
        reduce(torch.zeros(1, device=device))  # line the ranks up before timing
        start = time.perf_counter()
        for _ in range(reps):
            reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append({"bytes": size, "repeats": reps, "time_s": (time.perf_counter() - start) / reps})
    # Ranks finish a collective within one message of each other: report their mean time.
    times = torch.tensor([o["time_s"] for o in out], dtype=torch.float64, device=device)
    reduce(times)
    for o, t in zip(out, (times / world_size).tolist()):
        o["time_s"] = t
    return out


def worker(config: dict[str, Any]) -> None:
    os.environ.update(config.get("env", {}))
    import torch

    torch.set_num_threads(config["threads"])
    comm = raywork.torch_comm(config["backend"])
    comm.setup()
    device = comm.device()
    out = time_sizes(comm.allreduce_sum_, config["sizes"], config.get("target_bytes", TARGET_BYTES), device,
                     comm.world_size)
    raywork.hand_back(comm.rank, {"sizes": out, "world_size": comm.world_size, "device": str(device)})


# -- driver side ---------------------------------------------------------------------------

def _target(name: str) -> tuple[str, float]:
    """Launcher backend and GPUs per worker behind a --backends choice."""
    return ("horovod", 0.0) if name == "horovod" else ("native", 1.0 if name == "nccl" else 0.0)


BARE = {"gloo": "torchrun", "nccl": "torchrun", "horovod": "horovodrun"}  # each backend's bare launcher


def bare_command(name: str, workers: int, threads: int, config: dict) -> list[str]:
    """The command measuring ``name`` bare: this module's worker under torchrun or horovodrun."""
    backend, _ = _target(name)
    return raywork.bare_command(BARE[name], name, workers, "benchmarks.allreduce:worker",
                                {**config, "backend": backend, "threads": threads})


def run(names: list[str], sizes: list[int], workers: int, threads: int, note: Callable[[str], None],
        target_bytes: int = TARGET_BYTES, rounds: int = 1) -> tuple[list[dict], list[dict], float]:
    """(measurements, skipped, copy bandwidth in bytes/s). Each round measures every backend
    through the launcher (one local Ray for the round), then bare, with Ray shut down."""
    from benchmarks import machine

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
    failed: set[tuple[str, str]] = set()

    def record(name: str, variant: str, r: int, out: dict) -> None:
        for s in out["sizes"]:
            measured.append({"backend": name, "variant": variant, "round": r + 1, "workers": workers, **s})

    def failure(name: str, variant: str, exc: Exception, tag: str) -> None:
        reason = raywork.one_line(exc)
        note(f"{tag} {name} via {variant} failed: {reason}")
        if (name, variant) not in failed:
            failed.add((name, variant))
            skipped.append({"backend": name, "variant": variant, "reason": f"failed: {reason}"})

    config = {"sizes": sizes, "target_bytes": target_bytes}
    span = f"{len(sizes)} sizes {human(sizes[0])}..{human(sizes[-1])}"
    for r in range(rounds if todo else 0):
        tag = f"[round {r + 1}/{rounds}]"
        with connect(None, workers=workers, cpus_per_worker=threads):
            for name, backend, gpus in todo:
                note(f"{tag} {name} via the launcher: {workers} workers, {span} ...")
                try:
                    record(name, "launcher", r, raywork.run(backend, "torch", "resnet18-synthetic", workers, threads,
                                                            worker, config, gpus_per_worker=gpus))
                except Exception as exc:
                    failure(name, "launcher", exc, tag)
        for name, _, _ in todo:  # bare, with the launcher's Ray gone
            note(f"{tag} {name} via {BARE[name]} (bare): {workers} processes, {span} ...")
            try:
                record(name, BARE[name], r, raywork.run_bare(bare_command(name, workers, threads, config), threads))
            except Exception as exc:
                failure(name, BARE[name], exc, tag)
    return measured, skipped, copy_bw


def summarize(measured: list[dict], copy_bw: float) -> list[dict]:
    """One row per backend, way of launching and size: the median time over the rounds, and for
    the launcher's rows ``vs_bare``, its bus bandwidth over the bare run's (1.0: no tax)."""
    times: dict[tuple, list[float]] = {}
    for m in measured:
        times.setdefault((m["backend"], m.get("variant", "launcher"), m["workers"], m["bytes"]), []).append(m["time_s"])
    rows = []
    for (backend, variant, n, size), ts in times.items():
        t = statistics.median(ts)
        algbw = size / t
        busbw = algbw * 2 * (n - 1) / n
        rows.append({"backend": backend, "variant": variant, "workers": n, "bytes": size, "size": human(size),
                     "rounds": len(ts), "time_us": round(t * 1e6, 1), "algbw_gb_s": round(algbw / 1e9, 4),
                     "busbw_gb_s": round(busbw / 1e9, 4), "busbw_vs_copy": round(busbw / copy_bw, 4),
                     "latency_us": round(t * 1e6, 1) if size <= LATENCY_MAX_BYTES else None, "vs_bare": None})
    bare = {(r["backend"], r["workers"], r["bytes"]): r for r in rows if r["variant"] != "launcher"}
    for r in rows:
        twin = bare.get((r["backend"], r["workers"], r["bytes"]))
        if r["variant"] == "launcher" and twin:
            r["vs_bare"] = round(twin["time_us"] / r["time_us"], 3)
    return rows


def format_rows(rows: list[dict], skipped: list[dict], copy_bw: float) -> str:
    lines = [f"memory-copy bandwidth (reference): {copy_bw / 1e9:.2f} GB/s",
             f"{'backend':<8} {'workers':>7} {'size':>7} {'launcher us':>12} {'bare us':>10} "
             f"{'busbw GB/s':>11} {'bare busbw':>11} {'busbw/copy':>10} {'launcher/bare':>13}"]
    bare = {(r["backend"], r["workers"], r["bytes"]): r for r in rows if r["variant"] != "launcher"}
    for r in rows:
        if r["variant"] != "launcher":
            continue
        twin = bare.get((r["backend"], r["workers"], r["bytes"]))
        bare_us = f"{twin['time_us']:.1f}" if twin else "-"
        bare_bw = f"{twin['busbw_gb_s']:.3f}" if twin else "-"
        ratio = f"{r['vs_bare']:.2f}" if r["vs_bare"] else "-"
        lines.append(f"{r['backend']:<8} {r['workers']:>7} {r['size']:>7} {r['time_us']:>12.1f} {bare_us:>10} "
                     f"{r['busbw_gb_s']:>11.3f} {bare_bw:>11} {100 * r['busbw_vs_copy']:>9.1f}% {ratio:>13}")
    for name in dict.fromkeys(r["backend"] for r in rows):
        ratios = [r["vs_bare"] for r in rows if r["backend"] == name and r["vs_bare"]]
        if ratios:
            lines.append(f"{name}: launcher/bare bus bandwidth {min(ratios):.2f}-{max(ratios):.2f} "
                         f"(median {statistics.median(ratios):.2f}) against {BARE[name]}")
    small = [r for r in rows if r["latency_us"] is not None]
    for name, variant in dict.fromkeys((r["backend"], r["variant"]) for r in small):
        lat = [r["latency_us"] for r in small if (r["backend"], r["variant"]) == (name, variant)]
        lines.append(f"{name} via {variant}: latency (sizes <= {human(LATENCY_MAX_BYTES)}) "
                     f"{min(lat):.0f}-{max(lat):.0f} us")
    for s in skipped:
        lines.append(f"{s['backend']:<8} {('via ' + s['variant'] + ' ') if s.get('variant') else ''}"
                     f"unavailable: {s['reason']}")
    return "\n".join(lines)


def write_results(rows: list[dict], skipped: list[dict], copy_bw: float, info: dict, out_dir: str) -> list[str]:
    """allreduce.json, allreduce.csv and allreduce.png (busbw and time against size)."""
    fig, (ax_bw, ax_t) = results.new_figure(ncols=2, figsize=(11, 4))
    for name, variant in dict.fromkeys((r["backend"], r["variant"]) for r in rows):
        mine = [r for r in rows if (r["backend"], r["variant"]) == (name, variant)]
        style = "-" if variant == "launcher" else "--"
        label = f"{name} via {variant}"
        ax_bw.plot([r["bytes"] for r in mine], [r["busbw_gb_s"] for r in mine], marker="o", linestyle=style,
                   label=label)
        ax_t.plot([r["bytes"] for r in mine], [r["time_us"] for r in mine], marker="o", linestyle=style, label=label)
    ax_bw.axhline(copy_bw / 1e9, color="red", linestyle="--", label="memory copy")
    ax_bw.set(xscale="log", xlabel="message bytes", ylabel="GB/s", title="allreduce bus bandwidth")
    ax_t.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="time per allreduce (us)",
             title="allreduce time (latency at small sizes)")
    for ax in (ax_bw, ax_t):
        ax.legend()
    payload = {"machine": info, "copy_bandwidth_gb_s": copy_bw / 1e9, "unavailable": skipped,
               "definitions": {"algbw": "bytes / time", "busbw": "algbw * 2(n-1)/n (nccl-tests)",
                               "vs_bare": "launcher busbw / bare busbw (torchrun or horovodrun, same loop)",
                               "copy_bandwidth": "numpy copy of 256 MiB: bytes copied / s (driver's machine)"}}
    return results.write(out_dir, "allreduce", rows, payload, fig)
