"""Scaling of a training function (or any workload's managed loop), against its bare twin.

A training function owns its loop, so it cannot be timed step by step from outside the
way ``benchmarks/scaling.py`` times a model on a fixed batch. Here each measurement is a
whole run: ``launcher run --json`` for ``epochs`` epochs, and right after it the same
function under torchrun (or horovodrun) through ``benchmarks/torchrun_session.py``, the
same session less Ray and checkpoints. Both count throughput alike: all epochs' samples
over their training time (evaluation and start-up excluded). Pairs alternate, so drift in
the machine hits both; ``vs_bare`` is the median over the repeats of launcher/bare.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from typing import Callable

from benchmarks import results
from benchmarks.overhead import Job, _command
from benchmarks.raywork import failure_reason, last_json

BARE = {"native": "torchrun", "horovod": "horovodrun"}


def run(job: Job, backends: list[str], worker_counts: list[int], repeats: int, threads: int,
        note: Callable[[str], None]) -> list[dict]:
    """Every (backend, workers) pair ``repeats`` times, launcher then bare; one dict per run."""
    measured = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory(prefix="launcher-fscaling-") as tmp:
        for backend in backends:
            for n in worker_counts:
                for i in range(repeats):
                    for variant in ("launcher-cold", BARE[backend]):
                        cmd = _command(variant, n, os.path.join(tmp, "runs"), len(measured), job)
                        if variant == "launcher-cold":
                            cmd += ["--backend", backend, "--cpus-per-worker", str(threads)]
                        start = time.perf_counter()
                        res = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                        wall = time.perf_counter() - start
                        m = {"backend": backend, "workers": n, "repeat": i, "wall_s": round(wall, 2),
                             "variant": "launcher" if variant.startswith("launcher") else variant}
                        if res.returncode != 0:
                            m["failed"] = failure_reason(res.stderr, res.returncode, 200)
                            note(f"{backend}, {n} worker(s), {m['variant']}: FAILED: {m['failed']}")
                        else:
                            m["samples_per_s"] = float(last_json(res.stdout).get("samples_per_s") or 0.0)
                            note(f"{backend}, {n} worker(s), repeat {i + 1}/{repeats}, {m['variant']:<10} "
                                 f"{m['samples_per_s']:,.1f} samples/s (wall {wall:.1f}s)")
                        measured.append(m)
    return measured


def summarize(measured: list[dict]) -> list[dict]:
    """Per (backend, variant, workers): median samples/s, efficiency against 1 worker, and for the
    launcher the median launcher/bare ratio of its pairs."""
    ok = [m for m in measured if "samples_per_s" in m]
    rows = []
    for key in dict.fromkeys((m["backend"], m["variant"], m["workers"]) for m in ok):
        rates = [m["samples_per_s"] for m in ok if (m["backend"], m["variant"], m["workers"]) == key]
        rows.append({"backend": key[0], "variant": key[1], "workers": key[2], "repeats": len(rates),
                     "samples_per_s": round(statistics.median(rates), 2),
                     "min": round(min(rates), 2), "max": round(max(rates), 2)})
    for r in rows:
        one = next((o for o in rows if (o["backend"], o["variant"], o["workers"]) == (r["backend"], r["variant"], 1)),
                   None)
        r["efficiency"] = round(r["samples_per_s"] / (r["workers"] * one["samples_per_s"]), 4) if one else None
        r["vs_bare"] = None
        if r["variant"] == "launcher":
            pairs = [(m, b) for m in ok for b in ok if m["variant"] == "launcher" and b["variant"] != "launcher"
                     and (m["backend"], m["workers"], m["repeat"]) == (r["backend"], r["workers"], b["repeat"])
                     and b["backend"] == r["backend"] and b["workers"] == r["workers"]]
            ratios = [m["samples_per_s"] / b["samples_per_s"] for m, b in pairs if b["samples_per_s"]]
            r["vs_bare"] = round(statistics.median(ratios), 3) if ratios else None
    return rows


def format_rows(rows: list[dict]) -> str:
    via = max([10] + [len(r["variant"]) for r in rows])
    lines = [f"{'backend':<8} {'via':<{via}} {'workers':>7} {'samples/s (median, min-max)':>30} {'efficiency':>10} "
             f"{'launcher/bare':>13}"]
    for r in rows:
        eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
        ratio = f"{r['vs_bare']:.3f}" if r.get("vs_bare") else "-"
        span = f"{r['samples_per_s']:,.1f} ({r['min']:,.1f}-{r['max']:,.1f})"
        lines.append(f"{r['backend']:<8} {r['variant']:<{via}} {r['workers']:>7} {span:>30} {eff:>10} {ratio:>13}")
    return "\n".join(lines)


def write_results(rows: list[dict], measured: list[dict], info: dict, job: Job, out_dir: str) -> list[str]:
    """function-scaling.json, .csv and .png (samples/s against workers, launcher and bare)."""
    fig = plot(rows, "samples/s (median)", os.path.basename(job.workload), "bare")
    payload = {"machine": info, "job": asdict(job), "measurements": measured,
               "definitions": {"samples_per_s": "all epochs' samples over their training time, as the run reports",
                               "vs_bare": "median over repeats of launcher/bare, each pair run back to back"}}
    return results.write(out_dir, "function-scaling", rows, payload, fig)


def plot(rows: list[dict], ylabel: str, title: str, bare: str):
    """Throughput against workers per (backend, variant), and the launcher's ratio to its ``bare`` twin."""
    fig, (ax_t, ax_r) = results.new_figure(ncols=2, figsize=(11, 4))
    for key in dict.fromkeys((r["backend"], r["variant"]) for r in rows):
        mine = sorted((r for r in rows if (r["backend"], r["variant"]) == key), key=lambda r: r["workers"])
        ax_t.plot([r["workers"] for r in mine], [r["samples_per_s"] for r in mine], marker="o",
                  linestyle="-" if key[1] == "launcher" else "--", label=f"{key[0]} via {key[1]}")
        if key[1] == "launcher":
            ax_r.plot([r["workers"] for r in mine], [r["vs_bare"] or 0 for r in mine], marker="o", label=key[0])
    ax_t.set(xlabel="workers", ylabel=ylabel, title=title)
    ax_r.set(xlabel="workers", ylabel=f"launcher / {bare}", title="launcher tax (1.0: none)", ylim=(0.5, 1.2))
    ax_r.axhline(1.0, color="grey", linestyle=":")
    for ax in (ax_t, ax_r):
        ax.set_xticks(sorted({r["workers"] for r in rows}) or [1])
        if rows:
            ax.legend()
    return fig
