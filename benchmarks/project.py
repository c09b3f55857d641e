"""Projecting scaling efficiency to GPU counts one does not have: an analytic ring-allreduce model.

Per training step on n GPUs (every symbol is an input; defaults in Model):

* compute ``t_c``: forward + backward + optimizer time of one GPU's batch,
  measured (the unsynchronised step of ``launcher bench scaling``) or published;
* gradient bytes ``G``, split by tensor fusion into ``k = ceil(G / F)``
  buffers of at most F bytes (Horovod's fusion threshold, 128 MiB by default);
* ring allreduce of those buffers over the slowest link ``B`` (bytes/s: the
  node's network bandwidth once the ring spans nodes, ``intra_node_gbps``
  while all n GPUs share one node) with per-message latency ``a``::

      t_comm = 2 (n-1)/n * G / B  +  k * 2 (n-1) * a

  (a ring allreduce is a reduce-scatter plus an all-gather: each of the
  2 (n-1) steps sends 1/n of each buffer and pays one latency);
* overlap: communication starts while the backward pass is still running
  (buffers are reduced as their gradients become ready), so up to
  ``overlap * backward_share * t_c`` of it is hidden::

      t_step = t_c + max(0, t_comm - overlap * backward_share * t_c)
             = max(t_c, (1 - overlap * backward_share) * t_c + t_comm)

* scaling efficiency ``E(n) = t_c / t_step`` (per-GPU throughput at n over
  per-GPU throughput alone, as Horovod reports it).

Not modelled: stragglers and jitter, contention with other traffic, the
hierarchical (two-level) allreduce, gradient compression (fp16 halves G),
and the input pipeline. See benchmarks/README.md for the sanity check.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks import results

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Model:
    fusion_bytes: float = 128 * 1024 * 1024  # Horovod 0.28's default HOROVOD_FUSION_THRESHOLD
    latency_s: float = 30e-6               # per ring step and buffer: TCP/RoCE + software stack
    overlap: float = 0.5                   # share of the backward pass that can hide communication
    backward_share: float = 2 / 3          # backward ~ 2x forward
    gpus_per_node: int = 8
    intra_node_gbps: float = 1200.0         # NVLink-class link inside one node (bits/s / 1e9)


@dataclass(frozen=True)
class Workload:
    name: str
    gradient_bytes: float
    step_time_s: float  # compute per step on one GPU, no communication
    source: str = ""


def comm_time(n: int, gradient_bytes: float, bandwidth_bytes_s: float, model: Model) -> float:
    """Ring allreduce time of G bytes in fusion buffers among n ranks."""
    if n <= 1:
        return 0.0
    buffers = max(1, math.ceil(gradient_bytes / model.fusion_bytes))
    transfer = 2 * (n - 1) / n * gradient_bytes / bandwidth_bytes_s if bandwidth_bytes_s != math.inf else 0.0
    return transfer + buffers * 2 * (n - 1) * model.latency_s


def step_time(n: int, w: Workload, network_gbps: float, model: Model) -> tuple[float, float]:
    """(step time, communication time) on n GPUs with ``network_gbps`` per node."""
    gbps = model.intra_node_gbps if n <= model.gpus_per_node else network_gbps
    comm = comm_time(n, w.gradient_bytes, gbps * GBIT, model)
    hidden = model.overlap * model.backward_share * w.step_time_s
    return w.step_time_s + max(0.0, comm - hidden), comm


def efficiency(n: int, w: Workload, network_gbps: float, model: Model) -> float:
    return w.step_time_s / step_time(n, w, network_gbps, model)[0]


def project(workloads: list[Workload], networks: list[float], gpus: list[int], model: Model) -> list[dict]:
    rows = []
    for w in workloads:
        for net in networks:
            for n in gpus:
                t, comm = step_time(n, w, net, model)
                rows.append({"model": w.name, "network_gbps": net, "gpus": n,
                             "gradient_mb": round(w.gradient_bytes / 1e6, 1),
                             "compute_ms": round(1000 * w.step_time_s, 2), "comm_ms": round(1000 * comm, 2),
                             "step_ms": round(1000 * t, 2), "efficiency": round(w.step_time_s / t, 4)})
    return rows


# -- inputs ---------------------------------------------------------------------------------

def from_scaling_results(path: str) -> list[Workload]:
    """One workload per framework/backend of a ``launcher bench scaling`` JSON: the 1-worker
    unsynchronised step time and the model's gradient bytes."""
    with open(path) as f:
        data = json.load(f)
    found: dict[str, Workload] = {}
    for m in sorted(data.get("measurements", []), key=lambda m: m["workers"]):
        name = f"{data.get('settings', {}).get('workload', 'measured')} {m['framework']}/{m['backend']}"
        if name not in found:
            found[name] = Workload(name, float(m["gradient_bytes"]), float(m["local_step_s"]),
                                   f"measured {data.get('machine', {}).get('date_utc', '')}, {m['workers']} worker(s)")
    if not found:
        raise ValueError(f"{path} holds no scaling measurements (is it a `launcher bench scaling` scaling.json?)")
    return list(found.values())


