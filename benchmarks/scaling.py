"""Scaling efficiency: synthetic-image training throughput against the number of workers.

In the manner of Horovod's synthetic benchmarks: each worker trains the
workload's model on one fixed random batch (no input pipeline), ``warmup``
steps first, then ``iters`` iterations of ``batches_per_iter`` steps, each
iteration timed. Per iteration the total images/s is the sum over workers;
the table shows its mean +- 1.96 standard deviations over iterations.

Definitions (also in benchmarks/README.md):

* scaling efficiency ``E(n) = T(n) / (n * T(1))`` with T the total images/s
  of the same framework and backend;
* communication share ``1 - t_local / t_sync``: ``t_sync`` is the mean step
  time of the distributed step (the backend's wrapped model/optimizer or
  train step, gradients synchronised), ``t_local`` the mean step time of the
  same model, batch and optimizer on the same worker, while the other workers
  do the same, with no synchronisation at all (a plain local optimizer
  step). So it is the share of a synchronised step that synchronisation adds,
  whether as transfer time or as waiting for the slowest worker.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from benchmarks import raywork, results
from launcher.driver import connect

LOCAL_ITERS_MAX = 5  # the reference (unsynchronised) step needs fewer iterations for a stable mean


SYNTHETIC = ("resnet18-synthetic", "resnet50-synthetic")


@dataclass(frozen=True)
class Settings:
    workload: str = "resnet50-synthetic"  # or any workload, yours included (FILE.py:NAME)
    image_size: int = 64
    batch_size: int = 32
    warmup: int = 10
    iters: int = 10
    batches_per_iter: int = 10
    threads: int = 1  # per worker (torch threads, TF intra-op threads, OMP_NUM_THREADS)
    num_classes: int = 1000
    params: dict[str, Any] = field(default_factory=dict)

    def worker_config(self) -> dict[str, Any]:
        params = dict(self.params)
        if self.workload in SYNTHETIC:  # another workload (yours: FILE.py:NAME) keeps its own params
            params = {"image_size": self.image_size, "num_classes": self.num_classes,
                      "num_samples": self.batch_size, "test_samples": 1, **params}
        return {"workload": self.workload, "params": params, "batch_size": self.batch_size,
                "warmup": self.warmup, "iters": self.iters, "batches_per_iter": self.batches_per_iter}


# -- worker side ---------------------------------------------------------------------------

def _time_iters(step: Callable[[], None], warmup: int, iters: int, per_iter: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(per_iter):
            step()
        times.append(time.perf_counter() - start)
    return times


def _result(config: dict, sync_times: list[float], local_times: list[float], summed, world: int,
            grad_bytes: int) -> dict[str, Any]:
    """Every rank's numbers summed (``summed`` is the comm's allreduce), as rank 0 returns them."""
    images = config["batch_size"] * config["batches_per_iter"]
    sync_step = statistics.mean(sync_times) / config["batches_per_iter"]
    local_step = statistics.mean(local_times) / config["batches_per_iter"]
    totals = summed([images / t for t in sync_times] + [sync_step, local_step])
    n = len(sync_times)
    return {"rates": totals[:n], "sync_step_s": totals[n] / world, "local_step_s": totals[n + 1] / world,
            "rank0_rates": [images / t for t in sync_times], "gradient_bytes": grad_bytes, "world_size": world}


def torch_worker(config: dict[str, Any]) -> None:
    os.environ.update(config.get("env", {}))
    import torch
    import torch.nn.functional as F

    import workloads

    torch.set_num_threads(config["threads"])
    comm = raywork.torch_comm(config["backend"])
    comm.setup()
    workload = workloads.get(config["workload"])
    device = comm.device()
    params, bs = config["params"], config["batch_size"]

    def build():
        torch.manual_seed(0)
        module = workload.torch_model(params).to(device)
        return module, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)

    module, base_optimizer = build()
    model = comm.wrap_model(module)
    optimizer = comm.wrap_optimizer(base_optimizer, model)
    if hasattr(comm, "after_restore"):  # e.g. Horovod broadcasts rank 0's weights here
        comm.after_restore(model, optimizer)
    local_model, local_optimizer = build()  # a separate copy: no DDP/Horovod hooks on its parameters
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(bs, *workload.input_shape(params), generator=gen).to(device)
    y = torch.randint(0, workload.num_classes(params), (bs,), generator=gen).to(device)

    def stepper(m, opt):
        def step():
            opt.zero_grad()  # Horovod's optimizer takes no set_to_none; torch defaults to it
            F.cross_entropy(m(x), y).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        return step

    w, it, per = config["warmup"], config["iters"], config["batches_per_iter"]
    sync_times = _time_iters(stepper(model, optimizer), w, it, per)
    local_times = _time_iters(stepper(local_model, local_optimizer), min(w, 2), min(it, LOCAL_ITERS_MAX), per)

    def summed(values):
        return comm.allreduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()

    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    out = _result(config, sync_times, local_times, summed, comm.world_size, grad_bytes)
    raywork.hand_back(comm.rank, {**out, "device": str(device), "threads": torch.get_num_threads()})


def tf_worker(config: dict[str, Any]) -> None:
    os.environ.update(config.get("env", {}))
    from launcher.worker import configure_tensorflow

    configure_tensorflow(config["threads"])
    import numpy as np
    import tensorflow as tf

    import workloads
    from launcher import backends
    from workloads.tf_models import keras

    comm = backends.get(config["backend"]).tf_comm()
    comm.setup()
    workload = workloads.get(config["workload"])
    params, bs = config["params"], config["batch_size"]
    k = keras()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

    def build():
        k.utils.set_random_seed(0)
        model = workload.tf_model(params)
        optimizer = k.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        optimizer.build(model.trainable_variables)
        return model, optimizer

    with comm.scope():
        model, optimizer = build()
    comm.after_restore(model, optimizer)
    sync_step = comm.train_step(model, optimizer, loss)
    local_model, local_optimizer = build()  # outside the strategy: a plain local step

    @tf.function
    def local_step(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(loss(y, local_model(x, training=True)))
        grads = tape.gradient(value, local_model.trainable_variables)
        local_optimizer.apply_gradients(zip(grads, local_model.trainable_variables))
        return value

    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((bs, *workload.input_shape(params)), dtype=np.float32)
    y = rng.integers(0, workload.num_classes(params), bs, dtype=np.int64)
    w, it, per = config["warmup"], config["iters"], config["batches_per_iter"]
    # float() waits for the step's result, so each timed step is complete.
    sync_times = _time_iters(lambda: float(sync_step(x, y)), w, it, per)
    local_times = _time_iters(lambda: float(local_step(x, y)), min(w, 2), min(it, LOCAL_ITERS_MAX), per)

    def summed(values):
        return [float(v) for v in comm.allreduce_sum(np.array(values, dtype=np.float64))]

    grad_bytes = int(sum(int(np.prod(v.shape)) * v.dtype.size for v in model.trainable_variables))
    out = _result(config, sync_times, local_times, summed, comm.world_size, grad_bytes)
    raywork.hand_back(comm.rank, {**out, "device": "cpu", "threads": config["threads"]})


WORKERS = {"torch": torch_worker, "tensorflow": tf_worker}


# -- driver side ---------------------------------------------------------------------------

def run(settings: Settings, frameworks: list[str], backend_names: list[str], worker_counts: list[int],
        note: Callable[[str], None], bare: bool = True) -> tuple[list[dict], list[dict]]:
    """Measure every available (framework, backend, workers) through the launcher and, right
    after each torch one (``bare``), the same worker under torchrun or horovodrun, so drift in
    the machine's state hits both alike; returns (measurements, skipped).

    Each launcher measurement gets its own local Ray, shut down before the bare twin runs:
    an idle Ray beside the bare run would take CPU from it and flatter the launcher."""
    combos, skipped = [], []
    for fw in frameworks:
        for name in backend_names:
            backend, reason = raywork.backend_or_reason(name, fw)
            if backend is None:
                note(f"{fw}/{name}: unavailable: {reason}")
                skipped.append({"framework": fw, "backend": name, "reason": reason})
            else:
                combos.extend((fw, backend, n) for n in worker_counts)
    measured: list[dict] = []
    for i, combo in enumerate(combos, 1):
        m = _run_launcher(settings, combo, f"[{i}/{len(combos)}]", skipped, note)
        if m:
            measured.append(m)
        if bare and combo[0] == "torch":
            m = _run_bare(settings, combo, f"[{i}/{len(combos)} bare]", skipped, note)
            if m:
                measured.append(m)
    return measured, skipped


def _run_launcher(settings: Settings, combo: tuple, tag: str, skipped: list[dict],
                  note: Callable[[str], None]) -> dict | None:
    fw, backend, n = combo
    note(f"{tag} {fw}/{backend.name}, {n} worker(s): {settings.workload}, batch {settings.batch_size}, "
         f"{settings.warmup} warm-up + {settings.iters}x{settings.batches_per_iter} steps ...")
    start = time.perf_counter()
    try:
        with connect(None, workers=n, cpus_per_worker=settings.threads, workload=settings.workload):
            out = raywork.run(backend, fw, settings.workload, n, settings.threads, WORKERS[fw],
                              settings.worker_config())
    except Exception as exc:  # one failed combination must not lose the others
        reason = raywork.one_line(exc)
        note(f"{tag} {fw}/{backend.name}, {n} worker(s) failed: {reason}")
        skipped.append({"framework": fw, "backend": backend.name, "workers": n, "reason": f"failed: {reason}"})
        return None
    m = {"framework": fw, "backend": backend.name, "variant": "launcher", "workers": n, **out,
         "wall_s": time.perf_counter() - start}
    note(f"{tag} {statistics.mean(out['rates']):,.1f} images/s ({m['wall_s']:.0f}s)"
         + (f"; note: {out['note']}" if out.get("note") else ""))
    return m


BARE = {"native": ("torchrun", "gloo"), "horovod": ("horovodrun", "horovod")}


def _run_bare(settings: Settings, combo: tuple, tag: str, skipped: list[dict],
              note: Callable[[str], None]) -> dict | None:
    """The same worker and config under torchrun (native: DDP over gloo) or horovodrun
    (horovod), without Ray (benchmarks/bare.py)."""
    fw, backend, n = combo
    launcher, comm = BARE[backend.name]
    note(f"{tag} {fw}/{backend.name}, {n} worker(s) under {launcher} ...")
    config = {**settings.worker_config(), "backend": backend.name, "threads": settings.threads}
    start = time.perf_counter()
    try:
        out = raywork.run_bare(raywork.bare_command(launcher, comm, n, "benchmarks.scaling:torch_worker", config),
                               settings.threads)
    except Exception as exc:
        reason = raywork.one_line(exc)
        note(f"{tag} failed: {reason}")
        skipped.append({"framework": fw, "backend": backend.name, "workers": n, "variant": launcher,
                        "reason": f"failed: {reason}"})
        return None
    note(f"{tag} {statistics.mean(out['rates']):,.1f} images/s")
    return {"framework": fw, "backend": backend.name, "variant": launcher, "workers": n, **out,
            "wall_s": time.perf_counter() - start}


def summarize(measured: list[dict]) -> list[dict]:
    """One row per measurement; ``vs_bare``: the launcher's images/s over the same worker's
    under torchrun/horovodrun (1.0: no tax)."""
    rows = []

    def key(m: dict) -> tuple:
        return m["framework"], m["backend"], m.get("variant", "launcher")

    for m in measured:
        rates = m["rates"]
        mean = statistics.mean(rates)
        ci = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
        one = next((o for o in measured if key(o) == key(m) and o["workers"] == 1), None)
        t1 = statistics.mean(one["rates"]) if one else None
        share = max(0.0, 1.0 - m["local_step_s"] / m["sync_step_s"]) if m["workers"] > 1 else 0.0
        rows.append({
            "framework": m["framework"], "backend": m["backend"], "variant": m.get("variant", "launcher"),
            "workers": m["workers"],
            "images_per_s": round(mean, 2), "ci95": round(ci, 2), "per_worker": round(mean / m["workers"], 2),
            "efficiency": round(mean / (m["workers"] * t1), 4) if t1 else None,
            "comm_share": round(share, 4), "sync_step_ms": round(1000 * m["sync_step_s"], 2),
            "local_step_ms": round(1000 * m["local_step_s"], 2), "gradient_mb": round(m["gradient_bytes"] / 1e6, 2),
            "vs_bare": None,
        })
    bare = {(r["framework"], r["backend"], r["workers"]): r for r in rows if r["variant"] != "launcher"}
    for r in rows:
        twin = bare.get((r["framework"], r["backend"], r["workers"]))
        if r["variant"] == "launcher" and twin and twin["images_per_s"]:
            r["vs_bare"] = round(r["images_per_s"] / twin["images_per_s"], 3)
    return rows


def format_rows(rows: list[dict], skipped: list[dict]) -> str:
    lines = [f"{'framework':<11} {'backend':<8} {'via':<10} {'workers':>7} {'images/s (+-1.96sd)':>21} "
             f"{'per worker':>10} {'efficiency':>10} {'comm share':>10} {'step ms':>8} {'local ms':>8} "
             f"{'launcher/bare':>13}"]
    for r in rows:
        eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
        ratio = f"{r['vs_bare']:.2f}" if r.get("vs_bare") else "-"
        lines.append(f"{r['framework']:<11} {r['backend']:<8} {r['variant']:<10} {r['workers']:>7} "
                     f"{r['images_per_s']:>11.1f} +- {r['ci95']:<6.1f} {r['per_worker']:>10.1f} {eff:>10} "
                     f"{100 * r['comm_share']:>9.1f}% {r['sync_step_ms']:>8.1f} {r['local_step_ms']:>8.1f} "
                     f"{ratio:>13}")
    for s in skipped:
        where = f", {s['workers']} worker(s)" if "workers" in s else ""
        via = f" via {s['variant']}" if s.get("variant") else ""
        lines.append(f"{s['framework']:<11} {s['backend']:<8} {'':>7} unavailable{via}{where}: {s['reason']}")
    return "\n".join(lines)


def write_results(rows: list[dict], measured: list[dict], skipped: list[dict], info: dict, settings: Settings,
                  out_dir: str) -> list[str]:
    """scaling.json, scaling.csv and scaling.png (images/s and efficiency against workers)."""
    fig, (ax_t, ax_e) = results.new_figure(ncols=2, figsize=(11, 4))
    for key in dict.fromkeys((r["framework"], r["backend"], r["variant"]) for r in rows):
        mine = sorted((r for r in rows if (r["framework"], r["backend"], r["variant"]) == key),
                      key=lambda r: r["workers"])
        label = f"{key[0]}/{key[1]}" + ("" if key[2] == "launcher" else f" via {key[2]}")
        xs = [r["workers"] for r in mine]
        style = "-" if key[2] == "launcher" else "--"
        ax_t.errorbar(xs, [r["images_per_s"] for r in mine], yerr=[r["ci95"] for r in mine], marker="o",
                      capsize=4, label=label, linestyle=style)
        eff = [(r["workers"], r["efficiency"]) for r in mine if r["efficiency"] is not None]
        if eff:
            ax_e.plot(*zip(*eff), marker="o", label=label, linestyle=style)
    all_workers = sorted({r["workers"] for r in rows}) or [1]
    ax_t.set(xlabel="workers", ylabel="images/s (total)", title=f"{settings.workload}, batch {settings.batch_size}/worker")
    ax_e.set(xlabel="workers", ylabel="scaling efficiency T(n)/(n T(1))", title="scaling efficiency", ylim=(0, 1.1))
    ax_e.axhline(1.0, color="grey", linestyle=":")
    for ax in (ax_t, ax_e):
        ax.set_xticks(all_workers)
        if rows:
            ax.legend()
    payload = {"machine": info, "settings": asdict(settings), "measurements": measured, "unavailable": skipped,
               "definitions": {
                   "images_per_s": "sum over workers of batch*batches_per_iter/iteration time; mean over iterations",
                   "ci95": "1.96 * standard deviation over iterations",
                   "efficiency": "T(n) / (n * T(1)), same framework, backend and way of launching",
                   "vs_bare": "launcher images/s / images/s of the same worker under torchrun or horovodrun",
                   "comm_share": "1 - t_local/t_sync: t_sync = mean synchronised step, t_local = mean step of an "
                                 "identical unsynchronised model/optimizer on the same worker"}}
    return results.write(out_dir, "scaling", rows, payload, fig)