def from_figures_file(path: str) -> list[Workload]:
    """A YAML or JSON list of {model, gradient_bytes | gradient_mb | params, step_time_s}."""
    import yaml

    with open(path) as f:
        items = yaml.safe_load(f)  # JSON is YAML too
    if isinstance(items, dict):
        items = items.get("models", [items])
    return [figure(item, f"{path} entry {i + 1}") for i, item in enumerate(items)]


def figure(item: dict[str, Any], where: str) -> Workload:
    if "gradient_bytes" in item:
        grad = float(item["gradient_bytes"])
    elif "gradient_mb" in item:
        grad = float(item["gradient_mb"]) * 1e6
    elif "params" in item:
        grad = 4.0 * float(item["params"])  # fp32 gradients
    else:
        raise ValueError(f"{where}: give gradient_bytes, gradient_mb or params")
    if "step_time_s" not in item:
        raise ValueError(f"{where}: give step_time_s (compute per step on one GPU)")
    step = float(item["step_time_s"])
    if grad <= 0 or step <= 0:
        raise ValueError(f"{where}: gradient size and step_time_s must be positive")
    return Workload(str(item.get("model", "model")), grad, step, str(item.get("source", "")))


def format_rows(rows: list[dict], gpus: list[int]) -> str:
    """One line per (model, network): efficiency at each GPU count."""
    lines = [f"{'model':<40} {'Gbit/s':>6} " + " ".join(f"{n:>6}" for n in gpus)]
    for key in dict.fromkeys((r["model"], r["network_gbps"]) for r in rows):
        mine = {r["gpus"]: r for r in rows if (r["model"], r["network_gbps"]) == key}
        lines.append(f"{key[0][:40]:<40} {key[1]:>6g} " + " ".join(f"{100 * mine[n]['efficiency']:>5.1f}%" for n in gpus))
    return "\n".join(lines)


def gpu_axis(ax, counts: list[int]) -> None:
    """An x axis of GPU counts, doubling: log 2, a tick at each count."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")


def write_results(rows: list[dict], workloads: list[Workload], model: Model, info: dict, out_dir: str) -> list[str]:
    fig, ax = results.new_figure(figsize=(8, 4.5))
    for key in dict.fromkeys((r["model"], r["network_gbps"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["network_gbps"]) == key]
        ax.plot([r["gpus"] for r in mine], [r["efficiency"] for r in mine], marker="o",
                label=f"{key[0]}, {key[1]:g} Gbit/s")
    gpu_axis(ax, sorted({r["gpus"] for r in rows}))
    ax.set(ylabel="projected scaling efficiency", ylim=(0, 1.05),
           title="Ring-allreduce projection (tensor fusion, overlap with backward)")
    ax.legend(fontsize=7)
    payload = {"machine": info, "model": asdict(model), "inputs": [asdict(w) for w in workloads],
               "formula": "t_step = t_c + max(0, 2(n-1)/n*G/B + ceil(G/F)*2(n-1)*a - overlap*backward_share*t_c); "
                          "E = t_c/t_step"}
    return results.write(out_dir, "project", rows, payload, fig)
